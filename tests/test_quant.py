"""Quantized KV on top of a press (issue 19): rows chosen on the real keys, then quantized with mx.quantize (keys
rotated by a Hadamard matrix first, unless kv_hadamard=False: mlx-lm's own layout); mlx-lm's quantized attention
over them; the same layouts (dense, per-head, padded for stack) and byte-exact accounting.

The tiny models here have head dimension 64 (mx.quantize's groups are 32, 64 or 128 values)."""

import nestedkv  # noqa: F401  (loads OpenBLAS before mlx)

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache
from tiny import ByteTokenizer, make_tiny_model, sample_docs

from nestedkv import (
    KeyDiffPress,
    NestedKVCache,
    NestedKVPress,
    NoPress,
    compress,
    install_attention_hook,
    layer_stats,
    make_cache,
    stack,
    take,
)
from nestedkv import attention as nkv_attention
from nestedkv.buffers import check_hadamard, hadamard, hadamard_fits


def model64(dtype=mx.float32, n_heads=4, n_kv_heads=2, seed=0):
    # GQA (query heads share KV heads), head dim 64
    m = make_tiny_model("llama", hidden=64 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads, seed=seed, dtype=dtype)
    m.eval()
    return m


def toks(n, seed=0):
    return mx.random.randint(0, 256, (n,), key=mx.random.key(seed)).astype(mx.int32)


def prefill(model, cache, ids, chunk):
    for i in range(0, ids.shape[0], chunk):
        model(ids[None, i : i + chunk], cache=cache)
    mx.eval([c.state for c in cache])


def greedy(model, cache, question, steps):
    """Logits of the question's last position and of each greedy step."""
    logits = model(question[None], cache=cache)[:, -1]
    out = [logits]
    for _ in range(steps):
        nxt = mx.argmax(logits, axis=-1)
        logits = model(nxt[:, None], cache=cache)[:, -1]
        out.append(logits)
    mx.eval(out)
    return out


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if not mx.array_equal(x, y).item()), None)


@pytest.mark.parametrize("press", [NoPress(kv_bits=8, kv_hadamard=False),
                                   NestedKVPress(compression_ratio=0.0, kv_bits=8, kv_hadamard=False),
                                   NestedKVPress(compression_ratio=0.0, head_budget="adaptive", kv_bits=8,
                                                 kv_hadamard=False),
                                   KeyDiffPress(compression_ratio=0.0, kv_bits=4, kv_hadamard=False)],
                         ids=lambda p: p.name)
def test_r0_quantized_equals_mlx_lm_quantized_kv_cache(press):
    """r = 0 unrotated: the same logits, bit for bit, as mlx-lm's KVCache prefilled the same way and converted
    with to_quantized (its QuantizedKVCache), through the question and greedy decode steps."""
    model = model64()
    install_attention_hook(model)  # both runs take the same (hooked) attention
    ids, q = toks(300), toks(7, seed=1)
    ours = make_cache(model, press)
    prefill(model, ours, ids, 128)
    compress(ours)
    assert all(c.quantized and isinstance(c.keys, tuple) for c in ours)
    ref = [KVCache() for _ in model.layers]
    prefill(model, ref, ids, 128)
    ref = [c.to_quantized(group_size=press.kv_group_size, bits=press.kv_bits) for c in ref]
    got, want = greedy(model, ours, q, 12), greedy(model, ref, q, 12)
    assert first_difference(got, want) is None


def test_inside_mlx_lm_generate_it_compresses_quantizes_and_equals_mlx_lm_at_r0():
    """In generate_step the cache compresses (and quantizes) itself on the first single-token call; at r = 0 and
    8 bits the tokens are mlx-lm's own with kv_bits=8 from the end of the prompt's prefill."""
    from mlx_lm.generate import generate_step

    model = model64()
    install_attention_hook(model)
    prompt = toks(301)

    def run(cache, **kw):
        out = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=10,
                                                 prefill_step_size=128, **kw)]
        return out, cache

    ours, cache = run(make_cache(model, NoPress(kv_bits=8, kv_hadamard=False)))
    theirs, _ = run([KVCache() for _ in model.layers], kv_bits=8, kv_group_size=64,
                    quantized_kv_start=prompt.shape[0] - 1)
    assert all(c.quantized for c in cache) and ours == theirs
    evicted, cache = run(make_cache(model, NestedKVPress(compression_ratio=0.5, kv_bits=4)))
    assert len(evicted) == 10 and all(c.quantized and c.n_ctx_rows == 150 for c in cache)


