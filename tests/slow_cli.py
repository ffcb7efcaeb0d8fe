"""``python tests/slow_cli.py ARGS``: the ``nkv`` command, instrumented for the reliability tests' signal and
crash cases, which need to act while a batch is between documents.

Each document's start is appended to ``$NKV_TEST_MARKS`` (one doc_id a line). When ``$NKV_TEST_PAUSE_AT``
names a doc_id, that document's start pauses ``$NKV_TEST_PAUSE_S`` seconds (the moment to send a signal);
when ``$NKV_TEST_CRASH_AT`` names one, the process ends there at once, without any cleanup (a crash).
"""

import nestedkv

nestedkv.enable_cpu_fast_path()  # as the nkv entry point does, before pipeline.runner loads mlx

import os
import time

from flows.cli import main
from pipeline.runner import Runner

_start = Runner.start


def start(self, doc):
    with open(os.environ["NKV_TEST_MARKS"], "a") as f:
        f.write(doc.doc_id + "\n")
    if doc.doc_id == os.environ.get("NKV_TEST_CRASH_AT"):
        os._exit(70)
    if doc.doc_id == os.environ.get("NKV_TEST_PAUSE_AT"):
        time.sleep(float(os.environ.get("NKV_TEST_PAUSE_S", "60")))
    return _start(self, doc)


Runner.start = start

if __name__ == "__main__":
    main()
