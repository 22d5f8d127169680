"""vLLM's distributed state for building and calling vLLM's own modules in this process, outside
an engine (the stock-chain benchmark, the adapter's in-process tests): a gloo world of one and
vLLM's TP/PP groups of one, as vLLM's own module tests set up before building a layer."""

from __future__ import annotations

import socket

__all__ = ["ensure_vllm_distributed"]


def ensure_vllm_distributed() -> None:
    """Initialise the world (once per process, on a free local port) and vLLM's model-parallel
    groups (idempotent)."""
    import torch
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    if not torch.distributed.is_initialized():
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
