"""Every press: ``base`` holds the contract and the registry; each other module here defines presses, is
loaded when the package is, and registers them by subclassing ``BasePress``. A new press is a new module."""

import importlib
import pkgutil

from nestedkv.presses.base import PRESSES, BasePress, compared_methods, get_press

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")

# Method lists, CLI choices and report rows follow the registry in this order.
_ordered = sorted(PRESSES.items(), key=lambda kv: (kv[1].rank, kv[0]))
PRESSES.clear()
PRESSES.update(_ordered)

__all__ = ["PRESSES", "BasePress", "compared_methods", "get_press"]
