"""K1 (layer front) speed at the real Qwen3-Next-80B-A3B shapes (not a test).

    PYTHONPATH=src python benchmarks/bench_k1.py [--widths 1,2,4,8,16] [--csv out.csv]

GDN front: H 2048, 16 key / 32 value heads of 128, conv 4, in_proj_qkvz 12288x2048 and
in_proj_ba 64x2048 (bf16, interleaved packing), fp32 recurrent state [slots, 32, 128, 128]
(2 MiB per slot, read and written per row), bf16 conv state in vLLM's layout. ``copies``
layers, each with its own weights and caches, are captured into one CUDA graph (one epoch
bump, then one launch per layer, layer ids 0..copies-1: the in-engine pattern), so the
50 MB L2 cannot hold the weights between launches; time per launch = replay time /
copies, median of ``reps`` replays.

Baseline, same run, same copies, same graph treatment: "torch chain" = the same math as
stock torch ops (fp32 add + Gemma RMSNorm rounded to bf16, bf16 ``F.linear`` for both
projections, conv update via index_select / index_copy_, fp32 l2norm / gates / delta rule
(einsum) / gated norm, states written back with index_copy_).

Stock, same run, same copies, same graph treatment (``--stock vllm``, the default where vLLM
imports): vLLM 0.26's own modules and ops for the same work (benchmarks/_vllm_front.py names
every file and function): arm ``vllm`` as ``enforce_eager`` dispatches them, arm
``vllm-compiled`` under vLLM's default compilation (Inductor around the opaque GDN core op).
Before timing, each vLLM arm's output at every width is checked against K1's on the same
inputs and states (cosine >= 0.999 of the gated-norm output / q, and of the new recurrent
state); an arm that fails is reported and not timed. ``--results-csv`` writes one row per
(kind, width, arm) with ``stock_over_arm`` = the fastest vLLM arm's time over the arm's, the
stock to beat being vLLM's, never the torch chain.

``--stream``: the attention front on the stream engine's deal (``k1_stream``, Gluon) as arm
``k1-stream``, in the same graph treatment on the same weights and rows, its q checked against
K1's first (cosine >= 0.999); ``--stream-configs`` (a JSON list of ``StreamConfig`` overrides)
times each build as arm ``k1-stream <overrides>``; with ``--trace``, at ``--trace-widths``, a
traced twin of every build (the timed build has no stamps) puts its per-CTA points into
``--trace-json`` (``stream_traces``).

``--trace``: after the tables, each front's graph replayed once more with a trace build of the
table config (``K1Config.trace``: %globaltimer per CTA at ``k1.TRACE_POINTS``: start, rows
normed, S1 done, first S2 task's words, end), at ``--trace-widths``; the last launch's points
as min / median / max over CTAs, into ``--trace-json``.

Bandwidth: bytes a launch must move (weights once, every step row's state read + written,
conv state read + written, activations) over its time, against a device-to-device copy
measured in the same run (bytes read + written) and a read-only reduction.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from mono_ext.models.qwen3_next.configs import get_preset
from mono_ext.models.qwen3_next.dims import Dims, text_config
from mono_ext.models.qwen3_next.reference.gdn import split_ba, split_qkvz
from mono_ext.models.qwen3_next.triton.k1 import (
    S1,
    STAGES_ALL,
    TRACE_POINTS,
    K1AttnLaunch,
    K1AttnShape,
    K1Config,
    K1GdnLaunch,
    K1GdnShape,
)
from mono_ext.runtime.health import H_FAILED
from mono_ext.runtime.peers import RankState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cuda_timing import event_times_us  # noqa: E402
from _provenance import provenance  # noqa: E402
from _trace import cta_times, format_points, trace_points  # noqa: E402

DEV = torch.device("cuda")
PRESET = "qwen3-next-80b-a3b"


def hbm_bandwidth() -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s) on 1 GiB buffers, medians of 20."""
    x = torch.randn(1 << 29, device=DEV, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    copy_ms = statistics.median(event_times_us(lambda: y.copy_(x), 20)) / 1e3
    for _ in range(3):
        x.sum(dtype=torch.float32)
    read_ms = statistics.median(event_times_us(lambda: x.sum(dtype=torch.float32), 20)) / 1e3
    nbytes = x.numel() * 2
    return 2 * nbytes / copy_ms / 1e6, nbytes / read_ms / 1e6


# ------------------------------------------------------------------------ setup factory


def make_gdn_layers(md: Dims, width: int, copies: int, gen):
    """``copies`` layers of random bf16 weights and caches; slots 1..width (0: null)."""
    h, slots_n = md.hidden, width + 1

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    layers = []
    for _ in range(copies):
        w = {
            "input_layernorm": rnd(h, scale=0.2),
            "in_proj_qkvz": rnd(md.qkvz_rows, h, scale=h**-0.5),
            "in_proj_ba": rnd(2 * md.hv, h, scale=h**-0.5),
            "conv1d": rnd(md.conv_dim, 1, md.conv_k, scale=0.5),
            "A_log": torch.log(torch.empty(md.hv, device=DEV).uniform_(0.1, 4)),
            "dt_bias": rnd(md.hv, scale=0.5),
            "norm": (1 + rnd(md.dv, scale=0.1, dtype=torch.float32)).to(torch.bfloat16),
        }
        w["conv1d_t"] = w["conv1d"].reshape(md.conv_dim, -1).t().float().contiguous()  # chain
        conv = rnd(slots_n, md.conv_k - 1, md.conv_dim)
        ssm = rnd(slots_n, md.hv, md.dv, md.dk, scale=0.1, dtype=torch.float32)
        layers.append((w, conv, ssm))
    slots = torch.arange(1, width + 1, dtype=torch.int32, device=DEV)
    hid = rnd(width, h)
    res = rnd(width, h)
    return layers, slots, hid, res


def gdn_bytes(md: Dims, width: int, state_bytes: int = 4) -> int:
    w = (md.qkvz_rows + 2 * md.hv) * md.hidden * 2
    w += md.hidden * 2 + md.conv_dim * md.conv_k * 2 + md.hv * 6 + md.dv * 2
    state = 2 * width * md.hv * md.dv * md.dk * state_bytes
    conv = 2 * width * (md.conv_k - 1) * md.conv_dim * 2
    act = width * (3 * md.hidden * 2 + md.value_dim * 2)
    return w + state + conv + act


def torch_chain_gdn(md: Dims, hid, res, w, conv, ssm, slots, o_in, r_out):
    """The GDN front's math as plain torch ops (interleaved packing, time_chan conv state)."""
    eps = md.eps
    s = hid.float() + res.float()
    r_out.copy_(s)
    x = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (1 + w["input_layernorm"].float())
    x = x.to(torch.bfloat16)
    q, k, v, z = split_qkvz(F.linear(x, w["in_proj_qkvz"]), md, "interleaved")
    b, a = split_ba(F.linear(x, w["in_proj_ba"]), md, "interleaved")
    n = x.shape[0]
    mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1).float()
    idx = slots.long()
    window = torch.cat([conv.index_select(0, idx).float(), mixed[:, None, :]], dim=1)
    conv_out = F.silu((window * w["conv1d_t"][None]).sum(1))
    conv.index_copy_(0, idx, window[:, 1:].to(conv.dtype))
    qc, kc, vc = torch.split(conv_out, [md.key_dim, md.key_dim, md.value_dim], dim=-1)
    qc = qc.reshape(n, md.hk, -1)
    kc = kc.reshape(n, md.hk, -1)
    qc = qc * torch.rsqrt(qc.pow(2).sum(-1, keepdim=True) + 1e-6) * md.dk**-0.5
    kc = kc * torch.rsqrt(kc.pow(2).sum(-1, keepdim=True) + 1e-6)
    qc = qc.repeat_interleave(md.ratio, dim=1)
    kc = kc.repeat_interleave(md.ratio, dim=1)
    vc = vc.reshape(n, md.hv, -1)
    g = -torch.exp(w["A_log"]) * F.softplus(a.float() + w["dt_bias"].float())
    beta = torch.sigmoid(b.float())
    st = ssm.index_select(0, idx) * torch.exp(g)[..., None, None]
    delta = (vc - torch.einsum("nhvk,nhk->nhv", st, kc)) * beta[..., None]
    st = st + delta[..., :, None] * kc[..., None, :]
    o = torch.einsum("nhvk,nhk->nhv", st, qc)
    ssm.index_copy_(0, idx, st)
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w["norm"].float()
    o_in.copy_((y * F.silu(z.float())).reshape(n, -1))


