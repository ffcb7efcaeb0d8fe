"""The presses' public names (kept where they have always been imported from); they live in
``nestedkv.presses``, one module per method."""

from nestedkv.presses import PRESSES, compared_methods, get_press
from nestedkv.presses.base import (
    INT32_MAX,
    KV_BITS,
    KV_GROUP_SIZES,
    PREFILL_MODES,
    SEED_MAX,
    BasePress,
    NoPress,
    check_kv_bits,
)
from nestedkv.presses.baselines import KnormPress, RandomPress, StreamingLLMPress
from nestedkv.presses.keydiff import KeyDiffPress
from nestedkv.presses.nestedkv import NestedKVPress

__all__ = ["INT32_MAX", "KV_BITS", "KV_GROUP_SIZES", "PREFILL_MODES", "PRESSES", "SEED_MAX", "BasePress",
           "KeyDiffPress", "KnormPress", "NestedKVPress", "NoPress", "RandomPress", "StreamingLLMPress",
           "check_kv_bits", "compared_methods", "get_press"]
