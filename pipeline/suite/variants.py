"""NestedKV's variants (each scale alone, no gate, where RoPE sits, ...): what the suite's ablation and
``nkv ablation`` run, as press configurations."""

from __future__ import annotations

from pipeline.config import RunConfig

# name -> (press, head budget, the method's parameters)
VARIANTS: dict[str, tuple[str, str, dict]] = {
    "nestedkv": ("nestedkv", "uniform", {}),
    "nestedkv adaptive": ("nestedkv", "adaptive", {}),
    "no gate": ("nestedkv", "uniform", {"use_gate": False}),
    "stable only": ("nestedkv", "uniform", {"scales": [True, False, False]}),
    "block only": ("nestedkv", "uniform", {"scales": [False, True, False]}),
    "window only": ("nestedkv", "uniform", {"scales": [False, False, True]}),
    "stable+block": ("nestedkv", "uniform", {"scales": [True, True, False]}),
    "stable+window": ("nestedkv", "uniform", {"scales": [True, False, True]}),
    "block+window": ("nestedkv", "uniform", {"scales": [False, True, True]}),
    "keydiff": ("keydiff", "uniform", {}),
    "keydiff adaptive": ("keydiff", "adaptive", {}),
}
# Where RoPE sits in the score: NestedKV scores keys with the rotation undone by default (nestedkv.rope),
# so its variants also run post-RoPE (the paper's scoring); KeyDiff, post-RoPE by default, also runs unrotated.
_ROPE_VARIANTS = {"nestedkv": "post-RoPE", "nestedkv adaptive": "post-RoPE", "stable only": "post-RoPE",
                  "block only": "post-RoPE", "window only": "post-RoPE", "keydiff": "unrotated"}
VARIANTS.update({f"{name} {suffix}": (VARIANTS[name][0], VARIANTS[name][1],
                                      {**VARIANTS[name][2], "unrotate": suffix == "unrotated"})
                 for name, suffix in _ROPE_VARIANTS.items()})


def variant_configs(base: RunConfig, names: list[str], ratios: list[float]) -> dict[RunConfig, tuple[str, float]]:
    """config -> (variant, ratio); the no_press reference is ("no_press", 0.0)."""
    out = {base.reference(): ("no_press", 0.0)}
    for name in names:
        press, head_budget, params = VARIANTS[name]
        for r in ratios:
            cfg = RunConfig.model_validate({**base.model_dump(), "press": press, "head_budget": head_budget,
                                            "compression_ratio": r, "press_params": params})
            out[cfg] = (name, r)
    return out


def check_variants(names: list[str]) -> None:
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
