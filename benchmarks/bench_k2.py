"""K2 (layer tail) per-launch time on one GPU vs the stock op chains of the same math.

    PYTHONPATH=src python benchmarks/bench_k2.py [--csv docs/k2_h200.csv] [--plot docs/k2.png]
    PYTHONPATH=src:/tmp/site python benchmarks/bench_k2.py --stock both   # with vLLM 0.26 importable
    PYTHONPATH=src python benchmarks/bench_k2.py --formats fp8_block128 --widths 1,2,4,8,16

Shapes: Qwen3-Next-80B-A3B tail at TP1 (H 2048, GDN out_proj input 4096, 512 experts top-10,
I 512, shared 512). Every arm runs ``ROT`` rotations per CUDA-graph replay: each rotation has
its own copy of the dense planes (out_proj, router, norm, shared expert, its gate: 24 MB, so
8 copies are 4x the 50 MB L2; fp8 14 MB, 2x) and its own inputs, which route to their own
experts (w13/w2 are one 3 GB copy, fp8 1.5 GB: consecutive rotations pick different experts).
Time per launch = replay time / ROT, median of several replays.

Formats (``--formats``): ``bf16`` (default), or ``fp8_block128`` / ``fp8_channel``: out_proj,
w13, w2 and the shared expert's gate_up / down become e4m3fn codes with fp32 scales (block-128
[.., N/128, K/128] or per-row [.., N, 1], quantized by mono_ext.models.qwen3_next.reference.convert from the same
bf16 planes); the router, shared_expert_gate and norm stay bf16, as in vLLM. K2 reads the codes
and scales in place (``K2Launch.formats``); the vLLM arms are vLLM's own fp8 modules on the same
codes and scales; the torch arms run on bf16 planes of the dequantized values and are
information only (bf16 weights move twice the bytes: not a quantized stock).

Arms:
- ``k2``: this package's one persistent launch (config variants, see ``VARIANTS``).
- ``vllm``: vLLM 0.26's own modules and ops for the same work, as an engine with
  ``enforce_eager`` dispatches them, captured in the CUDA graph like every other arm:
  RowParallelLinear out_proj (F.linear), GemmaRMSNorm(hidden, residual) (vllm.ir
  fused_add_rms_norm), then the model's own Qwen3NextSparseMoeBlock: gate F.linear, fused_topk
  (``_moe_C.topk_softmax``, renormalised), the unquantized Triton fused MoE (TritonExperts via
  FusedMoEKernel), the Qwen2MoeMLP shared expert (SiluAndMul ``_C.silu_and_mul``, sigmoid
  gate) on vLLM's aux stream, shared + routed. benchmarks/_vllm_chain.py builds it and names
  every file / function it runs. Needs ``import vllm`` and CUDA. With an fp8 format the model's
  config declares the FP8 checkpoint's quantization_config (block-128: ``quant_method: fp8``,
  ``weight_block_size: [128, 128]``, dynamic activations, as Qwen's FP8 release;
  per-channel: compressed-tensors W8A8 FP8 channel weights, dynamic per-token activations), so
  out_proj and the shared expert are Fp8LinearMethod / CompressedTensorsLinearMethod with the
  fp8 GEMM vLLM picks (block-128 on sm_90: FlashInfer / DeepGEMM / CUTLASS) and the experts
  Fp8MoEMethod / CompressedTensorsW8A8Fp8MoEMethod (block-128 on sm_90: Triton); the codes and
  scales (vLLM's ``weight_scale_inv`` / ``weight_scale``) are a copy of K2's, bound before
  vLLM's post-load step (DeepGEMM's UE8M0 requantization rewrites them in place).
- ``vllm-compiled``: the same modules under vLLM's default compilation config (custom ops
  off): out_proj + add + norm through torch.compile (Inductor), as vLLM's compiled graph fuses
  them; the MoE block (an opaque op in vLLM's graph) as vLLM runs it there.
- ``torch``: the same math as a torch op chain under a CUDA graph: cuBLAS linears
  (out_proj, router, shared gate_up/down, shared gate), fp32 Gemma RMSNorm, softmax +
  torch.topk + renormalise, routed experts as a gather of the picked experts' planes
  (``w13[ids]``, ``w2[ids]``) + ``torch.bmm``, weighted sum. A stand-in for vLLM where vLLM
  does not import.
- ``torch-loop``: the experts as a per-pick loop of ``F.linear`` on the picked planes (no
  gather copies; needs the ids on the host, so eager, one sync per rotation); widths <= 4.
  With an fp8 format both are named ``... bf16-dequant (info)`` and are never the stock.

``--stock`` picks the stock arms (default ``both`` where vLLM imports, else ``torch``). Before
timing, each stock arm's output is checked against K2's on rotation 0 at width 4 (hidden
cosine >= 0.999; >= 0.995 for fp8 vLLM arms, which quantize activations to fp8 where K2
multiplies bf16 activations: ~0.998 expected, see ``STOCK_COSINE``). The "vs stock" column is
(stock time) / (arm time), the stock time being the fastest vLLM arm at that width when one was
timed under a CUDA graph, else (bf16 only) the fastest of torch / torch-loop (the CSV names it
in ``stock_arm``). A vLLM arm whose graph capture fails is timed with eager launches under the
name "<arm> (eager launches)" and is not a stock reference.

Bytes per launch count each weight byte read once (dense planes + the distinct picked
experts' w13/w2 planes of that rotation: 2 bytes per bf16 weight, 1 per fp8 weight plus its
fp32 scales) plus activations; % HBM is (bytes / time) over the device-to-device copy
bandwidth measured in the same run. The routing that picks the experts is the torch chain's
(on the dequantized planes for fp8).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _vllm_chain as vc  # noqa: E402  (imports vLLM only when its arms run)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _cuda_timing import copy_bandwidth, event_times_us, graph_times_us  # noqa: E402
from _provenance import provenance  # noqa: E402
from _trace import cta_times, format_points, trace_points  # noqa: E402

from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.reference.convert import (  # noqa: E402
    dequantized_weights,
    quantized_weights,
)
from mono_ext.models.qwen3_next.triton.k2 import (  # noqa: E402
    STAGES_ALL,
    K2Config,
    K2Launch,
    K2Shape,
)
from mono_ext.runtime.health import decode_health  # noqa: E402
from mono_ext.runtime.peers import RankState  # noqa: E402

ROT = 8
WIDTHS = (1, 2, 4, 8, 12, 16)
BF = torch.bfloat16
DENSE = (
    "out_proj",
    "post_attention_layernorm",
    "router",
    "shared_gate_up",
    "shared_down",
    "shared_expert_gate",
)
#: hidden cosine a stock arm must reach against K2 (width 4). vLLM's fp8 linears and experts
#: quantize their activations (dynamic fp8 per 128-group / per token) where K2 multiplies bf16
#: activations: emulating that on this chain's shapes gives 0.9983-0.9992 (4 seeds, both fp8
#: formats); a wrong plane or scale layout gives far less.
STOCK_COSINE = {"bf16": 0.999, "fp8_block128": 0.995, "fp8_channel": 0.995}
# name -> K2Config overrides (grid is set from the device)
VARIANTS = {
    "k2": {},
    # 352 gate_up tiles at width 1: max 3 per CTA, not 2 x 2
    "k2 gate_up_rows=32": {"gate_up_rows": 32},
    # the router's partial logits in eight K splits: more, shorter router tasks, and each
    # row's top-k CTA sums eight partials
    "k2 router_k_splits=8": {"router_k_splits": 8},
    "k2 down_rows=32": {"down_rows": 32},
    # fp8 block-128 planes stream 128-byte K chunks per row (a chunk stays in one scale
    # column), a quarter of bf16's 512: twice the stages give half bf16's bytes in flight per
    # CTA (sm_90 offline: 120 KB shared, 234 registers, no spills)
    "k2 pipeline_stages=8": {
        "out_proj_pipeline_stages": 8,
        "gate_up_pipeline_stages": 8,
        "down_pipeline_stages": 8,
    },
    # programmatic dependent launch between the rotations' launches (boundary gaps)
    "k2 pdl": {"pdl": True},
    # fp8 block-128 expert planes on an e4m3 MMA with e4m3 activations (vLLM's numerics;
    # with --formats fp8_block128 only)
    "k2 a8": {"fp8_activations": True},
}


def variant_overrides(name: str) -> dict:
    """K2Config overrides of variant ``name``: a key of ``VARIANTS``, or ``k2`` followed by
    ``field=value`` words (integers, ``true`` / ``false``), e.g. ``k2 num_warps=8 tile_rows=128``.
    """
    if name in VARIANTS:
        return dict(VARIANTS[name])
    head, *words = name.split() or [""]
    fields = {f.name for f in dataclasses.fields(K2Config)} | {"ctas_per_sm"}
    pairs = [w.partition("=") for w in words]
    if head != "k2" or any(not sep or k not in fields or k == "grid" for k, sep, _ in pairs):
        raise SystemExit(
            f"bench_k2: unknown variant {name!r} (a VARIANTS key, or 'k2 field=value ...' "
            f"with K2Config fields)"
        )
    out: dict = {}
    for key, _, raw in pairs:
        low = raw.lower()
        out[key] = low == "true" if low in ("true", "false") else int(raw)
    return out


PREFIXES = {  # stage bits: S1 (+reduce and the norm's parts), +norm/router, ...
    "S1 out_proj+residual": 3,
    "+S2 norm+router": 7,
    "+S3 topk+gate_up": 31,
    "+S4 down (+reduce = all)": STAGES_ALL,
}


def plane_bytes(w: dict, name: str) -> int:
    """Bytes of plane ``name`` of ``w`` and of its scales, if quantized."""
    return sum(t.numel() * t.element_size() for t in (w[name], w.get(name + ".scale"))
               if t is not None)  # fmt: skip


class Setup:
    """ROT rotations of dense planes and inputs, one copy of the expert planes. ``rot``: what
    K2 and vLLM read (``fmt``: fp8 codes + ``<plane>.scale`` for ``vc.QUANTIZED``);
    ``bf16_rot``: the same rotations with bf16 planes (of the dequantized values, for fp8), for
    the torch arms and the routing that counts bytes. ``device`` "cpu": the same planes without
    a GPU (smoke checks of the setup)."""

    def __init__(self, seed: int = 0, fmt: str = "bf16", device: str = "cuda"):
        self.dims = d = Dims.from_config(get_preset("qwen3-next-80b-a3b"), tp=1)
        g = torch.Generator(device=device).manual_seed(seed)
        h, e, i, s, k_in = d.hidden, d.experts, d.moe_inter, d.shared_inter, d.hv * d.dv

        def r(*shape, scale):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(BF)

        self.w13 = r(e, 2 * i, h, scale=h**-0.5)
        self.w2 = r(e, h, i, scale=i**-0.5)
        self.rot = []
        for _ in range(ROT):
            w = {
                "out_proj": r(h, k_in, scale=k_in**-0.5),
                "post_attention_layernorm": r(h, scale=0.1),
                "router": r(e, h, scale=3 * h**-0.5),  # logits std ~3, as in the tests
                "shared_gate_up": r(2 * s, h, scale=h**-0.5),
                "shared_down": r(h, s, scale=s**-0.5),
                "shared_expert_gate": r(1, h, scale=h**-0.5),
                "w13": self.w13,
                "w2": self.w2,
            }
            w["o_in"] = r(16, k_in, scale=1.0)
            w["residual"] = r(16, h, scale=1.0)
            w["out_h"] = torch.empty(16, h, dtype=BF, device=device)
            w["out_r"] = torch.empty(16, h, dtype=BF, device=device)
            self.rot.append(w)
        self.fmt = fmt
        self.formats = {} if fmt == "bf16" else dict.fromkeys(vc.QUANTIZED, fmt)
        self.bf16_rot = self._quantize() if self.formats else self.rot
        w0 = self.rot[0]
        self.dense_bytes = sum(plane_bytes(w0, n) for n in DENSE)
        self.expert_bytes = (plane_bytes(w0, "w13") + plane_bytes(w0, "w2")) // e

    def _quantize(self) -> list[dict]:
        """Quantize ``rot``'s planes in place (the experts once: one shared copy, as in bf16);
        returns the bf16 rotations (dequantized values)."""

        def quantize_planes(w, formats):  # (codes + scales, the dequantized fp32 values)
            q = quantized_weights(w, formats)
            return q, dequantized_weights(q, formats)

        experts = {n: f for n, f in self.formats.items() if n in ("w13", "w2")}
        dense = {n: f for n, f in self.formats.items() if n not in experts}
        ek, eref = quantize_planes({"w13": self.w13, "w2": self.w2}, experts)
        eref = {n: eref[n].to(BF) for n in experts}  # (the fp32 values, 6 GB, are dropped)
        plain = []
        for w in self.rot:
            k, ref = quantize_planes({n: w[n] for n in dense}, dense)
            plain.append({**w, **{n: ref[n].to(BF) for n in dense}, **eref})
            w.update(k)
            w.update(ek)
        self.w13, self.w2 = ek["w13"], ek["w2"]
        return plain

    def vllm_planes(self) -> list[dict]:
        """``rot`` for the vLLM arms: bf16, the same tensors (bound without copies); fp8, a
        copy of the codes and scales (one of the experts), which vLLM's post-load step may
        requantize in place."""
        if not self.formats:
            return self.rot
        names = [n + sfx for n in self.formats for sfx in ("", ".scale")]
        experts = {n: self.rot[0][n].clone() for n in names if n.startswith(("w13", "w2"))}
        dense = [n for n in names if n not in experts]
        return [{**w, **{n: w[n].clone() for n in dense}, **experts} for w in self.rot]

    def bytes_moved(self, b: int) -> float:
        """Mean over rotations: dense planes + distinct picked experts + activations."""
        d = self.dims
        total = 0.0
        for w in self.bf16_rot:
            _, ids = torch_route(w, b, d)
            n_exp = int(ids.unique().numel())
            acts = b * (d.hv * d.dv + 3 * d.hidden) * 2
            total += self.dense_bytes + n_exp * self.expert_bytes + acts
        return total / len(self.rot)


def torch_route(w: dict, b: int, d: Dims):
    x, res_out = torch_front(w, b, d)
    probs = torch.softmax(F.linear(x, w["router"]).float(), dim=-1)
    tw, ti = torch.topk(probs, d.top_k, dim=-1)
    return tw / tw.sum(-1, keepdim=True), ti


def torch_front(w: dict, b: int, d: Dims):
    res_out = w["residual"][:b] + F.linear(w["o_in"][:b], w["out_proj"])
    xf = res_out.float()
    x = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + d.eps)
    x = (x * (1.0 + w["post_attention_layernorm"].float())).to(BF)
    return x, res_out


def torch_shared(w: dict, x):
    g, u = F.linear(x, w["shared_gate_up"]).chunk(2, dim=-1)
    sh = F.linear(F.silu(g) * u, w["shared_down"])
    return sh * torch.sigmoid(F.linear(x, w["shared_expert_gate"]))


def torch_chain(w: dict, b: int, d: Dims) -> None:
    x, res_out = torch_front(w, b, d)
    probs = torch.softmax(F.linear(x, w["router"]).float(), dim=-1)
    tw, ti = torch.topk(probs, d.top_k, dim=-1)
    tw = tw / tw.sum(-1, keepdim=True)
    ids = ti.flatten()
    xr = x.repeat_interleave(d.top_k, dim=0).unsqueeze(-1)  # [b*k, H, 1]
    g, u = torch.bmm(w["w13"][ids], xr).squeeze(-1).chunk(2, dim=-1)
    y = torch.bmm(w["w2"][ids], (F.silu(g) * u).unsqueeze(-1)).squeeze(-1)  # [b*k, H]
    y = (y.view(b, d.top_k, -1).float() * tw.unsqueeze(-1)).sum(1)
    w["out_h"][:b].copy_(y + torch_shared(w, x).float())
    w["out_r"][:b].copy_(res_out)


def torch_loop_chain(w: dict, b: int, d: Dims) -> None:
    x, res_out = torch_front(w, b, d)
    probs = torch.softmax(F.linear(x, w["router"]).float(), dim=-1)
    tw, ti = torch.topk(probs, d.top_k, dim=-1)
    tw = (tw / tw.sum(-1, keepdim=True)).to(BF)
    out = torch_shared(w, x)
    ids = ti.tolist()  # host sync: the planes are picked on the host
    for r in range(b):
        for j, e in enumerate(ids[r]):
            g, u = F.linear(x[r : r + 1], w["w13"][e]).chunk(2, dim=-1)
            out[r : r + 1] += tw[r, j] * F.linear(F.silu(g) * u, w["w2"][e])
    w["out_h"][:b].copy_(out)
    w["out_r"][:b].copy_(res_out)


def time_graph(body, reps: int = 10) -> tuple[float, float]:
    """(median, best) microseconds per rotation layer of ``body`` replayed as a CUDA graph."""
    times = [t / ROT for t in graph_times_us(body, reps)]
    return statistics.median(times), min(times)


def time_eager(body, reps: int = 5) -> tuple[float, float]:
    """(median, best) microseconds per rotation layer of ``body`` launched eagerly."""
    body()
    torch.cuda.synchronize()
    times = [t / ROT for t in event_times_us(body, reps)]
    return statistics.median(times), min(times)


def build_k2(su: Setup, sms: int, stages: int = STAGES_ALL, **overrides) -> K2Launch:
    grid = sms * overrides.pop("ctas_per_sm", 1)
    cfg = K2Config(grid=grid, **overrides)
    k2 = K2Launch(K2Shape.from_dims(su.dims), cfg, stages=stages, formats=su.formats)
    k2.build("cuda")
    return k2


def launch_rot0(k: K2Launch, ws, su: Setup, state: RankState) -> tuple[torch.Tensor, ...]:
    """``k`` on rotation 0 at width 4, outputs poisoned first: (hidden, residual) as fp32."""
    w0 = su.rot[0]
    w0["out_h"][:4].fill_(float("nan"))
    w0["out_r"][:4].fill_(float("nan"))
    state.bump_epoch()
    k.launch(w0["o_in"][:4], w0["residual"][:4], w0, w0["out_h"][:4], w0["out_r"][:4], ws=ws,
             ctrl=state.ctrl, health=state.health)  # fmt: skip
    return w0["out_h"][:4].float().clone(), w0["out_r"][:4].float().clone()


def check_variant(
    k: K2Launch, ws, su: Setup, state: RankState, base: K2Launch, want, vname: str
) -> None:
    """Variant ``k`` against the default build ``base``'s output ``want`` (:func:`launch_rot0`):
    tiles change fp32 summation order only, so anything below a cosine of 0.99999 is a broken
    variant, not rounding. A variant that quantizes the expert inputs where the default does
    not, or the other way round (``fp8_activations``), computes another sum: it is held to the
    fp8 stock arms' cosine (``STOCK_COSINE``), vLLM's fp8 MoE quantizing them."""
    c = cosine(launch_rot0(k, ws, su, state)[0], want)
    need = STOCK_COSINE[su.fmt] if k.a8 != base.a8 else 0.99999
    if not c >= need:
        raise RuntimeError(
            f"variant {vname!r} disagrees with k2 (width 4): cosine {c:.6f} < {need}"
        )


def default_variants(fmt: str) -> list[str]:
    """The ``VARIANTS`` a run of planes in ``fmt`` times when none are named (the fp8
    activations variant needs fp8 block-128 planes)."""
    return [v for v in VARIANTS if fmt == "fp8_block128" or "fp8_activations" not in VARIANTS[v]]


def k2_body(k2: K2Launch, su: Setup, b: int, state: RankState, ws):
    def body():
        state.bump_epoch()
        for layer, w in enumerate(su.rot):
            k2.launch(w["o_in"][:b], w["residual"][:b], w, w["out_h"][:b], w["out_r"][:b],
                      ws=ws, ctrl=state.ctrl, health=state.health, layer=layer,
                      layers_per_step=ROT)  # fmt: skip

    return body


def host_launch_us(k2: K2Launch, su: Setup, state: RankState, ws, b: int = 1, reps: int = 200):
    """Host microseconds per eager K2 launch, median over ``reps`` rounds of one launch per
    rotation layer: ``checked``, planned on every launch with every tensor checked (what
    ``launch()`` does, and a layer's first launch in the runtime); ``planned``, run from each
    layer's plan after only ``fits`` (every later launch in the runtime). The GPU finishes
    each round before the next, so no launch waits for room in the queue."""
    lay = list(enumerate(su.rot))

    def acts(w):
        return w["o_in"][:b], w["residual"][:b], w["out_h"][:b], w["out_r"][:b]

    plans = []
    for layer, w in lay:
        o, r, h, ro = acts(w)
        plans.append(k2.plan(o, r, w, h, ro, ws=ws, ctrl=state.ctrl, health=state.health,
                             layer=layer, layers_per_step=ROT))  # fmt: skip

    def planned():
        for p, (_, w) in zip(plans, lay, strict=True):
            values = k2.live_values(*acts(w))
            if not p.fits(values):
                raise RuntimeError("a rotation layer's activations no longer fit its plan")
            p.run(values)

    def checked():
        for layer, w in lay:
            o, r, h, ro = acts(w)
            k2.launch(o, r, w, h, ro, ws=ws, ctrl=state.ctrl, health=state.health, layer=layer,
                      layers_per_step=ROT, validate=True)  # fmt: skip

    out = {}
    for name, body in (("checked", checked), ("planned", planned)):
        times = []
        for _ in range(reps + 5):
            state.bump_epoch()
            t0 = time.perf_counter_ns()
            body()
            times.append((time.perf_counter_ns() - t0) / 1e3 / len(lay))
            torch.cuda.synchronize()
        out[name] = round(statistics.median(times[5:]), 2)
    return out


TRACE_POINTS = (
    "start", "S1 pushed", "S1 reduced", "norm done", "router done", "top-k done",
    "gate_up done", "act waited", "down partials", "end", "top-k rows out",
    "gate_up streams", "down streams", "top-k logits in",
)  # fmt: skip


def print_trace(su: Setup, sms: int, state: RankState, vname: str, b: int) -> dict:
    """Run the rotation once (weights cold in L2, as timed) with a ``trace`` build and print,
    per stamp of the last launch, min / median / max over CTAs of microseconds since the
    first CTA started (``_trace.trace_points``); returns the same as a record for
    ``--trace-json``, with every CTA's stamps (``ctas_us``)."""
    k = build_k2(su, sms, trace=True, **variant_overrides(vname))
    ws = k.workspace("cuda")
    body = k2_body(k, su, b, state, ws)
    for _ in range(2):
        body()
    torch.cuda.synchronize()
    ws.trace.zero_()  # no stamp left from an earlier run
    body()
    torch.cuda.synchronize()
    stamps = ws.trace.cpu().tolist()
    points = trace_points(stamps, TRACE_POINTS)
    print(f"  trace {vname} width {b} (us since the first CTA started: min / median / max)")
    print("\n".join(format_points(points)))
    return {"variant": vname, "width": b, "points": points,
            "ctas_us": cta_times(stamps, len(TRACE_POINTS))}  # fmt: skip


VLLM_ARMS = ("vllm", "vllm-compiled")
TORCH_ARMS = ("torch", "torch-loop")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def vllm_arms(su: Setup, widths: list[int], modes: list[str], refs: dict, rows: list) -> None:
    """vLLM 0.26's own chain (benchmarks/_vllm_chain.py) per mode: built, checked against K2 on
    rotation 0 at width 4, timed per width under a CUDA graph (eager launches where capture
    fails). Appends (width, arm, median_us, best_us) to ``rows``; a mode that cannot be built or
    fails its check is reported and skipped."""
    problem = vc.import_problem()
    if problem is not None:
        print(f"vllm arms skipped: vLLM does not import ({problem})")
        return
    w0, wide = su.rot[0], max(widths)
    for mode in modes:
        arm = vc.ARMS[mode]
        t0 = time.perf_counter()
        try:
            planes = su.vllm_planes()
            tail = vc.VllmTail(planes, mode=mode, device="cuda",
                               quant_config=vc.quantization_config(su.fmt))  # fmt: skip
            # widest first: vLLM's MoE workspace (current_workspace_manager) grows here, never
            # inside a capture
            for r, w in enumerate(su.rot):
                tail(r, w["o_in"][:wide], w["residual"][:wide])
            hid, res = tail(0, w0["o_in"][:4], w0["residual"][:4])
            torch.cuda.synchronize()
            print(f"{arm}: {tail.describe(wide)}")
            copied = tail.copies(planes)
            print(f"{arm}: planes bound to vLLM's parameters without copies: "
                  f"{'all' if not copied else 'all but ' + ', '.join(copied)}")  # fmt: skip
        except Exception as e:  # report and go on: the other arms' numbers still stand
            traceback.print_exc()
            print(f"{arm}: could not build or run ({type(e).__name__}: {e}); not timed")
            continue
        ck = cosine(hid, refs["k2"])
        print(f"{arm} vs k2 (width 4): hidden cosine {ck:.6f}, vs torch chain "
              f"{cosine(hid, refs['torch']):.6f}; residual cosine vs k2 "
              f"{cosine(res, refs['k2_res']):.6f}")  # fmt: skip
        if not ck >= STOCK_COSINE[su.fmt]:
            print(f"{arm}: hidden cosine vs k2 below {STOCK_COSINE[su.fmt]}; not timed")
            continue
        for b in widths:

            def body(b=b, tail=tail):
                for r, w in enumerate(su.rot):
                    tail(r, w["o_in"][:b], w["residual"][:b])

            name = arm
            try:
                med, best = time_graph(body)
            except Exception as e:
                print(f"  {arm} w{b}: CUDA graph capture failed ({type(e).__name__}: {e}); "
                      "timed with eager launches")  # fmt: skip
                torch.cuda.synchronize()
                name = f"{arm} (eager launches)"
                med, best = time_eager(body)
            rows.append((b, name, med, best))
            print(f"  {name:<16} w{b:<2} {med:8.1f} us")
        print(f"  {arm}: built, checked and timed in {time.perf_counter() - t0:.0f} s")
        tail = planes = None
        torch.cuda.empty_cache()


def torch_arm_names(fmt: str) -> tuple[str, str]:
    """The torch arms' names: stock candidates in bf16, labelled information for fp8 (bf16
    planes of the dequantized values: twice the weight bytes of a quantized chain)."""
    if fmt == "bf16":
        return TORCH_ARMS
    return tuple(f"{arm} bf16-dequant (info)" for arm in TORCH_ARMS)


def stock_times(rows: list) -> tuple[dict, dict]:
    """Per width, the stock reference: the fastest graph-timed vLLM arm, else the fastest of
    torch / torch-loop (never the fp8 runs' information arms). Returns ({width: us},
    {width: arm})."""
    stock, arm_of = {}, {}
    for b in sorted({row[0] for row in rows}):
        for group in (VLLM_ARMS, TORCH_ARMS):
            timed = [(med, arm) for w, arm, med, _ in rows if w == b and arm in group]
            if timed:
                stock[b], arm_of[b] = min(timed)
                break
    return stock, arm_of


def ncu_target(overrides: dict) -> int:
    """Two rounds of eager K2 launches over the rotations at width 1 (profile the last few
    with ``ncu -k regex:k2_kernel``); returns the health record's failed word."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    su = Setup()
    state = RankState.create(0, "cuda", 2.0)
    k = build_k2(su, sms, **overrides)
    ws = k.workspace("cuda")
    body = k2_body(k, su, 1, state, ws)
    for _ in range(2):
        body()
    torch.cuda.synchronize()
    return 0 if decode_health(state.health.cpu().tolist(), rank=0).ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--variants", default=None, help="comma-separated (default: VARIANTS)")
    ap.add_argument("--prefixes", action="store_true", help="time stage prefixes too")
    ap.add_argument(
        "--trace", action="store_true",
        help="per-CTA %%globaltimer stamps of the first variant at widths 1 and 16 (where the "
             "time goes)",
    )  # fmt: skip
    ap.add_argument(
        "--trace-variants", default=None,
        help="with --trace: trace these variants (comma-separated) instead of the first",
    )  # fmt: skip
    ap.add_argument("--trace-json", default=None, help="with --trace: write the traces here")
    ap.add_argument(
        "--host-json", default=None,
        help="also time the host side of one eager K2 launch at width 1, planned every launch "
             "vs run from its plan, and write it here",
    )  # fmt: skip
    ap.add_argument(
        "--stock", choices=("vllm", "torch", "both"), default=None,
        help="stock arms: vLLM 0.26's own ops, the torch op chain, or both (default: both where "
             "vllm is installed, else torch)",
    )  # fmt: skip
    ap.add_argument(
        "--formats", choices=vc.FORMATS, default="bf16",
        help="weight format of out_proj, w13, w2 and the shared expert's gate_up / down (the "
             "router and shared_expert_gate stay bf16)",
    )  # fmt: skip
    ap.add_argument(
        "--vllm-modes", default="eager,compiled",
        help="vllm arms: eager (arm vllm, enforce_eager dispatch) and/or compiled "
             "(arm vllm-compiled, vLLM's default compilation)",
    )  # fmt: skip
    ap.add_argument(
        "--ncu", default=None, metavar="VARIANT",
        help="only eager launches of this variant at width 1 (for ncu -k regex:k2_kernel), exit",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.ncu is not None:
        return ncu_target(variant_overrides(args.ncu))
    if args.stock is None:
        args.stock = "both" if importlib.util.find_spec("vllm") is not None else "torch"
    widths = [int(x) for x in args.widths.split(",")]
    name = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    print(f"device: {name}, {sms} SMs; copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    su = Setup(fmt=args.formats)
    if args.variants is None:
        args.variants = ",".join(default_variants(su.fmt))
    d = su.dims
    torch_arm, loop_arm = torch_arm_names(su.fmt)
    if su.formats:
        print(f"formats: {args.formats} for {', '.join(vc.QUANTIZED)}; dense planes "
              f"{su.dense_bytes / 1e6:.1f} MB, one expert "
              f"{su.expert_bytes / 1e6:.2f} MB")  # fmt: skip
    state = RankState.create(0, "cuda", 2.0)
    nbytes = {b: su.bytes_moved(b) for b in widths}
    rows = []  # (width, arm, median_us, best_us)

    # correctness of what is timed: K2 vs the torch chain on rotation 0, width 4
    k2 = build_k2(su, sms)
    ws = k2.workspace("cuda")
    got, got_res = launch_rot0(k2, ws, su, state)
    refs = {"k2": got, "k2_res": got_res}
    w0 = su.rot[0]
    torch_chain(su.bf16_rot[0], 4, d)
    refs["torch"] = w0["out_h"][:4].float().clone()
    print(f"k2 vs {torch_arm} chain (width 4): hidden cosine {cosine(got, refs['torch']):.6f}")
    print(f"k2 build: {k2.label()} regs {k2.resources.regs_per_thread} "
          f"smem {k2.resources.shared_bytes} out_proj_k_splits {k2.out_proj_k_splits}")  # fmt: skip

    if args.host_json:
        host = host_launch_us(k2, su, state, ws)
        print(f"host us per K2 launch (width 1): {host}")
        with open(args.host_json, "w") as f:
            json.dump({**provenance(name), "label": k2.label(), "host_us_per_launch": host}, f,
                      indent=1)  # fmt: skip
    for vname in args.variants.split(","):
        k = k2 if vname == "k2" else build_k2(su, sms, **variant_overrides(vname))
        wsv = ws if k is k2 else k.workspace("cuda")
        if k is not k2:  # a variant changes tiles and waits, never what is computed
            check_variant(k, wsv, su, state, k2, refs["k2"], vname)
        for b in widths:
            med, best = time_graph(k2_body(k, su, b, state, wsv))
            rows.append((b, vname, med, best))
            print(f"  {vname:<16} w{b:<2} {med:8.1f} us")
    traces = []
    if args.trace:
        names = (args.trace_variants or args.variants.split(",")[0]).split(",")
        traces = [print_trace(su, sms, state, v, b) for v in names for b in (1, 16)]
    if args.trace_json:
        with open(args.trace_json, "w") as f:
            json.dump({**provenance(name), "traces": traces}, f, indent=1)
    if args.prefixes:
        for pname, bits in PREFIXES.items():
            k = build_k2(su, sms, stages=bits)
            wsp = k.workspace("cuda")
            for b in (1, 16):
                med, best = time_graph(k2_body(k, su, b, state, wsp))
                rows.append((b, f"prefix {pname}", med, best))
                print(f"  prefix {pname:<26} w{b:<2} {med:8.1f} us")
    h = decode_health(state.health.cpu().tolist(), rank=0)
    if not h.ok:
        raise RuntimeError(h.describe(k2.layout.describe))

    if args.stock in ("vllm", "both"):
        modes = [m for m in args.vllm_modes.split(",") if m]
        vllm_arms(su, widths, modes, refs, rows)
    timed_vllm = any(arm in VLLM_ARMS for _, arm, _, _ in rows)
    if args.stock in ("torch", "both") or not timed_vllm:
        if args.stock == "vllm":
            why = "(information only)" if su.formats else "as the stock reference"
            print(f"no vllm arm timed: timing the torch arms {why}")
        for b in widths:
            med, best = time_graph(lambda b=b: [torch_chain(w, b, d) for w in su.bf16_rot])
            rows.append((b, torch_arm, med, best))
            print(f"  {torch_arm:<16} w{b:<2} {med:8.1f} us")
            if b <= 4:
                med, best = time_eager(lambda b=b: [torch_loop_chain(w, b, d) for w in su.bf16_rot])
                rows.append((b, loop_arm, med, best))
                print(f"  {loop_arm:<16} w{b:<2} {med:8.1f} us")

    stock, stock_arm = stock_times(rows)
    date = datetime.date.today().isoformat()
    print(f"\n{name}, {date}; bytes/launch from the routed inputs; HBM = {bw / 1e12:.2f} TB/s"
          + (f"; weights {args.formats}" if su.formats else ""))  # fmt: skip
    print("vs stock: " + ", ".join(f"w{b} {stock_arm[b]}" for b in widths if b in stock_arm))
    if su.formats and not stock:
        print("  none: no vllm arm timed, and the torch arms on dequantized bf16 planes are not a "
              "quantized stock")  # fmt: skip
    print(f"{'width':>5} {'arm':<34} {'us':>8} {'best':>8} {'MB':>7} {'TB/s':>6} {'%HBM':>5} "
          f"{'vs stock':>8}")  # fmt: skip
    out = []
    for b, arm, med, best in rows:
        mb = nbytes[b] / 1e6
        tbs = nbytes[b] / (med * 1e-6) / 1e12
        pct = 100 * tbs * 1e12 / bw
        ratio = stock[b] / med if b in stock else float("nan")
        print(f"{b:>5} {arm:<34} {med:8.1f} {best:8.1f} {mb:7.1f} {tbs:6.2f} {pct:5.1f} "
              f"{ratio:8.2f}")  # fmt: skip
        out.append([name, date, b, arm, f"{med:.2f}", f"{best:.2f}", f"{mb:.1f}", f"{tbs:.3f}",
                    f"{pct:.1f}", f"{ratio:.3f}", f"{bw / 1e12:.3f}", stock_arm.get(b, "")])  # fmt: skip
    fmt_col = [args.formats] if su.formats else []  # bf16 CSVs keep their columns
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["device", "date", "width", "arm", "median_us", "best_us", "mbytes",
                         "tb_per_s", "pct_hbm", "stock_over_arm", "copy_tb_per_s",
                         "stock_arm"] + (["formats"] if fmt_col else [])
                        + ["commit", "command"])  # fmt: skip
            prov = provenance(name)
            wr.writerows(row + fmt_col + [prov["commit"], prov["command"]] for row in out)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for arm in ("k2", *VLLM_ARMS, torch_arm, loop_arm):
            pts = [(b, m) for b, a, m, _ in rows if a == arm]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=arm)
        ax.plot(widths, [nbytes[b] / bw * 1e6 for b in widths], "k--", label="HBM floor")
        ax.set_xlabel("width (rows)")
        ax.set_ylabel("us per launch")
        ax.set_yscale("log")
        ax.set_title(", ".join(["K2 layer tail, Qwen3-Next-80B-A3B TP1", *fmt_col, name]))
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