def gdn_step(k1, ws, st, layers, slots, hid, res, o_in, r_out):
    """One step of ``layers`` GDN fronts (one epoch, layer ids 0..n-1), as a graph holds it."""

    def body():
        st.bump_epoch()
        for i, (w, conv, ssm) in enumerate(layers):
            k1.launch(hid, res, w, conv, ssm, slots, o_in, r_out, ws=ws, ctrl=st.ctrl,
                      health=st.health, null_slot=0, layer=i, layers_per_step=len(layers),
                      validate=i == 0)  # fmt: skip

    return body


def attn_step(k1, ws, st, ws_list, hid, res, pos, outs, r_out):
    """One step of ``ws_list`` attention fronts, as :func:`gdn_step`."""

    def body():
        st.bump_epoch()
        for i, w in enumerate(ws_list):
            k1.launch(hid, res, w, pos, *outs, r_out, ws=ws, ctrl=st.ctrl, health=st.health,
                      layer=i, layers_per_step=len(ws_list), validate=i == 0)  # fmt: skip

    return body


def _graph(body):
    body()  # warm: module loads, cuBLAS handles
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


# --sweep: K1Config overrides (each applied to both kernels), timed at width 1; the first is
# the code default. Scored as 3 x GDN + attention (80B-A3B: 36 GDN and 12 attention layers).
SWEEP = (
    {},
    {"pipeline_stages": 4},
    # 32-row tiles: twice the S1 tiles, so at width 1 no CTA streams two 64-row tiles while
    # most stream one (mma.sync instead of wgmma; memory-bound either way; 50-75 KB smem)
    {"tile_rows": 32},
    {"tile_rows": 32, "pipeline_stages": 5},
    {"num_warps": 16},
    {"state_row_slices": 1},
    # programmatic dependent launch: each of the graph's launches starts launching the next
    # (the boundary gap between consecutive layers' launches)
    {"pdl": True},
    # half-width K chunks: the same bytes in flight with two more stages, a scale column per
    # chunk either way for block-128 planes
    {"k_chunk": 128, "pipeline_stages": 5},
    # the first weight chunks move into L2 while the rows are normed
    {"prefetch_first_chunks": True},
    # the recurrence as 2 or 4 tasks per (row, head), the gated norm a stage after it: at
    # width 1, 64 or 128 of the 132 CTAs share the state instead of 32
    {"dv_split": 2, "state_row_slices": 1},
    {"dv_split": 4, "state_row_slices": 1},
    # each row normed once, by one CTA, and handed to every CTA behind a flag: at every width,
    # from 5 rows up, and with the first weight chunks moving into L2 while the flags come
    {"norm_once_above": 0},
    {"norm_once_above": 4},
    {"norm_once_above": 0, "prefetch_first_chunks": True},
)


