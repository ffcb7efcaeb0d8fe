"""The synthetic long-context suite: generate (``pipeline.tasks``), calibrate, run the methods, report.

    nkv suite [--size quick|small|standard] [--db suite.duckdb] [--out reports/suite]

1. Generate the documents for the model's tokenizer into ``OUT/suite.parquet`` and record each question's
   task, length, kind and gold parts in the store's ``suite_questions`` table (keyed by doc_id, content
   hash and question_idx: joins to ``outputs`` and, through them, to ``evaluations``).
2. Calibrate: the uncompressed model (``no_press``) answers everything. A (task, length) cell whose
   uncompressed accuracy is below ``threshold`` (0.6) is reported but left out of the headline, and by
   default the methods are not run on it (``all_tasks`` runs them anyway).
3. Every method x ratio x head budget x prefill mode through the engine, one whole-context prefill per
   document, into the same DuckDB store (``evaluations`` gains a ``recall`` metric per question: RULER's
   score, the share of the gold parts found in the answer; ``correct`` for one-part questions). Documents of
   4k tokens and more also run NestedKV's per-scale variants (``bench.ablation``) at r = 0.75 and 0.9.
4. Report (``OUT/suite_report.md``, ``OUT/frontier.png``): accuracy per task x length x configuration; the
   headline, NestedKV against KeyDiff in the same budget mode on the calibrated cells of the longest
   lengths (4k and up when there are any), as paired per-question counts (better / worse / same) with the
   mean difference and its standard error; and accuracy against resident KV bytes per document.

A re-run resumes: the engine skips (configuration, document) pairs already stored.

Modules: ``options`` (what a suite runs), ``scores`` (recall rows, calibration, pairing), ``report`` (tables
and plot); here, the run itself. Every name is importable from ``pipeline.suite``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pipeline.engine
from pipeline import models
from pipeline.documents import sha256_hex
from pipeline.engine import NO_HOOKS
from pipeline.store import Store
# Re-exported: importers name pipeline.suite, whichever module defines the name.
from pipeline.suite.options import (ABLATION_FILE, HEADLINE_RATIOS, LONG_FROM, MARKDOWN_NAME, METHODS_FILE,  # noqa: F401
                                    PLOT_NAME, PREFILLS_DIR, QUESTIONS_FILE, SUITE_FILE, SUMMARY_FILE, CUT_FILE, SuiteOptions,
                                    SuiteResult, methods)
from pipeline.suite.report import (ablation_table, colour, accuracy_tables, headline_table, plot_frontier,  # noqa: F401
                                   resident_mib, summary_table, write_report)
from pipeline.suite.scores import (RECALL, calibration, headline, label, paired, question_rows, recall,  # noqa: F401
                                   register, score, score_coverage)
from pipeline.tasks import SIZES, generate, length_label, token_counter, write


def run_suite(opts: SuiteOptions, *, runner=None, count=None, hooks=None, log=print) -> SuiteResult:
    """Generate, calibrate, run the methods on the calibrated cells, score and report. ``count``: the token
    counter (default: the model's tokenizer); ``runner``: an engine runner (default: the model's)."""
    run = pipeline.engine.run  # looked up per call: callers and tests may replace it in pipeline.engine
    hooks = hooks or NO_HOOKS
    stage: dict[str, float] = {}
    t0 = time.perf_counter()
    if count is None:
        count = token_counter(models.load_model(opts.model)[1])  # through the module: tests replace it there
    if opts.summaries_only:
        summaries = run_summaries(opts, count, hooks, log, stage)
        with Store(opts.db) as store:
            score_coverage(store, summaries)
            return write_report(store, opts, [], stage, summaries)
    size = SIZES[opts.size]
    docs = generate(count, opts.lengths or size.lengths, opts.per_task or size.per_task, opts.seed, opts.tasks,
                    Path(opts.austen) if opts.austen else None)
    out = opts.out_dir
    out.mkdir(parents=True, exist_ok=True)
    suite = write(docs, out / SUITE_FILE)
    with Store(opts.db) as store:
        register(store, docs, out)
    stage["generate"] = time.perf_counter() - t0
    log(f"{suite}: {len(docs)} documents, {sum(len(d['questions']) for d in docs)} questions "
        f"({stage['generate']:.0f} s)")

    engine, wait_s = opts.engine(), opts.options.wait
    t0 = time.perf_counter()
    run(str(suite), [opts.base().reference()], opts.db, engine, hooks=hooks, runner=runner, wait_s=wait_s)
    with Store(opts.db) as store:
        score(store)
        hashes = [opts.base().reference().config_hash()]
        scores = store.suite_scores(hashes, [sha256_hex(d["text"]) for d in docs], RECALL)
    calib = calibration(scores, opts.threshold)
    stage["calibrate"] = time.perf_counter() - t0
    for c in calib:
        log(f"calibration {c['task']} {length_label(c['length'])}: {c['accuracy']:.2f} over {c['n']} questions"
            + ("" if c["headline"] else f" (below {opts.threshold:g}: left out of the headline)"))

    keep = {(c["task"], c["length"]) for c in calib if c["headline"] or opts.all_tasks}
    todo = [d for d in docs if (d["task"], d["length"]) in keep]
    t0 = time.perf_counter()
    configs, ablation = opts.configs(), list(opts.ablation_configs())
    # the long documents run the ablation variants too, from the same one prefill
    is_long = [bool(ablation) and d["length"] >= opts.long_from for d in todo]
    long = [d for d, lg in zip(todo, is_long) if lg]
    short = [d for d, lg in zip(todo, is_long) if not lg]
    for part, want, name in ((short, configs, METHODS_FILE),
                             (long, configs + [c for c in ablation if c not in configs], ABLATION_FILE)):
        if part and configs:  # no methods: calibration only
            log(f"{len(want)} configurations on {len(part)} documents")
            run(str(write(part, out / name)), want, opts.db, engine, hooks=hooks, runner=runner, wait_s=wait_s)
    stage["methods"] = time.perf_counter() - t0
    summaries = run_summaries(opts, count, hooks, log, stage)
    with Store(opts.db) as store:
        score(store)
        score_coverage(store, summaries)
        return write_report(store, opts, docs, stage, summaries)


def run_summaries(opts: SuiteOptions, count, hooks, log, stage: dict) -> list[dict]:
    """The summary stage: every configuration on the summary documents, the uncompressed model on their
    middle cuts too; returns the documents (none without ``opts.summaries`` or compared presses)."""
    summaries = opts.summary_documents(count)
    if not summaries or not opts.presses:
        return []
    run = pipeline.engine.run
    engine, wait_s = opts.engine(), opts.options.wait
    t0 = time.perf_counter()
    configs = opts.configs(opts.summary_base())
    whole = [d for d in summaries if d["task"] == "summary"]
    cuts = [d for d in summaries if d["task"] != "summary"]
    log(f"summaries: {len(configs)} configurations on {len(whole)} documents, the uncompressed model on "
        f"{len(cuts)} middle cuts")
    run(str(write(whole, opts.out_dir / SUMMARY_FILE)), configs, opts.db, engine, hooks=hooks, runner=None,
        wait_s=wait_s)
    if cuts:  # what the coverage measure gives for a lost middle: the uncompressed model on the ends alone
        run(str(write(cuts, opts.out_dir / CUT_FILE)), [configs[0].reference()], opts.db, engine, hooks=hooks,
            runner=None, wait_s=wait_s)
    stage["summaries"] = time.perf_counter() - t0
    return summaries

