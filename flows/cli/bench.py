"""``nkv bench``: a sub-app, one command per benchmark (``bench/``), each with its own options; an option left
out (None) keeps the benchmark function's default."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Callable, Optional

import typer

from bench import (kernels, long, memory, memory_plan, overhead, peer, press_cost, quant, rope, scoring_memory,
                   throughput)
from bench.peer import DEFAULT_PEER_PYTHON, PeerOptions
from flows import bench_overhead
from flows.cli.app import COMMANDS, group
from flows.cli.common import ModelOpt, fail, out_console, say, split_list, user_errors
from pipeline import models
from nestedkv.run_defaults import COMPRESSION_RATIO
from pipeline.config import DEFAULT_INPUT, INT32_MAX

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help=COMMANDS["bench"].help)
cli = group()
cli.add_typer(bench_app, name="bench")

OutOpt = typer.Option(None, "--out", help="also write the figures here (JSON)")
CompressionOpt = typer.Option(COMPRESSION_RATIO, "--compression-ratio", help="fraction of the context removed")
NewTokensOpt = typer.Option(32, "--new-tokens", help="tokens decoded per measurement")


def _unset(flag: str, help: str = "", of: Optional[Callable] = None, name: Optional[str] = None):
    """An option whose absence (None) leaves the benchmark's own default: the default of parameter ``name``
    (the flag's, by default) of the benchmark function ``of``, shown in the help; without ``of``, ``help``
    says what happens."""
    if of is not None:
        default = inspect.signature(of).parameters[name or flag.lstrip("-").replace("-", "_")].default
        shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else default
        help = f"{help} (default {shown})".lstrip()
    return typer.Option(None, flag, help=help)


def _given(**options) -> dict:
    """The options set on the command line (None: left to the benchmark's default)."""
    return {k: v for k, v in options.items() if v is not None}


def _log(message: str) -> None:
    out_console.print(message, markup=False, highlight=False)


@bench_app.command("kernels")
def bench_kernels(
    model: str = ModelOpt,
    context: int = typer.Option(4096, "--context", help="context tokens"),
    new_tokens: int = NewTokensOpt,
    chunk: Optional[int] = _unset("--chunk", "prefill chunk size", kernels.run),
    text: Optional[str] = _unset("--text", "a UTF-8 text file for the context (default: a "
                                       "built-in paragraph, repeated)"),
    random_tokens: bool = typer.Option(False, "--random-tokens", help="random token ids instead of tokenized text"),
    sizes: Optional[str] = _unset("--sizes", "scoring sizes N, comma-separated", kernels.run),
    repeats: Optional[int] = _unset("--repeats", "timed runs per scoring size, after two warm-ups",
                                   kernels.run),
    out: Optional[str] = OutOpt,
):
    """Scoring, compression and decode time, GEMM speed and bytes per layer."""
    with user_errors():
        scoring = split_list(sizes, int, "--sizes") or None
        try:
            kernels.run(models.model_dir(model), context=context, new_tokens=new_tokens, random_tokens=random_tokens,
                        out=out, **_given(chunk=chunk, text=text, sizes=scoring, repeats=repeats))
        except ValueError as exc:  # bad arguments (checked before any work) or a --text that tokenizes to nothing
            fail(str(exc))


@bench_app.command("memory-plan")
def bench_memory_plan(
    model: str = ModelOpt,
    tokens: int = typer.Option(5500, "--tokens", help="the document's length in tokens (about)"),
    compression_ratio: float = CompressionOpt,
    chunk: int = typer.Option(512, "--chunk", help="prefill chunk size"),
    limit: Optional[str] = _unset("--limit", "the memory limit (default: the weights, half the document's "
                                  "whole KV and 150 MiB)"),
    out: Optional[str] = OutOpt,
):
    """A document whose whole prefill does not fit the memory limit, read within it."""
    with user_errors():
        try:
            memory_plan.run_benchmark(model, tokens, compression_ratio, chunk, limit, out)
        except ValueError as exc:
            fail(str(exc))


@bench_app.command("scoring-memory")
def bench_scoring_memory(
    model: str = ModelOpt,
    lengths: str = typer.Option("4096,16384,32768", "--lengths", help="context lengths"),
    layers: int = typer.Option(2, "--layers", help="the model's first layers kept (scoring is per layer)"),
    compression_ratio: float = CompressionOpt,
    out: Optional[str] = OutOpt,
):
    """Peak memory of each press's scoring at long contexts, against the KV it scores."""
    with user_errors():
        ns = split_list(lengths, int, "--lengths")
        if not ns or not all(1 <= n <= INT32_MAX for n in ns) or layers < 1:
            fail("--lengths: positive token counts; --layers: at least 1")
        scoring_memory.run_benchmark(model, ns, layers, compression_ratio, out=out)


@bench_app.command("memory")
def bench_memory(
    model: str = ModelOpt,
    lengths: str = typer.Option("1024,2048,4096,8192", "--lengths", help="context lengths"),
    budget: int = typer.Option(512, "--budget", help="tokens kept per head"),
    compression_ratio: float = CompressionOpt,
    new_tokens: int = NewTokensOpt,
    out: str = typer.Option("reports/memory", "--out", help="folder for the table and the PNG plot"),
):
    """Peak KV memory at growing context lengths."""
    with user_errors():
        ns = split_list(lengths, int, "--lengths")
        if not ns or not all(1 <= n <= INT32_MAX for n in ns):
            fail(f"--lengths: context lengths must be whole numbers of tokens in 1..{INT32_MAX}, got {lengths!r}")
        memory.main(model, ns, budget, compression_ratio, 512, new_tokens, out)


@bench_app.command("throughput")
def bench_throughput(
    model: str = ModelOpt,
    input: str = typer.Option(DEFAULT_INPUT, "--input", help="the batch"),
    compression_ratio: float = CompressionOpt,
    max_new_tokens: Optional[int] = _unset("--max-new-tokens", of=throughput.run_benchmark),
    batch_size: int = typer.Option(5, "--batch-size", help="documents decoded together"),
    rerun: bool = typer.Option(True, "--rerun/--no-rerun", help="also time a re-run with a new ratio, with and "
                               "without the prefill cache"),
    out: Optional[str] = OutOpt,
):
    """Documents per hour: one at a time, batched, and a re-run through the prefill cache."""
    with user_errors():
        throughput.run_benchmark(input, model=model, batch_size=batch_size, ratio=compression_ratio, rerun=rerun,
                                 out=out, **_given(max_new_tokens=max_new_tokens))


@bench_app.command("rope")
def bench_rope(
    model: str = ModelOpt,
    context: int = typer.Option(4096, "--context", help="context tokens"),
    out: Optional[str] = OutOpt,
):
    """How much of each NestedKV scale's ranking is position."""
    with user_errors():
        res = rope.run(model, context, log=_log)
    if out:
        Path(out).write_text(json.dumps(res, indent=1))


@bench_app.command("peer")
def bench_peer(
    model: str = ModelOpt,
    input: Optional[str] = _unset("--input", "the batch", PeerOptions),
    compression_ratio: float = CompressionOpt,
    max_new_tokens: Optional[int] = _unset("--max-new-tokens", of=PeerOptions),
    docs: Optional[int] = _unset("--docs", "documents (with questions) from the start of the input", PeerOptions),
    peer_python: Optional[str] = _unset("--peer-python", "the kvpress environment's python "
                                              f"(default: $NKV_PEER_PYTHON or {DEFAULT_PEER_PYTHON})"),
    peer_threads: int = typer.Option(PeerOptions.peer_threads, "--peer-threads", help="torch threads"),
    export_dir: str = typer.Option(PeerOptions.export_dir, "--export-dir", help="where the fp32 transformers "
                                   "copy is written"),
    probe_tokens: int = typer.Option(PeerOptions.probe_tokens, "--probe-tokens", help="context tokens whose "
                                     "logits both engines must agree on"),
    tolerance: float = typer.Option(PeerOptions.tolerance, "--tolerance", help="max |logit difference| on the "
                                    "probe"),
    out: Optional[str] = OutOpt,
):
    """Side by side with kvpress on the same documents and weights."""
    given = _given(input=input, peer_python=peer_python, docs=docs, max_new_tokens=max_new_tokens)
    with user_errors():
        try:
            peer.run(PeerOptions(**given, model=model, compression_ratio=compression_ratio, peer_threads=peer_threads,
                                 export_dir=export_dir, probe_tokens=probe_tokens, tolerance=tolerance, out=out))
        except peer.Refusal as exc:
            say(f"bench_peer: {exc}")
            raise typer.Exit(3)


@bench_app.command("quant")
def bench_quant(
    model: str = ModelOpt,
    input: Optional[str] = _unset("--input", "the batch", quant.run),
    max_new_tokens: Optional[int] = _unset("--max-new-tokens", of=quant.run),
    docs: Optional[int] = _unset("--docs", "documents for the mlx-lm comparison (0: skip)", quant.run),
    speed_docs: Optional[int] = _unset("--speed-docs", "documents for the speed figures (0: skip)", quant.run),
    decode_tokens: Optional[int] = _unset("--decode-tokens", "greedy tokens decoded per speed row", quant.run),
    error_docs: Optional[int] = _unset("--error-docs", "sample-batch documents for the loss each quantizer adds "
                                       "(0: skip)", quant.run),
    out: Optional[str] = OutOpt,
):
    """Quantized KV against mlx-lm's, and decode speed."""
    with user_errors():
        quant.run(model=model, out=out, **_given(input=input, docs=docs, max_new_tokens=max_new_tokens,
                                                 speed_docs=speed_docs, decode_tokens=decode_tokens,
                                                 error_docs=error_docs))


@bench_app.command("overhead")
def bench_overhead_cmd(
    model: str = ModelOpt,
    input: Optional[str] = _unset("--input", "the batch", overhead.run_overhead),
    task: Optional[str] = _unset("--task", "qa or summarize", overhead.run_overhead),
    press: Optional[str] = _unset("--press", "the press", overhead.run_overhead),
    compression_ratio: float = CompressionOpt,
    max_new_tokens: Optional[int] = _unset("--max-new-tokens", of=overhead.run_overhead),
    out: Optional[str] = OutOpt,
):
    """Share of a batch's wall time outside model compute."""
    with user_errors():
        overhead.run_overhead(model=model, compression_ratio=compression_ratio, out=out,
                              **_given(input=input, task=task, press=press, max_new_tokens=max_new_tokens))


@bench_app.command("press-cost")
def bench_press_cost(
    model: str = ModelOpt,
    context: int = typer.Option(4096, "--context", help="context tokens"),
    press: Optional[str] = _unset("--press", "presses, comma-separated", press_cost.run_press_cost, "presses"),
    compression_ratio: float = CompressionOpt,
    chunk: Optional[int] = _unset("--chunk", "prefill chunk size", press_cost.run_press_cost),
    repeats: Optional[int] = _unset("--repeats", "timed runs of the prefill and of each compression, the best "
                                    "taken", press_cost.run_press_cost),
    out: Optional[str] = OutOpt,
):
    """Each press's compression seconds against the prefill it compresses."""
    with user_errors():
        try:
            press_cost.run_press_cost(model=model, context=context, compression_ratio=compression_ratio, out=out,
                                      **_given(presses=split_list(press, str, "--press") or None, chunk=chunk,
                                               repeats=repeats))
        except ValueError as exc:
            fail(str(exc))


@bench_app.command("long")
def bench_long(
    model: str = ModelOpt,
    lengths: str = typer.Option("6554,20480", "--lengths", help="document lengths"),
    per_length: int = typer.Option(2, "--per-length", help="documents per length (0: none)"),
    seed: int = typer.Option(0, "--seed", help="the documents' seed"),
    window: Optional[int] = _unset("--window", "treat the model's window as this many tokens "
                                         "(default: its own)"),
    rate_lengths: Optional[str] = _unset("--rate-lengths", "also time a streaming prefill of "
                                               "these lengths keeping --budget rows per head"),
    presses: str = typer.Option("nestedkv,keydiff,streaming_llm", "--presses", help="the presses that stream"),
    budget: int = typer.Option(512, "--budget", help="--rate-lengths: tokens kept per head"),
    max_new_tokens: Optional[int] = _unset("--max-new-tokens", "(default "
                                           + ", ".join(f"{n} for {t}" for t, n in long.NEW_TOKENS.items()) + ")"),
    task: str = typer.Option("qa", "--task", help="qa (needles in the middle: recall) or summarize (planted "
                             "events: coverage by depth)"),
    out: Optional[str] = OutOpt,
):
    """Documents past the window, read each way --long-docs offers."""
    res = {}
    with user_errors():
        if per_length:
            res["table"] = long.run(model, split_list(lengths, int, "--lengths"), per_length,
                                    split_list(presses, str, "--presses"), log=_log, seed=seed, task=task,
                                    **_given(max_new_tokens=max_new_tokens, window=window))
        if rate_lengths:
            res["rates"] = long.rates(model, split_list(rate_lengths, int, "--rate-lengths"), budget, log=_log)
    if out:
        Path(out).write_text(json.dumps(res, indent=1))


@bench_app.command("prefect")
def bench_prefect(
    model: str = ModelOpt,
    input: Optional[str] = _unset("--input", "the batch", bench_overhead.run),
    max_new_tokens: Optional[int] = _unset("--max-new-tokens", of=bench_overhead.run),
    repeats: Optional[int] = _unset("--repeats", "timed runs of each kind, the fastest counts", bench_overhead.run),
    no_model_runs: bool = typer.Option(False, "--no-model-runs", help="only the no-op runner measurements"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
):
    """Prefect's overhead per document."""
    with user_errors():
        bench_overhead.run(model=model, model_runs=not no_model_runs, as_json=as_json,
                           **_given(input=input, max_new_tokens=max_new_tokens, repeats=repeats))
