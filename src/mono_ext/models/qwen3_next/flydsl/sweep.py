"""Compile every gfx950 launch of the flydsl backend offline, check each, and print the table
of docs/journal.md's "FlyDSL gfx950 (compile-only)" entry.

    python -m mono_ext.models.qwen3_next.flydsl.sweep [--jobs N] [--all]

What is swept: the runtime launches (mailbox hand-off, one-shot all-reduce at TP 1/2/4/8) and
K2 (GDN and attention layers) and K1 (attention front; GDN front with the default layouts:
interleaved packing, time_chan [S, K-1, C] conv state, vk fp32 state), Qwen3-Next-80B-A3B
sizes at TP 1, at widths 1, 2, 4, 8, 16, or at every width 1..16 with ``--all`` (what CI's
flydsl stage runs). The other GDN layout combinations compile in
``tests/models/qwen3_next/flydsl/test_flydsl_k1.py``.
Keys compile in parallel processes (each one a fresh LLVM); nothing is cached across runs.
Exit status 1 when any launch fails to compile or breaks a limit.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

__all__ = ["targets", "compile_target", "table", "main"]


CI_WIDTHS = (1, 2, 4, 8, 16)


def targets(all_widths: bool = False) -> list[tuple[str, dict]]:
    """(builder name, kwargs) of every launch the backend compiles (K2 at ``CI_WIDTHS``, or
    every width 1..16 with ``all_widths``)."""
    out: list[tuple[str, dict]] = [("build_mailbox", {})]
    out += [("build_allreduce", {"world": w}) for w in (1, 2, 4, 8)]
    widths = range(1, 17) if all_widths else CI_WIDTHS
    # widest first: the longest compiles start first in the pool
    out += [("build_k2", {"kind": k, "width": w}) for w in sorted(widths, reverse=True)
            for k in ("gdn", "attn")]  # fmt: skip
    out += [("build_k1_attn", {"width": w}) for w in sorted(widths, reverse=True)]
    out += [("build_k1_gdn", {"width": w}) for w in sorted(widths, reverse=True)]
    return out


def compile_target(target: tuple[str, dict]) -> tuple[str, list[dict], list[str], str]:
    """(label, kernel metadata rows, check reasons, error) for one target; never raises."""
    from mono_ext.kernels.flydsl import runtime
    from mono_ext.models.qwen3_next.flydsl import k1, k2

    name, kwargs = target
    label = f"{name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    module = {"build_k2": k2, "build_k1_attn": k1, "build_k1_gdn": k1}.get(name, runtime)
    try:
        c = getattr(module, name)(**kwargs)
    except Exception as exc:  # a kernel that does not compile is a result, reported
        return label, [], [], f"{type(exc).__name__}: {exc}"
    return c.label, [k.row() for k in c.kernels], c.reasons(), ""


def table(results) -> str:
    lines = [
        "| launch | kernel | VGPR (arch/acc) | SGPR | LDS bytes | scratch | spills | CTAs/CU | check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rows, reasons, error in results:
        if error:
            lines.append(f"| {label} | - | - | - | - | - | - | - | does not compile: {error} |")
            continue
        for r in rows:
            from mono_ext.kernels.flydsl.toolchain import KernelMeta

            meta = KernelMeta(**{k: v for k, v in r.items() if k != "unified_vgprs"})
            verdict = "ok" if not reasons else "; ".join(reasons)
            lines.append(
                f"| {label} | {r['name']} | {r['vgpr_count']}/{r['agpr_count']} | "
                f"{r['sgpr_count']} | {r['lds_bytes']} | {r['scratch_bytes']} | "
                f"{r['vgpr_spill_count'] + r['sgpr_spill_count']} | {meta.ctas_per_cu()} | "
                f"{verdict} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile processes")
    ap.add_argument("--all", action="store_true", help="K2 at every width 1..16")
    args = ap.parse_args(argv)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(compile_target, targets(args.all)))
    print(table(results))
    bad = [r for r in results if r[3] or r[2]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
