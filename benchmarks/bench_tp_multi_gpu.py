"""Real TP2 all-reduce latency across two GPUs (not a test): the one-shot in-kernel all-reduce
through CUDA IPC peer buffers vs NCCL's all-reduce, both under CUDA-graph replay.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=src python benchmarks/bench_tp_multi_gpu.py [--json out.json]

One process per GPU. For 2048..16384 bf16 (4..32 KB) and several grids, each rank times
(CUDA events, median of replays, per all-reduce):

- *per step*: a graph of N steps, each an epoch bump + one all-reduce launch;
- *per layer*: a graph of one bump + N all-reduce launches with layer ids 0..N-1 (the
  K1/K2 pattern within a step: the all-reduce as its own graph node);
- *in-kernel*: N all-reduces inside one persistent launch (``%globaltimer`` on CTA 0), the
  cost a fused kernel pays per all-reduce;
- *NCCL graph*: a graph of N ``dist.all_reduce`` (sum) calls; *NCCL eager*: the same calls
  launched one by one.

Before every timed replay a tiny NCCL all-reduce lines the two GPUs up, so neither rank's
time includes waiting for the other to start. Reported numbers are the larger of the two
ranks' medians. Every row also checks the output against the fp32 rank-order sum rounded to
bf16 (bit for bit) and that no wait gave up. NVLink multicast stays off (set below, before
CUDA or NCCL starts); nothing here calls cuMulticastCreate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(NO_MULTICAST)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import triton  # noqa: E402

from mono_ext.kernels.triton.allreduce import (  # noqa: E402
    OneShotAllReduce,
    allreduce_loop_kernel,
)
from mono_ext.runtime.health import decode_health  # noqa: E402
from mono_ext.runtime.peers import IpcPeers  # noqa: E402

WORLD = 2
SIZES = (2048, 4096, 8192, 16384)
GRIDS = (8, 16, 32)
N = 100  # all-reduces per graph
REPS = 20  # timed replays
LOOP_ITERS = 500
LOOP_REPS = 5


def _block_for(hidden: int, grid: int) -> int:
    per_cta = -(-hidden // 2 // grid)
    return max(64, min(1024, triton.next_power_of_2(per_cta)))


class _Rank:
    def __init__(self, rank: int, dev, cpu):
        self.rank, self.dev, self.cpu = rank, dev, cpu
        self._sync = torch.ones(1, dtype=torch.float32, device=dev)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def line_up(self) -> None:
        """A tiny NCCL all-reduce on the stream: both GPUs pass this point together."""
        dist.all_reduce(self._sync)

    def time_us(self, fn, per: int) -> float:
        self.line_up()
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) * 1e3 / per

    def expected(self, x):
        xs = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(xs, x)
        acc = xs[0].float()
        for r in range(1, WORLD):
            acc = acc + xs[r].float()
        return acc.to(torch.bfloat16)


def _bench_ours(me: _Rank, hidden: int, grid: int) -> dict:
    block = _block_for(hidden, grid)
    ar = OneShotAllReduce(hidden, WORLD, grid, block=block, sys_scope=True, co_resident=1)
    peers = IpcPeers(ar.peer_words, me.cpu, me.dev, deadline_s=10.0)
    st = peers.state
    x = torch.randn(hidden, device=me.dev).mul_(3).to(torch.bfloat16)
    out = torch.empty_like(x)
    exp = me.expected(x)
    t = torch.zeros(2, dtype=torch.int64, device=me.dev)
    ar.build(x, out, peers.table, st.ctrl, st.health)
    lay = ar.layout
    loop_args = (
        x.view(torch.int32),
        out.view(torch.int32),
        hidden // 2,
        peers.table,
        lay.offsets["ar"],
        lay.region_id("ar"),
        st.ctrl,
        st.health,
        t,
    )
    consts = {"RANKS": WORLD, "BLOCK": block, "SYS": True}
    loop = allreduce_loop_kernel.warmup(*loop_args, 1, grid=(grid,), **consts)
    loop._init_handles()  # loaded now, not while the peer spins
    torch.cuda.synchronize(me.dev)
    dist.barrier(group=me.cpu)

    def launch(layer: int = 0, layers: int = 1) -> None:
        ar.launch(x, out, peers.table, st.ctrl, st.health, layer, layers)

    def per_step() -> None:
        for _ in range(N):
            st.bump_epoch()
            launch()

    def per_layer() -> None:
        st.bump_epoch()
        for layer in range(N):
            launch(layer, N)

    row = {"hidden": hidden, "grid": grid, "block": block, "rank": me.rank, "ok": True}
    for name, body in (("per_step", per_step), ("per_layer", per_layer)):
        body()  # eager once: warm, and both ranks in step
        torch.cuda.synchronize(me.dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        peers.register_graph(graph)
        times = []
        for rep in range(REPS + 2):
            out.fill_(float("nan"))
            us = me.time_us(graph.replay, N)
            if rep >= 2:
                times.append(us)
            row["ok"] = row["ok"] and torch.equal(out, exp)
        row[name] = statistics.median(times)
        row[name + "_best"] = min(times)
        del graph

    samples = []
    for rep in range(LOOP_REPS + 1):
        out.fill_(float("nan"))
        me.line_up()
        st.bump_epoch()
        allreduce_loop_kernel[(grid,)](*loop_args, LOOP_ITERS, **consts)
        torch.cuda.synchronize(me.dev)
        if rep:
            samples.append(t[0].item() / LOOP_ITERS / 1e3)
        row["ok"] = row["ok"] and torch.equal(out, exp)
    row["in_kernel"] = statistics.median(samples)
    row["in_kernel_best"] = min(samples)
    h = decode_health(st.health.cpu().tolist(), rank=me.rank)
    if not h.ok:
        row["ok"] = False
        print(f"[rank {me.rank}] h{hidden} grid {grid}: {h.describe(lay.describe)}", flush=True)
    peers.close()
    return row


def _bench_nccl(me: _Rank, hidden: int) -> dict:
    # N distinct buffers, each reduced once per replay: values double per replay, far from
    # overflow over these few replays, and never zeros
    bufs = [torch.randn(hidden, device=me.dev).to(torch.bfloat16) for _ in range(N)]
    probe = bufs[0].clone()
    exp = me.expected(probe)
    dist.all_reduce(probe)
    row = {"hidden": hidden, "rank": me.rank, "nccl_ok": torch.equal(probe, exp)}
    row["nccl_bits_differ"] = int((probe != exp).sum())

    def eager() -> None:
        for b in bufs:
            dist.all_reduce(b)

    eager()
    times = [me.time_us(eager, N) for _ in range(REPS // 2)]
    row["nccl_eager"] = statistics.median(times)
    try:
        torch.cuda.synchronize(me.dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        times = [me.time_us(graph.replay, N) for _ in range(REPS + 2)][2:]
        row["nccl_graph"] = statistics.median(times)
        row["nccl_graph_best"] = min(times)
        del graph
    except Exception as e:  # report it, keep the eager number
        row["nccl_graph"] = None
        row["nccl_graph_error"] = f"{type(e).__name__}: {e}"
    return row


def _worker(rank: int, init_file: str, out_json: str | None) -> None:
    os.environ.update(NO_MULTICAST)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    cpu = dist.new_group(backend="gloo")
    torch.manual_seed(77 + rank)
    me = _Rank(rank, dev, cpu)
    # NCCL communicator, and every torch kernel used later, up before any all-reduce spins
    me.line_up()
    me.expected(torch.randn(16, device=dev).to(torch.bfloat16))
    torch.cuda.synchronize(dev)
    ours = [_bench_ours(me, h, g) for h in SIZES for g in GRIDS]
    nccl = [_bench_nccl(me, h) for h in SIZES]  # last: a failed capture cannot spoil ours
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, (ours, nccl), group=cpu)
    if rank == 0:
        _print(gathered, out_json)
    dist.barrier(group=cpu)
    dist.destroy_process_group()


def _worst(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return max(vals) if vals else None


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _print(gathered: list, out_json: str | None) -> None:
    name = torch.cuda.get_device_name(0)
    print(f"device: {WORLD} x {name}, torch {torch.__version__}, triton {triton.__version__}")
    print("us per all-reduce, larger of the two ranks' medians; check = bit-exact + healthy")
    print(
        f"{'bf16':>6} {'bytes':>6} {'grid':>4} {'block':>5} {'per step':>9} {'per layer':>9} "
        f"{'in-kernel':>9} check"
    )
    ours = [row for rank_rows, _ in gathered for row in rank_rows]
    table = []
    for h in SIZES:
        for g in GRIDS:
            rows = [r for r in ours if r["hidden"] == h and r["grid"] == g]
            t = {
                "hidden": h,
                "grid": g,
                "block": rows[0]["block"],
                "per_step": _worst(rows, "per_step"),
                "per_layer": _worst(rows, "per_layer"),
                "in_kernel": _worst(rows, "in_kernel"),
                "ok": all(r["ok"] for r in rows),
            }
            table.append(t)
            print(
                f"{h:>6} {2 * h:>6} {g:>4} {t['block']:>5} {_fmt(t['per_step']):>9} "
                f"{_fmt(t['per_layer']):>9} {_fmt(t['in_kernel']):>9} "
                f"{'ok' if t['ok'] else 'WRONG'}"
            )
    print()
    print(
        f"{'bf16':>6} {'bytes':>6} {'ours: graph node':>17} {'in-kernel':>9} "
        f"{'NCCL graph':>10} {'NCCL eager':>10} {'NCCL vs exact':>13}"
    )
    nccl = [row for _, rank_rows in gathered for row in rank_rows]
    summary = []
    for h in SIZES:
        mine = [t for t in table if t["hidden"] == h and t["ok"]]
        best_node = min((t["per_layer"] for t in mine), default=None)
        best_loop = min((t["in_kernel"] for t in mine), default=None)
        rows = [r for r in nccl if r["hidden"] == h]
        s = {
            "hidden": h,
            "ours_graph_node": best_node,
            "ours_in_kernel": best_loop,
            "nccl_graph": _worst(rows, "nccl_graph"),
            "nccl_eager": _worst(rows, "nccl_eager"),
            "nccl_bits_differ": sum(r["nccl_bits_differ"] for r in rows),
            "nccl_graph_error": next(
                (r["nccl_graph_error"] for r in rows if "nccl_graph_error" in r), None
            ),
        }
        summary.append(s)
        print(
            f"{h:>6} {2 * h:>6} {_fmt(best_node):>17} {_fmt(best_loop):>9} "
            f"{_fmt(s['nccl_graph']):>10} {_fmt(s['nccl_eager']):>10} "
            f"{s['nccl_bits_differ']:>8} bits"
        )
        if s["nccl_graph_error"]:
            print(f"       NCCL graph capture failed: {s['nccl_graph_error']}")
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"device": name, "ranks": gathered, "table": table, "summary": summary}, f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}")
        return 1
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), args.json), nprocs=WORLD, join=True)
    print(f"took {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
