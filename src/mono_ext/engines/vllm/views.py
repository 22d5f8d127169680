"""Views of a vLLM 0.26 deployment's configuration, whatever the model family.

What the adapter reads from ``VllmConfig`` before any module exists: the text model's HF
config, the deployment's features (``core.views.FEATURES``), its ``ConfigView``, and the
refusals only the adapter can see. The Qwen3-Next family's plane map, binding, caches and step
facts are in :mod:`.qwen3_next`. Nothing here computes.
"""

from __future__ import annotations

from typing import Any

from ...core.backends import KernelBackend
from ...core.views import ConfigView, dtype_name
from ...models.qwen3_next.dims import text_config as _text_config

__all__ = ["config_reasons", "config_view", "features", "on_cpu", "text_config"]


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# -- config ----------------------------------------------------------------------------
def text_config(vllm_config: Any) -> dict[str, Any]:
    """The text model's HF config as a plain dict, with the served architectures."""
    mc = vllm_config.model_config
    cfg = _text_config(mc.hf_text_config.to_dict())
    cfg["architectures"] = list(mc.architectures)
    return cfg


def features(vllm_config: Any) -> frozenset[str]:
    """The ``core.views.FEATURES`` that are on in this deployment."""
    pc, cc = vllm_config.parallel_config, vllm_config.compilation_config
    on = set()
    if vllm_config.speculative_config is not None:
        on.add("spec_decode")
    if vllm_config.lora_config is not None:
        on.add("lora")
    if pc.pipeline_parallel_size > 1:
        on.add("pipeline_parallel")
    if pc.data_parallel_size > 1:
        on.add("data_parallel")
    if pc.enable_expert_parallel:
        on.add("expert_parallel")
    if vllm_config.kv_transfer_config is not None:
        on.add("kv_connector")
    if pc.use_sequence_parallel_moe or bool(getattr(cc.pass_config, "enable_sp", False)):
        on.add("sequence_parallel")
    if _has_cuda_graphs() and cc.cudagraph_mode.decode_mode().name == "PIECEWISE":
        on.add("piecewise_graphs_only")
    return frozenset(on)


def _has_cuda_graphs() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def config_view(vllm_config: Any) -> ConfigView:
    mc = vllm_config.model_config
    from vllm import __version__

    return ConfigView(
        hf_config=text_config(vllm_config),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        dtype=dtype_name(mc.dtype),
        quantization=mc.quantization,
        reads_plane_formats=True,  # bind_weights derives every matrix plane's format
        features=features(vllm_config),
        engine="vllm",
        engine_version=str(__version__),
    )


def config_reasons(vllm_config: Any, backend: KernelBackend, check: bool) -> list[str]:
    """Refusals of this deployment that only the adapter can see (not spec features)."""
    pc, cc, mc = (
        vllm_config.parallel_config,
        vllm_config.compilation_config,
        vllm_config.model_config,
    )
    reasons = []
    graphs = _has_cuda_graphs() and not mc.enforce_eager and cc.cudagraph_mode.name != "NONE"
    if check and graphs:
        reasons.append(
            "MONO_EXT_CHECK=1 runs eager only: a captured graph would replay the launches "
            "without the comparisons (add --enforce-eager)"
        )
    if _has_cuda_graphs() and not graphs and not check and not backend.testing_only:
        reasons.append(
            f"no decode CUDA graphs (--enforce-eager or cudagraph_mode NONE): the {backend.name} "
            "launches need a captured step (set MONO_EXT_CHECK=1 to run them eagerly)"
        )
    if graphs and getattr(vllm_config, "use_v2_model_runner", False):
        reasons.append(
            "vLLM's V2 GPU model runner (VLLM_USE_V2_MODEL_RUNNER=1): mono_ext checks FailStop "
            "after FULL-graph replays the way the V1 runner captures and calls compute_logits; "
            "a replay under V2 could return the tokens of a failed step"
        )
    if pc.use_ubatching:
        reasons.append("dual-batch overlap / micro-batching splits a step's rows over launches")
    if pc.enable_eplb:
        reasons.append("expert-parallel load balancing moves experts between steps")
    if getattr(mc.hf_text_config, "layer_scale", False):
        reasons.append("layer_scale=true: the launches apply no per-layer output scales")
    return reasons
