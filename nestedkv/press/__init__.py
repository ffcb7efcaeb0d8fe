"""Every press: ``base`` holds the contract and the registry; each other module here defines presses, is
loaded when the package is, and registers them by subclassing ``BasePress``. A new press is a new module.

The package's names are the presses' public API: the registry, every press class by its own name, and the
helpers a press module validates its fields with (``check``, ``check_ints``, ``int_in``, ``is_number``)."""

import importlib
import pkgutil

from nestedkv.press.base import (  # noqa: F401  (the package's API: __all__ below)
    INT32_MAX, KV_BITS, KV_GROUP_SIZES, PREFILL_MODES, PRESSES, SEED_MAX, BasePress, check, check_ints, check_kv_bits,
    compared_methods, get_press, int_in, is_number)

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")

# Method lists, CLI choices and report rows follow the registry in this order.
_ordered = sorted(PRESSES.items(), key=lambda kv: (kv[1].rank, kv[0]))
PRESSES.clear()
PRESSES.update(_ordered)

# Every registered press class by its own name (a new press module is exported without a list to keep).
globals().update({cls.__name__: cls for cls in PRESSES.values()})

__all__ = sorted(["INT32_MAX", "KV_BITS", "KV_GROUP_SIZES", "PREFILL_MODES", "PRESSES", "SEED_MAX", "BasePress",
                  "check", "check_ints", "check_kv_bits", "int_in", "is_number", "compared_methods", "get_press",
                  *(cls.__name__ for cls in PRESSES.values())])