def _conf(grid: int, over: dict) -> K1Config:
    return K1Config(grid=grid, **over)


def sweep(widths, copies, reps, cfg, bw_copy, rows_out) -> dict:
    """Time each SWEEP config (GDN and attention K1) at ``widths``; returns the overrides with
    the lowest 3 x GDN + attention time at the first width."""
    md = Dims.from_config(cfg)
    gshape = K1GdnShape.from_dims(md)
    ashape = K1AttnShape.from_dims(md)
    grid = torch.cuda.get_device_properties(DEV).multi_processor_count
    gen = torch.Generator(device=DEV).manual_seed(2)
    st = RankState.create(0, DEV, float(os.environ.get("MONO_EXT_DEADLINE_S", "2")))
    best = None
    for over in SWEEP:
        conf = _conf(grid, over)
        t0 = time.time()
        try:
            k1 = K1GdnLaunch(gshape, conf)
            k1.build(DEV)
            ka = K1AttnLaunch(ashape, conf, max_positions=8192)
            ka.build(DEV)
        except Exception as e:  # a config that does not build (resources): skip it
            print(f"config {over} failed to build: {e!r}", flush=True)
            continue
        built_s = time.time() - t0
        ws = ka.workspace(DEV)
        for width in widths:
            row = _gdn_width(md, width, copies, reps, {STAGES_ALL: k1}, st, gen, bw_copy, False)
            arow = _attn_width(md, ka, ws, st, gen, width, copies, reps, bw_copy)
            row.update(
                kind="gdn_sweep",
                config=json.dumps(over, sort_keys=True),
                regs=k1.resources.regs_per_thread,
                attn_us=arow["k1_us"],
                attn_pct_copy_bw=arow["pct_copy_bw"],
                attn_regs=ka.resources.regs_per_thread,
                build_s=round(built_s, 1),
            )
            rows_out.append(row)
            print(row, flush=True)
            score = 3 * row["k1_us"] + arow["k1_us"]
            if width == widths[0] and (best is None or score < best[0]):
                best = (score, over)
        del k1, ka, ws
        torch.cuda.empty_cache()
    return best[1]


def bench_gdn(widths, copies, reps, cfg, stages_variants, bw_copy, rows_out, conf=None,
              vllm_too=False):  # fmt: skip
    md = Dims.from_config(cfg)
    shape = K1GdnShape.from_dims(md)
    grid = torch.cuda.get_device_properties(DEV).multi_processor_count
    conf = conf or K1Config(grid=grid)
    launches = {}
    for stages in stages_variants:
        k1 = K1GdnLaunch(shape, conf, stages=stages)
        t0 = time.time()
        k1.build(DEV)
        print(f"built {k1.label()} stages={stages} in {time.time() - t0:.1f}s "
              f"({k1.resources})", flush=True)  # fmt: skip
        launches[stages] = k1
    gen = torch.Generator(device=DEV).manual_seed(0)
    st = RankState.create(0, DEV, float(os.environ.get("MONO_EXT_DEADLINE_S", "2")))
    for width in widths:
        rows_out.append(
            _gdn_width(md, width, copies, reps, launches, st, gen, bw_copy, True, vllm_too)
        )
        print(rows_out[-1], flush=True)
        torch.cuda.empty_cache()


