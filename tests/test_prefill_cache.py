"""The prefill cache: a re-run with a new budget loads the uncompressed prefill instead of computing it,
answers stay identical, damaged entries are recomputed, and the folder stays under its cap."""

import logging

import pytest
from tiny import sample_docs, save_tiny_model_dir, write_batch

import pipeline.engine as engine
from pipeline.config import RunConfig
from pipeline.engine import EngineOptions, make_configs
from pipeline.runner.prefill_cache import PrefillCache
from pipeline.store import Store


@pytest.fixture
def setup(tmp_path, prefills):
    model = str(save_tiny_model_dir(tmp_path / "model"))
    batch = write_batch(tmp_path / "in.parquet", sample_docs(2, 400))
    base = RunConfig(task="qa", model=model, max_new_tokens=5, prefill_step_size=128)
    return tmp_path, base, batch, prefills


def outputs(db):
    with Store(db, read_only=True) as s:
        return s.query("SELECT r.press, r.compression_ratio, o.doc_id, o.question_idx, o.output FROM outputs o "
                       "JOIN runs r USING (run_id) ORDER BY ALL").to_pylist()


def test_a_new_budget_reuses_the_prefill_and_answers_the_same(setup):
    tmp, base, batch, prefills = setup
    cached = EngineOptions(prefill_cache=str(tmp / "pc"))
    first = make_configs(base, ["keydiff"], [0.5])
    engine.run(batch, first, tmp / "a.duckdb", cached)
    assert len(prefills) == 2 and len(list((tmp / "pc").glob("nkv-prefill-*.safetensors"))) == 2
    prefills.clear()
    second = make_configs(base, ["nestedkv", "knorm"], [0.75])
    summary = engine.run(batch, second, tmp / "a.duckdb", cached)
    assert prefills == [] and summary.n_ok == 4  # no prefill: both documents came from the cache
    engine.run(batch, second, tmp / "b.duckdb")  # the same configurations without a cache
    assert len(prefills) == 2
    want = outputs(tmp / "b.duckdb")
    got = [r for r in outputs(tmp / "a.duckdb") if r["press"] != "keydiff"]
    assert got == want and all(r["output"] is not None for r in got)


def seconds(db):
    with Store(db, read_only=True) as s:
        return s.query("SELECT r.press, o.doc_id, any_value(o.prefill_s) AS s, any_value(o.prefill_compute_s) AS c "
                       "FROM outputs o JOIN runs r USING (run_id) GROUP BY ALL ORDER BY ALL").to_pylist()


def test_a_loaded_prefill_keeps_the_seconds_it_took_to_compute(setup):
    """Compression's cost is over the prefill's computed seconds: a re-run from the cache once reported the
    load time instead (KVzip at 1,590x its prefill in the suite)."""
    tmp, base, batch, prefills = setup
    cached = EngineOptions(prefill_cache=str(tmp / "pc"))
    engine.run(batch, make_configs(base, ["keydiff"], [0.5]), tmp / "a.duckdb", cached)
    engine.run(batch, make_configs(base, ["knorm"], [0.5]), tmp / "a.duckdb", cached)
    rows = {(r["press"], r["doc_id"]): r for r in seconds(tmp / "a.duckdb")}
    for doc in {d for _, d in rows}:
        computed, loaded = rows[("keydiff", doc)], rows[("knorm", doc)]
        assert computed["s"] == computed["c"] > 0  # computed here: the same seconds
        assert loaded["c"] == computed["c"]  # loaded: the seconds of the run that stored it
        assert loaded["s"] != loaded["c"]  # and its own (load) time apart


def test_an_entry_stored_without_its_seconds_leaves_them_unknown(tmp_path, tiny_model):
    import mlx.core as mx

    from nestedkv import make_cache

    model = tiny_model()
    cache = make_cache(model)
    model(mx.array([[5, 6, 7, 8]]), cache=cache)
    store = PrefillCache(str(tmp_path / "pc"))
    store.put("a" * 64, cache)  # as entries were stored before they kept their seconds
    store.put("b" * 64, cache, 12.5)
    assert store.load("a" * 64, 4).prefill_s is None and store.load("b" * 64, 4).prefill_s == 12.5
    assert store.get("a" * 64, 4) is not None  # still served: only the seconds are unknown


def test_a_batch_opens_its_prefill_cache_once_and_survives_its_removal(setup, monkeypatch):
    import shutil

    from pipeline.runner import prefill_cache

    tmp, base, batch, prefills = setup
    prefill_cache.open_cache.cache_clear()
    opened = []
    real = PrefillCache.__init__
    monkeypatch.setattr(PrefillCache, "__init__", lambda self, *a: (opened.append(a), real(self, *a))[1])
    cached = EngineOptions(prefill_cache=str(tmp / "pc"))
    engine.run(batch, make_configs(base, ["keydiff"], [0.5]), tmp / "a.duckdb", cached)
    assert len(opened) == 1 and len(prefills) == 2  # two documents, one folder check and model look-up
    shutil.rmtree(tmp / "pc")  # removed between batches of one process: recreated, not an error
    summary = engine.run(batch, make_configs(base, ["knorm"], [0.5]), tmp / "a.duckdb", cached)
    assert summary.n_ok == 2 and len(prefills) == 4 and len(list((tmp / "pc").glob("nkv-prefill-*"))) == 2


def test_a_damaged_entry_is_recomputed_with_a_warning(setup, caplog):
    tmp, base, batch, prefills = setup
    cached = EngineOptions(prefill_cache=str(tmp / "pc"))
    cfg = make_configs(base, ["keydiff"], [0.5])
    engine.run(batch, cfg, tmp / "a.duckdb", cached)
    for p in (tmp / "pc").glob("nkv-prefill-*.safetensors"):
        p.write_bytes(p.read_bytes()[:100])
    prefills.clear()
    with caplog.at_level(logging.WARNING):
        summary = engine.run(batch, make_configs(base, ["knorm"], [0.5]), tmp / "a.duckdb", cached)
    assert summary.n_ok == 2 and len(prefills) == 2
    assert sum("prefill cache entry" in r.message for r in caplog.records) == 2


