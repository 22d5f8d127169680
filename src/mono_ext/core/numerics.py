"""Check mode: compare a launch's outputs with the engine's own layer code.

Thresholds come from a spec's ``NUMERICS`` (``<launch>.<output>.<metric>``).
Rows whose router top-k is a near tie (the k-th and (k+1)-th scores within one
bf16 step) may legitimately pick a different expert than the engine did; they
are skipped, counted, and the skip rate is bounded so that a broken router
cannot hide behind the tie rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "METRICS",
    "Breach",
    "CheckTracker",
    "compare",
    "parse_numerics",
    "metrics",
    "topk_kl",
]

#: metric -> True when it is a lower bound (larger is better)
METRICS: dict[str, bool] = {"cosine": True, "rel_l2": False, "max_abs": False}


@dataclass(frozen=True)
class Breach:
    name: str  # <launch>.<output>.<metric>
    value: float
    threshold: float
    where: str = ""  # e.g. "layer 3"

    def __str__(self) -> str:
        op = ">=" if METRICS[self.name.rsplit(".", 1)[1]] else "<="
        loc = f"{self.where}: " if self.where else ""
        return f"{loc}{self.name} = {self.value:.6g} (needs {op} {self.threshold:g})"


def parse_numerics(numerics: Mapping[str, float]) -> dict[tuple[str, str], dict[str, float]]:
    """Group ``<launch>.<output>.<metric>`` thresholds by (launch, output); validate names."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for name, value in numerics.items():
        parts = name.split(".")
        if len(parts) != 3 or not all(parts) or parts[2] not in METRICS:
            raise ValueError(
                f"NUMERICS name {name!r} is not <launch>.<output>.<metric> with metric in "
                f"{sorted(METRICS)}"
            )
        if not math.isfinite(value):
            raise ValueError(f"NUMERICS {name} = {value!r} is not a finite threshold")
        out.setdefault((parts[0], parts[1]), {})[parts[2]] = float(value)
    return out


def metrics(out: Any, ref: Any) -> dict[str, float]:
    """cosine, rel_l2 and max_abs of ``out`` against ``ref``, in float64 (NaN-aware)."""
    a = out.detach().double().flatten()
    b = ref.detach().double().flatten()
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    if a.numel() == 0:
        raise ValueError("nothing to compare: both tensors are empty")
    diff = a - b
    ref_norm = float(b.norm())
    denom = float(a.norm()) * ref_norm
    nan = math.nan
    finite = bool(a.isfinite().all()) and bool(b.isfinite().all())
    return {
        # A NaN anywhere must fail every metric, never pass one by accident.
        "cosine": float(a.dot(b)) / denom if finite and denom > 0 else nan,
        "rel_l2": float(diff.norm()) / ref_norm if finite and ref_norm > 0 else nan,
        "max_abs": float(diff.abs().max()) if finite else nan,
    }


def _fails(metric: str, value: float, threshold: float) -> bool:
    if math.isnan(value):
        return True
    return value < threshold if METRICS[metric] else value > threshold


def compare(
    launch: str,
    output: str,
    out: Any,
    ref: Any,
    numerics: Mapping[str, float],
    *,
    where: str = "",
) -> list[Breach]:
    """Breaches of ``numerics`` for one output; an output with no thresholds is an error."""
    thresholds = parse_numerics(numerics).get((launch, output))
    if not thresholds:
        raise KeyError(f"NUMERICS has no thresholds for {launch}.{output}")
    got = metrics(out, ref)
    return [
        Breach(f"{launch}.{output}.{m}", got[m], t, where)
        for m, t in sorted(thresholds.items())
        if _fails(m, got[m], t)
    ]


@dataclass
class CheckTracker:
    """Counts checks, breaches and near-tie skips over a check-mode run."""

    numerics: Mapping[str, float]
    max_skip_rate: float = 0.05
    checks: int = 0
    rows_seen: int = 0
    rows_skipped: int = 0
    breaches: list[Breach] = field(default_factory=list)

    def check(
        self,
        launch: str,
        output: str,
        out: Any,
        ref: Any,
        *,
        skip_rows: Sequence[bool] | Any | None = None,
        where: str = "",
    ) -> list[Breach]:
        """Compare row-major ``out``/``ref`` (rows first), leaving out rows flagged in ``skip_rows``."""
        self.checks += 1
        rows = out.shape[0]
        self.rows_seen += rows
        if skip_rows is not None:
            import torch  # lazy: core imports without torch

            keep = ~torch.as_tensor(skip_rows, dtype=torch.bool, device=out.device)
            if keep.numel() != rows:
                raise ValueError(f"skip_rows has {keep.numel()} flags for {rows} rows")
            self.rows_skipped += rows - int(keep.sum())
            out, ref = out[keep], ref[keep]
            if out.shape[0] == 0:
                return []
        found = compare(launch, output, out, ref, self.numerics, where=where)
        self.breaches.extend(found)
        return found

    @property
    def skip_rate(self) -> float:
        return self.rows_skipped / self.rows_seen if self.rows_seen else 0.0

    def problems(self) -> list[str]:
        """Every reason this run fails check mode (empty: clean)."""
        out = [str(b) for b in self.breaches]
        if self.skip_rate > self.max_skip_rate:
            out.append(
                f"router near-tie skips {self.rows_skipped}/{self.rows_seen} rows "
                f"({self.skip_rate:.1%}) exceed the bound {self.max_skip_rate:.1%}"
            )
        return out

    def summary(self) -> str:
        return (
            f"{self.checks} checks, {len(self.breaches)} breaches, "
            f"{self.rows_skipped}/{self.rows_seen} near-tie rows skipped"
        )


def topk_kl(p: Mapping[Any, float], q: Mapping[Any, float]) -> tuple[float, float]:
    """KL(p || q) from two engines' top-k logprobs of one position (token -> logprob, each
    from the full-vocabulary softmax): the tokens in both top-k lists, plus one bucket for
    the rest of each distribution. Merging outcomes never raises a KL (log-sum inequality),
    so this is a lower bound of the full-vocabulary KL. Returns (kl, p's mass on the shared
    tokens) so a caller can tell how much of p the bound saw."""
    shared = set(p) & set(q)
    kl = pm = qm = 0.0
    for t in shared:
        lp, lq = p[t], q[t]
        kl += math.exp(lp) * (lp - lq)
        pm += math.exp(lp)
        qm += math.exp(lq)
    rp, rq = max(1.0 - pm, 0.0), max(1.0 - qm, 1e-12)
    if rp > 0:
        kl += rp * math.log(rp / rq)
    return kl, pm