def _gdn_width(md, width, copies, reps, launches, st, gen, bw_copy, chain_too, vllm_too=False):
    layers, slots, hid, res = make_gdn_layers(md, width, copies, gen)
    o_in = torch.empty(width, md.value_dim, dtype=torch.bfloat16, device=DEV)
    r_out = torch.empty_like(hid)
    nbytes = gdn_bytes(md, width)
    results = {}
    if vllm_too:  # K1 on a copy of layer 0's states: the output vLLM's arms must reproduce
        w0, conv0, ssm0 = layers[0]
        start = (conv0.clone(), ssm0.clone())
        conv_k, ssm_k = conv0.clone(), ssm0.clone()
        k1 = launches[STAGES_ALL]
        st.bump_epoch()
        k1.launch(hid, res, w0, conv_k, ssm_k, slots, o_in, r_out, ws=k1.workspace(DEV),
                  ctrl=st.ctrl, health=st.health, null_slot=0, layer=0, layers_per_step=copies)  # fmt: skip
        torch.cuda.synchronize()
        k1_ref = (o_in.clone(), ssm_k[slots.long()].clone())
    for stages, k1 in launches.items():
        body = gdn_step(k1, k1.workspace(DEV), st, layers, slots, hid, res, o_in, r_out)
        g = _graph(body)
        results[f"k1_stages{stages}"] = statistics.median(event_times_us(g.replay, reps)) / copies
    assert int(st.health[H_FAILED].item()) == 0, "a K1 wait gave up during the benchmark"
    k1_us = results[f"k1_stages{STAGES_ALL}"]
    row = {
        "kind": "gdn",
        "width": width,
        "bytes": nbytes,
        "k1_us": round(k1_us, 2),
        "k1_GBps": round(nbytes / k1_us / 1e3, 1),
        "pct_copy_bw": round(100 * nbytes / k1_us / 1e3 / bw_copy, 1),
    }
    if chain_too:
        r_out_f = torch.empty(width, md.hidden, dtype=torch.float32, device=DEV)

        def chain():
            for w, conv, ssm in layers:
                torch_chain_gdn(md, hid, res, w, conv, ssm, slots, o_in, r_out_f)

        g = _graph(chain)
        chain_us = statistics.median(event_times_us(g.replay, reps)) / copies
        row["torch_chain_us"] = round(chain_us, 2)
        row["speedup"] = round(chain_us / k1_us, 2)
    if f"k1_stages{S1}" in results:
        row["k1_s1_only_us"] = round(results[f"k1_stages{S1}"], 2)
    if vllm_too:
        layers[0] = (layers[0][0], *start)  # the check starts where K1's reference did
        row["vllm_rows"] = vllm_gdn_rows(md, width, layers, slots, hid.clone(), res.clone(),
                                         k1_ref, copies, reps, nbytes, bw_copy)  # fmt: skip
    return row


def bench_attn(widths, copies, reps, cfg, bw_copy, rows_out, conf=None, vllm_too=False,
               stream=(), stream_trace=()):  # fmt: skip
    """K1's attention front per width, with vLLM's and each ``stream`` build's beside it;
    ``stream_trace``: the widths at which a traced twin of each stream build (timed apart, so
    its stamps' barriers are in no timing) stamps one more step."""
    md = Dims.from_config(cfg)
    shape = K1AttnShape.from_dims(md)
    grid = torch.cuda.get_device_properties(DEV).multi_processor_count
    k1 = K1AttnLaunch(shape, conf or K1Config(grid=grid), max_positions=8192)
    k1.build(DEV)
    print(f"built {k1.label()} ({k1.resources})", flush=True)
    streams = []
    for over in stream or []:
        from mono_ext.models.qwen3_next.triton.k1_stream import K1AttnStreamLaunch, StreamConfig

        cfg_s = StreamConfig(**over)
        twins = []
        for traced in (False, True)[: 1 + bool(stream_trace)]:
            k1s = K1AttnStreamLaunch(shape, grid, cfg_s, max_positions=8192, trace=traced)
            k1s.build(DEV)
            twins.append(k1s)
        arm = "k1-stream" + (f" {json.dumps(over, sort_keys=True)}" if over else "")
        streams.append((arm, twins[0], twins[-1] if stream_trace else None))
        print(f"built {twins[0].label()}" + (" and its trace build" if stream_trace else ""),
              flush=True)  # fmt: skip
    ws = k1.workspace(DEV)
    gen = torch.Generator(device=DEV).manual_seed(1)
    st = RankState.create(0, DEV, float(os.environ.get("MONO_EXT_DEADLINE_S", "2")))
    for width in widths:
        traced = [(a, k, t if width in stream_trace else None) for a, k, t in streams]
        rows_out.append(_attn_width(md, k1, ws, st, gen, width, copies, reps, bw_copy, vllm_too,
                                    traced))  # fmt: skip
        print(rows_out[-1], flush=True)


def make_attn_layers(md: Dims, width: int, copies: int, gen):
    """``copies`` attention layers of random bf16 weights, the step's rows and positions, and
    its outputs (q, k, v, gate, residual_out)."""
    h, d = md.hidden, md.head_dim
    rows = (2 * md.hq + 2 * md.hkv) * d
    qd, kvd = md.hq * d, md.hkv * d

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEV, generator=gen) * scale).bfloat16()

    ws_list = [
        {
            "input_layernorm": rnd(h, scale=0.2),
            "qkv_proj": rnd(rows, h, scale=h**-0.5),
            "q_norm": rnd(d, scale=0.2),
            "k_norm": rnd(d, scale=0.2),
        }
        for _ in range(copies)
    ]
    hid, res = rnd(width, h), rnd(width, h)
    pos = torch.randint(0, 8192, (width,), device=DEV, generator=gen)
    outs = [torch.empty(width, n, dtype=torch.bfloat16, device=DEV) for n in (qd, kvd, kvd, qd)]
    return ws_list, hid, res, pos, outs, torch.empty_like(hid)


