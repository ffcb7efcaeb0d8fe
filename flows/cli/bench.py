"""``nkv suite`` and ``nkv bench``: the synthetic long-context suite and the benchmarks."""

from __future__ import annotations

import json
from typing import Optional

import typer

from flows.cli.common import InputOpt, ModelOpt, app, fail, invalid, out_console, say, split_list, user_errors
from flows.cli.spec import batch_progress
from pipeline.bench_peer import DEFAULT_PEER_PYTHON, PeerOptions
from pipeline.config import DEFAULT_INPUT

@app.command()
def suite(
    size: str = typer.Option("standard", "--size", help="quick (1k, 1 per task), small (2k, 2), standard (2k/4k/8k, 2)"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="target context tokens, e.g. 2048,4096 (overrides "
                                          "the size's)"),
    per_task: Optional[int] = typer.Option(None, "--per-task", help="documents per task and length"),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="comma-separated subset of the tasks (default: all)"),
    seed: int = typer.Option(0, "--seed"),
    model: str = ModelOpt,
    db: str = typer.Option("suite.duckdb", "--db", help="DuckDB file"),
    out: str = typer.Option("reports/suite", "--out", help="folder for suite.parquet, suite_report.md, frontier.png"),
    press: str = typer.Option("nestedkv,keydiff,knorm,streaming_llm,random", "--press", help="methods ('' = "
                              "calibration only)"),
    compression_ratio: str = typer.Option("0.5,0.75,0.9", "--compression-ratio"),
    head_budget: str = typer.Option("uniform,adaptive", "--head-budget"),
    prefill: str = typer.Option("whole", "--prefill", help="whole and/or streaming (streaming prefills per "
                                "configuration)"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
    threshold: float = typer.Option(0.6, "--threshold", help="least uncompressed accuracy for a task x length "
                                    "cell to enter the headline"),
    all_tasks: bool = typer.Option(False, "--all-tasks", help="run the methods on cells below the threshold too"),
    ablation: bool = typer.Option(True, "--ablation/--no-ablation", help="NestedKV's per-scale variants on the "
                                  "long documents"),
    variants: Optional[str] = typer.Option(None, "--variants", help="comma-separated subset of those variants "
                                           "(default: all, e.g. 'block only,window only post-RoPE')"),
    summaries: int = typer.Option(0, "--summaries", help="plain documents per long length whose compressed "
                                  "summaries are compared with the uncompressed one"),
    austen: Optional[str] = typer.Option(None, "--austen", help="folder with the Austen .txt files"),
    long_from: int = typer.Option(4096, "--long-from", help="documents of at least this many tokens make the "
                                  "headline, the ablation and the summaries"),
):
    """The synthetic long-context suite (RULER-style tasks on Austen's prose): generate, calibrate on the
    uncompressed model, run the methods, report per task and the quality-memory frontier."""
    from pipeline import suite as suite_mod
    from pipeline.tasks import TASKS

    try:
        opts = suite_mod.SuiteOptions(
            model=model, db=db, out=out, size=size, per_task=per_task, seed=seed,
            lengths=tuple(split_list(lengths, int, "--lengths")) or None,
            tasks=tuple(split_list(tasks, str, "--tasks")) or TASKS,
            presses=tuple(split_list(press, str, "--press")),
            ratios=tuple(split_list(compression_ratio, float, "--compression-ratio")),
            head_budgets=tuple(split_list(head_budget, str, "--head-budget")),
            prefills=tuple(split_list(prefill, str, "--prefill")), max_new_tokens=max_new_tokens,
            threshold=threshold, all_tasks=all_tasks, ablation=ablation,
            variants=tuple(split_list(variants, str, "--variants")) if variants else None, summaries=summaries,
            long_from=long_from, austen=austen)
        opts.configs()  # validate the press options before any work
    except ValueError as exc:
        invalid(exc)
    with user_errors(), batch_progress(configs_bar=True) as hooks:
        res = suite_mod.run_suite(opts, hooks=hooks, log=say)
    out_console.print(res.markdown_path.read_text(encoding="utf-8"), markup=False, highlight=False)
    say(f"wrote {res.markdown_path}" + (f" and {res.plot_path}" if res.plot_path else ""))


