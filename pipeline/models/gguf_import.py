"""A llama, qwen2 or gemma3 GGUF file -> an mlx-lm directory (config.json, model.safetensors, tokenizer files).

llama.cpp's own ``gguf`` package parses and validates the file and dequantizes every ggml type.
``mx.load`` reads F32/F16/Q4_0/Q4_1/Q8_0 natively, the quantized ones straight into MLX's affine
layout (lossless, and they stay quantized on Metal), so files made only of those go through it.
What stays here is the architecture mapping: mlx-lm config, tensor names, the Q/K row order (llama
only), Gemma's norm offset, and the Hugging Face tokenizer files (GPT-2 byte-level BPE, or SentencePiece
BPE rebuilt from the vocab and scores).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

# Types mx.load reads exactly. It also accepts some others, but as float16 and not always
# correctly (its Q4_K disagrees with llama.cpp's reference), and it fails on the rest.
_MX_NATIVE = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}
_KEEP_DTYPE = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
# GGUF architecture -> (mlx-lm model_type, HF class, whether llama.cpp permuted the Q/K rows for its rope).
# qwen2 and gemma3 use NeoX rope in llama.cpp, so their rows are stored in Hugging Face order.
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
}


class GGUFError(ValueError):
    """The file is not a readable GGUF model of a supported kind."""


class _Reader(gguf.GGUFReader):
    # The reader slices a memmap: past the end a read is silently short, and a corrupt array
    # length would then loop without advancing. Make every read past the end an error.
    def _get(self, offset, dtype, count=1, override_order=None):
        if offset + np.dtype(dtype).itemsize * int(count) > len(self.data):
            raise EOFError("unexpected end of file (truncated download?)")
        return super()._get(offset, dtype, count, override_order)


def read(path: str | Path) -> gguf.GGUFReader:
    """Parse and validate a GGUF file (header, metadata, every tensor inside the file)."""
    path = Path(path)
    try:
        return _Reader(path)
    except EOFError as e:
        raise GGUFError(f"{path} is not a valid GGUF file: {e}") from None
    except Exception as e:  # the reader raises ValueError/KeyError/IndexError with terse messages
        raise GGUFError(f"{path} is not a valid GGUF file: {type(e).__name__}: {e}") from None


def convert(src: str | Path, out: str | Path) -> None:
    """Write the mlx-lm files for the GGUF model ``src`` into the existing directory ``out``.

    Raises GGUFError, naming the file and the field, for anything it cannot read or map.
    """
    src, out = Path(src), Path(out)
    reader = read(src)  # validates the whole layout first: mx.load segfaults on a truncated file
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise GGUFError(f"{src}: GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})")
    weights = _tensors(reader, src)
    config = _config(meta, weights, src, arch)
    if arch == "gemma3":
        weights = unshift_norms(weights)
    weights = _rename(weights, config, src, permute=_ARCHS[arch][2], names=_NAMES_BY_ARCH.get(arch, _LAYER_NAMES))
    quant = {p[: -len(".scales")]: w for p, w in weights.items() if p.endswith(".scales")}
    if quant:
        # GGUF's Q4_0/Q4_1/Q8_0 blocks are 32 wide; bits follow from packed width / scale count.
        bits = {p: weights[p + ".weight"].shape[-1] // s.shape[-1] for p, s in quant.items()}
        config["quantization"] = {"group_size": 32, "bits": Counter(bits.values()).most_common(1)[0][0]}
        config["quantization"].update({p: {"group_size": 32, "bits": b} for p, b in bits.items()})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    _write_tokenizer(meta, out, src, arch)


def _tensors(reader: gguf.GGUFReader, src: Path) -> dict[str, mx.array]:
    if all(t.tensor_type.name in _MX_NATIVE for t in reader.tensors):
        try:
            return mx.load(str(src))
        except Exception as e:  # mlx raises RuntimeError/ValueError with terse messages
            raise GGUFError(f"could not read GGUF file {src}: {e}") from e
    # Anything else is dequantized by llama.cpp's reference code; quantized types become float16,
    # as mx.load would make them, and plain float types keep their dtype.
    out = {}
    for t in reader.tensors:
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(f"{src}: tensor {t.name!r} has unsupported ggml type {t.tensor_type.name}") from e
        out[t.name] = mx.array(values).astype(_KEEP_DTYPE.get(t.tensor_type.name, mx.float16))
    return out


def _need(meta: dict, key: str, src: Path) -> Any:
    if key not in meta:
        raise GGUFError(f"{src}: GGUF metadata field {key!r} is missing")
    return meta[key]


def _config(meta: dict, weights: dict, src: Path, arch: str) -> dict:
    need = lambda key: _need(meta, f"{arch}.{key}", src)  # noqa: E731
    get = lambda key, default: meta.get(f"{arch}.{key}", default)  # noqa: E731
    n_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    model_type, architecture, _ = _ARCHS[arch]
    config = {
        "model_type": model_type,
        "architectures": [architecture],
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(get("vocab_size", len(_need(meta, "tokenizer.ggml.tokens", src)))),
        "tie_word_embeddings": "output.weight" not in weights,
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": stop_tokens(meta),
    }
    if arch == "gemma3":
        config.update(_gemma3_config(meta, config, src))
    scaling = get("rope.scaling.type", None)
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise GGUFError(f"{src}: GGUF rope scaling {scaling!r} is not supported")
    return config


def _gemma3_config(meta: dict, config: dict, src: Path) -> dict:
    """mlx-lm gemma3_text keys the GGUF lacks take the values llama.cpp hard-codes for gemma3."""
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B (62 layers): 1/sqrt(hidden / heads).
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)  # absent in older files: llama.cpp's 6
    if isinstance(pattern, list):  # per layer, True = sliding; mlx-lm knows only "every n-th layer is global"
        n = pattern.index(False) + 1 if False in pattern else 0
        if not n or any(bool(s) != ((i + 1) % n != 0) for i, s in enumerate(pattern)):
            raise GGUFError(f"{src}: GGUF sliding-window layer pattern {pattern} is not periodic; not supported")
        pattern = n
    return {
        "sliding_window": int(_need(meta, "gemma3.attention.sliding_window", src)),
        "sliding_window_pattern": int(pattern),  # 6: five local layers, then one global
        "rope_local_base_freq": 10000.0,  # the GGUF stores only the global layers' base
        "query_pre_attn_scalar": hidden // heads if layers == 62 else config["head_dim"],
    }


def stop_tokens(meta: dict) -> int | list[int]:
    """The ids that end a generation: eos, end-of-turn and end-of-message, and the GPT-2 family's
    document end ``<|endoftext|>`` when it is a control token (instruct models may emit it after a turn)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    ids = [int(meta.get("tokenizer.ggml.eos_token_id", 2))]
    ids += [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eot", "eom") if f"tokenizer.ggml.{k}_token_id" in meta]
    for key in ("padding", "bos"):  # where GGUFs keep <|endoftext|> when it is not the eos
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and int(i) < len(tokens) and tokens[int(i)] == "<|endoftext|>" and types[int(i)] == 3:
            ids.append(int(i))
    ids = list(dict.fromkeys(ids))
    return ids[0] if len(ids) == 1 else ids


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Gemma 3 has four norms a layer; llama.cpp's ffn_norm is the pre-feed-forward one there.
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_NAMES_BY_ARCH = {"gemma3": _GEMMA3_NAMES}


def unshift_norms(weights: dict) -> dict:
    """llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight); mlx-lm's
    Gemma RMSNorm adds the 1 itself, so take it off again."""
    return {k: (w - 1 if k.endswith("norm.weight") else w) for k, w in weights.items()}


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row order so mlx-lm's (non-traditional) rope sees Hugging Face order."""
    # llama.cpp turns each head's half-split rope rows into interleaved pairs (row 2i+j <- row j*d/2+i).
    # Quantization groups run along the input dim, so packed weights, scales and biases permute alike.
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rename(weights: dict, config: dict, src: Path, permute: bool, names: dict = _LAYER_NAMES) -> dict:
    out = {}
    for name, w in weights.items():
        base, _, suffix = name.rpartition(".")  # suffix: weight | bias | scales | biases
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in names:
            new = f"model.layers.{parts[1]}.{names[parts[2]]}"
            if permute and parts[2] in ("attn_q", "attn_k"):
                heads = config["num_attention_heads" if parts[2] == "attn_q" else "num_key_value_heads"]
                w = unpermute_rows(w, heads)
        elif base in _TOP_NAMES:
            new = _TOP_NAMES[base]
        elif base == "rope_freqs":  # precomputed llama3 rope factors: mlx-lm derives its own
            continue
        else:
            raise GGUFError(f"{src}: unexpected GGUF tensor {name!r}")
        out[f"{new}.{suffix}"] = w
    return out


# llama.cpp's "qwen2" pre-tokenizer: the regex of Qwen2's tokenizer.json (digits one at a time,
# letters with at most one leading non-letter, case-insensitive English contractions).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# GGUF token types (SentencePiece's piece types).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece BPE over this vocab, best first.

    SentencePiece joins, at each step, the adjacent pair whose joined piece scores highest (ties: leftmost);
    a Hugging Face BPE applies the lowest-ranked merge. So every normal piece becomes one merge per split
    into two normal pieces, ranked by the joined piece's score. Control and user-defined pieces are matched
    whole before BPE, never built from parts.
    """
    normal = {t: i for i, t in enumerate(tokens) if types[i] == _NORMAL}
    found = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                found.append((-scores[i], i, normal[left], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _spm_tokenizer(meta: dict, src: Path):
    """A Hugging Face tokenizer doing what llama.cpp's SentencePiece ("llama") tokenizer does."""
    tokens = _need(meta, "tokenizer.ggml.tokens", src)
    scores = _need(meta, "tokenizer.ggml.scores", src)
    types = meta.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=spm_merges(tokens, scores, types),
                unk_token=None if unk is None else tokens[int(unk)], fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    # No pre-tokenizer: SentencePiece runs BPE over the whole text, spaces included (as U+2581).
    # llama.cpp's default; Gemma 3 says False. Like llama.cpp, the prefix starts every text piece between
    # special tokens, not only the first.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    specials, single = [], "$A"
    for key, fmt in (("bos", "{} $A"), ("eos", "$A {}")):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and meta.get(f"tokenizer.ggml.add_{key}_token", key == "bos"):
            single = single.replace("$A", fmt.format(tokens[int(i)]))
            specials.append((tokens[int(i)], int(i)))
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} {single.replace('$A', '$B')}", special_tokens=specials)
    return tok, tokens, types


