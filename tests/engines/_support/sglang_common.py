"""SGLang's own objects built on CPU, for the SGLang e2e tests on 0.5.17 and 0.5.23.

``ServerArgs``, a one-rank gloo process group, SGLang's ``ModelConfig`` and model loader (a
tiny checkpoint into SGLang's own classes), its ``HybridReqToTokenPool`` /
``HybridLinearKVPool`` and ``ForwardBatch``; where the two releases' calls differ, the
installed one's signature decides. :class:`Spy` stands in for the model's own forward;
:class:`Persistent` gives launches the per-step hooks of a persistent backend over a real
FailStop, for the FailStop tests of both adapters.

Import it after ``pytest.importorskip("sglang")`` and ``("torch")``.
"""

from __future__ import annotations

import inspect
import socket
from types import SimpleNamespace
from typing import Any

import torch

BF16 = torch.bfloat16
SLOTS, TOKENS = 8, 256  # pool sizes: requests (GDN state slots) and KV tokens

_DIST = {"up": False}


def server_args(path, **extra):
    """SGLang's ServerArgs for a tiny checkpoint on CPU."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(path),
        device="cpu",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        disable_radix_cache=True,
        **extra,
    )


def publish(sa) -> None:
    """Publish ``sa`` as this process's runtime context (0.5.23 also wants its ranks)."""
    from sglang.srt import runtime_context as rc

    if "ranks" in inspect.signature(rc.publish).parameters:
        rc.publish(sa, role="test", ranks=rc.SpawnRanks(world_rank=0, gpu_id=0))
    else:
        rc.publish(sa, role="test")


def ensure_dist() -> None:
    """One-rank process groups over gloo, once per process."""
    if _DIST["up"]:
        return
    from sglang.srt.distributed import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    ps.initialize_model_parallel(backend="gloo")
    _DIST["up"] = True


def load(path, *, fused: bool = False, **extra) -> SimpleNamespace:
    """SGLang's ModelConfig + loader on CPU (``extra``: more ServerArgs). ``fused``: build as
    on CUDA, where SGLang fuses the shared expert into the routed experts as an extra slot."""
    import sglang.srt.layers.rotary_embedding.base as rope_base
    import sglang.srt.models.qwen2_moe as qwen2_moe
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.model_loader import get_model

    sa = server_args(path, **extra)
    publish(sa)
    ensure_dist()
    mc = ModelConfig.from_server_args(sa)
    if len(inspect.signature(initialize_dp_attention).parameters) > 1:  # 0.5.17
        initialize_dp_attention(sa, mc)
    else:
        initialize_dp_attention(sa)
    saved = (rope_base._is_cpu, qwen2_moe._is_cuda)
    # CPU stand-ins for device checks at construction: the rotary module would otherwise
    # import vLLM's CUDA op; qwen2_moe enables shared-expert fusion on CUDA only.
    rope_base._is_cpu = True
    qwen2_moe._is_cuda = fused
    try:
        model = get_model(
            model_config=mc,
            load_config=LoadConfig(load_format="auto"),
            device_config=DeviceConfig("cpu", 0),
        )
    finally:
        rope_base._is_cpu, qwen2_moe._is_cuda = saved
    return SimpleNamespace(model=model, mc=mc, sa=sa)


def pools(mc, slots: int = SLOTS, tokens: int = TOKENS, kv_dtype=BF16):
    """SGLang's GDN state pool and KV pool for the model, as allocated by default."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    tc = mc.hf_text_config
    cp = tc.mamba2_cache_params
    rp = HybridReqToTokenPool(
        size=slots,
        mamba_size=slots,
        mamba_spec_state_size=0,
        max_context_len=64,
        device="cpu",
        enable_memory_saver=False,
        cache_params=cp,
        mamba_layer_ids=cp.layers,
        enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False,
    )
    full = [i for i, k in enumerate(tc.layers_block_type) if k == "attention"]
    kvp = HybridLinearKVPool(
        size=tokens,
        dtype=kv_dtype,
        page_size=1,
        head_num=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        full_attention_layer_ids=full,
        device="cpu",
        mamba_pool=rp.mamba_pool,
    )
    return rp, kvp


def batch(mode: str, bs: int, *, tokens_per_row: int = 1, ids=None, **extra):
    """A ForwardBatch of ``bs`` rows in ``mode`` (a ForwardMode name); ``extra`` attributes
    are set on it."""
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    n = bs * tokens_per_row
    fb = ForwardBatch(
        forward_mode=getattr(ForwardMode, mode),
        batch_size=bs,
        input_ids=torch.zeros(n, dtype=torch.long) if ids is None else ids,
        req_pool_indices=torch.zeros(bs, dtype=torch.long),
        seq_lens=torch.ones(bs, dtype=torch.long),
        out_cache_loc=torch.zeros(n, dtype=torch.long),
        seq_lens_sum=bs,
    )
    fb.capture_hidden_mode = CaptureHiddenMode.NULL
    for k, v in extra.items():
        setattr(fb, k, v)
    return fb


class Spy:
    """Stands in for SGLang's own model forward (which needs CUDA kernels): records the call."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, positions, forward_batch, *args, **kwargs):
        self.calls.append((forward_batch.forward_mode.name, forward_batch.batch_size))
        return "stock"


