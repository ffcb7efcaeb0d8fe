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
    check_kv_bits,
)
# Every registered press class by its own name (a new press module is exported without a list to keep).
globals().update({cls.__name__: cls for cls in PRESSES.values()})

__all__ = sorted(["INT32_MAX", "KV_BITS", "KV_GROUP_SIZES", "PREFILL_MODES", "PRESSES", "SEED_MAX", "BasePress",
                  "check_kv_bits", "compared_methods", "get_press", *(cls.__name__ for cls in PRESSES.values())])
