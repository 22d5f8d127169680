"""Shared by the GPU e2e tests (``test_vllm_gpu.py``, ``test_vllm_gpu_failstop.py``,
``test_sglang_gpu.py``, ``test_sglang_gpu_failstop.py``): kept engine runs, raw results for
offline analysis, the flag-off / flag-on comparison of one batch, the vLLM and SGLang engine
arguments, and the SGLang GPU tests' module-level skips.

Imports neither torch nor an engine, so the test modules can skip before touching either (and
``sglang_fault.py``, checked on CPU, can build on :data:`SGLANG_GPU_ENGINE`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mono_ext.core.numerics import GreedyAgreement, greedy_agreement, same_context_kl

#: env var: a directory where finished engine runs are kept and reused (by source digest)
KEEP_ENV = "MONO_EXT_GPU_RUNS"

#: vLLM engine arguments of the GPU e2e tests: a tiny model, FULL decode graphs without
#: torch.compile (every decode step of a captured width replays one whole-model graph)
VLLM_GPU_LLM: dict[str, Any] = dict(
    skip_tokenizer_init=True,
    dtype="bfloat16",
    max_model_len=512,
    max_num_seqs=16,
    seed=0,
    gpu_memory_utilization=0.3,
    gdn_prefill_backend="triton",  # FlashInfer is not in the device bundle
    enforce_eager=False,
    compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
)

SGLANG_GRAPH_BS = [1, 2, 4, 8, 16]
#: ``sglang.Engine`` arguments of the SGLang 0.5.17 GPU tests: a tiny model, decode CUDA graphs
#: of SGLANG_GRAPH_BS (prefill graphs off), SGLang's overlap scheduler (its default: not
#: disabled), pytorch sampling, no grammar, no radix cache (every prompt prefills the same way
#: in every run)
SGLANG_GPU_ENGINE: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "bfloat16",
    "attention_backend": "triton",  # FA3 is not in the device bundle
    "sampling_backend": "pytorch",
    "grammar_backend": "none",
    "disable_radix_cache": True,
    "mem_fraction_static": 0.3,
    "max_running_requests": 16,
    "context_length": 512,
    "cuda_graph_bs_decode": SGLANG_GRAPH_BS,
    "disable_prefill_cuda_graph": True,
    "random_seed": 0,
    "log_level": "info",
}
#: their environment: the triton backend serves no width until measured faster than stock,
#: and routing is what these tests are about
SGLANG_GPU_ENV = {"MONO_EXT_CHECK": "0", "MONO_EXT_SERVE_UNMEASURED": "1", "HF_HUB_OFFLINE": "1"}


def require_sglang_gpu() -> None:
    """Skip the calling test module without CUDA, without SGLang's CUDA build (``sgl_kernel``)
    or on SGLang with the kernel-plugin API (0.5.23+, tested elsewhere). Call it at import."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device", allow_module_level=True)
    pytest.importorskip("sgl_kernel", reason="needs SGLang's CUDA kernels (sgl_kernel)")
    from mono_ext.engines.sglang import has_native_api

    if has_native_api():
        pytest.skip("SGLang with the kernel-plugin API (0.5.23+)", allow_module_level=True)


def source_digest(*files: Path) -> str:
    """Of mono_ext's source and ``files`` (what defines a run: the test, its runner): a kept
    run is reused only for the same code."""
    import mono_ext

    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).name.encode() + Path(f).read_bytes())
    pkg = Path(mono_ext.__file__).parent
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode() + f.read_bytes())
    return h.hexdigest()[:16]


def kept_runs_dir(*files: Path) -> Path | None:
    """``$MONO_EXT_GPU_RUNS/<source digest>``, or None when the variable is unset.

    A device command is limited to 600 s and a cold pair of engine runs per preset takes
    about 5 minutes, so a test may need two calls: the second reuses what the first kept."""
    keep = os.environ.get(KEEP_ENV)
    return Path(keep) / source_digest(*files) if keep else None


