"""The kvpress side-by-side benchmark: weight export, the probe's refusal, the figures and their table.

Nothing here needs torch; the two tests at the end run the peer worker and skip without its environment.
"""

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from bench import peer as bench_peer
from bench.peer import Refusal, check_probe, compare_logits, format_report, summarize
from pipeline.config import REFERENCE_PRESS as REFERENCE
from bench.peer_export import MARKER, export_fp32, hf_config
from tiny import save_tiny_model_dir, tiny_model

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = Path(os.environ.get("NKV_PEER_PYTHON", ROOT / bench_peer.DEFAULT_PEER_PYTHON))


def quantized_dir(path: Path) -> Path:
    """A tiny llama saved 4-bit (config with a quantization entry), with a tokenizer."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    save_tiny_model_dir(path)
    config = json.loads((path / "config.json").read_text())
    model, config = quantize_model(tiny_model(), config, 32, 4)
    save_model(path, model)
    save_config(config, path / "config.json")
    assert "quantization" in json.loads((path / "config.json").read_text())
    return path


# -- export -------------------------------------------------------------------------------------------
def test_hf_config_drops_quantization_and_declares_fp32():
    cfg = {"model_type": "llama", "hidden_size": 64, "quantization": {"bits": 4}, "quantization_config": {"bits": 4}}
    out = hf_config(cfg)
    assert "quantization" not in out and "quantization_config" not in out
    assert out["torch_dtype"] == "float32" and out["hidden_size"] == 64
    assert "quantization" in cfg  # the caller's config is left alone


def test_export_writes_fp32_weights_of_the_dequantized_model(tmp_path):
    from pipeline.models import load_model

    src = quantized_dir(tmp_path / "q4")
    out = export_fp32(str(src), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and config["torch_dtype"] == "float32"
    weights = mx.load(str(out / "model.safetensors"))
    assert weights and all(v.dtype == mx.float32 for v in weights.values())
    assert not any(k.endswith((".scales", ".biases")) for k in weights)  # no packed leftovers
    model, _ = load_model(str(src), dtype="float32")
    want = dict(tree_flatten(model.parameters()))
    assert set(weights) == set(want)
    for k, v in want.items():
        assert mx.array_equal(weights[k], v), k
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()


def test_export_is_reused_until_forced(tmp_path):
    src = quantized_dir(tmp_path / "q4")
    out = export_fp32(str(src), tmp_path / "export")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    (out / "extra").write_text("left by hand")
    assert export_fp32(str(src), out) == out and (out / "extra").exists()
    export_fp32(str(src), out, force=True)
    assert not (out / "extra").exists() and (out / MARKER).is_file()
    assert (out / "model.safetensors").stat().st_mtime_ns >= stamp


def test_exported_directory_loads_back_with_the_same_logits(tmp_path):
    import mlx_lm

    from pipeline.models import load_model

    src = quantized_dir(tmp_path / "q4")
    out = export_fp32(str(src), tmp_path / "export")
    ids = mx.array([[3, 70, 101, 32, 9, 200]], dtype=mx.int32)
    a, _ = load_model(str(src), dtype="float32")
    b, _ = mlx_lm.load(str(out))
    assert mx.allclose(a(ids), b(ids), atol=1e-5).item()


# -- the probe ----------------------------------------------------------------------------------------
def _logits(n=6, vocab=50, seed=0):
    return np.random.default_rng(seed).normal(size=(n, vocab)).astype(np.float32) * 5


def test_probe_accepts_floating_point_noise():
    a = _logits()
    check = check_probe(a, a + 1e-4, tolerance=1e-2)
    assert check.ok and check.argmax_differ == 0 and check.max_abs_diff == pytest.approx(1e-4, rel=1e-2)


def test_probe_refuses_a_difference_beyond_the_tolerance():
    a = _logits()
    b = a.copy()
    b[2, 7] += 0.05
    with pytest.raises(Refusal, match=r"max \|diff\| 0.05"):
        check_probe(a, b, tolerance=1e-2)


def test_probe_refuses_an_argmax_flip_within_the_tolerance():
    a = _logits()
    top = a[1].argmax()
    a[1, (top + 1) % a.shape[1]] = a[1, top] - 1e-3  # a near tie
    b = a.copy()
    b[1, top] -= 2e-3  # tiny change, different greedy token
    check = compare_logits(a, b, tolerance=1e-2)
    assert check.max_abs_diff <= 1e-2 and check.argmax_differ == 1 and not check.ok
    with pytest.raises(Refusal, match="argmax differs at 1 of 6"):
        check_probe(a, b)


@pytest.mark.parametrize("b", [_logits(5), _logits()[:, :40], np.full((6, 50), np.nan, np.float32)])
def test_probe_refuses_logits_it_cannot_compare(b):
    with pytest.raises(Refusal, match="refusing to compare"):
        compare_logits(_logits(), b)


def nkv_bench_peer(*args):
    from typer.testing import CliRunner

    from flows.cli import app

    return CliRunner().invoke(app, ["bench", "peer", *args])


def test_refusal_is_one_line_and_a_nonzero_exit(tmp_path):
    res = nkv_bench_peer("--peer-python", str(tmp_path / "missing" / "python"))
    assert res.exit_code == 3
    err = res.stderr
    assert err.startswith("bench_peer: no kvpress environment") and err.count("\n") == 1


# -- figures -------------------------------------------------------------------------------------------
def _rec(answers, prefill_s=10.0, compress_s=0.0, decode_s=(1.0, 1.0), n_generated=(4, 4), kv=1000, n_tokens=100):
    return {"doc_id": "d", "n_tokens": n_tokens, "prefill_s": prefill_s, "compress_s": compress_s,
            "decode_s": list(decode_s), "n_generated": list(n_generated), "answers": list(answers),
            "kv_resident_bytes": kv}


GOLDS = [["6585", "715"]]


def _sides():
    ours = {REFERENCE: [_rec(["It was 6585.", "715 paces"], kv=4000)],
            "keydiff": [_rec(["6585", "no idea"], compress_s=0.5, kv=1000)]}
    peer = {REFERENCE: [_rec(["it was 6585", "715"], prefill_s=4.0, kv=4000)],
            "keydiff": [_rec(["6585", "seven"], prefill_s=4.0, kv=4000)]}
    return ours, peer


def test_summarize_counts_correctness_and_agreement_per_method():
    ours, peer = _sides()
    rows = {r["method"]: r for r in summarize(ours, peer, GOLDS)["methods"]}
    assert rows[REFERENCE]["ours_correct"] == 2 and rows[REFERENCE]["peer_correct"] == 2
    assert rows[REFERENCE]["same_correctness"] == 2
    assert rows[REFERENCE]["same_answer"] == 1  # "It was 6585." equals "it was 6585" once folded
    assert rows["keydiff"]["ours_correct"] == 1 and rows["keydiff"]["same_correctness"] == 2
    assert rows["keydiff"]["same_answer"] == 1
    assert rows["keydiff"]["ours_kv_share"] == 0.25 and rows["keydiff"]["peer_kv_share"] == 1.0


def test_summarize_prefills_once_per_document_on_our_side_only():
    ours, peer = _sides()
    report = summarize(ours, peer, GOLDS)
    # ours: one prefill (10) + compress 0.5 + decode 2 + 2 = 14.5 s for the sweep; one method 12.5 s
    assert report["ours"]["docs_per_hour_sweep"] == pytest.approx(3600 / 14.5, abs=0.1)
    assert report["ours"]["docs_per_hour_one"] == pytest.approx(3600 / 12.5, abs=0.1)
    # kvpress: each configuration prefills: 2 x (4 + 2) = 12 s; one method 6 s
    assert report["peer"]["docs_per_hour_sweep"] == pytest.approx(300.0)
    assert report["peer"]["docs_per_hour_one"] == pytest.approx(600.0)
    assert report["ours"]["prefill_tok_s"] == 10.0 and report["peer"]["prefill_tok_s"] == 25.0
    assert report["ours"]["decode_tok_s"] == 4.0


def test_summarize_rejects_sides_with_different_questions():
    ours, peer = _sides()
    peer["keydiff"][0]["answers"] = ["6585"]
    with pytest.raises(ValueError, match="keydiff"):
        summarize(ours, peer, GOLDS)


def test_format_report_shows_every_method_and_figure():
    ours, peer = _sides()
    report = summarize(ours, peer, GOLDS)
    report.update(ours_peak_rss_bytes=512 * 2**20, peer_peak_rss_bytes=1024 * 2**20)
    text = format_report(report)
    lines = text.splitlines()
    keydiff = next(l for l in lines if l.startswith("keydiff "))
    assert "1/2 (0.50)" in keydiff and "0.0 (25%)" in keydiff and "(100%)" in keydiff
    assert next(l for l in lines if l.startswith("documents/hour, 2-configuration sweep")).split()[-2:] == \
        [str(report["ours"]["docs_per_hour_sweep"]), "300.0"]
    assert next(l for l in lines if l.startswith("peak RSS MiB")).split()[-2:] == ["512.0", "1024.0"]
    assert "documents/hour, keydiff" in text and "prefill tokens/s" in text and "decode tokens/s" in text


def test_methods_match_kvpress_sinks():
    by = {m.label: m for m in bench_peer.METHODS}
    assert len(by) == 7 and by["keydiff"].n_sink == 0 and by["knorm"].n_sink == 0
    assert by["adakv(keydiff)"].head_budget == "adaptive" and by["adakv(keydiff)"].peer_adaptive
    assert by["streaming_llm"].n_sink == dict(by["streaming_llm"].peer_kwargs)["n_sink"]
    configs = bench_peer.our_configs("smollm2-135m", 0.75, 8)
    assert [c.make_press().n_sink for c in configs[1:]] == [0, 0, 0, 4, 4, 4]
    kvzip, ea = configs[-2].make_press(), configs[-1].make_press()
    assert kvzip.chunk == 2048 and kvzip.head_budget == "adaptive"  # kvpress: chunk_size 2048, layerwise=False
    assert ea.n_recent >= 10**9 and ea.head_budget == "uniform"  # kvpress: every context query, per head


# -- the peer environment -------------------------------------------------------------------------------
# Without the environment these skip; CI's peer step builds it and sets NKV_REQUIRE_EXTRAS=1: then they fail.
MISSING = not PEER_PYTHON.is_file() and os.environ.get("NKV_REQUIRE_EXTRAS") != "1"
peer = pytest.mark.skipif(MISSING, reason=f"no kvpress environment at {PEER_PYTHON} (.ci/run builds one)")


@peer
def test_peer_logits_match_ours_on_the_exported_weights(tmp_path):
    from pipeline.models import load_model

    src = quantized_dir(tmp_path / "q4")
    out = export_fp32(str(src), tmp_path / "export")
    ids = [3, 70, 101, 32, 9, 200, 17, 44]
    bench_peer.call_peer(str(PEER_PYTHON), {"op": "probe", "model_dir": str(out), "threads": 1, "probe_ids": ids,
                                            "probe_out": str(tmp_path / "p.npy")}, tmp_path)
    model, _ = load_model(str(src), dtype="float32")
    assert check_probe(bench_peer.probe_logits(model, ids), np.load(tmp_path / "p.npy"), 1e-3).ok


@peer
def test_peer_worker_compresses_under_kvpress(tmp_path):
    out = export_fp32(str(quantized_dir(tmp_path / "q4")), tmp_path / "export")
    ctx = list(np.random.default_rng(0).integers(1, 256, 64))
    methods = [m for m in bench_peer.METHODS if m.label in (REFERENCE, "keydiff", "adakv(keydiff)",
                                                            "expected_attention")]
    request = {"op": "bench", "model_dir": str(out), "threads": 1, "eos": [0], "max_new_tokens": 3,
               "configs": [bench_peer.peer_config(m, 0.75) for m in methods],
               "documents": [{"doc_id": "d", "context_ids": [int(t) for t in ctx], "questions_ids": [[5, 6], [7]],
                              "context_text": None, "question_texts": None}]}
    runs = {r["label"]: r for r in bench_peer.call_peer(str(PEER_PYTHON), request, tmp_path)["documents"][0]["runs"]}
    full = runs[REFERENCE]["kv_resident_bytes"]
    assert runs["keydiff"]["kv_resident_bytes"] == full // 4  # 16 of 64 rows kept
    assert runs["adakv(keydiff)"]["kv_resident_bytes"] == full  # kvpress's AdaKV masks rows, keeps them
    assert runs["expected_attention"]["kv_resident_bytes"] == full // 4  # 4 sinks among its 16 rows
    assert all(len(r["answers"]) == 2 and all(n <= 3 for n in r["n_generated"]) for r in runs.values())


@peer
def test_kvzip_scores_match_kvpress_over_several_chunks(tmp_path):
    """Score for score against kvpress's KVzip on the same weights, context and fed ids, three chunks (the
    last one short): each chunk's softmax over its sinks, itself and the fed rows, the max over the queries
    and the query group. Before, only whole-document answers were compared, on contexts of one chunk."""
    from nestedkv import make_cache
    from nestedkv.probe import Instruction
    from nestedkv.press.kvzip import KVzipPress
    from pipeline.models import load_model

    src = quantized_dir(tmp_path / "q4")
    out = export_fp32(str(src), tmp_path / "export")
    chunk, ctx = 48, [int(t) for t in np.random.default_rng(1).integers(1, 256, 120)]
    got = bench_peer.call_peer(str(PEER_PYTHON), {"op": "kvzip_scores", "model_dir": str(out), "threads": 1,
                                                  "context_ids": ctx, "chunk_size": chunk,
                                                  "scores_out": str(tmp_path / "s.npy")}, tmp_path)
    theirs, suffix, feeds = np.load(tmp_path / "s.npy"), got["suffix"], got["feeds"]
    assert len(feeds) == 3
    first = feeds[0][: -(len(suffix) + chunk)]
    resume = feeds[1][: -(len(suffix) + 8 + chunk)]
    prompt = Instruction(tuple(first), tuple(resume), tuple(suffix))
    assert [prompt.feed(ctx[max(a - 8, 0):a], ctx[a:a + chunk], a == 0) for a in (0, 48, 96)] == feeds

    model, _ = load_model(str(src), dtype="float32")
    cache = make_cache(model)
    model(mx.array(ctx)[None], cache=cache)
    ours = KVzipPress(compression_ratio=0.5, chunk=chunk).model_scores(model, cache, ctx, prompt)
    ours = np.stack([np.array(s[0]) for s in ours])  # [layers, kv heads, n]
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=2e-3, atol=1e-6)


@peer
@pytest.mark.parametrize("use_covariance", [False, True])
def test_expected_attention_scores_match_kvpress(tmp_path, use_covariance):
    """Score for score against kvpress's Expected Attention, its statistics from every query after the 4
    sinks, as ``nkv bench peer`` sets ours. kvpress's softmax leaves the sinks out and ours does not, which
    scales each head's scores by one factor (the attention its sinks take), so each head is compared
    normalized: the order within a head, hence a uniform budget's choice, is the same."""
    from nestedkv import make_cache
    from nestedkv.press.expected_attention import ExpectedAttentionPress
    from pipeline.models import load_model

    src = quantized_dir(tmp_path / "q4")
    out = export_fp32(str(src), tmp_path / "export")
    ctx = [int(t) for t in np.random.default_rng(1).integers(1, 256, 120)]
    bench_peer.call_peer(str(PEER_PYTHON), {"op": "scorer_scores", "model_dir": str(out), "threads": 1,
                                            "press": "ExpectedAttentionPress",
                                            "kwargs": {"use_covariance": use_covariance}, "context_ids": ctx,
                                            "scores_out": str(tmp_path / "s.npy")}, tmp_path)
    theirs = np.load(tmp_path / "s.npy")[..., 4:]

    model, _ = load_model(str(src), dtype="float32")
    cache = make_cache(model)
    model(mx.array(ctx)[None], cache=cache)
    press = ExpectedAttentionPress(compression_ratio=0.5, n_recent=len(ctx) - 4, n_sink=4,
                                   use_covariance=use_covariance)
    ours = np.exp(np.stack([np.array(s[0]) for s in press.model_scores(model, cache, ctx, None)]))[..., 4:]
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours / ours.sum(-1, keepdims=True), theirs / theirs.sum(-1, keepdims=True),
                               rtol=2.5e-3)


