"""The ``flydsl`` backend's :class:`~mono_ext.models.qwen3_next.launches.LaunchBuilder`: the
FlyDSL K1 (``k1.py``) and K2 (``k2.py``) behind the launch interface, with the runtime state
they share. Its structure is the Triton backend's (``models/qwen3_next/triton/backend.py``).

**Nothing here has run on an MI355X** (none where it was written): what is compiled, what is
written and exercised on a CPU only, and what is missing are :data:`BUILT`, :data:`WRITTEN`
and :data:`NOT_BUILT`. It serves no width by default (:attr:`FlyDSLBuilder.faster_widths` is
empty until a decode step is measured faster than the engine's own on gfx950); the plugin's
probe refuses every device that is not a ROCm gfx950 GPU.

What one deployment on one device gets (a :class:`FlyDSLRuntime`, made by the first key):

| object              | what                                               | when               |
|---------------------|----------------------------------------------------|--------------------|
| K1/K2 builds        | per width (``W`` is a compile-time constant of the | each key           |
|                     | FlyDSL kernels, unlike the Triton ones): compiled  |                    |
|                     | for gfx950, ISA-checked, loaded, residency-checked |                    |
| scratch             | one per launch kind (K1 GDN / attention, K2 GDN /  | first key's build  |
|                     | attention: same-layer K1 and K2 share a tag),      |                    |
|                     | sized for width 16                                 |                    |
| xs                  | the per-CTA rows, one for every launch (live only  | first key's build  |
|                     | within a launch; launches on a stream never        |                    |
|                     | overlap), sized for width 16                       |                    |
| rtab                | per launch kind: scratch, xs, RoPE table (K1       | first key's build  |
|                     | attention) / unused, ctrl, health                  |                    |
| RoPE table          | [max_positions, rotary_dim] fp32                   | first key's build  |
| layer tables        | int64 [layers, 24] per row: the K1 weight table,   | a layer's first    |
|                     | the K2 weight table, the GDN state table           | launch (never under|
|                     |                                                    | graph capture)     |
| RankState, FailStop | ctrl/health; pinned health copies polled after     | first key's build  |
|                     | every step (``torch.cuda`` is HIP on ROCm torch)   |                    |
| BuildCache          | every BuildKey of the deployment                   | each key; sealed   |
|                     |                                                    | by the first step  |

The widths share workspaces, tables and the epoch: one step runs at a time and every mailbox
tag is (step epoch, layer). Per step: the hooks of :mod:`mono_ext.runtime.persistent`, as the
Triton backend's (a dry run never captures). TP 1 only: the K2 all-reduces push into peer
buffers that no engine adapter opens yet (:class:`~mono_ext.runtime.peers.HipIpcPeers`
exists, untested on ROCm; GDN and attention K2 would each need their own, their layouts
differ).

``BuildContext.extra`` (all optional): ``ssm_dtype``, ``dt_bias_dtype``, ``max_positions``,
``deadline_s``, ``validate`` (as the Triton backend's), and ``dry_run``: on a CPU, with
``device="cpu"``, every tensor is a CPU tensor and every launch goes through
:func:`~mono_ext.kernels.flydsl.toolchain.dry_launch` (arguments checked against the
kernel's parameters, packed as for the device, bound and traced by FlyDSL under
``COMPILE_ONLY`` against the build's artifact) instead of running; FailStop reads a
:class:`~mono_ext.runtime.failstop.ScriptedHealthSource`. For tests
(``tests/models/qwen3_next/flydsl/test_backend_binding.py``); it serves nothing.

No flydsl import at module import: refusals and the probe work on any machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mono_ext.core.spec import BuildContext, BuildKey
from mono_ext.core.views import ConfigView
from mono_ext.kernels.flydsl.limits import MAX_WIDTH
from mono_ext.models.qwen3_next.launches import (
    STATE_DTYPES,
    BoundLayer,
    layout_reasons,
    resolved_layouts,
    state_dtype,
)
from mono_ext.models.qwen3_next.shapes import kernel_shape_reasons
from mono_ext.runtime.persistent import (
    PersistentLaunches,
    PersistentRuntime,
    runtime_key,
    wait_namer,
)

__all__ = [
    "BUILT",
    "NOT_BUILT",
    "WRITTEN",
    "FlyDSLBuilder",
    "FlyDSLLaunches",
    "FlyDSLRuntime",
    "build",
    "missing_reason",
]

#: Pieces compiled for gfx950 in CI (``mono_ext.models.qwen3_next.flydsl.sweep``), never run.
BUILT: tuple[str, ...] = (
    "runtime primitives: tagged mailbox store and bounded wait (s_memrealtime deadline, health "
    "record, sticky failed word)",
    "one-shot peer-buffer all-reduce through a device table of peer addresses",
    "K1 (layer fronts), models/qwen3_next/flydsl/k1.py: GDN (every engine layout) and attention "
    "fronts, widths 1..16, compiled and checked for gfx950; host-side tensor checks",
    "K2 (layer tail), models/qwen3_next/flydsl/k2.py: GDN and attention (gated) layers, widths 1..16, "
    "compiled and checked for gfx950; host-side tensor checks and launch arguments",
)

#: Pieces written and exercised on a CPU only: never run on gfx950.
WRITTEN: tuple[str, ...] = (
    "launch binding (this module): K1/K2 builds per width, workspaces, weight/state/runtime "
    "tables, RoPE table, RankState, FailStop polling; driven on a CPU by a dry run (every "
    "launch's arguments checked against the kernel's parameters, packed as for the device and "
    "bound by FlyDSL under COMPILE_ONLY); loading and launching on a device never ran",
    "HIP IPC peer buffers (runtime.peers.HipIpcPeers): the exchange tested over gloo with a "
    "stand-in driver; no engine adapter opens them, so TP > 1 is refused",
)

#: Pieces a deployment needs that do not exist yet (each one refuses the backend).
NOT_BUILT: tuple[str, ...] = ()

LAYER_ROW = 24  # int64 words per layer: K1 wtab at 0, K2 wtab at 8, GDN stab at 16
K1_COL, K2_COL, STATE_COL = 0, 8, 16


def missing_reason() -> str | None:
    """One line naming everything not built, or None when the backend is complete."""
    if not NOT_BUILT:
        return None
    return "the FlyDSL backend is incomplete: " + "; ".join(NOT_BUILT)


@dataclass
class FlyDSLRuntime(PersistentRuntime):
    """Everything the launches of one deployment on one device share (see the module doc);
    the per-step hooks are :class:`~mono_ext.runtime.persistent.PersistentRuntime`'s."""

    device: Any
    dims: Any  # models.qwen3_next.dims.Dims, this rank's
    grid: int
    null_slot: int | None
    validate: bool
    dry_run: bool
    state: Any  # runtime.peers.RankState
    failstop: Any  # runtime.failstop.FailStop
    factories: dict[str, Callable[[int], Any]]  # launch kind -> width -> K1/K2 build object
    scratch: dict[str, Any]  # launch kind -> int64 words
    xs: Any
    rope: Any  # None without attention layers
    rtabs: dict[str, Any]  # launch kind -> int64 [5]
    tables: Any  # int64 [layers, LAYER_ROW]
    cache: Any = None  # runtime.build_cache.BuildCache of FlyDSLLaunches
    steps: int = 0  # host-side count of finished steps (FailStop's step numbers)
    compiled: dict[str, Any] = field(default_factory=dict)  # label -> toolchain.Compiled
    launched: list = field(default_factory=list)  # dry run: (label, arguments, ABI values)
    bound: dict = field(default_factory=dict)  # (layer, column) -> the values written there

    @property
    def layers_per_step(self) -> int:
        return self.dims.num_layers

    @classmethod
    def create(cls, key: BuildKey, ctx: BuildContext) -> FlyDSLRuntime:
        import torch

        from mono_ext.core.settings import load_settings
        from mono_ext.kernels.flydsl import primitives
        from mono_ext.models.qwen3_next.dims import Dims
        from mono_ext.models.qwen3_next.flydsl import _k1_device, _k2_device, k1, k2
        from mono_ext.runtime.build_cache import BuildCache
        from mono_ext.runtime.failstop import CudaHealthSource, FailStop, ScriptedHealthSource
        from mono_ext.runtime.peers import RankState

        extra = dict(ctx.extra)
        dry = bool(extra.get("dry_run", False))
        dev, grid = _device(key, ctx.device, dry)
        text = dict(ctx.text_config)
        settings = load_settings()
        d = Dims.from_config(text, tp=key.tp_size)
        lay = resolved_layouts(dict(key.layouts))
        factories: dict[str, Callable[[int], Any]] = {}
        if "linear_attention" in d.kinds:
            gdn = k1.K1GdnShape.from_dims(d)
            opts = dict(packing=lay["qkvz_packing"], conv_layout=lay["conv_layout"],
                        ssm_layout=lay["ssm_layout"],
                        state_dtype=state_dtype(text, extra, key.dtype),
                        dt_bias_dtype=str(extra.get("dt_bias_dtype", key.dtype)))  # fmt: skip
            factories["k1_gdn"] = lambda w: k1.K1GdnBuild(gdn, w, grid=grid, **opts)
            k2_gdn = k2.K2Shape.from_dims(d, "gdn")
            factories["k2_gdn"] = lambda w: k2.K2Build(k2_gdn, w, "gdn", grid)
        if "full_attention" in d.kinds:
            attn = k1.K1AttnShape.from_dims(d)
            factories["k1_attn"] = lambda w: k1.K1AttnBuild(attn, w, grid)
            k2_attn = k2.K2Shape.from_dims(d, "attn")
            factories["k2_attn"] = lambda w: k2.K2Build(k2_attn, w, "attn", grid)
        widest = {kind: make(MAX_WIDTH) for kind, make in factories.items()}  # sizes only

        def zeros(n: int, dtype: Any) -> Any:
            return torch.zeros(n, dtype=dtype, device=dev)

        scratch = {kind: zeros(b.layout.scratch_words, torch.int64) for kind, b in widest.items()}
        xs = zeros(max(b.xs_bytes for b in widest.values()), torch.uint8)
        deadline = float(extra.get("deadline_s") or settings.deadline_s)
        state = RankState.create(ctx.tp_rank, dev, deadline)
        rope = None
        if "k1_attn" in widest:
            rows = int(extra.get("max_positions") or text.get("max_position_embeddings") or 8192)
            rope = k1.rope_table(d.rotary_dim, d.rope_theta, rows, dev)
        rtabs = {}
        for kind, b in widest.items():
            third = {"rope": rope} if kind == "k1_attn" else {}
            values = b.runtime_table(scratch=scratch[kind], xs=xs, ctrl=state.ctrl,
                                     health=state.health, **third)  # fmt: skip
            rtabs[kind] = torch.tensor(values, dtype=torch.int64, device=dev)
        source = ScriptedHealthSource() if dry else CudaHealthSource(state.health)
        failstop = FailStop(source, rank=ctx.tp_rank, agree_every=settings.agree_every,
                            name_of=wait_namer([b.layout for b in widest.values()]))  # fmt: skip
        rt = cls(
            device=dev,
            dims=d,
            grid=grid,
            null_slot=ctx.null_slot,
            validate=bool(extra.get("validate", False)),
            dry_run=dry,
            state=state,
            failstop=failstop,
            factories=factories,
            scratch=scratch,
            xs=xs,
            rope=rope,
            rtabs=rtabs,
            tables=torch.zeros(d.num_layers, LAYER_ROW, dtype=torch.int64, device=dev),
        )
        sources = (k1, k2, _k1_device, _k2_device, primitives)
        rt.cache = BuildCache(lambda k: FlyDSLLaunches(k, rt, rt.build_width(k.width)), sources)
        if not dry:
            torch.cuda.synchronize(dev)  # workspaces zeroed before any step can see them
        return rt

    def build_width(self, width: int) -> dict[str, Any]:
        """Launch kind -> the width's ``toolchain.Compiled`` (with ``.build``): compiled for
        gfx950, ISA-checked, loaded (device) and residency-checked (device)."""
        import contextlib

        import torch

        from mono_ext.runtime.build_cache import ResidencyError

        out = {}
        # FlyDSL loads onto the current device
        with contextlib.nullcontext() if self.dry_run else torch.cuda.device(self.device):
            for kind, make in self.factories.items():
                c = make(width).compile(load=not self.dry_run).check()
                if not self.dry_run and c.launcher.max_blocks_per_cu() < 1:
                    raise ResidencyError(f"{c.label}: not one CTA fits on a CU of this device")
                self.compiled[c.label] = c
                out[kind] = c
        return out

    # -- launching ---------------------------------------------------------------------
    def capturing(self) -> bool:
        return not self.dry_run and super().capturing()  # a dry run never captures

    def layer_table(self, layer: BoundLayer, column: int, values: list[int]) -> Any:
        """The int64 view at ``column`` of the layer's table row, holding ``values``; written
        on the layer's first launch and whenever its tensors moved (never while capturing:
        a graph must replay the addresses it captured)."""
        import torch

        if not 0 <= layer.index < self.layers_per_step:
            raise ValueError(f"layer {layer.index} outside [0, {self.layers_per_step})")
        view = self.tables[layer.index, column : column + len(values)]
        if self.bound.get((layer.index, column)) != values:
            if self.capturing():
                raise RuntimeError(
                    f"layer {layer.index}: its FlyDSL tables were not written before graph "
                    "capture (the tensors moved, or no eager step ran first)"
                )
            view.copy_(torch.tensor(values, dtype=torch.int64))
            self.bound[layer.index, column] = values
        return view

    def launch(self, c: Any, args: tuple) -> None:
        if self.dry_run:
            from mono_ext.kernels.flydsl.toolchain import dry_launch

            self.launched.append((c.label, args, dry_launch(c, (*args, None))))
            return
        import torch

        c.launcher(*args, torch.cuda.current_stream(self.device).cuda_stream)


