"""Plain-torch GDN ops with the signatures SGLang 0.5.17's CPU path calls (fp32 math).

Layouts as SGLang's pools hold them: conv state ``[slots, dim, K-1]``, recurrent state
``[slots, HV, V, K]``; a negative slot index marks a padded row (left untouched).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _act(x: torch.Tensor, activation) -> torch.Tensor:
    return F.silu(x) if activation in ("silu", "swish", True) else x


def causal_conv1d_fn_cpu(
    x,
    weight,
    bias=None,
    conv_states=None,
    query_start_loc=None,
    seq_lens_cpu=None,
    cache_indices=None,
    has_initial_state=None,
    activation="silu",
    **kwargs,
):
    """Prefill: ``x`` [dim, T] (sequences concatenated), returns [dim, T]; each sequence's
    last K-1 inputs (after its initial state) become its conv state."""
    dim, width = weight.shape[0], weight.shape[-1]
    w = weight.reshape(dim, width).float()
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        slot = int(cache_indices[i]) if cache_indices is not None else i
        xs = x[:, s:e].float()
        if has_initial_state is not None and bool(has_initial_state[i]) and slot >= 0:
            init = conv_states[slot].float()
        else:
            init = xs.new_zeros(dim, width - 1)
        full = torch.cat([init, xs], dim=1)  # [dim, K-1+L]
        y = F.conv1d(full.unsqueeze(0), w.unsqueeze(1), groups=dim).squeeze(0)
        if bias is not None:
            y = y + bias.float()[:, None]
        out[:, s:e] = _act(y, activation).to(x.dtype)
        if slot >= 0 and conv_states is not None:
            conv_states[slot] = full[:, -(width - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(
    x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, **kwargs
):
    """Decode: ``x`` [B, dim] one token per row; shifts each row's conv state by one."""
    dim, width = weight.shape[0], weight.shape[-1]
    w = weight.reshape(dim, width).float()
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        slot = int(conv_state_indices[r]) if conv_state_indices is not None else r
        if slot < 0:
            continue
        full = torch.cat([conv_state[slot].float(), x[r].float()[:, None]], dim=1)  # [dim, K]
        y = (full * w).sum(-1)
        if bias is not None:
            y = y + bias.float()
        out[r] = _act(y, activation).to(x.dtype)
        conv_state[slot] = full[:, 1:].to(conv_state.dtype)
    return out


def _gating(A_log, a, b, dt_bias, beta=1.0, threshold=20.0):
    x = a.float() + dt_bias.float()
    sp = torch.where(beta * x <= threshold, torch.log1p(torch.exp(beta * x)) / beta, x)
    return -torch.exp(A_log.float()) * sp, torch.sigmoid(b.float())


def fused_gdn_gating_cpu(A_log, a, b, dt_bias, beta=1.0, threshold=20.0):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b): each [1, T, HV] fp32."""
    g, bt = _gating(A_log, a, b, dt_bias, beta, threshold)
    return g.unsqueeze(0), bt.unsqueeze(0)


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _rule(q, k, v, g, beta, state, use_l2):
    """One sequence: q/k [L, H, K], v [L, HV, V], g/beta [L, HV], state [HV, V, K] (fp32,
    updated in place); returns o [L, HV, V]."""
    hv, kd = v.shape[1], q.shape[-1]
    rep = hv // q.shape[1]
    q, k = q.float(), k.float()
    if use_l2:
        q, k = _l2(q), _l2(k)
    q = q.repeat_interleave(rep, dim=1) * kd**-0.5
    k = k.repeat_interleave(rep, dim=1)
    v = v.float()
    out = v.new_empty(v.shape)
    for t in range(q.shape[0]):
        state.mul_(torch.exp(g[t].float())[:, None, None])
        mem = torch.einsum("hvk,hk->hv", state, k[t])
        delta = (v[t] - mem) * beta[t].float()[:, None]
        state.add_(delta[:, :, None] * k[t][:, None, :])
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])
    return out


def chunk_gated_delta_rule_cpu(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    cu_seqlens=None,
    initial_state_indices=None,
    use_qk_l2norm_in_kernel=True,
    **kwargs,
):
    """Prefill over concatenated sequences ([1, T, ...]); each sequence starts from (and
    writes back) its slot of ``initial_state``. Returns (o [1, T, HV, V], None, None)."""
    out = torch.empty(v.shape, dtype=q.dtype)
    starts = cu_seqlens.tolist()
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        slot = int(initial_state_indices[i])
        if slot < 0:
            continue
        st = initial_state[slot].float().clone()
        o = _rule(
            q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e], st, use_qk_l2norm_in_kernel
        )
        out[0, s:e] = o.to(out.dtype)
        initial_state[slot] = st.to(initial_state.dtype)
    return out, None, None


def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log,
    dt_bias,
    q,
    k,
    v,
    a,
    b,
    initial_state_source,
    initial_state_indices,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=True,
    softplus_beta=1.0,
    softplus_threshold=20.0,
    **kwargs,
):
    """Decode: one token per row (q/k [1, B, H, K], v [1, B, HV, V], a/b [B, HV]); gating
    and the delta rule in one go, states updated in place. Returns [1, B, HV, V]."""
    g, bt = _gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    out = torch.zeros(v.shape, dtype=q.dtype)
    for r in range(q.shape[1]):
        slot = int(initial_state_indices[r])
        if slot < 0:
            continue
        st = initial_state_source[slot].float().clone()
        o = _rule(
            q[0, r : r + 1],
            k[0, r : r + 1],
            v[0, r : r + 1],
            g[r : r + 1],
            bt[r : r + 1],
            st,
            use_qk_l2norm_in_kernel,
        )
        out[0, r] = o[0].to(out.dtype)
        initial_state_source[slot] = st.to(initial_state_source.dtype)
    return out
