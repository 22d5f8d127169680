"""FailStop in the SGLang 0.5.17 adapter: the after-hook on ``ModelRunner.forward`` queues a
release ticket for every routed step (eager, or a decode-graph replay found by the graph's
padded batch size) without waiting; the batch result takes its tickets and the scheduler's
result processor releases them before it hands the tokens out, or raises; and the build gets
SGLang's GDN state dtypes.

SGLang's own model classes are built on CPU (``_support/sglang_common.py``); the driver's
launches get the per-step hooks of a persistent backend over a real :class:`FailStop` reading a
fake health block (``sglang_common.Persistent``). A "replay" is what SGLang does on the host
for one: ``ModelRunner.forward`` returns ``can_run_graph=True`` without entering the router.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from mono_ext.core.spec import Step  # noqa: E402
from mono_ext.engines.sglang import has_native_api, plugin, release  # noqa: E402
from mono_ext.engines.sglang.dispatch import Router, install, uninstall  # noqa: E402
from mono_ext.runtime.failstop import FailStopError  # noqa: E402
from mono_ext.tools.checkpoint import make_checkpoint  # noqa: E402
from tests.engines._support.sglang_common import (  # noqa: E402, F401 (Persistent: report)
    Persistent,
    Spy,
    persistent_launches,
    process_result,
)
from tests.engines._support.sglang_common import active as _active  # noqa: E402
from tests.engines._support.sglang_common import after_forward as _forward  # noqa: E402
from tests.engines._support.sglang_common import batch as _batch  # noqa: E402
from tests.engines._support.sglang_common import load_with_tensors as _load  # noqa: E402
from tests.engines._support.sglang_common import pools as _pools  # noqa: E402
from tests.engines._support.sglang_common import serving as _serving  # noqa: E402

if has_native_api():  # the 0.5.17 adapter's hooks; SGLang with the kernel-plugin API has native_api
    pytest.skip("SGLang with the kernel-plugin API", allow_module_level=True)


@pytest.fixture(scope="module")
def qn(tmp_path_factory):
    return _load(make_checkpoint(tmp_path_factory.mktemp("qn"), "qwen3-next-tiny"))


@pytest.fixture
def routed(qn):
    sv, *_ = _active(qn)
    shared = persistent_launches(sv)
    router = Router(sv, Spy())
    install(qn.model, router)
    # what capturing decode graphs of batch sizes 1, 2, 4, 8, 16, 24 records
    router.captured = {
        bs: (Step(bs, sv.spec.build_key(bs)) if bs <= 16 else None) for bs in (1, 2, 4, 8, 16, 24)
    }
    yield router, shared
    uninstall(qn.model)


def test_the_failstop_hooks_are_registered():
    hooks = set(plugin.HOOKS)
    assert (
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        "AFTER",
        plugin._after_forward,
    ) in hooks
    assert (release.WORKER_TARGET, "AFTER", release.after_forward_batch_generation) in hooks
    for kind in ("decode", "prefill", "idle"):
        target = (
            "sglang.srt.managers.scheduler_components.batch_result_processor."
            f"SchedulerBatchResultProcessor.process_batch_result_{kind}"
        )
        assert (target, "BEFORE", release.before_process_batch_result) in hooks


def test_the_hook_targets_exist_in_this_sglang():
    import importlib

    for target in (release.WORKER_TARGET, *release.PROCESS_TARGETS):
        module, cls, method = target.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(module), cls), method)), target


def test_each_replay_of_a_routed_graph_is_released_when_its_result_is_processed(qn, routed):
    router, shared = routed
    for n, (bs, graph_bs) in enumerate(((3, 4), (1, 1), (8, 8), (3, 4)), start=1):
        assert _forward(qn, bs=bs, graph_bs=graph_bs) is None  # SGLang's result is kept
        assert (shared["steps"], shared["releases"]) == (n, n - 1), "the forward must not wait"
        process_result()
    assert (shared["steps"], shared["releases"], shared["asked"]) == (4, 4, [1, 2, 3, 4])
    assert (router.replayed_steps, router.released) == (4, 4)
    assert shared["src"].waits == [1, 2, 3, 4]  # only the result processor waits
    _forward(qn, bs=20, graph_bs=24)  # a stock graph
    _forward(qn, mode="EXTEND", bs=2, can_run_graph=True)  # a prefill graph: never routed
    _forward(qn, bs=3, can_run_graph=False)  # an eager decode the router did not see: stock
    process_result()
    assert (shared["steps"], shared["releases"]) == (4, 4)


def test_the_overlap_scheduler_releases_each_result_with_its_own_steps(qn, routed):
    router, shared = routed
    _forward(qn, bs=2, graph_bs=2)
    first = _taken()  # batch 1's result, back from forward_batch_generation
    _forward(qn, bs=4, graph_bs=4)  # the next batch runs before the first one's result
    release.before_process_batch_result(None, None, first)
    assert shared["asked"] == [1] and shared["src"].waits == [1], "batch 2 must not be waited"
    process_result()
    assert shared["asked"] == [1, 2] and router.released == router.queued == 2


def _taken():
    result = SimpleNamespace(copy_done=None)
    release.after_forward_batch_generation(result, None, None)
    return result


def test_a_failed_wait_raises_before_sglang_hands_out_the_tokens(qn, routed):
    router, shared = routed
    _forward(qn, bs=2, graph_bs=2)
    process_result()
    shared["src"].fail()  # the next step's wait gives up; its copy lands by its result
    _forward(qn, bs=2, graph_bs=2)
    with pytest.raises(FailStopError, match="gave up"):
        process_result()
    with pytest.raises(FailStopError):  # sticky
        _forward(qn, bs=1, graph_bs=1)
    assert router.released == 1


def test_eager_steps_seen_by_the_router(qn, routed):
    router, shared = routed
    fb = _batch("EXTEND", 2, tokens_per_row=3)
    qn.model.forward(fb.input_ids, torch.zeros(6, dtype=torch.long), fb)  # stock, eager
    _forward(qn, mode="EXTEND", bs=2, can_run_graph=False)
    assert (shared["steps"], shared["releases"]) == (0, 0)
    step = router.captured[4]
    driver = router.serving.driver
    driver._finished = driver.launches[4].end_step()  # as the driver's run() does, eagerly
    router._pending = ("eager", step)  # as Router.__call__ leaves a routed eager step
    _forward(qn, bs=4, can_run_graph=False)
    process_result()
    assert (shared["steps"], shared["releases"], router.released) == (1, 1, 1)
    assert router.replayed_steps == 0


def test_a_stale_eager_record_does_not_hide_a_replay(qn, routed):
    """A forward outside ModelRunner.forward (a warmup) leaves its record behind: the next
    replay, by SGLang's can_run_graph, is still checked as a replay."""
    router, shared = routed
    router._pending = ("eager", router.captured[4])
    _forward(qn, bs=2, graph_bs=2)
    process_result()
    assert (shared["steps"], shared["releases"], router.replayed) == (1, 1, {2: 1})


