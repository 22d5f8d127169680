"""Check mode: compare a launch's outputs with the engine's own layer code.

Thresholds come from a spec's ``NUMERICS`` (``<launch>.<output>.<metric>``).
Rows whose router top-k is a near tie (the k-th and (k+1)-th scores within one
bf16 step) may legitimately pick a different expert than the engine did; they
are skipped, counted, and the skip rate is bounded so that a broken router
cannot hide behind the tie rule.

End to end, two engine runs (flag off / on) are compared per request with
:func:`greedy_agreement` (greedy tokens equal up to a first divergence, which is
accepted only as a near tie of the two picks in both runs' top-k logprobs) and
:func:`same_context_kl` (:func:`topk_kl` over the positions whose context is
still the same in both runs).
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
    "GreedyAgreement",
    "compare",
    "greedy_agreement",
    "parse_numerics",
    "metrics",
    "same_context_kl",
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


def _by_token(logprobs: Mapping[Any, float]) -> dict[int, float]:
    """``{token id: logprob}`` with int keys (engines' JSON gives ``"17"``, Python ``17``)."""
    return {int(t): float(lp) for t, lp in logprobs.items()}


@dataclass(frozen=True)
class GreedyAgreement:
    """One request's greedy tokens in two runs (``off``, ``on``): see :func:`greedy_agreement`.

    ``agreeing``: positions with equal tokens before the first divergence (all of them when
    there is none). ``divergence``: that first differing position, or None. ``margin_off`` /
    ``margin_on``: at the divergence, each run's logprob of its own pick minus its logprob of
    the other run's pick (None where a pick is missing from that run's top-k, or without a
    divergence). ``near_tie``: the divergence is accepted (``reason`` says why not otherwise).
    """

    length: int
    agreeing: int
    divergence: int | None
    token_off: int | None
    token_on: int | None
    margin_off: float | None
    margin_on: float | None
    tie_nats: float
    near_tie: bool
    reason: str

    @property
    def exact(self) -> bool:
        return self.divergence is None

    @property
    def ok(self) -> bool:
        """Exact, or one accepted near-tie flip (positions after it are not compared)."""
        return self.exact or self.near_tie

    @property
    def same_context(self) -> int:
        """Positions ``0 .. same_context - 1`` were computed from the same context in both runs:
        the agreeing ones and the divergence itself (the tokens differ from there on)."""
        return self.length if self.divergence is None else self.divergence + 1

    def describe(self) -> str:
        if self.exact:
            return f"exact over {self.length} positions"

        def m(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2e}"

        verdict = f"near tie (<= {self.tie_nats:g} nats)" if self.near_tie else self.reason
        return (
            f"first divergence at step {self.divergence}/{self.length} "
            f"(off {self.token_off}, on {self.token_on}; margins off {m(self.margin_off)} "
            f"on {m(self.margin_on)} nats): {verdict}; {self.agreeing} positions agree before it"
        )


def greedy_agreement(
    tokens_off: Sequence[Any],
    tokens_on: Sequence[Any],
    logprobs_off: Sequence[Mapping[Any, float]],
    logprobs_on: Sequence[Mapping[Any, float]],
    tie_nats: float,
) -> GreedyAgreement:
    """Compare one request's greedy tokens from two runs of the same model and prompt.

    ``logprobs_*[i]``: the run's top-k logprobs (full-vocabulary softmax) of the distribution
    it picked ``tokens_*[i]`` from, as ``{token id: logprob}`` (int or str keys).

    Tokens are compared up to the first differing position; later positions are not compared,
    because from there on the two runs continue from different contexts. The divergence is
    accepted as a near tie only when both picks are in both runs' top-k at that position and,
    in each run, the margin (logprob of its own pick minus logprob of the other run's pick) is
    within ``[0, tie_nats]``: both runs saw the two tokens as (almost) equally likely, so a
    rounding difference may pick either. Any other divergence is real. A negative margin
    means a run's logprobs do not rank its own greedy pick first, which is never a tie.

    Near-uniform logits (e.g. a random tiny model) make such flips common under bf16 and a
    different reduction order; vLLM's model tests accept them the same way (``check_logprobs_close``
    in its ``tests/models/utils.py``).
    """
    if not math.isfinite(tie_nats) or tie_nats < 0:
        raise ValueError(f"tie_nats = {tie_nats!r} is not a finite, non-negative margin")
    a, b = [int(t) for t in tokens_off], [int(t) for t in tokens_on]
    if len(a) != len(b):
        raise ValueError(f"token counts differ: off {len(a)}, on {len(b)}")
    for name, lps in (("off", logprobs_off), ("on", logprobs_on)):
        if len(lps) != len(a):
            raise ValueError(f"{name}: {len(lps)} logprob positions for {len(a)} tokens")
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    if first is None:
        return GreedyAgreement(len(a), len(a), None, None, None, None, None, tie_nats, False, "")

    x, y = a[first], b[first]
    lp_off, lp_on = _by_token(logprobs_off[first]), _by_token(logprobs_on[first])
    missing = [
        f"{tok} ({who}'s pick) not in {run}'s top-{len(lps)}"
        for run, lps in (("off", lp_off), ("on", lp_on))
        for tok, who in ((x, "off"), (y, "on"))
        if tok not in lps
    ]
    margin_off = lp_off[x] - lp_off[y] if x in lp_off and y in lp_off else None
    margin_on = lp_on[y] - lp_on[x] if x in lp_on and y in lp_on else None
    problems = list(missing)
    for run, margin in (("off", margin_off), ("on", margin_on)):
        if margin is not None and not 0.0 <= margin <= tie_nats:
            problems.append(f"{run} margin {margin:.3g} outside [0, {tie_nats:g}]")
    reason = "real divergence: " + "; ".join(problems) if problems else ""
    return GreedyAgreement(
        len(a), first, first, x, y, margin_off, margin_on, tie_nats, not problems, reason
    )


def same_context_kl(
    logprobs_off: Sequence[Mapping[Any, float]],
    logprobs_on: Sequence[Mapping[Any, float]],
    agreement: GreedyAgreement,
    *,
    start: int = 0,
) -> list[tuple[float, float]]:
    """:func:`topk_kl` ``(off || on)`` at positions ``start .. agreement.same_context - 1``.

    Only those positions had the same context in both runs (the agreeing ones and the first
    divergence, whose distributions are still conditioned on equal tokens); after a divergence
    the runs continue different texts, and their KL would measure that, not the numerics.
    ``start=1`` skips the prefill's position. Keys may be int or str. Returns (kl, off's mass
    on the shared tokens) per position."""
    end = agreement.same_context
    if len(logprobs_off) < end or len(logprobs_on) < end:
        raise ValueError(
            f"{len(logprobs_off)}/{len(logprobs_on)} logprob positions for {end} compared ones"
        )
    return [
        topk_kl(_by_token(logprobs_off[i]), _by_token(logprobs_on[i])) for i in range(start, end)
    ]