def _attn_width(md, k1, ws, st, gen, width, copies, reps, bw_copy, vllm_too=False,
                streams=()) -> dict:  # fmt: skip
    h, d = md.hidden, md.head_dim
    rows = (2 * md.hq + 2 * md.hkv) * d
    qd, kvd = md.hq * d, md.hkv * d
    ws_list, hid, res, pos, outs, r_out = make_attn_layers(md, width, copies, gen)
    g = _graph(attn_step(k1, ws, st, ws_list, hid, res, pos, outs, r_out))
    us = statistics.median(event_times_us(g.replay, reps)) / copies
    assert int(st.health[H_FAILED].item()) == 0, "a K1 wait gave up during the benchmark"
    nbytes = rows * h * 2 + width * (3 * h * 2 + 2 * (qd + kvd) * 2)
    row = {
        "kind": "attn",
        "width": width,
        "bytes": nbytes,
        "k1_us": round(us, 2),
        "k1_GBps": round(nbytes / us / 1e3, 1),
        "pct_copy_bw": round(100 * nbytes / us / 1e3 / bw_copy, 1),
    }
    if vllm_too or streams:  # layer 0's q from K1: the other arms must match it
        st.bump_epoch()
        k1.launch(hid, res, ws_list[0], pos, *outs, r_out, ws=ws, ctrl=st.ctrl, health=st.health,
                  layer=0, layers_per_step=copies)  # fmt: skip
        torch.cuda.synchronize()
    row["stream_rows"] = [
        r for arm, k1s, traced in streams
        for r in stream_attn_rows(arm, width, k1s, ws_list, hid, res, pos, outs[0].clone(),
                                  copies, reps, nbytes, bw_copy, traced)
    ]  # fmt: skip
    if vllm_too:
        row["vllm_rows"] = vllm_attn_rows(md, width, ws_list, hid.clone(), res.clone(), pos,
                                          outs[0].clone(), copies, reps, nbytes, bw_copy)  # fmt: skip
    return row


def trace_front(kind: str, md: Dims, conf: K1Config, width: int, copies: int, st, gen) -> dict:
    """The graph of ``copies`` layers as timed, replayed with a trace build of ``conf``
    (``K1Config.trace``): per point of ``TRACE_POINTS``, min / median / max over the CTAs
    that reached it of us since the first CTA of the graph's last launch started, and every
    CTA's stamps (``ctas_us``: which CTAs are late, not only by how much)."""
    tconf = dataclasses.replace(conf, trace=True)
    if kind == "gdn":
        k1 = K1GdnLaunch(K1GdnShape.from_dims(md), tconf)
        k1.build(DEV)
        ws = k1.workspace(DEV)
        layers, slots, hid, res = make_gdn_layers(md, width, copies, gen)
        o_in = torch.empty(width, md.value_dim, dtype=torch.bfloat16, device=DEV)
        body = gdn_step(k1, ws, st, layers, slots, hid, res, o_in, torch.empty_like(hid))
    else:
        k1 = K1AttnLaunch(K1AttnShape.from_dims(md), tconf, max_positions=8192)
        k1.build(DEV)
        ws = k1.workspace(DEV)
        body = attn_step(k1, ws, st, *make_attn_layers(md, width, copies, gen))
    g = _graph(body)
    g.replay()
    torch.cuda.synchronize()
    ws.trace.zero_()  # no stamp left from an earlier replay
    g.replay()
    torch.cuda.synchronize()
    assert int(st.health[H_FAILED].item()) == 0, "a K1 wait gave up during the trace"
    stamps = ws.trace.cpu().tolist()
    points = trace_points(stamps, TRACE_POINTS)
    print(f"  trace {kind} width {width} ({k1.label()}; us since the first CTA started: "
          f"min / median / max)", flush=True)  # fmt: skip
    print("\n".join(format_points(points)), flush=True)
    return {"kind": kind, "width": width, "label": k1.label(), "points": points,
            "ctas_us": cta_times(stamps, len(TRACE_POINTS))}  # fmt: skip


# ------------------------------------------------------------------ vLLM's own front

VLLM_MODES = ("eager", "compiled")
STOCK_COSINE = 0.999


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def _vllm_front(gdn_planes, attn_planes, mode):
    from _vllm_front import ARMS, VllmFront

    return ARMS[mode], VllmFront(gdn_planes, attn_planes, mode=mode, device=DEV)


