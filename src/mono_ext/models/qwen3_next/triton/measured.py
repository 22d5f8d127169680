"""Where the Triton K1/K2 were measured faster than the engine's own decode step.

A deployment routes, by default, only the widths listed here for its engine, device and
checkpoint weights (``core.backends.served_widths``); every other width, engine, device and
weight format runs the engine's own forward unless ``MONO_EXT_SERVE_UNMEASURED=1``. Weights
are "bf16" for an unquantized checkpoint, else the engine's quantization method: K2 on fp8
planes is slower than vLLM's own fp8 tail at every width (docs/results/k2_vllm_fp8.csv), so a
bf16 result says nothing about an fp8 deployment. Each entry names the committed result it
comes from, and ``tests/models/qwen3_next/triton/test_measured_widths.py`` checks it against
that file: a width is listed exactly when its TPOT with mono_ext was below stock's at every
layer count of the run.
"""

from __future__ import annotations

__all__ = ["FASTER", "measured_faster", "weights_of"]

#: (engine, device name as torch reports it, weights) -> (widths, the result they come from)
FASTER: dict[tuple[str, str, str], tuple[frozenset[int], str]] = {
    # batches 1 and 4 faster at 16 and 32 layers; batch 16 slower at both
    ("vllm", "NVIDIA H200", "bf16"): (
        frozenset({1, 4}),
        "docs/results/e2e_vllm.json (vLLM 0.26, Qwen3-Next-80B-A3B shapes at 16 and 32 layers, "
        "bf16, 2026-12-04, commit e751cee)",
    ),
    # faster at every batch at 16 layers, slower at every batch at 8 (there batches 1 and 4
    # wait on the host, to which mono_ext's hooks add ~40 us)
    ("vllm", "NVIDIA H100 80GB HBM3", "bf16"): (
        frozenset(),
        "docs/results/e2e_vllm_h100.json (vLLM 0.26, Qwen3-Next-80B-A3B shapes at 8 and 16 "
        "layers, bf16, 2026-12-07, commit a58e931)",
    ),
    # every batch slower at 8 layers; at 16 batch 4 faster, 1 and 16 slower (batch 1 within
    # its rep-to-rep spread: docs/perf.md)
    ("sglang", "NVIDIA H100 80GB HBM3", "bf16"): (
        frozenset(),
        "docs/results/e2e_sglang_h100.json (SGLang 0.5.17, Qwen3-Next-80B-A3B shapes at 8 and "
        "16 layers, bf16, 2026-12-07, commit 80d9772)",
    ),
}


def weights_of(quantization: str | None) -> str:
    """The weights key of a checkpoint: "bf16" unquantized, else the engine's quant method."""
    return "bf16" if quantization is None else str(quantization)


def measured_faster(
    engine: str | None, device: str | None, quantization: str | None = None
) -> tuple[frozenset[int], str | None]:
    """The widths measured faster for ``engine`` on ``device`` with a checkpoint quantized by
    ``quantization`` (None: unquantized), and where that was recorded (nothing, None: never
    measured there)."""
    key = (str(engine), str(device), weights_of(quantization))
    widths, source = FASTER.get(key, (frozenset(), None))
    return widths, source
