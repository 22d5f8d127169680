#!/usr/bin/env python3
"""Digest of the code K1 and K2 compile to for sm_90a, without a GPU.

    PYTHONPATH=src .venvs/base/bin/python tools/ptx_digest.py [--json out.json]
        [--check baseline.json] [--ptx-dir DIR] [--only SUBSTRING] [--widths 1,16]
        [--by-function N]

Compiles every build of ``mono_ext.models.qwen3_next.triton.offline`` (the arguments and
constexprs each launch's ``build()`` warms up with) for ``GPUTarget("cuda", 90, 32)`` and
prints, per build, the sha256 of its normalised PTX (no line info, file names, comments or
DWARF: a restructuring of the sources that generates the same code keeps the digest), the
registers per thread, stack bytes, spill instructions (STL/LDL in the SASS), shared memory per
block and the number of ``wgmma.mma_async`` instructions. ``--check`` compares the digests
with an earlier ``--json`` and exits 1 on any difference; ``--ptx-dir`` writes each build's
normalised PTX there (to diff two runs); ``--by-function N`` adds each build's SASS
instruction count by source function (``offline.sass_by_function``), the top N printed.

Compiles go to a fresh Triton cache (``TRITON_CACHE_DIR`` unless ``--cache`` is given), so no
result comes from an earlier source.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--check", help="compare digests with this earlier --json; 1 if any differ")
    ap.add_argument("--ptx-dir", help="write each build's normalised PTX into this folder")
    ap.add_argument("--only", action="append", default=[], help="builds whose name has this")
    ap.add_argument("--widths", default="1,16", help="comma-separated widths (default 1,16)")
    ap.add_argument("--cache", action="store_true", help="use the usual Triton cache")
    ap.add_argument("--by-function", type=int, default=0, metavar="N",
                    help="also print each build's N source functions with the most SASS "
                         "instructions (the code size each inlined helper adds)")  # fmt: skip
    args = ap.parse_args(argv)

    os.environ.pop("TRITON_INTERPRET", None)
    if not args.cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ptx_digest_")

    from mono_ext.kernels.triton.offline import (
        normalised_ptx,
        ptx_digest,
        resources,
        sass_by_function,
    )
    from mono_ext.models.qwen3_next.triton.offline import build_names, offline_build

    widths = [int(w) for w in args.widths.split(",")]
    names = [n for n in build_names() if not args.only or any(o in n for o in args.only)]
    rows = []
    hdr = f"{'build':<28} {'sha256 (normalised PTX)':<64} {'regs':>4} {'stack':>5} "
    hdr += f"{'spill':>5} {'shared':>7} {'wgmma':>5} {'s':>5}"
    print(hdr)
    for name in names:
        for w in widths:
            b = offline_build(name, w)
            t0 = time.time()
            compiled = b.compile()
            dt = time.time() - t0
            r = resources(compiled)
            ptx = compiled.asm["ptx"]
            row = dict(
                build=b.name,
                label=b.label,
                sha256=ptx_digest(compiled),
                regs=r.regs,
                stack=r.stack,
                spill_stores=r.spill_stores,
                spill_loads=r.spill_loads,
                shared=r.shared,
                num_warps=r.num_warps,
                wgmma=ptx.count("wgmma.mma_async"),
            )
            rows.append(row)
            spill = f"{r.spill_stores}/{r.spill_loads}"
            print(f"{b.name:<28} {row['sha256']} {r.regs:>4} {r.stack:>5} {spill:>5} "
                  f"{r.shared:>7} {row['wgmma']:>5} {dt:>5.1f}", flush=True)  # fmt: skip
            if args.by_function:
                code = sass_by_function(compiled)
                total = sum(code.values())
                row["sass_instructions"] = total
                row["sass_by_function"] = code
                for fn, n in sorted(code.items(), key=lambda kv: -kv[1])[: args.by_function]:
                    print(f"    {n:6d} {100 * n / total:5.1f}%  {fn}")
            if args.ptx_dir:
                out = Path(args.ptx_dir)
                out.mkdir(parents=True, exist_ok=True)
                (out / (b.name.replace(" ", "_") + ".ptx")).write_text(normalised_ptx(ptx))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.check:
        base = {r["build"]: r["sha256"] for r in json.loads(Path(args.check).read_text())}
        bad = [r["build"] for r in rows if base.get(r["build"]) != r["sha256"]]
        missing = [n for n in base if n not in {r["build"] for r in rows}]
        for n in bad:
            print(f"DIFFERS: {n} (baseline {base.get(n, 'absent')})")
        if missing and not args.only:
            print("not built now: " + ", ".join(missing))
        print(f"check: {len(rows) - len(bad)} of {len(rows)} digests as in {args.check}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
