"""``DecodeDriver.after_step``: the host side of a step that an engine calls right after every
eager step and every graph replay; it never waits for the device and returns the step's
ticket, which the engine releases where it awaits the step's tokens.

The launches here are the reference backend's (so the driver computes a real step) with the
per-step hooks of a persistent backend over a real :class:`FailStop` reading a fake health
block: ``end_step`` counts the step and hands the health words to FailStop (a no-op while
capturing), ``release`` asks FailStop whether the step's tokens may go. A "replay" is what a
CUDA graph replay does on the host: nothing of the driver runs, only ``after_step``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mono_ext.core.backends import load_target  # noqa: E402
from mono_ext.core.spec import BuildContext, Deployment  # noqa: E402
from mono_ext.core.views import ConfigView, StepView  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.driver import (  # noqa: E402
    DecodeDriver,
    StepInputs,
    StepWithheld,
)
from mono_ext.models.qwen3_next.launches import BoundLayer  # noqa: E402
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec  # noqa: E402
from mono_ext.runtime.failstop import (  # noqa: E402
    FAILED,
    SUSPECT,
    FailStop,
    FailStopError,
    ScriptedHealthSource,
)

BF16 = torch.bfloat16
SLOTS, NULL = 6, 0


class Runtime:
    """The per-step hooks of a persistent backend (as the Triton runtime has them)."""

    def __init__(self, world: int = 1, lagging: bool = False) -> None:
        self.source = ScriptedHealthSource(index=17, cta=2, lagging=lagging)
        self.failstop = FailStop(self.source, agree_every=16, name_of=lambda r, i: f"k2.ar[{i}]")
        self.failstop.world = world  # > 1: a local failure waits for the ranks' agreement
        self.capturing = False
        self.steps = 0
        self.begins = 0
        self.releases = 0
        self.asked: list[int | None] = []  # the step numbers release() was asked about

    def begin_step(self) -> None:
        if self.failstop.error is not None:
            raise self.failstop.error
        self.begins += 1

    def end_step(self, replayed: bool = False) -> int | None:
        if self.capturing:
            return None
        self.steps += 1
        self.failstop.after_launch(self.steps)
        return self.steps

    def release(self, step=None) -> bool:
        self.releases += 1
        self.asked.append(step)
        return self.failstop.release(self.steps if step is None else step)


class Launches:
    """Reference K1/K2 with the persistent hooks of ``runtime``."""

    def __init__(self, inner, runtime: Runtime) -> None:
        self.inner, self.runtime, self.key = inner, runtime, inner.key

    def begin_step(self) -> None:
        self.runtime.begin_step()

    def end_step(self, replayed: bool = False) -> int | None:
        return self.runtime.end_step(replayed)

    def release(self, step=None) -> bool:
        return self.runtime.release(step)

    def k1_gdn(self, *a, **k) -> None:
        self.inner.k1_gdn(*a, **k)

    def k1_attn(self, *a, **k) -> None:
        self.inner.k1_attn(*a, **k)

    def k2(self, *a, **k) -> None:
        self.inner.k2(*a, **k)


def _setup(world: int = 1, persistent: bool = True, lagging: bool = False):
    cfg = get_preset("qwen3-next-tiny")
    dims = Dims.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    layers = []
    for i, kind in enumerate(dims.kinds):
        w = {}
        for name, shape in dims.planes(kind).items():
            t = 0.05 * torch.randn(shape, generator=g)
            w[name] = t if name == "A_log" else t.to(BF16)
        conv = ssm = None
        if kind == "linear_attention":
            conv = torch.zeros(SLOTS, dims.conv_k - 1, dims.conv_dim_r, dtype=BF16)
            ssm = torch.zeros(SLOTS, dims.hv_r, dims.dv, dims.dk)
        layers.append(BoundLayer(i, kind, w, conv, ssm))
    spec = Qwen3NextSpec()
    assert not spec.accept_config(ConfigView(hf_config=cfg))
    spec.deploy(
        Deployment(
            backend="reference",
            dtype="bfloat16",
            tp_size=1,
            widths=(1, 2),
            layouts={"conv_layout": "time_chan", "ssm_layout": "vk", "qkvz_packing": "interleaved"},
        )
    )
    builder = load_target("mono_ext.models.qwen3_next.reference.backend:build")
    ctx = BuildContext(text_config=cfg, null_slot=NULL)
    rt = Runtime(world, lagging)
    launches = {
        k.width: (Launches(builder(k, ctx), rt) if persistent else builder(k, ctx))
        for k in spec.build_keys()
    }
    driver = DecodeDriver(
        layers,
        launches,
        dims,
        dtype=BF16,
        device="cpu",
        null_slot=NULL,
        numerics=spec.NUMERICS,
    )
    driver.capturing = lambda: rt.capturing
    step = spec.plan(StepView("decode", 2))
    hd = dims.hidden
    gdn = [lay.index for lay in layers if lay.is_gdn]

    def run() -> None:
        inp = StepInputs(
            torch.randn(2, hd, generator=g).to(BF16),
            torch.tensor([4, 7]),
            {i: torch.tensor([2, 3], dtype=torch.int32) for i in gdn},
        )
        driver.run(step, inp, lambda i, q, k, v: torch.zeros_like(q))

    return driver, rt, step, run


def test_eager_steps_get_tickets_that_release_at_the_engines_await():
    driver, rt, step, run = _setup()
    for n in range(1, 4):
        run()
        ticket = driver.after_step(step, replayed=False)
        assert rt.releases == n - 1, "after_step must not ask FailStop: that is the await's"
        ticket.release()
        assert rt.asked[-1] == n and ticket.what is step and ticket.width == 2
    assert (rt.begins, rt.steps, rt.releases, driver.replays) == (3, 3, 3, 0)
    assert rt.source.waits == [1, 2, 3]  # only the releases wait, each for its own step


def test_a_ticket_asks_about_its_own_step_when_the_next_one_already_ran():
    # async scheduling: step n+1's forward runs before the engine awaits step n's tokens
    driver, rt, step, run = _setup()
    run()
    first = driver.after_step(step, replayed=False)
    run()
    second = driver.after_step(step, replayed=False)
    first.release()
    second.release()
    assert rt.asked == [1, 2] and rt.source.waits == [1, 2]


def test_a_replay_counts_its_step_once_and_nothing_runs_while_capturing():
    driver, rt, step, run = _setup()
    rt.capturing = True
    run()  # the capture: begin_step recorded with the graph, end_step a no-op
    assert driver.after_step(step, replayed=True) is None  # no step ran: nothing to check
    assert (rt.steps, rt.releases, driver.replays) == (0, 0, 0)
    rt.capturing = False
    for n in range(1, 5):  # each replay: the device repeats the step; the host sees only this
        ticket = driver.after_step(step, replayed=True)
        assert (rt.steps, rt.releases, driver.replays) == (n, n - 1, n)
        ticket.release()
        assert rt.asked[-1] == n
    assert rt.source.pending == [] and rt.failstop.last_seen_step == 4


def test_a_failed_wait_in_a_replayed_step_raises_instead_of_releasing_its_tokens():
    driver, rt, step, run = _setup()
    rt.capturing = True
    run()
    rt.capturing = False
    driver.after_step(step, replayed=True).release()
    rt.source.fail()  # the next replay's wait gives up
    with pytest.raises(FailStopError, match=r"k2\.ar\[17\]") as exc:
        driver.after_step(step, replayed=True)  # world 1: end_step's poll already sees it
    assert exc.value.step == 2 and rt.failstop.state == FAILED
    with pytest.raises(FailStopError):  # sticky: every later step raises, replayed or eager
        driver.after_step(step, replayed=True)
    with pytest.raises(FailStopError):
        run()


def test_a_failure_seen_only_at_the_await_raises_there_before_the_tokens_go():
    # the device is still on the step at after_step: its copy lands by the engine's await
    driver, rt, step, run = _setup(lagging=True)
    run()
    driver.after_step(step, replayed=False).release()
    rt.source.fail()  # this step's wait gives up
    run()
    ticket = driver.after_step(step, replayed=False)  # nothing landed yet: no error, no wait
    assert rt.failstop.first_failed_step is None and rt.source.waits == [1]
    with pytest.raises(FailStopError, match=r"k2\.ar\[17\]"):
        ticket.release()
    assert rt.failstop.first_failed_step == 2 and rt.source.waits == [1, 2]


def test_a_failed_wait_in_an_eager_step_raises_at_the_next_step():
    driver, rt, step, run = _setup()
    run()
    driver.after_step(step, replayed=False).release()
    rt.source.fail()
    with pytest.raises(FailStopError):
        run()  # end_step sees it first (world 1)
    with pytest.raises(FailStopError):
        driver.after_step(step, replayed=False).release()


def test_a_step_the_ranks_have_not_agreed_on_yet_is_withheld():
    driver, rt, step, run = _setup(world=2)
    run()
    driver.after_step(step, replayed=False).release()
    rt.source.fail()
    run()  # SUSPECT: agreement only every 16 steps, so end_step does not raise
    assert rt.failstop.state == SUSPECT
    ticket = driver.after_step(step, replayed=False)
    with pytest.raises(StepWithheld, match="withheld the tokens") as exc:
        ticket.release()
    assert isinstance(exc.value, FailStopError)


def test_launches_without_release_just_count():
    driver, _, step, run = _setup(persistent=False)
    run()
    driver.after_step(step, replayed=False).release()
    driver.after_step(step, replayed=True).release()
    assert driver.replays == 1
    with pytest.raises(KeyError, match="width 3"):
        driver.after_step(type(step)(width=3, key=step.key), replayed=True)