class Persistent:
    """One width's launches with the per-step hooks of a persistent backend: ``end_step``
    submits the step's health copy to the FailStop in ``shared`` (``fs``), ``release`` asks
    it whether the step's tokens may go; ``shared`` counts steps and releases."""

    def __init__(self, inner: Any, shared: dict) -> None:
        self.inner, self.shared, self.key = inner, shared, inner.key

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def end_step(self, replayed: bool = False) -> int:
        self.shared["steps"] += 1
        self.shared["fs"].after_launch(self.shared["steps"])
        return self.shared["steps"]

    def release(self, step=None) -> bool:
        self.shared["releases"] += 1
        self.shared["asked"].append(step)
        return self.shared["fs"].release(self.shared["steps"] if step is None else step)


def persistent_launches(serving: Any) -> dict:
    """Give ``serving``'s driver :class:`Persistent` launches over a real FailStop reading a
    lagging :class:`~mono_ext.runtime.failstop.ScriptedHealthSource` (a step's copy lands by
    the await of its results); returns the shared state (``fs``, ``src``, ``steps``,
    ``releases``, ``asked``: the step numbers each release asked about)."""
    from mono_ext.engines.sglang import release
    from mono_ext.runtime.failstop import FailStop, ScriptedHealthSource

    release.pending().release_all()  # nothing left from another test's model
    src = ScriptedHealthSource(lagging=True)
    shared = dict(fs=FailStop(src, agree_every=16), steps=0, releases=0, src=src, asked=[])
    driver = serving.driver
    driver.launches = {w: Persistent(x, shared) for w, x in driver.launches.items()}
    return shared


def process_result(result: Any = None) -> Any:
    """What SGLang does with a batch after its forward, through mono_ext's hooks on it:
    ``TpModelWorker.forward_batch_generation`` returns the batch result (which takes the steps'
    tickets), then the scheduler's result processor hands its tokens out (the tickets are
    released first). Raises where a step's device wait gave up."""
    from types import SimpleNamespace

    from mono_ext.engines.sglang import release

    result = SimpleNamespace(copy_done=None) if result is None else result
    release.after_forward_batch_generation(result, None, None)
    release.before_process_batch_result(None, None, result)
    return result


# -- a deployment on those objects (the 0.5.17 adapter's model, FailStop and report tests) -----
def load_with_tensors(path, *, fused: bool = False) -> SimpleNamespace:
    """SGLang's ModelConfig + loader on CPU, and the checkpoint's tensors (``sd``)."""
    from safetensors.torch import load_file

    env = load(path, fused=fused, disable_cuda_graph=True)
    env.sd = load_file(str(path / "model.safetensors"))
    return env


def serving(env, *, backend="reference", check=False, sa=None):
    from mono_ext.core.settings import Settings
    from mono_ext.engines.sglang.flags import Monokernel
    from mono_ext.engines.sglang.serving import Serving

    sv = Serving(Monokernel(backend), settings=Settings(check=check))
    mc = env.mc
    sv.accept_config(mc.hf_config, sa or env.sa, dtype=mc.dtype, quantization=mc.quantization)
    sv.accept_model(env.model)
    return sv


def active(env, **kw):
    sv = serving(env, **kw)
    rp, kvp = pools(env.mc)
    sv.accept_caches(rp, kvp)
    assert sv.active, sv.refusal and sv.refusal.message()
    return sv, rp, kvp


def after_forward(qn, *, mode="DECODE", bs=3, graph_bs=4, can_run_graph=True):
    """The after-hook as SGLang's hook registry calls it after ModelRunner.forward."""
    from mono_ext.engines.sglang import plugin

    runner = SimpleNamespace(model=qn.model, decode_cuda_graph_runner=SimpleNamespace(bs=graph_bs))
    out = SimpleNamespace(can_run_graph=can_run_graph, logits_output=None)
    return plugin._after_forward(out, runner, batch(mode, bs))
