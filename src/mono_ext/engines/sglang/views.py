"""Engine-neutral views (``mono_ext.core.views``) built from SGLang's objects.

A spec sees a deployment only through these: the config (``ServerArgs`` + the model's HF
config), the loaded model (the planes :mod:`.qwen3_next` bound), the caches (the bound
``MambaPool`` states and KV buffers) and each step (the ``ForwardBatch``'s mode and rows).

SGLang settings that change what a step is or where tensors live map onto the core's
``FEATURES``; the SGLang-only ones the kernels cannot serve are returned as extra config
reasons by :func:`engine_reasons`. Attribute reads use defaults so a field that an SGLang
release lacks reads as "off".

Quantized planes (docs/quantized_planes.md, section 3): each matrix plane's format is derived
from its owning module's tensors after ``process_weights_after_loading``, by the same
engine-neutral code as the vLLM adapter's (``core.views.matrix_plane_view``). SGLang keeps
vLLM's attribute names: ``weight_scale_inv`` for ``fp8`` block (fp32 [ceil(N/128),
ceil(K/128)]), ``weight_scale`` for per-channel / per-tensor and compressed-tensors,
``w13_weight_scale_inv`` / ``w13_weight_scale`` for experts (sliced like the bound experts:
``[:E]`` routed, ``[E]`` the fused shared slot); per-channel / per-tensor weights are a (K, N)
``weight.t()`` view of the loaded [N, K] storage, bound as ``weight.t()``. What differs from
vLLM: ``Fp8LinearMethod`` / ``Fp8MoEMethod`` keep the block size on the quant method
(``weight_block_size``), not on the layer (compressed-tensors sets it on the layer); Marlin is
the method's ``use_marlin`` (``SGLANG_FORCE_FP8_MARLIN``, ``--moe-runner-backend marlin``);
SGLang's CPU path VNNI-packs fp8 weights for AMX (``use_intel_amx_backend``, layout
``amx_packed``); MXFP4 experts under ``--moe-runner-backend triton_kernel`` leave the module
(triton_kernels containers on the quant method), and under the default Hopper path arrive
upcast to bf16, which SGLang's Triton fused MoE multiplies as plain bf16 weights: those planes
are tagged ``MXFP4_UPCAST`` (read as bf16 in place) after checking they took that branch
(:func:`_not_upcast`); any other bf16 experts under ``Mxfp4MoEMethod`` keep the method's name
with why, and are refused by it.
A quantized plane bound row-major gets its scale bound next to it as ``<plane>.scale``
(``core.views.scale_key``): SGLang's own scale tensor, sliced like the plane (:func:`model_view`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.views import (
    MATRIX_PLANES,
    SCALE_SUFFIX,
    CacheTensorView,
    CacheView,
    ConfigView,
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
from ...models.qwen3_next.dims import text_config
from ...models.qwen3_next.spec import MXFP4_UPCAST
from .qwen3_next import CacheBinding, ModelBinding

__all__ = [
    "ENGINE",
    "LAYOUTS",
    "KV_LAYOUT",
    "hf_dict",
    "features_of",
    "engine_reasons",
    "config_view",
    "model_view",
    "plane_view",
    "cache_view",
    "step_mode",
    "step_view",
]

ENGINE = "sglang"
#: Layout tags (``launches.LAYOUT_KEYS``) of SGLang's GDN caches (``MambaPool``): conv
#: (slots, C, K-1), ssm (slots, Hv, Dv, Dk).
LAYOUTS = {"conv_layout": "chan_time", "ssm_layout": "vk"}
#: ``MHATokenToKVPool``'s key buffer per layer is (tokens, Hkv, D), its value buffer apart.
KV_LAYOUT = "split_tok_head"


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
        dtype=dtype_name(dtype),
        quantization=quantization,
        reads_plane_formats=True,  # model_view derives every matrix plane's format
        features=features,
        engine=ENGINE,
        engine_version=engine_version,
    )


def _tensor(obj: Any) -> Any:
    return obj if hasattr(obj, "dtype") and hasattr(obj, "shape") else None


def _scale_of(mod: Any, prefix: str) -> tuple[str, Any] | None:
    """The module's weight scale (``{prefix}weight_scale_inv`` or ``{prefix}weight_scale``)."""
    for name in (f"{prefix}weight_scale_inv", f"{prefix}weight_scale"):
        t = _tensor(getattr(mod, name, None))
        if t is not None:
            return name, t
    return None


