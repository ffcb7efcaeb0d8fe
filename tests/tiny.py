"""Tiny random models with a byte tokenizer, for tests that run whole documents through the pipeline.

``ByteTokenizer`` is the in-process tokenizer (one token per UTF-8 byte, vocab 256, no chat template).
``save_tiny_model_dir`` writes the same thing as an mlx-lm directory with a Hugging Face tokenizer, so a
fresh process (a served flow run) can load it by path like any model reference.
``use_tiny_model`` (a context manager) makes ``pipeline.models.load_model`` answer a name with a tiny model.
"""

from __future__ import annotations

import nestedkv  # noqa: F401  (loads OpenBLAS before mlx)

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

VOCAB = 256
EOS = 0  # NUL never occurs in test text, so only the model can end a generation early
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


def tiny_model(seed: int = 0, n_layers: int = 2):
    from pipeline.models import make_tiny_model

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

    monkeypatch.setattr(models, "load_model", load_model)
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

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
    chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": chars[EOS], "bos_token": None,
        "clean_up_tokenization_spaces": False, "model_max_length": args.max_position_embeddings,
    }))
    return path


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