def vllm_gdn_rows(md, width, layers, slots, hid, res, k1_ref, copies, reps, nbytes, bw_copy):
    """vLLM's GDN front per mode on the same weights and states as K1's rows: checked against
    ``k1_ref`` = (o_in, new recurrent state of layer 0's first slot), then timed."""
    out = []
    planes = [{k: v for k, v in w.items() if k != "conv1d_t"} for w, _, _ in layers]
    start = (layers[0][1].clone(), layers[0][2].clone())  # each mode's timing moves the states
    for mode in VLLM_MODES:
        try:
            arm, front = _vllm_front(planes, [], mode)
            if not front.conv_is_time_major():
                raise RuntimeError("vLLM keeps the conv state channel-major here; K1's rows "
                                   "use time-major (VLLM_SSM_CONV_STATE_LAYOUT unset)")  # fmt: skip
            states = [(conv, ssm) for _, conv, ssm in layers]
            check = [(start[0].clone(), start[1].clone())] + states[1:]
            with front.gdn_step(check, slots):
                o, _ = front.gdn_front(0, hid, res)
            torch.cuda.synchronize()
            c_o = cosine(o, k1_ref[0])
            c_s = cosine(check[0][1][slots.long()], k1_ref[1])
            print(f"  {arm} w{width} vs k1: output cosine {c_o:.6f}, state cosine {c_s:.6f}",
                  flush=True)  # fmt: skip
            if not (c_o >= STOCK_COSINE and c_s >= STOCK_COSINE):
                print(f"  {arm}: below {STOCK_COSINE} against K1; not timed", flush=True)
                continue

            def body(front=front, states=states):
                with front.gdn_step(states, slots):
                    for i in range(copies):
                        front.gdn_front(i, hid, res)

            out.append(_timed_row("gdn", width, arm, body, copies, reps, nbytes, bw_copy))
        except Exception as e:  # report and go on: K1's numbers and the other arm still stand
            print(f"  vllm {mode} w{width}: not timed ({type(e).__name__}: {e})", flush=True)
        front = None
        torch.cuda.empty_cache()
    return out


def _timed_row(kind, width, arm, body, copies, reps, nbytes, bw_copy) -> dict:
    """``body`` (``copies`` layers) captured in one graph, timed per layer, as a results row."""
    us = statistics.median(event_times_us(_graph(body).replay, reps)) / copies
    print(f"  {arm:<14} {kind} w{width:<2} {us:8.2f} us", flush=True)
    return {"kind": kind, "width": width, "arm": arm, "median_us": round(us, 2),
            "bytes": nbytes, "pct_hbm": round(100 * nbytes / us / 1e3 / bw_copy, 1)}  # fmt: skip


def stream_attn_rows(arm, width, k1s, ws_list, hid, res, pos, k1_ref, copies, reps, nbytes,
                     bw_copy, traced=None):  # fmt: skip
    """The stream-engine attention front on the same weights and rows: q checked against
    ``k1_ref`` (K1's q), then timed as K1 is; ``traced`` (the same build with stamps) runs
    the timed body once more eagerly, and its last layer's stamps go with the row."""
    kvd = k1s.shape.hkv * k1s.shape.head_dim
    outs = [torch.empty_like(k1_ref), torch.empty(width, kvd, dtype=torch.bfloat16, device=DEV),
            torch.empty(width, kvd, dtype=torch.bfloat16, device=DEV), torch.empty_like(k1_ref),
            torch.empty_like(hid)]  # fmt: skip
    k1s.launch(hid, res, ws_list[0], pos, *outs)
    torch.cuda.synchronize()
    c_q = cosine(outs[0], k1_ref)
    print(f"  {arm} attn w{width} vs k1: q cosine {c_q:.6f}", flush=True)
    if not c_q >= STOCK_COSINE:
        print(f"  {arm}: below {STOCK_COSINE} against K1; not timed", flush=True)
        return []

    def body(launch=k1s, layers=range(copies)):
        for i in layers:
            launch.launch(hid, res, ws_list[i], pos, *outs, validate=i == 0)

    row = _timed_row("attn", width, arm, body, copies, reps, nbytes, bw_copy)
    if traced is not None:  # the last layer's launch of one more eager step
        from mono_ext.models.qwen3_next.triton.k1_stream_kernel import TRACE_POINTS

        body(traced, range(copies - 1))
        # which CTA writes a head's outputs (the last of its parts to arrive) differs from
        # launch to launch: stamps of the earlier layers would stand for CTAs that wrote none
        traced.stamps.zero_()
        body(traced, range(copies - 1, copies))
        torch.cuda.synchronize()
        stamps = traced.stamps.tolist()
        print("\n".join(format_points(trace_points(stamps, TRACE_POINTS))), flush=True)
        row["trace"] = {"points": trace_points(stamps, TRACE_POINTS),
                        "ctas_us": cta_times(stamps, len(TRACE_POINTS))}  # fmt: skip
    return [row]


