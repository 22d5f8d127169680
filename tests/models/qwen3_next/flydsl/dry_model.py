"""The dry run's model: a tiny Qwen3-Next whose sizes the FlyDSL kernels take, shared by the
binding's dry run (test_backend_binding) and the device tests (test_flydsl_gpu)."""

from mono_ext.models.qwen3_next.configs import get_preset


def config():
    cfg = get_preset("qwen3-next-tiny")  # 3 GDN layers, then attention
    cfg.update(head_dim=64, moe_intermediate_size=64, shared_expert_intermediate_size=64,
               mamba_ssm_dtype="float32")  # fmt: skip
    return cfg
