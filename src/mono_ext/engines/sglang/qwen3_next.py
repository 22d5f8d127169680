"""Bind SGLang's Qwen3-Next / Qwen3.5-MoE tensors in place: weights, GDN states, step slots.

Nothing here copies, converts or computes: every bound tensor is the engine's own parameter
or cache tensor, or a view of one (``data_ptr`` inside its storage). Anything that does not
look as expected becomes a *reason* (a string), never an exception, so that every TP rank
reaches the refusal agreement instead of one rank raising while its peers wait.

Where the planes live (SGLang 0.5.17 and 0.5.23 build the same module tree; ``L`` is
``model.model.layers[i]``, the text model is ``model.model`` for ``Qwen3NextForCausalLM``
and for ``Qwen3_5MoeForConditionalGeneration``):

=========================  =====================================================
plane (``core.views``)     SGLang tensor
=========================  =====================================================
input_layernorm            L.input_layernorm.weight
post_attention_layernorm   L.post_attention_layernorm.weight
in_proj_qkvz, in_proj_ba   L.linear_attn.in_proj_qkvz.weight, .in_proj_ba.weight
                           (Qwen3GatedDeltaNet keeps the checkpoint's interleaved
                           packing; Qwen3_5GatedDeltaNet stacks in_proj_qkv + in_proj_z
                           and in_proj_b + in_proj_a: contiguous)
conv1d                     L.linear_attn.conv1d.weight [C, 1, K]
A_log, dt_bias             L.linear_attn.A_log (fp32), .dt_bias
norm                       L.linear_attn.norm.weight
out_proj                   L.linear_attn.out_proj.weight
qkv_proj, o_proj           L.qkv_proj.weight, L.o_proj.weight (on the layer itself)
q_norm, k_norm             L.q_norm.weight, L.k_norm.weight
router                     L.mlp.gate.weight
w13, w2                    L.mlp.experts.w13_weight[:E], .w2_weight[:E]
shared_gate_up,            L.mlp.shared_expert.gate_up_proj.weight, .down_proj.weight;
shared_down                with SGLang's shared-expert fusion (on by default on CUDA
                           when the shared and routed intermediate sizes are equal;
                           ``mlp.shared_expert is None``) the extra expert slot
                           E: w13_weight[E], w2_weight[E]
shared_expert_gate         L.mlp.shared_expert_gate.weight
=========================  =====================================================

GDN states come from SGLang's ``MambaPool`` through the request pool:
``req_to_token_pool.mamba2_layer_cache(layer_id)`` gives ``conv[0]`` ``[slots + 1, C, K-1]``
(conv layout "chan_time") and ``temporal`` ``[slots + 1, Hv, Dv, Dk]`` (ssm layout "vk").
A step's slot per row is the tensor SGLang's own GDN kernels read,
``linear_attn_backend.forward_metadata.mamba_cache_indices`` (``get_mamba_indices`` of the
step's requests, padded rows set to -1, already translated for unified pools; under CUDA
graphs the runner's static per-batch-size buffer). Rows with slot -1 are padding: the
launches neither read nor write any state for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "QKVZ_PACKING",
    "LayerBinding",
    "ModelBinding",
    "CacheBinding",
    "bind_model",
    "bind_caches",
    "step_slots",
    "text_model_of",
]

#: GDN module class -> how its in_proj_qkvz / in_proj_ba rows are packed after loading.
#: A class not listed gets no packing, which the spec refuses (default-deny).
QKVZ_PACKING: dict[str, str] = {
    "Qwen3GatedDeltaNet": "interleaved",
    "Qwen3_5GatedDeltaNet": "contiguous",
}

_NO_QUANT = "none"


def _quant_name(module: Any) -> str:
    qm = getattr(module, "quant_method", None)
    return _NO_QUANT if qm is None else type(qm).__name__


def _weight(module: Any) -> torch.Tensor:
    return module.weight.detach()


@dataclass
class LayerBinding:
    """One decoder layer's planes, bound in place, and what a view needs to know of them."""

    index: int
    kind: str  # "linear_attention" or "full_attention"
    # plane -> tensor; :func:`.views.model_view` adds each quantized plane's scale as
    # "<plane>.scale" (the BoundLayer weights contract)
    planes: dict[str, torch.Tensor] = field(default_factory=dict)
    quant: dict[str, str] = field(default_factory=dict)  # plane -> owning module's quant method
    facts: dict[str, Any] = field(default_factory=dict)
    module: Any = None  # the decoder layer (for the engine attention and check mode)
    # matrix plane -> (owning module, weight attribute, index into the engine tensor or None):
    # where :func:`.views.model_view` finds the plane's scale, block size and sizes
    sources: dict[str, tuple[Any, str, Any]] = field(default_factory=dict)
    # planes an engine kernel holds outside torch tensors (triton_kernels' swizzled MXFP4
    # experts): plane -> the container; never bound, the view reports them
    containers: dict[str, Any] = field(default_factory=dict)

    def put(
        self,
        name: str,
        tensor: torch.Tensor,
        owner: Any = None,
        attr: str = "weight",
        index: Any = None,
    ) -> None:
        self.planes[name] = tensor
        self.quant[name] = _quant_name(owner) if owner is not None else _NO_QUANT
        if owner is not None:
            self.sources[name] = (owner, attr, index)


