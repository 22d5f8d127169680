"""K1, the layer front, in FlyDSL for gfx950 (compile-only: nothing here has run on an MI355X;
numerics are unverified until the Buildkite MI355 step runs it).

Both fronts exist (the Triton K1's contracts). GDN front (:func:`mono_ext.models.qwen3_next.reference.gdn.
gdn_front`), build-time layouts ``packing`` (interleaved / contiguous), ``conv_layout`` (time_chan
[S, K-1, C] / chan_time [S, C, K-1]), ``ssm_layout`` (vk / kv), ``state_dtype``, ``dt_bias_dtype``;
tables ``wtab`` (``GDN_WEIGHT_ENTRIES``), ``rtab`` (scratch, xs, -, ctrl, health) and ``stab``
(conv state, its slot stride, ssm state, its slot stride; elements); ``slots`` int32 [W] (< 0
or == ``null_slot``: padding, no state read back or written, o_in row 0). Program: prologue
(add + norm, every CTA) -> ``proj_conv`` (in_proj_qkvz / in_proj_ba rows on MFMA; conv update
of the channel's cached window, SiLU; beta, g; tagged fp32 payload per row: conv channels,
z, beta, g) -> ``recurrence`` (one (row, value head) per CTA: bounded waits on its words,
l2-norm q / k, decay + delta-rule update of the [Dv, Dk] state in place, o = S q, gated
RMSNorm with SiLU(z) -> o_in).

Attention front (:func:`mono_ext.models.qwen3_next.reference.attention.attn_front`; the Triton K1's tensor
contract), one build per width ``W`` (a launch takes exactly ``W`` rows):

| name            | shape                  | dtype | layout                                  | writer           |
|-----------------|------------------------|-------|-----------------------------------------|------------------|
| hidden          | [W, H]                 | bf16  | contiguous rows                         | engine / K2      |
| residual        | [W, H] or none         | bf16  | ``has_residual`` = 0 on layer 0         | K2               |
| residual_out    | [W, H]                 | bf16  | bf16(hidden + residual) (fp32 add)      | CTA 0            |
| input_layernorm | [H]                    | bf16  | Gemma weight                            | engine (read)    |
| qkv_proj        | [(2Hq + 2Hkv) D, H]    | bf16  | per q head [q (D), gate (D)]; k; v      | engine (read)    |
| q_norm / k_norm | [D]                    | bf16  | Gemma weights                           | engine (read)    |
| positions       | [W]                    | int64 | 0-based, < the rope table's rows        | engine           |
| rope table      | [P, rd]                | fp32  | cos (rd/2) then sin (rd/2) per position | host, at build   |
| q / gate        | [W, Hq*D]              | bf16  | normed + RoPE'd q / pre-sigmoid gate    | this launch      |
| k / v           | [W, Hkv*D]             | bf16  | normed + RoPE'd k / v                   | this launch      |
| scratch: qk     | [W][(Hq + Hkv) D] words| int64 | tagged fp32 raw q, k                    | proj -> norm_rope|
| priv xs         | [G][W][H]              | bf16  | this CTA's normed rows (MFMA operand)   | prologue         |
| wtab            | [4]                    | int64 | input_layernorm, qkv_proj, q_norm,      | host, at bind    |
|                 |                        |       | k_norm                                  |                  |
| rtab            | [5]                    | int64 | scratch, xs, rope table, ctrl, health   | host, at bind    |

Prologue (every CTA, redundant: no hand-off): add + Gemma norm of the W rows into its xs.
``qkv_proj``: 64-row tiles over the grid on MFMA (16 rows x 16 batch columns per wave);
gate and v go straight to their outputs, raw q and k into ``qk`` as tagged fp32. ``norm_rope``:
one (row, head) per wave: bounded waits on the head's words, Gemma norm, neox RoPE on the
first ``rd`` dims. The program is checked by ``runtime.layout`` at build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mono_ext.kernels.flydsl.limits import GFX950, MAX_WIDTH
from mono_ext.models.qwen3_next.flydsl.k2 import (
    _compile,
    _raise_launch,
    launch_reasons,
    runtime_table,
)
from mono_ext.models.qwen3_next.shapes import AttnFrontShape, GdnFrontShape
from mono_ext.runtime.layout import Layout, Program, Region, Stage, plan_layout, wait, write

__all__ = [
    "K1AttnBuild",
    "K1AttnShape",
    "K1GdnBuild",
    "K1GdnShape",
    "QWEN3_NEXT_80B_ATTN",
    "QWEN3_NEXT_80B_GDN",
    "build_k1_attn",
    "build_k1_gdn",
    "k1_attn_program",
    "k1_gdn_program",
    "rope_table",
]


@dataclass(frozen=True)
class K1AttnShape(AttnFrontShape):
    """The attention front's sizes (:class:`~mono_ext.models.qwen3_next.shapes.AttnFrontShape`)
    with the FlyDSL K1's own limits."""

    def refusals(self) -> list[str]:
        bad = super().refusals()
        d = self.head_dim
        if d < 64 or d % 64:
            bad.append(f"head_dim={d}: the FlyDSL K1 spreads a head over a wave (multiple of 64)")
        if self.hidden % 64:
            bad.append(f"hidden={self.hidden} is not a multiple of 64")
        return bad


