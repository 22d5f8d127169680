"""A weight plane streamed through a TMA ring: the stream engine's building block (Gluon, sm_90).

``y[N, B] = W[N, K] @ x[B, K]^T`` on a persistent grid of ``ctas`` CTAs. Each CTA owns the
row tiles ``pid, pid + ctas, pid + 2 * ctas, ...`` of ``tile_rows`` rows and walks them as
``K / k_chunk`` chunks each.

Inside a CTA two partitions share an SMEM ring of ``stages`` weight chunks:

- the **loader** (one warp) issues a TMA copy for every chunk of the CTA's walk, in order,
  waiting only for a free slot, never for data, so HBM sees the CTA's next bytes requested
  while earlier ones are being multiplied;
- the **consumer** (the launch's warpgroup) holds ``x^T`` resident in SMEM, waits for each
  chunk, issues an async wgmma with one kept in flight, and frees a slot once the wgmma that
  read it has retired.

Tensor contract:

| name | shape | dtype | layout | written by |
|---|---|---|---|---|
| ``w`` | [N, K] | bf16 | row-major, N % tile_rows == 0, K % k_chunk == 0 | the engine (weights) |
| ``xt`` | [K, 16] | bf16 | row-major (x transposed; rows past the batch are zeros) | the caller |
| ``y`` | [N, B] | fp32 | row-major | this kernel, every element once |

Bytes in flight per SM are ``stages * tile_rows * k_chunk * 2``. Little's law at ~2 us loaded
latency asks for ~56 KB per SM to keep 132 SMs at 3.7 TB/s, which is what the ring is sized
for (shared/KERNELS.md §4).
"""

from __future__ import annotations

import dataclasses

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mono_ext.kernels.triton.limits import SHARED_PER_BLOCK

__all__ = ["COLS", "RingConfig", "RingGemv", "ring_gemv_kernel"]

#: Columns of x^T: the wgmma N of every chunk. Narrower x^T tiles (8 columns, a 16-byte TMA
#: box) fault on the H200 with this layout, so a batch is padded to 16 rows.
COLS = 16


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """How a plane is cut into ring chunks."""

    tile_rows: int = 64  # wgmma M per tile; 64 rows per warpgroup instruction
    k_chunk: int = 128  # columns per TMA copy (one ring slot)
    stages: int = 6  # ring slots
    loader_regs: int = 40  # registers the loader warp keeps after reallocation

    def chunk_bytes(self) -> int:
        return self.tile_rows * self.k_chunk * 2

    def smem_bytes(self, k: int, cols: int) -> int:
        """Ring plus the resident ``x^T`` (barriers are a few dozen bytes more)."""
        return self.stages * self.chunk_bytes() + k * cols * 2


