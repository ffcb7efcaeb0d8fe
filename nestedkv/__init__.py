"""NestedKV: training-free, key-only KV-cache eviction for mlx-lm models (arXiv:2605.26678).

Importing the package changes nothing in the process and does not import mlx: the names below load their
module on first use, so that ``enable_cpu_fast_path()`` (the CPU opt-in, see ``nestedkv._platform``) can still
run before mlx loads.
"""

import importlib

from nestedkv._platform import enable_cpu_fast_path

_HOME = {
    "nestedkv.accounting": ("LayerMemory", "layer_stats", "peak_kv_bytes", "reset_peak"),
    "nestedkv.attention": ("head_mask", "install_attention_hook"),
    "nestedkv.cache": ("NestedKVCache", "check_model", "clone", "compress", "make_cache", "model_scores", "press_of",
                       "rewind", "stack", "steer", "take"),
    "nestedkv.press": ("PREFILL_MODES", "PRESSES", "BasePress", "compared_methods", "get_press"),  # and every press class, below
    "nestedkv.probe": ("Instruction",),
    "nestedkv.quant": ("KVQuant",),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}

__all__ = sorted([*_MODULE_OF, "enable_cpu_fast_path"])


def __getattr__(name: str):
    # The press classes come from the registry (nestedkv.press exports each one), not from a list here;
    # like everything above they load on first use, so importing nestedkv loads no mlx.
    module = _MODULE_OF.get(name) or ("nestedkv.press" if name.endswith("Press") else None)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # looked up once
        return value
    try:  # submodules, as `import nestedkv; nestedkv.cache` found them when the package imported them all
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(__all__))
