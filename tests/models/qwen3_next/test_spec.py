import dataclasses

import pytest

from mono_ext.core import ConfigView, Deployment, PlaneView, StepView
from mono_ext.core.views import FEATURES
from mono_ext.models.qwen3_next.configs import PRESETS, get_preset
from mono_ext.models.qwen3_next.dims import Dims, text_config
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec

SERVED = [
    "qwen3-next-80b-a3b",
    "qwen3.5-35b-a3b",
    "qwen3-next-tiny",
    "qwen3.5-moe-tiny",
    "qwen3.5-moe-tiny-b",
]


@pytest.mark.parametrize("preset", SERVED)
@pytest.mark.parametrize("tp", [1, 2])
def test_real_and_tiny_configs_pass_every_stage(preset, tp, views):
    ideal_model, ideal_caches = views
    spec = Qwen3NextSpec()
    assert spec.accept_config(ConfigView(get_preset(preset), tp_size=tp)).reasons == ()
    d = spec.dims
    assert spec.refuse_model(ideal_model(d)).reasons == ()
    for layout in ("time_chan", "chan_time"):
        for ssm in ("float32", "bfloat16"):
            assert (
                spec.refuse_caches(ideal_caches(d, conv_layout=layout, ssm_dtype=ssm)).reasons == ()
            )


