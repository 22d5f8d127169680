"""Real TP2 across two GPUs: one process per GPU, peer buffers opened through CUDA IPC, the
one-shot in-kernel all-reduce against NCCL, and a stalled rank that FailStop stops on both.

- ``test_tp2_allreduce_matches_nccl``: the device address table reaches the peer GPU's buffer
  (a kernel reads and writes it through the table); then for 2048 / 4096 / 8192 bf16 and
  4102 (an odd number of tagged words, not a multiple of the block) the all-reduce equals the
  fp32 rank-order sum rounded once to bf16 bit for bit, both ranks hold the same bits, and it
  is within one bf16 ulp of an NCCL all-reduce (sum); eager, then 200 CUDA-graph replays, each
  bit-identical to an eager run on the same inputs. Fresh random inputs every run, outputs
  poisoned with NaN before every run.
- ``test_tp2_stalled_rank_fails_both``: rank 1 stops launching its all-reduce at step 6 (a
  test-only switch: it simply skips its graph replay). Rank 0's first wait gives up within
  ``MONO_EXT_DEADLINE_S`` (1 s here), its later waits bail at once, FailStop raises on both
  ranks at the next agreement (``MONO_EXT_AGREE_EVERY`` = 4), and the process group exits
  with an error that names the wait. The parent kills any rank still alive after a hard limit.

NVLink multicast stays off in every process (a program that uses it can put a shared host's
GPUs out of service): the three variables below are set here, before CUDA or NCCL starts, and
inherited by the spawned ranks; nothing here calls cuMulticastCreate.
"""

import json
import math
import os
import tempfile
import time

import pytest

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(NO_MULTICAST)

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices (real TP across GPUs)", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.multiprocessing.spawn import ProcessRaisedException  # noqa: E402

pytestmark = pytest.mark.gpu

WORLD = 2
SIZES = (2048, 4096, 8192, 4102)  # 4102 bf16 = 2051 words: odd, and a partial last block
GRID, BLOCK = 4, 256  # several chunks per CTA at 8192 (16 chunks over 4 CTAs)
EAGER_RUNS = 20
GRAPH_REPLAYS = 200
PROBE_WORDS = 1000
STALL_STEP = 6
POISON = float("nan")


def _env(rank: int) -> torch.device:
    os.environ.update(NO_MULTICAST)
    # one host: bootstrap over loopback, whatever the hostname resolves to
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    return dev


def _spawn(fn, args, limit_s: float) -> None:
    """Start WORLD ranks; fail (after killing what is left) if they outlive ``limit_s``."""
    ctx = mp.spawn(fn, args=args, nprocs=WORLD, join=False)
    end = time.monotonic() + limit_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{fn.__name__}: ranks still running after {limit_s:.0f} s (a hang)")


def _report(out_dir: str, rank: int, rep: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rep, f)


def _load(out_dir: str) -> list[dict]:
    reps = []
    for r in range(WORLD):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            reps.append(json.load(f))
    return reps


