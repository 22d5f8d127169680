"""A standalone persistent launch of the one-shot bf16 all-reduce (tests, benchmarks, and a
fallback TP all-reduce between K1/K2 stages).

| name    | shape            | dtype | writer                                     |
|---------|------------------|-------|--------------------------------------------|
| x       | [hidden]         | bf16  | caller (this rank's partial sum)           |
| out     | [hidden]         | bf16  | this launch: sum over ranks, same on all   |
| peers   | [world] table    | int64 | host (see runtime.peers)                   |
| ctrl    | [CTRL_WORDS]     | int64 | host; epoch bumped once per step           |
| health  | [HEALTH_WORDS]   | int32 | a wait that gives up                       |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import triton
import triton.language as tl

from mono_ext.kernels.triton.primitives import allreduce_bf16_oneshot, global_timer_ns, step_seq
from mono_ext.runtime.build_cache import (
    check_residency,
    check_unspecialized,
    device_limits,
    kernel_resources,
)
from mono_ext.runtime.layout import Program, Region, Stage, allreduce, plan_layout

__all__ = [
    "OneShotAllReduce",
    "allreduce_kernel",
    "allreduce_loop_kernel",
    "allreduce_program",
]

# Arguments that change between launches: never specialised (see runtime.build_cache).
PER_STEP_ARGS = ("layer", "layers_per_step")


@triton.jit(do_not_specialize=["layer", "layers_per_step"])
def allreduce_kernel(
    x_ptr,
    out_ptr,
    n_words,
    peers_ptr,
    region_off,
    region_id,
    ctrl_ptr,
    health_ptr,
    layer,
    layers_per_step,
    RANKS: tl.constexpr,
    BLOCK: tl.constexpr,
    SYS: tl.constexpr,
):
    seq = step_seq(ctrl_ptr, layer, layers_per_step)
    allreduce_bf16_oneshot(
        x_ptr,
        out_ptr,
        n_words,
        peers_ptr,
        region_off,
        region_id,
        seq,
        ctrl_ptr,
        health_ptr,
        RANKS,
        BLOCK,
        SYS,
    )


@triton.jit(do_not_specialize=["iters"])
def allreduce_loop_kernel(
    x_ptr,
    out_ptr,
    n_words,
    peers_ptr,
    region_off,
    region_id,
    ctrl_ptr,
    health_ptr,
    t_ptr,
    iters,
    RANKS: tl.constexpr,
    BLOCK: tl.constexpr,
    SYS: tl.constexpr,
):
    # `iters` all-reduces inside one launch: what K2 pays per all-reduce, with no launch
    # gaps (benchmarks time it). One region is reused safely: every rank maps chunk c to
    # CTA c, so a CTA reaches use k+2 of a parity only after every peer's CTA c pushed use
    # k+1, i.e. finished reading use k.
    # Each is allreduce_kernel's body (a jit function, inlined here) at layer `it` of `iters`.
    t0 = global_timer_ns()
    for it in range(iters):
        allreduce_kernel(
            x_ptr,
            out_ptr,
            n_words,
            peers_ptr,
            region_off,
            region_id,
            ctrl_ptr,
            health_ptr,
            it,
            iters,
            RANKS,
            BLOCK,
            SYS,
        )
    t1 = global_timer_ns()
    if tl.program_id(0) == 0:
        tl.store(t_ptr, t1 - t0)


def allreduce_program(hidden: int) -> Program:
    if hidden % 2:
        raise ValueError(f"hidden must be even (two bf16 per tagged word), got {hidden}")
    return Program(
        "allreduce",
        regions=(Region("ar", hidden // 2, peer=True),),
        stages=(Stage("reduce", allreduce("ar")),),
    )


@dataclass
class OneShotAllReduce:
    """Build once (compile + load + residency check), then launch every step.

    ``co_resident`` is how many launches of this kernel spin together on one device:
    ``world`` for virtual TP (all ranks on one GPU), 1 for real TP.
    """

    hidden: int
    world: int
    grid: int
    block: int = 256
    sys_scope: bool = False
    co_resident: int = 1
    num_warps: int = 4
    layout: Any = field(init=False)
    _compiled: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.world & (self.world - 1):
            raise ValueError(
                f"world must be a power of two for the one-shot kernel, got {self.world}"
            )
        self.layout = plan_layout(allreduce_program(self.hidden), self.world)

    @property
    def n_words(self) -> int:
        return self.hidden // 2

    @property
    def peer_words(self) -> int:
        return self.layout.peer_words

    def label(self) -> str:
        return f"allreduce h{self.hidden} tp{self.world} grid{self.grid} block{self.block}"

    def build(self, x, out, peers, ctrl, health) -> None:
        """Compile and load at startup (never mid-step), and check the grid fits."""
        check_unspecialized(allreduce_kernel, PER_STEP_ARGS)
        compiled = allreduce_kernel.warmup(
            *self._args(x, out, peers, ctrl, health, 0, 1), grid=(self.grid,), **self._constexprs()
        )
        res = kernel_resources(compiled)
        check_residency(self.label(), self.grid * self.co_resident, res, device_limits(x.device))
        self._compiled = compiled

    def launch(self, x, out, peers, ctrl, health, layer: int = 0, layers_per_step: int = 1):
        if self._compiled is None:
            raise RuntimeError(f"{self.label()}: build() at startup before launching")
        allreduce_kernel[(self.grid,)](
            *self._args(x, out, peers, ctrl, health, layer, layers_per_step),
            **self._constexprs(),
        )

    def _args(self, x, out, peers, ctrl, health, layer, layers_per_step):
        for name, t in (
            ("x", x),
            ("out", out),
            ("peers", peers),
            ("ctrl", ctrl),
            ("health", health),
        ):
            # Triton keys variants on 16-byte pointer alignment: another alignment would
            # compile (and load a module) mid-step, which stalls against spinning peers.
            if t.data_ptr() % 16:
                raise ValueError(
                    f"{self.label()}: {name} must be 16-byte aligned (no JIT mid-step)"
                )
        return (
            x.view(_int32(x)),
            out.view(_int32(out)),
            self.n_words,
            peers,
            self.layout.offsets["ar"],
            self.layout.region_id("ar"),
            ctrl,
            health,
            layer,
            layers_per_step,
        )

    def _constexprs(self) -> dict:
        return {
            "RANKS": self.world,
            "BLOCK": self.block,
            "SYS": self.sys_scope,
            "num_warps": self.num_warps,
        }


def _int32(t):
    import torch

    if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.numel() % 2:
        raise ValueError(f"expected a contiguous bf16 tensor of even size, got {t.dtype} {t.shape}")
    return torch.int32


class VirtualTPAllReduce:
    """``world`` virtual ranks on one GPU, each with its own input/output, ctrl and health.

    ``step(ranks)`` bumps each rank's epoch and launches its all-reduce on its own stream,
    forked from and joined into the current stream (capturable into one CUDA graph).
    """

    def __init__(self, world: int, hidden: int, grid: int, deadline_s: float, block: int = 256):
        import torch

        from mono_ext.runtime.peers import VirtualPeers

        self.ar = OneShotAllReduce(hidden, world, grid, block=block, co_resident=world)
        self.peers = VirtualPeers(world, self.ar.peer_words, "cuda", deadline_s)
        # rows padded to 16 bytes: every rank's pointer has the alignment the build saw
        padded = -(-hidden // 8) * 8
        rows = torch.randn(world, padded, dtype=torch.bfloat16, device="cuda")
        self.xs = rows[:, :hidden]
        self.outs = torch.empty_like(rows)[:, :hidden]
        s0 = self.peers.ranks[0]
        self.ar.build(self.xs[0], self.outs[0], self.peers.table, s0.ctrl, s0.health)

    @property
    def world(self) -> int:
        return self.peers.world

    def launch(self, rank: int, layer: int = 0, layers_per_step: int = 1, x=None, out=None):
        s = self.peers.ranks[rank]
        self.ar.launch(
            self.xs[rank] if x is None else x,
            self.outs[rank] if out is None else out,
            self.peers.table,
            s.ctrl,
            s.health,
            layer,
            layers_per_step,
        )

    def step(self, ranks=None, layers: int = 1) -> None:
        def one(r: int) -> None:
            self.peers.ranks[r].bump_epoch()
            for layer in range(layers):
                self.launch(r, layer, layers)

        self.peers.run(one, ranks)

    def expected(self, xs=None):
        """What every rank must hold: fp32 sum in rank order, rounded once to bf16."""
        import torch

        xs = self.xs if xs is None else xs
        acc = torch.zeros(xs.shape[-1], dtype=torch.float32, device=xs.device)
        for r in range(xs.shape[0]):
            acc = acc + xs[r].float()
        return acc.to(torch.bfloat16), acc
