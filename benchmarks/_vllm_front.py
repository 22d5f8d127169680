"""vLLM 0.26's own code for the K1 layer front: the ``vllm`` arms of benchmarks/bench_k1.py.

The work of one K1 launch, run by vLLM's own modules, built as its model loader builds
Qwen3-Next and called as its decoder layer calls them (paths under vllm/, 0.26.0):

- **GDN front.** models/qwen3_next.py Qwen3NextDecoderLayer.forward:
  ``input_layernorm(hidden_states, residual)`` (a layers/layernorm.py GemmaRMSNorm), then
  ``linear_attn(hidden_states)``, a model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py
  QwenGatedDeltaNetAttention built with ``gqa_interleaved_layout=True`` as the decoder layer
  builds it. Its forward_cuda is run whole: ``in_proj_qkvz`` and ``in_proj_ba``
  (MergedColumnParallelLinear -> ``F.linear``), ``fix_query_key_value_ordering`` and the
  ``torch.cat`` of q, k, v, the ``torch.zeros`` output buffer, the custom op
  ``torch.ops.vllm.qwen_gdn_attention_core`` -> ``_forward_core`` -> (pure decode, packed
  recurrent decode on, vLLM's default) ``_forward_core_decode_non_spec``:
  ``causal_conv1d_update`` on the cached conv state and
  ``fused_recurrent_gated_delta_rule_packed_decode`` on the cached recurrent state, both in
  place; then ``_output_projection``'s RMSNormGated. The one change: the module's
  ``out_proj`` is an identity, since out_proj is K2's work (bench_k2's vLLM arm times it).
  The op finds its layer and the step's GDNAttentionMetadata (a pure decode batch, as
  GDNAttentionMetadataBuilder makes one) through the forward context, as in the engine; the
  states are the module's ``kv_cache`` (conv, recurrent), shaped by its own get_state_shape.
- **Attention front.** models/qwen3_next.py Qwen3NextAttention.forward up to its attention:
  ``input_layernorm``, ``qkv_proj`` (QKVParallelLinear), ``_project_qkv_gate`` (on CUDA the
  fused split + q/k Gemma RMSNorm + partial NeoX RoPE + gate kernel
  ``fused_qk_rmsnorm_rope_gate``), then the K/V write the FlashAttention backend does first
  in its forward (v1/attention/backends/flash_attn.py FlashAttentionImpl.do_kv_cache_update:
  ``reshape_and_cache_flash`` into the (blocks, heads, block, 2 x head_dim) cache through the
  slot mapping). The paged attention itself is the engine's in both arms and is not timed.

Modes as in benchmarks/_vllm_chain.py: ``eager`` (arm ``vllm``, custom ops on) and
``compiled`` (arm ``vllm-compiled``): vLLM compiles everything around its splitting custom
ops with Inductor, in pieces split at those ops. The GDN front is then two compiled pieces
(input norm, projections, q/k/v ordering; the gated norm) around the eager core op, the
pieces holding forward_cuda's own statements (a single graph through the op would let
Inductor hand the op differently strided inputs than vLLM's piecewise graphs do); the
attention front, which has no splitting op before the K/V write, is one compiled function.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from _vllm_chain import MODES, engine_config, worker_context, write_model_dir

from mono_ext.engines.vllm.local import ensure_vllm_distributed

ARMS = {"eager": "vllm", "compiled": "vllm-compiled"}
KV_BLOCK = 16


class _OutProjOff(torch.nn.Module):
    """Stands for out_proj, which is K2's: hands the gated norm's output through."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None


def _gdn_front(norm, gdn, hidden: torch.Tensor, residual: torch.Tensor):
    h, res = norm(hidden, residual)
    return gdn.forward_cuda(h), res


def _gdn_project(norm, gdn, hidden: torch.Tensor, residual: torch.Tensor):
    """forward_cuda's part 1 with the layer's input norm: the piece vLLM compiles before the
    GDN core op (its interleaved branch; ``rearrange "l p d -> l (p d)"`` is this reshape)."""
    h, res = norm(hidden, residual)
    mixed_qkvz, _ = gdn.in_proj_qkvz(h)
    ba, _ = gdn.in_proj_ba(h)
    q, k, v, z, b, a = gdn.fix_query_key_value_ordering(mixed_qkvz, ba)
    q, k, v = (t.reshape(t.shape[0], -1) for t in (q, k, v))
    return torch.cat((q, k, v), dim=-1), z, b, a, res


