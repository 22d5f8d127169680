"""The pure parts shared by the end-to-end benchmarks (``e2e_vllm.py``, ``e2e_sglang.py``):
no engine, no torch.

* TPOT by the delta method, the least-squares line over layer counts (per-layer slope and
  intercept) and the summary rows built from them (:func:`tpot_rows`);
* the bandwidth floor: bytes one decoder layer must move per decode step (dense weights once,
  the expected distinct routed experts ``E * (1 - (1 - k/E)**B)``, GDN state read + written
  per row, KV read per row at the mean context), per layer over the layers a slope adds, and
  for the whole model with the lm_head;
* plan selection and result merging across device calls; greedy agreement and KL(off || on)
  of top-k logprobs between two runs of the same prompts (:func:`compare_runs`);
* a decode step's device time from profiled runs: busy (the union of its kernels' and
  copies' intervals), idle, and the kernels by time (:func:`gpu_step_summary`); over layer
  counts, what of the fitted intercept per-step work is and what kernels run once per layer
  at a cost that changes with depth (:func:`intercept_parts`).

tests/tools/test_e2e_bench_math.py exercises these through ``e2e_vllm`` (which re-exports
them) and ``tests/tools/test_e2e_sglang_bench.py`` through ``e2e_sglang``.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from typing import Any


def delta_tpot(t_n1: float, t_n2: float, n1: int, n2: int) -> float:
    """Seconds per decode step from two generate times: (T(N2) - T(N1)) / (N2 - N1)."""
    if n2 <= n1:
        raise ValueError(f"need N2 > N1, got {n1}, {n2}")
    return (t_n2 - t_n1) / (n2 - n1)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys over xs (exact through two points)."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("need at least two distinct x values")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: the time something ran, counting
    overlapping work (two streams, a copy beside a kernel) once."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def gpu_step_summary(
    ev1: list[tuple[str, float, float]],
    ev2: list[tuple[str, float, float]],
    n1: int,
    n2: int,
    tpot_s: float,
    top: int = 40,
) -> dict[str, Any]:
    """Per decode step, from the device events ``(name, start_us, end_us)`` of one generate
    of ``n1`` and one of ``n2`` tokens: what the second run has more, over ``n2 - n1`` (the
    delta method of :func:`delta_tpot`, so prefill and start-up cancel). ``busy_us`` is the
    union of the events' intervals, ``idle_us`` the step's TPOT (from the timed reps) minus
    it: time the device waited on the host; ``overlap_us`` the events' summed time minus busy:
    time they ran alongside one another (two streams, a copy under a kernel). ``kernels``: the
    ``top`` names by time per step, with launches per step."""
    steps = n2 - n1
    if steps <= 0:
        raise ValueError(f"need N2 > N1, got {n1}, {n2}")

    def by_name(ev: list[tuple[str, float, float]]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for name, a, b in ev:
            t = out.setdefault(name, [0.0, 0.0])
            t[0] += b - a
            t[1] += 1
        return out

    t1, t2 = by_name(ev1), by_name(ev2)
    busy = (busy_us([(a, b) for _, a, b in ev2]) - busy_us([(a, b) for _, a, b in ev1])) / steps
    kernels = [
        dict(
            name=name,
            us_per_step=round((t2[name][0] - t1.get(name, [0.0, 0.0])[0]) / steps, 3),
            calls_per_step=round((t2[name][1] - t1.get(name, [0.0, 0.0])[1]) / steps, 3),
        )
        for name in t2
    ]
    kernels.sort(key=lambda k: -k["us_per_step"])
    summed = (sum(t[0] for t in t2.values()) - sum(t[0] for t in t1.values())) / steps
    tpot_us = tpot_s * 1e6
    return dict(
        tpot_us=round(tpot_us, 2),
        busy_us=round(busy, 2),
        idle_us=round(tpot_us - busy, 2),
        overlap_us=round(summed - busy, 2),
        events_per_step=round((len(ev2) - len(ev1)) / steps, 2),
        kernels=kernels[:top],
    )


def intercept_parts(profiles: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Where the intercept of a fit over layer counts comes from, per decode step, given one
    arm's :func:`gpu_step_summary` at each of two or more layer counts (layers -> summary).

    A kernel launched once per step whatever the depth (the logits GEMM, sampling, an
    adapter's own copies) is per-step work: ``step_kernels_us``, its mean time per step. A
    kernel launched a fixed number of times per layer adds to the intercept only if its time
    per call changes with depth (an MoE whose rows hit fewer experts in later layers):
    ``layer_kernels_intercept_us``, the sum of those kernels' own fitted intercepts, and the
    largest of them in ``layer_kernels``. ``unattributed_us`` is the busy intercept neither
    explains (kernels outside the summaries' top lists, or launched another way). Only
    kernels present at every layer count are classed; the summaries keep a top few each."""
    layers = sorted(profiles)
    if len(layers) < 2:
        raise ValueError(f"need two or more layer counts, got {layers}")
    xs = [float(n) for n in layers]

    def fit(values: list[float]) -> tuple[float, float]:
        return fit_line(xs, values)

    busy_slope, busy_icpt = fit([profiles[n]["busy_us"] for n in layers])
    _, idle_icpt = fit([profiles[n]["idle_us"] for n in layers])
    tpot_slope, tpot_icpt = fit([profiles[n]["tpot_us"] for n in layers])
    per = [{k["name"]: k for k in profiles[n]["kernels"]} for n in layers]
    common = set(per[0]).intersection(*per[1:])
    step_us, layer_icpt, parts = 0.0, 0.0, []
    for name in sorted(common):
        calls = [p[name]["calls_per_step"] for p in per]
        times = [p[name]["us_per_step"] for p in per]
        if all(math.isclose(c, calls[0], rel_tol=0.01) for c in calls):
            step_us += statistics.fmean(times)
        elif calls[0] > 0 and all(
            math.isclose(c / n, calls[0] / layers[0], rel_tol=0.01)
            for c, n in zip(calls, layers, strict=True)
        ):
            icpt = fit(times)[1]
            layer_icpt += icpt
            parts.append({"name": name, "intercept_us": round(icpt, 2),
                          "us_per_call": [round(t / c, 2) for t, c in zip(times, calls,
                                                                          strict=True)]})  # fmt: skip
    parts.sort(key=lambda p: -abs(p["intercept_us"]))
    return {
        "layers": layers,
        "tpot_per_layer_us": round(tpot_slope, 2),
        "tpot_intercept_us": round(tpot_icpt, 2),
        "busy_per_layer_us": round(busy_slope, 2),
        "busy_intercept_us": round(busy_icpt, 2),
        "idle_intercept_us": round(idle_icpt, 2),
        "layer_kernels_intercept_us": round(layer_icpt, 2),
        "step_kernels_us": round(step_us, 2),
        "unattributed_us": round(busy_icpt - layer_icpt - step_us, 2),
        "layer_kernels": parts[:5],
    }


