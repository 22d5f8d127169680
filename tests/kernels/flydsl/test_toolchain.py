"""The offline compile harness: real gfx950 compiles, and checks that fail when they must."""

import re

import flydsl.compiler as flyc
import flydsl.expr as fx
import pytest
from flydsl.expr import range_constexpr
from flydsl.expr.typing import Int32, Int64, Stream

from mono_ext.kernels.flydsl.limits import BLOCK, GFX950
from mono_ext.kernels.flydsl.toolchain import CompileCheckError, compile_offline

_NULL_STREAM = Stream(None)  # the launch default (the current stream)


def _gptr(addr, dtype, align):
    return fx.inttoptr(fx.PointerType.get(dtype.ir_type, fx.AddressSpace.Global, align), addr)


def _chain_launch(n_live: int):
    """n_live floats loaded, folded together, then each scaled: all live at once."""

    @flyc.kernel(known_block_size=[BLOCK, 1, 1])
    def chain(src: Int64, dst: Int64):
        tid = fx.thread_idx.x
        vals = []
        for i in range_constexpr(n_live):
            a = src + fx.Int64(tid * n_live + i) * fx.Int64(4)
            vals.append(fx.generic_load(_gptr(a, fx.Float32, 4)))
        acc = vals[0]
        for i in range_constexpr(1, n_live):
            acc = acc * vals[i] + vals[n_live - i]
        for i in range_constexpr(n_live):
            a = dst + fx.Int64(tid * n_live + i) * fx.Int64(4)
            fx.generic_store(_gptr(a, fx.Float32, 4), vals[i] * acc)

    @flyc.jit
    def launch(src: Int64, dst: Int64, stream: Stream = _NULL_STREAM):
        chain(src, dst).launch(grid=(GFX950.cus, 1, 1), block=(BLOCK, 1, 1), stream=stream)

    return launch


def _lds_launch(nbytes: int):
    @fx.struct
    class Smem:
        buf: fx.Array[fx.Float32, nbytes // 4, 16]

    @flyc.kernel(known_block_size=[BLOCK, 1, 1])
    def lds(dst: Int64, i: Int32):
        tid = fx.thread_idx.x
        p = fx.SharedAllocator().allocate(Smem).peek().buf.ptr
        fx.ptr_store(fx.Float32(1.0), p + tid * 64)
        fx.gpu.barrier()
        fx.generic_store(
            _gptr(dst + fx.Int64(tid) * fx.Int64(4), fx.Float32, 4), fx.ptr_load(p + i)
        )

    @flyc.jit
    def launch(dst: Int64, i: Int32, stream: Stream = _NULL_STREAM):
        lds(dst, i).launch(grid=(GFX950.cus, 1, 1), block=(BLOCK, 1, 1), stream=stream)

    return launch


def test_metadata_of_a_clean_kernel():
    c = compile_offline(_chain_launch(32), (fx.Int64(0), fx.Int64(0)), label="chain32",
                        grid=GFX950.cus)  # fmt: skip
    (k,) = c.kernels
    assert k.name.startswith("chain")
    assert k.workgroup_size == BLOCK
    assert 32 <= k.vgpr_count <= GFX950.vgprs_per_simd_lane  # 32 floats live at once
    assert k.lds_bytes == 0 and k.scratch_bytes == 0
    assert re.search(r'^\s*\.amdgcn_target "amdgcn-amd-amdhsa-[a-z]*-gfx950"', c.isa[k.name], re.M)
    assert c.reasons() == []
    assert c.check() is c


def test_a_kernel_that_spills_fails_the_check():
    # waves_per_eu=8 caps the kernel at 64 VGPRs; 160 live floats cannot fit in them
    c = compile_offline(_chain_launch(160), (fx.Int64(0), fx.Int64(0)), label="chain160",
                        grid=GFX950.cus, hints={"waves_per_eu": 8})  # fmt: skip
    (k,) = c.kernels
    assert k.vgpr_spill_count > 0 and k.scratch_bytes > 0
    reasons = c.reasons()
    assert any("spills" in r for r in reasons) and any("scratch" in r for r in reasons)
    with pytest.raises(CompileCheckError, match="spills"):
        c.check()
    # the same kernel without the cap keeps everything in registers and passes
    assert compile_offline(_chain_launch(160), (fx.Int64(0), fx.Int64(0)), label="chain160",
                           grid=GFX950.cus).reasons() == []  # fmt: skip


def test_lds_over_160k_fails_and_residency_counts_ctas_per_cu():
    over = compile_offline(_lds_launch(180_000), (fx.Int64(0), 0), label="lds180k",
                           grid=GFX950.cus)  # fmt: skip
    assert over.kernels[0].lds_bytes >= 180_000  # LLVM complains but still emits it
    with pytest.raises(CompileCheckError, match="LDS 180000 bytes"):
        over.check()
    fits = compile_offline(_lds_launch(64 * 1024), (fx.Int64(0), 0), label="lds64k",
                           grid=GFX950.cus)  # fmt: skip
    assert fits.kernels[0].lds_bytes == 64 * 1024 and fits.reasons() == []
    fits.per_cu = 3  # three 64 KiB CTAs per CU would need 192 KiB
    assert any("LDS" in r for r in fits.reasons())
    fits.per_cu, fits.grid = 1, GFX950.cus + 1  # one CTA more than CUs: not all resident
    assert any("not all resident" in r for r in fits.reasons())