@dataclass
class ModelBinding:
    outer: Any  # the model object whose forward is dispatched
    text: Any  # the text model: embed_tokens, layers, norm
    layers: list[LayerBinding]
    reasons: list[str]


def text_model_of(model: Any) -> Any | None:
    """The module holding ``embed_tokens``, ``layers`` and ``norm`` (``model.model`` for both
    served architectures), or None."""
    inner = getattr(model, "model", None)
    if inner is not None and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return inner
    return None


def _kind(layer: Any) -> str | None:
    if hasattr(layer, "linear_attn"):
        return "linear_attention"
    if hasattr(layer, "qkv_proj") and hasattr(layer, "attn"):
        return "full_attention"
    return None


def _bind_gdn(b: LayerBinding, layer: Any, reasons: list[str]) -> None:
    la = layer.linear_attn
    b.facts["qkvz_packing"] = QKVZ_PACKING.get(type(la).__name__)
    if b.facts["qkvz_packing"] is None:
        reasons.append(
            f"layer {b.index}: GDN module {type(la).__name__} has no known in_proj_qkvz packing "
            f"(known: {sorted(QKVZ_PACKING)})"
        )
    for name, owner in (
        ("in_proj_qkvz", la.in_proj_qkvz),
        ("in_proj_ba", la.in_proj_ba),
        ("conv1d", la.conv1d),
        ("out_proj", la.out_proj),
    ):
        b.put(name, _weight(owner), owner)
    b.put("A_log", la.A_log.detach())
    b.put("dt_bias", la.dt_bias.detach())
    b.put("norm", _weight(la.norm), la.norm)
    if getattr(la.conv1d, "bias", None) is not None:
        reasons.append(f"layer {b.index}: conv1d has a bias (the conv update adds none)")


def _bind_attention(b: LayerBinding, layer: Any, reasons: list[str]) -> None:
    for name in ("qkv_proj", "o_proj", "q_norm", "k_norm"):
        owner = getattr(layer, name)
        b.put(name, _weight(owner), owner)
    if getattr(layer.qkv_proj, "bias", None) is not None:
        reasons.append(f"layer {b.index}: qkv_proj has a bias (the attention front adds none)")
    if not getattr(layer, "attn_output_gate", True):
        reasons.append(f"layer {b.index}: attention without output gate (K2 always applies it)")


