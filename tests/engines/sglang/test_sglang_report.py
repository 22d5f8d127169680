"""The SGLang 0.5.17 adapter's report: ``Engine.collective_rpc("mono_ext_report", path=DIR)``
writes what each rank ran (the GPU e2e test reads it; the scheduler runs in another process).

Checked on CPU with SGLang's own model classes (``_support/sglang_common.py``) and SGLang's
own ``Scheduler.handle_rpc_request`` (on a stand-in scheduler): the hook is registered, an RPC
of that name writes the file and is answered as a success, other RPCs are untouched; the
report counts decode-graph replays by graph batch size, released steps and stock decode steps.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from mono_ext.core.spec import Step  # noqa: E402
from mono_ext.engines.sglang import has_native_api, plugin  # noqa: E402
from mono_ext.engines.sglang.dispatch import Router, install, uninstall  # noqa: E402
from mono_ext.engines.sglang.report import REPORT_RPC, runner_report  # noqa: E402
from mono_ext.engines.sglang.serving import SERVING_ATTR  # noqa: E402
from mono_ext.runtime.failstop import FailStop, ScriptedHealthSource  # noqa: E402
from mono_ext.tools.checkpoint import make_checkpoint  # noqa: E402
from tests.engines._support.sglang_common import (  # noqa: E402
    Spy,
    persistent_launches,
    process_result,
)
from tests.engines._support.sglang_common import active as _active  # noqa: E402
from tests.engines._support.sglang_common import after_forward as _forward  # noqa: E402
from tests.engines._support.sglang_common import load_with_tensors as _load  # noqa: E402

if has_native_api():
    pytest.skip("SGLang with the kernel-plugin API", allow_module_level=True)

RPC_TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request"


@pytest.fixture(scope="module")
def qn(tmp_path_factory):
    return _load(make_checkpoint(tmp_path_factory.mktemp("qn"), "qwen3-next-tiny"))


@pytest.fixture
def routed(qn):
    """An active deployment whose router recorded decode graphs of batch sizes 1..16 (routed)
    and 24 (stock), as after capture; the runner SGLang would hold it on."""
    sv, *_ = _active(qn)
    shared = persistent_launches(sv)
    router = Router(sv, Spy())
    install(qn.model, router)
    router.captured = {
        bs: (Step(bs, sv.spec.build_key(bs)) if bs <= 16 else None) for bs in (1, 2, 4, 8, 16, 24)
    }
    runner = SimpleNamespace(model=qn.model, **{SERVING_ATTR: sv})
    yield runner, router, shared
    uninstall(qn.model)


def test_the_rpc_hook_is_registered():
    assert (RPC_TARGET, "AROUND", plugin._around_handle_rpc_request) in plugin.HOOKS


def test_flag_off_runner_reports_no_state(qn):
    assert runner_report(SimpleNamespace(model=qn.model))["state"] is None


def test_report_counts_replays_by_graph_size_releases_and_stock_decode(qn, routed):
    runner, router, shared = routed
    for bs, graph_bs in ((3, 4), (1, 1), (8, 8), (3, 4)):
        _forward(qn, bs=bs, graph_bs=graph_bs)
        process_result()
    _forward(qn, bs=20, graph_bs=24)  # a stock graph: a stock decode step
    _forward(qn, mode="EXTEND", bs=2)  # prefill: neither
    r = runner_report(runner)
    assert (r["state"], r["backend"], r["refusals"], r["stage"]) == (
        "on",
        "reference",
        [],
        "caches",
    )
    assert r["widths"] == list(router.serving.spec.deployment.widths)
    assert r["captured"] == {"1": 1, "2": 2, "4": 4, "8": 8, "16": 16, "24": None}
    assert r["replayed"] == {"1": 1, "4": 2, "8": 1}
    assert (r["replayed_steps"], r["queued"], r["released"], r["stock_decode"]) == (4, 4, 4, 1)
    assert shared["releases"] == 4
    assert r["failstop"] is None  # the reference launches have no shared runtime
    json.dumps(r)  # what the RPC writes


def test_report_reads_the_failstop_of_a_shared_runtime(qn, routed):
    runner, router, _ = routed
    fs = FailStop(ScriptedHealthSource(), agree_every=16)
    runtime = SimpleNamespace(steps=7, failstop=fs)
    fs.last_seen_step = 7
    router.serving.driver.launches = {1: SimpleNamespace(runtime=runtime)}
    assert runner_report(runner)["failstop"] == {
        "state": "ok",
        "steps": 7,
        "last_seen_step": 7,
        "first_failed_step": None,
    }


def test_the_rpc_writes_the_report_through_sglangs_handler(qn, routed, tmp_path, monkeypatch):
    from sglang.srt.managers import scheduler as sched_mod
    from sglang.srt.managers.io_struct import RpcReqInput

    runner, router, _ = routed
    _forward(qn, bs=1, graph_bs=1)
    monkeypatch.setattr(sched_mod, "barrier", lambda group=None: None)  # one rank, no group
    original = sched_mod.Scheduler.__dict__["handle_rpc_request"]
    original = getattr(original, "__wrapped__", original)  # SGLang's own, whether hooked or not
    fake = SimpleNamespace(
        tp_rank=0,
        tp_worker=SimpleNamespace(model_runner=runner),
        tp_group=SimpleNamespace(cpu_group=None),
    )

    out = plugin._around_handle_rpc_request(
        original, fake, RpcReqInput(method=REPORT_RPC, parameters={"path": str(tmp_path)})
    )
    assert out.success, out.message
    written = json.loads((tmp_path / f"{REPORT_RPC}.tp0.json").read_text())
    assert (written["state"], written["tp_rank"], written["replayed"]) == ("on", 0, {"1": 1})

    other = plugin._around_handle_rpc_request(original, fake, RpcReqInput(method="no_such"))
    assert not other.success  # SGLang's answer for an unknown method, unchanged
    assert "no_such" not in vars(fake)
