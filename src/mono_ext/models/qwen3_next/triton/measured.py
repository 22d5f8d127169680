"""Where the Triton K1/K2 were measured faster than the engine's own decode step.

A deployment routes, by default, only the widths listed here for its engine and device
(``core.backends.served_widths``); every other width, engine and device runs the engine's own
forward unless ``MONO_EXT_SERVE_UNMEASURED=1``. Each entry names the committed result it comes
from, and ``tests/models/qwen3_next/triton/test_measured_widths.py`` checks it against that file: a width is listed
exactly when its TPOT with mono_ext was below stock's at every layer count of the run.
"""

from __future__ import annotations

__all__ = ["FASTER", "measured_faster"]

#: (engine, device name as torch reports it) -> (widths, the result they come from)
FASTER: dict[tuple[str, str], tuple[frozenset[int], str]] = {
    # batch 1 faster at 16 and 32 layers; batches 4 and 16 slower at 16 layers or both
    ("vllm", "NVIDIA H200"): (
        frozenset({1}),
        "docs/results/e2e_vllm.json (vLLM 0.26, Qwen3-Next-80B-A3B shapes at 16 and 32 layers, "
        "bf16, 2026-12-02, commit 00ea5a1)",
    ),
}


def measured_faster(engine: str | None, device: str | None) -> tuple[frozenset[int], str | None]:
    """The widths measured faster for ``engine`` on ``device``, and where that was recorded
    (nothing, None: never measured there)."""
    widths, source = FASTER.get((str(engine), str(device)), (frozenset(), None))
    return widths, source
