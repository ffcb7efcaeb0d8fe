"""``nkv bench``: the benchmarks, each a function that this command calls with the options given (an option
left out keeps that function's default)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from flows.cli.common import ModelOpt, app, fail, out_console, say, split_list, user_errors
from pipeline.bench_peer import DEFAULT_PEER_PYTHON, PeerOptions
from pipeline.config import DEFAULT_INPUT

BENCHMARKS = ("kernels", "memory", "throughput", "rope", "peer", "quant", "overhead", "long", "prefect")


def _given(**options) -> dict:
    """The options set on the command line (None: left to the benchmark's default)."""
    return {k: v for k, v in options.items() if v is not None}


@app.command()
def bench(
    what: str = typer.Argument("kernels", help="kernels (scoring, compression, decode, GEMM), memory (peak KV at "
                               "growing lengths), throughput (documents per hour, batched, prefill cache), rope "
                               "(how much each NestedKV scale's ranking is position, on --context tokens), peer "
                               "(side by side with kvpress), quant (quantized KV against mlx-lm's, and decode "
                               "speed), overhead (share of a batch's wall time outside model compute), long "
                               "(documents past the window, read each way --long-docs offers) or prefect "
                               "(Prefect's overhead per document)"),
    model: str = ModelOpt,
    context: int = typer.Option(4096, "--context", help="kernels and rope: context tokens"),
    new_tokens: int = typer.Option(32, "--new-tokens", help="tokens decoded per measurement"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="memory: context lengths (default "
                                          "1024,2048,4096,8192); long: document lengths (default 6554,20480)"),
    per_length: int = typer.Option(2, "--per-length", help="long: documents per length (0: none)"),
    seed: int = typer.Option(0, "--seed", help="long: the documents' seed"),
    window: Optional[int] = typer.Option(None, "--window", help="long: treat the model's window as this many "
                                         "tokens (default: its own)"),
    rate_lengths: Optional[str] = typer.Option(None, "--rate-lengths", help="long: also time a streaming prefill "
                                               "of these lengths keeping --budget rows per head"),
    presses: str = typer.Option("nestedkv,keydiff,streaming_llm", "--presses", help="long: the presses that "
                                "stream"),
    budget: int = typer.Option(512, "--budget", help="memory and long's --rate-lengths: tokens kept per head"),
    compression_ratio: float = typer.Option(0.75, "--compression-ratio", help="memory, throughput, peer and "
                                            "overhead"),
    input: Optional[str] = typer.Option(None, "--input", help=f"the batch (default: {DEFAULT_INPUT}; peer and "
                                        f"quant: {PeerOptions.input})"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="throughput, peer, quant, "
                                                 "overhead and prefect (default: 128, 24, 24, 32 and 16)"),
    batch_size: int = typer.Option(5, "--batch-size", help="throughput: documents decoded together"),
    rerun: bool = typer.Option(True, "--rerun/--no-rerun", help="throughput: also time a re-run with a new ratio, "
                               "with and without the prefill cache"),
    docs: Optional[int] = typer.Option(None, "--docs", help="peer: documents (with questions) from the start of "
                                       f"the input (default {PeerOptions.docs}); quant: documents for the mlx-lm "
                                       "comparison (default 6, 0: skip)"),
    peer_python: Optional[str] = typer.Option(None, "--peer-python", help="peer: the kvpress environment's python "
                                              f"(default: $NKV_PEER_PYTHON or {DEFAULT_PEER_PYTHON})"),
    peer_threads: int = typer.Option(PeerOptions.peer_threads, "--peer-threads", help="peer: torch threads"),
    export_dir: str = typer.Option(PeerOptions.export_dir, "--export-dir", help="peer: where the fp32 "
                                   "transformers copy is written"),
    probe_tokens: int = typer.Option(PeerOptions.probe_tokens, "--probe-tokens", help="peer: context tokens "
                                     "whose logits both engines must agree on"),
    tolerance: float = typer.Option(PeerOptions.tolerance, "--tolerance", help="peer: max |logit difference| on "
                                    "the probe"),
    speed_docs: Optional[int] = typer.Option(None, "--speed-docs", help="quant: documents for the speed figures "
                                             "(default 1, 0: skip)"),
    decode_tokens: Optional[int] = typer.Option(None, "--decode-tokens", help="quant: greedy tokens decoded per "
                                                "speed row (default 64)"),
    error_docs: Optional[int] = typer.Option(None, "--error-docs", help="quant: sample-batch documents for the "
                                             "loss each quantizer adds (default 5, 0: skip)"),
    task: Optional[str] = typer.Option(None, "--task", help="overhead: qa (default) or summarize"),
    press: Optional[str] = typer.Option(None, "--press", help="overhead: the press (default nestedkv)"),
    chunk: Optional[int] = typer.Option(None, "--chunk", help="kernels: prefill chunk size (default 512)"),
    text: Optional[str] = typer.Option(None, "--text", help="kernels: a UTF-8 text file for the context "
                                       "(default: a built-in paragraph, repeated)"),
    random_tokens: bool = typer.Option(False, "--random-tokens", help="kernels: random token ids instead of "
                                       "tokenized text"),
    sizes: Optional[str] = typer.Option(None, "--sizes", help="kernels: scoring sizes N, comma-separated "
                                        "(default 2048,8192,32768)"),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="kernels: timed runs per scoring size, after "
                                          "two warm-ups (default 3); prefect: timed runs of each kind, the "
                                          "fastest counts (default 1)"),
    no_model_runs: bool = typer.Option(False, "--no-model-runs", help="prefect: only the no-op runner "
                                       "measurements"),
    as_json: bool = typer.Option(False, "--json", help="prefect: print one JSON object instead of a table"),
    out: Optional[str] = typer.Option(None, "--out", help="also write the figures (JSON; memory: a folder with "
                                      "a table and a PNG plot)"),
):
    """Benchmarks: kernels (default), memory, throughput, rope, peer, quant, overhead, long, prefect."""
    if what not in BENCHMARKS:
        fail(f"nkv bench: unknown benchmark {what!r}; choose {', '.join(BENCHMARKS[:-1])} or {BENCHMARKS[-1]}")
    with user_errors():
        if what == "kernels":
            from nestedkv import bench as nbench
            from pipeline.models import model_dir

            scoring = split_list(sizes, int, "--sizes") or None
            try:
                nbench.run(model_dir(model), context=context, new_tokens=new_tokens, random_tokens=random_tokens,
                           out=out, **_given(chunk=chunk, text=text, sizes=scoring, repeats=repeats))
            except ValueError as exc:  # bad arguments (checked before any work) or a --text that tokenizes to nothing
                fail(str(exc))
        elif what == "memory":
            from pipeline import bench_memory
            from pipeline.config import INT32_MAX

            ns = split_list(lengths or "1024,2048,4096,8192", int, "--lengths")
            if not ns or not all(1 <= n <= INT32_MAX for n in ns):
                fail(f"--lengths: context lengths must be whole numbers of tokens in 1..{INT32_MAX}, got {lengths!r}")
            bench_memory.main(model, ns, budget, compression_ratio, 512, new_tokens, out or "reports/memory")
        elif what == "throughput":
            from pipeline import bench_throughput

            bench_throughput.run_benchmark(input or DEFAULT_INPUT, model=model, batch_size=batch_size,
                                           ratio=compression_ratio, rerun=rerun, out=out,
                                           **_given(max_new_tokens=max_new_tokens))
        elif what == "rope":
            from pathlib import Path

            from pipeline import bench_rope

            res = bench_rope.run(model, context, log=lambda m: out_console.print(m, markup=False, highlight=False))
            if out:
                Path(out).write_text(json.dumps(res, indent=1))
        elif what == "peer":
            from pipeline import bench_peer

            given = _given(input=input, peer_python=peer_python, docs=docs, max_new_tokens=max_new_tokens)
            try:
                bench_peer.run(PeerOptions(**given, model=model, compression_ratio=compression_ratio,
                                           peer_threads=peer_threads, export_dir=export_dir,
                                           probe_tokens=probe_tokens, tolerance=tolerance, out=out))
            except bench_peer.Refusal as exc:
                say(f"bench_peer: {exc}")
                raise typer.Exit(3)
        elif what == "quant":
            from pipeline import bench_quant

            bench_quant.run(model=model, out=out, **_given(input=input, docs=docs, max_new_tokens=max_new_tokens,
                                                           speed_docs=speed_docs, decode_tokens=decode_tokens,
                                                           error_docs=error_docs))
        elif what == "overhead":
            from pipeline.bench import run_overhead

            run_overhead(model=model, compression_ratio=compression_ratio, out=out,
                         **_given(input=input, task=task, press=press, max_new_tokens=max_new_tokens))
        elif what == "long":
            from pipeline import bench_long

            log = lambda m: out_console.print(m, markup=False, highlight=False)  # noqa: E731
            res = {}
            if per_length:
                res["table"] = bench_long.run(model, split_list(lengths or "6554,20480", int, "--lengths"),
                                              per_length, split_list(presses, str, "--presses"), log=log,
                                              seed=seed, **_given(max_new_tokens=max_new_tokens, window=window))
            if rate_lengths:
                res["rates"] = bench_long.rates(model, split_list(rate_lengths, int, "--rate-lengths"), budget,
                                                log=log)
            if out:
                from pathlib import Path

                Path(out).write_text(json.dumps(res, indent=1))
        else:
            from flows import bench_overhead

            bench_overhead.run(model=model, model_runs=not no_model_runs, as_json=as_json,
                               **_given(input=input, max_new_tokens=max_new_tokens, repeats=repeats))
