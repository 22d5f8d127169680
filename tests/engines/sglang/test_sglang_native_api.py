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
  raises listing SGLang's reasons and ours together; the triton backend is refused only
  where it cannot run (no CUDA here), and resolves where it can (its probe stubbed);
- plan routing: a tiny Qwen3-Next built by 0.5.23's own classes, checked and built by our
  spec (reference backend), behind 0.5.23's own ``_Dispatch``: DECODE steps of served
  widths run our forward (the logits of a stand-in engine attention run), EXTEND,
  TARGET_VERIFY and wider steps run the model's forward;
- FailStop: ``load_plugins`` puts 0.5.17's after-hook on ``ModelRunner.forward`` (the model
  stage refuses a process without it); through SGLang's own ``ModelRunner.forward`` (as
  patched) and ``_forward_raw`` on a stand-in runner, after a simulated capture of the
  decode graphs (the dispatching forward under capture, recorded by ``plan``): each replay
  of a routed graph (``decode_cuda_graph_runner.execute`` returning without entering the
  model, as a replay does on the host) and each eager routed step is released once before
  ``forward`` returns, i.e. before SGLang samples it (``TpModelWorker.
  forward_batch_generation``); a health block saying a wait gave up raises
  :class:`FailStopError` naming the wait, from then on; stock graphs and prefill are not
  checked; the report RPC through SGLang's own (hooked) ``Scheduler.handle_rpc_request``.