def _write_tokenizer(meta: dict, out: Path, src: Path, arch: str = "llama") -> None:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok, tokens, types = _gpt2_tokenizer(meta, src)
    elif kind == "llama":
        tok, tokens, types = _spm_tokenizer(meta, src)
    else:
        raise GGUFError(
            f"{src}: GGUF tokenizer {kind!r} is not supported (supported: gpt2 byte-level BPE, llama SentencePiece)")
    # GGUF token types: 3 = control (special), 4 = user-defined (added but not special); both match raw text.
    added = [AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
             for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    tok.add_tokens(added)
    tok.save(str(out / "tokenizer.json"))
    _write_tokenizer_config(meta, out, tokens, arch)


def _gpt2_tokenizer(meta: dict, src: Path):
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp's smollm pre-tokenizer splits every digit before the GPT-2 regex
        pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        pre_tok = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in ("gpt-2", "default"):
        pre_tok = byte_level
    else:
        raise GGUFError(f"{src}: GGUF pre-tokenizer {pre!r} is not supported (supported: smollm, qwen2, gpt-2)")

    tokens = _need(meta, "tokenizer.ggml.tokens", src)
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]  # absent when empty
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tok
    if pre == "qwen2":  # Qwen2's tokenizer.json normalizes to NFC before splitting
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, tokens, types


# For a GGUF without a chat template whose tokenizer wants a BOS (a base model such as Gemma 3 270M): the
# pipeline encodes rendered prompts without special tokens, and Gemma degrades badly without its BOS.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% if not loop.last %}\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}\n{% endif %}"
)


def _write_tokenizer_config(meta: dict, out: Path, tokens: list[str], arch: str) -> None:
    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{arch}.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    elif tok_config["add_bos_token"] and tok_config["bos_token"]:
        tok_config["chat_template"] = PLAIN_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