@peer
def test_snapkv_scores_match_kvpress(tmp_path):
    """Score for score against kvpress's SnapKV. kvpress reads the question as the last ``window_size`` tokens
    of its one prefill; ours prefills the context and reads the questions after it, every one as that window:
    the same attention, the same pooling, the same mean over each KV head's query group."""
    import nestedkv
    from nestedkv import make_cache
    from nestedkv.press.snapkv import SnapKVPress
    from pipeline.models import load_model

    src = quantized_dir(tmp_path / "q4")
    out = export_fp32(str(src), tmp_path / "export")
    rng = np.random.default_rng(2)
    ctx = [int(t) for t in rng.integers(1, 256, 150)]
    questions = [[int(t) for t in rng.integers(1, 256, 9)], [int(t) for t in rng.integers(1, 256, 7)]]
    window = [t for q in questions for t in q]
    bench_peer.call_peer(str(PEER_PYTHON), {"op": "scorer_scores", "model_dir": str(out), "threads": 1,
                                            "press": "SnapKVPress", "kwargs": {"window_size": len(window)},
                                            "context_ids": ctx + window, "scores_out": str(tmp_path / "s.npy")},
                         tmp_path)
    theirs = np.load(tmp_path / "s.npy")[..., : len(ctx)]

    model, _ = load_model(str(src), dtype="float32")
    cache = make_cache(model, SnapKVPress(compression_ratio=0.5))
    model(mx.array(ctx)[None], cache=cache)
    ours = np.stack([np.array(s[0]) for s in nestedkv.model_scores(cache, model, ctx, (), questions)])
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=2e-3, atol=1e-6)