@triton.jit
def _peer_probe(table_ptr, got_ptr, n, me, other, BLOCK: tl.constexpr):
    """Read ``n`` words of the peer's buffer into ``got``, and write this rank's first ``n``
    words into the peer's buffer at ``[n, 2n)``: both through the device address table."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    mine = tl.load(table_ptr + me).to(tl.pointer_type(tl.int64))
    theirs = tl.load(table_ptr + other).to(tl.pointer_type(tl.int64))
    tl.store(got_ptr + offs, tl.load(theirs + offs, mask=mask), mask=mask)
    tl.store(theirs + n + offs, tl.load(mine + offs, mask=mask), mask=mask)


def _pattern(rank: int, dev) -> torch.Tensor:
    gen = torch.Generator(device=dev).manual_seed(4242 + rank)
    return torch.randint(-(2**62), 2**62, (PROBE_WORDS,), generator=gen, device=dev)


def _check_peer_table(rank: int, dev, cpu, errors: list, info: dict) -> None:
    from mono_ext.runtime.peers import IpcPeers

    other = 1 - rank
    info["can_access_peer"] = bool(torch.cuda.can_device_access_peer(rank, other))
    peers = IpcPeers(2 * PROBE_WORDS, cpu, dev, deadline_s=5.0)
    table = peers.table.cpu().tolist()
    if table[rank] != peers._own or len(set(table)) != WORLD or not all(table):
        errors.append(f"device table {table} (own buffer {peers._own:#x})")
    own = peers.buffer()
    own[:PROBE_WORDS].copy_(_pattern(rank, dev))
    torch.cuda.synchronize(dev)
    dist.barrier(group=cpu)
    got = torch.zeros(PROBE_WORDS, dtype=torch.int64, device=dev)
    grid = (triton.cdiv(PROBE_WORDS, 256),)
    _peer_probe[grid](peers.table, got, PROBE_WORDS, rank, other, BLOCK=256)
    torch.cuda.synchronize(dev)
    dist.barrier(group=cpu)
    if not torch.equal(got, _pattern(other, dev)):
        errors.append(f"a kernel on GPU {rank} read wrong words from GPU {other}'s buffer")
    if not torch.equal(own[PROBE_WORDS : 2 * PROBE_WORDS], _pattern(other, dev)):
        errors.append(f"GPU {other}'s kernel did not land its words in GPU {rank}'s buffer")
    own.zero_()
    torch.cuda.synchronize(dev)
    peers.close()


def _compare(x, out, where: str, errors: list, stats: dict) -> None:
    """Collective (NCCL): same calls on both ranks whatever the outcome, so they stay in step."""
    xs = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(xs, x)
    outs = [torch.empty_like(out) for _ in range(WORLD)]
    dist.all_gather(outs, out)
    ref = x.clone()
    dist.all_reduce(ref)  # NCCL sum: the reference
    exp32 = xs[0].float()
    for r in range(1, WORLD):
        exp32 = exp32 + xs[r].float()
    exp = exp32.to(torch.bfloat16)
    problems = []
    if torch.isnan(out).any():
        problems.append(f"{int(torch.isnan(out).sum())} outputs never written")
    elif not torch.equal(out, exp):
        problems.append(f"{int((out != exp).sum())} words differ from the fp32 rank-order sum")
    if not torch.equal(outs[0], outs[1]):
        problems.append("the two ranks' outputs differ")
    # within bf16 rounding of NCCL: at most one bf16 ulp (2^-7 relative) apart
    diff = (out.float() - ref.float()).abs()
    if not (diff <= exp32.abs() * 2.0**-7 + 1e-38).all():
        problems.append(f"more than one bf16 ulp from NCCL (max abs {float(diff.max()):.3g})")
    stats["nccl_bits_differ"] += int((out != ref).sum())
    stats["nccl_max_abs"] = max(stats["nccl_max_abs"], float(diff.nan_to_num(0.0).max()))
    stats["runs"] += 1
    if problems and len(errors) < 20:
        errors.append(f"{where}: " + "; ".join(problems))


def _check_size(hidden: int, dev, cpu, errors: list) -> dict:
    from mono_ext.kernels.triton.allreduce import OneShotAllReduce, allreduce_kernel
    from mono_ext.runtime.build_cache import jit_cache_size
    from mono_ext.runtime.health import decode_health
    from mono_ext.runtime.peers import IpcPeers

    stats = {"runs": 0, "nccl_bits_differ": 0, "nccl_max_abs": 0.0, "graph_vs_eager_differ": 0}
    ar = OneShotAllReduce(hidden, WORLD, GRID, block=BLOCK, sys_scope=True, co_resident=1)
    peers = IpcPeers(ar.peer_words, cpu, dev, deadline_s=5.0)
    st = peers.state
    x = torch.empty(hidden, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(x)
    ar.build(x, out, peers.table, st.ctrl, st.health)
    compiled = jit_cache_size(allreduce_kernel)

    def fresh() -> None:
        x.copy_(torch.randn(hidden, device=dev).mul_(3))
        out.fill_(POISON)

    def step() -> None:
        st.bump_epoch()
        ar.launch(x, out, peers.table, st.ctrl, st.health)

    # every torch kernel and NCCL path used below runs once before any all-reduce spins
    fresh()
    _compare(x, x.clone(), "warm-up", [], dict(stats))
    torch.cuda.synchronize(dev)
    dist.barrier(group=cpu)  # both ranks built and loaded before either spins

    for i in range(EAGER_RUNS):
        fresh()
        step()
        _compare(x, out, f"h{hidden} eager run {i}", errors, stats)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    peers.register_graph(graph)
    for i in range(GRAPH_REPLAYS):
        fresh()
        graph.replay()
        from_graph = out.clone()
        out.fill_(POISON)
        step()  # the same inputs, eager
        if not torch.equal(from_graph, out):
            stats["graph_vs_eager_differ"] += 1
            if len(errors) < 20:
                errors.append(f"h{hidden} replay {i}: graph output differs from eager")
        _compare(x, from_graph, f"h{hidden} graph replay {i}", errors, stats)
    torch.cuda.synchronize(dev)
    h = decode_health(st.health.cpu().tolist(), rank=st.rank)
    if not h.ok:
        errors.append(f"h{hidden}: " + h.describe(ar.layout.describe))
    if jit_cache_size(allreduce_kernel) != compiled:
        errors.append(f"h{hidden}: a launch compiled after build()")
    del graph
    peers.close()
    return stats


def _allreduce_worker(rank: int, init_file: str, out_dir: str) -> None:
    dev = _env(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    cpu = dist.new_group(backend="gloo")
    torch.manual_seed(1000 + rank)
    rep: dict = {"rank": rank, "errors": [], "info": {}, "sizes": {}}
    try:
        _check_peer_table(rank, dev, cpu, rep["errors"], rep["info"])
        for hidden in SIZES:
            t = time.perf_counter()
            rep["sizes"][str(hidden)] = _check_size(hidden, dev, cpu, rep["errors"])
            rep["sizes"][str(hidden)]["seconds"] = round(time.perf_counter() - t, 2)
        for hidden, s in rep["sizes"].items():
            print(
                f"[rank {rank}] h{hidden}: {s['runs']} runs ({EAGER_RUNS} eager, "
                f"{GRAPH_REPLAYS} graph replays), graph!=eager {s['graph_vs_eager_differ']}, "
                f"bf16 words differing from NCCL {s['nccl_bits_differ']} "
                f"(max abs {s['nccl_max_abs']:.3g}), {s['seconds']} s",
                flush=True,
            )
        print(f"[rank {rank}] info {rep['info']} errors {rep['errors'][:5]}", flush=True)
    finally:
        _report(out_dir, rank, rep)
        dist.destroy_process_group()


def test_tp2_allreduce_matches_nccl():
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(_allreduce_worker, (os.path.join(tmp, "init"), tmp), limit_s=100)
        reps = _load(tmp)
    for rep in reps:
        assert not rep["errors"], f"rank {rep['rank']}: " + "\n".join(rep["errors"])
        for hidden in SIZES:
            assert rep["sizes"][str(hidden)]["runs"] == EAGER_RUNS + GRAPH_REPLAYS


def _fault_worker(rank: int, init_file: str, out_dir: str, deadline_s: float, agree: int):
    dev = _env(rank)
    # the runtime reads these itself (only in the spawned ranks: no leak into other tests)
    os.environ["MONO_EXT_DEADLINE_S"] = repr(deadline_s)
    os.environ["MONO_EXT_AGREE_EVERY"] = str(agree)
    from mono_ext.core.settings import load_settings
    from mono_ext.kernels.triton.allreduce import OneShotAllReduce
    from mono_ext.runtime.failstop import CudaHealthSource, FailStop, FailStopError
    from mono_ext.runtime.health import decode_health
    from mono_ext.runtime.peers import IpcPeers

    settings = load_settings()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    hidden, stalled = 4096, 1
    ar = OneShotAllReduce(hidden, WORLD, GRID, block=BLOCK, sys_scope=True, co_resident=1)
    peers = IpcPeers(ar.peer_words, group, dev, settings.deadline_s)
    st = peers.state
    x = torch.empty(hidden, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(x)
    ar.build(x, out, peers.table, st.ctrl, st.health)
    fs = FailStop(
        CudaHealthSource(st.health),
        rank=rank,
        group=group,
        agree_every=settings.agree_every,
        name_of=ar.layout.describe,
    )

    def inputs(step: int) -> list:  # every rank can compute every rank's input
        gens = [torch.Generator(device=dev).manual_seed(7919 * step + r) for r in range(WORLD)]
        return [torch.randn(hidden, generator=g, device=dev).to(torch.bfloat16) for g in gens]

    def expected(xs) -> torch.Tensor:
        acc = xs[0].float()
        for r in range(1, WORLD):
            acc = acc + xs[r].float()
        return acc.to(torch.bfloat16)

    def step() -> None:
        st.bump_epoch()
        ar.launch(x, out, peers.table, st.ctrl, st.health)

    rep: dict = {"rank": rank, "errors": [], "steps": [], "raised_at": None, "error": ""}
    xs = inputs(0)
    x.copy_(xs[rank])
    out.fill_(POISON)
    torch.cuda.synchronize(dev)
    dist.barrier(group=group)
    step()  # warm: every kernel used below is loaded
    torch.cuda.synchronize(dev)
    if not torch.equal(out, expected(xs)):
        rep["errors"].append("warm-up step: wrong sum")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    peers.register_graph(graph)
    torch.cuda.synchronize(dev)
    dist.barrier(group=group)

    err = None
    t_stall = None
    s = 0
    try:
        for s in range(1, STALL_STEP + 3 * settings.agree_every):
            xs = inputs(s)
            x.copy_(xs[rank])
            out.fill_(POISON)
            t0 = time.perf_counter()
            if s == STALL_STEP:
                t_stall = t0
            if not (rank == stalled and s >= STALL_STEP):  # the test-only stall switch
                graph.replay()
            fs.after_launch(s)
            torch.cuda.synchronize(dev)  # stands for the engine's wait for the step's tokens
            released = fs.release(s)
            rep["steps"].append([s, released, time.perf_counter() - t0])
            if released and s < STALL_STEP and not torch.equal(out, expected(xs)):
                rep["errors"].append(f"step {s}: wrong sum")
    except FailStopError as e:
        err = e
        rep["raised_at"] = s
        rep["since_stall_s"] = None if t_stall is None else time.perf_counter() - t_stall
        rep["error"] = str(e)
        rep["failed_ranks"] = list(e.failed_ranks)
        try:
            fs.after_launch(s + 1)
            rep["sticky"] = False
        except FailStopError:
            rep["sticky"] = True
    torch.cuda.synchronize(dev)
    h = decode_health(st.health.cpu().tolist(), rank=rank)
    rep["health_ok"] = h.ok
    rep["health"] = h.describe(ar.layout.describe)
    rep["region_ok"] = all(r.region == ar.layout.region_id("ar") for r in h.records)
    print(f"[rank {rank}] {json.dumps(rep)}", flush=True)
    _report(out_dir, rank, rep)
    dist.barrier(group=group)  # both reports are on disk before either rank exits
    del graph
    peers.close()
    dist.destroy_process_group()
    if err is not None:
        raise err  # the process group exits with the error that names the wait


def test_tp2_stalled_rank_fails_both():
    deadline = float(os.environ.get("MONO_EXT_DEADLINE_S", "1"))
    agree = int(os.environ.get("MONO_EXT_AGREE_EVERY", "4"))
    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(ProcessRaisedException) as exc:
            args = (os.path.join(tmp, "init"), tmp, deadline, agree)
            _spawn(_fault_worker, args, limit_s=60 + 3 * deadline)
        reps = _load(tmp)
    msg = str(exc.value)
    assert "FailStopError" in msg and "allreduce.ar[" in msg and "from rank 1," in msg, msg
    first_agreement = math.ceil(STALL_STEP / agree) * agree
    for rep in reps:
        r = rep["rank"]
        assert not rep["errors"], rep["errors"]
        assert rep["raised_at"] == first_agreement, rep
        assert rep["raised_at"] - STALL_STEP < agree, rep
        assert rep["failed_ranks"] == [0], rep
        assert "allreduce.ar[" in rep["error"] and "from rank 1," in rep["error"], rep["error"]
        assert rep["sticky"], "no fallback after a failure: later steps must raise too"
        assert rep["since_stall_s"] < deadline + 2.0, rep
        healthy = [ok for s, ok, _ in rep["steps"] if s < STALL_STEP]
        assert healthy == [True] * (STALL_STEP - 1), (r, rep["steps"])
    r0, r1 = reps
    assert not r0["health_ok"] and r0["region_ok"] and "from rank 1," in r0["health"]
    assert r1["health_ok"], r1["health"]  # the stalled rank's own waits never ran
    by_step = {s: (ok, dt) for s, ok, dt in r0["steps"]}
    ok, dt = by_step[STALL_STEP]
    assert not ok and deadline <= dt < deadline + 1.0, (STALL_STEP, ok, dt)
    for s in range(STALL_STEP + 1, first_agreement):
        ok, dt = by_step[s]
        assert not ok and dt < 0.2, (s, ok, dt)  # the sticky failed word: waits bail at once


def test_odd_hidden_is_refused():
    from mono_ext.kernels.triton.allreduce import allreduce_program

    with pytest.raises(ValueError, match="even"):
        allreduce_program(4097)