def _scale_for(source: Any) -> tuple[str, Any] | None:
    """The scale of a bound matrix plane (``LayerBinding.sources`` entry): the owning module's
    ``{prefix}weight_scale_inv`` / ``{prefix}weight_scale``, indexed like the bound plane
    (experts ``[:E]`` routed, ``[E]`` the fused shared slot), so a view of SGLang's tensor."""
    if source is None:
        return None
    mod, attr, index = source
    found = _scale_of(mod, attr[: -len("weight")])  # "" or "w13_" / "w2_"
    if found is None:
        return None
    name, scale = found
    if index is not None and scale.dim() >= 1:
        scale = scale[index]
    return name, scale


def _block(mod: Any) -> Any:
    """The fp8 block size: on the layer (compressed-tensors), else on SGLang's Fp8 method."""
    block = getattr(mod, "weight_block_size", None)
    if block is not None:
        return block
    qm = getattr(mod, "quant_method", None)
    if getattr(qm, "block_quant", False):
        return getattr(qm, "weight_block_size", None)
    return None


def _moe_backend(qm: Any) -> Any:
    runner = getattr(getattr(qm, "runner", None), "runner_backend", None)
    if runner is not None:
        return runner
    try:
        from sglang.srt.layers.moe.utils import get_moe_runner_backend

        return get_moe_runner_backend()
    except Exception:  # no SGLang (unit tests) or flags not set up
        return None


def _engine_kernel(mod: Any, moe: bool) -> str:
    """The SGLang kernel that reads a quantized module's weights (informational)."""
    qm = getattr(mod, "quant_method", None)
    if qm is None:
        return ""
    if getattr(mod, "use_intel_amx_backend", False):
        return "intel_amx"
    if getattr(qm, "use_marlin", False):
        return "marlin"
    scheme = getattr(mod, "scheme", None)  # compressed-tensors keeps its scheme on the layer
    if scheme is not None:
        return type(scheme).__name__
    for attr in ("w8a8_block_fp8_linear", "w8a8_mxfp8_linear"):
        fn = getattr(qm, attr, None)  # Fp8LinearMethod sets one even when not block-quantized
        if fn is not None and getattr(qm, "block_quant", False):
            return str(getattr(fn, "__name__", type(fn).__name__))
    if moe:
        for flag, name in (
            ("use_triton_kernels", "triton_kernels"),
            ("use_flashinfer", "flashinfer_mxfp4"),
        ):
            if getattr(qm, flag, False):
                return name
        backend = _moe_backend(qm)
        return "" if backend is None else f"moe runner {getattr(backend, 'value', backend)}"
    if hasattr(qm, "cutlass_fp8_supported"):
        return "apply_fp8_linear (" + (
            "cutlass)" if qm.cutlass_fp8_supported else "torch._scaled_mm)"
        )
    return ""


def _repacked_layout(mod: Any, kernel: str, moe: bool) -> str | None:
    """A layout SGLang repacked a quantized plane into (None: read it from the strides)."""
    if kernel == "intel_amx":
        return "amx_packed"
    if kernel == "marlin":
        return "marlin"
    if moe:
        backend = _moe_backend(getattr(mod, "quant_method", None))
        if backend is not None and getattr(backend, "value", backend) == "marlin":
            return "marlin"
        if kernel == "flashinfer_mxfp4":
            return "flashinfer_interleaved"
    return None


