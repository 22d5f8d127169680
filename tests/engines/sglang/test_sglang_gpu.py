"""SGLang 0.5.17 on a CUDA GPU (the H200) with ``--monokernel-backend triton``, decode CUDA graphs.

Skips without CUDA or without a GPU build of SGLang (``tools/gpu/run_sglang_e2e.sh`` installs
the bundle on the device and runs this file). For each tiny preset (Qwen3-Next, Qwen3.5-MoE;
random weights from ``mono_ext.tools.checkpoint``) two ``sglang.Engine`` runs, each in a fresh
process (its scheduler in another, as SGLang starts it): flag off, and
``Engine(..., monokernel_backend="triton")`` (what ``--monokernel-backend triton`` sets) with
``MONO_EXT_SERVE_UNMEASURED=1`` (the triton backend serves no width until measured faster
than stock: ``core.backends.served_widths``). Both: ``attention_backend="triton"``, decode
CUDA graphs of batch sizes 1, 2, 4, 8, 16 (prefill graphs off), pytorch sampling, no grammar,
no radix cache (every prompt prefills the same way in both runs).

Asserted, per preset, for batches of 1, 3 and 8 requests decoding 72 tokens each (>= 64 decode
steps at one width; 3 rows replay the 4-row graph with one padding row):

* greedy tokens agree with flag-off per request (prompt ids inside the 512-token vocabulary):
  equal up to a first differing position, which is accepted only as a near tie, i.e. both
  picks in both runs' top-k logprobs there and each run's margin (its own pick's logprob minus
  the other pick's) within [0, ``TIE_NATS``]; positions after it are not compared, the two
  runs then continue different texts (:func:`mono_ext.core.numerics.greedy_agreement`). Why
  not token for token: the random tiny model's logits are almost uniform over its vocabulary
  (top-10 mass ~0.025), so the top two tokens are often within 1e-3 nats, and the kernels'
  bf16 reduction order, different from SGLang's layers, flips such greedy picks (seen on the
  H200: batch 1 equal at all 71 decode positions with KL mean 3.7e-8, a batch-3 row flipping
  at step 24). vLLM's model tests accept the same way (``check_logprobs_close`` in its
  ``tests/models/utils.py``); a real divergence (a large margin, a pick outside the other
  run's top-k) still fails;
* decode logprobs close: KL(off || on) < 0.02 per position on average, over SGLang's top-k
  (k = ``TOPK``) bucketed as {tokens in both runs' top-k} + {the rest} (a lower bound on the
  full-vocabulary KL; the printed shared mass shows a divergence hiding outside the top-k),
  taken only where both runs had the same context: up to and including a row's first
  divergence;
* the report each scheduler writes on ``Engine.collective_rpc("mono_ext_report")``
  (:mod:`mono_ext.engines.sglang.report`): mono_ext on with the triton backend and no
  refusal; the captured decode graphs of batch sizes 1..16 routed; every decode step a replay
  of a routed graph (graph sizes 1, 4, 8 among them; no stock decode step); each replay
  released by FailStop, whose health copies were read up to the last step with no failure.
  The flag-off run's report says mono_ext was never started there.

With ``OUT`` set, each run's raw result (tokens, logprobs, reports) is written to
``$OUT/sglang_runs/<tag>_<on|off>.out.json`` for analysis without a rerun; with
``MONO_EXT_GPU_RUNS=DIR``, finished runs are kept under ``DIR/<source digest>/`` and reused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.engines._support import gpu_common
from tests.engines._support.gpu_common import (
    SGLANG_GPU_ENGINE,
    SGLANG_GPU_ENV,
    SGLANG_GRAPH_BS,
    compare_batch,
    export_result,
    kept_runs_dir,
    require_sglang_gpu,
    token_batches,
)

require_sglang_gpu()

pytestmark = pytest.mark.gpu

TOPK = 10
NEW_TOKENS = 72  # 71 decode steps per request (the first token comes from prefill)
KL_LIMIT = 0.02
# a greedy flip between the runs is a near tie when each run's margin between the two picks is
# at most this: ~40x the logit differences seen between the arms (~5e-4 nats: KL mean 3.7e-8,
# max 1.25e-7 per position on the H200), far below a real error's margins
TIE_NATS = 0.02
WIDTHS = (1, 3, 8)
TIMEOUT_S = 560  # one engine run (the device runs a command for at most 600 s)

PRESETS = {
    "next": ("qwen3-next-tiny", {}),
    "q35": ("qwen3.5-moe-tiny", {"enable_multimodal": False}),
}

_RUNNER = textwrap.dedent("""
    import json, os, sys, time
    spec = json.load(open(sys.argv[1]))
    t0 = time.time()
    import sglang
    engine = sglang.Engine(**spec["engine"])
    t1 = time.time()
    batches = []
    for b in spec["batches"]:
        params = [dict(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in b["max_tokens"]]
        outs = engine.generate(input_ids=b["prompts"], sampling_params=params,
                               return_logprob=True, top_logprobs_num=spec["topk"])
        batches.append({
            "tokens": [list(o["output_ids"]) for o in outs],
            "logprobs": [[{str(t): lp for lp, t, *_ in pos} for pos in o["meta_info"]["output_top_logprobs"]]
                         for o in outs],
        })
    t2 = time.time()
    report_dir = spec["report_dir"]
    os.makedirs(report_dir, exist_ok=True)
    engine.collective_rpc("mono_ext_report", path=report_dir)
    reports = [json.load(open(os.path.join(report_dir, f))) for f in sorted(os.listdir(report_dir))]
    engine.shutdown()
    json.dump({"batches": batches, "reports": reports,
               "seconds": {"init": t1 - t0, "generate": t2 - t1}}, open(sys.argv[2], "w"))
""")


class Runs:
    """``runs(tag, on)``: one engine run (fresh processes), started on first use.

    With ``MONO_EXT_GPU_RUNS=DIR`` a finished run's result is kept under DIR (keyed by the
    source digest) and reused by a later pytest call: a device command is limited to 600 s,
    so a cold pair of runs may take two calls. With ``OUT`` set, each run's result is also
    written to ``$OUT/sglang_runs/`` (``export_result``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple[str, bool], dict] = {}
        # $MONO_EXT_GPU_RUNS/<digest>, or None; gpu_common holds the engine arguments, so its
        # source is part of what defines a run
        self.keep = kept_runs_dir(Path(__file__), Path(gpu_common.__file__))

    def __call__(self, tag: str, on: bool) -> dict:
        key = (tag, on)
        if key in self.done:
            return self.done[key]
        from mono_ext.tools.checkpoint import make_checkpoint

        preset, extra = PRESETS[tag]
        ckpt = self.root / preset
        if not (ckpt / "config.json").exists():
            make_checkpoint(ckpt, preset, seed=0)
        name = f"{tag}_{'on' if on else 'off'}"
        engine = {**SGLANG_GPU_ENGINE, **extra, "model_path": str(ckpt)}
        if on:
            engine["monokernel_backend"] = "triton"
        spec = {
            "engine": engine,
            "batches": token_batches(WIDTHS, NEW_TOKENS),
            "topk": TOPK,
            "report_dir": str(self.root / f"{name}.reports"),
        }
        spec_path, out_path = self.root / f"{name}.json", self.root / f"{name}.out.json"
        spec_path.write_text(json.dumps(spec))
        kept = None if self.keep is None else self.keep / f"{name}.out.json"
        if kept is not None and kept.exists():
            print(f"\n{name}: reusing {kept}")
            self.done[key] = json.loads(kept.read_text())
            export_result("sglang_runs", name, kept.read_text())
            return self.done[key]
        env = {**os.environ, **SGLANG_GPU_ENV}
        env.pop("MONO_EXT_SGLANG_MONOKERNEL", None)  # only the Engine argument turns it on
        proc = subprocess.run(
            [sys.executable, "-c", _RUNNER, str(spec_path), str(out_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        log = proc.stdout + proc.stderr
        (self.root / f"{name}.log").write_text(log)
        mono = [ln for ln in log.splitlines() if "mono_ext" in ln]
        print(f"\n{name}: rc {proc.returncode}; mono_ext log lines:\n  " + "\n  ".join(mono[-12:]))
        if proc.returncode != 0:
            pytest.fail(f"engine run {name!r} failed (rc {proc.returncode}):\n{log[-6000:]}")
        self.done[key] = json.loads(out_path.read_text())
        export_result("sglang_runs", name, out_path.read_text())
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(out_path.read_text())
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("sglang-gpu"))


@pytest.mark.parametrize("tag", ["next", "q35"])
def test_triton_backend_under_decode_graphs_matches_flag_off(runs, tag):
    off, on = runs(tag, False), runs(tag, True)
    print(f"{tag}: seconds off {off['seconds']} on {on['seconds']}")

    assert [r["state"] for r in off["reports"]] == [None]  # flag off: never started
    (r,) = on["reports"]  # TP 1: one scheduler
    print(f"  report {json.dumps(r, default=str)}")
    assert (r["state"], r["backend"], r["refusals"]) == ("on", "triton", []), r
    assert r["widths"] and set(SGLANG_GRAPH_BS) <= set(r["widths"]), r["widths"]
    # every graph routed
    assert r["captured"] == {str(bs): bs for bs in SGLANG_GRAPH_BS}, r["captured"]

    decode_steps = sum(NEW_TOKENS - 1 for _ in WIDTHS)  # a batch decodes all its rows at once
    replayed = {int(bs): n for bs, n in r["replayed"].items()}
    assert r["replayed_steps"] == sum(replayed.values()) >= decode_steps, replayed
    assert set(replayed) >= {1, 4, 8}, replayed  # 3 rows replay the 4-row graph
    assert r["stock_decode"] == 0, r  # no decode step ran SGLang's forward
    # a replay counts only once FailStop released it (else the step raised before sampling);
    # every released step was a replay: no sampled decode step ran the kernels eagerly
    # (SGLang's warm-up runs before each capture end their steps but are never sampled)
    assert r["released"] == r["replayed_steps"], r
    fs = r["failstop"]
    assert fs is not None and fs["state"] == "ok" and fs["first_failed_step"] is None, fs
    assert fs["steps"] >= r["replayed_steps"], fs  # every replay ended its step on the host
    assert fs["last_seen_step"] == fs["steps"], fs  # the last step's health copy was read

    for bi, b in enumerate(WIDTHS):
        t_off, t_on = off["batches"][bi]["tokens"], on["batches"][bi]["tokens"]
        assert all(len(t) == NEW_TOKENS for t in t_off + t_on)
        assert all(0 <= x < 512 for t in t_off for x in t)
        lp_off, lp_on = off["batches"][bi]["logprobs"], on["batches"][bi]["logprobs"]
        assert all(len(row) == NEW_TOKENS for row in lp_off + lp_on)
        cmp = compare_batch(b, t_off, t_on, lp_off, lp_on, tie_nats=TIE_NATS, topk=TOPK)
        print(cmp.summary())
        assert cmp.ok, "\n".join(cmp.failures())
        assert cmp.kl_mean < KL_LIMIT, (b, cmp.kl_mean, cmp.kl_max, len(cmp.kls))
