"""The CPU-checkable parts of ``test_sglang_gpu_failstop.py``: its Engine arguments and
runner spec, and its verdict on synthetic results (a clean fault, and each way to fail)."""

from __future__ import annotations

import copy

import pytest

import tests.engines._support.sglang_fault as f

REF = [[(7 * r + i) % 500 for i in range(f.NEW_TOKENS)] for r in range(len(f.PROMPTS))]
ERR = (
    "FailStopError: mono_ext FailStop: a device wait gave up at step 14: region k1 CTA 3 "
    "wanted tag 14"
)


def _good():
    out = {"reference": copy.deepcopy(REF)}
    rec = {"armed": True, "injected_at": 100.0, "error": ERR, "error_at": 100.2, "runtimes": 1}
    stream = {"received": [r[: f.HEALTHY_STEPS + 1] for r in REF]}
    return out, rec, stream, "... mono_ext FailStop ..."


def test_spec_keeps_overlap_and_graphs_and_hooks_the_scheduler(tmp_path):
    spec = f.runner_spec("/m", tmp_path)
    eng = spec["engine"]
    assert eng["model_path"] == "/m" and eng["monokernel_backend"] == "triton"
    assert "disable_overlap_schedule" not in eng and "disable_cuda_graph" not in eng
    assert eng["cuda_graph_bs_decode"] == [1, 2, 4, 8, 16]
    (hook,) = eng["forward_hooks"]
    assert hook["hook_factory"] == "sglang_fault_hook:factory"
    assert hook["config"]["healthy_steps"] == f.HEALTHY_STEPS
    assert spec["arm"] == hook["config"]["arm"] and spec["record"] == hook["config"]["record"]
    assert f.ENV["MONO_EXT_SERVE_UNMEASURED"] == "1"


def test_a_clean_fault_passes():
    assert f.verdict(*_good()) == []


def test_each_broken_contract_is_named():
    out, rec, stream, log = _good()
    assert any("never cut" in p for p in f.verdict(out, {"injected_at": None}, stream, log))
    assert any("decoded on" in p for p in f.verdict(out, {**rec, "error": None}, stream, log))
    slow = {**rec, "error_at": rec["injected_at"] + f.STOP_S + 1}
    assert any("after the injection" in p for p in f.verdict(out, slow, stream, log))
    vague = {**rec, "error": "RuntimeError: boom"}
    assert any("CTA" in p for p in f.verdict(out, vague, stream, log))
    wrong = copy.deepcopy(stream)
    wrong["received"][1][-1] += 1  # a token the healthy run never made
    assert any("request 1" in p for p in f.verdict(out, rec, wrong, log))
    done = {"received": copy.deepcopy(REF)}
    assert any("finished" in p for p in f.verdict(out, rec, done, log))
    late = {"received": [r[: f.HEALTHY_STEPS + 10] for r in REF]}
    assert any("too many" in p for p in f.verdict(out, rec, late, log))


def test_the_hook_records_a_failstop_raised_where_sglang_processes_the_result(tmp_path):
    """FailStop raises at the release in SGLang's result processing, not in ``after_forward``:
    the hook must write that error to its record (the scheduler dies right after)."""
    import json

    from mono_ext.engines.sglang.dispatch import ROUTED_ATTR
    from mono_ext.engines.sglang.release import pending
    from mono_ext.runtime.release import Ticket
    from tests.engines._support import sglang_fault_hook as hook

    class Router:
        replayed_steps, queued, released = 5, 5, 4

        def after_forward(self, *args):
            return None

    class Model:
        pass

    def stalled():
        raise RuntimeError("mono_ext FailStop at step 5: rank 0 CTA 7 wanted tag 0x9, gave up")

    model = Model()  # the factory reads its caller's local ``model``, as SGLang calls it
    setattr(model, ROUTED_ATTR, Router())
    record = tmp_path / "record.json"
    queue = pending()
    try:
        hook.factory({"arm": str(tmp_path / "arm"), "record": str(record), "healthy_steps": 1})
        queue.add(Ticket(stalled, width=1))
        with pytest.raises(RuntimeError, match="wanted tag"):
            queue.release(queue.take())
    finally:
        vars(queue).pop("release", None)  # the class's own release again
    rec = json.loads(record.read_text())
    assert rec["error"].startswith("RuntimeError: mono_ext FailStop at step 5")
    assert rec["error_at"] > 0 and rec["report_replayed_steps"] == 5
