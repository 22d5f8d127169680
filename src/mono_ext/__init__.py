"""mono_ext: persistent fused decode kernels for vLLM and SGLang."""

__version__ = "0.1.0"