def _bind_moe(b: LayerBinding, layer: Any, num_experts: int, reasons: list[str]) -> None:
    mlp = layer.mlp
    for name in ("gate", "experts", "shared_expert_gate"):
        if getattr(mlp, name, None) is None:
            reasons.append(f"layer {b.index}: MLP {type(mlp).__name__} has no {name} (not MoE)")
            return
    experts = mlp.experts
    b.put("router", _weight(mlp.gate), mlp.gate)
    qm = getattr(experts, "quant_method", None)
    if getattr(experts, "w13_weight", None) is None and hasattr(qm, "w13_weight_triton_tensor"):
        # Mxfp4MoEMethod with --moe-runner-backend triton_kernel: the experts were swizzled
        # into triton_kernels tensors and the module's w13_weight / w2_weight deleted
        b.containers["w13"] = qm.w13_weight_triton_tensor
        b.containers["w2"] = getattr(qm, "w2_weight_triton_tensor", None)
        b.quant["w13"] = b.quant["w2"] = _quant_name(experts)
        b.sources["w13"] = (experts, "w13_weight", slice(0, num_experts))
        b.sources["w2"] = (experts, "w2_weight", slice(0, num_experts))
        b.put("shared_expert_gate", _weight(mlp.shared_expert_gate), mlp.shared_expert_gate)
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:
            b.put("shared_gate_up", _weight(shared.gate_up_proj), shared.gate_up_proj)
            b.put("shared_down", _weight(shared.down_proj), shared.down_proj)
            b.facts["shared_expert"] = "module"
        return
    w13, w2 = experts.w13_weight.detach(), experts.w2_weight.detach()
    fused = int(getattr(mlp, "num_fused_shared_experts", 0) or 0)
    slots = w13.shape[0]
    if slots < num_experts or w2.shape[0] != slots:
        reasons.append(
            f"layer {b.index}: experts hold {slots} of {num_experts} routed experts "
            "(expert parallelism)"
        )
        return
    routed = slice(0, num_experts)
    b.put("w13", w13[routed], experts, "w13_weight", routed)
    b.put("w2", w2[routed], experts, "w2_weight", routed)
    b.put("shared_expert_gate", _weight(mlp.shared_expert_gate), mlp.shared_expert_gate)
    shared = getattr(mlp, "shared_expert", None)
    if fused == 0:
        if slots != num_experts:
            reasons.append(
                f"layer {b.index}: experts hold {slots} slots for {num_experts} routed experts "
                "(redundant experts)"
            )
        if shared is None:
            reasons.append(f"layer {b.index}: no shared expert (K2 always adds it)")
            return
        b.put("shared_gate_up", _weight(shared.gate_up_proj), shared.gate_up_proj)
        b.put("shared_down", _weight(shared.down_proj), shared.down_proj)
        b.facts["shared_expert"] = "module"
    elif fused == 1 and shared is None and slots == num_experts + 1:
        # SGLang's fused shared expert: the extra slot E of the routed experts, loaded from
        # mlp.shared_expert.* by the model's load_weights; read in place like any expert.
        b.put("shared_gate_up", w13[num_experts], experts, "w13_weight", num_experts)
        b.put("shared_down", w2[num_experts], experts, "w2_weight", num_experts)
        b.facts["shared_expert"] = "fused_slot"
    else:
        # Any other fused layout: the spec refuses it, naming the flag that turns fusion off.
        b.facts["fused_shared_expert"] = True


def bind_model(model: Any, *, num_experts: int) -> ModelBinding:
    """Bind every decoder layer of a loaded SGLang model in place; reasons for what cannot be."""
    reasons: list[str] = []
    text = text_model_of(model)
    if text is None:
        return ModelBinding(model, None, [], [f"{type(model).__name__} has no text model"])
    layers: list[LayerBinding] = []
    for i, layer in enumerate(text.layers):
        kind = _kind(layer)
        if kind is None:
            reasons.append(
                f"layer {i}: {type(layer).__name__} is neither a GDN nor an attention layer"
            )
            continue
        b = LayerBinding(index=i, kind=kind, module=layer)
        try:
            b.put("input_layernorm", _weight(layer.input_layernorm))
            b.put("post_attention_layernorm", _weight(layer.post_attention_layernorm))
            if kind == "linear_attention":
                _bind_gdn(b, layer, reasons)
            else:
                _bind_attention(b, layer, reasons)
            _bind_moe(b, layer, num_experts, reasons)
        except AttributeError as exc:
            reasons.append(
                f"layer {i}: {type(layer).__name__} lacks a module the kernels read: {exc}"
            )
        layers.append(b)
    return ModelBinding(model, text, layers, reasons)