def _logical(mod: Any, attr: str, index: Any) -> tuple[int, ...] | None:
    """A plane's logical ([E,] N, K) from the sizes SGLang's modules record."""
    if attr in ("w13_weight", "w2_weight"):
        h = getattr(mod, "hidden_size", None)
        i = getattr(mod, "intermediate_size_per_partition", None)
        if h is None or i is None:
            return None
        nk = (2 * i, h) if attr == "w13_weight" else (h, i)
        if isinstance(index, slice):
            return (len(range(*index.indices(index.stop or 0))), *nk)
        return nk
    n = getattr(mod, "output_size_per_partition", None)
    k = getattr(mod, "input_size_per_partition", None)
    return None if n is None or k is None else (int(n), int(k))


#: ``Mxfp4MoEMethod`` flags of the ``process_weights_after_loading`` branches that keep (or
#: repack) the MXFP4 codes; the bf16 upcast is the final ``else``, taken with none of them set.
_MXFP4_CODE_BRANCHES = (
    "use_marlin",
    "use_deep_gemm",
    "_fi_kernel",
    "use_flashinfer",
    "use_triton_kernels",
)


def _not_upcast(mod: Any) -> str | None:
    """Why bf16 experts under SGLang's ``Mxfp4MoEMethod`` are not its upcast branch, to be read
    as plain bf16 (None: they are). That branch (``upcast_from_mxfp`` to bf16, scales deleted,
    w13/w2 re-registered) is taken with no kernel flag set, and ``apply`` then hands the bf16
    weights to the Triton runner without activation quantization (``TritonMoeQuantInfo`` with
    only the weights and the biases, which :func:`plane_view` checks): the unquantized MoE."""
    qm = mod.quant_method
    flags = [f for f in _MXFP4_CODE_BRANCHES if getattr(qm, f, None)]
    if flags or getattr(mod, "use_intel_amx_backend", False):
        return "bf16 experts with " + (", ".join(flags) or "use_intel_amx_backend") + " set"
    for attr in ("w13_weight", "w2_weight"):
        t = _tensor(getattr(mod, attr, None))
        if t is None or dtype_name(t) != "bfloat16":
            return f"{attr} is {'absent' if t is None else dtype_name(t)}, not upcast to bf16"
        if _tensor(getattr(mod, f"{attr}_scale", None)) is not None:
            return f"{attr} still has its MXFP4 scale (the upcast deletes it)"
    backend = getattr(getattr(getattr(qm, "runner", None), "runner_backend", None), "value", None)
    if backend != "triton":  # create_moe_runner builds none for e.g. flashinfer_trtllm
        return (
            f"bf16 experts under MoE runner {backend or 'none'}: only the Triton MoE runner "
            "multiplies the upcast experts as plain bf16"
        )
    return None


def plane_view(name: str, t: Any, quant: str, source: Any = None) -> tuple[PlaneView, Any]:
    """The PlaneView of one bound plane, and the tensor to bind for it (None where the storage
    cannot be bound as a row-major plane). ``source``: (owning module, weight attribute,
    index into it) for matrix planes (:class:`.qwen3_next.LayerBinding.sources`)."""
    if name not in MATRIX_PLANES or source is None:
        return PlaneView(tuple(t.shape), dtype_name(t), quant, t.is_contiguous()), t
    mod, attr, index = source
    moe = attr in ("w13_weight", "w2_weight")
    prefix = attr[: -len("weight")]  # "" or "w13_" / "w2_"
    kernel = _engine_kernel(mod, moe)
    found = _scale_for(source)
    scale = None if found is None else found[1]
    if moe:
        # SGLang's experts keep w13_weight_bias / w2_weight_bias, which its runners add when
        # present; Mxfp4MoEMethod creates zero ones on CUDA even without with_bias (no-ops)
        bias = _tensor(getattr(mod, f"{prefix}weight_bias", None))
        has_bias = bool(getattr(mod, "with_bias", False)) or (
            bias is not None and bias.numel() > 0 and bool(bias.any())
        )
    else:
        bias = _tensor(getattr(mod, "bias", None))
        has_bias = bias is not None and bias.numel() > 0
    layout = None
    if dtype_name(t) not in ("bfloat16", "float16", "float32"):
        layout = _repacked_layout(mod, kernel, moe)
    elif moe and quant == "Mxfp4MoEMethod":
        why = _not_upcast(mod)
        quant = MXFP4_UPCAST if why is None else f"{quant} ({why})"
    return matrix_plane_view(
        t,
        _logical(mod, attr, index),
        quant=quant,
        scale=scale,
        scale_name="" if found is None else found[0],
        block=_block(mod),
        kernel=kernel,
        layout=layout,
        bias=has_bias,
        input_scale=_tensor(getattr(mod, f"{prefix}input_scale", None)) is not None,
    )


