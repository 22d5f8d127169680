"""Runtime primitive benchmarks (not a test): cross-CTA mailbox hand-off latency and the
virtual-TP8 in-kernel one-shot all-reduce under CUDA-graph replay.

    PYTHONPATH=src python benchmarks/bench_runtime.py [--csv out.csv]

Hand-off: two CTAs of one launch ping-pong a tagged block through two mailbox regions with
the full bounded wait (deadline + sticky-word checks); one-way latency = in-kernel
%globaltimer time / (2 * rounds). All-reduce: 8 virtual ranks on 8 streams of one GPU,
``steps`` steps captured into one graph (each rank's stream: bump epoch, launch; ranks
synchronise only through the all-reduce itself, as real TP ranks do); time per step = replay
time / steps (median of several replays). "per layer" captures one epoch bump and
``steps`` all-reduces with layer ids 0..steps-1, the K2 pattern within a step. "in-kernel"
runs 500 all-reduces inside one persistent launch per rank (no launch gaps, the cost K2 pays
per all-reduce), timed with %globaltimer on rank 0's CTA 0.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # one hardware queue per rank stream

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl

from mono_ext.kernels.triton.allreduce import VirtualTPAllReduce, allreduce_loop_kernel
from mono_ext.kernels.triton.primitives import (
    global_timer_ns,
    mailbox_get,
    mailbox_put,
)
from mono_ext.runtime.health import decode_health
from mono_ext.runtime.peers import RankState


@triton.jit(do_not_specialize=["rounds"])
def _pingpong_kernel(mbox_ptr, t_ptr, rounds, ctrl_ptr, health_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < BLOCK
    ping = mbox_ptr
    pong = mbox_ptr + BLOCK
    base = tl.load(ctrl_ptr).to(tl.int32) * (rounds + 1)  # epoch: fresh tags every launch
    vals = offs + pid
    t0 = global_timer_ns()
    for i in range(rounds):
        tag = base + i + 1
        if pid == 0:
            mailbox_put(ping, offs, vals, mask, tag, False)
            vals, ok = mailbox_get(pong, offs, mask, tag, ctrl_ptr, health_ptr, 1)
        else:
            vals, ok = mailbox_get(ping, offs, mask, tag, ctrl_ptr, health_ptr, 0)
            mailbox_put(pong, offs, vals + 1, mask, tag, False)
    t1 = global_timer_ns()
    tl.store(t_ptr + pid, t1 - t0)


def bench_allreduce_in_kernel(hidden, grid, block, iters=500, reps=5):
    """Per all-reduce time inside one persistent launch (rank 0, CTA 0, %globaltimer)."""
    v = VirtualTPAllReduce(8, hidden, grid=grid, deadline_s=5.0, block=block)
    t = torch.zeros(8, 2, dtype=torch.int64, device="cuda")  # 16-byte rows: one alignment
    lay = v.ar.layout

    def launch(r: int, n: int) -> None:
        s = v.peers.ranks[r]
        s.bump_epoch()
        allreduce_loop_kernel[(grid,)](
            v.xs[r].view(torch.int32),
            v.outs[r].view(torch.int32),
            hidden // 2,
            v.peers.table,
            lay.offsets["ar"],
            lay.region_id("ar"),
            s.ctrl,
            s.health,
            t[r:],
            n,
            RANKS=8,
            BLOCK=block,
            SYS=False,
        )

    # compile and load before any rank spins (warmup compiles without launching)
    scratch = RankState.create(0, "cuda", deadline_s=1.0)
    compiled = allreduce_loop_kernel.warmup(
        v.xs[0].view(torch.int32),
        v.outs[0].view(torch.int32),
        hidden // 2,
        v.peers.table,
        lay.offsets["ar"],
        lay.region_id("ar"),
        scratch.ctrl,
        scratch.health,
        t[0],
        1,
        RANKS=8,
        BLOCK=block,
        SYS=False,
        grid=(grid,),
    )
    compiled._init_handles()
    samples = []
    for rep in range(reps + 1):
        v.xs.normal_()
        v.outs.fill_(float("nan"))
        v.peers.run(lambda r: launch(r, iters))
        torch.cuda.synchronize()
        if rep:
            samples.append(t[0, 0].item() / iters / 1e3)
    exp, _ = v.expected()
    ok = all(torch.equal(v.outs[r], exp) for r in range(8))
    ok = ok and all(decode_health(s.health.cpu().tolist(), s.rank).ok for s in v.peers.ranks)
    return statistics.median(samples), min(samples), ok


def bench_handoff(block: int, rounds: int = 5000, reps: int = 5) -> float:
    state = RankState.create(0, "cuda", deadline_s=5.0)
    mbox = torch.zeros(2 * block, dtype=torch.int64, device="cuda")
    t = torch.zeros(2, dtype=torch.int64, device="cuda")
    samples = []
    for rep in range(reps + 1):
        state.bump_epoch()
        _pingpong_kernel[(2,)](mbox, t, rounds, state.ctrl, state.health, BLOCK=block)
        torch.cuda.synchronize()
        if rep:  # the first launch compiles and warms
            samples.append(t[0].item() / (2 * rounds) / 1e3)
    h = decode_health(state.health.cpu().tolist(), rank=0)
    if not h.ok:
        raise RuntimeError(h.describe())
    return statistics.median(samples)


def bench_allreduce(hidden, grid, block, steps, per_layer, reps=20):
    v = VirtualTPAllReduce(8, hidden, grid=grid, deadline_s=5.0, block=block)
    layers = steps if per_layer else 1
    n_steps = 1 if per_layer else steps

    def body():
        for _ in range(n_steps):
            v.step(layers=layers)

    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    v.peers.register_graph(g)
    v.xs.normal_()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    exp, _ = v.expected()
    ok = all(torch.equal(v.outs[r], exp) for r in range(8))
    for s in v.peers.ranks:
        h = decode_health(s.health.cpu().tolist(), rank=s.rank)
        ok = ok and h.ok
    del g
    v.peers.close()
    return statistics.median(times), min(times), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    name = torch.cuda.get_device_name()
    rows = []
    for block in (128, 1024):
        us = bench_handoff(block)
        rows.append(("handoff", f"{block} words ({block * 4} B payload)", "-", f"{us:.3f}", "", ""))
    for hidden in (2048, 4096, 8192):
        for grid in (4, 8, 16):
            words_per_cta = -(-hidden // 2 // grid)
            block = max(64, min(1024, triton.next_power_of_2(words_per_cta)))
            for per_layer in (False, True):
                med, best, ok = bench_allreduce(hidden, grid, block, args.steps, per_layer)
                kind = "allreduce tp8 per layer" if per_layer else "allreduce tp8 per step"
                size = f"{hidden} bf16 ({hidden * 2} B)"
                rows.append(
                    (kind, size, grid, f"{med:.2f}", f"{best:.2f}", "ok" if ok else "WRONG")
                )
            med, best, ok = bench_allreduce_in_kernel(hidden, grid, block)
            kind = "allreduce tp8 in-kernel"
            rows.append((kind, size, grid, f"{med:.2f}", f"{best:.2f}", "ok" if ok else "WRONG"))
    print(f"device: {name}")
    print(f"{'what':<26} {'size':<26} {'grid':>4} {'median us':>10} {'best us':>8} check")
    for r in rows:
        print(f"{r[0]:<26} {r[1]:<26} {r[2]!s:>4} {r[3]:>10} {r[4]:>8} {r[5]}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["device", "what", "size", "grid", "median_us", "best_us", "check"])
            for r in rows:
                w.writerow([name, *r])
    return 0


if __name__ == "__main__":
    sys.exit(main())
