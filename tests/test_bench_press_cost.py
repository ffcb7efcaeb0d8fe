"""nkv bench press-cost: one prefill, each press compressing a clone of it with the pipeline's instruction."""

import pytest
from tiny import TINY_NAME, ByteTokenizer, use_tiny_model

from bench import press_cost


def test_each_press_compresses_the_same_prefill_with_the_pipelines_instruction(monkeypatch):
    seen = []
    real = press_cost.nestedkv.compress

    def spy(cache, **kw):
        seen.append((press_cost.nestedkv.press_of(cache).name, len(kw["tokens"]), kw["prompt"]))
        return real(cache, **kw)

    monkeypatch.setattr(press_cost.nestedkv, "compress", spy)
    lines = []
    with use_tiny_model(monkeypatch):
        res = press_cost.run_press_cost(model=TINY_NAME, context=300, presses=["nestedkv", "kvzip"], chunk=128,
                                        log=lines.append)
    assert [name for name, _, _ in seen] == ["nestedkv", "kvzip"]
    assert all(n == 300 for _, n, _ in seen)
    assert seen[1][2] == press_cost.repeat_instruction(ByteTokenizer())
    for name in ("nestedkv", "kvzip"):
        r = res["presses"][name]
        assert r["compress_s"] > 0 and r["compress_over_prefill"] == pytest.approx(r["compress_s"] / res["prefill_s"])
    assert len(lines) == 3 and "kvzip" in lines[2]


@pytest.mark.parametrize("kw,message", [({"presses": ["nope"]}, "not a press"),
                                        ({"presses": ["no_press"]}, "not a press"),
                                        ({"context": 4}, "--context"),
                                        ({"compression_ratio": 1.0}, "--compression-ratio")])
def test_bad_arguments_are_refused_before_any_work(kw, message, monkeypatch):
    monkeypatch.setattr(press_cost.models, "load_model", lambda *a: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match=message):
        press_cost.run_press_cost(**kw)