def _gdn_gated_norm(gdn, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """_output_projection up to out_proj: the piece vLLM compiles after the core op."""
    out = gdn.norm(core.reshape(-1, core.shape[-1]), z.reshape(-1, z.shape[-1]))
    return out.reshape(z.shape).flatten(-2)


def _gdn_pieces(project, gated_norm):
    """The compiled arm's GDN front as vLLM's piecewise graphs run it: the two compiled pieces
    around the opaque core op, called eagerly between them (Inductor keeps a piece's output
    strides, which the op's kernels rely on)."""
    from vllm.utils.torch_utils import _encode_layer_name

    def front(norm, gdn, hidden, residual):
        mixed_qkv, z, b, a, res = project(norm, gdn, hidden, residual)
        core = torch.zeros(
            (hidden.shape[0], gdn.num_v_heads // gdn.tp_size, gdn.head_v_dim),
            dtype=hidden.dtype,
            device=hidden.device,
        )
        torch.ops.vllm.qwen_gdn_attention_core(
            mixed_qkv, b, a, core, layer_name=_encode_layer_name(gdn.prefix)
        )
        return gated_norm(gdn, core, z), res

    return front


def _attn_front(norm, attn, hidden, residual, positions):
    h, res = norm(hidden, residual)
    qkv, _ = attn.qkv_proj(h)
    q, k, v, gate = attn._project_qkv_gate(qkv, positions)
    return q, k, v, gate, res


def _bind(module: torch.nn.Module, name: str, t: torch.Tensor, device) -> None:
    p = getattr(module, name)
    if tuple(p.shape) != tuple(t.shape):
        raise ValueError(f"vLLM's {type(module).__name__}.{name} is {tuple(p.shape)}, "
                         f"got {tuple(t.shape)}")  # fmt: skip
    # the caller's tensor itself where vLLM keeps that dtype (no copy: the same bytes stream)
    p.data = (t if t.dtype == p.dtype else t.to(p.dtype)).to(device)


class VllmFront:
    """vLLM 0.26's modules for the K1 work of ``len(gdn_planes)`` GDN layers and
    ``len(attn_planes)`` attention layers (module docstring).

    ``gdn_planes[r]``: ``input_layernorm``, ``in_proj_qkvz`` (interleaved packing),
    ``in_proj_ba``, ``conv1d`` [conv_dim, 1, K], ``A_log``, ``dt_bias``, ``norm``;
    ``attn_planes[r]``: ``input_layernorm``, ``qkv_proj``, ``q_norm``, ``k_norm``.
    """

    def __init__(
        self,
        gdn_planes: list[dict[str, torch.Tensor]],
        attn_planes: list[dict[str, torch.Tensor]],
        *,
        preset: str = "qwen3-next-80b-a3b",
        mode: str = "eager",
        device: str | torch.device = "cuda",
    ):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            QwenGatedDeltaNetAttention,
        )
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.models.qwen3_next import Qwen3NextAttention
        from vllm.utils.torch_utils import set_default_torch_dtype

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.device = mode, torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            import vllm.utils.torch_utils  # noqa: F401  (vLLM's stream tracking, as a worker)

            torch.cuda.set_stream(torch.cuda.current_stream(self.device))
        self._tmp = tempfile.TemporaryDirectory(prefix="vllm-front-")
        self.cfg = cfg = engine_config(write_model_dir(preset, Path(self._tmp.name)), mode)
        text = cfg.model_config.hf_text_config
        hidden, eps = int(text.hidden_size), float(text.rms_norm_eps)
        self.gdn_layers, self.attn_layers = torch.nn.ModuleList(), torch.nn.ModuleList()
        with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
            ensure_vllm_distributed()
            for r, w in enumerate(gdn_planes):
                layer = torch.nn.Module()
                layer.input_layernorm = GemmaRMSNorm(hidden, eps=eps)
                layer.linear_attn = QwenGatedDeltaNetAttention(
                    text,
                    vllm_config=cfg,
                    prefix=f"model.layers.{r}.linear_attn",
                    gqa_interleaved_layout=True,
                )
                gdn = layer.linear_attn
                gdn.out_proj = _OutProjOff()
                _bind(layer.input_layernorm, "weight", w["input_layernorm"], self.device)
                _bind(gdn.in_proj_qkvz, "weight", w["in_proj_qkvz"], self.device)
                _bind(gdn.in_proj_ba, "weight", w["in_proj_ba"], self.device)
                _bind(gdn.conv1d, "weight", w["conv1d"], self.device)
                _bind(gdn, "A_log", w["A_log"], self.device)
                _bind(gdn, "dt_bias", w["dt_bias"], self.device)
                _bind(gdn.norm, "weight", w["norm"], self.device)
                self.gdn_layers.append(layer)
            for r, w in enumerate(attn_planes):
                layer = torch.nn.Module()
                layer.input_layernorm = GemmaRMSNorm(hidden, eps=eps)
                layer.self_attn = Qwen3NextAttention(
                    text,
                    model_config=cfg.model_config,
                    cache_config=cfg.cache_config,
                    quant_config=cfg.quant_config,
                    prefix=f"model.layers.{len(gdn_planes) + r}.self_attn",
                )
                attn = layer.self_attn
                _bind(layer.input_layernorm, "weight", w["input_layernorm"], self.device)
                _bind(attn.qkv_proj, "weight", w["qkv_proj"], self.device)
                _bind(attn.q_norm, "weight", w["q_norm"], self.device)
                _bind(attn.k_norm, "weight", w["k_norm"], self.device)
                self.attn_layers.append(layer)
            process_weights_after_loading(
                torch.nn.ModuleList([*self.gdn_layers, *self.attn_layers]),
                cfg.model_config,
                self.device,
            )
            for m in (*self.gdn_layers, *self.attn_layers):
                m.to(self.device)
        self._gdn_fn, self._attn_fn = _gdn_front, _attn_front
        if mode == "compiled":
            self._gdn_fn = _gdn_pieces(
                torch.compile(_gdn_project, backend="inductor", dynamic=False),
                torch.compile(_gdn_gated_norm, backend="inductor", dynamic=False),
            )
            self._attn_fn = torch.compile(_attn_front, backend="inductor", dynamic=False)
            dc = torch._dynamo.config
            n = len(gdn_planes) + len(attn_planes)
            for knob in ("recompile_limit", "cache_size_limit"):
                if hasattr(dc, knob):
                    setattr(dc, knob, max(getattr(dc, knob), 8 * n))

    # ------------------------------------------------------------------ GDN

    def gdn_states(self, slots: int, ssm_dtype: torch.dtype = torch.float32):
        """Fresh (conv, recurrent) states for ``slots`` slots in vLLM's own shapes, one pair
        per GDN layer (conv in the model dtype; zeros: the caller fills them)."""
        out = []
        for layer in self.gdn_layers:
            conv_shape, ssm_shape = layer.linear_attn.get_state_shape()[:2]
            conv = torch.zeros(slots, *conv_shape, dtype=torch.bfloat16, device=self.device)
            ssm = torch.zeros(slots, *ssm_shape, dtype=ssm_dtype, device=self.device)
            out.append((conv, ssm))
        return out

    def conv_is_time_major(self) -> bool:
        """Whether vLLM keeps the conv state as (state_len, dim) per slot (its "SD" layout)."""
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        return not is_conv_state_dim_first()

    @contextlib.contextmanager
    def gdn_step(self, states, slot_ids: torch.Tensor) -> Iterator[None]:
        """A pure decode step's forward context: every GDN layer's metadata and states."""
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

        n = int(slot_ids.shape[0])
        meta = GDNAttentionMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=n,
            num_decode_tokens=n,
            num_spec_decodes=0,
            num_spec_decode_tokens=0,
            num_actual_tokens=n,
            non_spec_state_indices_tensor=slot_ids,
        )
        for layer, (conv, ssm) in zip(self.gdn_layers, states, strict=True):
            layer.linear_attn.kv_cache = (conv, ssm)
        metas = {layer.linear_attn.prefix: meta for layer in self.gdn_layers}
        with self._context(metas):
            yield

    def gdn_front(self, r: int, hidden: torch.Tensor, residual: torch.Tensor):
        """Layer r's front inside ``gdn_step``: (gated norm output [B, value_dim], residual)."""
        layer = self.gdn_layers[r]
        return self._gdn_fn(layer.input_layernorm, layer.linear_attn, hidden, residual)

    # ------------------------------------------------------------------ attention

    def attn_cache(self, blocks: int) -> list[torch.Tensor]:
        """One FlashAttention KV cache per attention layer, (blocks, kv heads, block, 2 x D)."""
        out = []
        for layer in self.attn_layers:
            a = layer.self_attn
            out.append(
                torch.zeros(blocks, a.num_kv_heads, KV_BLOCK, 2 * a.head_dim,
                            dtype=torch.bfloat16, device=self.device)  # fmt: skip
            )
        return out

    @contextlib.contextmanager
    def attn_step(self) -> Iterator[None]:
        with self._context(None):
            yield

    def attn_front(self, r, hidden, residual, positions, kv_cache, slot_mapping):
        """Layer r's front: q, gate (for o_proj) and residual; K and V written into
        ``kv_cache`` at ``slot_mapping`` as FlashAttentionImpl.do_kv_cache_update does."""
        from vllm.v1.attention.backends.fa_utils import reshape_and_cache_flash

        layer = self.attn_layers[r]
        a = layer.self_attn
        q, k, v, gate, res = self._attn_fn(layer.input_layernorm, a, hidden, residual, positions)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(a.head_dim, dim=-1)
        reshape_and_cache_flash(
            k.view(-1, a.num_kv_heads, a.head_dim),
            v.view(-1, a.num_kv_heads, a.head_dim),
            key_cache,
            value_cache,
            slot_mapping,
            "auto",
            a.attn._k_scale,
            a.attn._v_scale,
        )
        return q, gate, res

    # ------------------------------------------------------------------ shared

    def _context(self, attn_metadata: Any) -> contextlib.AbstractContextManager:
        return worker_context(self.cfg, attn_metadata)
