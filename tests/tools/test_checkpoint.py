"""The tiny-checkpoint maker writes exactly what transformers 5.17 loads."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from mono_ext.models.qwen3_next.configs import PRESETS  # noqa: E402
from mono_ext.tools.checkpoint import (  # noqa: E402
    checkpoint_config,
    make_checkpoint,
    param_shapes,
)

TINY = [n for n in PRESETS if "tiny" in n]


def _hf_model_on_meta(cfg_dict):
    cfg = transformers.AutoConfig.for_model(**cfg_dict)
    arch = cfg_dict["architectures"][0]
    with torch.device("meta"):
        return getattr(transformers, arch)(cfg)


def _hf_shapes(model):
    sd = model.state_dict()
    if model.config.get_text_config().tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # tied: saved once, under the embedding
    return {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.parametrize(
    "name,arch",
    [(n, None) for n in TINY] + [("qwen3.5-moe-tiny-b", "Qwen3_5MoeForCausalLM")],
)
def test_table_matches_hf_state_dict(name, arch):
    cfg = checkpoint_config(name, arch=arch)
    table = param_shapes(name, arch=arch, expert_layout="fused")
    assert table == _hf_shapes(_hf_model_on_meta(cfg))


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "qwen3.5-35b-a3b"])
def test_table_matches_hf_for_real_shapes_cut_to_two_layers(name):
    # meta device: shapes only, nothing allocated
    n = 4 if name.startswith("qwen3.5") else 2  # the 35B cut keeps one attention layer too
    cfg = checkpoint_config(name, num_layers=n)
    table = param_shapes(name, num_layers=n, expert_layout="fused")
    assert table == _hf_shapes(_hf_model_on_meta(cfg))
    assert cfg["architectures"] == (
        ["Qwen3NextForCausalLM"]
        if name.startswith("qwen3-next")
        else ["Qwen3_5MoeForConditionalGeneration"]
    )


def _load(path, arch):
    cls = getattr(transformers, arch)
    model, info = cls.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32)
    return model, info


@pytest.mark.parametrize(
    "name,arch,layout",
    [
        ("qwen3-next-tiny", "Qwen3NextForCausalLM", "auto"),
        ("qwen3-next-tiny-b", "Qwen3NextForCausalLM", "fused"),
        ("qwen3-next-tiny-dense-mlp", "Qwen3NextForCausalLM", "per_expert"),
        ("qwen3.5-moe-tiny", "Qwen3_5MoeForConditionalGeneration", "auto"),
        ("qwen3.5-moe-tiny-b", "Qwen3_5MoeForCausalLM", "per_expert"),
    ],
)
def test_checkpoint_loads_with_no_missing_or_unexpected_keys(tmp_path, name, arch, layout):
    kw = {"arch": arch} if arch == "Qwen3_5MoeForCausalLM" else {}
    out = make_checkpoint(tmp_path / name, name, seed=3, expert_layout=layout, **kw)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch]
    model, info = _load(out, arch)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info.get("error_msgs")
    # values really come from the file (not from init)
    on_disk = safetensors_torch.load_file(str(out / "model.safetensors"))
    sd = model.state_dict()
    emb = next(k for k in on_disk if k.endswith("embed_tokens.weight"))
    hf_emb = next(k for k in sd if k.endswith("embed_tokens.weight"))
    assert torch.equal(sd[hf_emb], on_disk[emb].float())
    a_log = next(k for k in on_disk if k.endswith("A_log"))
    assert on_disk[a_log].dtype == torch.float32
    assert float(on_disk[a_log].min()) >= 0 and float(on_disk[a_log].max()) <= 2.78
    # routed experts land in HF's fused gate_up_proj whichever layout the file has
    gu = next(k for k in sd if k.endswith("mlp.experts.gate_up_proj"))
    if gu in on_disk:
        assert torch.equal(sd[gu].bfloat16(), on_disk[gu])
    else:
        pre = gu[: -len("experts.gate_up_proj")]
        e1 = torch.cat(
            [on_disk[f"{pre}experts.1.gate_proj.weight"], on_disk[f"{pre}experts.1.up_proj.weight"]]
        )
        assert torch.equal(sd[gu][1].bfloat16(), e1)
    auto_per_expert = layout == "per_expert" or (layout == "auto" and "next" in name)
    assert (gu not in on_disk) == auto_per_expert


def test_sharded_checkpoint_and_determinism(tmp_path):
    a = make_checkpoint(tmp_path / "a", "qwen3-next-tiny", seed=1, max_shard_bytes=200_000)
    index = json.loads((a / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(param_shapes("qwen3-next-tiny"))
    model, info = _load(a, "Qwen3NextForCausalLM")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    b = make_checkpoint(tmp_path / "b", "qwen3-next-tiny", seed=1)
    c = make_checkpoint(tmp_path / "c", "qwen3-next-tiny", seed=2)
    tb = safetensors_torch.load_file(str(b / "model.safetensors"))
    tc = safetensors_torch.load_file(str(c / "model.safetensors"))
    ta = {}
    for f in files:
        ta.update(safetensors_torch.load_file(str(a / f)))
    assert all(torch.equal(ta[k], tb[k]) for k in tb)  # same seed, any sharding: same values
    assert not torch.equal(tb["lm_head.weight"], tc["lm_head.weight"])


def test_num_layers_cut_and_unknown_preset():
    cfg = checkpoint_config("qwen3-next-tiny-dense-mlp", num_layers=3)
    assert cfg["num_hidden_layers"] == 3 and cfg["mlp_only_layers"] == []
    cfg35 = checkpoint_config("qwen3.5-35b-a3b", num_layers=5)
    assert cfg35["text_config"]["layer_types"] == ["linear_attention"] * 3 + [
        "full_attention",
        "linear_attention",
    ]
    with pytest.raises(KeyError, match="qwen3-next-tiny"):
        param_shapes("no-such-preset")