def test_keys_and_the_size_cap(tmp_path):
    import mlx.core as mx

    from nestedkv import make_cache
    from tiny import tiny_model

    model_dir = str(save_tiny_model_dir(tmp_path / "m"))
    store = PrefillCache(str(tmp_path / "pc"), max_gb=1e-9)  # smaller than any entry
    k = store.key(model_dir, [1, 2, 3], 128)
    assert k == store.key(model_dir, [1, 2, 3], 128)
    assert len({k, store.key(model_dir, [1, 2, 4], 128), store.key(model_dir, [1, 2, 3], 64)}) == 3
    model = tiny_model()
    cache = make_cache(model)
    model(mx.array([[5, 6, 7, 8]]), cache=cache)
    store.put(k, cache)
    assert list((tmp_path / "pc").glob("nkv-prefill-*.safetensors")) == []  # over the cap: evicted at once
    big = PrefillCache(str(tmp_path / "pc2"))
    big.put(k, cache)
    assert big.get(k, 4) is not None and big.get(k, 5) is None  # a length mismatch is not served


def test_eviction_and_damage_touch_only_the_caches_own_files(tmp_path):
    import os

    import mlx.core as mx

    from nestedkv import make_cache
    from tiny import tiny_model

    folder = tmp_path / "models"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(b"w" * 4096)
    look_alike = folder / f"{'0' * 64}.safetensors"  # the name an entry had before entries were prefixed
    look_alike.write_bytes(b"x" * 4096)
    for p in (weights, look_alike):
        os.utime(p, (1, 1))  # older than any entry: first in line if eviction looked at them
    model = tiny_model()
    cache = make_cache(model)
    model(mx.array([[5, 6, 7, 8]]), cache=cache)
    store = PrefillCache(str(folder), max_gb=1e-9)
    store.put("a" * 64, cache)
    assert store.entries() == []  # its own entry went over the cap
    assert weights.read_bytes() == b"w" * 4096 and look_alike.read_bytes() == b"x" * 4096
    assert store.get("0" * 64, 4) is None and look_alike.exists()  # never read as an entry either


@pytest.mark.parametrize("make, words", [
    (lambda tmp: (tmp / "f").write_bytes(b"x") and tmp / "f", "not a folder"),
    (lambda tmp: (tmp / "f").write_bytes(b"x") and tmp / "f" / "sub", "not a folder"),
    (lambda tmp: __import__("pathlib").Path("/proc/nkv-cache"), "cannot write"),
])
def test_an_unusable_folder_is_refused_before_anything_is_created(tmp_path, make, words):
    from pipeline.runner.prefill_cache import PrefillCacheError, check_folder

    path = make(tmp_path)
    with pytest.raises(PrefillCacheError, match=words):
        check_folder(str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["f"])


@pytest.mark.parametrize("gb", [float("inf"), float("nan"), 0.0, -1.0])
def test_the_cap_is_a_positive_finite_size(gb):
    from pipeline.runner.prefill_cache import PrefillCacheError, check_cap

    with pytest.raises(PrefillCacheError):
        check_cap(gb)


def test_an_entry_loads_in_a_fresh_process(tmp_path, tiny_model, tokens):
    # mlx-lm's loader finds a saved cache's class by name: a process that has not built a cache yet (a batch's
    # first document) must still read the entries instead of discarding them.
    import os
    import subprocess
    import sys
    from pathlib import Path

    import nestedkv
    from tiny import feed

    model = tiny_model("llama")
    cache = nestedkv.make_cache(model, nestedkv.NoPress())
    feed(model, cache, tokens(64), 32)
    key = "ab" * 32
    PrefillCache(str(tmp_path / "pc")).put(key, cache)
    code = ("import sys; from pipeline.runner.prefill_cache import PrefillCache; "
            f"c = PrefillCache(sys.argv[1]).get({key!r}, 64); print(type(c[0]).__name__ if c else None)")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "pc")], capture_output=True, text=True,
                         env=env, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "NestedKVCache", out.stderr
    assert list((tmp_path / "pc").glob("nkv-prefill-*.safetensors"))  # kept, not discarded as damaged



@pytest.mark.slow  # about 15 s on a loaded 2-core machine: three engine runs
def test_model_scoring_presses_compress_a_loaded_prefill_as_a_computed_one(setup):
    tmp, base, batch, prefills = setup
    cached = EngineOptions(prefill_cache=str(tmp / "pc"))
    engine.run(batch, make_configs(base, ["keydiff"], [0.5]), tmp / "a.duckdb", cached)  # fills the cache
    prefills.clear()
    configs = make_configs(base, ["kvzip", "expected_attention"], [0.75])
    summary = engine.run(batch, configs, tmp / "a.duckdb", cached)
    assert prefills == [] and summary.n_ok == 4  # the loaded prefill was compressed with the model
    engine.run(batch, configs, tmp / "b.duckdb")
    got = [r for r in outputs(tmp / "a.duckdb") if r["press"] != "keydiff"]
    assert got == outputs(tmp / "b.duckdb")
    with Store(tmp / "b.duckdb", read_only=True) as s:
        rows = s.query("SELECT r.press, o.compress_s FROM outputs o JOIN runs r USING (run_id)").to_pylist()
    assert {r["press"] for r in rows} == {"kvzip", "expected_attention"} and all(r["compress_s"] > 0 for r in rows)