def vllm_attn_rows(md, width, ws_list, hid, res, pos, k1_ref, copies, reps, nbytes, bw_copy):
    """vLLM's attention front per mode on the same weights as K1's rows: q checked against
    ``k1_ref`` (K1's q), then timed with K/V written into a FlashAttention cache."""
    out = []
    for mode in VLLM_MODES:
        try:
            arm, front = _vllm_front([], ws_list, mode)
            caches = front.attn_cache(width + 1)
            slot_mapping = torch.arange(width, device=DEV, dtype=torch.int64) * 16 + 16 + 3
            with front.attn_step():
                q, _, _ = front.attn_front(0, hid, res, pos, caches[0], slot_mapping)
            torch.cuda.synchronize()
            c_q = cosine(q, k1_ref)
            print(f"  {arm} w{width} vs k1: q cosine {c_q:.6f}", flush=True)
            if not c_q >= STOCK_COSINE:
                print(f"  {arm}: below {STOCK_COSINE} against K1; not timed", flush=True)
                continue

            def body(front=front, caches=caches, slot_mapping=slot_mapping):
                with front.attn_step():
                    for i in range(copies):
                        front.attn_front(i, hid, res, pos, caches[i], slot_mapping)

            out.append(_timed_row("attn", width, arm, body, copies, reps, nbytes, bw_copy))
        except Exception as e:
            print(f"  vllm {mode} attn w{width}: not timed ({type(e).__name__}: {e})", flush=True)
        front = None
        torch.cuda.empty_cache()
    return out


def results_rows(rows: list[dict], meta: dict) -> list[dict]:
    """One row per (kind, width, arm): K1's and the vLLM arms', with the stock (fastest vLLM
    arm) time over each arm's."""
    arms = []
    for r in rows:
        if r["kind"] in ("gdn", "attn"):
            arms.append({"kind": r["kind"], "width": r["width"], "arm": "k1",
                         "median_us": r["k1_us"], "bytes": r["bytes"],
                         "pct_hbm": r["pct_copy_bw"]})  # fmt: skip
            arms.extend(r.get("stream_rows", []))
            arms.extend(r.get("vllm_rows", []))
    for a in arms:
        stock = [b["median_us"] for b in arms
                 if (b["kind"], b["width"]) == (a["kind"], a["width"])
                 and b["arm"].startswith("vllm")]  # fmt: skip
        a["stock_over_arm"] = round(min(stock) / a["median_us"], 3) if stock else ""
        a.update(meta)
    return arms


