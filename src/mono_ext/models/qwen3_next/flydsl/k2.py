"""K2, the layer tail, in FlyDSL for gfx950: one persistent launch per layer per decode step.

``out_proj``/``o_proj`` -> TP all-reduce -> residual add + post-attention Gemma RMSNorm ->
router softmax top-k (renormalised when the model says so) -> shared expert (sigmoid-gated)
and routed experts (gate_up, SiLU * up, down, weighted) -> MoE TP all-reduce. Semantics:
:func:`mono_ext.models.qwen3_next.reference.tail.layer_tail`; the tensor contract (inputs, outputs, weight
planes) is the Triton K2's (``models/qwen3_next/triton/k2.py``). **Compiled for gfx950 offline only:
nothing here has run on an MI355X; its numerics are unverified until the Buildkite MI355
step runs it.**

One build per (layer kind, width ``W`` = rows, TP): every size is a compile-time constant, a
launch takes exactly ``W`` rows (the step's padded batch). Scratch (int64 tagged words,
``runtime.layout``), ``Pr = W * top_k`` routed pairs, ``IW = max(I_r, Is_r) / 2``:

| name            | shape                  | dtype | layout                                  | writer           |
|-----------------|------------------------|-------|-----------------------------------------|------------------|
| o_in, gate      | [W, in_r]              | bf16  | as the Triton K2 (gate: gated builds)   | K1 / attention   |
| residual        | [W, H]                 | bf16  | contiguous                              | K1               |
| out_residual    | [W, H]                 | bf16  | residual + o_proj(o_in)                 | stage residual   |
| out_hidden      | [W, H]                 | bf16  | MoE output incl. the shared expert      | down / moe_out   |
| weights         | as the Triton K2       | bf16  | engine planes, read in place            | engine           |
| p1              | [ks1][W][H] words      | int64 | tagged fp32 out_proj partials (peer at  | out_proj         |
|                 |                        |       | TP > 1: every rank's slot on every rank)|                  |
| resid           | [W][H] words           | int64 | tagged fp32 residual_out                | residual         |
| logits          | [W][E] words           | int64 | tagged fp32 router logits               | norm_router      |
| act             | [Pr + W][IW] words     | int64 | tagged bf16x2 weight * SiLU(g) * u per  | topk_gate_up     |
|                 |                        |       | (row, pick) pair; shared expert at Pr+b |                  |
| ids             | [Pr] words             | int64 | tagged expert id of each pair           | topk_gate_up     |
| p4              | [W][H] words (TP > 1)  | int64 | tagged fp32 MoE partials (peer)         | down             |
| priv xs         | [G][W][H] fp32, then   |       | this CTA's normed rows (fp32 for the    | norm_router,     |
|                 | [G][W][H] bf16         |       | router/experts, bf16 for the MFMA)      | same CTA         |
| wtab            | [8]                    | int64 | addresses of the layer's weight planes  | host, at bind    |
| rtab            | [5]                    | int64 | scratch, xs, peer table, ctrl, health   | host, at bind    |

The launch takes the five activation addresses, ``wtab``, ``rtab``, ``layer`` and
``layers_per_step`` by value; each stage loads the table entries it needs (long-lived 64-bit
kernel arguments otherwise hold SGPRs for the whole launch, and the widths spilled them).

Work split: out_proj and the shared expert's gate_up run on MFMA (``v_mfma_f32_16x16x16
bf16``: 16 weight rows x 16 batch columns per wave, columns >= W zero); the router, routed
experts and down projections are wave-wide dot products (8 bf16 per lane per load, fp32
accumulate, xor-shuffle reduction). Every CTA normalises all rows (redundantly, bit-equal);
each routed gate_up task re-derives its row's top-k from the tagged logits (block-wide
argmax; ties go to the lower expert id). Stages hand off only through tagged words; every
wait is bounded (``primitives.wait_tagged``). No grid barrier.
"""

from __future__ import annotations

from dataclasses import dataclass

