import json
import subprocess
import sys

import pytest

from mono_ext.cli import EXIT_REFUSED, EXIT_USAGE, main
from mono_ext.models.qwen3_next.configs import get_preset
from mono_ext.models.qwen3_next.triton import measured


def test_explain_triton_serves_no_width_where_none_was_measured_faster(capsys, monkeypatch):
    monkeypatch.delenv("MONO_EXT_SERVE_UNMEASURED", raising=False)
    argv = ["explain", "qwen3-next-80b-a3b", "--backend", "triton", "--device", "NVIDIA A100"]
    assert main(argv) == EXIT_REFUSED
    out = capsys.readouterr().out
    assert out.startswith("mono_ext off: [config] 1 reason(s) (triton):")
    assert "'triton' serves no width with vllm on NVIDIA A100" in out
    assert "MONO_EXT_SERVE_UNMEASURED=1" in out


def test_explain_names_the_widths_served_on_an_h200_and_their_source(capsys, monkeypatch):
    monkeypatch.delenv("MONO_EXT_SERVE_UNMEASURED", raising=False)
    # the mechanism, whatever the committed results list today (test_measured_widths)
    source = "docs/results/e2e_vllm.json (a run where width 1 was faster)"
    monkeypatch.setitem(measured.FASTER, ("vllm", "NVIDIA H200", "bf16"), (frozenset({1}), source))
    argv = ["explain", "qwen3-next-80b-a3b", "--backend", "triton", "--device", "NVIDIA H200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mono_ext on: qwen3_next" in out
    assert "widths served by default: 1 (measured faster: docs/results/e2e_vllm.json" in out
    assert "qwen3_next/triton/w1/bfloat16/tp1/" in out and "/w2/" not in out
    assert main([*argv, "--engine", "sglang"]) == EXIT_REFUSED  # never measured on SGLang


def test_explain_serves_an_fp8_checkpoint_nothing_a_bf16_run_measured(
    capsys, monkeypatch, tmp_path
):
    """Served widths are measured per weight format: a bf16 result says nothing about K2 on
    fp8 planes (slower than vLLM's own fp8 tail in docs/results/k2_vllm_fp8.csv)."""
    import json

    from mono_ext.models.qwen3_next.configs import get_preset

    monkeypatch.delenv("MONO_EXT_SERVE_UNMEASURED", raising=False)
    source = "docs/results/e2e_vllm.json (a run where width 1 was faster)"
    monkeypatch.setitem(measured.FASTER, ("vllm", "NVIDIA H200", "bf16"), (frozenset({1}), source))
    cfg = {**get_preset("qwen3-next-80b-a3b"), "quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["explain", str(tmp_path), "--backend", "triton", "--device", "NVIDIA H200"]
    assert main(argv) == EXIT_REFUSED
    out = capsys.readouterr().out
    assert "'triton' serves no width with vllm on NVIDIA H200 (fp8 weights)" in out


def test_explain_prints_the_backends_refusals(capsys, monkeypatch):
    monkeypatch.setenv("MONO_EXT_SERVE_UNMEASURED", "1")
    assert main(["explain", "qwen3-next-80b-a3b", "--tp", "4", "--backend", "triton"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("mono_ext off: [config]") and "serves TP 1 only" in out


def test_explain_preset_prints_plan_for_every_width(capsys, monkeypatch):
    monkeypatch.setenv("MONO_EXT_SERVE_UNMEASURED", "1")
    assert main(["explain", "qwen3-next-80b-a3b", "--backend", "triton"]) == 0
    out = capsys.readouterr().out
    assert "mono_ext on: qwen3_next" in out
    for w in range(1, 17):
        assert f"qwen3_next/triton/w{w}/bfloat16/tp1/" in out


def test_explain_config_dir_lists_every_reason(tmp_path, capsys):
    cfg = get_preset("qwen3-next-tiny")
    cfg.update(hidden_act="relu", num_experts_per_tok=12)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = main(["explain", str(tmp_path), "--tp", "8", "--feature", "lora"])
    out = capsys.readouterr().out
    assert rc == EXIT_REFUSED
    assert out.startswith("mono_ext off: [config]")
    for needle in ("lora is on", "hidden_act='relu'", "num_experts_per_tok=12", "TP 8"):
        assert needle in out


def test_explain_wrapped_multimodal_config(tmp_path, capsys):
    wrapped = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": get_preset("qwen3.5-moe-tiny"),
    }
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    assert main(["explain", str(tmp_path / "config.json")]) == 0
    assert "Qwen3_5MoeForConditionalGeneration" in capsys.readouterr().out


def test_explain_unsupported_model_is_a_refusal_not_an_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert main(["explain", str(tmp_path)]) == EXIT_REFUSED
    assert "no registered spec serves ['LlamaForCausalLM']" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["explain", "no-such-thing"], "neither a config.json"),
        (["explain", "qwen3-next-tiny", "--tp", "0"], "--tp must be >= 1"),
    ],
)
def test_user_mistakes_are_one_line_exit_2(argv, needle, capsys):
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("mono-ext: ") and needle in err and err.count("\n") == 1


def test_bad_json_and_bad_env_through_the_console_script(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    exe = [sys.executable, "-m", "mono_ext.cli"]
    r = subprocess.run([*exe, "explain", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == EXIT_USAGE and "is not valid JSON" in r.stderr
    assert "Traceback" not in r.stderr
    env = {"MONO_EXT_DEADLINE_S": "soon", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([*exe, "doctor"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "settings: INVALID: MONO_EXT_DEADLINE_S='soon'" in r.stdout


def test_doctor_lists_specs_and_backends(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_next" in out and "reference    usable" in out and "triton" in out
    assert "served by default on " in out
    assert "triton       vllm    bf16 weights: widths " in out
    assert "triton       sglang  bf16 weights: widths none" in out
