"""Prefect flows and deployments, and the CLI that starts them.

Every process of the application (the ``nkv`` CLI, a Prefect worker or server running a flow) imports this
package first, so it is where the process opts in to the CPU fast path: mlx binds its BLAS when it loads, and
the modules of bench, pipeline and flows import mlx at their top. This is the one place the opt-in waits on
import order; ``import nestedkv`` and ``import pipeline`` alone still change nothing in the process.
"""

import os
import warnings

import nestedkv
from nestedkv._platform import MISSING_OPENBLAS

# Before prefect is imported (its settings are read once): the temporary local server's telemetry
# heartbeat fails offline and races the fresh SQLite database, and its start can exceed Prefect's
# 20 s default on a busy 2-core machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

with warnings.catch_warnings():  # a missing OpenBLAS is said in one line when a model loads (pipeline.models)
    warnings.filterwarnings("ignore", message=MISSING_OPENBLAS, category=RuntimeWarning)
    nestedkv.enable_cpu_fast_path()