def test_captures_record_decode_graphs_only(qn, routed):
    """The plan of each captured decode graph is recorded; a prefill graph captured at the
    same batch size afterwards does not replace it."""
    router, _ = routed
    router.captured.clear()
    router.capturing = lambda: True
    for mode, bs in (("DECODE", 24), ("DECODE", 4), ("EXTEND", 4)):
        router.note(_batch(mode, bs), None if bs > 16 else router.plan(_batch(mode, bs)))
    assert {bs: s and s.width for bs, s in router.captured.items()} == {24: None, 4: 4}
    assert router._pending is None  # a capture runs nothing


def test_without_a_router_the_hook_does_nothing(qn):
    runner = SimpleNamespace(model=qn.model, decode_cuda_graph_runner=None)
    assert plugin._after_forward("result", runner, _batch("DECODE", 1)) is None


def test_build_extra_has_sglangs_state_dtypes_and_a_wrong_state_is_refused(qn, monkeypatch):
    sv, *_ = _active(qn)
    extra = sv.build_extra
    assert extra["conv_dtype"] == "bfloat16" and extra["ssm_dtype"] == "float32"
    assert extra["a_log_dtype"] == "float32" and extra["positions_dtype"] == "int64"
    assert extra["max_positions"] == (
        qn.sa.context_length or qn.mc.hf_config.max_position_embeddings
    )
    rp, kvp = _pools(qn.mc)  # SGLang's pools as allocated by default: fp32 ssm
    monkeypatch.setenv("SGLANG_MAMBA_SSM_DTYPE", "bfloat16")  # a build for bf16 states
    sv = _serving(qn)
    assert sv.build_extra["ssm_dtype"] == "bfloat16"
    refusal = sv.accept_caches(rp, kvp)
    assert refusal and "ssm_state is float32, the launches were built for bfloat16" in str(
        refusal.message()
    )