#: Qwen3-Next-80B-A3B attention layer, TP 1 (16 q heads with gates, 2 kv heads, D 256, rd 64).
QWEN3_NEXT_80B_ATTN = K1AttnShape(
    hidden=2048, hq=16, hkv=2, head_dim=256, rotary_dim=64, rope_theta=10_000_000.0, eps=1e-6
)


def k1_attn_program(shape: K1AttnShape, width: int) -> Program:
    words = width * (shape.hq + shape.hkv) * shape.head_dim
    return Program(
        "k1_attn",
        (Region("qk", words),),
        (Stage("qkv_proj", [write("qk")]), Stage("norm_rope", [wait("qk")])),
    )


WEIGHT_ENTRIES = ("input_layernorm", "qkv_proj", "q_norm", "k_norm")
RT_ENTRIES = ("scratch", "xs", "rope", "ctrl", "health")
N_PTR_ARGS = 10  # hidden, residual, residual_out, positions, q, gate, k, v, wtab, rtab


@dataclass
class K1AttnBuild:
    shape: K1AttnShape
    width: int
    grid: int = GFX950.cus

    def __post_init__(self) -> None:
        self.shape.validate()
        if not 1 <= self.width <= MAX_WIDTH:
            raise ValueError(f"width {self.width}: widths 1..{MAX_WIDTH} only")
        self.layout: Layout = plan_layout(k1_attn_program(self.shape, self.width))

    def label(self) -> str:
        return f"k1 attn w{self.width} grid{self.grid}"

    @property
    def xs_bytes(self) -> int:
        return self.grid * self.width * self.shape.hidden * 2

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.shape
        return {
            "input_layernorm": (s.hidden,),
            "qkv_proj": (s.qkv_rows, s.hidden),
            "q_norm": (s.head_dim,),
            "k_norm": (s.head_dim,),
        }

    def check(self, hidden, residual, residual_out, positions, q, gate, k, v, weights):
        """Every reason the tensors do not fit this build (empty: they do)."""
        import torch

        from mono_ext.models.qwen3_next.flydsl.k2 import _tensor_reasons

        s, w = self.shape, self.width
        want = {
            "hidden": (hidden, (w, s.hidden)),
            "residual_out": (residual_out, (w, s.hidden)),
            "q": (q, (w, s.hq * s.head_dim)),
            "gate": (gate, (w, s.hq * s.head_dim)),
            "k": (k, (w, s.hkv * s.head_dim)),
            "v": (v, (w, s.hkv * s.head_dim)),
        }
        if residual is not None:
            want["residual"] = (residual, (w, s.hidden))
        bad = []
        for name, shp in self.weight_shapes().items():
            t = weights.get(name)
            if t is None:
                bad.append(f"missing weight {name!r}")
            else:
                want[name] = (t, shp)
        for name, (t, shp) in want.items():
            bad += _tensor_reasons(name, t, shp)
        if positions.dtype != torch.int64 or tuple(positions.shape) != (w,):
            bad.append(f"positions must be int64 [{w}]")
        return bad

    def runtime_table(self, *, scratch, xs, rope, ctrl, health) -> list[int]:
        """``rtab`` (``RT_ENTRIES``): scratch, xs, the RoPE table, ctrl, health."""
        import torch

        rd = self.shape.rotary_dim
        ok = rope.dtype == torch.float32 and rope.dim() == 2 and rope.shape[1] == rd
        bad = [] if ok and rope.is_contiguous() else [f"rope must be contiguous fp32 [P, {rd}]"]
        return runtime_table(self, bad, scratch, xs, rope, ctrl, health)

    def args(self, hidden, residual, residual_out, positions, q, gate, k, v, *, wtab, rtab,
             layer: int, layers_per_step: int) -> tuple:  # fmt: skip
        """The launch's arguments (``_k1_device.k1_attn_launch``); tensors are checked by
        :meth:`check`, the tables and layer ints here."""
        tables = {"wtab": (wtab, len(WEIGHT_ENTRIES)), "rtab": (rtab, len(RT_ENTRIES))}
        _raise_launch(self, launch_reasons(tables, layer, layers_per_step))
        rest = (residual_out, positions, q, gate, k, v, wtab, rtab)
        return _k1_args(hidden, residual, rest, (layer, layers_per_step))

    def compile(self, load: bool = False):
        """Compile for gfx950 (``load``: and load onto the current gfx950 device)."""
        from mono_ext.models.qwen3_next.flydsl._k1_device import k1_attn_launch

        return _compile(self, k1_attn_launch(self), N_PTR_ARGS, (1, 0, 1), load)


