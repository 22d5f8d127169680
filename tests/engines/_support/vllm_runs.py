"""One vLLM ``LLM`` run in a fresh subprocess (``engine_runner.py``), for the vLLM e2e tests
(conftest's named runs, test_vllm_quant's checkpoint runs). Environment of every run:
``TORCHDYNAMO_DISABLE=1``, ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` and one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless ``env_extra`` says otherwise (tests/engines/vllm/conftest.py
says why); ``MONO_EXT_CHECK`` / ``VLLM_PLUGINS`` only when the run sets them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RUNNER = Path(__file__).with_name("engine_runner.py")
FAULT_RUNNER = Path(__file__).with_name("fault_runner.py")  # test_vllm_gpu_failstop's engine


def run_engine(
    root: Path,
    name: str,
    spec: dict[str, Any],
    env_extra: dict[str, str],
    timeout: float,
    runner: Path = RUNNER,
) -> tuple[dict[str, Any], str]:
    """(the runner's result, its stdout + stderr); the log is also kept as ``root/name.log``.
    A run that fails fails the test with the log's tail. ``runner``: the script run
    (``SCRIPT SPEC.json OUT.json``)."""
    spec_path, out_path = root / f"{name}.json", root / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "TORCHDYNAMO_DISABLE": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        **env_extra,
    }
    for var in ("MONO_EXT_CHECK", "VLLM_PLUGINS"):  # only what the run itself sets
        if var not in env_extra:
            env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, str(runner), str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = proc.stdout + proc.stderr
    (root / f"{name}.log").write_text(log)
    if proc.returncode != 0:
        pytest.fail(f"engine run {name!r} failed (rc {proc.returncode}):\n{log[-6000:]}")
    return json.loads(out_path.read_text()), log
