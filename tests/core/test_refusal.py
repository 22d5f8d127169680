import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from mono_ext.core.refusal import OFF_PREFIX, Refusal, Stage, agree


def test_refusal_keeps_every_reason_once_in_order():
    r = Refusal.of("model", ["b", "a", "b", "c"])
    assert r.stage is Stage.MODEL and r.reasons == ("b", "a", "c") and r
    assert r.message() == OFF_PREFIX + "[model] b; a; c"
    assert not Refusal.of(Stage.CONFIG, [])


def test_merge_refuses_other_stage():
    with pytest.raises(ValueError, match="cannot merge"):
        Refusal.of("config", ["x"]).merged(Refusal.of("model", ["y"]))
    assert Refusal.of("config", ["x"]).merged(Refusal.of("config", ["y", "x"])).reasons == (
        "x",
        "y",
    )


def test_agree_without_group_is_identity():
    r = Refusal.of("caches", ["slot layout"])
    assert agree(r, None) is r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, reasons: list[list[str]], stages, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        got = agree(Refusal.of(stages[rank], reasons[rank]), dist.group.WORLD)
        out[rank] = (got.stage.value, list(got.reasons))
    except RuntimeError as exc:
        out[rank] = ("error", [str(exc)])
    finally:
        dist.barrier()  # leave together: a lone teardown can abort the peer (see failstop test)
        dist.destroy_process_group()


def _run(reasons, stages):
    world = len(reasons)
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_worker, args=(world, _free_port(), reasons, stages, out), nprocs=world)
        return [out[r] for r in range(world)]


def test_agree_unions_reasons_over_gloo_world_of_two():
    got = _run([["shared", "only rank 0"], ["shared", "only rank 1"]], ["model", "model"])
    want = ("model", ["shared", "ranks 0: only rank 0", "ranks 1: only rank 1"])
    assert got == [want, want]  # every rank sees the same union


def test_agree_one_rank_refusing_makes_all_refuse_and_stage_mismatch_errors():
    got = _run([[], ["bad layout"]], ["caches", "caches"])
    assert got[0] == got[1] == ("caches", ["ranks 1: bad layout"])
    got = _run([[], []], ["config", "model"])
    assert all(stage == "error" and "disagree" in msg[0] for stage, msg in got)
