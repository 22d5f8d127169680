"""The ``triton`` backend's :class:`~mono_ext.models.qwen3_next.launches.LaunchBuilder`: K1
(``k1.py``) and K2 (``k2.py``) behind the launch interface, with the runtime state they share.

What one deployment on one device gets (a :class:`TritonRuntime`, made by the first key):

| object              | what                                               | when               |
|---------------------|----------------------------------------------------|--------------------|
| K1 GDN / attention  | compiled, loaded, residency-checked; rope table    | first key's build  |
| K2 GDN / attention  | same; the attention build is ``gated``: its S1     | first key's build  |
|                     | load forms bf16(attn * sigmoid(gate)) (no extra    |                    |
|                     | launch, no buffer)                                 |                    |
| workspaces          | one per launch kind (mailbox scratch, per-CTA rows)| first key's build  |
| RankState           | ctrl (epoch, deadline, rank) and health words      | first key's build  |
| FailStop            | pinned health copies, polled after every step      | first key's build  |
| BuildCache          | every BuildKey (one per served width) of the       | each key; sealed   |
|                     | deployment                                         | by the first step  |

Every width shares the runtime: the kernels take the row count as a run-time argument (never
specialised), so a width needs nothing compiled of its own, and since one step runs at a time
and every mailbox tag is (step epoch, layer), the widths can share workspaces and the epoch.
Per step the driver calls ``begin_step``, the launches and ``end_step``, and the engine
``release(number)`` where it awaits that step's tokens: the hooks of
:mod:`mono_ext.runtime.persistent`, which the FlyDSL backend shares. A FailStop that saw a wait
give up raises :class:`~mono_ext.runtime.failstop.FailStopError`; after that every step raises
(no fallback).

``BuildContext.extra`` (all optional): ``ssm_dtype`` ("float32"/"bfloat16"; default the
config's ``mamba_ssm_dtype``, else the activation dtype), ``a_log_dtype`` ("float32"),
``dt_bias_dtype`` (the activation dtype), ``positions_dtype`` ("int64"), ``max_positions``
(RoPE table rows; default ``max_position_embeddings``), ``deadline_s`` (default
``MONO_EXT_DEADLINE_S``), ``k1_config`` / ``k2_config`` (tiles and grid), ``validate``
(check every tensor of every launch, default False: each layer's launches are planned at its
first launch, every tensor checked and the argument table frozen
(``kernels.triton.launcher``), and a later launch checks only that its activations fit the
plan: rows, dtype, trailing shape, contiguity, 16-byte alignment).

Triton and torch are imported when a runtime is built, so :meth:`TritonBuilder.refusals` works
(and names the missing piece) on a box without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mono_ext.core.spec import BuildContext, BuildKey
from mono_ext.core.views import ConfigView
from mono_ext.kernels.triton.limits import BLOCK_B, READ_FORMATS
from mono_ext.models.qwen3_next.launches import (
    STATE_DTYPES,
    BoundLayer,
    layout_reasons,
    resolved_layouts,
    state_dtype,
)
from mono_ext.models.qwen3_next.shapes import kernel_shape_reasons
from mono_ext.models.qwen3_next.triton.measured import measured_faster
from mono_ext.runtime.persistent import (
    PersistentLaunches,
    PersistentRuntime,
    runtime_key,
    wait_namer,
)

__all__ = ["TritonBuilder", "TritonLaunches", "TritonRuntime", "build", "device_sources"]

MAX_WIDTH = BLOCK_B  # K1 and K2 are built for up to BLOCK_B rows

# The files a build's code depends on: the jitted device code and the host modules that choose
# its constexprs. A build key's digest hashes them all, so any edit to them changes the digest.
_MODEL_SOURCES = (
    "k1.py",
    "k1_plan.py",
    "k1_kernel.py",
    "k1_norm.py",
    "k1_recurrence.py",
    "k1_units.py",
    "k1_words.py",
    "k1_stream.py",
    "k1_stream_kernel.py",
    "k2.py",
    "k2_config.py",
    "k2_kernel.py",
    "k2_stages.py",
    "k2_experts.py",
    "k2_sync.py",
    "k2_topk.py",
)
_GENERIC_SOURCES = (
    "allreduce.py",
    "limits.py",
    "planes.py",
    "primitives.py",
    "stream.py",
    "stream_schedule.py",
)


def device_sources() -> tuple[Path, ...]:
    """Every file the K1/K2 builds compile from or take constants from (without importing them)."""
    model = Path(__file__).resolve().parent
    generic = model.parents[2] / "kernels" / "triton"
    return tuple(model / f for f in _MODEL_SOURCES) + tuple(generic / f for f in _GENERIC_SOURCES)


@dataclass
class TritonRuntime(PersistentRuntime):
    """Everything the launches of one deployment on one device share (see the module doc);
    the per-step hooks are :class:`~mono_ext.runtime.persistent.PersistentRuntime`'s."""

    device: Any
    dims: Any  # models.qwen3_next.dims.Dims, this rank's
    layouts: Mapping[str, str]
    null_slot: int | None
    validate: bool
    state: Any  # runtime.peers.RankState
    failstop: Any  # runtime.failstop.FailStop
    k1: Any  # k1.K1Launches over the two K1 builds and their workspaces
    k2_gdn: Any  # k2.K2Launch or None
    k2_attn: Any  # k2.K2Launch (gated) or None
    k2_gdn_ws: Any
    k2_attn_ws: Any
    cache: Any  # runtime.build_cache.BuildCache of TritonLaunches
    steps: int = 0  # host-side count of finished steps (FailStop's step numbers)
    frozen: Any = None  # kernels.triton.launcher.FrozenLaunches of the K2 launches, per layer
    compiled: dict[str, Any] = field(default_factory=dict)  # label -> KernelResources

    @property
    def layers_per_step(self) -> int:
        return self.dims.num_layers

    @classmethod
    def create(cls, key: BuildKey, ctx: BuildContext) -> TritonRuntime:
        import torch

        from mono_ext.core.settings import load_settings
        from mono_ext.kernels.triton.launcher import FrozenLaunches
        from mono_ext.models.qwen3_next.dims import Dims
        from mono_ext.models.qwen3_next.triton import k1 as k1m
        from mono_ext.models.qwen3_next.triton import k2 as k2m
        from mono_ext.runtime.build_cache import BuildCache
        from mono_ext.runtime.failstop import CudaHealthSource, FailStop
        from mono_ext.runtime.peers import RankState

        dev = torch.device(ctx.device)
        if dev.type != "cuda":
            raise ValueError(f"{key.label()}: the Triton backend runs on CUDA devices, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        extra = dict(ctx.extra)
        text = dict(ctx.text_config)
        settings = load_settings()
        d = Dims.from_config(text, tp=key.tp_size)
        layouts = resolved_layouts(dict(key.layouts))
        sm = torch.cuda.get_device_properties(dev).multi_processor_count
        k1_cfg = extra.get("k1_config") or k1m.K1Config(grid=sm)
        k2_cfg = extra.get("k2_config") or k2m.K2Config(grid=sm)
        kinds = set(d.kinds)
        formats = dict(key.formats)  # planes not in bf16 (every launch reads its own)
        gdn = attn = k2_gdn = k2_attn = None
        if "linear_attention" in kinds:
            gdn = k1m.K1GdnLaunch(
                k1m.K1GdnShape.from_dims(d),
                k1_cfg,
                packing=layouts["qkvz_packing"],
                state_dtype=state_dtype(text, extra, key.dtype),
                ssm_layout=layouts["ssm_layout"],
                conv_dtype=key.dtype,
                a_log_dtype=str(extra.get("a_log_dtype", "float32")),
                dt_bias_dtype=str(extra.get("dt_bias_dtype", key.dtype)),
                formats=formats,
            )
            k2_gdn = k2m.K2Launch(
                k2m.K2Shape.from_dims(d, "gdn"), k2_cfg, kind="gdn", formats=formats
            )
        if "full_attention" in kinds:
            attn = k1m.K1AttnLaunch(
                k1m.K1AttnShape.from_dims(d),
                k1_cfg,
                max_positions=int(
                    extra.get("max_positions") or text.get("max_position_embeddings") or 8192
                ),
                positions_dtype=str(extra.get("positions_dtype", "int64")),
                formats=formats,
            )
            k2_attn = k2m.K2Launch(
                k2m.K2Shape.from_dims(d, "attn"), k2_cfg, kind="attn", gated=True, formats=formats
            )
        compiled = {}
        for launch in (gdn, attn, k2_gdn, k2_attn):  # compile + load + residency, now
            if launch is not None:
                launch.build(dev)
                compiled[launch.label()] = launch.resources
        deadline = float(extra.get("deadline_s") or settings.deadline_s)
        state = RankState.create(ctx.tp_rank, dev, deadline)
        layouts_of = [x.layout for x in (gdn, attn, k2_gdn, k2_attn) if x is not None]
        failstop = FailStop(
            CudaHealthSource(state.health),
            rank=ctx.tp_rank,
            agree_every=settings.agree_every,
            name_of=wait_namer(layouts_of),
        )
        validate = bool(extra.get("validate", False))
        k1 = k1m.K1Launches(
            gdn,
            attn,
            gdn.workspace(dev) if gdn is not None else None,
            attn.workspace(dev) if attn is not None else None,
            state.ctrl,
            state.health,
            layers_per_step=d.num_layers,
            null_slot=ctx.null_slot,
            validate=validate,
        )
        rt = cls(
            device=dev,
            dims=d,
            layouts=layouts,
            null_slot=ctx.null_slot,
            validate=validate,
            state=state,
            failstop=failstop,
            k1=k1,
            k2_gdn=k2_gdn,
            k2_attn=k2_attn,
            k2_gdn_ws=k2_gdn.workspace(dev) if k2_gdn is not None else None,
            k2_attn_ws=k2_attn.workspace(dev) if k2_attn is not None else None,
            cache=None,
            compiled=compiled,
        )
        rt.frozen = FrozenLaunches()
        rt.cache = BuildCache(lambda k: TritonLaunches(k, rt), sources=device_sources())
        torch.cuda.synchronize(dev)  # workspaces zeroed before any step can see them
        return rt


@dataclass
class TritonLaunches(PersistentLaunches):
    """:class:`~mono_ext.models.qwen3_next.launches.LayerLaunches` of one build key over the
    deployment's shared :class:`TritonRuntime` (its per-step hooks)."""

    key: BuildKey
    runtime: TritonRuntime

    def k1_gdn(self, layer: BoundLayer, hidden, residual, slots, *, o_in, residual_out) -> None:
        self._rows(hidden)
        self.runtime.k1.k1_gdn(layer, hidden, residual, slots, o_in=o_in,
                               residual_out=residual_out)  # fmt: skip

    def k1_attn(self, layer: BoundLayer, hidden, residual, positions, *, q, k, v, gate,
                residual_out) -> None:  # fmt: skip
        self._rows(hidden)
        self.runtime.k1.k1_attn(layer, hidden, residual, positions, q=q, k=k, v=v, gate=gate,
                                residual_out=residual_out)  # fmt: skip

    def k2(self, layer: BoundLayer, o_in, residual, gate, *, hidden_out, residual_out) -> None:
        self._rows(o_in)
        rt = self.runtime
        if layer.is_gdn:
            if gate is not None:
                raise ValueError(f"layer {layer.index}: a GDN layer's K2 takes no gate")
            launch, ws = rt.k2_gdn, rt.k2_gdn_ws
        else:
            if gate is None:
                raise ValueError(f"layer {layer.index}: an attention layer's K2 needs its gate")
            launch, ws = rt.k2_attn, rt.k2_attn_ws
        if launch is None:
            raise RuntimeError(f"{self.key.label()}: no K2 build for layer {layer.index}")
        if rt.validate:
            launch.check(o_in, residual, layer.weights, hidden_out, residual_out, gate)
        values = launch.live_values(o_in, residual, hidden_out, residual_out, gate)
        planned = rt.frozen.get(
            ("k2", layer.index),
            layer,
            values,
            lambda: launch.plan(o_in, residual, layer.weights, hidden_out, residual_out, ws=ws,
                                ctrl=rt.state.ctrl, health=rt.state.health, layer=layer.index,
                                layers_per_step=rt.layers_per_step, gate=gate),  # fmt: skip
        )
        planned.run(values)


class TritonBuilder:
    """The backend's ``target``: ``build(key, ctx)`` -> :class:`TritonLaunches`.

    Keys of one deployment (same device, rank, config, dtype, layouts and ``extra``) share one
    :class:`TritonRuntime`, made (and compiled) by the first of them.
    """

    # Widths a deployment routes by default: those measured faster than the engine's own
    # decode step, per engine and device, each from a committed result (measured.py).
    # Everything else runs stock unless MONO_EXT_SERVE_UNMEASURED=1 (tests and benchmarks;
    # core.backends.served_widths).
    measured_faster = staticmethod(measured_faster)
    # Plane formats K1/K2 read in place (kernels/triton/planes.py). A quantized deployment is
    # judged plane by plane at the model stage (models/qwen3_next/spec.py), so the config stage
    # names no quantization method.
    plane_formats: frozenset[str] = READ_FORMATS

    def __init__(self) -> None:
        self.runtimes: dict[tuple, TritonRuntime] = {}

    def refusals(self, cfg: ConfigView, layouts: Mapping[str, str]) -> list[str]:
        reasons = []
        if cfg.tp_size != 1:
            reasons.append(
                f"TP {cfg.tp_size}: the Triton K2 all-reduces run through peer buffers "
                "(runtime.peers.IpcPeers) that no engine adapter opens yet; the Triton backend "
                "serves TP 1 only"
            )
        if cfg.dtype != "bfloat16":
            reasons.append(f"dtype {cfg.dtype}: the Triton K1/K2 read and write bfloat16")
        reasons += layout_reasons(layouts, "Triton")
        text = dict(cfg.hf_config)
        ssm = text.get("mamba_ssm_dtype")
        if ssm is not None and ssm not in STATE_DTYPES:
            reasons.append(f"mamba_ssm_dtype {ssm!r}: K1 reads {STATE_DTYPES} recurrent states")
        try:
            import triton  # noqa: F401
        except ImportError:
            return [*reasons, "triton is not installed"]
        from mono_ext.models.qwen3_next.triton.k1 import K1AttnShape, K1GdnShape
        from mono_ext.models.qwen3_next.triton.k2 import K2Shape

        tp = max(1, cfg.tp_size)
        shape = kernel_shape_reasons(text, tp, "Triton", K1GdnShape, K1AttnShape, K2Shape)
        return reasons + shape

    def __call__(self, key: BuildKey, ctx: BuildContext) -> TritonLaunches:
        if key.tp_size != 1:
            raise ValueError(f"{key.label()}: the Triton backend serves TP 1 only (see refusals)")
        if key.dtype != "bfloat16":
            raise ValueError(f"{key.label()}: the Triton K1/K2 are built for bfloat16")
        if not 1 <= key.width <= MAX_WIDTH:
            raise ValueError(f"{key.label()}: widths 1..{MAX_WIDTH} only")
        bad = layout_reasons(dict(key.layouts), "Triton")
        if bad:
            raise ValueError(f"{key.label()}: " + "; ".join(bad))
        rk = runtime_key(key, ctx)
        rt = self.runtimes.get(rk)
        if rt is None:
            rt = self.runtimes[rk] = TritonRuntime.create(key, ctx)
        rt.cache.build_all([key])  # NotBuiltError once the first step has sealed it
        return rt.cache.get(key)


#: ``KernelBackend.target`` of the ``triton`` backend (``mono_ext.models.qwen3_next.triton.backend:build``).
build = TritonBuilder()
