"""Pure parts of benchmarks/e2e_sglang.py (no SGLang, no torch): plan, Engine arguments of
each arm on the H200 and on CPU, the CPU config padding, and the shared summary math."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_sglang.py"
_spec = importlib.util.spec_from_file_location("e2e_sglang", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_plan_interleaves_arms_like_e2e_vllm():
    ids = [e["id"] for e in bench.build_plan([16, 32], ["off", "on", "on", "off"])]
    assert ids[:5] == ["bw", "L16/off/0", "L16/on/0", "L16/on/1", "L16/off/1"]
    assert len(ids) == 9


def test_gpu_arms_differ_only_by_the_flag(tmp_path):
    a = bench.parse_args(["--out", str(tmp_path)])
    assert a.preset == "qwen3-next-80b-a3b" and a.backend == "triton"
    off = bench.engine_kwargs(a, tmp_path, "off", tmp_path / "r.json")
    on = bench.engine_kwargs(a, tmp_path, "on", tmp_path / "r.json")
    assert {k: v for k, v in on.items() if k not in ("monokernel", "monokernel_backend")} == off
    assert (on["monokernel"], on["monokernel_backend"]) == (True, "triton")
    assert off["load_format"] == "dummy" and off["disable_shared_experts_fusion"] is True
    assert off["cuda_graph_bs_decode"] == [1, 2, 4, 8, 16] and off["disable_prefill_cuda_graph"]
    assert "disable_cuda_graph" not in off and "disable_overlap_schedule" not in off
    (hook,) = off["forward_hooks"]
    assert hook["hook_factory"] == "_sglang_scale:factory" and hook["config"]["scale"] == 16.0
    assert bench.arm_env(a, "on")["MONO_EXT_SERVE_UNMEASURED"] == "1"
    assert "MONO_EXT_SERVE_UNMEASURED" not in bench.arm_env(a, "off")
    assert a.max_model_len >= a.prompt_len + a.n2


def test_profile_steps_is_refused_in_one_line(tmp_path, capsys):
    """A cProfile of the benchmark's process would profile SGLang's front end, not the
    scheduler that runs the model: the option is refused, naming the one that works."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path), "--profile-steps"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--profile-steps" in err and "scheduler" in err and "--profile-gpu" in err
    assert bench.parse_args(["--out", str(tmp_path), "--profile-gpu"]).profile_gpu


def test_cpu_smoke_arguments(tmp_path):
    a = bench.parse_args(["--out", str(tmp_path), "--cpu-smoke"])
    assert (a.preset, a.backend, a.layers, a.batches) == (
        "qwen3-next-tiny",
        "reference",
        [4, 8],
        [1, 2],
    )
    kw = bench.engine_kwargs(a, tmp_path, "on")
    assert (
        kw["device"] == "cpu"
        and kw["disable_cuda_graph"]
        and kw["attention_backend"] == "torch_native"
    )
    assert bench.arm_env(a, "off")["SGLANG_USE_CPU_ENGINE"] == "1"
    assert str(bench.CPU_STANDINS) in bench.entry_pythonpath(a, "")
    cfg = bench.cut_config("qwen3-next-tiny", 8, cpu=True)
    assert cfg["shared_expert_intermediate_size"] % 32 == 0 and len(cfg["layer_types"]) == 8
    q = bench.parse_args(["--out", str(tmp_path), "--model", "q35"])
    assert q.preset == "qwen3.5-35b-a3b" and bench.names("q35")[0] == "e2e_sglang_q35.json"
    assert bench.engine_kwargs(q, tmp_path, "off")["enable_multimodal"] is False


def test_tpot_rows_fit_and_floor():
    from _e2e_math import tpot_rows

    from mono_ext.models.qwen3_next.configs import get_preset
    from mono_ext.models.qwen3_next.dims import Dims

    dims = Dims.from_config(get_preset("qwen3-next-80b-a3b"))
    tp = {("off", 16, 1): [2.0e-3, 2.2e-3, 2.1e-3], ("off", 32, 1): [3.7e-3], ("on", 16, 1): [1e-3]}
    rows = tpot_rows(tp, dims, bw=4e12, ctx=700.0, state_bytes=4)
    off, on = rows
    assert off["tpot_L16_ms"] == pytest.approx(2.1) and off["per_layer_us"] == pytest.approx(100)
    assert off["tpot_L48_ms"] == pytest.approx(0.5 + 4.8)
    assert 0 < off["floor_fraction"] < 1
    assert "per_layer_us" not in on  # one layer count: no slope


def test_entry_estimates_cover_the_h100_run_and_fit_its_first_call(tmp_path):
    """The plan's estimates against the committed H100 run of the same plan: never below an
    entry's measured wall time (a call that starts an entry it cannot finish loses it), and
    the first engine entry fits, after the bandwidth entry, the 470 s call that skipped it
    under the former estimate of a cold start (420 s)."""
    import json

    result = _PATH.parents[1] / "docs" / "results" / "e2e_sglang_h100.json"
    runs = json.loads(result.read_text())["runs"]
    a = bench.parse_args(["--out", str(tmp_path), "--quick", "--layers", "8,16"])
    warm: set[str] = set()
    est = {e["id"]: bench.estimate_entry_s(e, a, warm) for e in bench.build_plan(a.layers, a.order)}
    assert set(est) == set(runs)
    for entry, seconds in est.items():
        assert runs[entry]["wall_s"] <= seconds, entry
    assert est["bw"] + est["L8/off/0"] <= 470
