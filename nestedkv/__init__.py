"""NestedKV: training-free, key-only KV-cache eviction for mlx-lm models (arXiv:2605.26678)."""

from nestedkv._platform import load_openblas

load_openblas()

from nestedkv.accounting import LayerMemory, layer_stats  # noqa: E402
from nestedkv.cache import NestedKVCache, clone, compress, make_cache  # noqa: E402
from nestedkv.press import (  # noqa: E402
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
    "layer_stats",
    "make_cache",
]