def _rows(cache_layer):
    """Each layer's stored rows (per-head: the flat buffer), whatever the layout."""
    c = cache_layer
    return (c.flat_keys, c.flat_values) if c.flat_keys is not None else (c.keys, c.values)


@pytest.mark.parametrize("prefill_mode", ["whole", "streaming"])
@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_quantized_rows_are_the_unquantized_selection_quantized(head_budget, prefill_mode):
    """Scores come from the real keys: the quantized cache keeps the very rows the 16-bit one keeps, each equal
    to mx.quantize of the 16-bit row (streaming too: what it keeps is quantized at the end)."""
    model = model64()
    ids = toks(600)
    kw = dict(compression_ratio=0.6, head_budget=head_budget, prefill=prefill_mode)
    caches = []
    for bits in (None, 4):
        c = make_cache(model, NestedKVPress(**kw, kv_bits=bits), context_len=600)
        prefill(model, c, ids, 128)
        compress(c)
        caches.append(c)
    for full, q in zip(*caches):
        assert mx.array_equal(full.kept, q.kept).item() and full.head_rows == q.head_rows
        assert (full.flat_keys is None) == (q.flat_keys is None)
        for x, y, rotated in zip(_rows(full), _rows(q), (True, False)):  # keys rotated, values as they are
            n = y[0].shape[2]
            x = x[..., :n, :]
            want = mx.quantize(hadamard(x) if rotated else x, group_size=64, bits=4)
            assert all(mx.array_equal(a, b).item() for a, b in zip(want, y))


def test_adaptive_quantized_is_padding_free_and_equals_the_padded_layout():
    """Per-head (unpadded) quantized rows attend like the padded and masked layout of stack, and a stack of two
    documents of different lengths answers each as it would alone: padding never gets weight."""
    model = model64(n_heads=6, n_kv_heads=2)  # 3 query heads per KV head, as in SmolLM2
    press = NestedKVPress(compression_ratio=0.5, head_budget="adaptive", kv_bits=4)
    a, b = make_cache(model, press), make_cache(model, press)
    prefill(model, a, toks(500), 128)
    prefill(model, b, toks(300, seed=2), 128)
    compress(a), compress(b)
    assert any(c.head_rows is not None and len(set(c.head_rows)) > 1 for c in a)  # heads keep different counts
    for s in layer_stats(a):
        assert s.bytes_resident == s.bytes_kept  # nothing allocated beyond the kept rows
    single = stack([a])  # the padded layout of the same rows
    assert all(c.valid is not None and c.quantized for c in single)
    q = toks(4, seed=3)[None]
    per_head = model(q, cache=a)
    padded = model(q, cache=single)
    assert mx.allclose(per_head, padded, atol=1e-4).item()
    for c in a:
        c.rewind()
    both = stack([a, b])
    qq = mx.concatenate([q, toks(4, seed=4)[None]], axis=0)
    together = model(qq, cache=both)
    assert mx.allclose(together[0], model(q, cache=a)[0], atol=1e-4).item()
    assert mx.allclose(together[1], model(qq[1:], cache=b)[0], atol=1e-4).item()
    left = take(both, [1])  # the other entry finished: this one decodes on alone, still quantized
    y = toks(1, seed=5)[None]
    assert all(c.quantized for c in left)
    assert mx.allclose(model(y, cache=left)[0], model(y, cache=b)[0], atol=1e-4).item()


