"""Scoring keys with the rotary embedding undone (press parameter ``unrotate``)."""

import nestedkv  # noqa: F401

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from nestedkv import KeyDiffPress, NestedKVCache, NestedKVPress, NoPress, clone, compress, make_cache
from nestedkv.rope import describe, inverse
from nestedkv.selection import select
from tiny import feed as prefill


@pytest.mark.parametrize("rope", [
    nn.RoPE(16, traditional=False, base=10000.0),
    nn.RoPE(16, traditional=True, base=1e6, scale=0.5),
    nn.RoPE(8, base=500.0),  # partial rotary: the last 8 dimensions are not rotated
    Llama3RoPE(16, max_position_embeddings=8192, base=500000.0,
               scaling_config={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 1024}),
])
def test_inverse_undoes_the_rotation_at_every_position(rope):
    x = mx.random.normal((1, 2, 300, 16), key=mx.random.key(0))
    for offset in (0, 37):
        back = inverse(rope)(rope(x, offset=offset), offset)
        np.testing.assert_allclose(np.array(back), np.array(x), atol=1e-4)
    assert not np.allclose(np.array(rope(x)), np.array(x), atol=1e-2)  # it did rotate


def test_unsupported_rope_is_named():
    class OtherRoPE(nn.Module):
        pass

    with pytest.raises(ValueError, match="does not support the rope OtherRoPE"):
        inverse(OtherRoPE())


def test_unrotated_scores_see_a_repeated_key_as_one_key():
    # One content vector at every position but one: after RoPE the copies point in many directions, so
    # only the unrotated score can tell the planted key from the repeated one.
    rng = np.random.default_rng(0)
    N, D = 256, 16
    base = rng.standard_normal(D)
    raw = np.tile(base, (1, 2, N, 1))
    raw[:, :, 100] = rng.standard_normal(D)
    rope = nn.RoPE(D, base=10000.0)
    keys = rope(mx.array(raw.astype(np.float32)))
    press = KeyDiffPress(budget=5, n_sink=4, unrotate=True)
    scores = np.array(press.score(inverse(rope)(keys, 0)))
    others = np.delete(scores, 100, axis=-1)
    assert np.ptp(others) < 1e-4 and (scores[..., 100] > others.max() + 0.5).all()
    sel = press.select(keys, unrope=inverse(rope))
    assert np.array(sel.indices)[0].tolist() == [[0, 1, 2, 3, 100]] * 2  # sinks, then the planted key
    with pytest.raises(ValueError, match="unrotate=true needs the model's rope"):
        press.select(keys)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cache_scores_unrotated_keys_and_keeps_the_rotated_ones(tiny_model, tokens, arch):
    model = tiny_model(arch)
    toks = tokens(300)
    press = NestedKVPress(budget=40, head_budget="adaptive", unrotate=True)
    cache = make_cache(model, press)
    prefill(model, cache, toks, 128)
    ref = [KVCache() for _ in model.layers]
    prefill(model, ref, toks, 128)
    unrope = inverse(model.layers[0].self_attn.rope)  # what the probe found, as the module describes it
    assert all(c.rope_spec == describe(model.layers[0].self_attn.rope) for c in cache)
    compress(cache)
    for c, r in zip(cache, ref):
        keys = r.state[0][..., : r.offset, :]
        want = select(press.score(unrope(keys, 0)), press.n_keep(300), "adaptive")
        np.testing.assert_array_equal(np.array(c.kept), np.array(want.counts))
        # the cache holds the model's (rotated) keys at the rows the unrotated scores selected
        k, _, _ = c.padded()
        idx = np.array(want.indices)[0]
        for h in range(idx.shape[0]):
            n = int(np.array(want.counts)[0, h])
            np.testing.assert_array_equal(np.array(k[0, h, :n]), np.array(keys[0, h][mx.array(idx[h, :n])]))


