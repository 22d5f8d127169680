"""Engine-neutral views: what a model spec may know about a deployment.

Each engine adapter builds these from its own objects (vLLM's VllmConfig and
modules, SGLang's ServerArgs and pools). A spec reads nothing else, so one spec
serves both engines and the CLI (which builds a ConfigView from a config.json).

Plane and cache names are the engine-neutral names below, not the engines'
attribute paths; shapes are those *this rank* holds (TP-sharded).

Plane names are the reference's weight keys (mono_ext.reference.convert), so a
bound layer's tensors and its view share one naming:

GDN layer planes          attention layer planes    MoE planes (every layer)
-----------------------   -----------------------   -------------------------------
input_layernorm (H,)      input_layernorm (H,)      post_attention_layernorm (H,)
in_proj_qkvz (P, H)       qkv_proj (Q, H)           router (E, H)
in_proj_ba   (2Hv, H)     q_norm   (D,)             w13    (E, 2I, H)
conv1d       (C, 1, K)     k_norm   (D,)             w2     (E, H, I)
A_log        (Hv,)        o_proj   (H, Hq*D)        shared_gate_up (2Is, H)
dt_bias      (Hv,)                                  shared_down    (H, Is)
norm         (Dv,)  gated RMSNorm weight            shared_expert_gate (1, H)
out_proj     (H, Hv*Dv)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ConfigView",
    "PlaneView",
    "LayerView",
    "ModelView",
    "CacheTensorView",
    "LayerCacheView",
    "CacheView",
    "StepView",
    "FEATURES",
    "STEP_MODES",
]

#: Engine features that change what a step is or where weights live. An adapter
#: sets the ones that are on; a spec refuses those it cannot serve.
FEATURES: dict[str, str] = {
    "spec_decode": "speculative decoding (draft tokens change the step's rows and states)",
    "lora": "LoRA adapters (extra low-rank terms the kernels do not add)",
    "pipeline_parallel": "pipeline parallelism (layers split over ranks)",
    "data_parallel": "data-parallel attention (rows split over ranks)",
    "expert_parallel": "expert parallelism (experts split over ranks)",
    "kv_connector": "a KV-cache connector (caches moved outside the engine)",
    "piecewise_graphs_only": "piecewise-only CUDA graphs (decode is not captured whole)",
    "sequence_parallel": "sequence parallelism (rows split inside a layer)",
}

#: Step modes an adapter reports; only "decode" is ever served.
STEP_MODES = ("decode", "prefill", "mixed", "spec_verify", "idle", "other")


@dataclass(frozen=True)
class ConfigView:
    """A deployment before its weights load."""

    hf_config: Mapping[str, Any]  # the text model's config as a plain dict
    tp_size: int = 1
    dtype: str = "bfloat16"  # activation/weight dtype the engine runs
    quantization: str | None = None  # the engine's quant method name, None when unquantized
    features: frozenset[str] = frozenset()  # names from FEATURES that are on
    engine: str = "none"  # "vllm", "sglang", or "none" (CLI, tests)
    engine_version: str = ""

    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(self.hf_config.get("architectures") or ())

    def __post_init__(self) -> None:
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(
                f"unknown engine features {sorted(unknown)}; known: {sorted(FEATURES)}"
            )


@dataclass(frozen=True)
class PlaneView:
    """One weight plane as this rank holds it."""

    shape: tuple[int, ...]
    dtype: str
    quant: str = "none"  # the engine's quant method for the owning module
    contiguous: bool = True
    layout: str = "row_major"  # engine layout tag when not a plain (out, in) matrix


@dataclass(frozen=True)
class LayerView:
    index: int
    kind: str  # "linear_attention" or "full_attention"
    planes: Mapping[str, PlaneView]
    # facts that are not planes, e.g. {"qkvz_packing": "interleaved", "fused_shared_expert": False}
    facts: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelView:
    layers: tuple[LayerView, ...]
    tp_size: int = 1
    tp_rank: int = 0


@dataclass(frozen=True)
class CacheTensorView:
    shape: tuple[int, ...]
    dtype: str
    layout: str  # e.g. "vllm" conv (slots, K-1, C) or "sglang" conv (slots, C, K-1)
    contiguous: bool = True


@dataclass(frozen=True)
class LayerCacheView:
    index: int
    kind: str
    tensors: Mapping[str, CacheTensorView]  # "conv_state", "ssm_state" or "kv_cache"


@dataclass(frozen=True)
class CacheView:
    layers: tuple[LayerCacheView, ...]
    num_slots: int  # state slots a request can own (the null/padding slot excluded)


@dataclass(frozen=True)
class StepView:
    """Host-side facts of one forward step (the same at graph capture and replay)."""

    mode: str  # one of STEP_MODES
    rows: int  # rows the step runs (the padded batch under CUDA graphs)
    tokens_per_row: int = 1

    def __post_init__(self) -> None:
        if self.mode not in STEP_MODES:
            raise ValueError(f"unknown step mode {self.mode!r}; known: {STEP_MODES}")
