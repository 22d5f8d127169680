"""Engine-neutral views (``mono_ext.core.views``) built from SGLang's objects.

A spec sees a deployment only through these: the config (``ServerArgs`` + the model's HF
config), the loaded model (the planes :mod:`.binding` bound), the caches (the bound
``MambaPool`` states and KV buffers) and each step (the ``ForwardBatch``'s mode and rows).

SGLang settings that change what a step is or where tensors live map onto the core's
``FEATURES``; the SGLang-only ones the kernels cannot serve are returned as extra config
reasons by :func:`engine_reasons`. Attribute reads use defaults so a field that an SGLang
release lacks reads as "off".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.views import (
    CacheTensorView,
    CacheView,
    ConfigView,
    LayerCacheView,
    LayerView,
    ModelView,
    PlaneView,
    StepView,
)
from ...models.qwen3_next.dims import text_config
from .binding import CacheBinding, ModelBinding

__all__ = [
    "ENGINE",
    "LAYOUTS",
    "hf_dict",
    "features_of",
    "engine_reasons",
    "config_view",
    "model_view",
    "cache_view",
    "step_mode",
    "step_view",
]

ENGINE = "sglang"
#: Layout tags of SGLang's GDN caches (``MambaPool``): conv (slots, C, K-1), ssm (slots, Hv, Dv, Dk).
LAYOUTS = {"conv_layout": "sglang", "ssm_layout": "vk"}


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default)


def hf_dict(hf_config: Any) -> dict[str, Any]:
    """The text model's config as a plain dict (outer architectures kept), from an HF config
    object or a dict."""
    raw = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    return text_config(raw)


def features_of(sa: Any) -> frozenset[str]:
    """The core FEATURES that are on in SGLang ``ServerArgs`` (or a resolved view of them)."""
    on: set[str] = set()
    if _get(sa, "speculative_algorithm") is not None:
        on.add("spec_decode")
    if _get(sa, "enable_lora") or _get(sa, "lora_paths"):
        on.add("lora")
    if (_get(sa, "pp_size", 1) or 1) > 1:
        on.add("pipeline_parallel")
    if (
        _get(sa, "enable_dp_attention")
        or (_get(sa, "dp_size", 1) or 1) > 1
        or (_get(sa, "attn_dp_size", 1) or 1) > 1
    ):
        on.add("data_parallel")
    if (_get(sa, "ep_size", 1) or 1) > 1 or _get(sa, "enable_eplb"):
        on.add("expert_parallel")
    if (_get(sa, "disaggregation_mode", "null") or "null") != "null" or any(
        _get(sa, f)
        for f in (
            "enable_hierarchical_cache",
            "enable_lmcache",
            "enable_flexkv",
            "disaggregation_decode_enable_offload_kvcache",
        )
    ):
        on.add("kv_connector")
    backend = _decode_graph_backend(sa)
    if backend not in (None, "full", "disabled"):
        on.add("piecewise_graphs_only")
    if (
        (_get(sa, "attn_cp_size", 1) or 1) > 1
        or (_get(sa, "dcp_size", 1) or 1) > 1
        or _get(sa, "enable_prefill_cp")
    ):
        on.add("sequence_parallel")
    return frozenset(on)


def _decode_graph_backend(sa: Any) -> str | None:
    cfg = _get(sa, "cuda_graph_config")
    decode = _get(cfg, "decode")
    backend = _get(decode, "backend")
    if backend is None and _get(sa, "disable_cuda_graph"):
        return "disabled"
    return None if backend is None else str(backend)


def decode_graphs_on(sa: Any) -> bool:
    return _decode_graph_backend(sa) not in (None, "disabled") and not _get(
        sa, "disable_cuda_graph"
    )


#: SGLang-only settings (beyond the core FEATURES) and why the fused path cannot serve them.
_ENGINE_SWITCHES: tuple[tuple[str, str], ...] = (
    (
        "enable_torch_compile",
        "--enable-torch-compile would trace the dispatching forward (decode must run eagerly "
        "or under a whole-model CUDA graph)",
    ),
    ("enable_two_batch_overlap", "--enable-two-batch-overlap splits a step's rows in two"),
    ("enable_single_batch_overlap", "--enable-single-batch-overlap interleaves a step's layers"),
    (
        "enable_memory_saver",
        "--enable-memory-saver releases and re-maps weights and caches the kernels hold",
    ),
    (
        "enable_weights_cpu_backup",
        "--enable-weights-cpu-backup moves weights the kernels read in place",
    ),
    (
        "enable_return_routed_experts",
        "--enable-return-routed-experts needs the router's choices, which K2 keeps on device",
    ),
    (
        "enable_deterministic_inference",
        "--enable-deterministic-inference needs bitwise-stable numerics; the fused path is "
        "within NUMERICS tolerances, not bitwise",
    ),
    (
        "enable_linear_replayssm",
        "--enable-linear-replayssm keeps recent GDN updates in ring buffers, so the recurrent "
        "state the kernels read would be stale",
    ),
    (
        "enable_linear_replayssm_spec",
        "--enable-linear-replayssm-spec keeps GDN updates in ring buffers",
    ),
    ("enable_hisparse", "hierarchical sparse attention changes the decode attention"),
    ("enable_pdmux", "--enable-pdmux splits the GPU between prefill and decode"),
)


def engine_reasons(sa: Any, *, check_mode: bool = False) -> list[str]:
    """Every SGLang setting (not covered by the core FEATURES) the fused path cannot serve."""
    reasons = [why for field_name, why in _ENGINE_SWITCHES if _get(sa, field_name)]
    if (_get(sa, "nnodes", 1) or 1) > 1:
        reasons.append(
            "multi-node tensor parallelism: the in-kernel all-reduce reaches peers through "
            "CUDA IPC inside one node"
        )
    if (_get(sa, "cpu_offload_gb", 0) or 0) > 0 or (_get(sa, "offload_group_size", 0) or 0) > 0:
        reasons.append("CPU offload moves weights the kernels read in place")
    if (_get(sa, "expert_distribution_recorder_mode") or None) is not None or _get(
        sa, "enable_expert_distribution_metrics"
    ):
        reasons.append(
            "the expert distribution recorder counts routed experts per layer in SGLang's MoE "
            "code, which routed decode steps do not run"
        )
    if _get(sa, "mamba_envelope_layout"):
        reasons.append(
            "the envelope mamba layout strides GDN states across slots (kernels read dense slots)"
        )
    if check_mode and decode_graphs_on(sa):
        reasons.append(
            "MONO_EXT_CHECK=1 compares on the host, which CUDA graphs cannot replay: "
            "add --disable-cuda-graph (or --cuda-graph-backend-decode disabled)"
        )
    return reasons


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def config_view(
    hf_config: Any,
    *,
    tp_size: int,
    dtype: Any,
    quantization: str | None,
    features: frozenset[str],
    engine_version: str = "",
) -> ConfigView:
    """The deployment before its weights load."""
    return ConfigView(
        hf_config=hf_dict(hf_config),
        tp_size=int(tp_size),
        dtype=_dtype_name(dtype),
        quantization=quantization,
        features=features,
        engine=ENGINE,
        engine_version=engine_version,
    )


def model_view(bound: ModelBinding, *, tp_size: int, tp_rank: int) -> ModelView:
    layers = []
    for b in bound.layers:
        planes = {
            name: PlaneView(
                shape=tuple(t.shape),
                dtype=_dtype_name(t.dtype),
                quant=b.quant.get(name, "none"),
                contiguous=t.is_contiguous(),
            )
            for name, t in b.planes.items()
        }
        layers.append(LayerView(b.index, b.kind, planes, dict(b.facts)))
    return ModelView(tuple(layers), tp_size=tp_size, tp_rank=tp_rank)


def _tensor_view(t: Any, layout: str) -> CacheTensorView:
    # A state tensor is "dense" when each slot's memory is one contiguous block at a fixed
    # stride; envelope/page-major pools stride slots through other layers' state.
    return CacheTensorView(
        shape=tuple(t.shape),
        dtype=_dtype_name(t.dtype),
        layout=layout,
        contiguous=t.is_contiguous(),
    )


def cache_view(caches: CacheBinding, kinds: Mapping[int, str]) -> CacheView:
    layers = []
    for i, kind in sorted(kinds.items()):
        if kind == "linear_attention":
            tensors = {}
            if i in caches.conv:
                tensors["conv_state"] = _tensor_view(caches.conv[i], LAYOUTS["conv_layout"])
            if i in caches.ssm:
                tensors["ssm_state"] = _tensor_view(caches.ssm[i], ENGINE)
        else:
            tensors = {"kv_cache": _tensor_view(caches.kv[i], ENGINE)} if i in caches.kv else {}
        layers.append(LayerCacheView(i, kind, tensors))
    return CacheView(tuple(layers), num_slots=caches.num_slots)


def step_mode(forward_mode: Any) -> str:
    """SGLang's ForwardMode as a core step mode (only "decode" is ever served)."""
    if forward_mode.is_decode():
        return "decode"
    if forward_mode.is_target_verify():
        return "spec_verify"
    if forward_mode.is_idle():
        return "idle"
    if forward_mode.is_mixed():
        return "mixed"
    if forward_mode.is_extend():
        return "prefill"
    return "other"