@app.command()
def bench(
    what: str = typer.Argument("kernels", help="kernels (scoring, compression, decode, GEMM), memory (peak KV at "
                               "growing lengths), throughput (documents per hour, batched, prefill cache), rope "
                               "(how much each NestedKV scale's ranking is position, on --context tokens), or peer "
                               "(side by side with kvpress)"),
    model: str = ModelOpt,
    context: int = typer.Option(4096, "--context", help="kernels and rope: context tokens"),
    new_tokens: int = typer.Option(32, "--new-tokens", help="tokens decoded per measurement"),
    lengths: str = typer.Option("1024,2048,4096,8192", "--lengths", help="memory: context lengths"),
    budget: int = typer.Option(512, "--budget", help="memory: tokens kept per head"),
    compression_ratio: float = typer.Option(0.75, "--compression-ratio", help="memory, throughput and peer"),
    input: Optional[str] = typer.Option(None, "--input", help=f"throughput and peer: the batch (default: "
                                        f"{DEFAULT_INPUT}; peer: {PeerOptions.input})"),
    batch_size: int = typer.Option(5, "--batch-size", help="throughput: documents decoded together"),
    rerun: bool = typer.Option(True, "--rerun/--no-rerun", help="throughput: also time a re-run with a new ratio, "
                               "with and without the prefill cache"),
    docs: int = typer.Option(PeerOptions.docs, "--docs", help="peer: documents (with questions) from the start "
                             "of the input"),
    peer_python: Optional[str] = typer.Option(None, "--peer-python", help="peer: the kvpress environment's python "
                                              f"(default: $NKV_PEER_PYTHON or {DEFAULT_PEER_PYTHON})"),
    peer_threads: int = typer.Option(PeerOptions.peer_threads, "--peer-threads", help="peer: torch threads"),
    export_dir: str = typer.Option(PeerOptions.export_dir, "--export-dir", help="peer: where the fp32 "
                                   "transformers copy is written"),
    probe_tokens: int = typer.Option(PeerOptions.probe_tokens, "--probe-tokens", help="peer: context tokens "
                                     "whose logits both engines must agree on"),
    tolerance: float = typer.Option(PeerOptions.tolerance, "--tolerance", help="peer: max |logit difference| on "
                                    "the probe"),
    out: Optional[str] = typer.Option(None, "--out", help="also write the figures (JSON; memory: a folder with "
                                      "a table and a PNG plot)"),
):
    """Benchmarks: kernels (default), memory, throughput, rope, peer."""
    with user_errors():
        if what == "kernels":
            from nestedkv import bench as nbench
            from pipeline.models import model_dir

            args = ["--model", str(model_dir(model)), "--context", str(context), "--new-tokens", str(new_tokens)]
            nbench.main(args + (["--out", out] if out else []))
        elif what == "memory":
            from pipeline import bench_memory
            from pipeline.config import INT32_MAX

            sizes = split_list(lengths, int, "--lengths")
            if not sizes or not all(1 <= n <= INT32_MAX for n in sizes):
                fail(f"--lengths: context lengths must be whole numbers of tokens in 1..{INT32_MAX}, got {lengths!r}")
            bench_memory.main(model, sizes, budget, compression_ratio, 512, new_tokens, out or "reports/memory")
        elif what == "throughput":
            from pipeline import bench_throughput

            bench_throughput.run_benchmark(input or DEFAULT_INPUT, model=model, batch_size=batch_size,
                                           ratio=compression_ratio, rerun=rerun, out=out)
        elif what == "rope":
            from pathlib import Path

            from pipeline import bench_rope

            res = bench_rope.run(model, context, log=lambda m: out_console.print(m, markup=False, highlight=False))
            if out:
                Path(out).write_text(json.dumps(res, indent=1))
        elif what == "peer":
            from pipeline import bench_peer

            given = dict(input=input, peer_python=peer_python)
            try:
                bench_peer.run(PeerOptions(**{k: v for k, v in given.items() if v is not None}, docs=docs,
                                           model=model, compression_ratio=compression_ratio,
                                           peer_threads=peer_threads, export_dir=export_dir,
                                           probe_tokens=probe_tokens, tolerance=tolerance, out=out))
            except bench_peer.Refusal as exc:
                say(f"bench_peer: {exc}")
                raise typer.Exit(3)
        else:
            fail(f"nkv bench: unknown benchmark {what!r}; choose kernels, memory, throughput, rope or peer")

