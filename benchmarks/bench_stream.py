"""How fast can one persistent Triton launch stream a weight plane? (not a test)

    PYTHONPATH=src python benchmarks/bench_stream.py [--json out.json] [--only NAME,...]

K1's projections and K2's expert planes are GEMVs of a bf16 plane [N, K] (K = 2048, rows
4 KB apart) against at most 16 activation rows. Both kernels land at 14-20 GB/s per SM
(docs/journal.md), about half of what the HBM gives. This isolates the stream: the same
product ``y[N, 16] = W[N, K] @ x[16, K]^T`` written several ways, each checked against
torch, each timed as 8 launches over 8 copies of W (8 x ~52 MB, so the 50 MB L2 holds
none of them) inside one CUDA graph, median of 20 replays; cuBLAS and a device copy in the
same run as the yardsticks.

Variants (grid 132 = one CTA per SM unless the name says otherwise):

- ``nested``: each CTA owns a contiguous band of rows, walks it in tiles of R rows, and
  for each tile a pipelined K loop of BK columns (today's K1/K2 pattern; the pipeline
  drains and refills at every tile).
- ``flat``: the same chunks as one pipelined loop over (tile, k): the stream never drains;
  a tile's result is stored by a masked store at its last chunk.
- ``stagger``: ``flat`` with each CTA starting its K sweep at a different column block
  (all CTAs otherwise hit the same column offset of rows 4 KB apart at once).
- ``rows``: chunks of R whole rows (R x 4 KB contiguous), one dot per chunk, no carried sum.
- ``tma``: ``flat`` with the weight chunks fetched by the bulk tensor copy engine.
- ``grid``: a plain non-persistent GEMV, one CTA per R rows, occupancy hides latency.
- ``ring``: the stream engine's building block (``mono_ext.kernels.triton.ring``, Gluon): a
  loader warp keeps an SMEM ring of TMA copies full while a warpgroup runs async wgmma.
- a ``cN`` suffix: the same plane on N CTAs (44 / 88 / 132), one CTA per SM.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from _provenance import provenance

DEV = torch.device("cuda")
SMS = 132
K = 2048
B = 16
COPIES = 8


@triton.jit
def _x_chunk(X, k0, K: tl.constexpr, B: tl.constexpr, BK: tl.constexpr):
    cols = k0 + tl.arange(0, BK)
    return tl.load(X + tl.arange(0, B)[None, :] * K + cols[:, None])  # [BK, B]


@triton.jit
def nested_kernel(
    W,
    X,
    Y,
    rows_per_cta,
    K: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    BK: tl.constexpr,
    NS: tl.constexpr,
):
    r0 = tl.program_id(0) * rows_per_cta
    for t in range(0, rows_per_cta // R):
        rows = r0 + t * R + tl.arange(0, R)
        acc = tl.zeros([R, B], tl.float32)
        for kk in tl.range(0, K // BK, num_stages=NS):
            cols = kk * BK + tl.arange(0, BK)
            w = tl.load(W + rows[:, None] * K + cols[None, :])
            acc += tl.dot(w, _x_chunk(X, kk * BK, K, B, BK))
        tl.store(Y + rows[:, None] * B + tl.arange(0, B)[None, :], acc)


@triton.jit
def flat_kernel(
    W,
    X,
    Y,
    rows_per_cta,
    K: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    BK: tl.constexpr,
    NS: tl.constexpr,
    STAGGER: tl.constexpr,
):
    pid = tl.program_id(0)
    r0 = pid * rows_per_cta
    KCH: tl.constexpr = K // BK
    n = (rows_per_cta // R) * KCH
    acc = tl.zeros([R, B], tl.float32)
    for i in tl.range(0, n, num_stages=NS):
        t = i // KCH
        kk = i % KCH
        if STAGGER:
            kk = (kk + pid) % KCH
        rows = r0 + t * R + tl.arange(0, R)
        cols = kk * BK + tl.arange(0, BK)
        w = tl.load(W + rows[:, None] * K + cols[None, :])
        acc += tl.dot(w, _x_chunk(X, kk * BK, K, B, BK))
        last = (i % KCH) == KCH - 1
        tl.store(Y + rows[:, None] * B + tl.arange(0, B)[None, :], acc, mask=last)
        acc = tl.where(last, 0.0, acc)


@triton.jit
def gather_kernel(
    W,
    X,
    Y,
    T,
    rows_per_cta,
    K: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    BK: tl.constexpr,
    NS: tl.constexpr,
):
    """``flat`` whose tiles come from a device table (K2's experts: the plane a CTA reads
    next is known only after a dependent load)."""
    pid = tl.program_id(0)
    tiles = rows_per_cta // R
    KCH: tl.constexpr = K // BK
    acc = tl.zeros([R, B], tl.float32)
    for i in tl.range(0, tiles * KCH, num_stages=NS):
        kk = i % KCH
        tile = tl.load(T + pid * tiles + i // KCH)
        rows = tile * R + tl.arange(0, R)
        cols = kk * BK + tl.arange(0, BK)
        w = tl.load(W + rows[:, None] * K + cols[None, :])
        acc += tl.dot(w, _x_chunk(X, kk * BK, K, B, BK))
        last = kk == KCH - 1
        tl.store(Y + rows[:, None] * B + tl.arange(0, B)[None, :], acc, mask=last)
        acc = tl.where(last, 0.0, acc)


@triton.jit
def rows_kernel(
    W, X, Y, rows_per_cta, K: tl.constexpr, B: tl.constexpr, R: tl.constexpr, NS: tl.constexpr
):
    r0 = tl.program_id(0) * rows_per_cta
    cols = tl.arange(0, K)
    for t in tl.range(0, rows_per_cta // R, num_stages=NS):
        rows = r0 + t * R + tl.arange(0, R)
        w = tl.load(W + rows[:, None] * K + cols[None, :])
        y = tl.dot(w, _x_chunk(X, 0, K, B, K))
        tl.store(Y + rows[:, None] * B + tl.arange(0, B)[None, :], y)


@triton.jit
def tma_kernel(
    w_desc,
    X,
    Y,
    rows_per_cta,
    K: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    BK: tl.constexpr,
    NS: tl.constexpr,
):
    r0 = tl.program_id(0) * rows_per_cta
    KCH: tl.constexpr = K // BK
    n = (rows_per_cta // R) * KCH
    acc = tl.zeros([R, B], tl.float32)
    for i in tl.range(0, n, num_stages=NS):
        t = i // KCH
        kk = i % KCH
        w = w_desc.load([r0 + t * R, kk * BK])
        acc += tl.dot(w, _x_chunk(X, kk * BK, K, B, BK))
        last = kk == KCH - 1
        rows = r0 + t * R + tl.arange(0, R)
        tl.store(Y + rows[:, None] * B + tl.arange(0, B)[None, :], acc, mask=last)
        acc = tl.where(last, 0.0, acc)


@triton.jit
def grid_kernel(
    W, X, Y, K: tl.constexpr, B: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    acc = tl.zeros([R, B], tl.float32)
    for kk in tl.range(0, K // BK, num_stages=NS):
        cols = kk * BK + tl.arange(0, BK)
        w = tl.load(W + rows[:, None] * K + cols[None, :])
        acc += tl.dot(w, _x_chunk(X, kk * BK, K, B, BK))
    tl.store(Y + rows[:, None] * B + tl.arange(0, B)[None, :], acc)


def _ring_configs():
    from mono_ext.kernels.triton.ring import RingConfig

    return (
        RingConfig(tile_rows=64, k_chunk=128, stages=6),  # 96 KB ring
        RingConfig(tile_rows=64, k_chunk=256, stages=4),  # 128 KB ring
        RingConfig(tile_rows=64, k_chunk=64, stages=8),  # 64 KB ring
        RingConfig(tile_rows=128, k_chunk=64, stages=6),  # 96 KB ring, two m-tiles per chunk
        RingConfig(tile_rows=64, k_chunk=128, stages=3),  # 48 KB ring
    )


def _ring(W, X, Y, ctas, cfg):
    """The Gluon TMA-ring stream (mono_ext.kernels.triton.ring) on ``ctas`` CTAs."""
    from mono_ext.kernels.triton.ring import RingGemv

    return RingGemv(W, X.t().contiguous(), Y, ctas, cfg)


RING_CONFIGS: tuple = ()


def _variants():
    """(name, rows per CTA, launcher factory) — each factory takes (W, X, Y) -> launch()."""
    out = []

    def add(name, rpc, make):
        out.append((name, rpc, make))

    for r, bk, ns, nw in ((32, 256, 3, 4), (32, 256, 4, 8), (64, 256, 3, 4), (64, 128, 4, 4)):
        rpc = 96 if 96 % r == 0 else 128
        add(
            f"nested R{r} bk{bk} ns{ns} w{nw}",
            rpc,
            lambda W, X, Y, rpc=rpc, r=r, bk=bk, ns=ns, nw=nw: (
                lambda: nested_kernel[(SMS,)](W, X, Y, rpc, K, B, r, bk, ns, num_warps=nw)
            ),
        )
    for r, bk, ns, nw, st in (
        (32, 256, 3, 4, 0),
        (32, 256, 4, 4, 0),
        (32, 256, 6, 4, 0),
        (64, 256, 3, 4, 0),
        (64, 128, 6, 4, 0),
        (32, 256, 4, 8, 0),
        (32, 256, 4, 4, 1),
        (64, 256, 3, 4, 1),
        (16, 512, 4, 4, 0),
    ):
        rpc = 96 if 96 % r == 0 else 128
        name = f"{'stagger' if st else 'flat'} R{r} bk{bk} ns{ns} w{nw}"
        add(
            name,
            rpc,
            lambda W, X, Y, rpc=rpc, r=r, bk=bk, ns=ns, nw=nw, st=st: (
                lambda: flat_kernel[(SMS,)](W, X, Y, rpc, K, B, r, bk, ns, st, num_warps=nw)
            ),
        )
    for r, bk, ns, nw in ((32, 256, 4, 4), (64, 128, 6, 4)):
        rpc = 96 if 96 % r == 0 else 128

        def make(W, X, Y, rpc=rpc, r=r, bk=bk, ns=ns, nw=nw):
            tiles = W.shape[0] // r
            table = torch.randperm(tiles, device=DEV).to(torch.int32)
            return lambda: gather_kernel[(SMS,)](W, X, Y, table, rpc, K, B, r, bk, ns, num_warps=nw)

        add(f"gather R{r} bk{bk} ns{ns} w{nw}", rpc, make)
    for r, ns, nw in ((16, 2, 4), (16, 3, 4), (16, 2, 8)):
        add(
            f"rows R{r} ns{ns} w{nw}",
            96,
            lambda W, X, Y, r=r, ns=ns, nw=nw: (
                lambda: rows_kernel[(SMS,)](W, X, Y, 96, K, B, r, ns, num_warps=nw)
            ),
        )
    for r, bk, ns, nw in (
        (32, 256, 4, 4),
        (64, 256, 3, 4),
        (64, 128, 6, 4),
        (32, 128, 8, 4),
        (64, 64, 10, 4),
    ):
        rpc = 96 if 96 % r == 0 else 128

        def make(W, X, Y, rpc=rpc, r=r, bk=bk, ns=ns, nw=nw):
            from triton.tools.tensor_descriptor import TensorDescriptor

            desc = TensorDescriptor.from_tensor(W, block_shape=[r, bk])
            return lambda: tma_kernel[(SMS,)](desc, X, Y, rpc, K, B, r, bk, ns, num_warps=nw)

        add(f"tma R{r} bk{bk} ns{ns} w{nw}", rpc, make)
    # the same 69 MB plane on 44, 88 and 132 CTAs: what one CTA's stream sustains, and whether
    # the whole grid reaches the HBM (KERNELS.md M0: >= 60 GB/s per SM at 44, >= 3.7 TB/s at 132)
    for ctas in (44, 88, 132):
        rpc = 128 * SMS // ctas
        for r, bk, ns, nw in ((64, 256, 3, 4), (32, 256, 4, 4)):
            add(
                f"flat R{r} bk{bk} ns{ns} w{nw} c{ctas}",
                128,
                lambda W, X, Y, rpc=rpc, r=r, bk=bk, ns=ns, nw=nw, ctas=ctas: (
                    lambda: flat_kernel[(ctas,)](W, X, Y, rpc, K, B, r, bk, ns, 0, num_warps=nw)
                ),
            )

        def make_tma(W, X, Y, rpc=rpc, ctas=ctas):
            from triton.tools.tensor_descriptor import TensorDescriptor

            desc = TensorDescriptor.from_tensor(W, block_shape=[64, 128])
            return lambda: tma_kernel[(ctas,)](desc, X, Y, rpc, K, B, 64, 128, 6, num_warps=4)

        add(f"tma R64 bk128 ns6 w4 c{ctas}", 128, make_tma)
        for cfg in RING_CONFIGS:
            add(
                f"ring R{cfg.tile_rows} bk{cfg.k_chunk} ns{cfg.stages} c{ctas}",
                128,
                lambda W, X, Y, cfg=cfg, ctas=ctas: _ring(W, X, Y, ctas, cfg),
            )
    for r, bk, ns, nw in ((16, 256, 3, 4), (32, 256, 3, 4), (64, 256, 3, 4)):
        add(
            f"grid R{r} bk{bk} ns{ns} w{nw}",
            96,
            lambda W, X, Y, r=r, bk=bk, ns=ns, nw=nw: (
                lambda: grid_kernel[(W.shape[0] // r,)](W, X, Y, K, B, r, bk, ns, num_warps=nw)
            ),
        )
    return out


def _time_graph(launches, reps=20) -> float:
    """Median us per launch of one graph running every launch once."""
    for f in launches:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for f in launches:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(launches))
    return statistics.median(times)


def _copy_tbs() -> float:
    """Device-to-device copy of 512 MB, bytes read + written per second (TB/s)."""
    src = torch.empty(1 << 28, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    us = _time_graph([lambda: dst.copy_(src)], reps=10)
    tbs = 2 * src.numel() * 2 / us / 1e6
    print(f"copy 512 MB: {us:.1f} us = {tbs:.2f} TB/s (read + write)", flush=True)
    return tbs


def check_and_time(launches, out: torch.Tensor, ref, tol: float) -> tuple[float, float]:
    """Median us per launch of ``launches`` (one CUDA graph), after the first launch's output
    ``out``, poisoned beforehand, was checked against ``ref()``: (us, relative L2 error)."""
    out.fill_(float("nan"))
    launches[0]()
    torch.cuda.synchronize()
    want = ref()
    rel = ((out - want).norm() / want.norm()).item()
    if not rel < tol:
        raise AssertionError(f"wrong result: rel_l2 {rel:.3g}")
    return _time_graph(launches), rel


def write_results(path: str, copy_tbs: float, results: list[dict]) -> None:
    """The run's rows with the device, date, commit, command and versions."""
    with open(path, "w") as f:
        meta = provenance(torch.cuda.get_device_name())
        meta.update(torch=torch.__version__, triton=triton.__version__, copy_tbs=copy_tbs)
        json.dump({**meta, "results": results}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    torch.manual_seed(0)
    results = []
    global RING_CONFIGS
    try:
        RING_CONFIGS = _ring_configs()
    except ImportError as exc:  # a Triton without Gluon: the ring rows are reported missing
        print(f"ring: not built ({exc})", flush=True)

    copy_tbs = _copy_tbs()
    results.append({"name": "copy", "tbs": copy_tbs})

    planes = {}

    def plane(rpc):
        if rpc not in planes:
            n = SMS * rpc
            ws = [torch.randn(n, K, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
            xs = [torch.randn(B, K, device=DEV, dtype=torch.bfloat16) for _ in range(COPIES)]
            ys = [torch.empty(n, B, device=DEV, dtype=torch.float32) for _ in range(COPIES)]
            planes[rpc] = (ws, xs, ys)
        return planes[rpc]

    for rpc in (96, 128):
        ws, xs, ys = plane(rpc)
        mb = ws[0].numel() * 2 / 1e6
        outs = [torch.empty(ws[0].shape[0], B, device=DEV, dtype=torch.bfloat16) for _ in ws]
        us = _time_graph(
            [
                lambda w=w, x=x, o=o: torch.mm(w, x.t(), out=o)
                for w, x, o in zip(ws, xs, outs, strict=True)
            ]
        )
        vouts = [torch.empty(ws[0].shape[0], device=DEV, dtype=torch.bfloat16) for _ in ws]
        us1 = _time_graph(
            [
                lambda w=w, x=x, o=o: torch.mv(w, x[0], out=o)
                for w, x, o in zip(ws, xs, vouts, strict=True)
            ]
        )
        for name, t in (
            (f"cublas mm B16 N{ws[0].shape[0]}", us),
            (f"cublas mv N{ws[0].shape[0]}", us1),
        ):
            print(
                f"{name:32s} {t:7.1f} us  {mb / t:6.2f} TB/s  {100 * mb / t / copy_tbs:5.1f}%",
                flush=True,
            )
            results.append({"name": name, "us": t, "tbs": mb / t, "mb": mb})

    for name, rpc, make in _variants():
        if only and not any(name.startswith(o) for o in only):
            continue
        ws, xs, ys = plane(rpc)
        mb = ws[0].numel() * 2 / 1e6
        try:
            launches = [make(w, x, y) for w, x, y in zip(ws, xs, ys, strict=True)]
            us, rel = check_and_time(
                launches, ys[0], lambda w=ws[0], x=xs[0]: w.float() @ x.float().t(), 1e-2
            )
        except Exception as exc:  # one broken variant must not hide the others
            print(f"{name:32s} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            results.append({"name": name, "error": str(exc)[:300]})
            continue
        tbs = mb / us
        ctas = int(name.rsplit(" c", 1)[1]) if " c" in name else SMS
        per_sm = tbs * 1e3 / ctas
        print(
            f"{name:32s} {us:7.1f} us  {tbs:6.2f} TB/s  {100 * tbs / copy_tbs:5.1f}%  "
            f"{per_sm:5.1f} GB/s/SM  rel {rel:.1e}",
            flush=True,
        )
        results.append(
            {
                "name": name,
                "ctas": ctas,
                "us": us,
                "tbs": tbs,
                "pct_copy": 100 * tbs / copy_tbs,
                "gbs_per_sm": per_sm,
                "mb": mb,
                "rel_l2": rel,
            }
        )

    if args.json:
        write_results(args.json, copy_tbs, results)


if __name__ == "__main__":
    main()
