"""Broadcast hand-off latency (not a test): a few writer CTAs publish one row of tagged words
each and every CTA of a full grid waits for all of them, as K2's S3 union waits for the
top-k CTAs' picks and most of K1's and K2's hand-offs have the whole grid wait.

    PYTHONPATH=src python benchmarks/bench_handoff.py [--json out.json]

Each launch: every CTA starts spinning in ``primitives.wait_tagged`` (the tree's own bounded
wait, deadline and failed-word checks included) on a block of words (``SHAPES``), of which
the writers' rows hold ``live`` words each. The writers (the last CTAs) first spin ``delay``
us on the timer, so that every reader is already waiting, then store their row and stamp
the time. Latency of a CTA = the time it has every row minus the last writer's stamp
(``%globaltimer`` on both sides). The ``counter`` arm is the other protocol a stream engine
would use: plain stores, a release fence and one atomic increment per writer, the readers
polling that one word before an acquire fence and the loads. Both arms check every value
they read.

Run it with two ``src/`` trees on ``PYTHONPATH`` to compare two versions of the wait.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from mono_ext.kernels.triton.primitives import (
    CTRL_EPOCH,
    fence_gpu,
    global_timer_ns,
    put_words,
    unpack_value,
    wait_tagged,
)
from mono_ext.runtime.health import H_FAILED, decode_health
from mono_ext.runtime.peers import RankState

# (rows of the waited block, words per row, writers, live words per writer's row): K2's picks
# at width 1 and 16 ([BB, PKWP], 20 words a row), and a wide hand-off like S1's partials
# (64 writers of 64 words: 32 words per thread of a 4-warp CTA)
SHAPES = ((16, 32, 1, 20), (16, 32, 16, 20), (64, 64, 64, 64))


@triton.jit(do_not_specialize=["n_writers", "delay_ns"])
def _broadcast_kernel(words_ptr, data_ptr, ctr_ptr, t_ptr, ctrl_ptr, health_ptr, n_writers,
                      delay_ns, R: tl.constexpr, C: tl.constexpr, LIVE: tl.constexpr,
                      COUNTER: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    tag = tl.load(ctrl_ptr + CTRL_EPOCH, volatile=True).to(tl.int32)  # one per launch
    t_begin = global_timer_ns()
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    w = G - 1 - pid
    t_write = t_begin - t_begin
    if w < n_writers:
        spin = True
        while spin:
            spin = global_timer_ns() - t_begin < delay_ns
        vals = w * C + cols + tag
        if COUNTER:
            tl.store(data_ptr + w * C + cols, vals, mask=cols < LIVE)
            tl.debug_barrier()
            fence_gpu(False)
            tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")
        else:
            put_words(words_ptr, w * C + cols, vals, cols < LIVE, tag, False)
        tl.debug_barrier()
        t_write = global_timer_ns()
    idx = rows[:, None] * C + cols[None, :]
    m = (rows < n_writers)[:, None] & (cols < LIVE)[None, :]
    if COUNTER:
        target = tag * n_writers
        seen = tl.load(ctr_ptr, volatile=True)
        while seen < target:
            seen = tl.load(ctr_ptr, volatile=True)
        fence_gpu(False)
        vals = tl.load(data_ptr + idx, mask=m, other=0, volatile=True)
    else:
        words, ok = wait_tagged(tl.reshape(words_ptr + idx, (R * C,)), tl.reshape(m, (R * C,)),
                                tl.reshape(idx, (R * C,)), tag, ctrl_ptr, health_ptr, 0)  # fmt: skip
        vals = tl.reshape(unpack_value(words), (R, C))
    tl.debug_barrier()
    t_seen = global_timer_ns()
    good = tl.sum(tl.sum(((vals == idx + tag) & m).to(tl.int32), axis=1), axis=0)
    tl.store(t_ptr + pid * 3 + 0, t_write)
    tl.store(t_ptr + pid * 3 + 1, t_seen)
    tl.store(t_ptr + pid * 3 + 2, good.to(tl.int64))


def latencies_us(stamps: list[list[int]], writers: int) -> list[float]:
    """Per CTA, the time it had every row after the last writer's store (us). ``stamps``:
    per CTA (write ns, seen ns, ...); the writers are the last ``writers`` CTAs."""
    last_write = max(row[0] for row in stamps[len(stamps) - writers :])
    return [(row[1] - last_write) / 1000 for row in stamps]


def run_arm(grid: int, rows: int, cols: int, writers: int, live: int, counter: bool,
            launches: int, delay_us: float, num_warps: int) -> dict:  # fmt: skip
    dev = "cuda"
    words = torch.zeros(rows * cols, dtype=torch.int64, device=dev)
    data = torch.zeros(rows * cols, dtype=torch.int32, device=dev)
    ctr = torch.zeros(1, dtype=torch.int32, device=dev)
    state = RankState.create(0, dev, deadline_s=5.0)
    t = torch.zeros(grid, 3, dtype=torch.int64, device=dev)
    lat_med, lat_max, bad = [], [], 0
    for i in range(launches + 3):
        state.bump_epoch()
        _broadcast_kernel[(grid,)](
            words, data, ctr, t, state.ctrl, state.health, writers, int(delay_us * 1000),
            R=rows, C=cols, LIVE=live, COUNTER=counter, num_warps=num_warps,
        )  # fmt: skip
        torch.cuda.synchronize()
        h = t.cpu()
        if int(state.health[H_FAILED]) != 0:
            sys.exit(decode_health(state.health.cpu().tolist(), rank=0).describe())
        bad += int((h[:, 2] != writers * live).sum())
        if i < 3:
            continue  # compile and warm the path
        lat = latencies_us(h.tolist(), writers)
        lat_med.append(statistics.median(lat))
        lat_max.append(max(lat))
    return {
        "arm": "counter" if counter else "tagged words",
        "grid": grid,
        "block": [rows, cols],
        "writers": writers,
        "live_words_per_row": live,
        "num_warps": num_warps,
        "launches": launches,
        "median_cta_us": statistics.median(lat_med),
        "last_cta_us": statistics.median(lat_max),
        "last_cta_worst_us": max(lat_max),
        "wrong_values": bad,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--delay-us", type=float, default=20.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from _provenance import provenance  # benchmarks/ is the script's directory

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for counter in (False, True):
        for rows_, cols, writers, live in SHAPES:
            for warps in (4, 8):
                r = run_arm(sms, rows_, cols, writers, live, counter, args.launches,
                            args.delay_us, warps)  # fmt: skip
                rows.append(r)
                print(
                    f"{r['arm']:13s} block {rows_}x{cols} writers {writers:2d} warps {warps}: median CTA "
                    f"{r['median_cta_us']:.2f} us, last CTA {r['last_cta_us']:.2f} us "
                    f"(worst {r['last_cta_worst_us']:.2f}), wrong values {r['wrong_values']}",
                    flush=True,
                )
    out = {**provenance(torch.cuda.get_device_name(0)), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
