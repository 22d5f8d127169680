"""The TMA-ring weight stream (mono_ext.kernels.triton.ring).

Offline, on any machine: each ring configuration the benchmarks time compiles for sm_90a, uses
the instructions the stream engine is built on (TMA copies, mbarrier waits, async wgmma, the
loader's register reallocation), spills nothing and fits its SMEM. On an H200: the product
against an fp32 torch reference on fresh random inputs, the output poisoned first, at CTA
counts that leave some CTAs a tile more than others; and a refusal of the 8-column x^T tile,
which faults on the device.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
ring = pytest.importorskip("mono_ext.kernels.triton.ring", reason="this Triton has no Gluon")

from mono_ext.kernels.triton.limits import SHARED_PER_BLOCK  # noqa: E402
from mono_ext.kernels.triton.offline import resources  # noqa: E402

K = 2048
CONFIGS = [
    ring.RingConfig(tile_rows=64, k_chunk=128, stages=6),
    ring.RingConfig(tile_rows=64, k_chunk=256, stages=4),
    ring.RingConfig(tile_rows=128, k_chunk=64, stages=6),
]


def _compile_sm90(config: ring.RingConfig, cols: int):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    w_layout = gl.NVMMASharedLayout.get_default_for([config.tile_rows, config.k_chunk], gl.bfloat16)
    x_layout = gl.NVMMASharedLayout.get_default_for([config.k_chunk, cols], gl.bfloat16)
    signature = {
        "w_desc": f"tensordesc<bf16[{config.tile_rows}, {config.k_chunk}],{w_layout!r}>",
        "x_desc": f"tensordesc<bf16[{config.k_chunk}, {cols}],{x_layout!r}>",
        "y_ptr": "*fp32",
        "n_tiles": "i32",
        "KCH": "constexpr",
        "NS": "constexpr",
        "LOADER_REGS": "constexpr",
    }
    constexprs = {
        "KCH": K // config.k_chunk,
        "NS": config.stages,
        "LOADER_REGS": config.loader_regs,
    }
    src = GluonASTSource(
        ring.ring_gemv_kernel,
        signature,
        constexprs=constexprs,
        attrs={(2,): [["tt.divisibility", 16]]},
    )
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except RuntimeError as exc:  # no ptxas for sm_90a in this wheel
        pytest.skip(f"cannot compile for sm_90a here: {exc}")


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: f"R{c.tile_rows}bk{c.k_chunk}ns{c.stages}"
)
@pytest.mark.parametrize("cols", [8, 16])
def test_ring_compiles_for_sm90a_with_the_stream_instructions(config, cols):
    kernel = _compile_sm90(config, cols)
    ptx = kernel.asm["ptx"]
    chunks = K // config.k_chunk
    # one copy per resident x^T chunk plus the loader's weight copy (a 128-byte swizzle box
    # holds 64 bf16 columns, so a wider chunk is several boxes)
    assert ptx.count("cp.async.bulk.tensor") >= chunks + 1
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group" in ptx
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive" in ptx
    assert "setmaxnreg" in ptx  # the loader warp gives its registers to the consumer
    res = resources(kernel)
    assert res.stack == 0 and res.spill_stores == res.spill_loads == 0
    smem = res.shared
    want = config.smem_bytes(K, cols)
    assert want <= smem <= want + 1024, (smem, want)  # ring + x^T, then alignment and barriers
    assert smem <= SHARED_PER_BLOCK


def test_ring_refuses_a_plane_it_cannot_tile():
    w = torch.empty(100, K, dtype=torch.bfloat16)
    xt = torch.empty(K, 16, dtype=torch.bfloat16)
    y = torch.empty(100, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="N % 64 == 0"):
        ring.RingGemv(w, xt, y, ctas=4)
    w128 = torch.empty(128, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"xt \[K, 16\]"):  # 8 columns fault on the device
        ring.RingGemv(w128, xt[:, :8], torch.empty(128, 8, dtype=torch.float32), ctas=4)
    with pytest.raises(ValueError, match="SMEM"):
        ring.RingGemv(
            torch.empty(128, K, dtype=torch.bfloat16),
            xt,
            torch.empty(128, 16, dtype=torch.float32),
            ctas=4,
            config=ring.RingConfig(k_chunk=256, stages=8),
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: f"R{c.tile_rows}bk{c.k_chunk}ns{c.stages}"
)
@pytest.mark.parametrize("ctas", [7, 132])
def test_ring_matches_the_fp32_product(config, ctas):
    cols = ring.COLS
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the ring is built for sm_90")
    gen = torch.Generator(device="cuda").manual_seed(1000 * ctas + cols)
    n = 29 * 128  # 58 / 29 tiles: uneven over both CTA counts
    w = (torch.randn(n, K, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(cols, K, device="cuda", generator=gen).to(torch.bfloat16)
    y = torch.full((n, cols), float("nan"), device="cuda")
    launch = ring.RingGemv(w, x.t().contiguous(), y, ctas, config)
    launch()
    torch.cuda.synchronize()
    ref = w.float() @ x.float().t()
    rel = ((y - ref).norm() / ref.norm()).item()
    assert torch.isfinite(y).all()
    assert rel < 1e-5, rel  # fp32 accumulation of exact bf16 products: rounding order only