def test_a_saved_cache_keeps_the_rope_and_a_cache_without_one_asks_for_the_model(tiny_model, tokens, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny_model("llama")
    full = make_cache(model, NoPress())
    prefill(model, full, tokens(200), 100)
    path = str(tmp_path / "full.safetensors")
    save_prompt_cache(path, full)
    press = KeyDiffPress(budget=30)
    want = clone(full, press)
    compress(want)
    got = clone(load_prompt_cache(path), press)  # no model given: the file kept its rope
    compress(got)
    for a, b in zip(want, got):
        assert mx.array_equal(a.keys, b.keys).item() and b.stored == 30
    for c in full:
        c.rope_spec = c.facts = None  # a cache built without the model (NestedKVCache(press) by hand)
    with pytest.raises(ValueError, match="needs the model's rope"):
        compress(clone(full, press))
    bound = clone(full, press, model=model)
    compress(bound)
    assert all(c.stored == 30 for c in bound)


def test_unrotate_is_the_default_of_the_direction_scorers_and_earlier_runs_keep_their_meaning():
    from pipeline.config import RunConfig

    assert NestedKVPress().unrotate and KeyDiffPress().unrotate and not NoPress().unrotate
    assert json.loads(NestedKVPress().to_json())["unrotate"] is True  # a new hash for the new default
    assert "unrotate" not in json.loads(NestedKVPress(unrotate=False).to_json())  # runs stored before it keep theirs
    stored = json.loads(NestedKVPress(unrotate=False).to_json())
    assert NestedKVPress.from_json(json.dumps(stored)).unrotate is False  # stored without it: post-RoPE
    assert NestedKVPress.from_json(NestedKVPress().to_json()) == NestedKVPress()
    # the run hash: the default hashes as an explicit true did, an explicit false as no parameter did
    run = lambda **params: RunConfig(task="qa", press="keydiff", compression_ratio=0.75, press_params=params)  # noqa: E731
    assert run().config_hash() == run(unrotate=True).config_hash() != run(unrotate=False).config_hash()
    assert json.loads(run(unrotate=False).canonical_json())["press_params"] == {}
    assert json.loads(run().canonical_json())["press_params"] == {"unrotate": True}
    with pytest.raises(ValueError, match="unrotate must be true or false"):
        KeyDiffPress(unrotate="yes")


def _rotated_stream(press, x, rope, chunk):
    """A streaming cache fed ``x`` [1, H, N, D] rotated by ``rope`` in chunks (keys double as values)."""
    c = NestedKVCache(press, context_len=x.shape[2])
    c.rope_spec = describe(rope) if press.unrotate else None
    for i in range(0, x.shape[2], chunk):
        k = rope(x[..., i : i + chunk, :], offset=i) if press.unrotate else x[..., i : i + chunk, :]
        c.update_and_fetch(k, k)
    c.compress()
    return c


@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
@pytest.mark.parametrize("make", [NestedKVPress, KeyDiffPress])
def test_streaming_unrotated_scores_the_content_of_each_kept_key(make, head_budget):
    # Rotated keys scored unrotated keep exactly the rows the content keys keep when scored as they are,
    # through evictions of rows that are no longer contiguous; the cache still holds the rotated keys.
    rng = np.random.default_rng(3)
    N, H, D = 900, 2, 16
    x = mx.array((rng.standard_normal((1, H, N, D)) + rng.standard_normal(D)).astype(np.float32))
    rope = nn.RoPE(D, base=10000.0)
    kw = dict(budget=96, head_budget=head_budget, prefill="streaming")
    rotated = _rotated_stream(make(**kw, unrotate=True), x, rope, 160)
    plain = _rotated_stream(make(**kw, unrotate=False), x, rope, 160)
    assert rotated.stream is None and rotated.kept is not None
    np.testing.assert_array_equal(np.array(rotated.kept), np.array(plain.kept))
    k_rot, _, valid = rotated.padded()
    k_plain, _, _ = plain.padded()
    for h in range(H):
        n = int(np.array(rotated.kept)[0, h])
        pos = _positions_of(np.array(k_plain[0, h, :n]), np.array(x[0, h]))
        assert len(pos) == n < N and (np.diff(pos) > 0).all()
        want = np.array(rope(x, offset=0)[0, h])[pos]  # the model's rotated keys at the kept positions
        np.testing.assert_allclose(np.array(k_rot[0, h, :n]), want, atol=1e-5)


def _positions_of(rows, keys):
    return [int(np.flatnonzero((keys == r).all(axis=1))[0]) for r in rows]


def test_streaming_unrotate_needs_the_rope():
    press = NestedKVPress(budget=32, prefill="streaming")
    c = NestedKVCache(press, context_len=200)
    with pytest.raises(ValueError, match="unrotate=true needs the model's rope"):
        c.update_and_fetch(mx.zeros((1, 2, 100, 16)), mx.zeros((1, 2, 100, 16)))


def test_every_rope_kind_is_undone_by_position_too():
    from mlx_lm.models.rope_utils import SuScaledRoPE, YarnRoPE
    from nestedkv.rope import at_positions

    x = mx.random.normal((1, 2, 40, 16), key=mx.random.key(1))
    pos = mx.broadcast_to(mx.arange(7, 47), (1, 2, 40))
    for rope in (YarnRoPE(16, scaling_factor=4.0, mscale_all_dim=0.5),
                 SuScaledRoPE(16, short_factor=[1.0] * 8, long_factor=[2.0] * 8)):
        back = np.array(at_positions(inverse(rope), rope(x, offset=7), pos))
        cos = (back * np.array(x)).sum(-1) / np.linalg.norm(back, axis=-1) / np.linalg.norm(np.array(x), axis=-1)
        assert cos.min() > 0.9999  # the direction is back; a constant magnitude factor may stay


def test_rotation_effect_tells_position_from_content():
    from bench.rope import rotation_effect, spearman, summarize

    assert spearman(np.array([[1.0, 2.0, 3.0]]), np.array([[10.0, 20.0, 30.0]]))[0] == pytest.approx(1.0)
    assert spearman(np.array([[1.0, 2.0, 3.0]]), np.array([[3.0, 2.0, 1.0]]))[0] == pytest.approx(-1.0)
    rope = nn.RoPE(16, base=10000.0)
    rng = np.random.default_rng(1)
    # Content: one direction with small noise, so unrotated keys agree; rotated ones spread with position.
    raw = np.tile(rng.standard_normal(16), (1, 2, 600, 1)) + 0.05 * rng.standard_normal((1, 2, 600, 16))
    keys = rope(mx.array(raw.astype(np.float32)))
    got = rotation_effect(keys, inverse(rope))
    assert got["stable"]["cos_unrotated"] > 0.95 > got["stable"]["cos_post"]
    assert got["window_coherence"]["unrotated"] > got["window_coherence"]["post"]
    same = rotation_effect(mx.array(raw.astype(np.float32)), lambda x, offset: x)  # nothing to undo
    assert all(same[s]["spearman"] == pytest.approx(1.0) for s in ("stable", "block", "window"))
    assert summarize([got, same])["stable"]["spearman_min_layer"] == pytest.approx(got["stable"]["spearman"])