def export_result(subdir: str, name: str, result: dict[str, Any] | str) -> Path | None:
    """Write one run's raw result (tokens, logprobs, reports) to ``$OUT/<subdir>/<name>.out.json``
    when ``OUT`` is set (the device copies ``$OUT`` back), for analysis without a rerun."""
    out = os.environ.get("OUT")
    if not out:
        return None
    path = Path(out) / subdir / f"{name}.out.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result if isinstance(result, str) else json.dumps(result, default=str))
    return path


@dataclass
class BatchComparison:
    """Flag off vs on for one batch: per-row :class:`GreedyAgreement` and the top-k KL at the
    decode positions that had the same context in both runs (see ``compare_batch``)."""

    batch: int
    topk: int
    rows: list[GreedyAgreement]
    kls: list[float] = field(default_factory=list)
    masses: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(g.ok for g in self.rows)

    @property
    def kl_mean(self) -> float:
        return sum(self.kls) / len(self.kls) if self.kls else math.nan

    @property
    def kl_max(self) -> float:
        return max(self.kls) if self.kls else math.nan

    def failures(self) -> list[str]:
        return [
            f"batch {self.batch} row {r}: {g.describe()}"
            for r, g in enumerate(self.rows)
            if not g.ok
        ]

    def summary(self) -> str:
        exact = sum(g.exact for g in self.rows)
        flips = [
            f"row {r} at step {g.divergence} (off {g.token_off} on {g.token_on}, margins "
            f"off {g.margin_off:.2e} on {g.margin_on:.2e} nats)"
            for r, g in enumerate(self.rows)
            if g.near_tie
        ]
        real = len(self.rows) - exact - len(flips)
        mass = f"{min(self.masses):.3f}" if self.masses else "n/a"
        return (
            f"  batch {self.batch}: rows exact {exact}/{len(self.rows)}, near-tie flips "
            f"{len(flips)}"
            + (f" [{'; '.join(flips)}]" if flips else "")
            + (f", REAL divergences {real}" if real else "")
            + f"; {sum(g.agreeing for g in self.rows)} agreeing tokens, {len(self.kls)} decode "
            f"positions compared (same context), KL mean {self.kl_mean:.2e} max {self.kl_max:.2e}, "
            f"shared top-{self.topk} mass min {mass}"
        )


def token_batches(widths: Sequence[int], new_tokens: int) -> list[dict]:
    """One batch per width, row r a fixed prompt of 9 + 4r token ids, each asking for
    ``new_tokens``. The ids stay inside both tiny vocabularies (512): an id past the embedding
    is a device-side assert in the flag-off run, not a test of anything."""
    out = []
    for b in widths:
        prompts = [[(37 * r + 11 * i + 5) % 500 + 3 for i in range(9 + 4 * r)] for r in range(b)]
        out.append({"prompts": prompts, "max_tokens": [new_tokens] * b})
    return out


def compare_batch(
    batch: int,
    tokens_off: list[list[Any]],
    tokens_on: list[list[Any]],
    logprobs_off: list[list[dict]],
    logprobs_on: list[list[dict]],
    *,
    tie_nats: float,
    topk: int,
) -> BatchComparison:
    """Each row: greedy tokens equal up to a first divergence, which must be a near tie
    (:func:`mono_ext.core.numerics.greedy_agreement`); the KL is taken at decode positions
    (1.., position 0 is the prefill's token) up to and including that divergence only."""
    out = BatchComparison(batch, topk, [])
    for t_off, t_on, lp_off, lp_on in zip(
        tokens_off, tokens_on, logprobs_off, logprobs_on, strict=True
    ):
        g = greedy_agreement(t_off, t_on, lp_off, lp_on, tie_nats)
        out.rows.append(g)
        for kl, mass in same_context_kl(lp_off, lp_on, g, start=1):
            out.kls.append(kl)
            out.masses.append(mass)
    return out