def test_real_80b_shapes_are_derived_not_hard_coded():
    d = Dims.from_config(get_preset("qwen3-next-80b-a3b"), tp=2)
    assert d.kinds.count("full_attention") == 12 and d.kinds.count("linear_attention") == 36
    gdn, attn = d.planes("linear_attention"), d.planes("full_attention")
    assert gdn["in_proj_qkvz"] == ((2 * 16 * 128 + 2 * 32 * 128) // 2, 2048)
    assert gdn["conv1d"] == (8192 // 2, 1, 4) and gdn["out_proj"] == (2048, 16 * 128)
    assert attn["qkv_proj"] == (2 * 8 * 256 + 2 * 1 * 256, 2048)  # kv heads 2 -> 1 per rank
    assert gdn["w13"] == (512, 512, 2048) and gdn["w2"] == (512, 2048, 256)
    assert d.rotary_dim == 64


def test_every_config_reason_is_listed_not_just_the_first():
    cfg = get_preset("qwen3-next-tiny")
    cfg.update(
        hidden_act="gelu",
        norm_topk_prob=False,
        linear_key_head_dim=48,
        num_experts_per_tok=11,
        num_experts=600,
        attention_bias=True,
        linear_conv_kernel_dim=3,
    )
    view = ConfigView(
        cfg,
        tp_size=3,
        dtype="float16",
        quantization="fp8",
        features=frozenset({"spec_decode", "lora", "kv_connector"}),
    )
    reasons = Qwen3NextSpec().refuse_config(view).reasons
    needles = [
        "hidden_act",
        "norm_topk_prob",
        "linear_key_head_dim=48",
        "num_experts_per_tok=11",
        "num_experts=600",
        "attention_bias",
        "linear_conv_kernel_dim=3",
        "TP 3",
        "dtype float16",
        "quantization 'fp8'",
        "spec_decode",
        "lora",
        "kv_connector",
    ]
    for needle in needles:
        assert sum(needle in r for r in reasons) >= 1, (needle, reasons)
    assert len(reasons) >= len(needles)


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_engine_feature_is_refused_with_its_reason(feature):
    view = ConfigView(get_preset("qwen3-next-tiny"), features=frozenset({feature}))
    assert Qwen3NextSpec().refuse_config(view).reasons == (f"{feature} is on: {FEATURES[feature]}",)


def test_unknown_architecture_and_dense_layers():
    cfg = get_preset("qwen3-next-tiny")
    cfg["architectures"] = ["LlamaForCausalLM"]
    assert "is not one of" in Qwen3NextSpec().refuse_config(ConfigView(cfg)).reasons[0]
    r = Qwen3NextSpec().refuse_config(ConfigView(get_preset("qwen3-next-tiny-dense-mlp")))
    assert any("dense-MLP" in x for x in r.reasons)


def test_wrapped_qwen35_config_is_unwrapped():
    inner = get_preset("qwen3.5-moe-tiny")
    wrapped = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": inner,
        "vision_config": {},
    }
    cfg = text_config(wrapped)
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert Qwen3NextSpec().refuse_config(ConfigView(cfg)).reasons == ()


def test_model_stage_lists_every_bad_plane(views):
    ideal_model, _ = views
    spec = Qwen3NextSpec()
    spec.accept_config(ConfigView(get_preset("qwen3-next-tiny")))
    mv = ideal_model(spec.dims)
    l0, l3 = mv.layers[0], mv.layers[3]
    bad0 = dict(l0.planes)
    bad0["w13"] = PlaneView((8, 60, 64), "bfloat16")  # wrong I
    bad0["out_proj"] = PlaneView(bad0["out_proj"].shape, "bfloat16", quant="Fp8LinearMethod")
    del bad0["dt_bias"]
    bad3 = dict(l3.planes)
    bad3["qkv_proj"] = PlaneView(bad3["qkv_proj"].shape, "float16", contiguous=False)
    layers = (
        dataclasses.replace(l0, planes=bad0, facts={"qkvz_packing": "contiguous"}),
        *mv.layers[1:3],
        dataclasses.replace(l3, planes=bad3, facts={"fused_shared_expert": True}),
    )
    reasons = spec.refuse_model(dataclasses.replace(mv, layers=layers)).reasons
    for needle in [
        "layer 0: w13 is (8, 60, 64)",
        "layer 0: out_proj uses quant method",
        "layer 0: no dt_bias",
        "layer 0: in_proj_qkvz packing 'contiguous'",
        "layer 3: qkv_proj is float16",
        "layer 3: qkv_proj is not contiguous",
        "layer 3: shared expert fused",
        "needs --disable-shared-experts-fusion",
    ]:
        assert any(needle in r for r in reasons), (needle, reasons)


def test_cache_stage_lists_every_bad_tensor(views):
    ideal_model, ideal_caches = views
    spec = Qwen3NextSpec()
    spec.accept_config(ConfigView(get_preset("qwen3-next-tiny")))
    cv = ideal_caches(spec.dims)
    l0 = cv.layers[0]
    t = dict(l0.tensors)
    t["conv_state"] = dataclasses.replace(
        t["conv_state"], layout="chan_time"
    )  # shape is time_chan's
    t["ssm_state"] = dataclasses.replace(t["ssm_state"], dtype="float16")
    l3 = cv.layers[3]
    kv = dataclasses.replace(l3.tensors["kv_cache"], dtype="float8_e4m3fn")
    layers = (
        dataclasses.replace(l0, tensors=t),
        *cv.layers[1:3],
        dataclasses.replace(l3, tensors={"kv_cache": kv}),
    )
    reasons = spec.refuse_caches(dataclasses.replace(cv, layers=layers)).reasons
    for needle in [
        "layer 0: conv_state",
        "chan_time layout",
        "ssm_state dtype float16",
        "layer 3: kv_cache is float8_e4m3fn",
    ]:
        assert any(needle in r for r in reasons), (needle, reasons)


def _deployed(widths=tuple(range(1, 17))):
    spec = Qwen3NextSpec()
    spec.accept_config(ConfigView(get_preset("qwen3-next-80b-a3b")))
    spec.deploy(
        Deployment(
            backend="triton",
            dtype="bfloat16",
            tp_size=1,
            widths=widths,
            layouts={"conv_layout": "time_chan", "ssm_dtype": "float32"},
        )
    )
    return spec


@pytest.mark.parametrize("rows", range(1, 17))
def test_plan_routes_pure_decode_of_each_width(rows):
    step = _deployed().plan(StepView("decode", rows))
    assert step is not None and step.width == rows and step.key.width == rows
    assert step.key.layouts == (("conv_layout", "time_chan"), ("ssm_dtype", "float32"))


@pytest.mark.parametrize(
    "view",
    [
        StepView("prefill", 4),
        StepView("mixed", 4),
        StepView("spec_verify", 4),
        StepView("idle", 1),
        StepView("decode", 17),
        StepView("decode", 0),
        StepView("decode", 4, tokens_per_row=2),
    ],
)
def test_plan_leaves_every_other_step_to_the_engine(view):
    assert _deployed().plan(view) is None


def test_plan_only_serves_deployed_widths_and_needs_deploy():
    spec = _deployed(widths=(1, 2, 4))
    assert spec.plan(StepView("decode", 3)) is None and spec.plan(StepView("decode", 4)) is not None
    assert len({k.digest() for k in spec.build_keys()}) == 3
    with pytest.raises(RuntimeError, match="deploy"):
        Qwen3NextSpec().plan(StepView("decode", 1))
    with pytest.raises(ValueError, match="widths"):
        Qwen3NextSpec().deploy(Deployment("triton", "bfloat16", 1, widths=(32,)))


def test_every_preset_is_judged():
    for name in PRESETS:
        Qwen3NextSpec().refuse_config(ConfigView(text_config(get_preset(name))))