from mono_ext.kernels.flydsl.limits import GFX950, MAX_WIDTH, WAVES
from mono_ext.models.qwen3_next.shapes import TailShape
from mono_ext.runtime.layout import Layout, Program, Region, Stage, plan_layout, push, wait, write

__all__ = [
    "K2Build",
    "K2Shape",
    "k2_program",
    "build_k2",
    "QWEN3_NEXT_80B",
    "RT_ENTRIES",
    "WEIGHT_ENTRIES",
]

ROWS_PER_CTA = 16 * WAVES  # MFMA rows per CTA task (16 per wave)


@dataclass(frozen=True)
class K2Shape(TailShape):
    """Per-rank sizes one K2 build is compiled for (fields, ``from_dims`` and the shared limits:
    :class:`~mono_ext.models.qwen3_next.shapes.TailShape`), with this kernel's own limits."""

    def refusals(self) -> list[str]:
        bad = super().refusals()
        if self.hidden % ROWS_PER_CTA:
            bad.append(f"hidden={self.hidden} is not a multiple of {ROWS_PER_CTA}")
        if self.in_dim % 16:
            bad.append(f"in_dim={self.in_dim} is not a multiple of 16 (MFMA K)")
        for name in ("moe_inter", "shared_inter"):
            if getattr(self, name) < 1 or getattr(self, name) % ROWS_PER_CTA:
                bad.append(f"{name}={getattr(self, name)} is not a positive multiple of 64")
        if self.hidden % 8:
            bad.append(f"hidden={self.hidden} is not a multiple of 8 (16-byte loads)")
        return bad

    @property
    def pairs_per_row(self) -> int:
        return self.top_k

    @property
    def act_words(self) -> int:
        return max(self.moe_inter, self.shared_inter) // 2


#: Qwen3-Next-80B-A3B per-rank sizes at TP 1 (the shape CI compiles every width for).
QWEN3_NEXT_80B = {
    "gdn": K2Shape(2048, 32 * 128, 512, 10, 512, 512, True, 1e-6),
    "attn": K2Shape(2048, 16 * 256, 512, 10, 512, 512, True, 1e-6),
}


