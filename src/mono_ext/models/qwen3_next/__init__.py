"""Qwen3-Next / Qwen3.5-MoE family: preset configs, dims and shapes, the spec, the launch
interface and driver, the exact reference (`reference/`) and the kernel backends (`triton/`,
`flydsl/`)."""