def expected_distinct(experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts picked by ``rows`` rows of ``top_k`` distinct picks each,
    rows independent and uniform: E * (1 - (1 - k/E)**B)."""
    if experts <= 0 or top_k <= 0 or rows <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def _plane_bytes(shape: tuple[int, ...], wbytes: int, fp8: bool) -> float:
    """Bytes of one weight plane: ``wbytes`` per weight, or (``fp8``) one byte per e4m3 code
    plus an fp32 scale per 128x128 block of its last two dims."""
    n = math.prod(shape)
    if not fp8:
        return n * wbytes
    *lead, rows, cols = shape
    return n + math.prod(lead) * math.ceil(rows / 128) * math.ceil(cols / 128) * 4


def layer_bytes(
    dims: Any,
    kind: str,
    rows: int,
    ctx: float,
    wbytes: int = 2,
    state_bytes: int = 2,
    fp8_planes: frozenset[str] | set[str] = frozenset(),
) -> dict[str, float]:
    """Bytes one decoder layer of ``kind`` must move for one decode step of ``rows`` rows
    (TP 1), by component. ``ctx``: mean context length (KV positions read per row);
    ``fp8_planes``: the planes stored as fp8 block-128 codes and scales."""
    h = dims.hidden
    dense = 0.0
    for name, shape in dims.planes(kind).items():
        if name not in ("w13", "w2"):
            dense += _plane_bytes(shape, wbytes, name in fp8_planes)
    # one routed expert: its slices of w13 [2I, H] and w2 [H, I]
    expert = _plane_bytes((2 * dims.moe_inter, h), wbytes, "w13" in fp8_planes)
    expert += _plane_bytes((h, dims.moe_inter), wbytes, "w2" in fp8_planes)
    out = {
        "dense_weights": dense,
        "experts": expected_distinct(dims.experts, dims.top_k, rows) * expert,
        "gdn_state": 0.0,
        "kv": 0.0,
    }
    if kind == "linear_attention":
        ssm = dims.hv * dims.dv * dims.dk * state_bytes
        conv = (dims.conv_k - 1) * dims.conv_dim_r * wbytes
        out["gdn_state"] = 2.0 * rows * (ssm + conv)  # read + write
    elif kind == "full_attention":
        per_pos = 2 * dims.hkv * dims.head_dim * wbytes  # K and V
        out["kv"] = rows * (ctx * per_pos + per_pos)  # read the context, write the new token
    else:
        raise ValueError(f"unknown layer kind {kind!r}")
    out["total"] = sum(out.values())
    return out


def kinds_for(n_layers: int, interval: int = 4) -> list[str]:
    """Layer kinds of a cut model: every ``interval``-th layer (1-based) full attention."""
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    ]


def model_bytes(dims: Any, n_layers: int, rows: int, ctx: float, **kw: Any) -> float:
    """Bytes of ``n_layers`` layers of ``dims`` (kinds as in the cut config)."""
    return sum(layer_bytes(dims, k, rows, ctx, **kw)["total"] for k in kinds_for(n_layers))


def floor_per_layer(
    dims: Any, layers: list[int], rows: int, ctx: float, bw: float, **kw: Any
) -> dict[str, float]:
    """Floor per layer (seconds) over the layers the slope adds (lo -> hi layer count), the
    bytes per layer behind it, and the 48-layer (``dims.num_layers``) step floor with the
    lm_head read once."""
    lo, hi = min(layers), max(layers)
    if hi == lo:
        per_layer = model_bytes(dims, hi, rows, ctx, **kw) / hi
    else:
        per_layer = (
            model_bytes(dims, hi, rows, ctx, **kw) - model_bytes(dims, lo, rows, ctx, **kw)
        ) / (hi - lo)
    wbytes = kw.get("wbytes", 2)
    lm_head = dims_vocab(dims) * dims.hidden * wbytes
    full = model_bytes(dims, dims.num_layers, rows, ctx, **kw) + lm_head
    return {
        "bytes_per_layer": per_layer,
        "s_per_layer": per_layer / bw,
        "lm_head_bytes": lm_head,
        "s_full_model": full / bw,
    }


def dims_vocab(dims: Any) -> int:
    return int(getattr(dims, "vocab", 0) or 0)


def select(plan: list[dict], only: list[str] | None, done: set[str], redo: bool) -> list[dict]:
    """Plan entries matching any ``only`` glob (all without), minus those already done."""
    out = []
    for e in plan:
        if only and not any(fnmatch.fnmatch(e["id"], p) for p in only):
            continue
        if e["id"] in done and not redo:
            continue
        out.append(e)
    return out


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Results of several calls: ``runs`` merge by id (the newer run of an id wins), ``meta``
    keeps every call's entry in ``calls``."""
    out = {"runs": dict(old.get("runs", {})), "meta": dict(old.get("meta", {}))}
    out["runs"].update(new.get("runs", {}))
    calls = list(old.get("meta", {}).get("calls", []))
    for c in new.get("meta", {}).get("calls", []):
        if c not in calls:
            calls.append(c)
    out["meta"].update({k: v for k, v in new.get("meta", {}).items() if k != "calls"})
    out["meta"]["calls"] = calls
    return out


def compare_runs(ref: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Greedy agreement and KL of one batch's accuracy pass against a reference pass.

    ``ref``/``run``: {"tokens": [[ids] per row], "logprobs": [[{tok: lp}] per row]}.
    Position 0 of each row is the prefill's token; decode positions are 1.."""
    from mono_ext.core.numerics import topk_kl

    agree, full_rows, kls, margins = [], 0, [], []
    for r, (a, b) in enumerate(zip(ref["tokens"], run["tokens"], strict=True)):
        n = min(len(a), len(b))
        first = next((i for i in range(n) if a[i] != b[i]), None)
        matched = n if first is None else first
        agree.append(matched / max(n, 1))  # over the tokens both runs produced
        full_rows += first is None
        last = n - 1 if first is None else first  # same context up to and incl. `first`
        lps_a, lps_b = ref["logprobs"][r], run["logprobs"][r]
        for i in range(1, min(last + 1, len(lps_a), len(lps_b))):
            kls.append(topk_kl(lps_a[i], lps_b[i])[0])
        if first is not None and first < len(lps_a):
            top = sorted(lps_a[first].values(), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return {
        "agreement": sum(agree) / len(agree) if agree else float("nan"),
        "rows_identical": full_rows,
        "rows": len(agree),
        "kl_mean": sum(kls) / len(kls) if kls else float("nan"),
        "kl_max": max(kls) if kls else float("nan"),
        "kl_positions": len(kls),
        "divergence_margins": margins,
    }


def tpot_rows(
    tp: dict[tuple[str, int, int], list[float]],
    dims: Any,
    *,
    bw: float | None,
    ctx: float,
    state_bytes: int = 2,
    fp8_planes: frozenset[str] | set[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Summary rows per (arm, batch) from TPOT seconds per (arm, layers, batch) (every run's
    value; the median is taken): TPOT per layer count, and with two or more layer counts the
    per-layer slope, intercept and TPOT at ``dims.num_layers``; with the copy bandwidth
    ``bw`` also the floor per layer, its fraction reached and the full-model floor
    (``fp8_planes`` as in :func:`layer_bytes`)."""
    rows = []
    arms = sorted({k[0] for k in tp}, key=lambda s: (s != "off", s))
    batches = sorted({k[2] for k in tp})
    for arm in arms:
        for b in batches:
            pts = sorted(
                (n, statistics.median(v)) for (a_, n, b_), v in tp.items() if a_ == arm and b_ == b
            )
            if not pts:
                continue
            row: dict[str, Any] = {"arm": arm, "batch": b}
            for n, v in pts:
                row[f"tpot_L{n}_ms"] = v * 1e3
            layers = [n for n, _ in pts]
            if len(set(layers)) >= 2:
                slope, icpt = fit_line([float(n) for n in layers], [v for _, v in pts])
                row.update(
                    per_layer_us=slope * 1e6,
                    intercept_ms=icpt * 1e3,
                    tpot_L48_ms=(icpt + dims.num_layers * slope) * 1e3,
                )
                if bw:
                    fl = floor_per_layer(dims, layers, b, ctx, bw, state_bytes=state_bytes,
                                         fp8_planes=fp8_planes)  # fmt: skip
                    row.update(
                        floor_per_layer_us=fl["s_per_layer"] * 1e6,
                        floor_bytes_per_layer_MB=fl["bytes_per_layer"] / 1e6,
                        floor_fraction=fl["s_per_layer"] / slope if slope > 0 else None,
                        floor_L48_ms=fl["s_full_model"] * 1e3,
                    )
            rows.append(row)
    return rows


def accuracy_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every offline run (ids ``L<n>/<arm>/<rep>``) against the first ``off`` run of its layer
    count, batch by batch; each ``on`` run after the first also against that first ``on`` run
    (the on-vs-on noise floor). Rows: :func:`compare_runs` plus run, vs, batch."""
    acc = []
    for r_id, r in sorted(runs.items()):
        e = r["entry"]
        if e["kind"] != "offline":  # check runs: own weights and own verdict
            continue
        ref = runs.get(f"L{e['layers']}/off/0")
        if ref is None or r_id == f"L{e['layers']}/off/0":
            continue
        for b, row in r["batches"].items():
            if b in ref["batches"]:
                c = compare_runs(ref["batches"][b], row)
                c.update(run=r_id, vs=f"L{e['layers']}/off/0", batch=int(b))
                acc.append(c)
        same = [k for k in runs if k.startswith(f"L{e['layers']}/on/") and k != r_id]
        if e.get("arm") == "on" and same and same[0] < r_id:
            for b, row in r["batches"].items():
                c = compare_runs(runs[same[0]]["batches"][b], row)
                c.update(run=r_id, vs=same[0], batch=int(b))
                acc.append(c)
    return acc
