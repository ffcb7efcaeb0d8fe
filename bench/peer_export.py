"""Write a model's weights as the fp32 Hugging Face directory a PyTorch peer loads (``LlamaForCausalLM``).

The weights are the ones our CPU path runs: ``load_model(ref, dtype="float32")`` dequantizes a GGUF import,
so both engines compute with the same numbers. The config keeps everything but the ``quantization`` entry
(a transformers loader would otherwise look for packed weights); the tokenizer files are copied as they are.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from pipeline import models  # models.load_model, models.model_dir looked up at each call: tests stand in for them

MARKER = "nkv-peer-export.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "generation_config.json", "vocab.json", "merges.txt")
# Bump when the written directory changes, so an old export is rewritten.
_FORMAT = 1


def hf_config(config: dict) -> dict:
    """The config a transformers loader reads for fp32 weights: no quantization, float32 declared."""
    out = {k: v for k, v in config.items() if k != "quantization" and k != "quantization_config"}
    out["torch_dtype"] = "float32"
    out.setdefault("architectures", ["LlamaForCausalLM"])
    return out


def export_fp32(ref: str, out: str | Path, *, force: bool = False) -> Path:
    """Export ``ref`` (any model reference) into ``out`` once; a matching earlier export is reused."""
    src = Path(models.model_dir(ref))
    out = Path(out)
    stamp = {"source": str(src), "format": _FORMAT}
    marker = out / MARKER
    if not force and marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    model, _ = models.load_model(ref, dtype="float32")
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    config = hf_config(json.loads((src / "config.json").read_text()))
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed: a crash never leaves a half model that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; an export is read like any model folder
    try:
        # "pt": the metadata transformers expects of a PyTorch checkpoint.
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        for name in _TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        (tmp / MARKER).write_text(json.dumps(stamp))
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
