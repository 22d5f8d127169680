"""Weight-plane formats the Triton K1/K2 read in place: bf16, and fp8 e4m3fn with fp32 scales
(block 128x128, per row, per tensor), as vLLM 0.26 and SGLang 0.5.17 leave them on sm_90
(docs/quantized_planes.md).

A launch is compiled for one format per plane (``core.spec.BuildKey.formats``); each plane's
format is a constexpr ``Q`` code, so a bf16 plane compiles to the same code as a build that
names no format. A quantized plane ``name`` comes with its scale tensor as ``weights[name + ".scale"]``
(fp32, dense, the engine's own tensor):

| format        | Q | weight                     | scale (per expert for w13/w2)           |
|---------------|---|----------------------------|-----------------------------------------|
| bf16          | 0 | bf16 [.., N, K]            | none                                    |
| fp8_block128  | 1 | e4m3fn [.., N, K]          | fp32 [.., ceil(N/128), ceil(K/128)]     |
| fp8_channel   | 2 | e4m3fn [.., N, K]          | fp32 [.., N] (or [.., N, 1])            |
| fp8_tensor    | 3 | e4m3fn [.., N, K]          | fp32 one per plane ([E] for experts)    |

How a GEMV reads them (:func:`qdot`): every fp8 code converts to bf16 exactly (3 mantissa bits
into 7, the exponent range fits), the MMA multiplies it by the bf16 activations with fp32
accumulation, and the chunk's fp32 partial is multiplied by its scale before it joins the
accumulator. So the result equals the product with the dequantized plane up to fp32 rounding
(no bf16 rounding of ``w * scale``), which is also what the engines' block-scaled GEMMs compute.
A chunk must not straddle a scale column: block-128 planes are read in K chunks that divide 128
(:func:`chunk_limit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import triton
import triton.language as tl

from mono_ext.kernels.triton.limits import FORMAT_CODES, READ_FORMATS

__all__ = [
    "FORMAT_CODES",
    "READ_FORMATS",
    "chunk_limit",
    "format_code",
    "plane_reasons",
    "qdot",
    "qdot_a8",
    "qdot_a8q",
    "qdot_either",
    "quantize_e4m3_cols",
    "row_scale",
    "scale_index",
    "scale_numel",
]

BLOCK = 128  # fp8 block-128: rows and columns per scale
_BLOCK = tl.constexpr(BLOCK)


def format_code(formats: Mapping[str, str], plane: str) -> int:
    """The ``Q`` code of ``plane`` (bf16 when the build names no format for it)."""
    fmt = formats.get(plane, "bf16")
    if fmt not in FORMAT_CODES:
        raise ValueError(f"{plane}: the Triton kernels do not read {fmt!r} planes")
    return FORMAT_CODES[fmt]


def chunk_limit(formats: Mapping[str, str], *planes: str) -> int | None:
    """The largest K chunk the GEMVs over ``planes`` may use: a block-128 plane's chunks must
    stay inside one scale column (None: no limit)."""
    if any(formats.get(p) == "fp8_block128" for p in planes):
        return BLOCK
    return None


def scale_numel(fmt: str, n: int, k: int) -> int:
    """Scales one [N, K] plane (one expert) has in ``fmt``."""
    if fmt == "fp8_block128":
        return -(-n // BLOCK) * -(-k // BLOCK)
    if fmt == "fp8_channel":
        return n
    if fmt == "fp8_tensor":
        return 1
    return 0


def plane_reasons(name: str, weights: Mapping[str, Any], fmt: str, shape: tuple) -> list[str]:
    """What is wrong with plane ``name`` (logical ``shape`` ([E,] N, K)) and its scale for
    format ``fmt``: dtype, shape, density, 16-byte alignment (Triton keys variants on it; another
    alignment would compile mid-step). Missing planes are the caller's to report."""
    import torch

    t = weights.get(name)
    if t is None:
        return []
    bad = []
    want = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
    if t.dtype != want:
        bad.append(f"{name} is {t.dtype}, expected {want} ({fmt})")
    if tuple(t.shape) != tuple(shape):
        bad.append(f"{name} is {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_contiguous():
        bad.append(f"{name} is not contiguous")
    if t.data_ptr() % 16:
        bad.append(f"{name} is not 16-byte aligned (no JIT mid-step)")
    if fmt == "bf16":
        return bad
    s = weights.get(name + ".scale")
    *lead, n, k = shape
    experts = int(lead[0]) if lead else 1
    need = experts * scale_numel(fmt, int(n), int(k))
    if s is None:
        bad.append(f"missing {name}.scale ({fmt} planes need their fp32 scales)")
    elif s.dtype != torch.float32 or s.numel() != need or not s.is_contiguous():
        bad.append(
            f"{name}.scale is {s.dtype} {tuple(s.shape)} "
            f"({'dense' if s.is_contiguous() else 'strided'}), expected {need} dense float32 "
            f"scales ({fmt})"
        )
    elif s.data_ptr() % 16:
        bad.append(f"{name}.scale is not 16-byte aligned (no JIT mid-step)")
    return bad


@triton.jit
def scale_index(rows, k0, Q: tl.constexpr, N, K):
    """Index into one [N, K] plane's scales of output ``rows`` for the chunk starting at
    column ``k0`` (``Q``: FORMAT_CODES; the caller adds expert * scales per expert). ``N`` and
    ``K`` may be constexprs or run-time values (K2's down stage reads two planes of different
    K in one loop)."""
    if Q == 1:
        return (rows // _BLOCK) * ((K + _BLOCK - 1) // _BLOCK) + k0 // _BLOCK
    elif Q == 2:
        return rows
    else:
        return rows * 0


@triton.jit
def qdot(w, x, acc, scale_ptr, rows, rmask, k0, Q: tl.constexpr, N, K):
    """``acc + W[rows, k0:k0+BK] @ x`` for a plane in format ``Q``: bf16 planes accumulate in
    the MMA; fp8 planes multiply bf16(codes) @ x (exact products, fp32 sums) by each row's
    scale of this chunk. ``scale_ptr`` points at this plane's (expert's) scales."""
    if Q == 0:
        return tl.dot(w, x, acc)
    else:
        s = row_scale(scale_ptr, rows, rmask, k0, Q, N, K)
        return acc + tl.dot(w.to(tl.bfloat16), x) * s[:, None]


@triton.jit
def quantize_e4m3_cols(x):
    """A K chunk of activations ``x`` [BK, BB] (one batch row per column) as e4m3 codes and
    one fp32 scale per column: ``scale = max(amax, 1e-10) / 448`` over the chunk, codes =
    ``x / scale`` rounded to nearest even, saturating (vLLM's per-token-group quantization of
    the activations of an fp8 block-128 GEMM, groups of 128 columns = one chunk). IEEE
    divisions, so the reference (``reference.convert.quantize_activations``) matches code for
    code. A zero is divided as ``s / s`` and keeps its own signed zero: sm_90's IEEE division
    sends a zero dividend to a slow subroutine (``FCHK``, then a call), and the padding rows of
    a narrow step are all zeros."""
    xf = x.to(tl.float32)
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-10), 448.0)
    zero = xf == 0.0
    q = tl.where(zero, xf, tl.div_rn(tl.where(zero, s[None, :], xf), s[None, :]))
    return tl.clamp(q, -448.0, 448.0).to(tl.float8e4nv), s


