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
    check,
    check_ints,
    check_kv_bits,
    int_in,
    is_number,
)
# Every registered press class by its own name (a new press module is exported without a list to keep).
globals().update({cls.__name__: cls for cls in PRESSES.values()})

# check, check_ints, int_in, is_number: what a press module validates its own fields with.
__all__ = sorted(["INT32_MAX", "KV_BITS", "KV_GROUP_SIZES", "PREFILL_MODES", "PRESSES", "SEED_MAX", "BasePress",
                  "check", "check_ints", "check_kv_bits", "int_in", "is_number", "compared_methods", "get_press",
                  *(cls.__name__ for cls in PRESSES.values())])
