"""Prefect's temporary local API server, owned by the command that needs it and never outliving it.

Without a configured server (``PREFECT_API_URL``), Prefect starts a temporary one in a subprocess and
stops it at exit; a SIGKILL skips that and leaves the server running forever, holding a port and memory.
The server started here runs under a watcher that exits as soon as its parent process is gone, on Linux
and macOS alike (no parent-death signal needed). ``python -m flows.local_server PARENT_PID ARGS...`` is
that watcher: it runs ``uvicorn ARGS`` in-process beside a thread polling the parent.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import prefect
from prefect.logging.handlers import APILogHandler
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

POLL_S = 0.5


@contextmanager
def local_api() -> Iterator[None]:
    """Within the block, flows talk to the configured Prefect server or, when none is configured, to a
    temporary one tied to this process."""
    if get_current_settings().api.url:
        yield
        return
    server = OwnedServer()
    server.start()
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield
            finally:
                _flush_logs()  # while the server still listens: queued run logs would be lost (and complain)
    finally:
        server.stop()


def _flush_logs() -> None:
    try:
        APILogHandler.flush(APILogHandler())
    except Exception:  # logs are a report: never fail the command over them
        pass


class OwnedServer(SubprocessASGIServer):
    """Prefect's temporary server whose process is the watcher above."""

    _instances: dict = {}  # not shared with Prefect's own temporary servers

    def _run_uvicorn_command(self) -> subprocess.Popen:
        args = ["--app-dir", str(prefect.__module_path__.parent), "--factory", "prefect.server.api.server:create_app",
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
               **get_current_settings().to_environment_variables(exclude_unset=True)}
        return subprocess.Popen([sys.executable, "-m", "flows.local_server", str(os.getpid()), *args], env=env)


def _watch(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(0)  # the parent died (we were re-parented): nothing is left to serve
        time.sleep(POLL_S)


def main(argv: list[str]) -> None:
    parent = int(argv[0])
    threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    sys.argv = ["uvicorn", *argv[1:]]
    runpy.run_module("uvicorn", run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