def step_view(forward_batch: Any) -> StepView:
    """Host facts of a step: its mode and rows (the padded batch under CUDA graphs)."""
    rows = int(forward_batch.batch_size)
    ids = getattr(forward_batch, "input_ids", None)
    tokens = int(ids.shape[0]) // rows if rows > 0 and ids is not None else 0
    if rows > 0 and ids is not None and int(ids.shape[0]) % rows:
        tokens = 0  # ragged rows: never a pure decode step
    return StepView(mode=step_mode(forward_batch.forward_mode), rows=rows, tokens_per_row=tokens)


def gdn_state_dtypes(hf_config: Any) -> tuple[str, str] | None:
    """(conv, ssm) dtypes SGLang's MambaPool will allocate for this model, before it exists:
    SGLang's own ``mamba2_state_dtype`` (``SGLANG_MAMBA_CONV_DTYPE``; ssm from
    ``SGLANG_MAMBA_SSM_DTYPE``, else the config's ``mamba_ssm_dtype``, else fp32)."""
    try:
        from sglang.srt.configs.mamba_utils import mamba2_state_dtype
    except ImportError:
        return None
    d = mamba2_state_dtype(hf_config)
    return _dtype_name(d.conv), _dtype_name(d.temporal)


def build_extra(
    hf_config: Any, server_args: Any, planes: Mapping[int, Mapping[str, Any]]
) -> dict[str, Any]:
    """``BuildContext.extra`` (keys as ``kernels/triton/backend.py`` reads them): the GDN state
    dtypes SGLang allocates, the loaded A_log / dt_bias dtypes, int64 positions, and the
    largest position a request can reach (``--context-length``, else the config's
    ``max_position_embeddings``)."""
    extra: dict[str, Any] = {}
    states = gdn_state_dtypes(hf_config)
    if states is not None:
        extra["conv_dtype"], extra["ssm_dtype"] = states
    gdn = next((p for p in planes.values() if "A_log" in p and "dt_bias" in p), None)
    if gdn is not None:
        extra["a_log_dtype"] = _dtype_name(gdn["A_log"].dtype)
        extra["dt_bias_dtype"] = _dtype_name(gdn["dt_bias"].dtype)
    extra["positions_dtype"] = "int64"
    limit = _get(server_args, "context_length") or hf_dict(hf_config).get("max_position_embeddings")
    if limit:
        extra["max_positions"] = int(limit)
    return extra


def state_dtype_reasons(caches: CacheBinding, extra: Mapping[str, Any]) -> list[str]:
    """The bound GDN states must have the dtypes the launches were built for."""
    reasons = []
    for name, key, states in (("conv_state", "conv_dtype", caches.conv), ("ssm_state",
                              "ssm_dtype", caches.ssm)):  # fmt: skip
        want = extra.get(key)
        for i, t in sorted(states.items()):
            if want is not None and _dtype_name(t.dtype) != want:
                reasons.append(f"layer {i}: {name} is {_dtype_name(t.dtype)}, the launches were "
                               f"built for {want}")  # fmt: skip
    return reasons
