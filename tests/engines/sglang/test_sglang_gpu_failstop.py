"""FailStop end to end in SGLang 0.5.17 on a CUDA GPU: a wait that gives up mid-decode stops
the engine with an error naming the wait, and no token of the failed step, or of any later
one, reaches a request.

One engine (``sglang_fault_runner.py`` in a fresh process, its scheduler in another: tiny
Qwen3-Next, ``Engine(monokernel=True, monokernel_backend="triton")``, decode CUDA graphs,
SGLang's overlap scheduler on; arguments in ``_support/sglang_fault.py``) first decodes the prompts
with nothing injected (the reference), then streams them again; after ``HEALTHY_STEPS``
routed decode replays every mono_ext wait deadline is cut to 1 ns on the device
(``sglang_fault_hook.py``, inside the scheduler), so the kernels' next waits give up as a
stalled wait does when its deadline passes. Asserted (``sglang_fault.verdict``):

* the scheduler raised FailStopError's message (a wait that gave up, named by region and CTA)
  within ``STOP_S`` of the injection (the deadline is gone, so this bounds the agreement
  interval, ``MONO_EXT_AGREE_EVERY``, and the release path);
* every request received a prefix of its reference tokens: the kernels are batch-invariant and
  deterministic, so a token of a failed step (computed from bailed-out waits) would differ;
* few tokens came after the injection (the overlap scheduler may have launched the next step
  before the deadline changed on the stream; that step is healthy), none finished.

Skips without CUDA, without SGLang's CUDA build, or on SGLang with the kernel-plugin API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines._support.gpu_common import export_result, require_sglang_gpu
from tests.engines._support.sglang_fault import ENV, runner_spec, verdict

require_sglang_gpu()

pytestmark = pytest.mark.gpu

SUPPORT = Path(__file__).resolve().parents[1] / "_support"  # the runner and the hook factory
TIMEOUT_S = 560


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory):
    from mono_ext.tools.checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("sglang-fault")
    ckpt = make_checkpoint(root / "qwen3-next-tiny", "qwen3-next-tiny", seed=0)
    spec = runner_spec(str(ckpt), root)
    spec_path, out_path = root / "spec.json", root / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **ENV}
    env.pop("MONO_EXT_SGLANG_MONOKERNEL", None)
    # the hook factory is imported by name in the scheduler process
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "sglang_fault_runner.py"), str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        start_new_session=True,
    )
    log = proc.stdout + proc.stderr
    (root / "engine.log").write_text(log)

    def load(p):
        p = Path(p)
        return json.loads(p.read_text()) if p.exists() else {}

    result = {
        "rc": proc.returncode,
        "out": load(out_path),
        "record": load(spec["record"]),
        "stream": load(spec["stream_log"]),
    }
    export_result("sglang_runs", "gpu_fault", result)
    print(f"\nrunner rc {proc.returncode}; hook record {result['record']}")
    print("\n".join(ln for ln in log.splitlines() if "mono_ext" in ln or "FailStop" in ln)[-4000:])
    return result, log


def test_the_engine_stops_and_no_failed_token_reaches_a_request(fault_run):
    r, log = fault_run
    problems = verdict(r["out"], r["record"], r["stream"], log)
    assert not problems, "\n".join(problems) + f"\n--- engine log tail ---\n{log[-6000:]}"


def test_decode_steps_were_routed_before_the_fault(fault_run):
    r, _ = fault_run
    rec = r["record"]
    assert rec.get("armed") and rec.get("runtimes", 0) >= 1, rec
    # the hook counted HEALTHY_STEPS replays after the reference pass: every one routed
    assert rec["injected_after_replays"] - rec["replays_before_arm"] >= 1, rec
    assert 0 <= rec["queued"] - rec["released"] <= 2, rec  # at most the steps in flight
