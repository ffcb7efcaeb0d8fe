"""Tiny random models with a byte tokenizer, for tests that run whole documents through the pipeline.

``make_tiny_model`` builds a small mlx-lm model of a real architecture with seeded random weights.
``ByteTokenizer`` is the in-process tokenizer (one token per UTF-8 byte, vocab 256, no chat template).
``save_tiny_model_dir`` writes the same thing as an mlx-lm directory with a Hugging Face tokenizer, so a
fresh process (a served flow run) can load it by path like any model reference; ``save_tiny_gguf``
writes it as a llama.cpp GGUF file instead.
``use_tiny_model`` (a context manager) makes ``pipeline.models.load_model`` answer a name with a tiny model.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn

VOCAB = 256
EOS = 0  # NUL never occurs in test text, so only the model can end a generation early
BOS = 1  # SOH, the BOS of a byte tokenizer that adds one (``write_byte_tokenizer(adds_bos=True)``)
TINY_NAME = "tiny-llama-test"


class ByteTokenizer:
    """The part of an mlx-lm tokenizer the runner uses: encode, decode, eos ids, chat_template."""

    chat_template = None
    eos_token_id = EOS
    eos_token_ids = {EOS}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, **_) -> str:
        return bytes(int(i) for i in ids if int(i) != EOS).decode("utf-8", errors="replace")


def make_tiny_model(
    kind: str = "llama",
    *,
    n_layers: int = 2,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    vocab: int = 256,
    seed: int = 0,
    dtype: Any = mx.float32,
) -> nn.Module:
    """A small mlx-lm model of a real architecture with random weights, deterministic for a seed."""
    import importlib

    if kind not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"kind must be llama, qwen2 or qwen3, got {kind!r}")
    arch = importlib.import_module(f"mlx_lm.models.{kind}")
    args = arch.ModelArgs.from_dict({
        "model_type": kind, "hidden_size": hidden, "num_hidden_layers": n_layers,
        "intermediate_size": 2 * hidden, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "head_dim": hidden // n_heads, "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": True,
    })
    return randomize(arch.Model(args), seed, dtype)


def randomize(model: nn.Module, seed: int = 0, dtype: Any = mx.float32) -> nn.Module:
    """Seeded random weights (norms at one) for a freshly built mlx-lm model."""
    from mlx.utils import tree_flatten, tree_unflatten

    params = tree_flatten(model.parameters())
    # Explicit keys: the weights depend on `seed` alone, whatever the global RNG state is.
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, p), k in zip(params, keys):
        if name.endswith("norm.weight"):
            v = mx.ones(p.shape)
        else:
            v = mx.random.normal(p.shape, key=k) * (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.02)
        new.append((name, v.astype(dtype)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return model


def tiny_model(seed: int = 0, n_layers: int = 2):
    return make_tiny_model("llama", n_layers=n_layers, vocab=VOCAB, seed=seed)


@contextmanager
def use_tiny_model(monkeypatch, name: str = TINY_NAME, seed: int = 0) -> Iterator[tuple]:
    """Within the block, ``load_model(name)`` returns one tiny model and a ByteTokenizer; counts loads."""
    import pipeline.models as models

    pair = (tiny_model(seed), ByteTokenizer())
    real = models.load_model
    loads = []

    def load_model(ref=None, **kw):
        if ref == name:
            loads.append(ref)
            return pair
        return real(ref, **kw)

    real_dir = models.model_dir
    monkeypatch.setattr(models, "load_model", load_model)
    # No files behind the name: it is its own identity (as a repo id is) for the prefill cache.
    monkeypatch.setattr(models, "model_dir", lambda ref=None: str(ref) if ref == name else real_dir(ref))
    yield pair, loads


def _byte_chars() -> list[str]:
    # Byte-level BPE shows each byte as a printable character: printable Latin-1 bytes as themselves,
    # the others shifted past 255, in byte order. Token id = byte value.
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def save_tiny_model_dir(path, seed: int = 0, n_layers: int = 2) -> Path:
    """An mlx-lm directory (config.json, safetensors, byte-level tokenizer.json) loadable by path."""
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_model(seed, n_layers)
    save_model(path, model)
    args = model.args
    save_config({
        "model_type": "llama", "hidden_size": args.hidden_size, "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size, "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads, "head_dim": args.head_dim, "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size, "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings, "tie_word_embeddings": True,
        "eos_token_id": EOS,
    }, path / "config.json")
    write_byte_tokenizer(path, max_length=args.max_position_embeddings)
    return path


def write_byte_tokenizer(path, max_length: int = 4096, adds_bos: bool = False, **config) -> None:
    """The byte-level tokenizer (token id = byte value) as Hugging Face files in ``path``; ``config``: more
    ``tokenizer_config.json`` entries (a ``chat_template``, a ``bos_token`` text). ``adds_bos``: byte 1 is a
    special BOS token (``BOS_TEXT``) that encoding with special tokens puts first, as Llama's and Gemma's do."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if adds_bos:
        tok.add_special_tokens([AddedToken(chars[BOS], special=True)])
        tok.post_processor = processors.TemplateProcessing(single=f"{chars[BOS]} $A",
                                                           special_tokens=[(chars[BOS], BOS)])
        config = {"bos_token": chars[BOS], **config}
    tok.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": chars[EOS], "bos_token": None,
        "clean_up_tokenization_spaces": False, "model_max_length": max_length, **config,
    }))


