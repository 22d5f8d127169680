"""How fast can one persistent Triton launch stream an fp8 block-128 plane? (not a test)

    PYTHONPATH=src python benchmarks/bench_stream_fp8.py [--json out.json] [--only NAME,...]

K2 reads fp8 block-128 expert planes at about a third of its bf16 byte rate (docs/perf.md,
"Why K2's fp8 GEMVs are slow"), and widening the codes faster did not change that. This
isolates the question on one plane, ``y[N, 16] = (W * scale) @ x[16, K]^T`` with W e4m3fn
[N, K] and one fp32 scale per 128 x 128 block (K = 2048, 128 rows per CTA, 132 CTAs), timed
as in ``bench_stream.py`` (8 launches over 8 copies of the plane, ~35 MB each, inside one CUDA
graph; median of 20 replays), each variant checked against torch first:

- ``widen``: K2's way today: each chunk's codes widened to bf16 in registers, a bf16 MMA
  with the bf16 activations, the fp32 partial times the block's scale.
- ``a8``: vLLM's way: the activations quantized to e4m3 per (row, 128 columns) beforehand
  (scale = amax / 448, as vLLM's per-token-group quantization), an e4m3 x e4m3 MMA straight
  from shared memory, the partial times both scales. Its check is against the product with
  the dequantized activations (the quantization is the arm's numerics, not an error).
- ``a8q``: ``a8`` with each chunk's activations quantized inside the loop from bf16 (amax
  over the chunk's 128 columns per row, an IEEE division, e4m3 with saturation), as a K2
  task would do it without a quantized copy of its input: what that costs over ``a8``.
- ``bf16``: the same rows as a bf16 plane (twice the bytes), the yardstick per byte.

Names: ``R`` rows per tile, ``bk`` K chunk (at most 128: a chunk stays in one scale block),
``ns`` chunks in flight (Triton pipeline stages), ``w`` warps.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from bench_stream import _copy_tbs, check_and_time, write_results

DEV = torch.device("cuda")
SMS = 132
K = 2048
B = 16
ROWS_PER_CTA = 128
COPIES = 8
E4M3_MAX = 448.0


@triton.jit
def fp8_flat_kernel(
    W,
    S,
    X,
    XQ,
    XS,
    Y,
    rows_per_cta,
    K: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    BK: tl.constexpr,
    NS: tl.constexpr,
    MODE: tl.constexpr,  # 0 widen, 1 a8, 2 bf16 plane, 3 a8q
):
    pid = tl.program_id(0)
    r0 = pid * rows_per_cta
    KCH: tl.constexpr = K // BK
    KB: tl.constexpr = K // 128
    n = (rows_per_cta // R) * KCH
    bb = tl.arange(0, B)
    acc = tl.zeros([R, B], tl.float32)
    # one flat pipelined loop over (tile, chunk), as K2's expert stages run
    for i in tl.range(0, n, num_stages=NS):
        t = i // KCH
        kk = i % KCH
        rows = r0 + t * R + tl.arange(0, R)
        cols = kk * BK + tl.arange(0, BK)
        w = tl.load(W + rows[:, None] * K + cols[None, :])
        if MODE == 2:
            x = tl.load(X + bb[None, :] * K + cols[:, None])
            acc = tl.dot(w, x, acc)
        else:
            s = tl.load(S + (rows // 128) * KB + (kk * BK) // 128)
            if MODE == 1:
                xq = tl.load(XQ + bb[None, :] * K + cols[:, None])
                xs = tl.load(XS + bb * KB + (kk * BK) // 128)
                acc += tl.dot(w, xq) * s[:, None] * xs[None, :]
            elif MODE == 3:
                x = tl.load(X + bb[None, :] * K + cols[:, None]).to(tl.float32)
                xs = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10), 448.0)
                q = tl.clamp(tl.div_rn(x, xs[None, :]), -448.0, 448.0)
                acc += tl.dot(w, q.to(tl.float8e4nv)) * s[:, None] * xs[None, :]
            else:
                x = tl.load(X + bb[None, :] * K + cols[:, None])
                acc += tl.dot(w.to(tl.bfloat16), x) * s[:, None]
        last = kk == KCH - 1
        tl.store(Y + rows[:, None] * B + bb[None, :], acc, mask=last)
        acc = tl.where(last, 0.0, acc)


MODES = {"widen": 0, "a8": 1, "bf16": 2, "a8q": 3}
VARIANTS = [
    # (mode, R, bk, ns, warps)
    ("widen", 64, 128, 4, 4),
    ("widen", 64, 128, 6, 4),
    ("widen", 64, 64, 8, 4),
    ("a8", 64, 128, 4, 4),
    ("a8", 64, 128, 6, 4),
    ("a8", 64, 128, 8, 4),
    ("a8", 128, 128, 4, 8),
    ("a8q", 64, 128, 6, 4),
    ("a8q", 64, 128, 8, 4),
    ("bf16", 64, 128, 4, 4),
    ("bf16", 64, 256, 3, 4),
]


def variant_name(mode: str, r: int, bk: int, ns: int, nw: int) -> str:
    return f"{mode} R{r} bk{bk} ns{ns} w{nw}"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and fp32 scales [rows, K / 128] of bf16 activations, per 128 columns."""
    g = x.float().view(x.shape[0], -1, 128)
    scale = g.abs().amax(-1).clamp_min(1e-10) / E4M3_MAX
    q = (g / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(x.shape), scale.contiguous()


def make_planes(n: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for _ in range(COPIES):
        w = (torch.randn(n, K, device=DEV) * 0.5).to(torch.float8_e4m3fn)
        s = torch.rand(n // 128, K // 128, device=DEV) * 0.02 + 0.001
        x = torch.randn(B, K, device=DEV).to(torch.bfloat16)
        xq, xs = quantize_rows(x)
        wb = (w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16)
        y = torch.empty(n, B, device=DEV, dtype=torch.float32)
        out.append(dict(w=w, s=s, x=x, xq=xq, xs=xs, wb=wb, y=y))
    return out


def reference(p: dict[str, torch.Tensor], mode: str) -> torch.Tensor:
    """What each mode computes, in fp64: the dequantized plane (bf16: the bf16 plane) times
    the activations it multiplies (a8: its dequantized e4m3 activations)."""
    if mode == "bf16":
        w = p["wb"].double()
    else:
        full = p["s"].double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        w = p["w"].double() * full
    if mode in ("a8", "a8q"):
        x = p["xq"].double() * p["xs"].double().repeat_interleave(128, 1)
    else:
        x = p["x"].double()
    return (w @ x.t()).float()


def launcher(p: dict[str, torch.Tensor], mode: str, r: int, bk: int, ns: int, nw: int):
    w = p["wb"] if mode == "bf16" else p["w"]

    def launch():
        fp8_flat_kernel[(SMS,)](w, p["s"], p["x"], p["xq"], p["xs"], p["y"], ROWS_PER_CTA, K, B,
                                r, bk, ns, MODES[mode], num_warps=nw)  # fmt: skip

    return launch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", default="", help="comma-separated name prefixes")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    torch.manual_seed(0)
    copy_tbs = _copy_tbs()
    n = SMS * ROWS_PER_CTA
    planes = make_planes(n)
    results = [{"name": "copy", "tbs": copy_tbs}]
    for mode, r, bk, ns, nw in VARIANTS:
        name = variant_name(mode, r, bk, ns, nw)
        if only and not any(name.startswith(o) for o in only):
            continue
        mb = n * K * (2 if mode == "bf16" else 1) / 1e6  # the plane's bytes (scales: 0.4%)
        try:
            launches = [launcher(p, mode, r, bk, ns, nw) for p in planes]
            us, rel = check_and_time(
                launches, planes[0]["y"], lambda m=mode: reference(planes[0], m), 1e-3
            )
        except Exception as exc:  # one broken variant must not hide the others
            print(f"{name:28s} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            results.append({"name": name, "error": str(exc)[:300]})
            continue
        tbs = mb / us
        print(
            f"{name:28s} {us:7.1f} us  {tbs:6.2f} TB/s  {100 * tbs / copy_tbs:5.1f}%  "
            f"{n * K / us / 1e6:6.2f} Gcodes/ms  rel {rel:.1e}",
            flush=True,
        )
        results.append(
            {"name": name, "us": us, "tbs": tbs, "pct_copy": 100 * tbs / copy_tbs, "mb": mb,
             "rel_l2": rel}  # fmt: skip
        )
    if args.json:
        write_results(args.json, copy_tbs, results)


if __name__ == "__main__":
    main()