@gluon.jit
def _ring_loader(
    w_desc,
    ring,
    ready,
    empty,
    pid,
    n_ctas,
    n_tiles,
    KCH: gl.constexpr,
    NS: gl.constexpr,
):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    n_mine = (n_tiles - pid + n_ctas - 1) // n_ctas
    for c in range(n_mine * KCH):
        s = c % NS
        # a fresh barrier has completed the phase before its first: the first lap never waits
        mbarrier.wait(empty.index(s), ((c // NS) & 1) ^ 1)
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
        tile = pid + (c // KCH) * n_ctas
        tma.async_copy_global_to_shared(
            w_desc, [tile * BN, (c % KCH) * BK], ready.index(s), ring.index(s)
        )


@gluon.jit
def _ring_consumer(
    ring,
    ready,
    empty,
    xs,
    xbar,
    y_ptr,
    pid,
    n_ctas,
    n_tiles,
    KCH: gl.constexpr,
    NS: gl.constexpr,
    BN: gl.constexpr,
    BB: gl.constexpr,
):
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BB, 16]
    )
    n_mine = (n_tiles - pid + n_ctas - 1) // n_ctas
    acc = gl.zeros((BN, BB), dtype=gl.float32, layout=mma)
    mbarrier.wait(xbar, 0)
    for c in range(n_mine * KCH):
        s = c % NS
        kk = c % KCH
        mbarrier.wait(ready.index(s), (c // NS) & 1)
        acc = warpgroup_mma(ring.index(s), xs.index(kk), acc, use_acc=kk > 0, is_async=True)
        # one wgmma stays in flight: the one before it has read its slot and can free it
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((c + NS - 1) % NS), pred=kk > 0)
        if kk == KCH - 1:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(s))
            tile = pid + (c // KCH) * n_ctas
            o_rows = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
            o_cols = gl.arange(0, BB, layout=gl.SliceLayout(0, mma))
            gl.store(y_ptr + o_rows[:, None] * BB + o_cols[None, :], acc)


@gluon.jit
def ring_gemv_kernel(
    w_desc,
    x_desc,
    y_ptr,
    n_tiles,
    KCH: gl.constexpr,
    NS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BB: gl.constexpr = x_desc.block_type.shape[1]
    pid = gl.program_id(0)
    n_ctas = gl.num_programs(0)
    ring = gl.allocate_shared_memory(w_desc.dtype, [NS] + w_desc.block_type.shape, w_desc.layout)
    xs = gl.allocate_shared_memory(x_desc.dtype, [KCH] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    xbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(xbar, count=1)
    fence_async_shared()
    mbarrier.expect(xbar, KCH * x_desc.block_type.nbytes)
    for kc in gl.static_range(KCH):
        tma.async_copy_global_to_shared(
            x_desc, [kc * x_desc.block_type.shape[0], 0], xbar, xs.index(kc)
        )
    gl.warp_specialize(
        [
            (
                _ring_consumer,
                (ring, ready, empty, xs, xbar, y_ptr, pid, n_ctas, n_tiles, KCH, NS, BN, BB),
            ),
            (_ring_loader, (w_desc, ring, ready, empty, pid, n_ctas, n_tiles, KCH, NS)),
        ],
        [1],
        [LOADER_REGS],
    )


class RingGemv:
    """One bound plane: descriptors and grid made once, each call one launch (no checks)."""

    def __init__(self, w, xt, y, ctas: int, config: RingConfig = RingConfig()):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        n, k = w.shape
        cols = xt.shape[1]
        c = config
        if (
            n % c.tile_rows
            or k % c.k_chunk
            or tuple(xt.shape) != (k, COLS)
            or tuple(y.shape) != (n, COLS)
        ):
            raise ValueError(
                f"ring GEMV needs N % {c.tile_rows} == 0, K % {c.k_chunk} == 0, xt [K, {COLS}], "
                f"y [N, {COLS}]; got w {tuple(w.shape)}, xt {tuple(xt.shape)}, y {tuple(y.shape)}"
            )
        if c.smem_bytes(k, cols) > SHARED_PER_BLOCK:
            raise ValueError(
                f"ring needs {c.smem_bytes(k, cols)} B of SMEM, over {SHARED_PER_BLOCK}"
            )
        w_layout = gl.NVMMASharedLayout.get_default_for([c.tile_rows, c.k_chunk], gl.bfloat16)
        x_layout = gl.NVMMASharedLayout.get_default_for([c.k_chunk, cols], gl.bfloat16)
        self._w_desc = TensorDescriptor.from_tensor(w, [c.tile_rows, c.k_chunk], w_layout)
        self._x_desc = TensorDescriptor.from_tensor(xt, [c.k_chunk, cols], x_layout)
        self._y = y
        self._n_tiles = n // c.tile_rows
        self._grid = (min(ctas, self._n_tiles),)
        self._kch = k // c.k_chunk
        self._config = c

    def __call__(self) -> None:
        ring_gemv_kernel[self._grid](
            self._w_desc,
            self._x_desc,
            self._y,
            self._n_tiles,
            self._kch,
            self._config.stages,
            self._config.loader_regs,
            num_warps=4,
        )
