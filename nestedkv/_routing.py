"""Route one object's calls through a replacement function, leaving its module and every other object alone.

mlx-lm's model modules call the functions they imported by their module-global names (``scaled_dot_product_attention``,
``swiglu``). ``route`` gives one layer instance a subclass of its class whose ``__call__`` is the same code
seeing the replacement under that name; the module, its class and the other instances (another model of the
same architecture, with a plain mlx-lm cache) keep mlx-lm's function.
"""

from __future__ import annotations

import types

_CLASSES: dict = {}  # (class, name, replacement) -> routed subclass, made once


class _Globals(dict):
    """A module's globals with some names replaced; every other name is read live from the module."""

    def __init__(self, module_globals: dict, replaced: dict):
        super().__init__(replaced)
        self.module_globals = module_globals

    def __missing__(self, key):
        return self.module_globals[key]


def _global(fn, name: str):
    try:
        return fn.__globals__[name]  # through __missing__ for a routed function
    except KeyError:
        return None


def routed(obj, name: str, replacement) -> bool:
    return getattr(type(obj), "_nkv_routes", {}).get(name) is replacement


def can_route(obj, name: str, original) -> bool:
    """Whether ``obj``'s ``__call__`` calls ``original`` by the global ``name``."""
    fn = getattr(type(obj), "__call__", None)
    code = getattr(fn, "__code__", None)
    return code is not None and name in code.co_names and _global(fn, name) is original


def route(obj, name: str, original, replacement) -> bool:
    """Make ``obj`` call ``replacement`` where its ``__call__`` calls ``original`` by the global ``name``
    (idempotent); False, and ``obj`` unchanged, when its ``__call__`` does not call ``original``."""
    if routed(obj, name, replacement):
        return True
    if not can_route(obj, name, original):
        return False
    cls = type(obj)
    key = (cls, name, replacement)
    if key not in _CLASSES:
        fn = cls.__call__
        scope = _Globals(fn.__globals__, {name: replacement, "__builtins__": fn.__globals__["__builtins__"]})
        call = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        call.__kwdefaults__, call.__qualname__, call.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
        routes = {**getattr(cls, "_nkv_routes", {}), name: replacement}
        _CLASSES[key] = type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__,
                                                     "__qualname__": cls.__qualname__, "_nkv_routes": routes})
    obj.__class__ = _CLASSES[key]
    return True


def route_all(objs: list, name: str, original, replacement) -> bool:
    """``route`` every one of ``objs`` (one model's layers), or none: False, nothing changed, when some
    object is missing (None) or does not call ``original``."""
    if not objs or not all(o is not None and (routed(o, name, replacement) or can_route(o, name, original))
                           for o in objs):
        return False
    for o in objs:
        route(o, name, original, replacement)
    return True
