"""Pure parts of benchmarks/e2e_vllm.py (no vLLM, no torch): delta method, line fit, the
bandwidth-floor model, plan order, result merging, accuracy comparison."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from mono_ext.core.numerics import topk_kl
from mono_ext.models.qwen3_next.configs import get_preset
from mono_ext.models.qwen3_next.dims import Dims

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_vllm.py"
_spec = importlib.util.spec_from_file_location("e2e_vllm", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

DIMS = Dims.from_config(get_preset("qwen3-next-80b-a3b"))


def test_delta_tpot_cancels_prefill():
    prefill, step = 0.25, 0.004
    t1, t2 = prefill + 64 * step, prefill + 320 * step
    assert bench.delta_tpot(t1, t2, 64, 320) == pytest.approx(step)
    with pytest.raises(ValueError):
        bench.delta_tpot(t1, t2, 320, 64)


def test_fit_line_two_and_three_points():
    assert bench.fit_line([16, 32], [2.29e-3, 3.55e-3]) == pytest.approx((78.75e-6, 1.03e-3))
    slope, icpt = bench.fit_line([16, 32, 48], [3.0, 5.0, 7.0])
    assert (slope, icpt) == pytest.approx((0.125, 1.0))
    with pytest.raises(ValueError):
        bench.fit_line([16, 16], [1.0, 2.0])


def test_expected_distinct_experts():
    assert bench.expected_distinct(512, 10, 1) == pytest.approx(10)
    assert bench.expected_distinct(512, 10, 2) == pytest.approx(20 - 100 / 512)
    assert bench.expected_distinct(8, 8, 3) == pytest.approx(8)  # every expert picked
    d16 = bench.expected_distinct(512, 10, 16)
    assert 130 < d16 < 160  # overlap: fewer than 16 * 10


def test_expected_distinct_matches_simulation():
    import random

    rng, trials, e, k, b = random.Random(0), 4000, 64, 6, 5
    mean = sum(
        len(set().union(*(rng.sample(range(e), k) for _ in range(b)))) for _ in range(trials)
    )
    assert mean / trials == pytest.approx(bench.expected_distinct(e, k, b), rel=0.01)


def test_layer_bytes_80b_gdn_bs1():
    h, w = 2048, 2
    got = bench.layer_bytes(DIMS, "linear_attention", rows=1, ctx=700, state_bytes=2)
    qkvz = (2 * 16 * 128 + 2 * 32 * 128) * h
    dense = qkvz + 64 * h + 8192 * 4 + 32 + 32 + 128 + 4096 * h  # proj, ba, conv, A, dt, norm
    dense += 2 * h + 512 * h + 3 * 512 * h + h  # 2 layer norms, router, shared expert, its gate
    assert got["dense_weights"] == dense * w
    assert got["experts"] == pytest.approx(10 * 3 * 512 * h * w)
    assert got["gdn_state"] == 2 * (32 * 128 * 128 * 2 + 3 * 8192 * 2)
    assert got["kv"] == 0
    # ENGINES.md: ~32 us at 4.3 TB/s for bs1
    assert got["total"] / 4.3e12 == pytest.approx(32e-6, rel=0.1)


def test_layer_bytes_attention_kv_grows_with_rows_and_ctx():
    a = bench.layer_bytes(DIMS, "full_attention", rows=2, ctx=100)
    b = bench.layer_bytes(DIMS, "full_attention", rows=4, ctx=100)
    per_pos = 2 * 2 * 256 * 2
    assert a["kv"] == 2 * 101 * per_pos and b["kv"] == 2 * a["kv"]
    assert a["gdn_state"] == 0
    with pytest.raises(ValueError):
        bench.layer_bytes(DIMS, "conv", rows=1, ctx=1)


def test_floor_per_layer_is_the_slope_of_bytes():
    bw = 4.0e12
    fl = bench.floor_per_layer(DIMS, [16, 32], 4, 600.0, bw)
    kinds = bench.kinds_for(32)[16:]
    want = sum(bench.layer_bytes(DIMS, k, 4, 600.0)["total"] for k in kinds) / 16
    assert fl["bytes_per_layer"] == pytest.approx(want)
    assert fl["s_per_layer"] == pytest.approx(want / bw)
    assert bench.kinds_for(8) == ["linear_attention"] * 3 + ["full_attention"] + [
        "linear_attention"
    ] * 3 + ["full_attention"]
    # the 48-layer floor includes the lm_head once when the vocabulary is known
    assert fl["lm_head_bytes"] == 0  # plain Dims carries no vocabulary
    assert fl["s_full_model"] * bw == pytest.approx(bench.model_bytes(DIMS, 48, 4, 600.0))


def test_plan_interleaves_arms_per_layer_count():
    plan = bench.build_plan(
        [16, 32],
        ["off", "on", "on", "off"],
        check=True,
        server=True,
        server_layers=[32],
        server_order=["off", "on"],
        check_layers=4,
    )
    ids = [e["id"] for e in plan]
    assert ids == [
        "bw",
        "L16/off/0",
        "L16/on/0",
        "L16/on/1",
        "L16/off/1",
        "L32/off/0",
        "L32/on/0",
        "L32/on/1",
        "L32/off/1",
        "check/L4",
        "server/L32/off",
        "server/L32/on",
    ]
    todo = bench.select(plan, ["L32/*", "bw"], {"bw", "L32/off/0"}, redo=False)
    assert [e["id"] for e in todo] == ["L32/on/0", "L32/on/1", "L32/off/1"]
    assert len(bench.select(plan, None, {"bw"}, redo=True)) == len(plan)


def test_merge_keeps_runs_of_every_call():
    a = {"runs": {"bw": {"ok": True, "v": 1}, "L16/off/0": {"ok": False}}, "meta": {"calls": [1]}}
    b = {"runs": {"L16/off/0": {"ok": True}, "L16/on/0": {"ok": True}}, "meta": {"calls": [2]}}
    m = bench.merge(a, b)
    assert set(m["runs"]) == {"bw", "L16/off/0", "L16/on/0"}
    assert m["runs"]["L16/off/0"] == {"ok": True}  # the newer run of an id wins
    assert m["meta"]["calls"] == [1, 2]
    assert bench.merge(m, b)["meta"]["calls"] == [1, 2]  # idempotent
    assert a["runs"]["L16/off/0"] == {"ok": False}  # inputs untouched


def test_topk_kl_and_compare_runs():
    p = {"1": math.log(0.6), "2": math.log(0.3)}
    assert topk_kl(p, dict(p)) == pytest.approx((0.0, 0.9))
    q = {"1": math.log(0.3), "2": math.log(0.6)}
    kl, _ = topk_kl(p, q)
    assert kl == pytest.approx(0.6 * math.log(2) + 0.3 * math.log(0.5))

    lp = [{"5": -0.1, "6": -2.5}, {"7": -0.2, "8": -1.0}, {"9": -0.3, "4": -0.4}]
    ref = {"tokens": [[5, 7, 9], [5, 7, 9]], "logprobs": [lp, lp]}
    run = {"tokens": [[5, 7, 9], [5, 7, 4]], "logprobs": [lp, lp]}
    c = bench.compare_runs(ref, run)
    assert c["agreement"] == pytest.approx((1 + 2 / 3) / 2)
    assert (c["rows_identical"], c["rows"]) == (1, 2)
    assert c["kl_positions"] == 4  # decode positions 1, 2 of each row (row 2 up to its split)
    assert c["kl_mean"] == pytest.approx(0.0)
    assert c["divergence_margins"] == [pytest.approx(0.1)]
    shorter = {"tokens": [[5, 7]], "logprobs": [lp[:2]]}  # a shorter run: compared over 2
    assert bench.compare_runs({"tokens": [[5, 7, 9]], "logprobs": [lp]}, shorter)[
        "agreement"
    ] == pytest.approx(1.0)


def test_tpot_from_chunks():
    assert bench.tpot_from_chunks([1.0, 1.1, 1.3], [1, 1, 2]) == pytest.approx(0.1)
    assert bench.tpot_from_chunks([1.0], [1]) is None
    assert bench.tpot_from_chunks([], []) is None


def test_quick_defaults_and_estimate_fit_calls():
    a = bench.parse_args(["--out", "/tmp/x", "--quick"])
    assert (a.layers, a.batches, a.order, a.server) == ([16, 32], [1, 4, 16], ["off", "on"], False)
    plan = bench.build_plan(
        a.layers,
        a.order,
        check=a.check,
        server=a.server,
        server_layers=[],
        server_order=[],
        check_layers=a.check_layers,
    )
    warm: set[str] = set()
    ests = [bench.estimate_entry_s(e, a, warm) for e in plan]
    assert all(s < 540 for s in ests)  # every entry fits one 10-minute device call
    full = bench.parse_args(["--out", "/tmp/x"])
    assert full.order == ["off", "on", "on", "off"] and full.batches == [1, 2, 4, 8, 16]
    assert full.max_model_len >= full.prompt_len + full.n2


def _busy_step(k: int) -> int:
    return sum(i * i for i in range(k))


def test_profile_steps_counts_calls_per_decode_step():
    """A stand-in ``gen`` that does one known step per token: the profile names that step
    with one call per decode step, and orders the rows by own time."""

    def gen(prompts, n):
        for _ in range(n):
            _busy_step(2000)
        return 0.0, None

    rows = bench.runner.profile_steps(gen, None, 40)
    step = next(r for r in rows if r["function"].endswith("(_busy_step)"))
    assert step["calls_per_step"] == 1.0
    assert step["cumtime_us_per_step"] >= step["tottime_us_per_step"] > 0
    own = [r["tottime_us_per_step"] for r in rows]
    assert own == sorted(own, reverse=True)


def test_busy_us_counts_overlapping_work_once():
    assert bench.busy_us([]) == 0.0
    assert bench.busy_us([(0.0, 10.0)]) == 10.0
    # a copy inside a kernel, a second stream overlapping its tail, then a gap
    assert bench.busy_us([(20.0, 30.0), (2.0, 5.0), (0.0, 10.0), (8.0, 12.0)]) == 22.0


def test_gpu_step_summary_takes_the_delta_of_two_runs():
    """A stand-in trace: one prefill kernel, then per decode step a 30 us layer kernel and a
    5 us copy overlapping it, 50 us apart. The delta over the steps the second run adds
    cancels the prefill; busy counts the overlapping copy once; idle is TPOT minus busy."""

    def trace(steps):
        ev = [("prefill", 0.0, 400.0)]
        for i in range(steps):
            t = 1000.0 + 50.0 * i
            ev += [("layer", t, t + 30.0), ("copy", t + 25.0, t + 30.0), ("norm", t + 31, t + 33)]
        return ev

    g = bench.gpu_step_summary(trace(4), trace(12), 4, 12, tpot_s=50e-6, top=2)
    assert (g["tpot_us"], g["busy_us"], g["idle_us"]) == (50.0, 32.0, 18.0)
    assert g["overlap_us"] == 5.0  # the copy ran under the layer kernel
    assert g["events_per_step"] == 3.0
    assert [k["name"] for k in g["kernels"]] == ["layer", "copy"]  # by time, top 2
    assert g["kernels"][0] == dict(name="layer", us_per_step=30.0, calls_per_step=1.0)
    with pytest.raises(ValueError):
        bench.gpu_step_summary(trace(4), trace(4), 4, 4, 50e-6)


def test_profile_gpu_reads_an_engines_own_chrome_trace(tmp_path):
    """An engine whose model runs in another process (SGLang's scheduler) exports its own
    torch.profiler chrome trace: profile_gpu takes the device work from it through a
    ``capture`` (kernels, copies and memsets; host ops, flows and counters are not device
    time), gzipped or not, and summarizes it like a trace taken here."""
    import gzip
    import json

    def trace(steps):
        ev = [{"ph": "X", "cat": "kernel", "name": "prefill", "ts": 0.0, "dur": 400.0}]
        for i in range(steps):
            t = 1000.0 + 50.0 * i
            ev += [
                {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t - 9, "dur": 8.0},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t - 1,
                 "dur": 1.0},  # fmt: skip
                {"ph": "X", "cat": "kernel", "name": "layer", "ts": t, "dur": 30.0},
                {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": t + 25, "dur": 5.0},
                {"ph": "X", "cat": "gpu_memset", "name": "zero", "ts": t + 31, "dur": 2.0},
                {"ph": "s", "cat": "ac2g", "name": "flow", "ts": t, "id": i},
                {"ph": "C", "cat": "kernel", "name": "counter", "ts": t, "args": {}},
            ]
        return {"traceEvents": ev}

    paths = {4: tmp_path / "a.trace.json", 12: tmp_path / "b.trace.json.gz"}
    paths[4].write_text(json.dumps(trace(4)))
    with gzip.open(paths[12], "wt") as f:
        json.dump(trace(12), f)
    assert bench.runner.chrome_device_events(paths[4])[1] == ("layer", 1000.0, 1030.0)

    ran = []

    def gen(prompts, n):
        ran.append(n)
        return 0.0, None

    def capture(fn):
        fn()
        return bench.runner.chrome_device_events(paths[ran[-1]])

    g = bench.runner.profile_gpu(gen, None, 4, 12, 50e-6, capture)
    assert ran == [4, 12]
    assert (g["tpot_us"], g["busy_us"], g["idle_us"], g["overlap_us"]) == (50.0, 32.0, 18.0, 5.0)
    assert g["events_per_step"] == 3.0
    empty = bench.runner.profile_gpu(gen, None, 4, 12, 50e-6, lambda fn: [])
    assert empty == {"skipped": "no device events the engine's own profiler recorded"}


def test_gpu_profile_rows_and_table():
    g = bench.gpu_step_summary(
        [("k", 0.0, 1.0)], [("k", 0.0, 1.0), ("k", 10.0, 31.0)], 1, 2, tpot_s=40e-6
    )
    runs = {
        "L16-on": {"batches": {"16": {"gpu_profile": g}, "4": {"gpu_profile": {"skipped": "x"}}}},
        "L16-off": {"batches": {"1": {}}},
    }
    rows = bench.runner.gpu_profile_rows(runs)
    assert rows == [
        {"run": "L16-on", "batch": 16, "tpot_us": 40.0, "busy_us": 21.0, "idle_us": 19.0,
         "events_per_step": 1.0, "overlap_us": 0.0, "top": [("k", 21.0)]}
    ]  # fmt: skip
    floor = dict(copy_bw_TBps=4.2, ssm_state_dtype="bf16", distinct_experts=10.0, ctx_mean=700)
    summary = dict(floor_model=floor, tpot=[], accuracy=[], routed={}, failed=[], gpu_profile=rows)
    table = bench.runner.print_tables(summary)
    assert "| L16-on | 16 | 40.0 | 21.0 | 19.0 | 0.0 | 1.0 | k 21.0 |" in table
    old = dict(rows[0], overlap_us=None)  # a profile recorded before overlap_us
    table = bench.runner.print_tables(dict(summary, gpu_profile=[old]))
    assert "| L16-on | 16 | 40.0 | 21.0 | 19.0 | - | 1.0 | k 21.0 |" in table


def test_fp8_planes_count_one_byte_and_a_scale_per_block():
    bf16 = bench.layer_bytes(DIMS, "linear_attention", rows=1, ctx=700)
    fp8_planes = frozenset({"in_proj_qkvz", "out_proj", "w13", "w2"})
    fp8 = bench.layer_bytes(DIMS, "linear_attention", rows=1, ctx=700, fp8_planes=fp8_planes)
    h, qkvz = 2048, 2 * 16 * 128 + 2 * 32 * 128

    def saved(n, k):  # a bf16 plane's bytes minus its fp8 codes and block scales
        return 2 * n * k - (n * k + math.ceil(n / 128) * math.ceil(k / 128) * 4)

    assert bf16["dense_weights"] - fp8["dense_weights"] == saved(qkvz, h) + saved(h, 4096)
    per_expert = saved(2 * 512, h) + saved(h, 512)
    assert bf16["experts"] - fp8["experts"] == pytest.approx(10 * per_expert)
    assert fp8["gdn_state"] == bf16["gdn_state"]  # states are no weights


def test_result_names_per_model_and_format():
    assert bench.names() == ("e2e_vllm.json", "e2e_vllm.csv", "e2e_vllm.png")
    assert bench.names("q35")[0] == "e2e_vllm_q35.json"
    assert bench.names("next", "fp8_block128")[0] == "e2e_vllm_fp8.json"


def test_model_and_format_arguments(capsys):
    q35 = bench.parse_args(["--out", "/tmp/x", "--quick", "--model", "q35"])
    assert q35.preset == "qwen3.5-35b-a3b" and q35.formats == "bf16"
    fp8 = bench.parse_args(["--out", "/tmp/x", "--quick", "--formats", "fp8_block128"])
    assert fp8.preset == "qwen3-next-80b-a3b" and fp8.check is False
    assert "no check entry" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "/tmp/x", "--model", "q35", "--formats", "fp8_block128"])
    assert "Qwen3-Next (--model next) only" in capsys.readouterr().err


def test_fp8_config_keeps_the_official_bf16_modules(tmp_path):
    import json

    path = bench.write_config(tmp_path, "qwen3-next-80b-a3b", 8, formats="fp8_block128")
    q = json.loads((path / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["weight_block_size"]) == ("fp8", [128, 128])
    keep = set(q["modules_to_not_convert"])
    assert {"lm_head", "model.embed_tokens"} <= keep
    assert "model.layers.0.linear_attn.in_proj_ba" in keep
    assert not any(k.startswith("model.layers.3.linear_attn") for k in keep)  # attention
    assert {f"model.layers.{i}.mlp.gate" for i in range(8)} <= keep
    assert not any(k.startswith("model.layers.8.") for k in keep)
    with pytest.raises(ValueError, match="dummy weights only"):
        bench.write_config(tmp_path, "qwen3-next-80b-a3b", 4, "checkpoint", "fp8_block128")


def test_latency_entries_run_vllms_own_benchmark_per_arm(tmp_path):
    a = bench.parse_args(["--out", str(tmp_path), "--latency", "on", "--latency-batches", "1,4"])
    plan = bench.build_plan(
        a.layers, a.order, check=False, server=False, server_layers=[], server_order=[],
        latency_layers=a.latency_layers, latency_batches=a.latency_batches,
    )  # fmt: skip
    ids = [e["id"] for e in plan if e["kind"] == "latency"]
    assert ids == ["latency/L32/b1/off", "latency/L32/b1/on", "latency/L32/b4/off",
                   "latency/L32/b4/on"]  # fmt: skip
    model = bench.write_config(tmp_path, a.preset, 4, min_vocab=bench.LATENCY_VOCAB)
    off = bench.latency_args(a, model, "off", 4, tmp_path / "r.json")
    on = bench.latency_args(a, model, "on", 4, tmp_path / "r.json")
    assert on[: len(off)] == off and on[len(off)] == "--additional-config"
    assert "--additional-config" not in off
    i = off.index("--batch-size")
    assert off[i + 1] == "4" and off[off.index("--output-json") + 1] == str(tmp_path / "r.json")
    quick = bench.parse_args(["--out", str(tmp_path), "--quick"])
    assert quick.latency is False


def test_latency_vocab_covers_the_prompt_ids(tmp_path):
    import json

    tiny = bench.write_config(tmp_path, "qwen3-next-tiny", 4, min_vocab=bench.LATENCY_VOCAB)
    assert json.loads((tiny / "config.json").read_text())["vocab_size"] == bench.LATENCY_VOCAB
    big = bench.write_config(tmp_path, "qwen3-next-80b-a3b", 4, min_vocab=bench.LATENCY_VOCAB)
    assert json.loads((big / "config.json").read_text())["vocab_size"] == 151936


def test_latency_rows_put_each_on_run_over_its_off_run():
    def run(arm, b, s):
        e = {"kind": "latency", "arm": arm, "layers": 32, "batch": b}
        return {"entry": e, "avg_latency_s": s, "output_len": 128}

    runs = {
        "latency/L32/b1/off": run("off", 1, 0.64),
        "latency/L32/b1/on": run("on", 1, 0.48),
        "latency/L32/b4/on": run("on", 4, 0.9),
    }
    rows = {r["run"]: r for r in bench.latency_rows(runs)}
    assert rows["latency/L32/b1/on"]["on_over_off"] == pytest.approx(0.75)
    assert rows["latency/L32/b1/off"]["ms_per_output_token"] == pytest.approx(5.0)
    assert rows["latency/L32/b4/on"]["on_over_off"] is None  # no off run of that batch


def test_bench_serve_runs_random_prompts_of_the_servers_lengths(tmp_path):
    a = bench.parse_args(["--out", str(tmp_path)])
    args = bench.bench_serve_args(a)
    assert args[args.index("--dataset-name") + 1] == "random"
    assert args[args.index("--random-input-len") + 1] == str(a.prompt_len)
    assert args[args.index("--random-output-len") + 1] == str(a.server_tokens)
    assert "--ignore-eos" in args and a.bench_serve is True
    off = bench.parse_args(["--out", str(tmp_path), "--bench-serve", "off"])
    assert off.bench_serve is False


def _profile(busy, idle, kernels):
    return {"tpot_us": busy + idle, "busy_us": busy, "idle_us": idle,
            "kernels": [{"name": n, "us_per_step": t, "calls_per_step": c}
                        for n, t, c in kernels]}  # fmt: skip


def test_intercept_parts_separates_step_work_from_depth_dependent_layers():
    # per step: a 150 us logits GEMM; per layer: "front" at a constant 50 us a call, "moe" at
    # 250 us a call at 16 layers and 242.5 at 32 (fewer experts deeper), and 20 us of busy
    # time the summaries do not name
    p16 = _profile(
        150 + 16 * 50 + 16 * 250 + 20,
        80,
        [("lm", 150, 1), ("front", 16 * 50, 16), ("moe", 16 * 250, 16)],
    )
    p32 = _profile(150 + 32 * 50 + 32 * 242.5 + 20, 100,
                   [("lm", 150, 1), ("front", 32 * 50, 32), ("moe", 32 * 242.5, 32),
                    ("only32", 5, 1)])  # fmt: skip
    r = bench.intercept_parts({32: p32, 16: p16})
    assert r["layers"] == [16, 32]
    assert r["busy_per_layer_us"] == pytest.approx(50 + 235)
    assert r["busy_intercept_us"] == pytest.approx(150 + 20 + 16 * 15)
    assert r["step_kernels_us"] == pytest.approx(150)
    assert r["layer_kernels_intercept_us"] == pytest.approx(16 * 15)
    assert r["unattributed_us"] == pytest.approx(20)
    assert r["idle_intercept_us"] == pytest.approx(60)
    assert r["layer_kernels"][0] == {"name": "moe", "intercept_us": 240.0,
                                     "us_per_call": [250.0, 242.5]}  # fmt: skip
    assert {k["name"] for k in r["layer_kernels"]} == {"moe", "front"}  # "only32": not at 16
    with pytest.raises(ValueError):
        bench.intercept_parts({16: p16})


def test_gpu_profile_fit_rows_per_arm_and_batch_and_table():
    def run(arm, layers, busy):
        g = _profile(busy, 10.0, [("k", busy, layers)])
        return {
            "entry": {"kind": "offline", "arm": arm, "layers": layers},
            "batches": {"1": {"gpu_profile": g}, "4": {"gpu_profile": {"skipped": "x"}}},
        }

    runs = {"L16/on/0": run("on", 16, 1700.0), "L32/on/0": run("on", 32, 3300.0),
            "L16/off/0": run("off", 16, 1800.0)}  # fmt: skip
    rows = bench.runner.gpu_profile_fit_rows(runs)
    assert [(r["arm"], r["batch"], r["layers"]) for r in rows] == [("on", 1, [16, 32])]
    assert rows[0]["busy_per_layer_us"] == pytest.approx(100.0)
    assert rows[0]["busy_intercept_us"] == pytest.approx(100.0)
    assert rows[0]["layer_kernels_intercept_us"] == pytest.approx(100.0)
    floor = dict(copy_bw_TBps=4.2, ssm_state_dtype="bf16", distinct_experts=10.0, ctx_mean=700)
    summary = dict(floor_model=floor, tpot=[], accuracy=[], routed={}, failed=[],
                   gpu_profile_fit=rows)  # fmt: skip
    table = bench.runner.print_tables(summary)
    assert "| on | 1 | 100.0 | 100.0 | 0.0 | 100.0 | 0.0 | 10.0 |" in table


def test_the_92b4779_profile_puts_batch_16s_intercept_gap_in_k2s_depth_dependence():
    """docs/perf.md's reading of the profiled run: at batch 16 the fused arm's higher busy
    intercept is its layer kernels' (K2's time per call falls with depth), not per-step work."""
    import json

    path = Path(__file__).resolve().parents[2] / "docs/results/e2e_vllm_92b4779_profile.json"
    rows = {(r["arm"], r["batch"]): r for r in bench.runner.gpu_profile_fit_rows(
        json.loads(path.read_text())["runs"])}  # fmt: skip
    on, off = rows["on", 16], rows["off", 16]
    gap = on["busy_intercept_us"] - off["busy_intercept_us"]
    layer_gap = on["layer_kernels_intercept_us"] - off["layer_kernels_intercept_us"]
    assert gap == pytest.approx(114.76, abs=0.05)
    assert layer_gap == pytest.approx(123.24, abs=0.05)
    assert on["layer_kernels"][0]["name"] == "k2_kernel"
    assert on["layer_kernels"][0]["us_per_call"] == [249.78, 242.49]