@triton.jit
def qdot_a8(w, x, acc, scale_ptr, rows, rmask, k0, Q: tl.constexpr, N, K):
    """``qdot`` of an fp8 plane on e4m3 activations: the chunk's activations ``x`` quantized
    (:func:`quantize_e4m3_cols`), an e4m3 x e4m3 MMA read from shared memory (no widening),
    its fp32 partial times the weight rows' and the activation columns' scales. The chunk is
    the quantization group: the caller's chunks are 128 columns (or all of K below that)."""
    xq, xs = quantize_e4m3_cols(x)
    return qdot_a8q(w, xq, xs, acc, scale_ptr, rows, rmask, k0, Q, N, K)


@triton.jit
def qdot_a8q(w, xq, xs, acc, scale_ptr, rows, rmask, k0, Q: tl.constexpr, N, K):
    """:func:`qdot_a8` on activations the caller quantized beforehand: codes ``xq`` [BK, BB]
    and one scale per column ``xs`` [BB], as :func:`quantize_e4m3_cols` returns them (a
    caller that multiplies the same activations by many tiles quantizes them once)."""
    s = row_scale(scale_ptr, rows, rmask, k0, Q, N, K)
    return acc + tl.dot(w, xq) * s[:, None] * xs[None, :]


@triton.jit
def row_scale(scale_ptr, rows, rmask, k0, Q: tl.constexpr, N, K):
    """Each weight row's scale for the chunk at column ``k0`` (1 for a bf16 plane)."""
    if Q == 0:  # noqa: SIM108 (a constexpr branch)
        s = tl.full(rows.shape, 1.0, tl.float32)
    else:
        s = tl.load(scale_ptr + scale_index(rows, k0, Q, N, K), mask=rmask, other=0.0)
    return s


@triton.jit
def qdot_either(acc, wa, wb, use_b, x, sa_ptr, sb_ptr, rows, rmask, k0, QA: tl.constexpr,
                QB: tl.constexpr, NA, KA, NB, KB):  # fmt: skip
    """``qdot`` for a loop that streams two planes of different formats (A and B), one per
    tile: the tile was loaded into ``wa`` or ``wb`` (``use_b``; the other load fully masked,
    so no traffic), since one load cannot go through pointers of two element types. Both
    widen to bf16 exactly; one MMA; then each row's scale of its own plane."""
    w = tl.where(use_b, wb.to(tl.bfloat16), wa.to(tl.bfloat16))
    s = tl.where(
        use_b,
        row_scale(sb_ptr, rows, rmask & use_b, k0, QB, NB, KB),
        row_scale(sa_ptr, rows, rmask & (use_b == 0), k0, QA, NA, KA),
    )
    return acc + tl.dot(w, x) * s[:, None]
