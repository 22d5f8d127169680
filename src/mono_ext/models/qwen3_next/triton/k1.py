"""K1, the layer front, as one persistent Triton launch per layer per decode step (bf16
activations; the matrix planes in bf16 or fp8 e4m3fn with fp32 scales, ``formats``).

GDN layers (:func:`mono_ext.models.qwen3_next.reference.gdn.gdn_front` is the fp32 oracle): residual add +
input Gemma RMSNorm -> ``in_proj_qkvz`` / ``in_proj_ba`` -> causal conv1d update on the
engine's conv state -> gated delta rule on the engine's recurrent state (in place) -> gated
RMSNorm with SiLU(z) = out_proj's input. Attention layers (:func:`mono_ext.models.qwen3_next.reference.
attention.attn_front`): residual add + norm -> ``qkv_proj`` -> q/k Gemma norms -> partial
neox RoPE -> q, k, v, gate. Writing k/v into the paged KV cache stays with the engine's
attention call (its ``reshape_and_cache`` / backend ``forward``), which runs after K1.

The device program (prologue, S1, S2, why no wait can deadlock) and the tensor contract are
described with the kernels, in ``k1_kernel.py``; the shapes, config, hand-off programs and S1's
tiling are ``k1_plan.py`` (re-exported here); this module checks the tensors and builds and
launches the kernels.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mono_ext.kernels.triton.launcher import (
    ROWS,
    FrozenLaunch,
    FrozenLaunches,
    Live,
    live_template,
    live_values,
)
from mono_ext.kernels.triton.limits import BLOCK_B, PER_STEP_ARGS, next_pow2, pdl_options
from mono_ext.kernels.triton.planes import chunk_limit, format_code, plane_reasons
from mono_ext.models.qwen3_next.triton.k1_kernel import (
    S0,
    S1,
    S2,
    S3,
    STAGES_ALL,
    TRACE_POINTS,
    k1_attn_kernel,
    k1_gdn_kernel,
)
from mono_ext.models.qwen3_next.triton.k1_plan import (
    K1AttnShape,
    K1Config,
    K1GdnShape,
    gdn_row_map,
    k1_attn_program,
    k1_gdn_program,
    pow2_divisor,
    rope_table,
    s1_units,
    split_words,
)
from mono_ext.runtime.layout import plan_layout

__all__ = [
    "S0",
    "S1",
    "S2",
    "S3",
    "STAGES_ALL",
    "TRACE_POINTS",
    "BLOCK_B",
    "K1AttnLaunch",
    "K1AttnShape",
    "K1Config",
    "K1GdnLaunch",
    "K1GdnShape",
    "K1Launches",
    "K1Workspace",
    "gdn_row_map",
    "k1_attn_kernel",
    "k1_attn_program",
    "k1_gdn_kernel",
    "k1_gdn_program",
    "rope_table",
    "s1_units",
]


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _prefetch(config: K1Config, hidden: int) -> bool:
    """Weight prefetch: off in the interpreter (no inline asm) and for chunks < 64 values."""
    return (
        config.prefetch_first_chunks
        and not _interp()
        and pow2_divisor(hidden, config.k_chunk) >= 64
    )


@dataclass
class K1Workspace:
    """One rank's K1 scratch: the tagged mailbox region and per-CTA normed rows."""

    scratch: Any  # int64 [scratch_words]
    xs: Any  # bf16 [G, Bb, H]; [G + 1, Bb, H] with norm_once_above (the last: the shared rows)
    trace: Any = None  # int64 [G, 16]: trace builds only (K1Config.trace, TRACE_POINTS)


def _check_tensors(label: str, tensors: dict, bad: list[str]) -> None:
    for name, (t, shp, dtype) in tensors.items():
        if t is None:
            bad.append(f"missing {name}")
            continue
        if shp is not None and tuple(t.shape) != tuple(shp):
            bad.append(f"{name} is {tuple(t.shape)}, expected {tuple(shp)}")
        if dtype is not None and t.dtype != dtype:
            bad.append(f"{name} is {t.dtype}, expected {dtype} (the dtype built)")
        if not t.is_contiguous():
            bad.append(f"{name} is not contiguous")
        if t.data_ptr() % 16:
            # Triton keys variants on 16-byte pointer alignment: another alignment would
            # compile (and load a module) mid-step, which stalls against spinning CTAs.
            bad.append(f"{name} is not 16-byte aligned (no JIT mid-step)")


