"""K2, the layer tail, as one persistent Triton launch per layer per decode step (bf16).

``out_proj``/``o_proj`` -> TP all-reduce -> residual add + post-attention Gemma RMSNorm ->
router GEMV + softmax top-k (renormalised) -> shared expert and the union of picked routed
experts (gate_up, SiLU * up, down, weighted) -> MoE TP all-reduce. Semantics:
:func:`mono_ext.models.qwen3_next.reference.tail.layer_tail` (the fp32 oracle). Weights are read in place.

Tensor contract (one set per rank; ``Bb = BLOCK_B`` = 16 rows, ``B <= Bb`` live rows,
``G`` = grid, ``Um = min(E, Bb * top_k)`` routed slots, ``Pm = Bb * top_k`` routed pairs,
``IW = ceil(max(I_r, Is_r) / 2)`` words per activation row):

| name            | shape                 | dtype | layout                                 | writer               |
|-----------------|-----------------------|-------|----------------------------------------|----------------------|
| o_in            | [B, in_r]             | bf16  | contiguous rows (GDN: Hv*Dv/tp; attn:  | K1 / engine attention|
|                 |                       |       | Hq*D/tp, already * sigmoid(gate) unless|                      |
|                 |                       |       | the build is ``gated``)                |                      |
| gate            | [B, in_r]             | bf16  | ``gated`` builds only: the pre-sigmoid | K1 (attention)       |
|                 |                       |       | output gate; S1 reads bf16(o_in *      |                      |
|                 |                       |       | sigmoid(gate)) (fp32 math, one round)  |                      |
| residual        | [B, H]                | bf16  | contiguous rows                        | K1 (residual_out)    |
| out_hidden      | [B, H]                | bf16  | contiguous; MoE out incl. shared expert| this launch (S4)     |
| out_residual    | [B, H]                | bf16  | contiguous; residual + o_proj(o_in)    | this launch (S1)     |
| out_proj/o_proj | [H, in_r]             | bf16  | row-parallel shard (engine's plane)    | engine (read only)   |
| post_attention_ | [H]                   | bf16  | Gemma weight (``x * (1 + w)``)         | engine (read only)   |
| layernorm       |                       |       |                                        |                      |
| router          | [E, H]                | bf16  | replicated                             | engine (read only)   |
| w13             | [E, 2*I_r, H]         | bf16  | FusedMoE: gate rows then up rows,      | engine (read only)   |
|                 |                       |       | column-parallel over I                 |                      |
| w2              | [E, H, I_r]           | bf16  | FusedMoE, row-parallel over I          | engine (read only)   |
| shared_gate_up  | [2*Is_r, H]           | bf16  | gate rows then up rows                 | engine (read only)   |
| shared_down     | [H, Is_r]             | bf16  | row-parallel                           | engine (read only)   |
| shared_expert_  | [1, H]                | bf16  | replicated                             | engine (read only)   |
| gate            |                       |       |                                        |                      |
| scratch: nsum   | [H / cols][Bb][2]     | int64 | tagged fp32 per (reduce column block,  | S1 (reduce) -> S2    |
|                 | words                 |       | row): sum of r^2, sum of u * shared_   |                      |
|                 |                       |       | expert_gate (u = r * (1 + w))          |                      |
| scratch: logits | [KS][Bb][E] words     | int64 | tagged fp32 partial router logits,     | S2 -> S3             |
|                 |                       |       | one K-split each, summed in ks order   |                      |
| scratch: picks  | [Bb][2][top_k] words  | int64 | tagged: a row's expert ids by rank,    | S3 top-k -> S3 union |
|                 |                       |       | then their weights (fp32 bits)         |                      |
| scratch: act    | [Pm + Bb][IW] words   | int64 | tagged bf16x2 weighted SiLU(g)*u per   | S3 -> S4             |
|                 |                       |       | (row, pick) pair; shared at Pm + row   |                      |
| peer: ar1       | [2][tp][Bb * H] words | int64 | tagged fp32 out_proj partials          | S1 push (tp > 1)     |
| peer: ar2       | [2][tp][Bb * H] words | int64 | tagged fp32 MoE partials               | S4 push (tp > 1)     |
| priv xs         | [G + 2, 2, Bb, H]     | bf16  | xs[G]: every row's u, bf16(u) and      | S1 (reduce) -> all,  |
|                 |                       |       | bf16(u - bf16(u)), shared (behind the  | behind nsum          |
|                 |                       |       | nsum words); xs[G + 1] plane 0: the    | S3 top-k -> S3       |
|                 |                       |       | rows' e4m3 codes + scales per K chunk  | gate_up (a8)         |
|                 |                       |       | (a8); xs[p]: CTA p's down run's e4m3   | S4, same CTA (a8)    |
|                 |                       |       | activations (a8)                       |                      |
| priv wsc        | [G, Um + 2, Bb]       | fp32  | routing weight per (slot, row); slot   | S2/S3, same CTA      |
|                 |                       |       | Um holds sigmoid(shared_expert_gate.x),|                      |
|                 |                       |       | slot Um + 1 each row's rsqrt           |                      |
| priv ppos       | [G, Um + 1, Bb]       | int32 | pair row of (slot, row) in act, or -1  | S3, same CTA         |
| priv meta       | [G, META]             | int32 | union list (Um), then U and n_pairs    | S3, same CTA         |
| priv eslot      | [G, 2 * EP +          | int32 | per expert: its union slot, then its   | S3 union, same CTA   |
|                 | Bb * 2 * top_k]       |       | picked flag (EP = next pow2 of E);     |                      |
|                 |                       |       | then the CTA's own picks per row (ids, | S3 local top-k ->    |
|                 |                       |       | weights' bits; local_topk_rows steps)  | S3 union, same CTA   |
| ctrl / health   | see runtime.health    |       | epoch read for tags; sticky failed word| host / bounded waits |
| peers           | [tp]                  | int64 | byte address of each rank's buffer     | host (runtime.peers) |

The norm never waits for a whole row. Gemma's RMSNorm of r is u = r * (1 + w) times one
scalar per row, so each reduce task writes its columns of u into ``xs[G]`` and its sums of
r^2 (and of u * shared_expert_gate) into ``nsum``; every CTA sums a row's blocks in one fixed
order into its rsqrt, and the router and gate_up multiply u and scale their sums by it. The
u planes are the only hand-off whose payload is not in its tagged words (the writer fences
between the planes and the sums, the readers after the sums).

Each row's top-k is computed by one CTA and its picks published (in a step of at most
``local_topk_rows`` rows, every CTA computes every row's itself); every CTA then builds the
same union and routing tables from them. The union of picked experts (ascending expert id)
plus the shared expert are the "slots" whose gate_up row blocks (S3) and down H-slices (S4)
are spread over the grid. Every other hand-off is tagged words (``runtime.layout``); the
program is declared by :func:`k2_program` and checked at build. No grid barrier; waits are
bounded.

Per-element reduction orders depend only on the build (tiles), never on the width or the
other rows, so a row's output is independent of the batch (batch invariance), and replays
are bit-identical.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mono_ext.kernels.triton.launcher import ROWS, FrozenLaunch, Live, live_template, live_values
from mono_ext.kernels.triton.limits import BLOCK_B, PER_STEP_ARGS, next_pow2, pdl_options
from mono_ext.kernels.triton.planes import chunk_limit, format_code, plane_reasons, scale_numel
from mono_ext.models.qwen3_next.shapes import TailShape
from mono_ext.models.qwen3_next.triton.k2_config import K2Config
from mono_ext.models.qwen3_next.triton.k2_kernel import STAGE_ORDER, STAGES_ALL, k2_kernel
from mono_ext.runtime.layout import Program, Region, Stage, plan_layout, push, wait, write

__all__ = [
    "BLOCK_B",
    "K2Config",
    "K2Launch",
    "K2Shape",
    "k2_kernel",
    "k2_program",
    "STAGES_ALL",
]


@dataclass(frozen=True)
class K2Shape(TailShape):
    """Per-rank sizes this backend's K2 is built for (fields, ``from_dims`` and the shared
    limits: :class:`~mono_ext.models.qwen3_next.shapes.TailShape`)."""

    @property
    def slots(self) -> int:
        """Routed slots a launch can touch: min(E, BLOCK_B * top_k)."""
        return min(self.experts, BLOCK_B * self.top_k)

    @property
    def pairs(self) -> int:
        return BLOCK_B * self.top_k

    @property
    def act_words(self) -> int:
        return (max(self.moe_inter, self.shared_inter) + 1) // 2


def k2_program(shape: K2Shape, config: K2Config) -> Program:
    """K2's regions and stages (checked by ``runtime.layout.check_handoffs`` at build).

    ``act`` holds one activation row per (slot, row), ``p4l`` one down partial per (pair, H
    row): pairs are (row, pick rank) then the shared expert's (row). At TP1 the out_proj
    partials are local and the pair sum is the output; at TP > 1 ``p1`` and ``p4`` are peer
    regions (every rank pushes into its slot on every rank: the all-reduce is the sum the
    next stage takes over ranks, in rank order).
    """
    h, bb = shape.hidden, BLOCK_B
    splits = config.splits(shape)
    peer = shape.tp > 1
    regions = [
        Region("p1", splits * bb * h, peer=peer),
        Region("logits", config.router_k_splits * bb * shape.experts),
        Region("picks", bb * 2 * shape.top_k),
        Region("act", (shape.slots + 1) * bb * shape.act_words),
        Region("p4l", (shape.pairs + bb) * h),
        Region("nsum", -(-h // config.reduce_cols) * bb * 2),
    ]
    stages = [
        Stage("out_proj", [push("p1") if peer else write("p1")]),
        Stage("residual", [wait("p1"), write("nsum")]),
        Stage("norm_router", [wait("nsum"), write("logits")]),
        Stage("topk", [wait("logits"), write("picks")]),
        Stage("gate_up", [wait("picks"), write("act")]),
        Stage("down", [wait("act"), write("p4l")]),
    ]
    if peer:
        regions.append(Region("p4", bb * h, peer=True))
        stages += [Stage("moe_sum", [wait("p4l"), push("p4")]), Stage("moe_out", [wait("p4")])]
    else:
        stages.append(Stage("moe_out", [wait("p4l")]))
    return Program("k2", tuple(regions), tuple(stages))


@dataclass
class K2Workspace:
    """One rank's scratch: mailbox regions and per-CTA private rows (zeroed once)."""

    scratch: Any  # int64 [scratch_words]
    xs: Any  # bf16 [G + 2, 2, Bb, H]: per CTA (a8), the shared u planes, the shared a8 codes
    eslot: Any  # int32 [G, 2 * EP + Bb * 2 * top_k]: expert slots, flags, the CTA's picks
    wsc: Any  # fp32 [G, Um + 2, Bb]
    ppos: Any  # int32 [G, Um + 1, Bb]
    meta: Any  # int32 [G, Um + 1]
    trace: Any = None  # int64 [G, 16] (``trace`` builds only)


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: the expert planes whose inputs a build with ``fp8_activations`` quantizes to e4m3
A8_PLANES = frozenset({"w13", "w2", "shared_gate_up", "shared_down"})

