"""Every task: each module here plans one task and registers it with ``plans.task``; all are loaded when the
package is. A new task is a new module (and its test)."""

import importlib
import pkgutil

from pipeline.tasks.plans import KINDS

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

_ordered = sorted(KINDS.items(), key=lambda kv: (kv[1].rank, kv[0]))
KINDS.clear()
KINDS.update(_ordered)

TASKS = tuple(n for n, k in KINDS.items() if k.suite)  # the suite's default set
KNOWN = tuple(KINDS)


def check_tasks(names) -> None:
    """ValueError naming each unknown task (and the known ones), or when none is given."""
    unknown = [t for t in names if t not in KINDS]
    if unknown or not names:
        raise ValueError(f"tasks: unknown {unknown or 'none given'}; known: {', '.join(KNOWN)}")


__all__ = ["KINDS", "KNOWN", "TASKS", "check_tasks"]
