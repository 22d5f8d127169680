"""Scratch and mailbox layout of a persistent launch, and the build-time hand-off check.

A launch runs a :class:`Program`: named :class:`Region` s and an ordered list of
:class:`Stage` s. Stages hand off only through regions of *tagged words*: 64-bit
``(tag << 32) | value`` words, one store each, so a reader that sees the tag it wants also
sees the value that came with it. Readers re-load until every tag matches (a bounded wait).

Tags come from the step sequence ``seq = epoch * layers_per_step + layer``: ``epoch`` lives
in the rank's control block and is bumped once per step on the stream (graph-safe), so
every launch of a region gets a tag its previous launch never wrote.

| region kind | where              | shape (int64 words)                | written by        |
|-------------|--------------------|------------------------------------|-------------------|
| local       | per-rank scratch   | ``[words]``                        | one earlier stage |
| peer        | every rank's peer  | ``[2 parity][world src][words]``   | every rank's push |
|             | buffer (same off.) |                                    | (``push``)        |

Peer regions are double-buffered by the parity of ``seq``: a rank can run at most one use
ahead of its slowest peer (its next all-reduce needs that peer's push), so parity keeps the
fast rank's writes off the slot the slow rank is still reading.

:func:`check_handoffs` refuses, at build, a program whose waits could spin forever: a wait
on a region no earlier stage writes (or, for a peer region, that this CTA has not pushed
first). This module imports neither torch nor triton.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "ALIGN_WORDS",
    "HandoffError",
    "Layout",
    "Op",
    "Program",
    "Region",
    "Stage",
    "allreduce",
    "check_handoffs",
    "parity_of",
    "plan_layout",
    "push",
    "step_seq",
    "tag_of",
    "wait",
    "write",
]

#: Regions start on 128-byte boundaries so a wide store never straddles two regions.
ALIGN_WORDS = 16


def step_seq(epoch: int, layer: int, layers_per_step: int) -> int:
    """Host mirror of the device ``step_seq``: one number per (step, layer)."""
    if not 0 <= layer < layers_per_step:
        raise ValueError(f"layer {layer} outside [0, {layers_per_step})")
    return epoch * layers_per_step + layer


def tag_of(seq: int) -> int:
    """Tag stored with each word: the low 32 bits of the sequence (unsigned)."""
    return seq & 0xFFFFFFFF


def parity_of(seq: int) -> int:
    """Which half of a double-buffered peer region this sequence uses."""
    return seq & 1


@dataclass(frozen=True)
class Region:
    """A named region of tagged 64-bit words (``words`` per slot)."""

    name: str
    words: int
    peer: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"region name {self.name!r}: use letters, digits, '_' and '.'")
        if self.words <= 0:
            raise ValueError(f"region {self.name!r}: words must be > 0, got {self.words}")


@dataclass(frozen=True)
class Op:
    """One hand-off operation of a stage, in program order."""

    kind: str  # "write" | "wait" | "push"
    region: str

    def __post_init__(self) -> None:
        if self.kind not in ("write", "wait", "push"):
            raise ValueError(f"op kind {self.kind!r}: expected write, wait or push")


def write(region: str) -> Op:
    """Store tagged words into a local region."""
    return Op("write", region)


def wait(region: str) -> Op:
    """Bounded wait until the region's words carry this step's tag."""
    return Op("wait", region)


def push(region: str) -> Op:
    """Store this rank's tagged words into its slot of a peer region on every rank."""
    return Op("push", region)


def allreduce(region: str) -> tuple[Op, Op]:
    """One-shot all-reduce through a peer region: push own part, then wait for all parts."""
    return (push(region), wait(region))


@dataclass(frozen=True)
class Stage:
    name: str
    ops: tuple[Op, ...]

    def __init__(self, name: str, ops: Iterable[Op | tuple[Op, ...]]):
        flat: list[Op] = []
        for op in ops:
            flat.extend(op if isinstance(op, tuple) else (op,))
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "ops", tuple(flat))


@dataclass(frozen=True)
class Program:
    name: str
    regions: tuple[Region, ...]
    stages: tuple[Stage, ...]

    def region_id(self, name: str) -> int:
        for i, r in enumerate(self.regions):
            if r.name == name:
                return i
        raise KeyError(f"program {self.name!r} has no region {name!r}")


class HandoffError(ValueError):
    """A program's hand-offs could deadlock (or are ambiguous); every reason is listed."""

    def __init__(self, program: str, reasons: list[str]):
        self.program = program
        self.reasons = tuple(reasons)
        super().__init__(f"program {program!r} refused at build: " + "; ".join(reasons))