def ncu_target(cfg, over: dict) -> int:
    """A few eager GDN, then attention K1 launches at width 1 on rotating copies (profile the
    last of each kind)."""
    md = Dims.from_config(cfg)
    grid = torch.cuda.get_device_properties(DEV).multi_processor_count
    k1 = K1GdnLaunch(K1GdnShape.from_dims(md), _conf(grid, over))
    k1.build(DEV)
    layers, slots, hid, res = make_gdn_layers(md, 1, 3, torch.Generator(device=DEV).manual_seed(5))
    st = RankState.create(0, DEV, 2.0)
    ws = k1.workspace(DEV)
    o_in = torch.empty(1, md.value_dim, dtype=torch.bfloat16, device=DEV)
    r_out = torch.empty_like(hid)
    for w, conv, ssm in layers:
        st.bump_epoch()
        k1.launch(hid, res, w, conv, ssm, slots, o_in, r_out, ws=ws, ctrl=st.ctrl,
                  health=st.health, null_slot=0, layer=0, layers_per_step=1)  # fmt: skip
    ka = K1AttnLaunch(K1AttnShape.from_dims(md), _conf(grid, over), max_positions=8192)
    ka.build(DEV)
    gen = torch.Generator(device=DEV).manual_seed(6)
    _attn_width(md, ka, ka.workspace(DEV), st, gen, 1, 3, 1, 1.0)
    torch.cuda.synchronize()
    return int(st.health[H_FAILED].item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--copies", type=int, default=8, help="layers (weight/cache copies)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--s1-only", action="store_true", help="also time S1 alone (diagnosis)")
    ap.add_argument("--no-attn", action="store_true")
    ap.add_argument("--no-gdn", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="try SWEEP configs, table with best")
    ap.add_argument("--sweep-widths", default="1")
    ap.add_argument("--config", default=None, help="K1Config overrides (JSON) for the table")
    ap.add_argument("--best-json", default=None, help="write the sweep's best overrides here")
    ap.add_argument("--csv", default=None)
    ap.add_argument(
        "--stock", choices=("vllm", "torch"), default=None,
        help="stock arms: vLLM 0.26's own front (and the torch chain), or the torch chain only "
             "(default: vllm where vLLM imports)",
    )  # fmt: skip
    ap.add_argument("--results-csv", default=None,
                    help="one row per (kind, width, arm), e.g. docs/results/k1_vllm.csv")  # fmt: skip
    ap.add_argument(
        "--ncu", action="store_true", help="3 GDN then 3 attention K1 at width 1 (for ncu), exit"
    )
    ap.add_argument(
        "--stream",
        action="store_true",
        help="also the attention front on the stream engine (arm k1-stream)",
    )
    ap.add_argument(
        "--stream-configs",
        default=None,
        help="with --stream: a JSON list of StreamConfig overrides, one arm each",
    )
    ap.add_argument("--trace", action="store_true",
                    help="after the tables, each front's graph once more with a trace build of "
                         "the table config: per-CTA times of its points (K1Config.trace)")  # fmt: skip
    ap.add_argument("--trace-widths", default="1,16", help="with --trace: these widths")
    ap.add_argument("--trace-json", default=None, help="with --trace: write the traces here")
    args = ap.parse_args(argv)
    if args.ncu:
        return ncu_target(text_config(get_preset(PRESET)),
                          json.loads(args.config) if args.config else {})  # fmt: skip
    widths = [int(w) for w in args.widths.split(",")]
    cfg = text_config(get_preset(PRESET))
    props = torch.cuda.get_device_properties(DEV)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    bw_copy, bw_read = hbm_bandwidth()
    print(f"HBM: copy {bw_copy:.0f} GB/s (read + write), read-only {bw_read:.0f} GB/s", flush=True)
    rows: list[dict] = []
    variants = [STAGES_ALL, S1] if args.s1_only else [STAGES_ALL]
    over = json.loads(args.config) if args.config else {}
    if args.sweep:
        sw = [int(w) for w in args.sweep_widths.split(",")]
        over = sweep(sw, args.copies, args.reps, cfg, bw_copy, rows)
        print(f"BEST {json.dumps(over, sort_keys=True)} (3 x GDN + attn at width {sw[0]})",
              flush=True)  # fmt: skip
        if args.best_json:
            with open(args.best_json, "w") as f:
                json.dump(over, f, sort_keys=True)
    conf = _conf(props.multi_processor_count, over)
    print(f"table config: {conf}", flush=True)
    if args.stock is None:
        import importlib.util

        args.stock = "vllm" if importlib.util.find_spec("vllm") is not None else "torch"
    vllm_too = args.stock == "vllm"
    if not args.no_gdn:
        bench_gdn(widths, args.copies, args.reps, cfg, variants, bw_copy, rows, conf, vllm_too)
    if not args.no_attn:
        streams = json.loads(args.stream_configs or "[{}]") if args.stream else []
        trace_at = {int(w) for w in args.trace_widths.split(",")} if args.trace else set()
        bench_attn(widths, args.copies, args.reps, cfg, bw_copy, rows, conf, vllm_too, streams,
                   trace_at)  # fmt: skip
    sweep_rows = [r for r in rows if r["kind"] == "gdn_sweep"]
    if sweep_rows:
        print("\n| config (K1Config overrides) | width | GDN us | % BW | attn us | attn % BW | regs "
              "GDN/attn |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for r in sweep_rows:
            print(f"| {r['config']} | {r['width']} | {r['k1_us']} | {r['pct_copy_bw']} | "
                  f"{r['attn_us']} | {r['attn_pct_copy_bw']} | {r['regs']}/{r['attn_regs']} |")  # fmt: skip
    print(f"\nK1 at {PRESET} shapes; HBM copy {bw_copy:.0f} GB/s, read {bw_read:.0f} GB/s")
    print("| kind | width | MB moved | K1 us | S1 only us | torch chain us | K1 speedup | GB/s "
          "| % copy BW |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "gdn_sweep":
            continue
        sp = f"{r['speedup']}x" if "speedup" in r else "-"
        print(f"| {r['kind']} | {r['width']} | {r['bytes'] / 1e6:.1f} | {r['k1_us']} | "
              f"{r.get('k1_s1_only_us', '-')} | {r.get('torch_chain_us', '-')} | {sp} | "
              f"{r['k1_GBps']} | {r['pct_copy_bw']} |")  # fmt: skip
    arms = results_rows(rows, {**provenance(props.name), "copy_GBps": round(bw_copy)})
    stream_traces = [{"arm": a["arm"], "width": a["width"], **a.pop("trace")}
                     for a in arms if "trace" in a]  # fmt: skip
    if vllm_too or args.stream:
        print("\n| kind | width | arm | us | % copy BW | vLLM / arm |")
        print("|---|---|---|---|---|---|")
        for a in arms:
            print(f"| {a['kind']} | {a['width']} | {a['arm']} | {a['median_us']} | "
                  f"{a['pct_hbm']} | {a['stock_over_arm']} |")  # fmt: skip
    if args.results_csv:
        keys = ["kind", "width", "arm", "median_us", "pct_hbm", "stock_over_arm", "bytes",
                "copy_GBps", "device", "date", "commit", "command"]  # fmt: skip
        with open(args.results_csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=keys)
            wr.writeheader()
            wr.writerows(arms)
    for r in rows:
        r.pop("vllm_rows", None)
        r.pop("stream_rows", None)
    if args.trace:
        st = RankState.create(0, DEV, float(os.environ.get("MONO_EXT_DEADLINE_S", "2")))
        gen = torch.Generator(device=DEV).manual_seed(3)
        kinds = [k for k, off in (("gdn", args.no_gdn), ("attn", args.no_attn)) if not off]
        traces = [trace_front(kind, Dims.from_config(cfg), conf, int(w), args.copies, st, gen)
                  for kind in kinds for w in args.trace_widths.split(",")]  # fmt: skip
        if args.trace_json:
            with open(args.trace_json, "w") as f:
                json.dump({**provenance(props.name), "traces": traces,
                           "stream_traces": stream_traces}, f, indent=1)  # fmt: skip
    if args.csv:  # every row (the sweep's too), each with the run's provenance
        prov = provenance(props.name)
        rows = [{**r, **prov} for r in rows]
        keys = sorted({k for r in rows for k in r})
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=keys)
            wr.writeheader()
            wr.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
