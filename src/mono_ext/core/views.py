"""Engine-neutral views: what a model spec may know about a deployment.

Each engine adapter builds these from its own objects (vLLM's VllmConfig and
modules, SGLang's ServerArgs and pools). A spec reads nothing else, so one spec
serves both engines and the CLI (which builds a ConfigView from a config.json).

Plane and cache names are the engine-neutral names below, not the engines'
attribute paths; shapes are those *this rank* holds (TP-sharded).

Plane names are the reference's weight keys (mono_ext.models.qwen3_next.reference.convert),
so a bound layer's tensors and its view share one naming:

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

Matrix planes (the projections above, ``MATRIX_PLANES``) also carry a *format*: how their
values are stored (``PLANE_FORMATS``). A plane's ``shape`` is always the logical one, (N, K)
or (E, N, K) as in the table, whatever the storage (mxfp4 packs two codes per byte, so its
storage is [..., N, K/2]); ``dtype`` is the storage dtype. What each engine leaves after
loading, per format and kernel, is in docs/quantized_planes.md.
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
    "ScaleView",
    "FEATURES",
    "PLANE_FORMATS",
    "MATRIX_PLANES",
    "QUANT_METHODS",
    "STEP_MODES",
    "KN_FORMATS",
    "SCALE_SUFFIX",
    "scale_key",
    "dtype_name",
    "plane_format",
    "plane_layout",
    "matrix_plane_view",
    "container_plane_view",
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

#: Weight-plane formats an adapter may report for a matrix plane. "bf16" is what every built
#: kernel reads; the others are recognised (docs/quantized_planes.md) so that a quantized
#: deployment is judged plane by plane, and refused with exact reasons until a backend reads
#: them. Values: (family, description of the readable layout).
PLANE_FORMATS: dict[str, tuple[str, str]] = {
    "bf16": ("bf16", "bf16 (row-major [N, K])"),
    "fp8_block128": (
        "fp8",
        "fp8 block-128 (e4m3fn [N, K] row-major, fp32 scales [ceil(N/128), ceil(K/128)])",
    ),
    "fp8_channel": ("fp8", "fp8 per-channel (e4m3fn [N, K] row-major, fp32 scale per row)"),
    "fp8_tensor": ("fp8", "fp8 per-tensor (e4m3fn [N, K] row-major, one fp32 scale)"),
    "mxfp4": (
        "mxfp4",
        "mxfp4 (e2m1 codes 2 per byte [N, K/2] row-major, e8m0 scale per 32 along K [N, K/32])",
    ),
}

#: The planes that are matrices (a format applies), and the launch that reads each.
MATRIX_PLANES: dict[str, str] = {
    "in_proj_qkvz": "K1",
    "in_proj_ba": "K1",
    "qkv_proj": "K1",
    "out_proj": "K2",
    "o_proj": "K2",
    "router": "K2",
    "w13": "K2",
    "w2": "K2",
    "shared_gate_up": "K2",
    "shared_down": "K2",
    "shared_expert_gate": "K2",
}

#: A bound layer's weights carry a quantized matrix plane's scale tensor (the engine's own, in
#: place) under the plane's name plus this suffix: ``weights["w13.scale"]``. Scale keys are
#: not planes: views and plane checks skip them.
SCALE_SUFFIX = ".scale"


def scale_key(plane: str) -> str:
    """The weights key of ``plane``'s scale tensor (``"out_proj"`` -> ``"out_proj.scale"``)."""
    return plane + SCALE_SUFFIX


#: Engine quantization methods (``ConfigView.quantization``) whose planes an adapter that
#: derives plane formats (``ConfigView.reads_plane_formats``) can judge at the model stage.
#: Any other method is refused at the config stage.
QUANT_METHODS: tuple[str, ...] = ("fp8", "fbgemm_fp8", "compressed-tensors", "mxfp4")

#: Step modes an adapter reports; only "decode" is ever served.
STEP_MODES = ("decode", "prefill", "mixed", "spec_verify", "idle", "other")


