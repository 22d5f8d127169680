"""``serve.lifecycle``: each stage is guarded and agreed by the TP ranks.

Two real ranks over gloo (two processes): rank 1 raises inside one stage (config, the model
binding, the build, the caches binding) while rank 0 does nothing wrong. Both ranks must refuse
at that stage with rank 1's reason, and neither may hang in the agreement. The config stage
runs for real (the registry's Qwen3-Next spec, the reference backend, a tiny preset); the
later stages use a stand-in spec whose checks pass, so the only reason is the raised one.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest

torch = pytest.importorskip("torch")

from mono_ext.core.refusal import Refusal, Stage  # noqa: E402
from mono_ext.core.settings import Settings  # noqa: E402
from mono_ext.core.views import ConfigView  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.serve.lifecycle import Lifecycle  # noqa: E402
from tests._support.gloo import leave  # noqa: E402

STAGES = ("config", "model", "build", "caches")
TIMEOUT_S = 120


class StandInSpec:
    """The spec's later checks, all passing; one build key."""

    def __init__(self, real) -> None:
        self.real = real

    def refuse_model(self, view) -> Refusal:
        return Refusal.of(Stage.MODEL, [])

    def build_keys(self):
        return [self.real.build_key(1)]

    def refuse_caches(self, view) -> Refusal:
        return Refusal.of(Stage.CACHES, [])


def _rank(rank: int, raising: str, init: str, out) -> None:
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        group = dist.new_group(backend="gloo")

        def boom(stage: str) -> None:
            if rank == 1 and raising == stage:
                raise RuntimeError(f"rank 1 fails its {stage}")

        life = Lifecycle("reference", group=group, tp_size=2, tp_rank=rank, settings=Settings())

        def cfg() -> ConfigView:
            boom("config")
            return ConfigView(hf_config=get_preset("qwen3-next-tiny"), tp_size=1)

        life.config_stage(cfg, lambda _cfg: {}, lambda *_: [])
        if not life.off:
            life.spec = StandInSpec(life.spec)
            life.builder = lambda key, ctx: boom("build") or ("launches", key.width)

            def bind_model():
                boom("model")
                return None, []

            life.model_stage(bind_model, lambda: None)

            def bind_caches():
                boom("caches")
                return None, []

            life.caches_stage(bind_caches, lambda: "driver")
        refusal = life.refusal
        out.put(
            (
                rank,
                None if refusal is None else refusal.stage.value,
                None if refusal is None else refusal.message(),
                life.active,
            )
        )
        leave(dist, out)
    except Exception:
        out.put((rank, "crashed", traceback.format_exc(), False))


def _run(tmp_path, raising: str) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'pg'}"
    procs = [ctx.Process(target=_rank, args=(r, raising, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, *rest = out.get(timeout=TIMEOUT_S)
            results[rank] = tuple(rest)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


@pytest.mark.parametrize("raising", STAGES)
def test_one_rank_raising_makes_both_ranks_refuse_with_its_reason(tmp_path, raising):
    results = _run(tmp_path, raising)
    assert sorted(results) == [0, 1], results
    stage = "model" if raising == "build" else raising
    for rank, (refused_at, message, active) in results.items():
        assert refused_at == stage, (rank, refused_at, message)
        assert f"internal error in the {stage} stage: RuntimeError: rank 1 fails" in message
        assert message.startswith(f"mono_ext off: [{stage}]") and not active


def test_without_a_raise_both_ranks_are_active(tmp_path):
    results = _run(tmp_path, "nothing")
    assert results == {0: (None, None, True), 1: (None, None, True)}