def _fp8_stand_ins(planes: list[str], dev: Any) -> dict:
    """Warmup stand-ins of quantized planes and their scales: warmup compiles for dtypes and
    alignment, it launches nothing."""
    import torch

    out = {}
    for plane in planes:
        out[plane] = torch.zeros(16, dtype=torch.float8_e4m3fn, device=dev)
        out[plane + ".scale"] = torch.zeros(16, dtype=torch.float32, device=dev)
    return out


def _dt(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _workspace(words: int, grid: int, hidden: int, device: Any, trace: bool,
               shared_rows: bool = False) -> K1Workspace:  # fmt: skip
    import torch

    return K1Workspace(
        scratch=torch.zeros(max(words, 16), dtype=torch.int64, device=device),
        xs=torch.zeros(grid + shared_rows, BLOCK_B, hidden, dtype=torch.bfloat16, device=device),
        trace=torch.zeros(grid, 16, dtype=torch.int64, device=device) if trace else None,
    )


def _step_args(residual, ws, ctrl, health, n_rows, layer, layers_per_step) -> tuple:
    """The arguments both kernels take after their tensors (scratch .. has_res), in order.
    Without a trace tensor the scratch stands in for it (only TRACE builds write it)."""
    trace = ws.scratch if ws.trace is None else ws.trace
    return (ws.scratch, ws.xs, ctrl, health, trace, n_rows, layer, layers_per_step,
            0 if residual is None else 1)  # fmt: skip


class _K1LaunchBase:
    """What :class:`K1GdnLaunch` and :class:`K1AttnLaunch` share: refusals, S1 tiling and the
    common constexprs, tensor checks, the build (compile + load + residency check) and the
    launch (S1 and S2 as two launches in the interpreter with more than one program).

    Subclasses are dataclasses with the fields ``shape``, ``config``, ``co_resident``,
    ``stages``, ``formats``, ``layout``, ``resources``, ``_built`` and ``_cx`` (the
    constexprs, computed once by :meth:`build`); they set ``_KIND``
    (refusals), ``_KERNEL``, ``_PROGRAM`` and ``_PLANES`` and implement ``label``, ``check``,
    ``_args``, ``_refusals``, ``_proj_rows``, ``_kind_constexprs`` and ``_warmup_args``.

    ``formats``: plane -> format (``kernels.triton.planes.FORMAT_CODES``) of the matrix planes
    in ``_PLANES``; absent ones are bf16, other planes are ignored. A quantized plane ``P`` is
    read in place with its fp32 scales ``weights[P + ".scale"]``; each plane's format is a
    constexpr, so an all-bf16 build compiles to the same kernel as a build with no format constexprs.
    """

    _KIND = ""
    _FRONT = ""  # NORM_ONCE_ABOVE's key
    _KERNEL: Any = None
    _PROGRAM: Any = None
    _PLANES: tuple[str, ...] = ()
    _LIVE_AT: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = self.shape.refusals() + self._refusals() + self._format_refusals()
        if not 0 <= self.norm_once_above <= BLOCK_B:
            bad.append(f"norm_once_above={self.norm_once_above}: 0..{BLOCK_B} rows")
        if bad:
            raise ValueError(f"K1 {self._KIND} refused: " + "; ".join(bad))
        self.layout = plan_layout(self._program())

    @property
    def norm_once_above(self) -> int:
        """Steps of more rows than this take the norm-once hand-off (``K1Config``)."""
        return self.config.norm_once_rows(self._FRONT)

    def norms_once(self) -> bool:
        """Whether some width (at most BLOCK_B rows) takes the norm-once hand-off."""
        return self.norm_once_above < BLOCK_B

    def _program(self) -> Any:
        return type(self)._PROGRAM(self.shape, norm_once=self.norms_once(),
                                   split=self._split_words())  # fmt: skip

    def _tiling(self) -> tuple[int, int]:
        """S1's tile rows and K chunk (``BN``, ``BK``)."""
        c = self.config
        bn = pow2_divisor(self._proj_rows(), c.tile_rows)
        # a block-128 plane's chunks stay inside one scale column: BK divides 128 (and H, so
        # every chunk starts at a multiple of BK)
        bk = min(c.k_chunk, chunk_limit(self.formats, *self._PLANES) or c.k_chunk)
        return bn, pow2_divisor(self.shape.hidden, bk)

    def _units(self) -> tuple[int, int, int, int]:
        """S1's units (:func:`s1_units`): full tiles, split, tail units, rows per tail unit."""
        bn, bk = self._tiling()
        return s1_units(self._s1_rows(bn), self.config.grid, bn, self.shape.hidden // bk,
                        self.config.split_tail_tiles)  # fmt: skip

    def _split_words(self) -> int:
        _, split, units, rows = self._units()
        return split_words(units // split, split, rows)

    def _fmt(self, plane: str) -> str:
        return self.formats.get(plane, "bf16")

    def _quantized(self) -> list[str]:
        """Planes of ``_PLANES`` this build reads in a format other than bf16."""
        return [p for p in self._PLANES if self._fmt(p) != "bf16"]

    def _format_refusals(self) -> list[str]:
        bad = []
        for plane in self._PLANES:
            try:
                format_code(self.formats, plane)
            except ValueError as e:
                bad.append(str(e))
        return bad

    def _q(self, plane: str) -> int:
        return format_code(self.formats, plane)

    def _scale_arg(self, weights: Any, plane: str) -> Any:
        """A quantized plane's scales; bf16 planes have none: the weight itself (never read,
        and as aligned as the weight, so no other variant is compiled)."""
        return weights[plane + ".scale"] if self._fmt(plane) != "bf16" else weights[plane]

    def _formats_label(self) -> str:
        q = self._quantized()
        return (" " + ",".join(f"{p}={self._fmt(p)}" for p in q)) if q else ""

    def _config_label(self) -> str:
        c = self.config
        return (
            f"grid{c.grid} w{c.num_warps} tile_rows={c.tile_rows} k_chunk={c.k_chunk}"
            f" pipeline_stages={c.pipeline_stages}"
            + (f" norm_once_above={self.norm_once_above}" if self.norms_once() else "")
            + ("" if c.split_tail_tiles else " split_tail_tiles=False")
        )

    def workspace(self, device: Any) -> K1Workspace:
        return _workspace(self.layout.scratch_words, self.config.grid, self.shape.hidden,
                          device, self._traced(), self.norms_once())  # fmt: skip

    def _traced(self) -> bool:
        """Trace stamps (``K1Config.trace``): compiled builds only (they read %globaltimer)."""
        return self.config.trace and not _interp()

    def _s1_rows(self, bn: int) -> int:
        """Rows S1 streams in tiles (:func:`s1_units`)."""
        return self._proj_rows()

    def _constexprs(self) -> dict:
        s, c = self.shape, self.config
        bn, bk = self._tiling()
        ft, split, nu, tr = self._units()
        return dict(
            H=s.hidden,
            **self._kind_constexprs(),
            BB=BLOCK_B,
            BN=bn,
            BK=bk,
            FT=ft,
            SPLIT=split,
            NU=nu,
            TR=tr,
            OFF_SPLIT=self.layout.offsets.get("s1_split", 0),
            CH=min(c.norm_chunk, next_pow2(s.hidden)),
            NS=c.pipeline_stages,
            PRE=_prefetch(c, s.hidden) and not self._quantized(),  # the prefetch assumes bf16
            STAGES=self.stages,
            INTERP=_interp(),
            TRACE=self._traced(),
            num_warps=c.num_warps,
            num_stages=1,  # only the projection loop is pipelined (its own num_stages)
            **pdl_options(c.pdl),
            **self._norm_once_constexprs(),
        )

    def _norm_once_constexprs(self) -> dict:
        """The norm-once hand-off's constexprs; none without it (the same compile as a build
        that never had them)."""
        if not self.norms_once():
            return {}
        lay = self.layout
        return dict(NONCE=self.norm_once_above, OFF_NFLAG=lay.offsets["nflag"],
                    RID_NFLAG=lay.region_id("nflag"))  # fmt: skip

    def _check(self, hidden, residual, residual_out, weights, rows: dict, params: dict,
               more: list[str] | tuple = ()) -> int:  # fmt: skip
        """Shapes, dtypes, contiguity and alignment of hidden, residual(_out), the input norm,
        ``rows`` (name: (tensor, shape after the width, dtype)) and ``params`` (weight name:
        (shape or None, dtype)); ``more`` refusals after those. Returns the width."""
        import torch

        s, bf = self.shape, torch.bfloat16
        b = hidden.shape[0] if hidden.dim() == 2 else -1
        planes = {name: params.pop(name)[0] for name in self._PLANES}
        want = {
            "hidden": (hidden, (b, s.hidden), bf),
            "residual_out": (residual_out, (b, s.hidden), bf),
            **{name: (t, (b, *tail), dt) for name, (t, tail, dt) in rows.items()},
            "input_layernorm": (weights.get("input_layernorm"), (s.hidden,), bf),
            **{name: (weights.get(name), shp, dt) for name, (shp, dt) in params.items()},
        }
        if residual is not None:
            want["residual"] = (residual, (b, s.hidden), bf)
        bad: list[str] = []
        _check_tensors(self.label(), want, bad)
        for name, shp in planes.items():  # matrix planes (and scales) in their built formats
            if weights.get(name) is None:
                bad.append(f"missing {name}")
            bad += plane_reasons(name, weights, self._fmt(name), shp)
        bad += more
        if not 1 <= b <= BLOCK_B:
            bad.append(f"width {b} outside 1..{BLOCK_B}")
        if bad:
            raise ValueError(f"{self.label()}: " + "; ".join(bad))
        return b

    def build(self, device: Any = "cuda") -> None:
        """Compile, load and residency-check (GPU) at startup."""
        import torch

        dev = torch.device(device)
        self._cx = self._constexprs()
        if _interp() or dev.type != "cuda":
            self._built = True
            return
        from mono_ext.runtime.build_cache import (
            check_residency,
            check_unspecialized,
            device_limits,
            kernel_resources,
        )
        from mono_ext.runtime.peers import RankState

        check_unspecialized(self._KERNEL, PER_STEP_ARGS)
        one = torch.zeros(16, dtype=torch.bfloat16, device=dev)
        ws = K1Workspace(torch.zeros(16, dtype=torch.int64, device=dev), one)
        st = RankState.create(0, dev, 1.0)
        args = self._warmup_args(dev, one, ws, st.ctrl, st.health)
        compiled = self._KERNEL.warmup(*args, grid=(self.config.grid,), **self._cx)
        res = kernel_resources(compiled)
        check_residency(self.label(), self.config.grid * self.co_resident, res, device_limits(dev))
        self.resources = res
        self._built = True

    def plan(self, tensors: tuple, ws: K1Workspace, ctrl, health, *, check: bool = True,
             **step) -> FrozenLaunch:  # fmt: skip
        """The launch for ``tensors`` (``check``'s arguments) planned once: every tensor checked
        (unless ``check`` is False), the argument table frozen with the per-step tensors
        (``_LIVE_AT``) and the row count live; ``step``: ``_args``' keywords after n_rows."""
        if not self._built:
            raise RuntimeError(f"{self.label()}: build() at startup before launching")
        if check:
            self.check(*tensors)
        template, names, values = live_template(tensors, self._LIVE_AT)
        args = self._args(*template, ws, ctrl, health, Live(ROWS), **step)
        cx = self._cx
        passes = [cx]
        if self._split():  # interpreter: programs run in turn; a wait would need later ones
            first = (S0,) if self.norms_once() else ()
            passes = [{**cx, "STAGES": st & self.stages} for st in (*first, *self._passes())]
        return FrozenLaunch(self._KERNEL, self.config.grid, args, names, values, passes,
                            compiled=not _interp(), max_rows=BLOCK_B)  # fmt: skip

    def live_values(self, tensors: tuple) -> list:
        """What a planned launch (:meth:`plan`) takes per step from ``check``'s arguments."""
        return live_values(tensors, self._LIVE_AT)

    def _launch(self, tensors: tuple, validate: bool, ws: K1Workspace, ctrl, health,
                **step) -> None:  # fmt: skip
        """Plan and run once: ``tensors``: ``check``'s arguments (checked when
        ``validate``); ``step``: ``_args``' keywords after n_rows."""
        planned = self.plan(tensors, ws, ctrl, health, check=validate, **step)
        planned.run(self.live_values(tensors))

    def _split(self) -> bool:
        """Run each stage as a launch: the interpreter with more than one program."""
        return _interp() and self.config.grid > 1

    def _passes(self) -> tuple[int, ...]:
        return (S1, S2)


@dataclass
class K1GdnLaunch(_K1LaunchBase):
    """GDN K1 of one build: compile + load + residency check once, then launch per layer.

    ``packing`` picks the row map (data, not a compile); conv-state strides are read from
    the tensor, so both conv layouts share one compile. ``state_dtype`` ("float32" or
    "bfloat16") and ``ssm_layout`` are compiled in. ``param_dtypes`` fixes A_log / dt_bias
    dtypes (a different dtype would compile mid-step: refused at launch instead).
    ``formats``: ``in_proj_qkvz`` / ``in_proj_ba`` formats (see :class:`_K1LaunchBase`).
    """

    shape: K1GdnShape
    config: K1Config
    packing: str = "interleaved"
    state_dtype: str = "float32"
    ssm_layout: str = "vk"
    conv_dtype: str = "bfloat16"
    a_log_dtype: str = "float32"
    dt_bias_dtype: str = "bfloat16"
    co_resident: int = 1
    stages: int = STAGES_ALL
    formats: Mapping[str, str] = field(default_factory=dict)
    layout: Any = field(init=False)
    resources: Any = field(init=False, default=None)
    _built: bool = field(init=False, default=False)
    _cx: dict = field(init=False, default_factory=dict, repr=False)  # fixed by build()

    _KIND = "GDN"
    _FRONT = "gdn"
    _KERNEL = k1_gdn_kernel
    _PROGRAM = staticmethod(k1_gdn_program)
    _PLANES = ("in_proj_qkvz", "in_proj_ba")
    # check()'s per-step arguments: hidden, residual, slots, o_in, residual_out
    _LIVE_AT = (0, 1, 5, 6, 7)

    def _refusals(self) -> list[str]:
        bad = []
        if self.state_dtype not in ("float32", "bfloat16"):
            bad.append(f"state dtype {self.state_dtype}: K1 reads fp32 or bf16 states")
        if self.ssm_layout not in ("vk", "kv"):
            bad.append(f"ssm_layout {self.ssm_layout!r} is not 'vk' or 'kv'")
        if self.shape.qkvz_rows % 16:
            bad.append(f"qkvz rows {self.shape.qkvz_rows} are not a multiple of 16")
        slices, split = self.config.state_row_slices, self.config.dv_split
        if slices not in (1, 2) or self.shape.dv // slices < 16:
            bad.append(f"state_row_slices={slices}: 1 or 2 state slices of at least 16 rows")
        if split not in (1, 2, 4) or self.shape.dv // split < 16:
            bad.append(f"dv_split={split}: 1, 2 or 4 blocks of at least 16 state rows")
        elif split > 1 and slices != 1:
            bad.append(f"dv_split={split} needs state_row_slices=1 (a block is one slice)")
        return bad

    def _program(self) -> Any:
        return k1_gdn_program(self.shape, self.config.dv_split, self.norms_once(),
                              self._split_words())  # fmt: skip

    def _passes(self) -> tuple[int, ...]:
        return (S1, S2, S3) if self.config.dv_split > 1 else (S1, S2)

    def label(self) -> str:
        s = self.shape
        return (
            f"k1 gdn h{s.hidden} hk{s.hk} hv{s.hv} dk{s.dk} dv{s.dv} {self.state_dtype} "
            f"{self.ssm_layout} {self._config_label()}"
            f" state_row_slices={self.config.state_row_slices}"
            + (f" dv_split={self.config.dv_split}" if self.config.dv_split > 1 else "")
            + f"{self._formats_label()}"
        )

    def _proj_rows(self) -> int:
        return self.shape.qkvz_rows

    def _s1_rows(self, bn: int) -> int:
        na = -(-2 * self.shape.hv // bn) * bn  # in_proj_ba rows first, padded to whole tiles
        return na + self.shape.qkvz_rows

    def _kind_constexprs(self) -> dict:
        s, c, lay = self.shape, self.config, self.layout
        return dict(
            HK=s.hk,
            HV=s.hv,
            DK=s.dk,
            DV=s.dv,
            KC=s.conv_k,
            WROW=s.payload_words,
            OFF_PROJ=lay.offsets["proj"],
            RID_PROJ=lay.region_id("proj"),
            SSM_KV=self.ssm_layout == "kv",
            INTERLEAVED=self.packing == "interleaved",
            STATE_BYTES=4 if self.state_dtype == "float32" else 2,
            DVS=c.state_row_slices,
            WB=next_pow2(2 * s.dk + 2 * s.dv // c.dv_split + 2),
            Q_QKVZ=self._q("in_proj_qkvz"),
            Q_BA=self._q("in_proj_ba"),
            **self._split_constexprs(),
        )

    def _split_constexprs(self) -> dict:
        """The blocked recurrence's constexprs; none for dv_split 1 (the same compile as a
        build that never had them)."""
        ds, lay = self.config.dv_split, self.layout
        if ds == 1:
            return {}
        return dict(DS=ds, OFF_OSQ=lay.offsets["osq"], RID_OSQ=lay.region_id("osq"),
                    OFF_ORAW=lay.offsets["oraw"])  # fmt: skip

    def check(self, hidden, residual, weights, conv_state, ssm_state, slots, o_in,
              residual_out) -> int:  # fmt: skip
        """Validate shapes, dtypes, contiguity, alignment and strides; returns the width."""
        import torch

        s, bf = self.shape, torch.bfloat16
        rows = {"o_in": (o_in, (s.value_dim,), bf), "slots": (slots, (), torch.int32)}
        params = {
            "in_proj_qkvz": ((s.qkvz_rows, s.hidden), bf),
            "in_proj_ba": ((2 * s.hv, s.hidden), bf),
            "conv1d": (None, bf),
            "A_log": ((s.hv,), _dt(self.a_log_dtype)),
            "dt_bias": ((s.hv,), _dt(self.dt_bias_dtype)),
            "norm": ((s.dv,), bf),
        }
        more = self._state_refusals(weights.get("conv1d"), conv_state, ssm_state)
        return self._check(hidden, residual, residual_out, weights, rows, params, more)

    def _state_refusals(self, conv_w, conv_state, ssm_state) -> list[str]:
        s = self.shape
        bad = []
        if conv_w is not None and conv_w.numel() != s.conv_dim * s.conv_k:
            bad.append(f"conv1d has {conv_w.numel()} values, expected {s.conv_dim}x{s.conv_k}")
        k1 = s.conv_k - 1
        if conv_state.dim() != 3 or conv_state.dtype != _dt(self.conv_dtype):
            bad.append(f"conv_state must be 3-d {self.conv_dtype}, got {conv_state.dtype}")
        elif tuple(conv_state.shape[1:]) not in ((k1, s.conv_dim), (s.conv_dim, k1)):
            bad.append(f"conv_state is {tuple(conv_state.shape)}: neither [S, K-1, C] nor "
                       "[S, C, K-1]")  # fmt: skip
        if ssm_state.dtype != _dt(self.state_dtype):
            bad.append(f"ssm_state is {ssm_state.dtype}, built for {self.state_dtype}")
        if ssm_state.dim() != 4 or tuple(ssm_state.shape[1:]) != (s.hv, s.dv, s.dk):
            bad.append(f"ssm_state is {tuple(ssm_state.shape)}, expected [S, {s.hv}, {s.dv}, "
                       f"{s.dk}]")  # fmt: skip
        elif ssm_state.stride()[1:] != (s.dv * s.dk, s.dk, 1) or ssm_state.stride(0) % 16:
            bad.append("ssm_state slots must be contiguous inside, slot stride a multiple of 16")
        for name, t in (("conv_state", conv_state), ("ssm_state", ssm_state)):
            if t.data_ptr() % 16:
                bad.append(f"{name} is not 16-byte aligned (no JIT mid-step)")
        return bad

    def _args(self, hidden, residual, weights, conv_state, ssm_state, slots, o_in,
              residual_out, ws, ctrl, health, n_rows, null_slot, layer, layers_per_step):  # fmt: skip
        cs = conv_state.stride()
        k1 = self.shape.conv_k - 1
        if tuple(conv_state.shape[1:]) == (k1, self.shape.conv_dim):
            cs_t, cs_c = cs[1], cs[2]  # time_chan: [S, K-1, C]
        else:
            cs_t, cs_c = cs[2], cs[1]  # chan_time: [S, C, K-1]
        return (
            hidden, hidden if residual is None else residual, residual_out, o_in,
            *(weights[n] for n in ("input_layernorm", "in_proj_qkvz", "in_proj_ba", "conv1d",
                                   "A_log", "dt_bias", "norm")),
            conv_state, ssm_state, slots,
            *_step_args(residual, ws, ctrl, health, n_rows, layer, layers_per_step),
            -1 if null_slot is None else int(null_slot), cs[0], cs_t, cs_c,
            ssm_state.stride(0) // 16, float(self.shape.eps), float(self.shape.dk) ** -0.5,
            self._scale_arg(weights, "in_proj_qkvz"), self._scale_arg(weights, "in_proj_ba"),
        )  # fmt: skip

    def _warmup_args(self, dev, one, ws, ctrl, health) -> tuple:
        import torch

        w = {k: one for k in ("input_layernorm", "in_proj_qkvz", "in_proj_ba", "conv1d", "norm")}
        w.update(_fp8_stand_ins(self._quantized(), dev))
        w["A_log"] = torch.zeros(16, dtype=_dt(self.a_log_dtype), device=dev)
        w["dt_bias"] = torch.zeros(16, dtype=_dt(self.dt_bias_dtype), device=dev)
        conv = torch.zeros(1, 3, 16, dtype=_dt(self.conv_dtype), device=dev)
        ssm = torch.zeros(1, 1, 1, 16, dtype=_dt(self.state_dtype), device=dev)
        slots = torch.zeros(16, dtype=torch.int32, device=dev)
        return self._args(one, None, w, conv, ssm, slots, one, one, ws, ctrl, health, 2, 0, 0, 1)

    def launch(self, hidden, residual, weights, conv_state, ssm_state, slots, o_in,
               residual_out, *, ws: K1Workspace, ctrl, health, null_slot: int | None = None,
               layer: int = 0, layers_per_step: int = 1, validate: bool = True) -> None:  # fmt: skip
        """One K1 for ``hidden.shape[0]`` rows. The caller bumps the epoch once per step."""
        self._launch((hidden, residual, weights, conv_state, ssm_state, slots, o_in,
                      residual_out), validate, ws, ctrl, health, null_slot=null_slot,
                     layer=layer, layers_per_step=layers_per_step)  # fmt: skip


@dataclass
class K1AttnLaunch(_K1LaunchBase):
    """Attention K1 of one build. RoPE reads a [max_positions, rotary_dim] fp32 cos/sin
    table built once here (positions are clamped into it). ``formats``: the ``qkv_proj``
    format (see :class:`_K1LaunchBase`)."""

    shape: K1AttnShape
    config: K1Config
    max_positions: int = 8192
    positions_dtype: str = "int64"
    co_resident: int = 1
    stages: int = STAGES_ALL
    formats: Mapping[str, str] = field(default_factory=dict)
    layout: Any = field(init=False)
    rope: Any = field(init=False, default=None)
    resources: Any = field(init=False, default=None)
    _built: bool = field(init=False, default=False)
    _cx: dict = field(init=False, default_factory=dict, repr=False)  # fixed by build()

    _KIND = "attention"
    _FRONT = "attn"
    _KERNEL = k1_attn_kernel
    _PROGRAM = staticmethod(k1_attn_program)
    _PLANES = ("qkv_proj",)
    # check()'s per-step arguments: hidden, residual, positions, q, k, v, gate, residual_out
    _LIVE_AT = (0, 1, 3, 4, 5, 6, 7, 8)

    def _refusals(self) -> list[str]:
        rows = self.shape.qkv_rows
        return [f"qkv rows {rows} are not a multiple of 16"] if rows % 16 else []

    def label(self) -> str:
        s = self.shape
        return (
            f"k1 attn h{s.hidden} hq{s.hq} hkv{s.hkv} d{s.head_dim} rd{s.rotary_dim} "
            f"{self._config_label()}{self._formats_label()}"
        )

    def _proj_rows(self) -> int:
        return self.shape.qkv_rows

    def _kind_constexprs(self) -> dict:
        s, lay = self.shape, self.layout
        return dict(
            HQ=s.hq,
            HKV=s.hkv,
            D=s.head_dim,
            RD=s.rotary_dim,
            OFF_QK=lay.offsets["qk"],
            RID_QK=lay.region_id("qk"),
            Q_QKV=self._q("qkv_proj"),
        )

    def check(self, hidden, residual, weights, positions, q, k, v, gate, residual_out) -> int:
        import torch

        s, bf = self.shape, torch.bfloat16
        qd, kvd = s.hq * s.head_dim, s.hkv * s.head_dim
        rows = {
            "positions": (positions, (), _dt(self.positions_dtype)),
            "q": (q, (qd,), bf),
            "gate": (gate, (qd,), bf),
            "k": (k, (kvd,), bf),
            "v": (v, (kvd,), bf),
        }
        params = {
            "qkv_proj": ((s.qkv_rows, s.hidden), bf),
            "q_norm": ((s.head_dim,), bf),
            "k_norm": ((s.head_dim,), bf),
        }
        return self._check(hidden, residual, residual_out, weights, rows, params)

    def _args(self, hidden, residual, weights, positions, q, k, v, gate, residual_out, ws,
              ctrl, health, n_rows, layer, layers_per_step):  # fmt: skip
        return (
            hidden, hidden if residual is None else residual, residual_out,
            *(weights[n] for n in ("input_layernorm", "qkv_proj", "q_norm", "k_norm")),
            self.rope, positions, q, k, v, gate,
            *_step_args(residual, ws, ctrl, health, n_rows, layer, layers_per_step),
            self.max_positions, float(self.shape.eps), self._scale_arg(weights, "qkv_proj"),
        )  # fmt: skip

    def build(self, device: Any = "cuda") -> None:
        """The cos/sin table to ``device``, then compile, load and residency-check (GPU)."""
        import torch

        self.rope = rope_table(self.shape, self.max_positions, torch.device(device))
        super().build(device)

    def _warmup_args(self, dev, one, ws, ctrl, health) -> tuple:
        import torch

        w = {k: one for k in ("input_layernorm", "qkv_proj", "q_norm", "k_norm")}
        w.update(_fp8_stand_ins(self._quantized(), dev))
        pos = torch.zeros(16, dtype=_dt(self.positions_dtype), device=dev)
        return self._args(one, None, w, pos, one, one, one, one, one, ws, ctrl, health, 2, 0, 1)

    def launch(self, hidden, residual, weights, positions, q, k, v, gate, residual_out, *,
               ws: K1Workspace, ctrl, health, layer: int = 0, layers_per_step: int = 1,
               validate: bool = True) -> None:  # fmt: skip
        self._launch((hidden, residual, weights, positions, q, k, v, gate, residual_out),
                     validate, ws, ctrl, health, layer=layer,
                     layers_per_step=layers_per_step)  # fmt: skip


@dataclass
class K1Launches:
    """The K1 half of ``models.qwen3_next.launches.LayerLaunches`` (``k1_gdn``, ``k1_attn``
    with the Protocol's signatures) over built :class:`K1GdnLaunch` / :class:`K1AttnLaunch`.

    A Triton ``LayerLaunches`` delegates its ``k1_*`` methods here; ``layer.index`` is the
    tag's layer id, ``layers_per_step`` the number of decoder layers. Each layer's launch is
    planned (every tensor checked, the argument table frozen) at its first launch, and again
    only when a step's tensors no longer fit the plan; ``validate`` also checks every tensor
    of every launch.
    """

    gdn: K1GdnLaunch | None
    attn: K1AttnLaunch | None
    gdn_ws: K1Workspace | None
    attn_ws: K1Workspace | None
    ctrl: Any
    health: Any
    layers_per_step: int
    null_slot: int | None = None
    validate: bool = False
    frozen: FrozenLaunches = field(default_factory=FrozenLaunches)

    def _run(self, kind: str, launch: Any, ws: Any, layer: Any, tensors: tuple, **step) -> None:
        if self.validate:
            launch.check(*tensors)
        values = launch.live_values(tensors)
        planned = self.frozen.get(
            (kind, layer.index, tensors[1] is None),
            layer,
            values,
            lambda: launch.plan(tensors, ws, self.ctrl, self.health, layer=layer.index,
                                layers_per_step=self.layers_per_step, **step),  # fmt: skip
        )
        planned.run(values)

    def k1_gdn(self, layer, hidden, residual, slots, *, o_in, residual_out) -> None:
        if self.gdn is None or self.gdn_ws is None:
            raise RuntimeError("K1Launches: no GDN build")
        self._run("gdn", self.gdn, self.gdn_ws, layer,
                  (hidden, residual, layer.weights, layer.conv_state, layer.ssm_state, slots,
                   o_in, residual_out), null_slot=self.null_slot)  # fmt: skip

    def k1_attn(self, layer, hidden, residual, positions, *, q, k, v, gate,
                residual_out) -> None:  # fmt: skip
        if self.attn is None or self.attn_ws is None:
            raise RuntimeError("K1Launches: no attention build")
        self._run("attn", self.attn, self.attn_ws, layer,
                  (hidden, residual, layer.weights, positions, q, k, v, gate,
                   residual_out))  # fmt: skip
