"""NestedKV: training-free, key-only KV-cache eviction for mlx-lm models (arXiv:2605.26678)."""

from nestedkv._platform import load_openblas

load_openblas()

from nestedkv.accounting import LayerMemory, layer_stats, peak_kv_bytes, reset_peak  # noqa: E402
from nestedkv.attention import head_mask, install_attention_hook  # noqa: E402
from nestedkv.cache import NestedKVCache, clone, compress, make_cache, stack, take  # noqa: E402
from nestedkv.press import (  # noqa: E402
    PREFILL_MODES,
    PRESSES,
    BasePress,
    KeyDiffPress,
    KnormPress,
    NestedKVPress,
    NoPress,
    RandomPress,
    StreamingLLMPress,
    get_press,
)

__all__ = [
    "PREFILL_MODES",
    "PRESSES",
    "BasePress",
    "KeyDiffPress",
    "KnormPress",
    "LayerMemory",
    "NestedKVCache",
    "NestedKVPress",
    "NoPress",
    "RandomPress",
    "StreamingLLMPress",
    "clone",
    "compress",
    "get_press",
    "head_mask",
    "install_attention_hook",
    "layer_stats",
    "make_cache",
    "peak_kv_bytes",
    "reset_peak",
    "stack",
    "take",
]