#: planes K2 reads in any format of ``planes.READ_FORMATS``, besides out_proj / o_proj (the
#: engines leave the router and shared_expert_gate bf16; a checkpoint could still quantize them)
QUANTIZABLE = ("w13", "w2", "shared_gate_up", "shared_down", "router", "shared_expert_gate")

_WEIGHT_KEYS = (
    "post_attention_layernorm",
    "router",
    "w13",
    "w2",
    "shared_gate_up",
    "shared_down",
    "shared_expert_gate",
)


@dataclass
class K2Launch:
    """Build once (compile + load + residency check), then launch once per layer per step.

    ``co_resident``: how many launches of this kernel spin together on one device (``tp``
    for virtual TP, 1 for real TP). ``kind``: "gdn" reads ``weights["out_proj"]``, "attn"
    ``weights["o_proj"]``. ``gated`` (attention only): :meth:`launch` takes the pre-sigmoid
    output ``gate`` next to the raw attention output and S1 forms bf16(o_in * sigmoid(gate))
    as it loads (compiled in; no extra launch). ``formats``: plane -> format of the planes
    not in bf16 (``kernels.triton.planes``; a quantized plane's scales come as
    ``weights[plane + ".scale"]``); planes K2 does not read are ignored.
    """

    shape: K2Shape
    config: K2Config
    kind: str = "gdn"
    gated: bool = False
    co_resident: int = 1
    sys_scope: bool = False
    stages: int = STAGES_ALL
    formats: Mapping[str, str] = field(default_factory=dict)
    layout: Any = field(init=False)
    _compiled: Any = field(init=False, default=None)
    # the launch's constexprs, fixed by build(): a launch does not recompute them
    _cx: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.shape.validate()
        if self.kind not in ("gdn", "attn"):
            raise ValueError(f"kind must be 'gdn' or 'attn', got {self.kind!r}")
        if self.gated and self.kind != "attn":
            raise ValueError("only attention layers have an output gate (gated needs kind 'attn')")
        c = self.config
        if c.tile_rows != 16 * c.num_warps:
            raise ValueError(
                f"tile_rows={c.tile_rows} must be 16 * num_warps (one M16 slab per warp)"
            )
        for name in ("gate_up_rows", "down_rows"):
            if not 16 <= getattr(c, name) <= 64:
                raise ValueError(f"{name}={getattr(c, name)} must be 16, 32 or 64 (MMA rows)")
        if c.down_prefetch_bytes < 0 or c.down_prefetch_bytes % 16:
            raise ValueError(
                f"down_prefetch_bytes={c.down_prefetch_bytes} must be 0 or a positive multiple "
                "of 16 (bulk prefetch sizes)"
            )
        if c.router_preload:
            self._check_router_preload()
        for name in ("local_topk_rows", "down_runs_from_last_rows"):
            if not 0 <= getattr(c, name) <= BLOCK_B:
                raise ValueError(f"{name}={getattr(c, name)} must be 0..{BLOCK_B}")
        self.out_proj_k_splits = c.splits(self.shape)
        self.layout = plan_layout(k2_program(self.shape, c), self.shape.tp)
        self._check_formats()

    def _gate_up_k_chunk(self) -> int:
        """gate_up's K chunk: at most ``gate_up_k_chunk``, inside one scale column of a
        block-128 plane."""
        s, c = self.shape, self.config
        lim3 = chunk_limit(self.formats, "w13", "shared_gate_up") or c.gate_up_k_chunk
        return min(c.gate_up_k_chunk, max(16, next_pow2(s.hidden)), lim3)

    def _check_router_preload(self) -> None:
        s, c = self.shape, self.config
        chunk = self._router_k_chunk()
        tasks = -(-s.experts // c.tile_rows) * c.router_k_splits
        if chunk * c.router_k_splits < s.hidden or tasks > c.grid:
            raise ValueError(
                f"router_preload needs one router task of one K chunk per CTA: "
                f"router_k_splits={c.router_k_splits} x chunk {chunk} covers "
                f"{chunk * c.router_k_splits} of hidden {s.hidden}, {tasks} tasks on grid {c.grid}"
            )

    def _router_k_chunk(self) -> int:
        """The router's K chunk: a split's columns rounded up to a power of two, at most
        ``router_k_chunk`` and inside one scale column of a block-128 plane."""
        s, c = self.shape, self.config
        lim = chunk_limit(self.formats, "router") or c.router_k_chunk
        return min(c.router_k_chunk, max(16, next_pow2(-(-s.hidden // c.router_k_splits))), lim)

    # -- plane formats -------------------------------------------------------------------
    @property
    def w_o_name(self) -> str:
        return "out_proj" if self.kind == "gdn" else "o_proj"

    def fmt(self, plane: str) -> str:
        return self.formats.get(plane, "bf16")

    def _check_formats(self) -> None:
        for plane in (self.w_o_name, *QUANTIZABLE):
            format_code(self.formats, plane)  # raises for a format the kernels do not read
        if self.config.fp8_activations and (why_not := self._a8_unmet()):
            raise ValueError(f"fp8_activations {why_not}")

    @property
    def a8(self) -> bool:
        """Whether the expert planes take e4m3 activations: ``K2Config.fp8_activations``
        resolved against ``formats`` (None: wherever :meth:`_a8_unmet` finds nothing)."""
        return self.config.fp8_activations is not False and self._a8_unmet() is None

    def _a8_unmet(self) -> str | None:
        """Why this build cannot quantize its expert inputs to e4m3 (None: it can)."""
        bad = sorted(p for p in A8_PLANES if self.fmt(p) != "fp8_block128")
        if bad:
            return (
                f"needs fp8_block128 expert planes; {', '.join(bad)} "
                f"{'is' if len(bad) == 1 else 'are'} "
                f"{', '.join(sorted({self.fmt(p) for p in bad}))}"
            )
        # a K chunk is one quantization group: 128 columns (or all of a shorter K)
        for name in ("gate_up_k_chunk", "down_i_chunk"):
            if getattr(self.config, name) < 128:
                return f"needs {name} >= 128, got {getattr(self.config, name)}"
        # the down stage quantizes its run's activations into the CTA's xs planes
        need, have = self._a8_down_bytes(), 2 * 2 * BLOCK_B * self.shape.hidden
        if need > have:
            return (
                f"needs {need} bytes per CTA for a down run's e4m3 activations, more than the "
                f"{have} of its xs planes (a larger grid runs fewer slots each)"
            )
        return None

    def _a8_down_bytes(self) -> int:
        """Bytes of one CTA's quantized down activations: e4m3 codes per (run slot, row, I
        column, padded to whole chunks), then one fp32 scale per (run slot, I chunk, row)."""
        imax = max(self.shape.moe_inter, self.shape.shared_inter)
        bi4 = self._down_i_chunk()
        return self._run_slots() * BLOCK_B * -(-imax // bi4) * (bi4 + 4)

    def _down_i_chunk(self) -> int:
        """The down stage's I chunk (its K): a block-128 plane's chunk stays in one scale
        column."""
        s, c = self.shape, self.config
        lim4 = chunk_limit(self.formats, "w2", "shared_down") or c.down_i_chunk
        return min(c.down_i_chunk, max(32, next_pow2(max(s.moe_inter, s.shared_inter))), lim4)

    @property
    def a8_planes(self) -> frozenset[str]:
        """The planes whose inputs this build quantizes to e4m3 (``K2Config.fp8_activations``;
        the reference's ``layer_tail(a8_planes=...)``)."""
        return A8_PLANES if self.a8 else frozenset()

    # -- sizes ---------------------------------------------------------------------------
    @property
    def peer_words(self) -> int:
        return self.layout.peer_words

    def label(self) -> str:
        s = self.shape
        return (
            f"k2 {self.kind} h{s.hidden} in{s.in_dim} e{s.experts}k{s.top_k} i{s.moe_inter}"
            f" is{s.shared_inter} tp{s.tp} grid{self.config.grid} w{self.config.num_warps}"
            + (" gated" if self.gated else "")
        )

    @property
    def meta_words(self) -> int:
        return self.shape.slots + 1

    def workspace(self, device: Any) -> K2Workspace:
        import torch

        g, s = self.config.grid, self.shape
        eslot_words = 2 * next_pow2(s.experts) + BLOCK_B * 2 * s.top_k
        return K2Workspace(
            scratch=torch.zeros(
                max(self.layout.scratch_words, 16), dtype=torch.int64, device=device
            ),
            xs=torch.zeros(g + 2, 2, BLOCK_B, s.hidden, dtype=torch.bfloat16, device=device),
            eslot=torch.zeros(g, eslot_words, dtype=torch.int32, device=device),
            wsc=torch.zeros(g, s.slots + 2, BLOCK_B, dtype=torch.float32, device=device),
            ppos=torch.full((g, s.slots + 1, BLOCK_B), -1, dtype=torch.int32, device=device),
            meta=torch.zeros(g, self.meta_words, dtype=torch.int32, device=device),
            trace=(
                torch.zeros(g, 16, dtype=torch.int64, device=device) if self.config.trace else None
            ),
        )

    def _max_tasks3(self) -> int:
        """gate_up tasks of the widest step: the shared expert and every routed slot."""
        s, c = self.shape, self.config
        bi3 = c.gate_up_rows // 2
        return -(-s.shared_inter // bi3) + s.slots * -(-s.moe_inter // bi3)

    def _run_slots(self) -> int:
        """Slots one CTA's run of down tasks can touch (power of two): a run of at most
        ceil(tasks / grid) tasks, ``H / down_rows`` tasks per slot, may start inside a slot."""
        s, c = self.shape, self.config
        rb4 = -(-s.hidden // c.down_rows)
        run = -(-((s.slots + 1) * rb4) // c.grid)
        return next_pow2(-(-run // rb4) + 1)

    def _s1_prefetch(self) -> int:
        """What S1 prefetches into L2 after its stream: bit 1 the router, bit 2 the shared
        gate_up."""
        c = self.config
        return (1 if c.prefetch or c.prefetch_router else 0) | (
            2 if c.prefetch or c.prefetch_shared else 0
        )

    def _constexprs(self) -> dict:
        s, c, lay = self.shape, self.config, self.layout
        rid = {r.name: i for i, r in enumerate(lay.program.regions)}
        # a block-128 plane's K chunks stay inside one scale column
        lim1 = chunk_limit(self.formats, self.w_o_name) or c.out_proj_k_chunk
        ks1 = self.out_proj_k_splits
        return dict(
            H=s.hidden,
            KO=s.in_dim,
            E=s.experts,
            EP=next_pow2(s.experts),
            TOPK=s.top_k,
            NORM_TOPK=bool(s.norm_topk),
            IR=s.moe_inter,
            ISR=s.shared_inter,
            OFF_P1=lay.offsets["p1"],
            OFF_LOGITS=lay.offsets["logits"],
            OFF_ACT=lay.offsets["act"],
            OFF_P4L=lay.offsets["p4l"],
            OFF_P4=lay.offsets.get("p4", 0),
            OFF_PICKS=lay.offsets["picks"],
            OFF_NSUM=lay.offsets["nsum"],
            RID_P1=rid["p1"],
            RID_LOGITS=rid["logits"],
            RID_PICKS=rid["picks"],
            RID_ACT=rid["act"],
            RID_P4L=rid["p4l"],
            RID_P4=rid.get("p4", 0),
            RID_NSUM=rid["nsum"],
            RANKS=s.tp,
            SYS=self.sys_scope,
            BB=BLOCK_B,
            BN=c.tile_rows,
            BN3=c.gate_up_rows,
            BN4=c.down_rows,
            BK1=min(c.out_proj_k_chunk, max(16, next_pow2(-(-s.in_dim // ks1))), lim1),
            KSPL1=ks1,
            KS2=c.router_k_splits,
            BK2=self._router_k_chunk(),
            BK3=self._gate_up_k_chunk(),
            BI4=self._down_i_chunk(),
            JS=self._run_slots(),
            ACH=min(c.act_rows_per_wait, self._run_slots() * BLOCK_B),
            CB=c.reduce_cols,
            TKP=next_pow2(s.top_k),
            PKWP=next_pow2(2 * s.top_k),
            TRP=next_pow2(-(-s.hidden // c.reduce_cols)),
            HP=next_pow2(s.hidden),
            PREFETCH=c.prefetch and not _interp(),
            PF1=0 if _interp() else self._s1_prefetch(),
            PF4=c.down_prefetch_bytes,
            GATED=self.gated,
            NPP=next_pow2(s.pairs + BLOCK_B),
            IWPOW=next_pow2(s.act_words),
            STAGES=self.stages,
            PIPE1=c.out_proj_pipeline_stages,
            PIPE2=c.router_pipeline_stages,
            PIPE3=c.gate_up_pipeline_stages,
            PIPE4=c.down_pipeline_stages,
            JM3=next_pow2(-(-(self._max_tasks3()) // c.grid)),
            TRACE=c.trace,
            Q_O=format_code(self.formats, self.w_o_name),
            Q_13=format_code(self.formats, "w13"),
            Q_2=format_code(self.formats, "w2"),
            Q_SGU=format_code(self.formats, "shared_gate_up"),
            Q_SD=format_code(self.formats, "shared_down"),
            Q_R=format_code(self.formats, "router"),
            Q_SEG=format_code(self.formats, "shared_expert_gate"),
            SPE13=scale_numel(self.fmt("w13"), 2 * s.moe_inter, s.hidden),
            SPE2=scale_numel(self.fmt("w2"), s.hidden, s.moe_inter),
            INTERP=_interp(),
            A8=self.a8,
            RPRE=c.router_preload,
            DRR=c.down_runs_from_last_rows,
            LTR=0 if self.a8 else c.local_topk_rows,
            num_warps=c.num_warps,
            num_stages=1,
            **pdl_options(c.pdl),
        )

    # -- build / launch ------------------------------------------------------------------
    def _args(self, o_in, residual, weights, out_hidden, out_residual, ws, ctrl, health, peers,
              n_rows, layer, layers_per_step, gate=None):  # fmt: skip
        w_o = weights[self.w_o_name]

        def scale(plane):  # bf16 planes have none: any fp32 pointer (never read)
            return weights.get(plane + ".scale", ws.wsc)

        return (
            o_in,
            o_in if gate is None else gate,  # read only by gated builds
            residual,
            out_hidden,
            out_residual,
            w_o,
            weights["post_attention_layernorm"],
            weights["router"],
            weights["shared_expert_gate"],
            weights["w13"],
            weights["w2"],
            weights["shared_gate_up"],
            weights["shared_down"],
            scale(self.w_o_name),
            scale("w13"),
            scale("w2"),
            scale("shared_gate_up"),
            scale("shared_down"),
            scale("router"),
            scale("shared_expert_gate"),
            ws.scratch,
            ws.xs,
            ws.eslot,
            ws.wsc,
            ws.ppos,
            ws.meta,
            ctrl if peers is None else peers,
            ctrl,
            health,
            ws.meta if ws.trace is None else ws.trace,
            n_rows,
            layer,
            layers_per_step,
            float(self.shape.eps),
        )

    def check(self, o_in, residual, weights, out_hidden, out_residual, gate=None) -> int:
        """Validate shapes, dtypes, contiguity and 16-byte alignment; returns the width."""
        import torch

        b = o_in.shape[0] if o_in.dim() == 2 else -1
        acts, bad = self.shape.launch_tensors(self.kind, self.gated, b, o_in, residual, weights,
                                              out_hidden, out_residual, gate)  # fmt: skip
        for plane in (self.w_o_name, *QUANTIZABLE):  # weights and scales in their formats
            if plane in acts:
                bad += plane_reasons(plane, weights, self.fmt(plane), acts.pop(plane)[1])
        for name, (t, shp) in acts.items():
            if tuple(t.shape) != shp:
                bad.append(f"{name} is {tuple(t.shape)}, expected {shp}")
            if t.dtype != torch.bfloat16:
                bad.append(f"{name} is {t.dtype}, expected bfloat16")
            if not t.is_contiguous():
                bad.append(f"{name} is not contiguous")
            if t.data_ptr() % 16:
                # Triton keys variants on 16-byte pointer alignment: another alignment would
                # compile (and load a module) mid-step, which stalls against spinning peers.
                bad.append(f"{name} is not 16-byte aligned (no JIT mid-step)")
        if not 1 <= b <= BLOCK_B:
            bad.append(f"width {b} outside 1..{BLOCK_B}")
        if bad:
            raise ValueError(f"{self.label()}: " + "; ".join(bad))
        return b

    def _warmup_args(self, dev: Any, n_rows: int = 2) -> tuple:
        """Tiny stand-ins on ``dev`` (a CPU too: offline compiles): warmup compiles for dtypes
        and alignment, it launches nothing."""
        import torch

        from mono_ext.runtime.peers import RankState

        s = self.shape
        bf = dict(dtype=torch.bfloat16, device=dev)
        one = torch.zeros(16, **bf)
        f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
        weights = {k: one for k in _WEIGHT_KEYS}
        weights["out_proj"] = weights["o_proj"] = one
        for plane in (self.w_o_name, *QUANTIZABLE):
            if self.fmt(plane) != "bf16":
                weights[plane] = torch.zeros(16, dtype=torch.float8_e4m3fn, device=dev)
                weights[plane + ".scale"] = torch.zeros(16, **f32)
        ws = K2Workspace(
            scratch=torch.zeros(16, dtype=torch.int64, device=dev),
            xs=one,
            eslot=torch.zeros(16, **i32),
            wsc=torch.zeros(16, **f32),
            ppos=torch.zeros(16, **i32),
            meta=torch.zeros(16, **i32),
            trace=torch.zeros(16, dtype=torch.int64, device=dev) if self.config.trace else None,
        )
        st = RankState.create(0, dev, 1.0)
        peers = torch.zeros(max(s.tp, 2), dtype=torch.int64, device=dev) if s.tp > 1 else None
        return self._args(one, one, weights, one, one, ws, st.ctrl, st.health, peers, n_rows, 0,
                          1, one if self.gated else None)  # fmt: skip

    def build(self, device: Any = "cuda") -> None:
        """Compile and load at startup (never mid-step), and check the grid is resident."""
        import torch

        from mono_ext.runtime.build_cache import (
            check_residency,
            check_unspecialized,
            device_limits,
            kernel_resources,
        )

        s = self.shape
        dev = torch.device(device)
        self._cx = self._constexprs()
        if _interp():
            # the CPU interpreter (tests without a GPU): nothing to compile, one stage per
            # launch, so nothing spins and residency does not apply; TP1 only (virtual ranks
            # would have to interleave their stages)
            if s.tp > 1:
                raise ValueError(f"{self.label()}: the interpreter path runs TP1 only")
            self.resources = None
            self._compiled = "interpreter"
            return
        check_unspecialized(k2_kernel, PER_STEP_ARGS)
        args = self._warmup_args(dev)
        compiled = k2_kernel.warmup(*args, grid=(self.config.grid,), **self._cx)
        res = kernel_resources(compiled)
        check_residency(self.label(), self.config.grid * self.co_resident, res, device_limits(dev))
        self.resources = res
        self._compiled = compiled

    # check()'s per-step arguments: o_in, residual, out_hidden, out_residual, gate
    _LIVE_AT = (0, 1, 3, 4, 5)

    def plan(self, o_in, residual, weights: dict, out_hidden, out_residual, *,
             ws: K2Workspace, ctrl, health, peers=None, layer: int = 0,
             layers_per_step: int = 1, gate=None, check: bool = True) -> FrozenLaunch:  # fmt: skip
        """One layer's K2 planned once: every tensor checked (unless ``check`` is False), the
        argument table frozen with the activations and the row count live (``live_values``).
        The caller bumps the epoch once per step. ``gate``: the pre-sigmoid output gate, for
        (and only for) a ``gated`` build."""
        if self._compiled is None:
            raise RuntimeError(f"{self.label()}: build() at startup before launching")
        if check:
            self.check(o_in, residual, weights, out_hidden, out_residual, gate)
        elif self.gated != (gate is not None):
            raise ValueError(f"{self.label()}: gate must be given exactly for gated builds")
        if self.shape.tp > 1 and peers is None:
            raise ValueError(f"{self.label()}: TP {self.shape.tp} needs the peer table")
        tensors = (o_in, residual, weights, out_hidden, out_residual, gate)
        t, names, values = live_template(tensors, self._LIVE_AT)
        args = self._args(t[0], t[1], weights, t[3], t[4], ws, ctrl, health, peers, Live(ROWS),
                          layer, layers_per_step, t[5])  # fmt: skip
        cx = self._cx
        if cx["INTERP"]:  # one stage per launch: every hand-off is written before it is read
            passes = [{**cx, "STAGES": st} for st in STAGE_ORDER if st & self.stages]
        else:
            passes = [cx]
        return FrozenLaunch(k2_kernel, self.config.grid, args, names, values, passes,
                            compiled=not cx["INTERP"], max_rows=BLOCK_B)  # fmt: skip

    def live_values(self, o_in, residual, out_hidden, out_residual, gate=None) -> list:
        """What a planned launch (:meth:`plan`) takes per step."""
        return live_values((o_in, residual, None, out_hidden, out_residual, gate), self._LIVE_AT)

    def launch(
        self,
        o_in,
        residual,
        weights: dict,
        out_hidden,
        out_residual,
        *,
        ws: K2Workspace,
        ctrl,
        health,
        peers=None,
        layer: int = 0,
        layers_per_step: int = 1,
        validate: bool = True,
        gate=None,
    ) -> None:
        """Plan (:meth:`plan`; tensors checked when ``validate``) and run one K2 for
        ``o_in.shape[0]`` rows."""
        planned = self.plan(o_in, residual, weights, out_hidden, out_residual, ws=ws, ctrl=ctrl,
                            health=health, peers=peers, layer=layer,
                            layers_per_step=layers_per_step, gate=gate,
                            check=validate)  # fmt: skip
        planned.run(self.live_values(o_in, residual, out_hidden, out_residual, gate))


def shard_tail_weights(
    weights: dict, tp: int, rank: int, formats: Mapping[str, str] | None = None
) -> dict:
    """One rank's K2 planes cut from full (TP1) planes, the way the engines shard them:
    out_proj/o_proj and w2/shared_down split their input columns (row-parallel), w13 and
    shared_gate_up split I within the gate rows and within the up rows (column-parallel),
    router, shared_expert_gate and the norm weight are replicated. A quantized plane's
    ``.scale`` (``formats`` names its format) is cut to match: block-128 scales by blocks,
    per-row scales with their rows, a per-tensor scale replicated. Tests and benchmarks use
    it; engines hand their own shards."""
    import torch

    if tp == 1:
        return dict(weights)
    formats = formats or {}

    def cols(w, k):  # the rank's share of the last dim, k per rank
        return w[..., rank * k : (rank + 1) * k].contiguous()

    def gate_up_rows(w, c):  # the rank's c rows of the gate half and of the up half
        i = w.shape[-2] // 2
        gate = w[..., rank * c : (rank + 1) * c, :]
        up = w[..., i + rank * c : i + (rank + 1) * c, :]
        return torch.cat([gate, up], dim=-2).contiguous()

    out = {}
    for name, w in weights.items():
        plane, is_scale = name.removesuffix(".scale"), name.endswith(".scale")
        fmt = formats.get(plane, "bf16")
        if is_scale and fmt == "fp8_tensor":
            out[name] = w
        elif plane in ("out_proj", "o_proj", "shared_down", "w2"):
            if not is_scale:
                out[name] = cols(w, w.shape[-1] // tp)
            elif fmt == "fp8_block128":
                out[name] = cols(w, weights[plane].shape[-1] // tp // 128)
            else:  # per-row scales: the rows are not split
                out[name] = w
        elif plane in ("w13", "shared_gate_up"):
            rows = weights[plane].shape[-2] // 2 // tp  # gate (and up) rows per rank
            out[name] = gate_up_rows(w, rows // 128 if fmt == "fp8_block128" and is_scale else rows)
        else:
            out[name] = w
    return out
