"""mono_ext through SGLang 0.5.23's kernel-plugin API, against the real 0.5.23 package on CPU.

SGLang 0.5.23 needs torch 2.14; its spec/binding modules and model classes also import
under the 0.5.17 environment's torch 2.13. ``tools/ci/install_sglang_cpu.sh`` puts the
0.5.23 package (no dependencies) in ``<venv>/overlays/sglang-0.5.23``. Run in the 0.5.17
environment, this module re-runs itself in a child process with that overlay first on
``PYTHONPATH``; run where ``import sglang`` is 0.5.23, it runs the checks:

- registration: SGLang's own ``load_plugins()`` runs our ``nvidia_megakernel`` entry point
  (the name the API requires), which registers a ``MegakernelSpec`` per architecture;
  ``find_spec`` returns it for sm_90 and says why not for another ISA; the ``mono_ext``
  entry point (0.5.17's hooks) stays out of the way;
- the spec object: requirements, accepted features, numerics, widths as mapped from our
  ModelSpec; the AMD ``MonoSpec`` mapping validates against 0.5.23's classes;
- refusal messages: SGLang's argument resolution with ``--enable-nvidia-megakernel``
  raises listing SGLang's reasons and ours together;
- plan routing: a tiny Qwen3-Next built by 0.5.23's own classes, checked and built by our
  spec (reference backend), behind 0.5.23's own ``_Dispatch``: DECODE steps of served
  widths run our forward (the logits of a stand-in engine attention run), EXTEND,
  TARGET_VERIFY and wider steps run the model's forward.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from mono_ext.engines.sglang import has_native_api  # noqa: E402

OVERLAY = Path(sys.prefix) / "overlays" / "sglang-0.5.23"


if not has_native_api():

    @pytest.mark.skipif(not OVERLAY.is_dir(), reason=f"no SGLang 0.5.23 overlay at {OVERLAY}")
    def test_v0523_suite_in_the_overlay():
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(OVERLAY), os.environ.get("PYTHONPATH", "")]),
        }
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        tail = (run.stdout + run.stderr)[-4000:]
        assert run.returncode == 0, tail
        assert " passed" in run.stdout and " skipped" not in run.stdout.splitlines()[-1], tail

else:
    import sglang  # noqa: E402
    from sglang.kernels.plugin_kernels.amd import spec as amd  # noqa: E402
    from sglang.kernels.plugin_kernels.nvidia import spec as nv  # noqa: E402
    from sglang.srt.kernel_plugins.nvidia import binding as nvb  # noqa: E402

    from mono_ext.engines.sglang import v0523  # noqa: E402
    from mono_ext.models.qwen3_next.spec import LIMITS, Qwen3NextSpec  # noqa: E402
    from mono_ext.tools.checkpoint import make_checkpoint  # noqa: E402

    ARCH = "Qwen3NextForCausalLM"

    @pytest.fixture(scope="module", autouse=True)
    def plugins_loaded():
        from sglang.srt.plugins import load_plugins

        assert sglang.__version__.startswith("0.5.23"), sglang.__version__
        load_plugins()

    def test_entry_point_is_the_one_the_api_requires():
        assert nv.ENTRY_POINT == v0523.ENTRY_POINT == "nvidia_megakernel"
        assert nv.MEGAKERNEL_API_VERSION == v0523.API_VERSION
        assert nvb.plugin_reasons() == []  # SGLang finds our entry point installed

    def test_load_plugins_registers_our_spec_for_each_architecture():
        from sglang.srt.plugins.hook_registry import HookRegistry

        assert set(v0523.ARCHITECTURES) <= set(nv.registered_architectures())
        spec, why = nv.find_spec(architectures=[ARCH], isa="sm_90")
        assert why == "" and isinstance(spec, nv.MegakernelSpec)
        assert spec is v0523.MEGAKERNEL_SPEC
        none, why = nv.find_spec(architectures=[ARCH], isa="sm_100")
        assert none is None and "supports ['sm_90'], not sm_100" in why
        # 0.5.17's --monokernel hooks are not installed on this SGLang
        assert not any("ModelRunner.load_model" in t for t in HookRegistry._hooks)
        v0523.register()  # re-entrant
        assert nv.find_spec(architectures=[ARCH], isa="sm_90")[0] is spec

    def test_spec_maps_our_model_spec():
        s = v0523.MEGAKERNEL_SPEC
        assert s.name == "mono_ext.qwen3_next" and s.api_version == 1
        assert s.requires.isas == frozenset({"sm_90"})
        assert s.requires.tp_sizes == frozenset(LIMITS["tp_sizes"])
        assert s.requires.dtypes == frozenset({"bfloat16"})
        assert s.requires.decode_graph_backends == frozenset({"full", "disabled"})
        assert s.features == frozenset()  # every refused-by-default feature stays refused
        assert s.numerics.kind is nv.NumericsKind.TOLERANCE
        assert dict(s.numerics.tolerances) == dict(Qwen3NextSpec.NUMERICS)
        assert s.max_rows == max(Qwen3NextSpec.widths) == 16

    def test_amd_mono_spec_validates_against_the_amd_contract():
        s = v0523.mono_spec("flydsl")
        assert isinstance(s, amd.MonoSpec) and s.api_version == amd.MONOKERNEL_API_VERSION
        assert s.widths("gfx950") == tuple(range(1, 17))
        assert s.devices["gfx950"].tp_sizes == tuple(LIMITS["tp_sizes"])
        assert s.numerics.bound("k2.hidden.rel") == Qwen3NextSpec.NUMERICS["k2.hidden.rel_l2"]
        # mono_ext registers a flydsl backend, so load_plugins registered the AMD spec too
        # (the backend itself refuses until its kernels exist and a gfx950 device is visible)
        assert amd.spec_registered(backend=amd.BACKEND, architectures=[ARCH])

    # -- SGLang objects on CPU ----------------------------------------------------------------
    _DIST = {"up": False}

    def _publish(sa):
        from sglang.srt import runtime_context as rc

        rc.publish(sa, role="test", ranks=rc.SpawnRanks(world_rank=0, gpu_id=0))
        if _DIST["up"]:
            return
        from sglang.srt.distributed import parallel_state as ps

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        ps.initialize_model_parallel(backend="gloo")
        _DIST["up"] = True

    def _server_args(path, **extra):
        from sglang.srt.server_args import ServerArgs

        return ServerArgs(
            model_path=str(path),
            device="cpu",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            disable_radix_cache=True,
            **extra,
        )

    @pytest.fixture(scope="module")
    def ckpt(tmp_path_factory):
        return make_checkpoint(tmp_path_factory.mktemp("qn"), "qwen3-next-tiny")

    @pytest.fixture
    def gpu_isa(monkeypatch):
        """What SGLang's binding would read from an H200 (there is no GPU here)."""
        monkeypatch.setattr(nvb, "device_isa", lambda: "sm_90")

    def test_resolution_refuses_with_sglangs_and_our_reasons(ckpt, gpu_isa):
        sa = _server_args(ckpt, enable_nvidia_megakernel=True, enable_lora=True, max_lora_rank=8)
        with pytest.raises(ValueError) as info:
            sa.resolve_once()  # what the launcher and Engine run before anything starts
        text = str(info.value)
        assert text.startswith("--enable-nvidia-megakernel cannot run this setup:")
        assert "LoRA is in use and mono_ext.qwen3_next does not accept it" in text  # SGLang's
        assert "lora is on" in text  # ours: the spec's config refusal
        assert "kernel backend 'auto': no kernel backend can run here" in text  # CPU: no triton

    @pytest.fixture(scope="module")
    def model(ckpt):
        import sglang.srt.layers.rotary_embedding.base as rope_base
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.layers.dp_attention import initialize_dp_attention
        from sglang.srt.model_loader import get_model

        sa = _server_args(ckpt)
        _publish(sa)
        initialize_dp_attention(sa)
        mc = ModelConfig.from_server_args(sa)
        saved, rope_base._is_cpu = rope_base._is_cpu, True  # else it imports vLLM's CUDA op
        try:
            m = get_model(
                model_config=mc,
                load_config=LoadConfig(load_format="auto"),
                device_config=DeviceConfig("cpu", 0),
            )
        finally:
            rope_base._is_cpu = saved
        return SimpleNamespace(model=m, mc=mc, sa=sa)

    def _pools(mc):
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

        tc = mc.hf_text_config
        cp = tc.mamba2_cache_params
        rp = HybridReqToTokenPool(
            size=8,
            mamba_size=8,
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
            size=64,
            dtype=torch.bfloat16,
            page_size=1,
            head_num=tc.num_key_value_heads,
            head_dim=tc.head_dim,
            full_attention_layer_ids=full,
            device="cpu",
            mamba_pool=rp.mamba_pool,
        )
        return rp, kvp

    class FakeAttention:
        """The step's attention backend (SGLang's decode kernels need CUDA): zeros out, and
        the GDN slots SGLang's own backend would hand its kernels."""

        def __init__(self, rp, kvp, slots):
            self.req_to_token_pool, self.token_to_kv_pool = rp, kvp
            self.linear_attn_backend = SimpleNamespace(
                forward_metadata=SimpleNamespace(mamba_cache_indices=slots)
            )
            self.calls = 0

        def forward(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
            self.calls += 1
            return torch.zeros(q.shape[0], layer.tp_q_head_num * layer.head_dim, dtype=q.dtype)

    def _batch(mode, bs, tokens=1):
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
            ForwardMode,
        )

        n = bs * tokens
        fb = ForwardBatch(
            forward_mode=getattr(ForwardMode, mode),
            batch_size=bs,
            input_ids=torch.arange(n) % 500,
            req_pool_indices=torch.zeros(bs, dtype=torch.long),
            seq_lens=torch.ones(bs, dtype=torch.long),
            out_cache_loc=torch.zeros(n, dtype=torch.long),
            seq_lens_sum=bs,
        )
        fb.capture_hidden_mode = CaptureHiddenMode.NULL
        return fb

    def test_plan_routing_through_sglangs_own_dispatch(model, monkeypatch):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        spec = v0523.megakernel_spec("reference")  # the fp32 CPU backend in place of triton
        # what torch reports outside graph capture (CPU-only torch raises instead)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(v0523, "MEGAKERNEL_SPEC", spec, raising=False)
        found, why = nv.find_spec(architectures=[ARCH], isa="sm_90")
        assert found is spec, why
        m, hf = model.model, model.mc.hf_config
        assert spec.model_disable_reasons(m, hf) == []
        ctx = nv.BuildContext(
            widths=tuple(range(1, spec.max_rows + 1)), tokens_per_request=1, deadline_s=30.0
        )
        built = spec.build(m, hf, ctx)
        assert built.widths == tuple(range(1, 17)) and built.draft_sampler is None
        assert "mono_ext qwen3_next on backend reference" in built.summary()
        calls = []

        def original(input_ids, positions, forward_batch, *a, **k):
            calls.append((forward_batch.forward_mode.name, forward_batch.batch_size))
            return "stock"

        binding = SimpleNamespace(forward_view=lambda: "view")
        forward = nvb._Dispatch(built=built, original=original, binding=binding).wrapped()
        rp, kvp = _pools(model.mc)
        slots = torch.tensor([1, 2, 3, -1], dtype=torch.int32)
        backend = FakeAttention(rp, kvp, slots)
        for mode, bs, tokens in (("EXTEND", 2, 3), ("TARGET_VERIFY", 2, 4), ("DECODE", 17, 1)):
            fb = _batch(mode, bs, tokens)
            assert built.plan(fb.input_ids, fb) is None
            assert forward(fb.input_ids, torch.zeros(bs * tokens, dtype=torch.long), fb) == "stock"
        assert calls == [("EXTEND", 2), ("TARGET_VERIFY", 2), ("DECODE", 17)]
        fb = _batch("DECODE", 4)
        step = built.plan(fb.input_ids, fb)
        assert isinstance(step, nv.Step) and (step.mode, step.rows) == ("decode", 4)
        with forward_context(ForwardContext(attn_backend=backend)):
            out = forward(fb.input_ids, torch.arange(4), fb)
        assert calls[-1] == ("DECODE", 17), "a served decode step ran the model's forward"
        assert out.next_token_logits.shape == (4, model.mc.hf_config.vocab_size)
        assert backend.calls == 1  # the engine attention of the one attention layer
        assert built.serving.active and built.router.routed_steps == 1
