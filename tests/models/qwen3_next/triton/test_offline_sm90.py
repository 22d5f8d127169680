"""K1 (GDN, attention) and K2 (bf16) as a deployment of the 80B-A3B preset builds them,
compiled for sm_90a on the CPU (no GPU, no driver: ``kernels.triton.offline``, the same
builds ``tools/ptx_digest.py`` digests), with the resource facts the persistent design
relies on: no spills, at most 255 registers, shared memory within an H200 block's 227 KB,
one CTA per SM resident at the build's grid, the projections on wgmma, and no compile of
its own per width (the row count is never specialised).

Skips only where Triton cannot compile for sm_90a at all (a probe kernel), and under
``TRITON_INTERPRET=1`` (the interpreter replaces compiled kernels).
"""

import os

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("offline sm_90a compiles need the compiler, not the interpreter",
                allow_module_level=True)  # fmt: skip

import triton.language as tl  # noqa: E402

from mono_ext.kernels.triton.limits import SHARED_PER_BLOCK  # noqa: E402
from mono_ext.kernels.triton.offline import (  # noqa: E402
    compile_offline,
    ptx_digest,
    resources,
    sass_by_function,
    sass_opcodes,
)
from mono_ext.models.qwen3_next.triton.offline import (  # noqa: E402
    DEFAULT_BUILDS,
    GRID,
    offline_build,
)
from mono_ext.runtime.build_cache import (  # noqa: E402
    DeviceLimits,
    KernelResources,
    check_residency,
)

WIDTHS = (1, 16)