def ks1_of(shape: K2Shape, grid: int) -> int:
    """out_proj K splits: about one task per CTA (a power of two dividing in_dim / 16)."""
    blocks = shape.hidden // ROWS_PER_CTA
    ks = 1
    while ks * 2 * blocks <= grid and (shape.in_dim // 16) % (ks * 2) == 0:
        ks *= 2
    return ks


def k2_program(shape: K2Shape, width: int, grid: int = GFX950.cus) -> Program:
    """K2's regions and stages, checked by ``runtime.layout.check_handoffs`` at build."""
    h, w = shape.hidden, width
    peer = shape.tp > 1
    pr = w * shape.top_k
    regions = [
        Region("p1", ks1_of(shape, grid) * w * h, peer=peer),
        Region("resid", w * h),
        Region("logits", w * shape.experts),
        Region("act", (pr + w) * shape.act_words),
        Region("ids", pr),
    ]
    if peer:
        regions.append(Region("p4", w * h, peer=True))
    stages = [
        Stage("out_proj", [push("p1") if peer else write("p1")]),
        Stage("residual", [wait("p1"), write("resid")]),
        Stage("norm_router", [wait("resid"), write("logits")]),
        Stage("topk_gate_up", [wait("logits"), write("act"), write("ids")]),
        Stage("down", [wait("act"), wait("ids")] + ([push("p4")] if peer else [])),
    ]
    if peer:
        stages.append(Stage("moe_out", [wait("p4")]))
    return Program("k2", tuple(regions), tuple(stages))


@dataclass
class K2Build:
    """One K2 build key: (kind, width, shape); ``layout`` is checked at construction."""

    shape: K2Shape
    width: int
    kind: str = "gdn"
    grid: int = GFX950.cus
    system: bool = True  # system-scope peer stores (a peer may be another GPU over XGMI)

    def __post_init__(self) -> None:
        self.shape.validate()
        if self.kind not in ("gdn", "attn"):
            raise ValueError(f"kind must be 'gdn' or 'attn', got {self.kind!r}")
        if not 1 <= self.width <= MAX_WIDTH:
            raise ValueError(f"width {self.width}: widths 1..{MAX_WIDTH} only")
        self.layout: Layout = plan_layout(k2_program(self.shape, self.width, self.grid),
                                          self.shape.tp)  # fmt: skip

    @property
    def out_proj_splits(self) -> int:
        """K splits of out_proj (the device code's ``KS1``)."""
        return ks1_of(self.shape, self.grid)

    @property
    def gated(self) -> bool:
        """Attention builds form bf16(o_in * sigmoid(gate)) as they load (as the Triton one)."""
        return self.kind == "attn"

    def label(self) -> str:
        return f"k2 {self.kind} w{self.width} tp{self.shape.tp} grid{self.grid}"

    @property
    def xs_bytes(self) -> int:
        """Size of the per-CTA private rows buffer (fp32 rows, then bf16 rows)."""
        return self.grid * self.width * self.shape.hidden * 6

    # -- host-side checks (torch tensors; no device needed) ------------------------------
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.shape.weight_shapes(self.kind)

    def check(self, o_in, residual, weights, out_hidden, out_residual, gate=None) -> list[str]:
        """Every reason the tensors do not fit this build (empty: they do)."""

        acts, bad = self.shape.launch_tensors(self.kind, self.gated, self.width, o_in, residual,
                                              weights, out_hidden, out_residual, gate)  # fmt: skip
        for name, (t, shp) in acts.items():
            bad += _tensor_reasons(name, t, shp)
        return bad

    def weight_table(self, weights) -> list[int]:
        """The layer's weight table (``WEIGHT_ENTRIES`` byte addresses, in that order): the
        caller copies it into a device int64 tensor once per layer at bind (weights do not
        move), and passes that tensor as ``wtab``."""
        bad = []
        for name, shp in self.weight_shapes().items():
            t = weights.get(name)
            if t is None:
                bad.append(f"missing weight {name!r}")
            else:
                bad += _tensor_reasons(name, t, shp)
        _raise_launch(self, bad)
        return [weights[k].data_ptr() for k in self.weight_shapes()]

    def runtime_table(self, *, scratch, xs, ctrl, health, peers=None) -> list[int]:
        """The rank's runtime table (``RT_ENTRIES``): scratch, xs, peer table, ctrl, health."""
        bad = []
        if self.shape.tp > 1 and peers is None:
            bad.append(f"TP {self.shape.tp} needs the peer table")
        peer = peers if peers is not None else ctrl  # never read at TP 1
        return runtime_table(self, bad, scratch, xs, peer, ctrl, health)

    def args(
        self,
        o_in,
        residual,
        out_hidden,
        out_residual,
        *,
        wtab,
        rtab,
        layer: int = 0,
        layers_per_step: int = 1,
        gate=None,
    ) -> tuple:
        """The launch's arguments: activation addresses, the two tables, layer ints."""  # fmt: skip
        s, w = self.shape, self.width
        acts = {
            "o_in": (o_in, (w, s.in_dim)),
            "residual": (residual, (w, s.hidden)),
            "out_hidden": (out_hidden, (w, s.hidden)),
            "out_residual": (out_residual, (w, s.hidden)),
        }
        bad = []
        if self.gated != (gate is not None):
            bad.append("gate must be given exactly for gated (attention) builds")
        elif gate is not None:
            acts["gate"] = (gate, (w, s.in_dim))
        for name, (t, shp) in acts.items():
            bad += _tensor_reasons(name, t, shp)
        tables = {"wtab": (wtab, len(WEIGHT_ENTRIES)), "rtab": (rtab, len(RT_ENTRIES))}
        _raise_launch(self, bad + launch_reasons(tables, layer, layers_per_step))
        ptr = [o_in, gate if gate is not None else o_in, residual, out_hidden, out_residual,
               wtab, rtab]  # fmt: skip
        return tuple(t.data_ptr() for t in ptr) + (layer, layers_per_step)

    def compile(self, load: bool = False):
        """Compile this key for gfx950 (``load``: and load it onto the current device, a
        gfx950 GPU); the :class:`~mono_ext.kernels.flydsl.toolchain.Compiled`, with ``.build``."""
        from mono_ext.models.qwen3_next.flydsl._k2_device import k2_launch

        return _compile(self, k2_launch(self), N_PTR_ARGS, (0, 1), load)


def _compile(build, launch, n_ptr: int, ints: tuple, load: bool):
    """Compile one K1/K2 build: ``n_ptr`` address placeholders, then ``ints``."""
    import flydsl.expr as fx

    from mono_ext.kernels.flydsl.toolchain import compile_offline

    args = tuple(fx.Int64(0) for _ in range(n_ptr)) + ints
    c = compile_offline(launch, args, label=build.label(), grid=build.grid, load=load)
    c.build = build  # type: ignore[attr-defined]
    return c


def launch_reasons(tables: dict, layer: int, layers_per_step: int) -> list[str]:
    """What is wrong with a launch's tables (name -> (tensor, entries)) and layer ints."""
    import torch

    bad = []
    for name, (t, n) in tables.items():
        if t.dtype != torch.int64 or t.numel() != n:
            bad.append(f"{name} must be {n} int64 addresses")
    if not 0 <= layer < layers_per_step:
        bad.append(f"layer {layer} outside [0, {layers_per_step})")
    return bad


def _raise_launch(build, bad: list[str]) -> None:
    if bad:
        raise ValueError(f"{build.label()}: " + "; ".join(bad))


def runtime_table(build, bad: list[str], scratch, xs, third, ctrl, health) -> list[int]:
    """A K1/K2 runtime table (scratch, xs, ``third``, ctrl, health), checked against the
    build's scratch words and xs bytes; ``bad``: the caller's own reasons so far."""
    if scratch.numel() * scratch.element_size() < 8 * build.layout.scratch_words:
        bad.append(f"scratch holds fewer than {build.layout.scratch_words} int64 words")
    if xs.numel() * xs.element_size() < build.xs_bytes:
        bad.append(f"xs holds fewer than {build.xs_bytes} bytes")
    _raise_launch(build, bad)
    return [t.data_ptr() for t in (scratch, xs, third, ctrl, health)]


def _tensor_reasons(name, t, shp) -> list[str]:
    import torch

    bad = []
    if tuple(t.shape) != shp:
        bad.append(f"{name} is {tuple(t.shape)}, expected {shp}")
    if t.dtype != torch.bfloat16:
        bad.append(f"{name} is {t.dtype}, expected bfloat16")
    if not t.is_contiguous():
        bad.append(f"{name} is not contiguous")
    if t.data_ptr() % 16:
        bad.append(f"{name} is not 16-byte aligned")
    return bad


#: Order of the weight table (``wtab``) and the runtime table (``rtab``).
WEIGHT_ENTRIES = ("out_proj|o_proj", "post_attention_layernorm", "router", "w13", "w2",
                  "shared_gate_up", "shared_down", "shared_expert_gate")  # fmt: skip
RT_ENTRIES = ("scratch", "xs", "peers", "ctrl", "health")
N_PTR_ARGS = 7  # pointers of :meth:`K2Build.args`, then layer and layers_per_step


def build_k2(kind: str, width: int, shape: K2Shape | None = None, grid: int = GFX950.cus):
    """Compile one K2 build key offline for gfx950; returns the checked
    :class:`~mono_ext.kernels.flydsl.toolchain.Compiled` (with ``.build``)."""
    return K2Build(shape or QWEN3_NEXT_80B[kind], width, kind, grid).compile()