@dataclass(frozen=True)
class ConfigView:
    """A deployment before its weights load."""

    hf_config: Mapping[str, Any]  # the text model's config as a plain dict
    tp_size: int = 1
    dtype: str = "bfloat16"  # activation/weight dtype the engine runs
    quantization: str | None = None  # the engine's quant method name, None when unquantized
    # True when the adapter derives each matrix plane's format at the model stage (a quantized
    # deployment of a QUANT_METHODS method is then judged plane by plane there)
    reads_plane_formats: bool = False
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
class ScaleView:
    """The scale tensor of a quantized plane, as the engine keeps it."""

    shape: tuple[int, ...]
    dtype: str
    contiguous: bool = True  # dense row-major
    name: str = ""  # the engine's attribute, e.g. "weight_scale_inv"


@dataclass(frozen=True)
class PlaneView:
    """One weight plane as this rank holds it."""

    shape: tuple[int, ...]  # logical: (N, K) / (E, N, K) for matrix planes, whatever the storage
    dtype: str  # storage dtype ("float8_e4m3fn", "uint8" for packed mxfp4, ...)
    quant: str = "none"  # the engine's quant method for the owning module
    contiguous: bool = True
    # "row_major": the memory is a dense [.., N, K] (or [.., N, K/2]) array a kernel streams
    # row by row (possibly exposed by the engine as a transposed (K, N) view of it);
    # "transposed": the memory is [K, N]; "strided": anything else; "padded": the storage is
    # larger than the logical shape; "marlin" / "triton_kernels": an engine kernel's tiled or
    # swizzled layout; "dropped": the engine freed the plane after converting it elsewhere.
    layout: str = "row_major"
    format: str = "bf16"  # a PLANE_FORMATS key, or another tag the spec refuses
    scale: ScaleView | None = None  # quantized formats: the engine's scale tensor
    block: tuple[int, ...] | None = None  # fp8 block shape (rows, cols) a scale covers
    bias: bool = False  # the owning module adds a bias
    input_scale: bool = False  # a static activation scale (W8A8 with a fixed input scale)
    kernel: str = ""  # the engine kernel that reads the plane (informational)


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
    layout: str  # memory order, e.g. conv "time_chan" (slots, K-1, C); see launches.LAYOUT_KEYS
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


# -- plane formats from an engine's tensors ------------------------------------------------------
# Shared by the engine adapters (vLLM 0.26, SGLang 0.5.17/0.5.23): both leave the same tensors
# after ``process_weights_after_loading`` (docs/quantized_planes.md), so what a plane's format
# and layout are follows from its tensors alone; the adapter says only where they live (the
# weight, its scale, the block size, the logical shape the module records, bias, static input
# scale, the engine kernel). Tensors are read duck-typed (``dtype``, ``shape``,
# ``is_contiguous``, ``t``): the core imports no torch.

_FLOAT_DTYPES = frozenset({"bfloat16", "float16", "float32"})
_FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"})
#: formats whose weights both engines leave as a (K, N) ``weight.t()`` view of the loaded
#: [N, K] storage (their per-channel / per-tensor methods all end with ``weight.t()``); block and
#: MXFP4 methods keep (N, K). This decides square planes.
KN_FORMATS = frozenset({"fp8_channel", "fp8_tensor"})