@dataclass
class CacheBinding:
    """GDN states per layer (whole tensors, every slot) and the attention layers' key buffers
    (only for the cache view: the engine's attention writes them)."""

    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    kv: dict[int, torch.Tensor]
    num_slots: int
    reasons: list[str]
    identity: tuple = ()  # (data_ptr, shape, dtype) of every GDN state, to notice a reallocation

    def same_as(self, other: CacheBinding) -> bool:
        return self.identity == other.identity


def _ident(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), str(t.dtype))


def bind_caches(
    req_to_token_pool: Any, token_to_kv_pool: Any, kinds: Mapping[int, str]
) -> CacheBinding:
    """GDN states from ``MambaPool`` (via ``mamba2_layer_cache``) and key buffers per layer."""
    conv: dict[int, torch.Tensor] = {}
    ssm: dict[int, torch.Tensor] = {}
    kv: dict[int, torch.Tensor] = {}
    reasons: list[str] = []
    pool = getattr(req_to_token_pool, "mamba_pool", None)
    if pool is None or not hasattr(req_to_token_pool, "mamba2_layer_cache"):
        reasons.append(
            f"request pool {type(req_to_token_pool).__name__} holds no MambaPool (GDN states)"
        )
        return CacheBinding(conv, ssm, kv, 0, reasons)
    for i, kind in sorted(kinds.items()):
        try:
            if kind == "linear_attention":
                state = req_to_token_pool.mamba2_layer_cache(i)
                if len(state.conv) != 1:
                    reasons.append(f"layer {i}: {len(state.conv)} conv state tensors, expected 1")
                    continue
                conv[i], ssm[i] = state.conv[0], state.temporal
            else:
                kv[i] = token_to_kv_pool.get_key_buffer(i)
        except Exception as exc:  # a layer missing from a pool: say which, on every rank
            reasons.append(f"layer {i}: cache not found: {type(exc).__name__}: {exc}")
    # Only the GDN states matter for a reallocation check: the launches write them; the KV
    # buffers belong to the engine's attention (SGLang may resize its KV pool after capture).
    ident = tuple(_ident(t) for d in (conv, ssm) for _, t in sorted(d.items()))
    return CacheBinding(conv, ssm, kv, int(getattr(pool, "size", 0)), reasons, ident)


def step_slots(
    forward_batch: Any,
    rows: int,
    *,
    attn_backend: Any,
    req_to_token_pool: Any = None,
    capturing: bool = False,
) -> torch.Tensor:
    """The GDN state slot of each of the step's ``rows`` rows; padded rows are -1.

    Prefers the slots SGLang's own GDN kernels read this step (``mamba_cache_indices`` of
    the linear-attention backend's metadata). Without them (an eager step before the backend
    built metadata) it asks the pool, ``get_mamba_indices(req_pool_indices)``, and sets rows
    past the real batch to -1 itself; under graph capture that would freeze one step's padding
    into the graph, so it refuses instead.
    """
    linear = getattr(attn_backend, "linear_attn_backend", None)
    meta = getattr(linear, "forward_metadata", None)
    slots = getattr(meta, "mamba_cache_indices", None)
    if slots is not None and slots.shape[0] >= rows:
        return slots[:rows]
    if capturing:
        raise RuntimeError(
            "mono_ext: the linear-attention backend has no mamba_cache_indices for this "
            "captured decode step; the GDN state slots of padded rows would be unknown"
        )
    pool = (
        req_to_token_pool
        if req_to_token_pool is not None
        else getattr(attn_backend, "req_to_token_pool", None)
    )
    if pool is None or not hasattr(pool, "get_mamba_indices"):
        raise RuntimeError("mono_ext: no request pool to read the step's GDN state slots from")
    slots = pool.get_mamba_indices(forward_batch.req_pool_indices[:rows]).clone()
    real = getattr(forward_batch, "_original_batch_size", None)
    if real is not None and real < rows:
        slots[real:] = -1
    return slots
