"""What the vLLM tests that build vLLM's modules in-process share (tests/e2e/test_vllm_adapter.py,
tests/e2e/test_vllm_quant.py)."""

from __future__ import annotations

import socket


def ensure_vllm_distributed() -> None:
    """A gloo world of one and vLLM's model-parallel groups of one, once per process (what
    vLLM's own module tests set up before building a layer)."""
    import torch
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=0,
        backend="gloo",
    )
    ensure_model_parallel_initialized(1, 1)
