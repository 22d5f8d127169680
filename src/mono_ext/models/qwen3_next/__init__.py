"""Qwen3-Next / Qwen3.5-MoE family: preset configs, shapes, the spec."""