_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    """llama.cpp's tensor name for an mlx-lm llama/qwen2 parameter name (written independently of the importer)."""
    parts = name.split(".")  # model.layers.<i>.<module path>.weight|bias | model.embed_tokens.weight | model.norm.weight
    if parts[1] == "layers":
        return f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
    return {"embed_tokens": "token_embd.weight", "norm": "output_norm.weight"}[parts[1]]


def llama_cpp_permute(x, n_heads: int):
    """llama.cpp's convert_hf_to_gguf row order for Q/K: each head's half-split rope rows -> interleaved pairs."""
    return x.reshape(n_heads, 2, x.shape[0] // n_heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def save_tiny_gguf(path, model: nn.Module | None = None, *, qtype: str = "Q8_0", embed_qtype: str | None = None,
                   arch: str = "llama") -> Path:
    """A llama (default: ``tiny_model()``) or qwen2 model as llama.cpp writes it: GGUF names, Q/K rows
    permuted for its rope (llama only: qwen2 uses NeoX rope), norms and biases in F32, the other matrices in
    ``qtype`` (the embedding in ``embed_qtype`` or ``qtype``), and the byte-level vocabulary of
    ``save_tiny_model_dir`` with the architecture's pre-tokenizer."""
    import gguf
    import numpy as np
    from mlx.utils import tree_flatten

    model = tiny_model() if model is None else model
    a = model.args
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(a.num_hidden_layers)
    w.add_context_length(a.max_position_embeddings)
    w.add_embedding_length(a.hidden_size)
    w.add_feed_forward_length(a.intermediate_size)
    w.add_head_count(a.num_attention_heads)
    w.add_head_count_kv(a.num_key_value_heads)
    w.add_layer_norm_rms_eps(a.rms_norm_eps)
    w.add_rope_freq_base(a.rope_theta)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "gpt-2")
    w.add_token_list(_byte_chars())
    w.add_token_types([3 if i == EOS else 1 for i in range(VOCAB)])  # 3 = control token
    w.add_eos_token_id(EOS)

    for name, p in tree_flatten(model.parameters()):
        x = np.array(p.astype(mx.float32))
        gname = gguf_name(name)
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            x = llama_cpp_permute(x, a.num_attention_heads if "attn_q" in gname else a.num_key_value_heads)
        qt = "F32" if x.ndim == 1 else (embed_qtype or qtype) if gname == "token_embd.weight" else qtype
        t = gguf.GGMLQuantizationType[qt]
        w.add_tensor(gname, gguf.quants.quantize(x, t), raw_dtype=t)
    return finish_gguf(w)


def finish_gguf(writer) -> Path:
    """Write out and close a ``gguf.GGUFWriter`` (header, metadata, tensors); its path."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(writer.path)


def write_batch(path, docs: list[dict]) -> str:
    """A Parquet batch from dicts (doc_id, text, optional title/questions/answers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = ("doc_id", "text", "title", "questions", "answers")
    table = pa.table({c: [d.get(c) for d in docs] for c in cols},
                     schema=pa.schema([("doc_id", pa.string()), ("text", pa.string()), ("title", pa.string()),
                                       ("questions", pa.list_(pa.string())), ("answers", pa.list_(pa.string()))]))
    pq.write_table(table, path)
    return str(path)


def sample_docs(n: int = 3, chars: int = 400) -> list[dict]:
    base = "It is a truth universally acknowledged that a tiny model reads bytes. "
    return [{"doc_id": f"doc-{i}", "title": f"Doc {i}", "text": (f"Document {i}. " + base * 20)[:chars],
             "questions": ["Who reads bytes?", "What is acknowledged?"], "answers": ["a tiny model", "a truth"]}
            for i in range(n)]


def feed(model, cache, toks, chunk: int = 512, each=None):
    """Prefill ``toks`` [N] in chunks, evaluating the cache after each; ``each(tokens_seen)`` after each chunk.
    Returns the last chunk's logits."""
    for i in range(0, toks.shape[0], chunk):
        logits = model(toks[None, i : i + chunk], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        if each is not None:
            each(i + min(chunk, toks.shape[0] - i))
    return logits