@triton.jit
def _probe(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


@pytest.fixture(scope="module")
def compiled():
    """(build, width) -> (build, compiled kernel), each compiled once for the module."""
    try:
        compile_offline(_probe, (torch.zeros(16), 16), {"BLOCK": 16})
    except Exception as e:  # no ptxas / no NVIDIA backend in this Triton
        pytest.skip(f"Triton cannot compile for sm_90a here: {e!r}")
    out = {}
    for name in DEFAULT_BUILDS:
        for w in WIDTHS:
            b = offline_build(name, w)
            out[name, w] = (b, b.compile())
    return out


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", DEFAULT_BUILDS)
def test_resources(compiled, name, width):
    b, c = compiled[name, width]
    r = resources(c)
    assert (r.spill_stores, r.spill_loads, r.stack) == (0, 0, 0), f"{b.label}: spills {r}"
    assert r.regs <= 255, f"{b.label}: {r.regs} registers"
    assert 0 < r.shared <= SHARED_PER_BLOCK, f"{b.label}: {r.shared} B shared"
    assert r.num_warps == b.constexprs["num_warps"]
    res = KernelResources(regs_per_thread=r.regs, num_warps=r.num_warps, shared_bytes=r.shared)
    # the build's own residency check, against an H200's 132 SMs
    assert check_residency(b.label, GRID, res, DeviceLimits(sm_count=132)) >= 1


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", DEFAULT_BUILDS)
def test_projections_on_wgmma(compiled, name, width):
    b, c = compiled[name, width]
    assert "wgmma.mma_async" in c.asm["ptx"], f"{b.label}: no wgmma in the PTX"


@pytest.mark.parametrize("name", DEFAULT_BUILDS)
def test_one_compile_for_every_width(compiled, name):
    digests = {ptx_digest(compiled[name, w][1]) for w in WIDTHS}
    assert len(digests) == 1, f"{name}: widths {WIDTHS} compile to different code"


def test_code_size_by_function_covers_every_instruction(compiled):
    """``sass_by_function``: every SASS instruction of K2 is counted once, under the source
    function its line info names, and K2's stages and the bounded wait are among them."""
    _, c = compiled["k2 gdn bf16", 1]
    by_fn = sass_by_function(c)
    assert sum(by_fn.values()) == sum(sass_opcodes(c).values())
    for fn in ("k2_stages.py:s1_out_proj", "k2_experts.py:s4_down", "primitives.py:wait_tagged"):
        assert by_fn.get(fn, 0) > 0, f"no instruction attributed to {fn}: {sorted(by_fn)}"


def test_k2_norm_hand_off_is_fenced(compiled):
    """The norm's hand-off is the one whose payload sits outside its tagged words (the shared
    u planes): the reduce task's fence must come between its plane stores and its sums, and
    each reader's after its wait for the sums, or a reader could see the sums before the
    planes. Both fences live in the K2 build every deployment compiles."""
    _, c = compiled["k2 gdn bf16", 1]
    ptx = c.asm["ptx"]
    assert ptx.count("fence.acq_rel.gpu") >= 2, "the norm's hand-off lost a fence"
    assert "st.relaxed.gpu.global.b64" in ptx and "ld.volatile.global" in ptx


def test_fp8_activations_build_multiplies_e4m3_on_e4m3():
    """``fp8_activations``: the expert stages' MMAs are e4m3 x e4m3 (QGMMA on sm_90) beside
    the bf16 ones of out_proj's widened codes and the router; no spills."""
    b = offline_build("k2 gdn fp8_block128 a8", 1)
    c = b.compile()
    ops = sass_opcodes(c)
    assert any(op.startswith("QGMMA") for op in ops), f"{b.label}: no e4m3 MMA"
    assert any(op.startswith("HGMMA") for op in ops), f"{b.label}: no bf16 MMA"
    r = resources(c)
    assert (r.spill_stores, r.spill_loads, r.stack) == (0, 0, 0), f"{b.label}: spills {r}"
    assert r.regs <= 255 and 0 < r.shared <= SHARED_PER_BLOCK, r


def test_bounded_down_prefetch_build():
    """``down_prefetch_bytes``: the bulk L2 prefetch stays (its byte counts from the budget),
    the build keeps the default's resources: no spills, one CTA per SM."""
    b = offline_build("k2 gdn bf16 down-prefetch-256k", 1)
    c = b.compile()
    assert "cp.async.bulk.prefetch.L2" in c.asm["ptx"], f"{b.label}: no L2 prefetch"
    assert ptx_digest(c) != ptx_digest(offline_build("k2 gdn bf16", 1).compile())
    r = resources(c)
    assert (r.spill_stores, r.spill_loads, r.stack) == (0, 0, 0), f"{b.label}: spills {r}"
    res = KernelResources(regs_per_thread=r.regs, num_warps=r.num_warps, shared_bytes=r.shared)
    assert check_residency(b.label, GRID, res, DeviceLimits(sm_count=132)) >= 1


@pytest.mark.parametrize(
    "name, prefetches",
    [("k2 gdn bf16", 1), ("k2 gdn bf16 no-router-prefetch", 0), ("k2 gdn bf16 prefetch-shared", 2)],
)
def test_k2_one_plane_prefetch_builds(name, prefetches):
    """``prefetch_router`` (the default) / ``prefetch_shared``: one bulk L2 prefetch per CTA
    after S1 for each plane (none of the down planes'); no spills, one CTA per SM."""
    b = offline_build(name, 1)
    c = b.compile()
    ptx = c.asm["ptx"]
    assert ptx.count("cp.async.bulk.prefetch.L2") == prefetches, f"{b.label}: prefetches"
    r = resources(c)
    assert (r.spill_stores, r.spill_loads, r.stack) == (0, 0, 0), f"{b.label}: spills {r}"
    res = KernelResources(regs_per_thread=r.regs, num_warps=r.num_warps, shared_bytes=r.shared)
    assert check_residency(b.label, GRID, res, DeviceLimits(sm_count=132)) >= 1


def test_dv_split_build():
    """``dv_split``: the blocked recurrence compiles without spills and stays resident at one
    CTA per SM, and compiles to other code than the default build."""
    b = offline_build("k1 gdn dv-split-4", 1)
    c = b.compile()
    r = resources(c)
    assert (r.spill_stores, r.spill_loads, r.stack) == (0, 0, 0), f"{b.label}: spills {r}"
    assert r.regs <= 255 and 0 < r.shared <= SHARED_PER_BLOCK, r
    res = KernelResources(regs_per_thread=r.regs, num_warps=r.num_warps, shared_bytes=r.shared)
    assert check_residency(b.label, GRID, res, DeviceLimits(sm_count=132)) >= 1
    assert b.constexprs["DS"] == 4
    assert ptx_digest(c) != ptx_digest(offline_build("k1 gdn", 1).compile())


@pytest.mark.parametrize("kind", ["gdn", "attn"])
def test_k1_trace_build_stamps_every_point(kind):
    """``K1Config.trace``: one %globaltimer read per trace point beyond the untraced build's
    (whose reads are its bounded waits' deadlines), no spills, still one CTA per SM; the
    default build reads no trace word."""
    from mono_ext.models.qwen3_next.triton.k1_kernel import TRACE_POINTS

    plain = offline_build("k1 attn every-cta" if kind == "attn" else f"k1 {kind}", 1)
    b = offline_build(f"k1 {kind} trace", 1)
    assert b.constexprs["TRACE"] and not plain.constexprs["TRACE"]
    c = b.compile()
    ptx, ptx0 = c.asm["ptx"], plain.compile().asm["ptx"]
    assert ptx.count("%globaltimer") - ptx0.count("%globaltimer") == len(TRACE_POINTS)
    r = resources(c)
    assert (r.spill_stores, r.spill_loads, r.stack) == (0, 0, 0), f"{b.label}: spills {r}"
    assert r.regs <= 255 and 0 < r.shared <= SHARED_PER_BLOCK, r
    res = KernelResources(regs_per_thread=r.regs, num_warps=r.num_warps, shared_bytes=r.shared)
    assert check_residency(b.label, GRID, res, DeviceLimits(sm_count=132)) >= 1


@pytest.mark.parametrize(
    "plain_name, once_name, nonce",
    [("k1 gdn", "k1 gdn norm-once", 0), ("k1 attn every-cta", "k1 attn", 4)],
)
def test_k1_norm_once_build_fences_its_hand_off(plain_name, once_name, nonce):
    """``K1Config.norm_once_above`` (GDN at 0; the attention front's default, 4): no spills,
    still one CTA per SM; beyond the fences of the build where every CTA norms every row, one
    after the shared rows' stores (before the flags) and one after the flags are seen (before
    the rows are read); that build has no nflag region."""
    plain = offline_build(plain_name, 1)
    b = offline_build(once_name, 1)
    assert b.constexprs["NONCE"] == nonce and "NONCE" not in plain.constexprs
    c = b.compile()
    ptx, ptx0 = c.asm["ptx"], plain.compile().asm["ptx"]
    assert ptx.count("fence.acq_rel.gpu") - ptx0.count("fence.acq_rel.gpu") == 2
    r = resources(c)
    assert (r.spill_stores, r.spill_loads, r.stack) == (0, 0, 0), f"{b.label}: spills {r}"
    assert r.regs <= 255 and 0 < r.shared <= SHARED_PER_BLOCK, r
    res = KernelResources(regs_per_thread=r.regs, num_warps=r.num_warps, shared_bytes=r.shared)
    assert check_residency(b.label, GRID, res, DeviceLimits(sm_count=132)) >= 1
