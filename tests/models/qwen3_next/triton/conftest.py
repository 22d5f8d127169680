"""Qwen3-Next's Triton kernel tests (K1, K2, the triton backend): on an NVIDIA device, or
compiled offline.

The modules in ``INTERPRETED`` also run on Triton's CPU interpreter at tiny shapes: they carry
the ``interpreter`` marker (tools/test.sh runs ``-m interpreter`` with
``TRITON_INTERPRET=1``), and with that variable set the interpreter is patched to compute what
the GPU does (tests/_support/triton_interpreter.py) before any kernel runs. Without a CUDA device
or the variable, they skip themselves.
"""

import os
from pathlib import Path

from tests._support.markers import mark_folder
from tests._support.triton_interpreter import patch_triton_interpreter

HERE = Path(__file__).parent
INTERPRETED = ("test_k1.py", "test_k2_sync.py", "test_k2_tiny.py", "test_k2_topk.py")

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    patch_triton_interpreter()


def pytest_collection_modifyitems(config, items):
    mark_folder(items, HERE, "interpreter", INTERPRETED)
