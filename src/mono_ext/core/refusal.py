"""Refusals: every reason mono_ext will not serve a deployment, and agreement across TP ranks.

Refusal is default-deny and comes in three stages (config before weights load,
model after load, caches at every bind). Each stage collects *every* reason so
an operator fixes a deployment in one pass, and TP ranks union their reasons so
that all ranks take the same path: a rank serving kernels while its peer runs
the stock forward would deadlock inside the first all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["Stage", "Refusal", "agree", "OFF_PREFIX"]

#: Every log line announcing that mono_ext is off starts with this.
OFF_PREFIX = "mono_ext off: "


class Stage(str, Enum):
    CONFIG = "config"
    MODEL = "model"
    CACHES = "caches"


@dataclass(frozen=True)
class Refusal:
    """The reasons one stage refuses (empty: the stage accepts)."""

    stage: Stage
    reasons: tuple[str, ...] = ()

    @classmethod
    def of(cls, stage: Stage | str, reasons: Iterable[str]) -> Refusal:
        # Keep first-seen order but drop repeats: many layers often fail for one cause.
        return cls(Stage(stage), tuple(dict.fromkeys(str(r) for r in reasons)))

    @property
    def refused(self) -> bool:
        return bool(self.reasons)

    def __bool__(self) -> bool:
        return self.refused

    def message(self) -> str:
        """One log line naming every reason, e.g. ``mono_ext off: [config] a; b``."""
        if not self.reasons:
            return f"mono_ext on: [{self.stage.value}] accepted"
        return f"{OFF_PREFIX}[{self.stage.value}] " + "; ".join(self.reasons)

    def merged(self, other: Refusal) -> Refusal:
        if other.stage is not self.stage:
            raise ValueError(f"cannot merge a {other.stage.value} refusal into {self.stage.value}")
        return Refusal.of(self.stage, self.reasons + other.reasons)


def agree(refusal: Refusal, group: Any = None) -> Refusal:
    """Union the reasons of ``refusal`` over every rank of a CPU process group.

    ``group`` is a ``torch.distributed`` process group whose backend moves Python
    objects on the CPU (gloo); ``None`` means "no group": a single process, whose
    own refusal is the answer. Every rank gets the same, rank-ordered union, so
    all ranks refuse together or serve together. A reason that only some ranks
    give is prefixed with those ranks (``ranks 1,3: ...``) so the log says where
    it came from.
    """
    if group is None:
        return refusal
    import torch.distributed as dist  # lazy: core must import on a machine without torch

    world = dist.get_world_size(group)
    if world == 1:
        return refusal
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (refusal.stage.value, list(refusal.reasons)), group=group)
    stages = {stage for stage, _ in gathered}
    if stages != {refusal.stage.value}:
        raise RuntimeError(
            f"mono_ext: TP ranks disagree on the refusal stage ({sorted(stages)}); "
            "every rank must run the same stage at the same time"
        )
    who: dict[str, list[int]] = {}
    for rank, (_, theirs) in enumerate(gathered):
        for reason in theirs:
            who.setdefault(reason, []).append(rank)
    reasons = [
        reason if len(ranks) == world else f"ranks {','.join(map(str, ranks))}: {reason}"
        for reason, ranks in who.items()
    ]
    return Refusal.of(refusal.stage, reasons)
