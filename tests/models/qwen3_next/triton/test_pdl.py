"""K1 and K2 with programmatic dependent launch, compiled for sm_90a on the CPU.

``pdl=True`` must put the grid-dependency wait and the early launch of the next kernel into
each persistent kernel, mark the build for a PDL launch, and cost no registers, spills or
shared memory; the default build must have neither (its code is pinned by tools/ptx_digest.py).
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import os  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("offline compiles, not the interpreter", allow_module_level=True)

from mono_ext.kernels.triton.limits import pdl_options  # noqa: E402
from mono_ext.kernels.triton.offline import resources  # noqa: E402
from mono_ext.models.qwen3_next.triton.offline import DEFAULT_BUILDS, offline_build  # noqa: E402


@pytest.mark.parametrize("name", DEFAULT_BUILDS)
def test_pdl_build_waits_for_its_predecessor_and_launches_the_next(name):
    plain = offline_build(name, 1)
    try:
        base = plain.compile()
    except Exception as e:  # no ptxas / no NVIDIA backend in this Triton
        pytest.skip(f"Triton cannot compile for sm_90a here: {e!r}")
    pdl = dataclasses.replace(plain, constexprs={**plain.constexprs, **pdl_options(True)}).compile()
    ptx, base_ptx = pdl.asm["ptx"], base.asm["ptx"]
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert "griddepcontrol" not in base_ptx
    assert pdl.metadata.launch_pdl and not base.metadata.launch_pdl
    r, r0 = resources(pdl), resources(base)
    assert (r.stack, r.spill_stores, r.spill_loads) == (0, 0, 0)
    assert r.shared == r0.shared and r.regs <= max(r0.regs, 255)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pdl_chain_in_a_graph_equals_eager_launches():
    """Four K2 launches, each reading the residual the one before wrote, captured with PDL:
    the wait at each kernel's start must hold it until its predecessor is done, so the graph's
    outputs equal plain eager launches bit for bit."""
    from mono_ext.models.qwen3_next.configs import get_preset
    from mono_ext.models.qwen3_next.dims import Dims, text_config
    from mono_ext.models.qwen3_next.triton.k2 import K2Config, K2Launch, K2Shape
    from mono_ext.runtime.health import decode_health
    from mono_ext.runtime.peers import RankState
    from tests.models.qwen3_next.triton.tail_weights import random_tail_weights

    dims = Dims.from_config(text_config(get_preset("qwen3-next-tiny")), tp=1)
    shape = K2Shape.from_dims(dims)
    gen = torch.Generator(device="cuda").manual_seed(3)
    h, k_in = dims.hidden, dims.hv * dims.dv
    w = random_tail_weights(dims, gen)

    def r(*shp, scale):
        return (torch.randn(*shp, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    b, n = 4, 4
    o_in = r(b, k_in, scale=1.0)
    res0 = r(b, h, scale=1.0)

    def chain(pdl: bool):
        k2 = K2Launch(shape, K2Config(grid=8, pdl=pdl))
        k2.build("cuda")
        ws, st = k2.workspace("cuda"), RankState.create(0, torch.device("cuda"), 2.0)
        hid = [torch.full((b, h), float("nan"), dtype=torch.bfloat16, device="cuda")
               for _ in range(n)]  # fmt: skip
        res = [res0] + [torch.full_like(res0, float("nan")) for _ in range(n)]

        def step():
            st.bump_epoch()
            for j in range(n):
                k2.launch(o_in, res[j], w, hid[j], res[j + 1], ws=ws, ctrl=st.ctrl,
                          health=st.health, layer=j, layers_per_step=n)  # fmt: skip

        return step, hid, res, st, k2

    step, hid_e, res_e, st_e, _ = chain(False)
    step()
    torch.cuda.synchronize()
    step_p, hid_p, res_p, st_p, k2p = chain(True)
    step_p()  # eager first: module loads outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_p()
    for t in (*hid_p, *res_p[1:]):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for st in (st_e, st_p):
        health = decode_health(st.health.cpu().tolist(), rank=0)
        assert health.ok, health.describe(k2p.layout.describe)
    for a, c in zip((*hid_e, *res_e[1:]), (*hid_p, *res_p[1:]), strict=True):
        assert torch.isfinite(c).all() and torch.equal(a, c)