def _k1_args(hidden, residual, rest: tuple, ints: tuple) -> tuple:
    """hidden, residual (hidden's address on the first layer: ``has_residual`` 0, never
    read), the other addresses, ``has_residual``, then ``ints``."""
    ptrs = (hidden, hidden if residual is None else residual, *rest)
    return tuple(t.data_ptr() for t in ptrs) + (int(residual is not None), *ints)


def rope_table(rotary_dim: int, theta: float, max_positions: int, device: Any = "cpu") -> Any:
    """The attention front's RoPE table: [max_positions, rotary_dim] fp32, cos (rd/2) then
    sin (rd/2) per position, from the reference's frequencies."""
    import torch

    from mono_ext.models.qwen3_next.reference.attention import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(max_positions, device=device), rotary_dim, theta)
    return torch.cat([cos, sin], dim=-1).contiguous()


def build_k1_attn(width: int, shape: K1AttnShape | None = None, grid: int = GFX950.cus):
    """Compile one attention-front key offline for gfx950 (checked ``Compiled``)."""
    return K1AttnBuild(shape or QWEN3_NEXT_80B_ATTN, width, grid).compile()


# -- GDN front -------------------------------------------------------------------------------


@dataclass(frozen=True)
class K1GdnShape(GdnFrontShape):
    """The GDN front's sizes (:class:`~mono_ext.models.qwen3_next.shapes.GdnFrontShape`)
    with the FlyDSL K1's own limits."""

    def refusals(self) -> list[str]:
        from mono_ext.kernels.flydsl.limits import BLOCK

        bad = super().refusals()
        if self.dv < 1 or BLOCK % self.dv or self.dk % (BLOCK // self.dv):
            bad.append(f"dv={self.dv}, dk={self.dk}: a state tile is spread over {BLOCK} threads")
        if self.hidden % 64:
            bad.append(f"hidden={self.hidden} is not a multiple of 64")
        if self.conv_k < 2:
            bad.append(f"conv_k={self.conv_k} < 2")
        return bad


#: Qwen3-Next-80B-A3B GDN layer, TP 1.
QWEN3_NEXT_80B_GDN = K1GdnShape(hidden=2048, hk=16, hv=32, dk=128, dv=128, conv_k=4, eps=1e-6)

GDN_WEIGHT_ENTRIES = ("input_layernorm", "in_proj_qkvz", "in_proj_ba", "conv1d", "A_log",
                      "dt_bias", "norm")  # fmt: skip
GDN_STATE_ENTRIES = ("conv_state", "conv slot stride", "ssm_state", "ssm slot stride")
GDN_N_PTR_ARGS = 8  # hidden, residual, residual_out, slots, o_in, wtab, rtab, stab


def k1_gdn_program(shape: K1GdnShape, width: int) -> Program:
    return Program(
        "k1_gdn",
        (Region("proj", width * shape.payload_words),),
        (Stage("proj_conv", [write("proj")]), Stage("recurrence", [wait("proj")])),
    )


@dataclass
class K1GdnBuild:
    """One GDN-front build key; the layouts are compiled in."""

    shape: K1GdnShape
    width: int
    packing: str = "interleaved"
    conv_layout: str = "time_chan"
    ssm_layout: str = "vk"
    state_dtype: str = "float32"
    dt_bias_dtype: str = "bfloat16"
    grid: int = GFX950.cus

    def __post_init__(self) -> None:
        bad = self.shape.refusals()
        for name, allowed in (("packing", ("interleaved", "contiguous")),
                              ("conv_layout", ("time_chan", "chan_time")),
                              ("ssm_layout", ("vk", "kv")),
                              ("state_dtype", ("float32", "bfloat16")),
                              ("dt_bias_dtype", ("float32", "bfloat16"))):  # fmt: skip
            if getattr(self, name) not in allowed:
                bad.append(f"{name}={getattr(self, name)!r} not in {allowed}")
        if not 1 <= self.width <= MAX_WIDTH:
            bad.append(f"width {self.width}: widths 1..{MAX_WIDTH} only")
        if bad:
            raise ValueError("K1 GDN build refused: " + "; ".join(bad))
        self.layout: Layout = plan_layout(k1_gdn_program(self.shape, self.width))

    def label(self) -> str:
        return (f"k1 gdn w{self.width} {self.packing}/{self.conv_layout}/{self.ssm_layout}/"
                f"{self.state_dtype} grid{self.grid}")  # fmt: skip

    @property
    def xs_bytes(self) -> int:
        return self.grid * self.width * self.shape.hidden * 2

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.shape
        return {
            "input_layernorm": (s.hidden,),
            "in_proj_qkvz": (s.qkvz_rows, s.hidden),
            "in_proj_ba": (2 * s.hv, s.hidden),
            "conv1d": (s.conv_dim, s.conv_k),
            "A_log": (s.hv,),
            "dt_bias": (s.hv,),
            "norm": (s.dv,),
        }

    def check(self, hidden, residual, residual_out, slots, o_in, weights) -> list[str]:
        """Every reason the tensors do not fit this build (empty: they do)."""
        import torch

        from mono_ext.models.qwen3_next.flydsl.k2 import _tensor_reasons

        s, w = self.shape, self.width
        want = {
            "hidden": (hidden, (w, s.hidden)),
            "residual_out": (residual_out, (w, s.hidden)),
            "o_in": (o_in, (w, s.hv * s.dv)),
        }
        if residual is not None:
            want["residual"] = (residual, (w, s.hidden))
        bad = []
        dtypes = {"A_log": torch.float32, "dt_bias": getattr(torch, self.dt_bias_dtype)}
        for name, shp in self.weight_shapes().items():
            t = weights.get(name)
            if t is None:
                bad.append(f"missing weight {name!r}")
            elif name == "conv1d":
                if t.numel() != s.conv_dim * s.conv_k or t.shape[0] != s.conv_dim:
                    bad.append(f"conv1d is {tuple(t.shape)}, expected {shp} or [C, 1, K]")
                if t.dtype != torch.bfloat16 or not t.is_contiguous():
                    bad.append("conv1d must be contiguous bfloat16")
            elif name in dtypes:
                if tuple(t.shape) != shp or t.dtype != dtypes[name]:
                    bad.append(f"{name} must be {dtypes[name]} {shp}")
            else:
                want[name] = (t, shp)
        for name, (t, shp) in want.items():
            bad += _tensor_reasons(name, t, shp)
        if slots.dtype != torch.int32 or tuple(slots.shape) != (w,):
            bad.append(f"slots must be int32 [{w}]")
        return bad

    def state_table(self, conv_state, ssm_state) -> list[int]:
        """``stab``: the states' addresses and slot strides (elements), checked."""
        import torch

        s = self.shape
        bad = []
        if conv_state.dtype != torch.bfloat16:
            bad.append(f"conv_state is {conv_state.dtype}, expected bfloat16")
        if conv_state.dim() != 3:
            bad.append("conv_state must be [slots, ., .]")
        else:
            want = (s.conv_k - 1, s.conv_dim)
            if self.conv_layout == "chan_time":
                want = want[::-1]
            inner = conv_state.stride()[1:]
            if tuple(conv_state.shape[1:]) != want or inner != (want[1], 1):
                bad.append(f"conv_state slots must be contiguous {want} ({self.conv_layout})")
        sdt = torch.float32 if self.state_dtype == "float32" else torch.bfloat16
        if ssm_state.dtype != sdt:
            bad.append(f"ssm_state is {ssm_state.dtype}, expected {sdt}")
        per_slot = s.hv * s.dv * s.dk
        if ssm_state[0].numel() != per_slot or not ssm_state[0].is_contiguous():
            bad.append(f"ssm_state slots must be contiguous {per_slot} elements")
        if bad:
            raise ValueError(f"{self.label()}: " + "; ".join(bad))
        return [conv_state.data_ptr(), conv_state.stride(0), ssm_state.data_ptr(),
                ssm_state.stride(0)]  # fmt: skip

    def runtime_table(self, *, scratch, xs, ctrl, health) -> list[int]:
        """``rtab``: scratch, xs, an unused entry, ctrl, health."""
        return runtime_table(self, [], scratch, xs, ctrl, ctrl, health)

    def args(self, hidden, residual, residual_out, slots, o_in, *, wtab, rtab, stab,
             null_slot: int | None, layer: int, layers_per_step: int) -> tuple:  # fmt: skip
        """The launch's arguments (``_k1_device.k1_gdn_launch``); ``null_slot`` None: only
        negative slots are padding."""
        tables = {"wtab": (wtab, len(GDN_WEIGHT_ENTRIES)), "rtab": (rtab, len(RT_ENTRIES)),
                  "stab": (stab, len(GDN_STATE_ENTRIES))}  # fmt: skip
        _raise_launch(self, launch_reasons(tables, layer, layers_per_step))
        null = -1 if null_slot is None else null_slot
        rest = (residual_out, slots, o_in, wtab, rtab, stab)
        return _k1_args(hidden, residual, rest, (null, layer, layers_per_step))

    def compile(self, load: bool = False):
        """Compile for gfx950 (``load``: and load onto the current gfx950 device)."""
        from mono_ext.models.qwen3_next.flydsl._k1_device import k1_gdn_launch

        return _compile(self, k1_gdn_launch(self), GDN_N_PTR_ARGS, (1, 0, 0, 1), load)


def build_k1_gdn(width: int, shape: K1GdnShape | None = None, grid: int = GFX950.cus, **layouts):
    """Compile one GDN-front key offline for gfx950 (checked ``Compiled``)."""
    return K1GdnBuild(shape or QWEN3_NEXT_80B_GDN, width, grid=grid, **layouts).compile()
