"""The contract every registered press keeps (parametrized from the registry, so a new press is checked
without an edit here): validation, its JSON round trip, select's shapes and sinks under both head budgets,
streaming equal to whole-context scoring when nothing is evicted before compress, and save/load."""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from nestedkv import compress, make_cache
from nestedkv.press import PRESSES, BasePress, NoPress, compared_methods, get_press
from pipeline.config import RunConfig

NAMES = sorted(PRESSES)
METHODS = [n for n in NAMES if PRESSES[n] is not NoPress]
KEY_ONLY = [n for n in METHODS if not PRESSES[n].needs_model]  # scored from the keys alone, so they can stream
N_DOC = 300


def _keys(seed=0, N=256, H=3, D=16):
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal((1, H, N, D)) + rng.standard_normal(D)).astype(np.float32))


def test_the_registry_holds_every_press_once_in_report_order():
    assert {"nestedkv", "keydiff", "knorm", "streaming_llm", "random", "no_press"} <= set(PRESSES)
    assert all(cls.name == name for name, cls in PRESSES.items())
    assert list(PRESSES)[-1] == "no_press"
    assert compared_methods() == ("nestedkv", "keydiff", "knorm", "streaming_llm", "random", "kvzip",
                                  "expected_attention")


@pytest.mark.parametrize("name", NAMES)
def test_validation(name):
    with pytest.raises(ValueError, match="compression_ratio|ratio"):
        get_press(name, compression_ratio=1.5)
    with pytest.raises(ValueError):
        get_press(name, head_budget="sideways")
    with pytest.raises(TypeError, match="does not take"):
        get_press(name, no_such_parameter=1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kw", [{}, {"compression_ratio": 0.5, "head_budget": "adaptive"},
                                {"budget": 64, "prefill": "streaming", "unrotate": True}])
def test_json_round_trip(name, kw):
    if kw.get("prefill") == "streaming" and not get_press(name, **{**kw, "prefill": "whole"}).streams:
        with pytest.raises(ValueError, match="cannot evict while prefilling"):
            get_press(name, **kw)
        kw = {**kw, "prefill": "whole"}
    press = get_press(name, **kw)
    again = press.from_json(press.to_json())
    assert again == press and type(again) is type(press) and again.to_json() == press.to_json()


@pytest.mark.parametrize("name", KEY_ONLY)
@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_select_shapes_and_sinks(name, head_budget):
    keys = _keys()
    press = get_press(name, compression_ratio=0.75, head_budget=head_budget, unrotate=False)
    s = press.score(keys)
    assert s.shape == keys.shape[:3]
    sel = press.select(keys)
    keep = press.n_keep(keys.shape[2])
    idx, counts = np.array(sel.indices), np.array(sel.counts)
    assert idx.shape[:2] == (1, 3) and int(counts.sum()) == 3 * keep
    if head_budget == "uniform":
        assert idx.shape[2] == keep and (counts == keep).all()
    for h in range(3):
        real = idx[0, h, : counts[0, h]]
        assert (np.diff(real) > 0).all()  # ascending original order
        assert set(range(press.n_sink)) <= set(real.tolist())  # sinks survive


def test_no_press_selects_nothing():
    assert NoPress().select(_keys()) is None


def _run(model, press, toks, chunk):
    cache = make_cache(model, press, context_len=len(toks))
    for i in range(0, len(toks), chunk):
        model(toks[None, i : i + chunk], cache=cache)
    for c in cache:
        if c.stream is not None:  # the press's streaming scorer agrees with its whole-context score
            k = c.keys[..., : c.stored, :]
            want = press.score(c.unrope(k, 0) if press.unrotate else k)
            np.testing.assert_allclose(np.array(c.stream.scores(k, None, c.unrope)), np.array(want), atol=1e-5)
    # model and tokens: for presses that score with the model; questions: for those that read them
    compress(cache, model=model, tokens=toks.tolist(), questions=[[21, 22, 23]])
    return cache


@pytest.mark.parametrize("name", KEY_ONLY)
@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_streaming_with_a_chunk_larger_than_the_document_equals_whole(tiny_model, tokens, name, head_budget):
    model, toks = tiny_model("llama"), tokens(N_DOC)
    kw = dict(compression_ratio=0.6, head_budget=head_budget)
    whole = _run(model, get_press(name, **kw), toks, N_DOC)
    stream = _run(model, get_press(name, prefill="streaming", **kw), toks, 512)
    for a, b in zip(whole, stream):
        assert np.array_equal(np.array(a.kept), np.array(b.kept))
        for x, y in zip(a.keys_and_values(), b.keys_and_values()):
            for u, v in zip(x if isinstance(x, list) else [x], y if isinstance(y, list) else [y]):
                assert np.array_equal(np.array(u), np.array(v))


@pytest.mark.parametrize("name", NAMES)
def test_save_load(tiny_model, tokens, tmp_path, name):
    model, toks = tiny_model("llama"), tokens(N_DOC)
    press = get_press(name, compression_ratio=0.5, head_budget="adaptive")
    cache = _run(model, press, toks, 128)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    q = tokens(3, seed=1)[None]
    want, got = model(q, cache=cache), model(q, cache=loaded)
    assert all(c.press == press for c in loaded)
    assert np.array_equal(np.array(want), np.array(got))


@pytest.mark.parametrize("name", NAMES)
def test_a_runs_press_is_the_press_at_its_own_defaults(name):
    # The pipeline's settings take their defaults from the press class: no second table of them.
    cfg = RunConfig(press=name, compression_ratio=0.0 if PRESSES[name] is NoPress else 0.5)
    want = get_press(name, **{**PRESSES[name].defaults(), "compression_ratio": cfg.compression_ratio})
    assert cfg.make_press() == want
    assert cfg.head_budget == PRESSES[name].defaults()["head_budget"]


def test_a_press_declares_a_runs_defaults_on_its_class():
    @dataclass(frozen=True)
    class Competing(PRESSES["knorm"]):
        name: ClassVar[str] = "test_competing"
        run_defaults: ClassVar[dict] = {"head_budget": "adaptive"}

    try:
        cfg = RunConfig(press="test_competing")
        assert (cfg.head_budget, cfg.compression_ratio) == ("adaptive", 0.75)
        assert (Competing().head_budget, Competing().compression_ratio) == ("uniform", 0.0)  # the library's fields
        assert Competing.defaults()["compression_ratio"] == 0.75  # its bases' run defaults too
        knorm, nkv, kvzip = RunConfig(press="knorm"), RunConfig(press="nestedkv"), RunConfig(press="kvzip")
        assert (knorm.head_budget, nkv.head_budget, kvzip.head_budget) == ("uniform", "adaptive", "adaptive")
        # Every run's ratio is the one the base press declares, NestedKV's adding only its head budget
        assert knorm.compression_ratio == nkv.compression_ratio == BasePress.run_defaults["compression_ratio"]
    finally:
        del PRESSES["test_competing"]
