"""The engine-neutral per-step driver: every decoder layer as K1 -> (engine attention) -> K2.

An engine adapter binds each layer's tensors in place (:class:`~.launches.BoundLayer`), builds
the launches of every served width at start-up, and per planned step hands the driver the
step's embeddings, positions and each GDN layer's state slots (engines may give different
layers different slot tables: vLLM 0.26 keeps one per KV-cache group) plus an ``attend``
callback that runs the engine's own paged attention (which writes the KV cache). The driver owns the activation buffers
(allocated once at the widest width and sliced per step, so graph replays see fixed
addresses) and chains the layers; it contains no engine code and no kernel code. Each step is
bracketed by the launches' ``begin_step`` (device side: captured with the step) and
``end_step`` (host side: a no-op while capturing).

After every step that ran launches on the device the adapter calls
:meth:`DecodeDriver.after_step` from an eager point of its engine right after the forward
(vLLM: ``compute_logits``; SGLang: after ``ModelRunner.forward``): for a replayed CUDA graph it
calls ``end_step`` (the replay never entered Python, so nobody else did). It returns the step's
:class:`~mono_ext.runtime.release.Ticket`, which the adapter releases where its engine already
waits for the step's sampled tokens (``runtime.release``): the launches' ``release`` must let the
step's tokens go, and a step whose device wait gave up raises
:class:`~mono_ext.runtime.failstop.FailStopError` there, so the engine stops instead of returning
its tokens.

Check mode (``MONO_EXT_CHECK=1``, eager only) runs the engine's own layer code
(:class:`StockLayers`) next to each launch on the same inputs and compares with the spec's
NUMERICS through a :class:`~mono_ext.core.numerics.CheckTracker`; GDN states are snapshotted
before K1, the engine's code advances them from the same start, and the launch's states are
put back, so the run continues on the fused path. Router near-tie rows are skipped in
``k2.hidden``. Every breach is logged with its layer and metric.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ...core.numerics import CheckTracker
from ...core.spec import Step
from ...runtime.device import is_capturing
from ...runtime.failstop import FailStopError
from ...runtime.release import Ticket
from .dims import Dims
from .launches import BoundLayer, LayerLaunches

__all__ = ["Attend", "StockLayers", "StepInputs", "DecodeDriver", "StepWithheld"]

log = logging.getLogger("mono_ext.decode")


class StepWithheld(FailStopError):
    """The launches refused to release a step's tokens (a device wait gave up on this rank and
    the TP ranks have not agreed yet): the engine must not return them, so it stops here."""

    def __init__(self, step: Step) -> None:
        RuntimeError.__init__(
            self,
            f"mono_ext FailStop: the launches withheld the tokens of a decode step of width "
            f"{step.width}: a device wait gave up on this rank (MONO_EXT_DEADLINE_S). The engine "
            "stops: no tokens from a failed step are returned and there is no fallback after a "
            "failure.",
        )
        self.summaries = ()
        self.step = None


class Attend(Protocol):
    """The engine's attention for one layer: writes k/v into its paged cache at the step's
    slots and returns the attention output [B, Hq*D] in the engine's dtype."""

    def __call__(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class StockLayers(Protocol):
    """The engine's own layer code, piece by piece, for check mode (an adapter calls the
    engine's modules; no math of its own)."""

    def front_norm(
        self, index: int, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_layernorm with the residual add: (normed x, residual_out)."""

    def gdn_mixer(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """The GDN mixer up to out_proj's input (advances the layer's states in place)."""

    def attn_qkv(
        self, index: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv_proj, q/k norm and RoPE: (q, k, v, gate), as the engine's attention takes them."""

    def out_proj(self, index: int, o_in: torch.Tensor) -> torch.Tensor:
        """out_proj / o_proj of the layer (incl. the engine's TP reduction)."""

    def tail(
        self, index: int, y: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """post_attention_layernorm with the residual add, then the MoE: (hidden, residual)."""


@dataclass(frozen=True)
class StepInputs:
    """One planned step as the engine hands it over (rows = the step's width)."""

    hidden: torch.Tensor  # [B, H] embeddings, engine dtype
    positions: torch.Tensor  # [B]
    # GDN layer index -> [B] state slot per row; padding rows hold the null slot in every one
    slots: Mapping[int, torch.Tensor]


@dataclass
class _Buffers:
    o_in: torch.Tensor  # [W, Hv*Dv]
    q: torch.Tensor  # [W, Hq*D]
    k: torch.Tensor  # [W, Hkv*D]
    v: torch.Tensor  # [W, Hkv*D]
    gate: torch.Tensor  # [W, Hq*D]
    residual: tuple[torch.Tensor, torch.Tensor]  # K1 writes [0], K2 writes [1]
    hidden: tuple[torch.Tensor, torch.Tensor]  # K2 of layer l writes [l % 2]


class DecodeDriver:
    """Runs a planned decode step through the fused launches of every layer.

    ``launches`` maps each served width to its :class:`LayerLaunches` (built at start-up).
    With ``stock`` given, check mode compares every launch with the engine's own code.
    """

    def __init__(
        self,
        layers: Sequence[BoundLayer],
        launches: Mapping[int, LayerLaunches],
        dims: Dims,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        null_slot: int | None,
        numerics: Mapping[str, float],
        stock: StockLayers | None = None,
    ) -> None:
        if not layers:
            raise ValueError("no layers to run")
        if not launches:
            raise ValueError("no launches built")
        self.layers = list(layers)
        self.launches = dict(launches)
        self.dims = dims
        self.null_slot = null_slot
        self.stock = stock
        self.tracker = CheckTracker(numerics) if stock is not None else None
        self.steps = 0  # run() calls (captures included)
        self._finished: int | None = None  # end_step's number for the last eager run()
        self.replays = 0  # replayed graphs handed to after_step
        self.capturing = is_capturing  # replaceable (tests)
        w, h, d = max(self.launches), dims.hidden, dims

        def buf(cols: int) -> torch.Tensor:
            return torch.zeros(w, cols, dtype=dtype, device=device)

        self._buf = _Buffers(
            o_in=buf(d.hv_r * d.dv),
            q=buf(d.hq_r * d.head_dim),
            k=buf(d.hkv_r * d.head_dim),
            v=buf(d.hkv_r * d.head_dim),
            gate=buf(d.hq_r * d.head_dim),
            residual=(buf(h), buf(h)),
            hidden=(buf(h), buf(h)),
        )

    @property
    def checking(self) -> bool:
        return self.tracker is not None

    def run(self, step: Step, inp: StepInputs, attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers for ``step``; returns (hidden, residual) for the engine's final norm.

        The returned tensors are views of the driver's buffers, valid until the next step.
        """
        rows = step.width
        launches = self.launches.get(rows)
        if launches is None:
            raise KeyError(f"no launches built for width {rows} (built: {sorted(self.launches)})")
        bad = [i for i, s in inp.slots.items() if s.shape[0] != rows]
        if inp.hidden.shape[0] != rows or bad:
            raise ValueError(
                f"step of width {rows} got hidden {tuple(inp.hidden.shape)}, "
                f"slots of another width for layers {bad}"
            )
        b = self._buf
        valid = self._valid_rows(next(iter(inp.slots.values()))) if self.checking else None
        hidden, residual = inp.hidden, None
        launches.begin_step()  # e.g. the step epoch: captured with the step, replayed with it
        for n, layer in enumerate(self.layers):
            r1, r2, h2 = b.residual[0][:rows], b.residual[1][:rows], b.hidden[n % 2][:rows]
            if layer.is_gdn:
                o_in, gate, slots = b.o_in[:rows], None, inp.slots[layer.index]
                snap = self._snapshot(layer, slots, valid) if self.checking else None
                launches.k1_gdn(layer, hidden, residual, slots, o_in=o_in, residual_out=r1)
                if snap is not None:
                    self._check_k1_gdn(layer, hidden, residual, o_in, r1, snap, valid)
            else:
                q, k, v, gate = b.q[:rows], b.k[:rows], b.v[:rows], b.gate[:rows]
                launches.k1_attn(
                    layer,
                    hidden,
                    residual,
                    inp.positions,
                    q=q,
                    k=k,
                    v=v,
                    gate=gate,
                    residual_out=r1,
                )
                if self.checking:
                    self._check_k1_attn(
                        layer, hidden, residual, inp.positions, (q, k, v, gate), r1, valid
                    )
                o_in = attend(layer.index, q, k, v)
            launches.k2(layer, o_in, r1, gate, hidden_out=h2, residual_out=r2)
            if self.checking:
                self._check_k2(layer, o_in, gate, r1, h2, r2, valid)
            hidden, residual = h2, r2
        health_copy = getattr(launches, "health_copy", None)
        if health_copy is not None:
            health_copy()  # on the stream after the last K2: inside a capture, a graph node
        self._finished = launches.end_step()  # the step counted (a no-op while capturing)
        self.steps += 1
        return hidden, residual

    def after_step(self, step: Step, *, replayed: bool) -> Ticket | None:
        """The host side of a step that ran on the device, right after its forward (vLLM:
        ``compute_logits``; SGLang: after ``ModelRunner.forward``); never waits for the device.

        ``replayed``: the step was a replay of a captured graph (its ``run`` happened at
        capture, where ``end_step`` does nothing), so ``end_step`` runs now, once per replay;
        an eager step's ``run`` already called it. Returns the step's ticket: its ``release()``
        asks the launches' ``release`` (where the backend has one) whether the step's tokens may
        go, and raises :class:`~mono_ext.runtime.failstop.FailStopError` for a failed device
        wait (or :class:`StepWithheld` while TP ranks have not agreed yet). The adapter calls it
        where the engine awaits the step's sampled tokens. None while a graph is being captured
        (no step ran).
        """
        if self.capturing():
            return None
        launches = self.launches.get(step.width)
        if launches is None:
            raise KeyError(
                f"no launches built for width {step.width} (built: {sorted(self.launches)})"
            )
        if replayed:
            number = launches.end_step(replayed=True)
            self.replays += 1
        else:
            number, self._finished = self._finished, None
        release = getattr(launches, "release", None)

        def release_step() -> None:
            if release is not None and not release(number):
                raise StepWithheld(step)

        return Ticket(release_step, step.width, step)

    # -- check mode ----------------------------------------------------------------------
    def _valid_rows(self, slots: torch.Tensor) -> torch.Tensor:
        ok = slots >= 0
        if self.null_slot is not None:
            ok &= slots != self.null_slot
        return ok

    def _snapshot(self, layer: BoundLayer, slots: torch.Tensor, valid: torch.Tensor):
        idx = slots[valid].long()
        return idx, layer.conv_state[idx].clone(), layer.ssm_state[idx].clone()

    def _compare(self, launch: str, output: str, out, ref, index: int, skip_rows=None) -> None:
        if out.shape[0] == 0:  # every row is padding: nothing the engine computed either
            return
        where = f"layer {index}"
        for breach in self.tracker.check(
            launch, output, out, ref, skip_rows=skip_rows, where=where
        ):
            log.warning("mono_ext check: %s", breach)

    def _check_k1_gdn(self, layer, hidden, residual, o_in, r1, snap, valid) -> None:
        idx, conv_before, ssm_before = snap
        conv, ssm = layer.conv_state, layer.ssm_state
        conv_launch, ssm_launch = conv[idx].clone(), ssm[idx].clone()
        conv[idx], ssm[idx] = conv_before, ssm_before  # the engine's code starts from the same
        x, r_stock = self.stock.front_norm(layer.index, hidden, residual)
        o_stock = self.stock.gdn_mixer(layer.index, x)
        conv_stock, ssm_stock = conv[idx].clone(), ssm[idx].clone()
        conv[idx], ssm[idx] = conv_launch, ssm_launch  # the fused path goes on with its own
        i = layer.index
        self._compare("k1", "out", o_in[valid], o_stock[valid], i)
        self._compare("k1", "residual", r1[valid], r_stock[valid], i)
        if idx.numel():
            self._compare("k1", "conv_state", conv_launch, conv_stock, i)
            self._compare("k1", "ssm_state", ssm_launch, ssm_stock, i)

    def _check_k1_attn(self, layer, hidden, residual, positions, qkvg, r1, valid) -> None:
        x, r_stock = self.stock.front_norm(layer.index, hidden, residual)
        stock = self.stock.attn_qkv(layer.index, x, positions)
        for name, out, ref in zip(("q", "k", "v", "gate"), qkvg, stock, strict=True):
            self._compare("k1", name, out[valid], ref.reshape(out.shape)[valid], layer.index)
        self._compare("k1", "residual", r1[valid], r_stock[valid], layer.index)

    def _check_k2(self, layer, o_in, gate, r1, h2, r2, valid) -> None:
        from .reference.attention import attn_out_input
        from .reference.common import gemma_rms_norm
        from .reference.tail import route

        if gate is not None:  # o_proj's input as the engine forms it: attn * sigmoid(gate)
            o_in = attn_out_input(o_in, gate).to(o_in.dtype)
        y = self.stock.out_proj(layer.index, o_in)
        h_stock, r_stock = self.stock.tail(layer.index, y, r1)
        w = layer.weights
        x = gemma_rms_norm(r_stock, w["post_attention_layernorm"], self.dims.eps)
        _, _, near_tie = route(x, w["router"], self.dims.top_k, self.dims.norm_topk)
        self._compare("k2", "residual", r2[valid], r_stock[valid], layer.index)
        self._compare(
            "k2", "hidden", h2[valid], h_stock[valid], layer.index, skip_rows=near_tie[valid]
        )
