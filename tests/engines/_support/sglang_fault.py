"""Pure parts of the SGLang GPU fault test (``test_sglang_gpu_failstop.py``): the Engine
arguments and runner spec, and the verdict on a finished run. No torch, no SGLang: checked on
CPU by ``test_sglang_fault_checks.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.engines._support.gpu_common import SGLANG_GPU_ENGINE, SGLANG_GPU_ENV

HEALTHY_STEPS = 12  # decode steps at width 3 (replays of the 4-row graph) before the fault
NEW_TOKENS = 48
STOP_S = 10.0  # deadline (now 1 ns) + agreement interval + release path, with margin
AGREE_EVERY = 4
PROMPTS = [[(37 * r + 11 * i + 5) % 500 + 3 for i in range(9 + 4 * r)] for r in range(3)]

#: the tiny model with the overlap scheduler and decode CUDA graphs, as test_sglang_gpu.py
#: runs it, with mono_ext on
ENGINE: dict[str, Any] = dict(SGLANG_GPU_ENGINE, monokernel=True, monokernel_backend="triton")
ENV = {**SGLANG_GPU_ENV, "MONO_EXT_AGREE_EVERY": str(AGREE_EVERY)}


def runner_spec(model_path: str, root: Path) -> dict[str, Any]:
    """The runner's SPEC: Engine arguments with the fault hook, prompts, paths."""
    record, arm = root / "hook_record.json", root / "arm"
    engine = dict(
        ENGINE,
        model_path=model_path,
        forward_hooks=[
            {
                "name": "mono_ext_fault",
                "target_modules": ["lm_head"],
                "hook_factory": "sglang_fault_hook:factory",
                "config": {"arm": str(arm), "record": str(record), "healthy_steps": HEALTHY_STEPS},
            }
        ],
    )
    assert not engine.get("disable_overlap_schedule"), "the overlap scheduler is the subject"
    return {
        "engine": engine,
        "prompts": PROMPTS,
        "max_tokens": NEW_TOKENS,
        "arm": str(arm),
        "record": str(record),
        "stream_log": str(root / "stream_log.json"),
    }


def verdict(
    out: dict[str, Any], record: dict[str, Any], stream: dict[str, Any], log: str
) -> list[str]:
    """Every way the run failed the fault contract (empty: it passed).

    ``out``: the runner's OUT (reference tokens); ``record``: the hook's record (injection,
    the FailStopError as the scheduler raised it); ``stream``: what reached each request;
    ``log``: the engine's stdout + stderr."""
    bad = []
    ref, got = out.get("reference") or [], stream.get("received") or []
    if len(ref) != len(PROMPTS) or any(len(r) != NEW_TOKENS for r in ref):
        bad.append(f"the reference pass did not finish: {[len(r) for r in ref]}")
    if record.get("injected_at") is None:
        bad.append(f"the deadlines were never cut: {record}")
        return bad
    err = record.get("error") or ""
    if not err:
        bad.append("the engine decoded on after its waits gave up (no FailStopError)")
    else:
        for needle in ("FailStopError", "mono_ext FailStop", "gave up", " CTA ", "wanted tag"):
            if needle not in err:
                bad.append(f"the error does not say {needle!r}: {err[-1500:]}")
        dt = record["error_at"] - record["injected_at"]
        if not 0 <= dt < STOP_S:
            bad.append(f"stopped {dt:.2f}s after the injection (limit {STOP_S}s)")
        if "FailStop" not in log:
            bad.append("the engine log does not name FailStop")
    if len(got) != len(PROMPTS):
        bad.append(f"stream log has {len(got)} requests, want {len(PROMPTS)}")
        return bad
    for row, (r, g) in enumerate(zip(ref, got, strict=False)):
        if g != r[: len(g)]:
            bad.append(f"request {row} got tokens the healthy run never made: {g} vs {r}")
    counts = [len(g) for g in got]
    # prefill makes token 1, each decode step one more; HEALTHY_STEPS replays ran before the
    # cut, and the overlap scheduler may have one more step in flight (healthy: launched
    # before the deadline changed on the stream), plus a step whose waits all found their
    # data at the first poll
    if not counts or max(counts) >= NEW_TOKENS:
        bad.append(f"a request finished despite the fault: {counts}")
    elif max(counts) > HEALTHY_STEPS + 4:
        bad.append(f"too many tokens after the fault: {counts} (healthy steps {HEALTHY_STEPS})")
    return bad
