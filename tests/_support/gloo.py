"""Leaving a gloo process group from a test's spawned rank without the teardown abort.

Ranks that tear gloo down as their processes exit now and then abort one of them ("terminate
called without an active exception": a gloo thread still joinable while the interpreter
unwinds), whatever the test computed, and even after a barrier and destroy_process_group. A
rank therefore hands over its results first, waits for its peer, and leaves through
``os._exit``, which runs no destructors; the operating system closes what gloo held.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def leave(dist: Any, results: Any = None) -> None:
    """End a spawned rank: flush ``results`` (a ``multiprocessing`` queue, if the rank reports
    through one), wait for every rank, exit with status 0."""
    if results is not None and hasattr(results, "join_thread"):
        results.close()
        results.join_thread()  # the queue's feeder thread dies with os._exit: drain it first
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
    os._exit(0)