def model_view(bound: ModelBinding, *, tp_size: int, tp_rank: int) -> ModelView:
    """The bound model as a ModelView. Matrix planes get their format derived from the owning
    module (:func:`plane_view`); a plane SGLang keeps as a (K, N) ``weight.t()`` view is
    rebound here as the row-major [N, K] it views, and a quantized plane bound row-major gets
    its scale bound as ``<plane>.scale`` (``bound.layers[i].planes``)."""
    layers = []
    for b in bound.layers:
        planes = {}
        for name, t in list(b.planes.items()):
            if name.endswith(SCALE_SUFFIX):
                continue  # bound by an earlier call; not a plane
            source = b.sources.get(name)
            view, row_major = plane_view(name, t, b.quant.get(name, "none"), source)
            planes[name] = view
            if row_major is not None and row_major is not t:
                b.planes[name] = row_major
            found = _scale_for(source) if view.scale is not None else None
            if row_major is not None and found is not None:
                b.planes[scale_key(name)] = found[1]
        for name, container in b.containers.items():
            mod, attr, index = b.sources[name]
            planes[name] = container_plane_view(
                container,
                _logical(mod, attr, index),
                quant=b.quant.get(name, "none"),
                kernel=_engine_kernel(mod, True),
            )
        layers.append(LayerView(b.index, b.kind, planes, dict(b.facts)))
    return ModelView(tuple(layers), tp_size=tp_size, tp_rank=tp_rank)


def _tensor_view(t: Any, layout: str) -> CacheTensorView:
    # A state tensor is "dense" when each slot's memory is one contiguous block at a fixed
    # stride; envelope/page-major pools stride slots through other layers' state.
    return CacheTensorView(
        shape=tuple(t.shape),
        dtype=dtype_name(t.dtype),
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
                tensors["ssm_state"] = _tensor_view(caches.ssm[i], LAYOUTS["ssm_layout"])
        else:
            tensors = {"kv_cache": _tensor_view(caches.kv[i], KV_LAYOUT)} if i in caches.kv else {}
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
    return dtype_name(d.conv), dtype_name(d.temporal)


def build_extra(
    hf_config: Any, server_args: Any, planes: Mapping[int, Mapping[str, Any]]
) -> dict[str, Any]:
    """``BuildContext.extra`` (keys as ``models/qwen3_next/triton/backend.py`` reads them): the GDN state
    dtypes SGLang allocates, the loaded A_log / dt_bias dtypes, int64 positions, and the
    largest position a request can reach (``--context-length``, else the config's
    ``max_position_embeddings``)."""
    extra: dict[str, Any] = {}
    states = gdn_state_dtypes(hf_config)
    if states is not None:
        extra["conv_dtype"], extra["ssm_dtype"] = states
    gdn = next((p for p in planes.values() if "A_log" in p and "dt_bias" in p), None)
    if gdn is not None:
        extra["a_log_dtype"] = dtype_name(gdn["A_log"].dtype)
        extra["dt_bias_dtype"] = dtype_name(gdn["dt_bias"].dtype)
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
            if want is not None and dtype_name(t.dtype) != want:
                reasons.append(f"layer {i}: {name} is {dtype_name(t.dtype)}, the launches were "
                               f"built for {want}")  # fmt: skip
    return reasons