def _device(key: BuildKey, device: Any, dry: bool) -> tuple[Any, int]:
    """(torch device, grid): a ROCm gfx950 GPU and its CU count, or the CPU of a dry run."""
    import torch

    from mono_ext.kernels.flydsl.limits import GFX950

    dev = torch.device(device)
    if dry:
        if dev.type != "cpu":
            raise ValueError(f"{key.label()}: a dry run builds on the CPU, got {dev}")
        return dev, GFX950.cus
    if dev.type != "cuda" or not getattr(torch.version, "hip", None):
        raise ValueError(f"{key.label()}: the FlyDSL backend runs on ROCm gfx950 GPUs, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    arch = str(getattr(props, "gcnArchName", "")).split(":")[0]
    if arch != GFX950.arch:
        raise ValueError(f"{key.label()}: device {dev} is {arch or 'unknown'}, not gfx950")
    return dev, props.multi_processor_count


@dataclass
class FlyDSLLaunches(PersistentLaunches):
    """:class:`~mono_ext.models.qwen3_next.launches.LayerLaunches` of one build key (one
    width's K1/K2 builds) over the deployment's shared :class:`FlyDSLRuntime`."""

    key: BuildKey
    runtime: FlyDSLRuntime
    builds: dict[str, Any]  # launch kind -> toolchain.Compiled of this width

    def _build(self, kind: str, layer: BoundLayer, rows: Any) -> Any:
        self._rows(rows)
        c = self.builds.get(kind)
        if c is None:
            raise RuntimeError(f"{self.key.label()}: no {kind} build for layer {layer.index}")
        return c

    def _checked(self, c: Any, layer: BoundLayer, column: int, reasons: Callable) -> Any:
        """The layer's weight table for ``c``; the build's tensor checks (``reasons()``) run
        on every launch when validating, and before the layer's first launch regardless."""
        weights = layer.weights
        fresh = self.runtime.bound.get((layer.index, column)) is None
        if self.runtime.validate or fresh:
            bad = reasons()
            if bad:
                raise ValueError(f"{c.label} (layer {layer.index}): " + "; ".join(bad))
        addresses = [weights[n].data_ptr() for n in c.build.weight_shapes()]  # the entry order
        return self.runtime.layer_table(layer, column, addresses)

    def k1_gdn(self, layer: BoundLayer, hidden, residual, slots, *, o_in, residual_out) -> None:
        rt = self.runtime
        c = self._build("k1_gdn", layer, hidden)
        b = c.build
        if layer.conv_state is None or layer.ssm_state is None:
            raise ValueError(f"layer {layer.index}: a GDN layer's K1 needs its conv and ssm states")
        wtab = self._checked(c, layer, K1_COL, lambda: b.check(hidden, residual, residual_out,
                                                               slots, o_in, layer.weights))  # fmt: skip
        stab = rt.layer_table(layer, STATE_COL, b.state_table(layer.conv_state, layer.ssm_state))
        rt.launch(c, b.args(hidden, residual, residual_out, slots, o_in, wtab=wtab,
                            rtab=rt.rtabs["k1_gdn"], stab=stab, null_slot=rt.null_slot,
                            layer=layer.index, layers_per_step=rt.layers_per_step))  # fmt: skip

    def k1_attn(self, layer: BoundLayer, hidden, residual, positions, *, q, k, v, gate,
                residual_out) -> None:  # fmt: skip
        rt = self.runtime
        c = self._build("k1_attn", layer, hidden)
        b = c.build
        wtab = self._checked(c, layer, K1_COL, lambda: b.check(hidden, residual, residual_out,
                                                               positions, q, gate, k, v,
                                                               layer.weights))  # fmt: skip
        rt.launch(c, b.args(hidden, residual, residual_out, positions, q, gate, k, v, wtab=wtab,
                            rtab=rt.rtabs["k1_attn"], layer=layer.index,
                            layers_per_step=rt.layers_per_step))  # fmt: skip

    def k2(self, layer: BoundLayer, o_in, residual, gate, *, hidden_out, residual_out) -> None:
        rt = self.runtime
        kind = "k2_gdn" if layer.is_gdn else "k2_attn"
        c = self._build(kind, layer, o_in)
        b = c.build
        wtab = self._checked(c, layer, K2_COL, lambda: b.check(o_in, residual, layer.weights,
                                                               hidden_out, residual_out, gate))  # fmt: skip
        rt.launch(c, b.args(o_in, residual, hidden_out, residual_out, wtab=wtab,
                            rtab=rt.rtabs[kind], layer=layer.index,
                            layers_per_step=rt.layers_per_step, gate=gate))  # fmt: skip


class FlyDSLBuilder:
    """The backend's ``target``: ``build(key, ctx)`` -> :class:`FlyDSLLaunches`.

    Keys of one deployment (same device, rank, config, dtype, layouts and ``extra``) share one
    :class:`FlyDSLRuntime`, made by the first of them; each key compiles its width's builds.
    """

    # Widths at which a whole decode step through the FlyDSL K1/K2 has been measured faster
    # than the engine's own step on an MI355X. None: nothing has run on one. Deployments route
    # nothing until this holds a width, unless MONO_EXT_SERVE_UNMEASURED=1
    # (core.backends.served_widths).
    faster_widths: frozenset[int] = frozenset()
    # The FlyDSL K1/K2 read bf16 planes only (quantized configs are refused).
    plane_formats: frozenset[str] = frozenset({"bf16"})

    def __init__(self) -> None:
        self.runtimes: dict[tuple, FlyDSLRuntime] = {}

    def refusals(self, cfg: ConfigView, layouts: Mapping[str, str]) -> list[str]:
        from mono_ext.kernels.flydsl.toolchain import flydsl_available

        reasons = list(NOT_BUILT)
        if cfg.tp_size != 1:
            reasons.append(
                f"TP {cfg.tp_size}: the FlyDSL K2 all-reduces push into peer buffers "
                "(runtime.peers.HipIpcPeers) that no engine adapter opens yet; the FlyDSL "
                "backend serves TP 1 only"
            )
        if cfg.dtype != "bfloat16":
            reasons.append(f"dtype {cfg.dtype}: the FlyDSL K1/K2 read and write bfloat16")
        if cfg.quantization is not None:
            reasons.append(f"quantization {cfg.quantization!r}: the FlyDSL K1/K2 read bf16 planes")
        reasons += layout_reasons(layouts, "FlyDSL")
        text = dict(cfg.hf_config)
        ssm = text.get("mamba_ssm_dtype")
        if ssm is not None and ssm not in STATE_DTYPES:
            reasons.append(f"mamba_ssm_dtype {ssm!r}: K1 reads {STATE_DTYPES} recurrent states")
        ok, why = flydsl_available()
        if not ok:
            reasons.append(why)
        from mono_ext.models.qwen3_next.flydsl.k1 import K1AttnShape, K1GdnShape
        from mono_ext.models.qwen3_next.flydsl.k2 import K2Shape

        tp = max(1, cfg.tp_size)
        shape = kernel_shape_reasons(text, tp, "FlyDSL", K1GdnShape, K1AttnShape, K2Shape)
        return reasons + shape

    def __call__(self, key: BuildKey, ctx: BuildContext) -> FlyDSLLaunches:
        if not 1 <= key.width <= MAX_WIDTH:
            raise ValueError(f"{key.label()}: widths 1..{MAX_WIDTH} only")
        why = missing_reason()
        if why is not None:
            raise NotImplementedError(f"{key.label()}: {why}")
        if key.tp_size != 1:
            raise ValueError(f"{key.label()}: the FlyDSL backend serves TP 1 only (see refusals)")
        if key.dtype != "bfloat16" or key.formats:
            raise ValueError(f"{key.label()}: the FlyDSL K1/K2 read and write bf16 only")
        rk = runtime_key(key, ctx)
        rt = self.runtimes.get(rk)
        if rt is None:
            rt = self.runtimes[rk] = FlyDSLRuntime.create(key, ctx)
        rt.cache.build_all([key])  # NotBuiltError once the first step has sealed it
        return rt.cache.get(key)


#: ``KernelBackend.target`` of the ``flydsl`` backend (``mono_ext.models.qwen3_next.flydsl.backend:build``).
build = FlyDSLBuilder()
