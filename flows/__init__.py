"""Prefect flows and deployments, and the CLI that starts them."""

import os

# Before prefect is imported (its settings are read once): the temporary local server's telemetry
# heartbeat fails offline and races the fresh SQLite database, and its start can exceed Prefect's
# 20 s default on a busy 2-core machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