def test_nkv_bench_peer_refuses_without_the_environment(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.setenv("NKV_PEER_PYTHON", str(tmp_path / "missing" / "python"))
    result = CliRunner().invoke(app, ["bench", "peer"])
    assert result.exit_code == 3
    assert "no kvpress environment" in result.output


def test_benchmark_refuses_when_the_peer_model_differs(tmp_path, capsys):
    """The whole command on a tiny model, against a stand-in peer whose probe logits are all zero."""
    from tiny import sample_docs, write_batch

    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    batch = write_batch(tmp_path / "b.parquet", sample_docs(1))
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys, numpy as np\n"
                    "r = json.load(open(sys.argv[2]))\n"
                    "np.save(r[\"probe_out\"], np.zeros((len(r[\"probe_ids\"]), 256), np.float32))\n"
                    "json.dump({}, open(sys.argv[3], \"w\"))' \"$@\"\n")
    fake.chmod(0o755)
    res = nkv_bench_peer("--model", str(model_dir), "--input", batch, "--docs", "1", "--peer-python", str(fake),
                         "--export-dir", str(tmp_path / "export"), "--probe-tokens", "32")
    assert res.exit_code == 3
    err = res.stderr
    assert err.count("\n") == 1
    assert err.startswith("bench_peer: refusing to compare: the two models differ")
    assert "argmax differs at" in err and "of 32 positions" in err