"""

from __future__ import annotations

import dataclasses
import json
import os
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
    def test_native_api_suite_in_the_overlay():
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
    from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
    from sglang.srt.kernel_plugins.nvidia import binding as nvb  # noqa: E402
    from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402

    from mono_ext.engines.sglang import hooks, native_api  # noqa: E402
    from mono_ext.engines.sglang.dispatch import ROUTED_ATTR  # noqa: E402
    from mono_ext.engines.sglang.serving import SERVING_ATTR  # noqa: E402
    from mono_ext.models.qwen3_next.spec import LIMITS, Qwen3NextSpec  # noqa: E402
    from mono_ext.tools.checkpoint import make_checkpoint  # noqa: E402
    from tests.engines._support.sglang_common import (  # noqa: E402
        Spy,
        batch,
        load,
        persistent_launches,
        pools,
        process_result,
        server_args,
    )

    ARCH = "Qwen3NextForCausalLM"
    FWD = hooks.FORWARD_TARGET

    @pytest.fixture(scope="module", autouse=True)
    def plugins_loaded():
        from sglang.srt.plugins import load_plugins

        assert sglang.__version__.startswith("0.5.23"), sglang.__version__
        load_plugins()

    def test_entry_point_is_the_one_the_api_requires():
        assert nv.ENTRY_POINT == native_api.ENTRY_POINT == "nvidia_megakernel"
        assert nv.MEGAKERNEL_API_VERSION == native_api.API_VERSION
        assert nvb.plugin_reasons() == []  # SGLang finds our entry point installed

    def test_load_plugins_registers_our_spec_for_each_architecture():
        from sglang.srt.plugins.hook_registry import HookRegistry

        assert set(native_api.ARCHITECTURES) <= set(nv.registered_architectures())
        spec, why = nv.find_spec(architectures=[ARCH], isa="sm_90")
        assert why == "" and isinstance(spec, nv.MegakernelSpec)
        assert spec is native_api.MEGAKERNEL_SPEC
        none, why = nv.find_spec(architectures=[ARCH], isa="sm_100")
        assert none is None and "supports ['sm_90'], not sm_100" in why
        # 0.5.17's --monokernel hooks are not installed on this SGLang
        assert not any("ModelRunner.load_model" in t for t in HookRegistry._hooks)
        native_api.register()  # re-entrant
        assert nv.find_spec(architectures=[ARCH], isa="sm_90")[0] is spec

    def test_spec_maps_our_model_spec():
        s = native_api.MEGAKERNEL_SPEC
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
        s = native_api.mono_spec("flydsl")
        assert isinstance(s, amd.MonoSpec) and s.api_version == amd.MONOKERNEL_API_VERSION
        assert s.widths("gfx950") == tuple(range(1, 17))
        assert s.devices["gfx950"].tp_sizes == tuple(LIMITS["tp_sizes"])
        assert s.numerics.bound("k2.hidden.rel") == Qwen3NextSpec.NUMERICS["k2.hidden.rel_l2"]
        # mono_ext registers a flydsl backend, so load_plugins registered the AMD spec too
        # (the backend itself refuses until its kernels exist and a gfx950 device is visible)
        assert amd.spec_registered(backend=amd.BACKEND, architectures=[ARCH])

    # -- SGLang objects on CPU (_support/sglang_common: shared with the 0.5.17 suite) -----------
    @pytest.fixture(scope="module")
    def ckpt(tmp_path_factory):
        return make_checkpoint(tmp_path_factory.mktemp("qn"), "qwen3-next-tiny")

    @pytest.fixture
    def gpu_isa(monkeypatch):
        """What SGLang's binding would read from an H200 (there is no GPU here)."""
        monkeypatch.setattr(nvb, "device_isa", lambda: "sm_90")

    def _triton_here(monkeypatch):
        """The triton backend as on an H200: its probe says it can run, every width served
        (none is measured faster than stock yet: MONO_EXT_SERVE_UNMEASURED=1)."""
        from mono_ext.core.registry import get_registry

        backends = get_registry().backends
        probed = dataclasses.replace(backends["triton"], probe=lambda: (True, "sm_90 (test)"))
        monkeypatch.setitem(backends, "triton", probed)
        monkeypatch.setenv("MONO_EXT_SERVE_UNMEASURED", "1")

    def test_resolution_refuses_with_sglangs_and_our_reasons(ckpt, gpu_isa):
        sa = server_args(ckpt, enable_nvidia_megakernel=True, enable_lora=True, max_lora_rank=8)
        with pytest.raises(ValueError) as info:
            sa.resolve_once()  # what the launcher and Engine run before anything starts
        text = str(info.value)
        assert text.startswith("--enable-nvidia-megakernel cannot run this setup:")
        assert "LoRA is in use and mono_ext.qwen3_next does not accept it" in text  # SGLang's
        assert "lora is on" in text  # ours: the spec's config refusal
        assert "kernel backend 'auto': no kernel backend can run here" in text  # CPU: no triton
        assert "FailStop" not in text

    def test_triton_is_refused_only_where_it_cannot_run(ckpt, gpu_isa, monkeypatch):
        """FailStop is checked after every step now (below): the triton backend is no longer
        refused for it; the reasons it cannot run here still apply."""
        sa = server_args(ckpt)
        hf = ModelConfig.from_server_args(sa).hf_config
        spec = native_api.megakernel_spec("triton")
        assert spec.config_disable_reasons(sa, hf) == [
            "kernel backend 'triton': kernel backend 'triton' cannot run here: no CUDA device "
            "is visible"
        ]
        _triton_here(monkeypatch)
        assert spec.config_disable_reasons(sa, hf) == []
        # and SGLang's own resolution of --enable-nvidia-megakernel (auto picks triton) passes
        server_args(ckpt, enable_nvidia_megakernel=True).resolve_once()

    @pytest.fixture(scope="module")
    def model(ckpt):
        return load(ckpt)

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

    @pytest.fixture
    def deployed(model, monkeypatch):
        """Our spec (reference backend: the fp32 CPU one) checked and built for the model, and
        the model's forward replaced by 0.5.23's own ``_Dispatch``, as ``install_megakernel``
        does; undone afterwards."""
        spec = native_api.megakernel_spec("reference")
        # what torch reports outside graph capture (CPU-only torch raises instead)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(native_api, "MEGAKERNEL_SPEC", spec, raising=False)
        m, hf = model.model, model.mc.hf_config
        assert spec.model_disable_reasons(m, hf) == []
        ctx = nv.BuildContext(
            widths=tuple(range(1, spec.max_rows + 1)), tokens_per_request=1, deadline_s=30.0
        )
        built = spec.build(m, hf, ctx)
        original = Spy()  # the model's own forward
        binding = SimpleNamespace(forward_view=lambda: "view")
        m.forward = nvb._Dispatch(built=built, original=original, binding=binding).wrapped()
        rp, kvp = pools(model.mc)
        slots = torch.tensor([1, 2, 3] + [-1] * 13, dtype=torch.int32)  # 3 requests, padded
        backend = FakeAttention(rp, kvp, slots)
        yield SimpleNamespace(spec=spec, built=built, original=original, backend=backend)
        for attr in ("forward", ROUTED_ATTR, SERVING_ATTR):
            m.__dict__.pop(attr, None)

    def test_plan_routing_through_sglangs_own_dispatch(model, deployed):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        spec, built, backend = deployed.spec, deployed.built, deployed.backend
        found, why = nv.find_spec(architectures=[ARCH], isa="sm_90")
        assert found is spec, why
        assert built.widths == tuple(range(1, 17)) and built.draft_sampler is None
        assert "mono_ext qwen3_next on backend reference" in built.summary()
        forward, calls = model.model.forward, deployed.original.calls
        for mode, bs, tokens in (("EXTEND", 2, 3), ("TARGET_VERIFY", 2, 4), ("DECODE", 17, 1)):
            fb = batch(mode, bs, tokens_per_row=tokens)
            assert built.plan(fb.input_ids, fb) is None
            assert forward(fb.input_ids, torch.zeros(bs * tokens, dtype=torch.long), fb) == "stock"
        assert calls == [("EXTEND", 2), ("TARGET_VERIFY", 2), ("DECODE", 17)]
        fb = batch("DECODE", 4)
        step = built.plan(fb.input_ids, fb)
        assert isinstance(step, nv.Step) and (step.mode, step.rows) == ("decode", 4)
        with forward_context(ForwardContext(attn_backend=backend)):
            out = forward(fb.input_ids, torch.arange(4), fb)
        assert calls[-1] == ("DECODE", 17), "a served decode step ran the model's forward"
        assert out.next_token_logits.shape == (4, model.mc.hf_config.vocab_size)
        assert backend.calls == 1  # the engine attention of the one attention layer
        assert built.serving.active and built.router.routed_steps == 1

    # -- FailStop after every step --------------------------------------------------------------
    def test_load_plugins_puts_the_failstop_hook_on_model_runner_forward():
        from sglang.srt.model_executor.model_runner import ModelRunner

        assert hooks.applied(hooks.FORWARD_TARGET, hooks.after_forward)
        assert hooks.applied(hooks.RPC_TARGET, hooks.around_handle_rpc_request)
        assert hasattr(ModelRunner.forward, "__wrapped__")  # HookRegistry's wrapper
        assert native_api.failstop_reasons() == []

    def test_model_stage_refuses_where_the_hook_is_not_applied(model, monkeypatch):
        from sglang.srt.plugins.hook_registry import HookRegistry

        monkeypatch.setattr(HookRegistry, "_patched", set(HookRegistry._patched) - {FWD})
        try:
            reasons = native_api.megakernel_spec("reference").model_disable_reasons(
                model.model, model.mc.hf_config
            )
        finally:
            model.model.__dict__.pop(SERVING_ATTR, None)
        assert len(reasons) == 1 and reasons[0].startswith(
            f"mono_ext's FailStop hook on {FWD} is not applied in this process"
        )

    class Graphs:
        """The decode CUDA-graph runner as ``ModelRunner._forward_raw`` sees it: graphs of
        batch sizes ``capture_bs``; a replay pads the batch to the next one (``bs``) and
        returns the captured output without running any Python of the model."""

        capture_bs = (1, 2, 4, 8, 16, 24)

        def __init__(self):
            self.bs = None

        def can_run_graph(self, fb):
            return fb.batch_size <= max(self.capture_bs)

        def execute(self, fb, pp_proxy_tensors=None):
            self.bs = min(b for b in self.capture_bs if b >= fb.batch_size)
            return f"replayed graph {self.bs}"

    class Eager:
        """SGLang's eager runner: the model's (dispatching) forward, in the forward context
        ``_forward_raw`` set."""

        def __init__(self, model):
            self.model = model

        def execute(self, fb, pp_proxy_tensors=None):
            n = fb.input_ids.shape[0]
            return self.model.forward(fb.input_ids, torch.zeros(n, dtype=torch.long), fb)

    class Runner:
        """A ModelRunner with SGLang's own ``forward`` (as HookRegistry patched it: the
        FailStop after-hook) and ``_forward_raw`` (which picks replay or eager), over
        stand-ins for what needs a GPU."""

        def forward(self, *args, **kwargs):  # looked up now: load_plugins patched it
            return ModelRunner.forward(self, *args, **kwargs)

        _forward_raw = ModelRunner._forward_raw
        _maybe_execute_deferred_mamba_cow_and_clear = (
            ModelRunner._maybe_execute_deferred_mamba_cow_and_clear
        )
        forward_pass_id, msprobe_debugger, canary_manager, eplb_manager = 0, None, None, None
        is_draft_worker = enable_elastic_ep = False
        hisparse_coordinator = prefill_cuda_graph_runner = None
        device = "cuda"  # decode batches may replay a graph

        def __init__(self, model, attn_backend, graphs=True):
            self.model, self.attn_backend = model, attn_backend
            self.req_to_token_pool = attn_backend.req_to_token_pool
            self.decode_cuda_graph_runner = Graphs() if graphs else None
            self.eager_runner = Eager(model)

        def _prepare_eager_forward_batch(self, fb):  # DP / MLP-sync padding: none here
            pass

    def _capture(model, deployed, monkeypatch):
        """What capturing the decode graphs of ``Graphs.capture_bs`` (the largest first, as
        SGLang does) and then a prefill graph runs on the host: the dispatching forward under
        capture, in the capture's forward context."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        router = deployed.built.router
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        router.capturing = lambda: True  # CPU torch never captures
        shapes = [("DECODE", bs, 1) for bs in sorted(Graphs.capture_bs, reverse=True)]
        with forward_context(ForwardContext(attn_backend=deployed.backend)):
            for mode, bs, tokens in [*shapes, ("EXTEND", 4, 8)]:
                fb = batch(mode, bs, tokens_per_row=tokens)
                model.model.forward(fb.input_ids, torch.zeros(bs * tokens, dtype=torch.long), fb)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        router.capturing = lambda: False
        return router

    def test_each_routed_step_is_checked_before_sglang_samples_it(model, deployed, monkeypatch):
        router = _capture(model, deployed, monkeypatch)
        # every captured decode graph's plan, the prefill graph not mixed in
        assert {bs: s and s.width for bs, s in router.captured.items()} == {
            1: 1,
            2: 2,
            4: 4,
            8: 8,
            16: 16,
            24: None,
        }
        assert router.replayed_steps == router.released == 0  # a capture releases nothing
        shared = persistent_launches(deployed.built.serving)
        runner = Runner(model.model, deployed.backend)
        for bs in (3, 1, 8, 3):  # healthy replays of routed graphs: each checked once
            out = runner.forward(batch("DECODE", bs))
            assert out.can_run_graph and out.logits_output.startswith("replayed graph")
            process_result()  # where SGLang awaits the batch's tokens
        assert (shared["steps"], shared["releases"]) == (4, 4)
        assert router.replayed == {4: 2, 1: 1, 8: 1} and router.released == 4
        runner.forward(batch("DECODE", 20))  # a stock graph (24)
        runner.forward(batch("EXTEND", 2, tokens_per_row=3))  # prefill: SGLang's forward
        assert (shared["steps"], shared["releases"], router.stock_decode) == (4, 4, 1)
        # graphs off: an eager routed step runs the launches here and is released too
        eager = Runner(model.model, deployed.backend, graphs=False)
        out = eager.forward(batch("DECODE", 4))
        assert not out.can_run_graph and out.logits_output.next_token_logits.shape[0] == 4
        process_result()
        assert (shared["steps"], shared["releases"], router.released) == (5, 5, 5)
        assert router.replayed_steps == 4 and router.routed_steps == 5 + 1  # + the capture
        assert deployed.original.calls == [("DECODE", 24), ("EXTEND", 4), ("EXTEND", 2)]

    def test_a_failed_wait_raises_before_sglang_samples_the_step(model, deployed, monkeypatch):
        from mono_ext.runtime.failstop import FailStopError

        router = _capture(model, deployed, monkeypatch)
        shared = persistent_launches(deployed.built.serving)
        runner = Runner(model.model, deployed.backend)
        runner.forward(batch("DECODE", 2))
        process_result()
        shared["src"].fail()  # a device wait of the next step gives up
        runner.forward(batch("DECODE", 2))  # a replay: its copy lands by its result's await
        with pytest.raises(FailStopError, match="gave up") as info:
            process_result()  # raised before SGLang hands out any of the step's tokens
        assert "region#0[9]: rank 0 CTA 1" in str(info.value)  # the wait, named
        with pytest.raises(FailStopError):  # sticky: eager steps too
            Runner(model.model, deployed.backend, graphs=False).forward(batch("DECODE", 3))
        assert router.released == 1

    def test_a_forward_outside_model_runner_forward_does_not_hide_a_replay(
        model, deployed, monkeypatch
    ):
        """SGLang's warmups (e.g. FlashInfer autotune's ``_dummy_run``) call the model's
        forward without ``ModelRunner.forward``: the next replay is still checked as one."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        router = _capture(model, deployed, monkeypatch)
        shared = persistent_launches(deployed.built.serving)
        fb = batch("DECODE", 2)
        with forward_context(ForwardContext(attn_backend=deployed.backend)):
            model.model.forward(fb.input_ids, torch.zeros(2, dtype=torch.long), fb)
        assert router._pending is not None and shared["steps"] == 1  # ran, never released
        Runner(model.model, deployed.backend).forward(batch("DECODE", 2))
        process_result()
        assert router.replayed == {2: 1} and (shared["steps"], shared["releases"]) == (2, 1)

    def test_the_report_rpc_on_the_native_api(model, deployed, monkeypatch, tmp_path):
        from sglang.srt.managers import scheduler as sched_mod
        from sglang.srt.managers.io_struct import RpcReqInput

        from mono_ext.engines.sglang.report import REPORT_RPC

        _capture(model, deployed, monkeypatch)
        runner = Runner(model.model, deployed.backend)
        runner.forward(batch("DECODE", 3))
        process_result()
        monkeypatch.setattr(sched_mod, "barrier", lambda group=None: None)  # one rank
        fake = SimpleNamespace(  # 0.5.23's scheduler has no tp_rank: the runtime context's
            tp_worker=SimpleNamespace(model_runner=runner),
            tp_group=SimpleNamespace(cpu_group=None),
        )
        handler = sched_mod.Scheduler.handle_rpc_request  # as HookRegistry patched it
        out = handler(fake, RpcReqInput(method=REPORT_RPC, parameters={"path": str(tmp_path)}))
        assert out.success, out.message
        r = json.loads((tmp_path / f"{REPORT_RPC}.tp0.json").read_text())
        assert (r["state"], r["backend"], r["tp_rank"]) == ("on", "reference", 0)
        assert r["captured"] == {"1": 1, "2": 2, "4": 4, "8": 8, "16": 16, "24": None}
        assert (r["replayed"], r["released"]) == ({"4": 1}, 1)
