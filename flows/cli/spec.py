"""The batch spec from the command line: the generated press and generation options into one
``BatchSpec`` (validated once, one line naming the field on bad input), and what a batch command prints."""

from __future__ import annotations

from contextlib import contextmanager

import pyarrow as pa
import typer
from rich.text import Text

from flows.cli.checks import printable_prefect_logs
from flows.cli.common import invalid, markup_safe, out_console, print_table, progress_bars, say, split_list
from flows.output import plain
from nestedkv.press import compared_methods
from pipeline.config import BatchOptions, PressSettings, parse_kv_bits, parse_press_param
from pipeline.engine import Hooks
from pipeline.quality import batch_quality, compared
from pipeline.results import OK
from pipeline.spec import FIXED_FIELDS, BatchSpec, scalar_type
from pipeline.store import Store

# Without values these are an error the spec names (nothing to run); the other press options fall back to
# the spec's default.
REQUIRED_LISTS = ("press", "compression_ratio")


def press_grid(press: dict) -> dict:
    """The press options (comma-separated strings, ``--press-param NAME=VALUE``) as the spec's lists."""
    grid = {"press_params": dict(parse_press_param(p) for p in press["press_param"] or [])}
    for name, field in PressSettings.model_fields.items():
        if name in FIXED_FIELDS:
            continue
        raw = press.get(name)  # a setting the caller does not pass takes the spec's default
        if name == "kv_bits":  # 16 and none are words for "not quantized"
            values = [parse_kv_bits(b) for b in (raw or "none").split(",") if b.strip()]
        else:
            values = split_list(raw, scalar_type(field.annotation), "--" + name.replace("_", "-"))
        if values or name in REQUIRED_LISTS:
            grid[name] = values
    return grid


def compared_by_default(press: dict) -> dict:
    """The press options with no ``--press`` given: every press the registry marks as compared."""
    if press["press"] is not None:
        return press
    return {**press, "press": ",".join(compared_methods())}


def build(press: dict, generation: dict, **spec) -> BatchSpec:
    """The batch spec of a command: its press and generation options, and ``spec`` (input, task, model,
    db, reference, evaluate, metrics). Its configurations are expanded here, so bad input fails now."""
    try:
        options = BatchOptions(**generation)  # its own errors name its fields, not options.<field>
        made = BatchSpec(**press_grid(press), options=options, **spec)
        made.configs()
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        invalid(exc)
    return made


@contextmanager
def batch_progress(configs_bar: bool = False):
    """Progress bars for documents, configurations and prefill chunks, as engine hooks."""
    printable_prefect_logs()
    with progress_bars() as bars:
        docs = bars.add_task("documents", total=None)
        cfgs = bars.add_task("configurations", total=None, visible=configs_bar)
        chunks = bars.add_task("prefill", total=None)

        def on_config(i, n, cfg, res):
            bars.update(cfgs, completed=i, total=n, description=markup_safe(f"configurations ({cfg.label()}: {res.status})"))

        yield Hooks(
            on_start=lambda plan: bars.update(docs, total=len(plan.todo_docs)),
            on_prefill=lambda done, total: bars.update(chunks, completed=done, total=total),
            on_config=on_config,
            on_document=lambda i, n, doc, out: bars.update(docs, completed=i, total=n,
                                                           description=markup_safe(f"documents ({doc.doc_id})")),
        )


def print_input_errors(errors) -> None:
    for err in errors:
        say(f"skipped row {err.row} ({err.doc_id or 'no doc_id'}) in {err.source}: {err.field}: {err.message}",
            style="yellow")


def print_savings(savings: list[dict]) -> None:
    if savings:
        print_table(pa.Table.from_pylist(savings), title="memory savings")


OUTPUT_CHARS = 100  # of each document's output in the closing lines; the store holds it whole


def output_line(outcome, with_config: bool) -> str:
    """One document's result in a line: the start of its summary or answers, or why it failed."""
    res = outcome.result
    head = res.doc_id + (f" [{outcome.config.label()}]" if with_config else "")
    if res.status != OK:
        return f"{head}: {res.status}: {res.error or ''}"
    parts = [q.output if q.status == OK else f"({q.status})" for q in res.questions]
    text = " | ".join(" ".join(p.split()) for p in parts)
    cut = text if len(text) <= OUTPUT_CHARS else text[: OUTPUT_CHARS - 3].rstrip() + "..."
    return f"{head}: {cut}"


def print_summary(summary, db: str) -> None:
    print_input_errors(summary.input_errors)
    with_config = len(summary.runs) > 1
    for outcome in summary.outcomes:
        out_console.print(Text(plain(output_line(outcome, with_config))), soft_wrap=True, highlight=False)
    say(
        f"{len(summary.runs)} runs, {summary.n_processed} documents prefilled once each, {summary.n_ok} done, "
        f"{summary.n_failed} failed, {summary.n_skipped} already done, {len(summary.input_errors)} bad rows -> {db}")
    print_savings(summary.savings)


def print_quality(summary, db: str) -> None:
    """This batch's runs against the uncompressed twin (``--compare-full``): the means over its documents of
    the store's evaluation metrics, the twin's own first."""
    with Store(db, read_only=True) as store:
        rows = batch_quality(store, {c.config_hash() for c, _ in summary.runs})
    if compared(rows):
        print_table(pa.Table.from_pylist(rows), title="against the uncompressed run (delta NLL: lower is closer; "
                                                      "source: the document's tenths a summary draws on)")


def exit_unless_done(summary) -> None:
    """Exit 1 with one line unless every valid document is done, now or before (docs/reliability.md: exit codes)."""
    if not summary.all_done:
        say(("error:", "red"), " ", summary.problem())
        raise typer.Exit(1)


