"""Compile every gfx950 launch of the flydsl backend offline, check each, and print the table
of docs/perf.md's "FlyDSL gfx950 (compile-only)" section.

    python -m mono_ext.kernels.flydsl.sweep [--jobs N]

What is swept today: the runtime launches (mailbox hand-off, one-shot all-reduce at TP 1/2/4/8).
K1 and K2 are not written in FlyDSL yet (``backend.NOT_BUILT``), so there is no per-width key
to compile; when they exist, their (layer kind, width 1..16) keys join :func:`targets`.
Keys compile in parallel processes (each one a fresh LLVM); nothing is cached across runs.
Exit status 1 when any launch fails to compile or breaks a limit.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

__all__ = ["targets", "compile_target", "table", "main"]


def targets() -> list[tuple[str, dict]]:
    """(builder name, kwargs) of every launch the backend compiles."""
    out: list[tuple[str, dict]] = [("build_mailbox", {})]
    out += [("build_allreduce", {"world": w}) for w in (1, 2, 4, 8)]
    return out


def compile_target(target: tuple[str, dict]) -> tuple[str, list[dict], list[str], str]:
    """(label, kernel metadata rows, check reasons, error) for one target; never raises."""
    from . import runtime

    name, kwargs = target
    label = f"{name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    try:
        c = getattr(runtime, name)(**kwargs)
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
            from .toolchain import KernelMeta

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
    args = ap.parse_args(argv)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(compile_target, targets()))
    print(table(results))
    bad = [r for r in results if r[3] or r[2]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
