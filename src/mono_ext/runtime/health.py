"""Health words and control words shared by every persistent launch of one rank.

Two small device blocks per rank, written by the runtime and read by every kernel:

| block   | dtype | words            | writer                      | reader               |
|---------|-------|------------------|-----------------------------|----------------------|
| control | int64 | ``CTRL_WORDS``   | host at init; epoch bumped  | every wait, every    |
|         |       |                  | once per step on the stream | tag computation      |
| health  | int32 | ``HEALTH_WORDS`` | host at init (magic); a     | every wait (sticky   |
|         |       |                  | wait that gives up          | failed word); host   |
|         |       |                  | (record + failed count)     | (FailStop, pinned)   |

The health block layout below MUST MATCH the device code in
``mono_ext/kernels/triton/primitives.py`` (which imports these constants) and the
ctypes mirror :class:`HealthBlockC`; ``tests/runtime/test_runtime_health.py`` checks
sizes and offsets. This module imports neither torch nor triton.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "CTRL_EPOCH",
    "CTRL_DEADLINE_NS",
    "CTRL_RANK",
    "CTRL_WORDS",
    "H_FAILED",
    "H_MAGIC",
    "H_RECORDS",
    "HEALTH_MAGIC",
    "HEALTH_WORDS",
    "MAX_RECORDS",
    "RECORD_FIELDS",
    "RECORD_WORDS",
    "HealthBlockC",
    "HealthLayoutError",
    "HealthSummary",
    "WaitRecord",
    "ctrl_init_words",
    "decode_health",
    "health_init_words",
]

# --- control block (int64 words) -------------------------------------------------------------
CTRL_EPOCH = 0  # step epoch: starts at 0, bumped to 1 before the first step, never reset
CTRL_DEADLINE_NS = 1  # how long one wait may spin, in %globaltimer nanoseconds
CTRL_RANK = 2  # this rank's index in its TP group (kept here so kernels never specialise on it)
CTRL_WORDS = 4  # one spare word; keeps the block 32 bytes

# --- health block (int32 words) --------------------------------------------------------------
H_FAILED = 0  # sticky: number of waits that gave up; any non-zero value makes later waits bail
H_MAGIC = 1  # HEALTH_MAGIC, written by the host, so a decoder can tell it reads the right buffer
H_RECORDS = 4  # first record; words 2-3 are spare
MAX_RECORDS = 8  # records past this are counted in H_FAILED but not stored
RECORD_FIELDS = (
    "region",  # region id: index into the launch's Program.regions
    "index",  # word index inside the region (peer regions: parity/source/word, see Layout)
    "wanted_tag",  # tag the wait expected (low 32 bits of the step sequence)
    "seen_tag",  # tag found in the first word that never matched
    "cta",  # program id of the waiting CTA
    "rank",  # CTRL_RANK of the waiting launch
    "epoch",  # low 32 bits of CTRL_EPOCH when the wait gave up
    "waited_us",  # how long it spun before giving up
)
RECORD_WORDS = len(RECORD_FIELDS)
HEALTH_WORDS = H_RECORDS + MAX_RECORDS * RECORD_WORDS
HEALTH_MAGIC = 0x4D4F4E4F  # "MONO"


class _RecordC(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in RECORD_FIELDS]


class HealthBlockC(ctypes.Structure):
    """ctypes mirror of the device health block (must match the H_* offsets above)."""

    _fields_ = [
        ("failed", ctypes.c_int32),
        ("magic", ctypes.c_int32),
        ("spare", ctypes.c_int32 * 2),
        ("records", _RecordC * MAX_RECORDS),
    ]


class HealthLayoutError(ValueError):
    """Words handed to :func:`decode_health` are not a health block."""


def _s32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def health_init_words() -> list[int]:
    """What the host writes into a fresh health block."""
    words = [0] * HEALTH_WORDS
    words[H_MAGIC] = _s32(HEALTH_MAGIC)
    return words


def ctrl_init_words(rank: int, deadline_s: float) -> list[int]:
    """What the host writes into a fresh control block (epoch 0: no step has run)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if not deadline_s > 0:
        raise ValueError(f"deadline must be positive, got {deadline_s} s")
    words = [0] * CTRL_WORDS
    words[CTRL_DEADLINE_NS] = int(round(deadline_s * 1e9))
    words[CTRL_RANK] = rank
    return words


@dataclass(frozen=True)
class WaitRecord:
    """One wait that gave up, as the device wrote it."""

    region: int
    index: int
    wanted_tag: int
    seen_tag: int
    cta: int
    rank: int
    epoch: int
    waited_us: int

    def describe(self, name_of: Callable[[int, int], str] | None = None) -> str:
        where = (
            name_of(self.region, self.index) if name_of else f"region#{self.region}[{self.index}]"
        )
        return (
            f"{where}: rank {self.rank} CTA {self.cta} wanted tag {self.wanted_tag:#010x}, "
            f"saw {self.seen_tag:#010x} after {self.waited_us} us (epoch {self.epoch})"
        )


@dataclass(frozen=True)
class HealthSummary:
    """A rank's health block, decoded; small and picklable so ranks can exchange it."""

    rank: int
    failed_waits: int
    records: tuple[WaitRecord, ...] = ()
    step: int | None = None  # host step whose copy this was read from, when known

    @property
    def ok(self) -> bool:
        return self.failed_waits == 0

    def describe(self, name_of: Callable[[int, int], str] | None = None) -> str:
        if self.ok:
            return f"rank {self.rank}: healthy"
        lines = [f"rank {self.rank}: {self.failed_waits} wait(s) gave up"]
        lines += ["  " + r.describe(name_of) for r in self.records]
        dropped = self.failed_waits - len(self.records)
        if dropped > 0:
            lines.append(f"  ({dropped} more not recorded: only {MAX_RECORDS} slots)")
        return "\n".join(lines)


def decode_health(words: Sequence[int], rank: int, step: int | None = None) -> HealthSummary:
    """Decode ``HEALTH_WORDS`` int32 values read back from a rank's health block."""
    if len(words) != HEALTH_WORDS:
        raise HealthLayoutError(f"health block has {len(words)} words, expected {HEALTH_WORDS}")
    words = [int(w) for w in words]
    if _s32(words[H_MAGIC]) != _s32(HEALTH_MAGIC):
        raise HealthLayoutError(
            f"health block magic is {words[H_MAGIC] & 0xFFFFFFFF:#010x}, expected "
            f"{HEALTH_MAGIC:#010x}: not an initialised health block (wrong buffer or overwritten)"
        )
    failed = words[H_FAILED]
    records = []
    for i in range(min(max(failed, 0), MAX_RECORDS)):
        base = H_RECORDS + i * RECORD_WORDS
        fields = words[base : base + RECORD_WORDS]
        rec = dict(zip(RECORD_FIELDS, fields, strict=True))
        rec["wanted_tag"] &= 0xFFFFFFFF
        rec["seen_tag"] &= 0xFFFFFFFF
        rec["epoch"] &= 0xFFFFFFFF
        records.append(WaitRecord(**rec))
    return HealthSummary(rank=rank, failed_waits=failed, records=tuple(records), step=step)