def check_handoffs(program: Program) -> None:
    """Refuse a program whose waits could spin until the deadline.

    Rules (all reasons are collected, not just the first):

    - every op names a declared region; region names are unique;
    - a local region is written by exactly one stage, never pushed;
    - a wait on a local region comes in a stage *after* the one that writes it (CTAs of one
      stage are not ordered against each other, so a same-stage hand-off can deadlock);
    - a peer region is pushed by exactly one stage, once, never written locally (its
      double buffering covers one use per launch);
    - a wait on a peer region follows the CTA's own push of it (same stage, earlier op, or an
      earlier stage): otherwise every rank may wait for pushes no rank has made yet.
    """
    reasons: list[str] = []
    by_name: dict[str, Region] = {}
    for r in program.regions:
        if r.name in by_name:
            reasons.append(f"region {r.name!r} declared twice")
        by_name[r.name] = r

    writer: dict[str, list[tuple[int, int]]] = {}  # region -> [(stage, op index)]
    for si, st in enumerate(program.stages):
        for oi, op in enumerate(st.ops):
            region = by_name.get(op.region)
            if region is None:
                reasons.append(f"stage {st.name!r} {op.kind}s undeclared region {op.region!r}")
                continue
            if op.kind == "write" and region.peer:
                reasons.append(
                    f"stage {st.name!r} writes peer region {op.region!r} locally: peers only "
                    "see pushes"
                )
            if op.kind == "push" and not region.peer:
                reasons.append(
                    f"stage {st.name!r} pushes local region {op.region!r}: declare it peer=True"
                )
            if op.kind in ("write", "push"):
                writer.setdefault(op.region, []).append((si, oi))

    for name, sites in writer.items():
        if len(sites) > 1:
            stages = ", ".join(repr(program.stages[s].name) for s, _ in sites)
            reasons.append(
                f"region {name!r} is written {len(sites)} times per launch (stages {stages}): "
                "a waiter could take the wrong writer's words; give each hand-off its own region"
            )

    for si, st in enumerate(program.stages):
        for oi, op in enumerate(st.ops):
            if op.kind != "wait" or op.region not in by_name:
                continue
            sites = writer.get(op.region, [])
            if by_name[op.region].peer:
                if not any(s < si or (s == si and o < oi) for s, o in sites):
                    reasons.append(
                        f"stage {st.name!r} waits on peer region {op.region!r} before its own "
                        "push of it: every rank could wait for pushes nobody has made (deadlock)"
                    )
            elif not any(s < si for s, _ in sites):
                if any(s == si for s, _ in sites):
                    why = "its own stage writes it, and CTAs of one stage are not ordered"
                else:
                    why = "no earlier stage writes it"
                reasons.append(
                    f"stage {st.name!r} waits on region {op.region!r}, but {why}: the wait could "
                    "spin until the deadline (deadlock)"
                )
    if reasons:
        raise HandoffError(program.name, reasons)


@dataclass(frozen=True)
class Layout:
    """Word offsets of every region: local ones in the scratch, peer ones in the peer buffer."""

    program: Program
    world: int
    offsets: dict[str, int] = field(hash=False)
    scratch_words: int
    peer_words: int

    def region_id(self, name: str) -> int:
        return self.program.region_id(name)

    def region(self, name: str) -> Region:
        return self.program.regions[self.region_id(name)]

    def slot_offset(self, name: str, seq: int, src: int) -> int:
        """Offset (int64 words) of source ``src``'s slot of a peer region for ``seq``."""
        r = self.region(name)
        if not r.peer:
            raise ValueError(f"region {name!r} is local: it has no slots")
        return self.offsets[name] + (parity_of(seq) * self.world + src) * r.words

    def describe(self, region_id: int, index: int) -> str:
        """Human name of a word, for health records: ``ar0[parity 1, from rank 3, word 17]``."""
        if not 0 <= region_id < len(self.program.regions):
            return f"<unknown region #{region_id} of {self.program.name!r}>[{index}]"
        r = self.program.regions[region_id]
        if not r.peer:
            return f"{self.program.name}.{r.name}[word {index}]"
        slot, word = divmod(index, r.words)
        parity, src = divmod(slot, self.world)
        return f"{self.program.name}.{r.name}[parity {parity}, from rank {src}, word {word}]"


def _align(n: int) -> int:
    return (n + ALIGN_WORDS - 1) // ALIGN_WORDS * ALIGN_WORDS


def plan_layout(program: Program, world: int = 1) -> Layout:
    """Check the program's hand-offs, then place every region (refuses what could deadlock)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    check_handoffs(program)
    offsets: dict[str, int] = {}
    scratch = peer = 0
    for r in program.regions:
        if r.peer:
            offsets[r.name] = peer
            peer = _align(peer + 2 * world * r.words)
        else:
            offsets[r.name] = scratch
            scratch = _align(scratch + r.words)
    return Layout(program, world, offsets, scratch, peer)
