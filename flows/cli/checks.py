"""What a command checks before it starts a flow or loads a model: the environment, the input, the model and
the store, each failing in one line (``common.fail``) before any work."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from prefect.logging.handlers import PrefectConsoleHandler
from prefect.settings import get_current_settings

from flows.cli.common import fail, say, user_errors
from flows.deploy import ServerUnavailable, check_server
from flows.output import CONTROL_ESCAPES
from nestedkv.cache import check_group_size, unfit
from pipeline import models
from pipeline.documents import check_input
from pipeline.models import cache_dir_problem
from pipeline.paths import unwritable
from pipeline.spec import BatchSpec
from pipeline.store import Store


_LOG_CONTROL = {c: e for c, e in CONTROL_ESCAPES.items() if chr(c) not in "\n\t"}  # log lines may span lines


class _PrintableLog(logging.Filter):
    """Prefect's log lines quote doc_ids and paths from the input: their control characters shown escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        safe = msg.translate(_LOG_CONTROL)
        if safe != msg:
            record.msg, record.args = safe, None
        return True


def printable_prefect_logs() -> None:
    """Put ``_PrintableLog`` on Prefect's console handlers (importing its flow API, as ``flows.batch`` does,
    makes them)."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)}:
        if not any(isinstance(f, _PrintableLog) for f in handler.filters):
            handler.addFilter(_PrintableLog())


def check_environment(prefect: bool = True) -> None:
    """Environment faults, before any work: one line naming the variable and the fix. ``prefect``: the
    command runs a flow (Prefect's home must be writable, a configured server must answer)."""
    tmp = os.environ.get("TMPDIR")
    if tmp is not None:  # mlx, DuckDB and Prefect's subprocesses take it as it is
        why = "it is empty" if not tmp else unwritable(tmp) or (None if Path(tmp).is_dir() else "no such folder")
        if why:
            fail(f"TMPDIR={tmp}: {why}; point TMPDIR at a writable folder or unset it")
    problem = cache_dir_problem()  # where models are converted, by this command or its flow runs
    if problem:
        fail(problem)
    if not prefect:
        return
    home = os.environ.get("PREFECT_HOME")
    try:
        folder = Path(home) if home else Path.home() / ".prefect"
    except RuntimeError:  # no HOME and no password entry
        fail("HOME is unset and Prefect keeps its files under it; set HOME or PREFECT_HOME to a writable folder")
    why = unwritable(folder)
    if why:
        var = f"PREFECT_HOME={home}" if home else f"HOME={Path.home()} (Prefect keeps its files in ~/.prefect)"
        fail(f"{var}: {why}; set PREFECT_HOME to a writable folder")
    if get_current_settings().api.url:
        try:
            check_server(hint="start it (`prefect server start`) or unset PREFECT_API_URL to run with a "
                              "temporary server of this command's own")
        except ServerUnavailable as exc:
            fail(str(exc))


def exit_on_sigterm() -> None:
    """A terminated flow run still stops Prefect's temporary server (its atexit hook), instead of orphaning it.
    Ctrl-C (SIGINT) stops the batch the same clean way even when the command inherited SIGINT ignored, as a
    non-interactive shell's background job does: Python then keeps it ignored, and the interrupted command went
    on holding the store."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def check_input_early(input: str) -> None:
    """Fail on a missing or damaged input before a flow (and Prefect's temporary server) starts."""
    with user_errors():
        check_input(input, pages=True)


def check_before_flow(spec: BatchSpec, data_path: Optional[str] = None, load: bool = True,
                      defaulted: bool = False) -> BatchSpec:
    """What can be checked before a flow starts is checked here, so an expected error is one line and
    leaves nothing behind: the input's pages, the model (loaded: only loading finds missing weights, a
    damaged file or a model NestedKV cannot compress; the flow reuses this process's copy), that each press
    runs on it, and that the store opens for writing. ``defaulted``: the presses are the command's default
    list, from which those the model cannot run are left out (said in one line) instead of failing.
    ``load=False`` (a fan-out, whose workers load the model): the reference is only resolved. Returns the
    spec to run."""
    check_input_early(spec.input)
    db = spec.db
    with user_errors():
        # a bad reference fails before any loading
        loaded = models.load_model(spec.model, dtype=spec.options.dtype) if load else models.check_reference(spec.model)
        if load:
            check_kv_group_size(loaded[0], spec.configs())
            spec = fitting_presses(loaded[0], spec, defaulted)
        with Store(db, wait_s=spec.options.wait, data_path=data_path, on_wait=lambda waited, total: say(
                f"{db} is held by another writer; waited {waited:.0f} of {total:.0f} s", style="yellow")):
            pass
    return spec


def fitting_presses(model, spec: BatchSpec, defaulted: bool) -> BatchSpec:
    """``spec`` less the presses ``model`` cannot run (``nestedkv.cache.unfit``): left out with one line when
    they are a default list, else the command fails in one line naming the first."""
    why = {}
    for cfg in spec.configs():
        reason = why.get(cfg.press) or unfit(model, cfg.make_press())
        if reason:
            why[cfg.press] = reason
    if not why:
        return spec
    if not defaulted:
        press, reason = next(iter(why.items()))
        fail(f"--press {press}: {reason}")
    kept = [p for p in spec.press if p not in why]
    say(f"not compared on this model: {', '.join(why)} ({next(iter(why.values()))})", style="yellow")
    return BatchSpec.model_validate({**spec.model_dump(), "press": kept})


def check_kv_group_size(model, configs) -> None:
    """A quantization group that does not divide the model's head dimension: one line, before any prefill."""
    for size in sorted({c.kv_group_size for c in configs if c.kv_bits is not None}):
        try:
            check_group_size(model, size)
        except ValueError as exc:
            fail(f"--kv-group-size: {exc}")