@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_decode_rows_are_quantized_as_they_arrive_and_trim_back(head_budget):
    model = model64()
    cache = make_cache(model, NestedKVPress(compression_ratio=0.75, head_budget=head_budget, kv_bits=4))
    prefill(model, cache, toks(400), 128)
    compress(cache)
    ctx = [(c.stored, c.offset, c.nbytes) for c in cache]
    q = toks(6, seed=1)
    first = greedy(model, cache, q, 5)
    for c, (stored, offset, _) in zip(cache, ctx):
        assert c.stored == stored + 11 and all(x.dtype == mx.uint32 for x in (_rows(c)[0][0], _rows(c)[1][0]))
        c.rewind()
        assert (c.stored, c.offset) == (stored, offset)
    again = greedy(model, cache, q, 5)  # one compressed document, many questions
    assert first_difference(first, again) is None


@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_save_load_roundtrip_of_a_quantized_cache(tmp_path, head_budget):
    model = model64()
    cache = make_cache(model, NestedKVPress(compression_ratio=0.5, head_budget=head_budget, kv_bits=8))
    prefill(model, cache, toks(300), 128)
    compress(cache)
    model(toks(5, seed=1)[None], cache=cache)  # a question already appended
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert all(type(c) is NestedKVCache and c.quant == (8, 64, True) for c in loaded)
    assert [c.nbytes for c in loaded] == [s.bytes_kept for s in layer_stats(loaded)]
    y = toks(1, seed=3)[None]
    assert mx.array_equal(model(y, cache=cache), model(y, cache=loaded)).item()
    for caches in (cache, loaded):
        for c in caches:
            c.rewind()
    q = toks(4, seed=4)[None]
    assert mx.array_equal(model(q, cache=cache), model(q, cache=loaded)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_accounting_counts_the_quantized_bytes(dtype, bits, group, head_budget):
    """resident = the arrays' nbytes (packed values + scales + biases); full = the model dtype's uncompressed
    cache; kept = kept rows x the quantized row size."""
    model = model64(dtype=dtype)
    cache = make_cache(model, NestedKVPress(compression_ratio=0.75, head_budget=head_budget, kv_bits=bits,
                                            kv_group_size=group))
    prefill(model, cache, toks(512), 128)
    compress(cache)
    D, H = 64, 2
    row = 2 * (D * bits // 8 + 2 * (D // group) * dtype.size)  # K and V: packed + scales + biases
    for c, s in zip(cache, layer_stats(cache)):
        parts = [*_rows(c)[0], *_rows(c)[1]]
        assert s.bytes_resident == sum(x.nbytes for x in parts) == c.nbytes
        assert s.bytes_full == H * 512 * 2 * D * dtype.size
        assert s.bytes_kept == (s.kept_mean * H) * row == s.bytes_resident
        assert s.dtype == str(dtype).removeprefix("mlx.core.") and s.head_dim == D
        assert parts[1].dtype == dtype  # scales stay in the model's dtype


def test_bad_quantization_settings_are_refused_before_any_work():
    with pytest.raises(ValueError, match="kv_bits must be one of 4, 8"):
        NestedKVPress(kv_bits=3)
    with pytest.raises(ValueError, match="kv_group_size"):
        NestedKVPress(kv_bits=4, kv_group_size=48)
    with pytest.raises(ValueError, match="must divide the model's head dimension 16"):
        make_cache(make_tiny_model("llama"), NestedKVPress(kv_bits=4))  # head dim 16
    model = model64()
    a, b = make_cache(model, NoPress(kv_bits=4)), make_cache(model, NoPress())
    for c in (a, b):
        prefill(model, c, toks(40), 40)
        compress(c)
    plain = make_cache(model, NoPress(kv_bits=4, kv_hadamard=False))
    prefill(model, plain, toks(40), 40)
    compress(plain)
    for other in (b, plain):  # unquantized, or keys not rotated: their attention differs
        with pytest.raises(ValueError, match="quantized alike"):
            stack([a, other])
    with pytest.raises(ValueError, match="kv_hadamard must be true or false"):
        NestedKVPress(kv_bits=4, kv_hadamard="yes")
    with pytest.raises(ValueError, match="kv_bits"):
        a[0].to_quantized(bits=4)  # mlx-lm's kv_bits would bypass the press: pointed at the press's option


def test_press_json_and_run_hash():
    from pipeline.config import RunConfig
    from pipeline.engine import make_configs

    assert "kv_bits" not in NestedKVPress().to_json()  # unquantized presses (and old saved caches) unchanged
    p = NestedKVPress(compression_ratio=0.5, kv_bits=4, kv_group_size=32)
    assert NestedKVPress.from_json(p.to_json()) == p and p.kv_hadamard
    plain = NestedKVPress(compression_ratio=0.5, kv_bits=4, kv_group_size=32, kv_hadamard=False)
    assert NestedKVPress.from_json(plain.to_json()) == plain
    # stored before the rotation existed: unrotated, as they were computed
    assert "kv_hadamard" not in plain.to_json() and "kv_hadamard" in p.to_json()
    base = RunConfig(task="qa")
    assert "kv_bits" not in base.canonical_json()  # 16-bit runs keep their hashes: old stores still resume
    hashes = {RunConfig(task="qa", kv_bits=b, kv_group_size=g, kv_hadamard=h).config_hash()
              for b in (None, 4, 8) for g in (32, 64) for h in (True, False)}
    assert len(hashes) == 9  # group size and rotation only matter when quantized
    assert "kv_hadamard" not in RunConfig(kv_bits=4, kv_hadamard=False).canonical_json()  # old stores resume
    assert RunConfig(kv_group_size=32, kv_hadamard=False) == RunConfig()  # one unquantized configuration
    assert RunConfig(kv_bits=4, kv_hadamard=False).label().endswith("kv4/plain")
    q8 = RunConfig(task="qa", press="no_press", compression_ratio=0.0, kv_bits=8)
    assert not q8.is_reference and q8.reference().kv_bits is None and q8.label() == "no_press kv8"
    cfgs = make_configs(base, ["no_press", "keydiff"], [0.75], kv_bits=[None, 4])
    assert [(c.press, c.kv_bits) for c in cfgs] == [("no_press", None), ("no_press", 4), ("keydiff", None),
                                                    ("keydiff", 4)]
    with pytest.raises(ValueError, match="kv_bits"):
        RunConfig(kv_bits=3)
    with pytest.raises(ValueError, match="kv_group_size"):
        RunConfig(kv_group_size=50)
    with pytest.raises(ValueError, match="kv_bits is an option of its own"):
        RunConfig(press_params={"kv_bits": 4})


def test_pipeline_answers_and_stores_quantized_bytes(tmp_path):
    """The engine end to end: configurations quantized at 4 and 8 bits answer (batched and not), and the store's
    memory_savings shows the combined saving against the model dtype's full cache."""
    from pipeline.config import RunConfig
    from pipeline.documents import Document
    from pipeline.engine import EngineOptions, compute, make_configs
    from pipeline.evaluate import evaluation_rows
    from pipeline.report import write_report
    from pipeline.runner import Runner
    from pipeline.store import Store

    base = RunConfig(task="qa", model="tiny", press="no_press", compression_ratio=0.0, max_new_tokens=4,
                     prefill_step_size=128)
    runner = Runner(model64(), ByteTokenizer(), base, max_context=4096)
    doc = Document(**sample_docs(1, 500)[0])
    cfgs = make_configs(base, ["no_press", "nestedkv"], [0.75], kv_bits=[None, 4, 8])
    outs, outcomes = {}, {}
    for batched in (False, True):
        got = compute(runner, doc, cfgs, reference=cfgs[0], options=EngineOptions(evaluate=True, batch_decode=batched))
        outcomes[batched] = got
        outs[batched] = {o.config: o.result for o in got}
        assert all(r.status == "ok" for r in outs[batched].values())
    # decoded together or one at a time: the same answers
    assert {c: [q.output for q in r.questions] for c, r in outs[False].items()} == \
           {c: [q.output for q in r.questions] for c, r in outs[True].items()}
    db = str(tmp_path / "s.duckdb")
    with Store(db) as store:
        runs = {o.config: store.start_run(o.config, "x") for o in outcomes[False]}
        ref = runs[cfgs[0]]
        store.write_results([(runs[o.config], o.result, evaluation_rows(runs[o.config], o.result, o.scores, ref))
                             for o in outcomes[False]])
        rows = store.query("SELECT press, kv_bits, bytes_full, bytes_resident, resident_share FROM memory_savings "
                           "ORDER BY press, kv_bits NULLS FIRST").to_pylist()
        # the quantized no_press run is compared with the 16-bit one, like any compressed run
        twins = store.query("SELECT DISTINCT press, kv_bits FROM quality_vs_full ORDER BY ALL").to_pylist()
    assert [(t["press"], t["kv_bits"]) for t in twins] == [("nestedkv", 4), ("nestedkv", 8), ("nestedkv", None),
                                                         ("no_press", 4), ("no_press", 8)]
    rep = write_report(db, tmp_path / "report")  # nkv report: one row per KV width, the 16-bit no_press as reference
    assert rep.plot_path.stat().st_size > 0
    assert [(r["press"], r["kv_bits"]) for r in rep.rows] == [("no_press", None), ("no_press", 8), ("no_press", 4),
                                                            ("nestedkv", None), ("nestedkv", 8), ("nestedkv", 4)]
    assert "KV bits" in rep.markdown
    by = {(r["press"], r["kv_bits"]): r for r in rows}
    full = by[("no_press", None)]["bytes_full"]
    assert all(r["bytes_full"] == full for r in rows)  # full stays the fp32 uncompressed cache
    for (press, bits), r in by.items():
        res = outs[False][next(c for c in cfgs if (c.press, c.kv_bits) == (press, bits))]
        assert r["bytes_resident"] == sum(m.bytes_resident for m in res.layers)
    # 4 bits + 64-value groups with fp32 scales: 40 of 256 bytes per row; 8 bits: 72 of 256
    assert by[("no_press", 4)]["resident_share"] == pytest.approx(40 / 256)
    assert by[("no_press", 8)]["resident_share"] == pytest.approx(72 / 256)
    assert by[("nestedkv", 4)]["resident_share"] < 0.25 * 40 / 256 * 1.1


def test_cli_refuses_bad_kv_options_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from tiny import save_tiny_model_dir

    db = tmp_path / "x.duckdb"
    model = str(save_tiny_model_dir(tmp_path / "tiny"))  # head dimension 16: no quantization group divides it
    for args, text in ((["--kv-bits", "3"], "--kv-bits must be 4 or 8"),
                       (["--kv-group-size", "48"], "kv_group_size must be one of 32, 64, 128"),
                       (["--kv-bits", "4", "--model", model], "must divide the model's head dimension 16")):
        res = subprocess.run([sys.executable, "-m", "flows.cli", "run", *args, "--db", str(db)],
                             capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"}, timeout=120)
        assert res.returncode == 2, res.stderr
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and text in lines[0], res.stderr
    assert not db.exists()  # refused before anything was created


def test_kv_settings_reach_the_flows_and_deployments():
    """A deployment's parameters (what ``nkv serve`` and the fan-out submit) carry the KV width into each flow."""
    import inspect

    from flows.batch import budget_sweep, summarize_batch
    from flows.sharded import sharded_batch
    from flows.cli.spec import press_grid
    from flows.deploy import batch_parameters
    from flows.params import SWEEP
    from pipeline.config import RunConfig
    from pipeline.spec import BatchSpec

    params = batch_parameters(BatchSpec.of(RunConfig(kv_bits=4, kv_group_size=32), input="in.parquet", db="x.duckdb"))
    assert (params["kv_bits"], params["kv_group_size"]) == (4, 32)
    inspect.signature(summarize_batch.fn).bind(**params)
    inspect.signature(sharded_batch.fn).bind(pool="macs", **params)
    grid = press_grid({"press": "nestedkv", "compression_ratio": "0.75", "budget": None, "head_budget": None,
                       "prefill": "whole", "press_param": None, "kv_bits": "16,8,4", "kv_group_size": "64",
                       "kv_hadamard": "true,false"})
    assert grid["kv_bits"] == [None, 8, 4]
    spec = BatchSpec(input="x", **grid)
    assert [(c.kv_bits, c.kv_hadamard) for c in spec.configs()] == [(None, True), (8, True), (8, False), (4, True),
                                                                    (4, False)]
    inspect.signature(budget_sweep.fn).bind(**SWEEP.arguments(BatchSpec(input="x", **grid)))


def test_hadamard_keeps_dot_products_and_spreads_outlier_channels():
    """The rotation is orthonormal (scores unchanged before quantization), and on keys with a few large
    channels, as real models' keys have, 4-bit scores come out closer after it."""
    k = mx.random.normal((1, 2, 256, 64), key=mx.random.key(0))
    k = k * mx.where(mx.arange(64) < 3, 30.0, 1.0)  # three outlier channels
    q = mx.random.normal((1, 2, 8, 64), key=mx.random.key(1))
    exact = q @ k.swapaxes(-1, -2)
    assert mx.allclose(hadamard(q) @ hadamard(k).swapaxes(-1, -2), exact, atol=1e-3).item()

    def error(rotate):
        kk, qq = (hadamard(k), hadamard(q)) if rotate else (k, q)
        deq = mx.dequantize(*mx.quantize(kk, group_size=64, bits=4), group_size=64, bits=4)
        return mx.abs(qq @ deq.swapaxes(-1, -2) - exact).mean().item()

    assert error(rotate=True) < 0.5 * error(rotate=False)


@pytest.mark.parametrize("head_dim,fits", [(64, True), (128, True), (96, True), (80, True), (112, True),
                                           (72, False), (288, False), (100, False)])
def test_hadamard_sizes_are_checked_before_mlx_is_asked(head_dim, fits):
    """mx.hadamard_transform returns a non-orthogonal result for sizes it does not have (72: 9 x 8) instead of
    raising: those are refused, naming the way out."""
    assert hadamard_fits(head_dim) is fits
    if fits:
        x = mx.random.normal((3, head_dim), key=mx.random.key(2))
        assert mx.allclose((hadamard(x) ** 2).sum(-1), (x ** 2).sum(-1), rtol=1e-4).item()
    else:
        with pytest.raises(ValueError, match="kv_hadamard=False"):
            check_hadamard(head_dim)


@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_rotated_keys_attend_like_the_same_keys_rotated_back(head_budget):
    """The queries are rotated exactly where the keys are: the quantized cache answers as a plain 16-bit cache
    holding the same rows dequantized and rotated back (the 64-dim Hadamard matrix is its own inverse)."""
    model = model64()
    ids, q = toks(300), toks(5, seed=1)[None]
    cache = make_cache(model, NestedKVPress(compression_ratio=0.0, head_budget=head_budget, kv_bits=4))
    prefill(model, cache, ids, 128)
    compress(cache)
    ref = [KVCache() for _ in model.layers]
    prefill(model, ref, ids, 128)

    def dq(x):
        return mx.dequantize(*mx.quantize(x, group_size=64, bits=4), group_size=64, bits=4)

    class RotatedBack(KVCache):  # every row it gets (the question's too) quantized, then rotated back
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(hadamard(dq(hadamard(keys))), dq(values))

    back = []
    for c in ref:
        back.append(RotatedBack())
        back[-1].update_and_fetch(c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
    got = model(q, cache=cache)
    assert mx.allclose(got, model(q, cache=back), atol=1e-4).item()
    unrotated = make_cache(model, NestedKVPress(compression_ratio=0.0, head_budget=head_budget, kv_bits=4,
                                                kv_hadamard=False))
    prefill(model, unrotated, ids, 128)
    compress(unrotated)
    assert not mx.allclose(got, model(q, cache=unrotated), atol=1e-4).item()  # the rotation is what differs


def test_rotated_keys_refuse_a_model_that_is_not_routed(monkeypatch):
    """mlx-lm's attention would score unrotated queries against rotated keys: the cache refuses and says how
    to route the model; a layer whose attention cannot be routed stores its keys unrotated, and says so."""
    model = model64()
    cache = make_cache(model, NoPress(kv_bits=8))
    prefill(model, cache, toks(100), 100)
    compress(cache)
    monkeypatch.setattr(nkv_attention, "calling_model", lambda skip=2: None)
    other = model64()
    with pytest.raises(RuntimeError, match="Hadamard rotation"):
        other(toks(3, seed=1)[None], cache=cache)
    from nestedkv import _routing

    monkeypatch.setattr(_routing, "can_route", lambda *a: False)  # an attention of the model's own
    cache = make_cache(model64(), NoPress(kv_bits=4))
    assert all(not c.press.kv_hadamard and "quantized keys not rotated" in c.adapted for c in cache)
    assert all(c.run_press.kv_hadamard for c in cache)  # the run's press is as given


def test_bench_quant_error_figure_ranks_the_quantizers():
    """``nkv bench quant``'s error part: one row per quantizer, over the documents long enough to score, and
    8 bits moves the loss far less than 4 bits."""
    from bench.quant import CONTINUATION, quantization_error
    from pipeline.config import RunConfig
    from pipeline.documents import Document
    from pipeline.runner import Runner

    runner = Runner(model64(), ByteTokenizer(), RunConfig(task="qa", model="tiny", prefill_step_size=128))
    docs = [Document(**d) for d in sample_docs(2, 3 * CONTINUATION)] + [Document(doc_id="short", text="too short")]
    rows = quantization_error(runner, docs)
    assert [(r["kv_bits"], r["kv_hadamard"]) for r in rows] == [(8, False), (8, True), (4, False), (4, True)]
    assert all(r["docs"] == 2 for r in rows)
    by = {(r["kv_bits"], r["kv_hadamard"]): abs(r["delta_nll"]) for r in rows}
    assert max(by[(8, False)], by[(8, True)]) < min(by[(4, False)], by[(4, True)])


def test_rotated_and_unrotated_configurations_decode_together_as_alone(tmp_path):
    """A sweep over kv_hadamard decodes each quantization as a batch of its own (a stack cannot mix them):
    every answer ok, the same batched as one at a time; the report tells the two layouts apart."""
    from pipeline.config import RunConfig
    from pipeline.documents import Document
    from pipeline.engine import EngineOptions, compute
    from pipeline.evaluate import evaluation_rows
    from pipeline.report import write_report
    from pipeline.runner import Runner
    from pipeline.spec import PressGrid
    from pipeline.store import Store

    base = RunConfig(task="qa", model="tiny", max_new_tokens=4, prefill_step_size=128)
    runner = Runner(model64(), ByteTokenizer(), base, max_context=4096)
    doc = Document(**sample_docs(1, 500)[0])
    cfgs = PressGrid(press=["nestedkv", "no_press"], compression_ratio=[0.75], kv_bits=[None, 4],
                     kv_hadamard=[True, False]).configs(base)
    assert len(cfgs) == 6
    answers = []
    for batched in (False, True):
        got = compute(runner, doc, cfgs, reference=cfgs[0].reference(),
                      options=EngineOptions(batch_decode=batched, evaluate=True))
        assert all(o.result.status == "ok" for o in got), [o.result.error for o in got]
        answers.append({o.config: [q.output for q in o.result.questions] for o in got})
    assert answers[0] == answers[1]
    db = str(tmp_path / "h.duckdb")
    with Store(db) as store:
        runs = {o.config: store.start_run(o.config, "x") for o in got}
        ref = runs[cfgs[0].reference()]
        store.write_results([(runs[o.config], o.result, evaluation_rows(runs[o.config], o.result, o.scores, ref))
                             for o in got])
    rep = write_report(db, tmp_path / "report")
    assert [(r["press"], r["kv_label"]) for r in rep.rows] == [
        ("no_press", None), ("no_press", "4"), ("no_press", "4 plain"),
        ("nestedkv", None), ("nestedkv", "4"), ("nestedkv", "4 plain")]