def dtype_name(t: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (of a tensor or a dtype)."""
    return str(getattr(t, "dtype", t)).removeprefix("torch.")


def _numel(t: Any) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n


def plane_format(dtype: str, *, block: Any, scale: Any, rows: int) -> str:
    """The ``PLANE_FORMATS`` tag of a matrix plane stored as ``dtype`` with weight scale
    ``scale`` (None: none), quantisation block ``block`` ((rows, cols), None: not block
    quantized); ``rows`` = [E *] N."""
    if dtype in _FLOAT_DTYPES:
        return "bf16" if scale is None else "unknown"
    if dtype in _FP8_DTYPES:
        if block is not None:
            return "fp8_block128" if list(block) == [128, 128] else "fp8_block"
        if scale is not None and _numel(scale) == rows and rows > 1:
            return "fp8_channel"
        return "fp8_tensor"
    if dtype == "uint8" and scale is not None:
        return "mxfp4"
    return "unknown"


def plane_layout(t: Any, logical: tuple[int, ...], *, packed: bool, kn: bool) -> tuple[str, Any]:
    """(layout tag, the tensor to bind as row-major [.., N, K]) of a matrix plane's storage
    ``t`` of logical shape ``logical``; ``packed``: two codes per byte along K; ``kn``: the
    engine keeps this format as (K, N) (``KN_FORMATS``), which decides square planes."""
    *lead, n, k = logical
    want = (*lead, n, k // 2 if packed else k)
    kn_shape = (want[-1], n)
    shape = tuple(t.shape)
    if not lead and shape == kn_shape and (kn or kn_shape != want):
        if t.t().is_contiguous():  # a (K, N) view of the row-major [N, K] storage
            return "row_major", t.t()
        if t.is_contiguous():
            return "transposed", t
    if shape == want:
        return ("row_major" if t.is_contiguous() else "strided"), t
    if len(shape) == len(want) and all(a >= b for a, b in zip(shape, want, strict=True)):
        return "padded", t
    return "strided", t


def matrix_plane_view(
    t: Any,
    logical: tuple[int, ...] | None,
    *,
    quant: str = "none",
    scale: Any = None,
    scale_name: str = "",
    block: Any = None,
    kernel: str = "",
    layout: str | None = None,
    bias: bool = False,
    input_scale: bool = False,
) -> tuple[PlaneView, Any]:
    """The PlaneView of a matrix plane from the engine's weight ``t`` and its scale, and the
    tensor to bind for it (row-major [.., N, K]; None when the storage cannot be bound).

    ``logical``: the plane's ([E,] N, K) as the module records it (None: taken from the
    storage; a (K, N) view of a per-channel / per-tensor weight is recognised by its strides);
    ``block``: the fp8 block size the engine quantized with (None: not block-quantized);
    ``layout``: a layout the adapter knows the engine repacked into ("marlin", ...), which
    overrides the one read from the strides; ``input_scale``: a static activation scale.
    """
    dtype = dtype_name(t)
    packed = dtype == "uint8"
    storage = (*t.shape[:-1], t.shape[-1] * (2 if packed else 1))
    rows = 1
    for d in (logical or storage)[:-1]:
        rows *= int(d)
    fmt = plane_format(dtype, block=block, scale=scale, rows=rows)
    if logical is None:
        logical = tuple(storage)
        if fmt in KN_FORMATS and t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
            logical = (int(t.shape[1]), int(t.shape[0]))  # the (K, N) view of [N, K]
    if layout is not None:
        bound = None
    else:
        layout, bound = plane_layout(t, tuple(logical), packed=packed, kn=fmt in KN_FORMATS)
    if layout == "padded":
        logical = tuple(storage)
    view = PlaneView(
        shape=tuple(int(d) for d in logical),
        dtype=dtype,
        quant=quant,
        contiguous=layout == "row_major",
        layout=layout,
        format=fmt,
        scale=(
            None
            if scale is None
            else ScaleView(
                tuple(int(d) for d in scale.shape),
                dtype_name(scale),
                bool(scale.is_contiguous()),
                scale_name,
            )
        ),
        block=tuple(block) if block is not None and fmt.startswith("fp8_block") else None,
        bias=bias,
        input_scale=fmt.startswith("fp8") and input_scale,
        kernel=kernel if fmt != "bf16" else "",
    )
    return view, (bound if layout == "row_major" else None)


def container_plane_view(
    container: Any, logical: tuple[int, ...] | None, *, quant: str, kernel: str = ""
) -> PlaneView:
    """The PlaneView of a plane an engine kernel holds in its own container, not a torch
    tensor (triton_kernels' swizzled MXFP4 tensors): never bound."""
    fmt = "mxfp4" if "mxfp4" in quant.lower() else "unknown"
    return PlaneView(
        tuple(logical or ()),
        type(container).__name__,
        quant,
        False,
        "triton_kernels",
        fmt,
        kernel=kernel,
    )
