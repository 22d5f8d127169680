"""Decoder layers per decode step: mono_ext's K1 + K2 against vLLM 0.26's own layer code.

    PYTHONPATH=src:/tmp/site python benchmarks/bench_layer.py [--widths 1,2,4,8,16]
        [--vllm-modes eager,compiled] [--json docs/results/layer_vllm.json]
        [--k1-config '{"pdl": true}']

What one step runs, per arm, for the first ``LAYERS`` layers of Qwen3-Next-80B-A3B at TP 1
(three GDN layers to one attention layer, as the model has them), all captured in one CUDA
graph per arm and width:

- ``k1+k2``: per layer one K1 (GDN or attention front) and one K2 (tail; the attention
  layers' build is ``gated``), the way the triton backend launches them: one epoch per step,
  the layer index as the tag, every layer its own weights and states.
- ``k1+k2 pdl``: the same builds with programmatic dependent launch (``pdl`` in K1Config and
  K2Config), so each launch starts while the one before drains: the boundary cost of a step
  is the difference (``--no-pdl`` leaves it out). It must leave a step bit-identical to
  ``k1+k2``'s from the same states, or it is not timed.
- ``vllm`` / ``vllm-compiled``: vLLM's modules for the same work (benchmarks/_vllm_front.py
  for the fronts, benchmarks/_vllm_chain.py for the tails; both name every file and function
  they run), eager (``enforce_eager`` dispatch) and under vLLM's default compilation.

Both arms leave the same work out: the paged attention of the attention layers (the engine's
in both; its output is one fixed random tensor, multiplied by the sigmoid of each arm's own
gate, vLLM's ``attn_output * sigmoid(gate)``, inside K2 for ``k1+k2``) and the embedding,
final norm and logits. Both write K and V into a FlashAttention cache with vLLM's
``reshape_and_cache_flash``, as the engine's attention does first. The attention layers'
tails in the vLLM arm go through the same RowParallelLinear + MoE block as the GDN layers'
(o_proj and out_proj have the same shape here, [2048, 4096]).

Checked before timing, at width ``CHECK_WIDTH``, layer by layer on equal inputs: each vLLM
mode runs every layer on the inputs K1 + K2 got (and on copies of the states they started
from), and its front output (GDN: gated-norm output; attention: q), its new recurrent state
(GDN) and its tail's hidden output must reach a cosine of ``STOCK_COSINE`` against K1 + K2's;
a mode that fails is reported and not timed.

Floor: the bytes a step must move (every weight read once, only the routed experts' w13/w2
planes, from the routing K1 + K2's own inputs give at that width; recurrent and conv states
read and written; K/V written; activations) over the device-to-device copy bandwidth of the
same run (read + write counted). Writes one JSON (device, date, commit, command; a row per
(width, arm): step, per layer, floor fraction, stock over arm with the stock the fastest vLLM
mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _cuda_timing import copy_bandwidth, graph_times_us  # noqa: E402
from _provenance import provenance  # noqa: E402

from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402

PRESET = "qwen3-next-80b-a3b"
LAYERS = 8
WIDTHS = (1, 2, 4, 8, 16)
MAX_W = 16
CHECK_WIDTH = 4
STOCK_COSINE = 0.999  # what bench_k1 and bench_k2 hold vLLM's arms to, per launch
BF = torch.bfloat16
KV_BLOCK = 16
ARM = "k1+k2"
PDL_ARM = "k1+k2 pdl"  # every launch of the step with programmatic dependent launch


# ------------------------------------------------------------------ sizes (no device)


def layer_kinds(d: Dims, n: int = LAYERS) -> tuple[str, ...]:
    """The first ``n`` layers' kinds ("gdn" / "attn"), in the model's order."""
    names = {"linear_attention": "gdn", "full_attention": "attn"}
    return tuple(names[k] for k in d.kinds[:n])


def layer_bytes(d: Dims, kind: str, width: int, experts_hit: int, state_bytes: int = 4) -> int:
    """Bytes one layer of ``kind`` must move at ``width`` rows: its planes once, w13/w2 only for
    the ``experts_hit`` routed experts, GDN states read and written (conv in bf16), K/V
    written, and the activations each launch reads and writes (bf16)."""
    planes = d.planes("linear_attention" if kind == "gdn" else "full_attention")
    total = 0
    for name, shape in planes.items():
        n = 1
        for s in shape:
            n *= s
        if name in ("w13", "w2"):
            n = n // d.experts * experts_hit
        total += n * (4 if name == "A_log" else 2)
    h = d.hidden
    if kind == "gdn":
        total += 2 * width * d.hv_r * d.dv * d.dk * state_bytes
        total += 2 * width * (d.conv_k - 1) * d.conv_dim_r * 2
        inner = d.hv_r * d.dv
        total += width * (3 * h + inner) * 2  # K1: hidden, residual in, residual out, o_in
    else:
        qd, kvd = d.hq_r * d.head_dim, d.hkv_r * d.head_dim
        inner = qd
        total += width * (3 * h + 2 * qd + 2 * kvd) * 2  # K1: q, k, v, gate out
        total += width * 2 * kvd * 2  # the K/V cache write
        total += width * qd * 2  # K2 reads the attention output beside the gate
    total += width * (inner + 3 * h) * 2  # K2: o_in, residual in, hidden and residual out
    return total


# ------------------------------------------------------------------ weights and buffers


def make_layers(d: Dims, kinds, gen) -> list[dict[str, torch.Tensor]]:
    """Random bf16 planes of every layer (A_log fp32), each layer its own copy, scaled by
    fan-in so activations stay O(1) through the layers."""
    out = []
    for kind in kinds:
        w = {}
        for name, shape in d.planes(
            "linear_attention" if kind == "gdn" else "full_attention"
        ).items():
            if name == "A_log":
                w[name] = torch.log(torch.empty(shape, device="cuda").uniform_(0.1, 4.0))
                continue
            x = torch.randn(shape, generator=gen, device="cuda")
            if name == "norm":  # the gated norm multiplies by its weight itself (no 1 + w)
                x, scale = 1.0 + 0.1 * x, 1.0
            elif name.endswith("norm"):  # Gemma norms: 1 + w
                scale = 0.1
            elif name == "router":
                scale = 3 * d.hidden**-0.5  # logits std ~3, as bench_k2 and the tests
            elif name in ("dt_bias", "conv1d"):
                scale = 0.5
            else:
                scale = shape[-1] ** -0.5
            w[name] = (x * scale).to(BF)
        if kind == "attn":
            w["out_proj"] = w["o_proj"]  # the vLLM tail's name for the same plane
        out.append(w)
    return out


class Buffers:
    """Every layer's inputs and outputs at ``MAX_W`` rows (arms slice their width), the
    attention core's stand-in output, positions and slots."""

    def __init__(self, d: Dims, kinds, gen):
        h = d.hidden
        qd, kvd = d.hq_r * d.head_dim, d.hkv_r * d.head_dim

        def empty(*shape):
            return torch.full(shape, float("nan"), dtype=BF, device="cuda")

        self.hidden = [torch.randn(MAX_W, h, generator=gen, device="cuda").to(BF)]
        self.residual = [torch.randn(MAX_W, h, generator=gen, device="cuda").to(BF)]
        self.hidden += [empty(MAX_W, h) for _ in kinds]
        self.residual += [empty(MAX_W, h) for _ in kinds]
        self.mid = [empty(MAX_W, h) for _ in kinds]  # residual after K1's add
        self.o_in = [empty(MAX_W, d.hv_r * d.dv) if k == "gdn" else None for k in kinds]
        self.qkvg = [None if k == "gdn" else tuple(empty(MAX_W, n) for n in (qd, kvd, kvd, qd))
                     for k in kinds]  # fmt: skip
        self.attn_o = torch.randn(MAX_W, qd, generator=gen, device="cuda").to(BF)
        self.positions = torch.randint(0, 4096, (MAX_W,), generator=gen, device="cuda")
        self.slots = torch.arange(1, MAX_W + 1, dtype=torch.int32, device="cuda")  # 0: null
        self.slot_mapping = torch.arange(MAX_W, device="cuda", dtype=torch.int64) + KV_BLOCK


def make_states(d: Dims, kinds, gen) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """GDN states in vLLM's layouts (conv [S, K-1, C] bf16, recurrent [S, Hv, Dv, Dk] fp32),
    slot 0 the null slot; None for attention layers."""
    out = []
    for kind in kinds:
        if kind != "gdn":
            out.append(None)
            continue
        conv = torch.randn(MAX_W + 1, d.conv_k - 1, d.conv_dim_r, generator=gen, device="cuda")
        ssm = torch.randn(MAX_W + 1, d.hv_r, d.dv, d.dk, generator=gen, device="cuda") * 0.1
        out.append((conv.to(BF), ssm))
    return out


def kv_cache(d: Dims, kinds) -> list[torch.Tensor | None]:
    """One FlashAttention cache per attention layer, (blocks, kv heads, block, 2 x D)."""
    blocks = MAX_W // KV_BLOCK + 2
    return [torch.zeros(blocks, d.hkv_r, KV_BLOCK, 2 * d.head_dim, dtype=BF, device="cuda")
            if k == "attn" else None for k in kinds]  # fmt: skip


def write_kv(d: Dims, k, v, cache, slot_mapping) -> None:
    """vLLM's FlashAttention K/V write (FlashAttentionImpl.do_kv_cache_update)."""
    from vllm.v1.attention.backends.fa_utils import reshape_and_cache_flash

    key_cache, value_cache = cache.transpose(1, 2).split(d.head_dim, dim=-1)
    one = torch.ones((), dtype=torch.float32, device=k.device)
    reshape_and_cache_flash(k.view(-1, d.hkv_r, d.head_dim), v.view(-1, d.hkv_r, d.head_dim),
                            key_cache, value_cache, slot_mapping, "auto", one, one)  # fmt: skip


# ------------------------------------------------------------------ the arms


class MonoArm:
    """K1 + K2 builds of the deployment (one per kind), their workspaces and the rank state."""

    def __init__(self, d: Dims, kinds, layers, states, caches, bufs, kv: bool, pdl: bool = False,
                 k1_over: dict | None = None, k2_over: dict | None = None):  # fmt: skip
        from mono_ext.models.qwen3_next.triton.k1 import (
            K1AttnLaunch,
            K1AttnShape,
            K1Config,
            K1GdnLaunch,
            K1GdnShape,
        )
        from mono_ext.models.qwen3_next.triton.k2 import K2Config, K2Launch, K2Shape
        from mono_ext.runtime.peers import RankState

        sm = torch.cuda.get_device_properties(0).multi_processor_count
        self.arm = PDL_ARM if pdl else ARM
        if k2_over:
            self.arm += " " + json.dumps(k2_over, separators=(",", ":"))
        k1c = K1Config(grid=sm, pdl=pdl, **(k1_over or {}))
        k2c = K2Config(grid=sm, pdl=pdl, **(k2_over or {}))
        self.d, self.kinds, self.layers, self.states = d, kinds, layers, states
        self.caches, self.bufs, self.kv = caches, bufs, kv
        self.k1 = {
            "gdn": K1GdnLaunch(K1GdnShape.from_dims(d), k1c, packing="interleaved",
                               state_dtype="float32", ssm_layout="vk", conv_dtype="bfloat16",
                               a_log_dtype="float32", dt_bias_dtype="bfloat16"),
            "attn": K1AttnLaunch(K1AttnShape.from_dims(d), k1c, max_positions=8192,
                                 positions_dtype="int64"),
        }  # fmt: skip
        self.k2 = {
            "gdn": K2Launch(K2Shape.from_dims(d, "gdn"), k2c, kind="gdn"),
            "attn": K2Launch(K2Shape.from_dims(d, "attn"), k2c, kind="attn",
                             gated=True),
        }  # fmt: skip
        for launch in (*self.k1.values(), *self.k2.values()):
            launch.build("cuda")
        self.ws1 = {k: v.workspace("cuda") for k, v in self.k1.items()}
        self.ws2 = {k: v.workspace("cuda") for k, v in self.k2.items()}
        self.state = RankState.create(0, "cuda", float(os.environ.get("MONO_EXT_DEADLINE_S", "2")))
        torch.cuda.synchronize()

    def labels(self) -> list[str]:
        return [x.label() for x in (*self.k1.values(), *self.k2.values())]

    def step(self, b: int) -> None:
        st, bf, n = self.state, self.bufs, len(self.kinds)
        st.bump_epoch()
        for i, kind in enumerate(self.kinds):
            w, h, r, mid = self.layers[i], bf.hidden[i][:b], bf.residual[i][:b], bf.mid[i][:b]
            common = dict(ctrl=st.ctrl, health=st.health, layer=i, layers_per_step=n)
            if kind == "gdn":
                conv, ssm = self.states[i]
                o_in, gate = bf.o_in[i][:b], None
                self.k1["gdn"].launch(h, r, w, conv, ssm, bf.slots[:b], o_in, mid,
                                      ws=self.ws1["gdn"], null_slot=0, **common)  # fmt: skip
            else:
                q, k, v, gate = (t[:b] for t in bf.qkvg[i])
                self.k1["attn"].launch(h, r, w, bf.positions[:b], q, k, v, gate, mid,
                                       ws=self.ws1["attn"], **common)  # fmt: skip
                if self.kv:
                    write_kv(self.d, k, v, self.caches[i], bf.slot_mapping[:b])
                o_in = bf.attn_o[:b]
            self.k2[kind].launch(o_in, mid, w, bf.hidden[i + 1][:b], bf.residual[i + 1][:b],
                                 ws=self.ws2[kind], gate=gate, **common)  # fmt: skip

    def healthy(self) -> None:
        """Raise, naming the wait, if any wait of the steps so far gave up."""
        from mono_ext.runtime.health import decode_health
        from mono_ext.runtime.persistent import wait_namer

        h = decode_health(self.state.health.cpu().tolist(), rank=0)
        if not h.ok:
            launches = (*self.k1.values(), *self.k2.values())
            raise RuntimeError(h.describe(wait_namer([x.layout for x in launches])))


class VllmArm:
    """vLLM's fronts (``_vllm_front.VllmFront``) and tails (``_vllm_chain.VllmTail``) of the
    same layers, one mode; its own copies of the states and caches."""

    def __init__(self, d: Dims, kinds, layers, states, mode: str):
        import _vllm_chain as vc
        from _vllm_front import VllmFront

        self.d, self.kinds, self.mode, self.arm = d, kinds, mode, vc.ARMS[mode]
        gdn = [w for w, k in zip(layers, kinds, strict=True) if k == "gdn"]
        attn = [w for w, k in zip(layers, kinds, strict=True) if k == "attn"]
        self.front = VllmFront(gdn, attn, preset=PRESET, mode=mode, device="cuda")
        if not self.front.conv_is_time_major():
            raise RuntimeError("vLLM keeps the conv state channel-major here; this bench's "
                               "states are time-major (VLLM_SSM_CONV_STATE_LAYOUT unset)")  # fmt: skip
        tails = [{n: w[n] for n in vc.PARAMS} for w in layers]
        self.tail = vc.VllmTail(tails, preset=PRESET, mode=mode, device="cuda")
        self.index = []  # layer -> its index among the front's GDN or attention layers
        counts = {"gdn": 0, "attn": 0}
        for k in kinds:
            self.index.append(counts[k])
            counts[k] += 1
        self.states = [None if s is None else (s[0].clone(), s[1].clone()) for s in states]
        self.caches = kv_cache(d, kinds)
        self.gated = torch.compile(_gated, backend="inductor", dynamic=False) \
            if mode == "compiled" else _gated  # fmt: skip

    def gdn_states(self, states=None):
        return [s for s in (states or self.states) if s is not None]

    def layer(self, i: int, h, r, bufs, b: int):
        """Layer ``i`` on (h, r): (front output, hidden out, residual out), inside
        ``front.gdn_step``."""
        kind, j = self.kinds[i], self.index[i]
        if kind == "gdn":
            o, mid = self.front.gdn_front(j, h, r)
            out = o
        else:
            q, gate, mid = self.front.attn_front(j, h, r, bufs.positions[:b], self.caches[i],
                                                 bufs.slot_mapping[:b])  # fmt: skip
            o, out = self.gated(bufs.attn_o[:b], gate), q
        hid, res = self.tail(i, o, mid)
        return out, hid, res

    def step(self, b: int, bufs) -> None:
        h, r = bufs.hidden[0][:b], bufs.residual[0][:b]
        with self.front.gdn_step(self.gdn_states(), bufs.slots[:b]):
            for i in range(len(self.kinds)):
                _, h, r = self.layer(i, h, r, bufs, b)


def _gated(attn_out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Qwen3NextAttention.forward's output gate before o_proj."""
    return attn_out * torch.sigmoid(gate)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def check_vllm(mono: MonoArm, arm: VllmArm, bufs: Buffers, start) -> tuple[dict, dict]:
    """``arm`` layer by layer on the inputs K1 + K2 got in their last step at CHECK_WIDTH (and
    on copies of the states that step started from): the lowest cosine of each output, and
    where the hidden one is lowest (layer, kind, each row's cosine: one row far below the
    others is a row routed to other experts, the rest agree)."""
    b = CHECK_WIDTH
    states = [None if s is None else (s[0].clone(), s[1].clone()) for s in start]
    lows = {"front": 1.0, "state": 1.0, "hidden": 1.0}
    where: dict = {}
    with arm.front.gdn_step(arm.gdn_states(states), bufs.slots[:b]):
        for i, kind in enumerate(mono.kinds):
            out, hid, _ = arm.layer(i, bufs.hidden[i][:b], bufs.residual[i][:b], bufs, b)
            ref = bufs.o_in[i][:b] if kind == "gdn" else bufs.qkvg[i][0][:b]
            lows["front"] = min(lows["front"], cosine(out, ref))
            c = cosine(hid, bufs.hidden[i + 1][:b])
            if c < lows["hidden"]:
                rows = [round(cosine(hid[r], bufs.hidden[i + 1][r]), 6) for r in range(b)]
                where = {"layer": i, "kind": kind, "row_cosines": rows}
            lows["hidden"] = min(lows["hidden"], c)
            if kind == "gdn":
                slots = bufs.slots[:b].long()
                got, want = states[i][1][slots], mono.states[i][1][slots]
                lows["state"] = min(lows["state"], cosine(got, want))
    torch.cuda.synchronize()
    return {k: round(v, 6) for k, v in lows.items()}, where


def same_step(ref: MonoArm, other: MonoArm, bufs: Buffers) -> bool:
    """Whether ``other`` leaves the bit-identical last hidden and residual that ``ref`` does,
    each from the same states (PDL changes when a launch starts, never what it computes)."""
    b, last = CHECK_WIDTH, len(ref.kinds)
    snap = [None if s is None else (s[0].clone(), s[1].clone()) for s in ref.states]
    ref.step(b)
    want = (bufs.hidden[last][:b].clone(), bufs.residual[last][:b].clone())
    for s, saved in zip(ref.states, snap, strict=True):
        if s is not None:
            s[0].copy_(saved[0])
            s[1].copy_(saved[1])
    other.step(b)
    torch.cuda.synchronize()
    return torch.equal(bufs.hidden[last][:b], want[0]) and torch.equal(
        bufs.residual[last][:b], want[1]
    )


def experts_hit(d: Dims, layers, bufs: Buffers, b: int) -> list[int]:
    """Distinct experts each layer's rows route to, from K1 + K2's last step's own tail inputs
    (torch: out_proj, add, Gemma RMSNorm, router logits, top-k)."""
    out = []
    for i, w in enumerate(layers):
        if bufs.o_in[i] is not None:
            o = bufs.o_in[i][:b]
        else:
            o = _gated(bufs.attn_o[:b], bufs.qkvg[i][3][:b])
        x = F.linear(o, w["out_proj"]).float() + bufs.mid[i][:b].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + d.eps)
        x = (x * (1.0 + w["post_attention_layernorm"].float())).to(BF)
        ids = torch.topk(F.linear(x, w["router"]).float(), d.top_k, dim=-1).indices
        out.append(int(ids.unique().numel()))
    return out


def time_graph(body, reps: int) -> float:
    """Median microseconds of one replay of ``body`` captured in a CUDA graph."""
    return statistics.median(graph_times_us(body, reps))


def time_arms(bodies, passes: int, time_one) -> dict[str, list[float]]:
    """``time_one(body)`` of every ``(arm, body, mono)`` in ``bodies``, ``passes`` times, the
    order reversed every other pass (so no arm always runs first after a capture); a mono
    arm's health is checked after each of its timings. Returns each arm's times in pass order."""
    out: dict[str, list[float]] = {arm: [] for arm, _, _ in bodies}
    for p in range(passes):
        for arm, body, mono in bodies if p % 2 == 0 else bodies[::-1]:
            out[arm].append(time_one(body))
            if mono is not None:
                mono.healthy()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--vllm-modes", default="eager,compiled")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-pdl", action="store_true", help=f"leave out the {PDL_ARM!r} arm")
    ap.add_argument("--json", default=None, help="default docs/results/layer_<device>.json")
    ap.add_argument("--k2-variants", default=None,
                    help='more mono arms, each a K2Config override (JSON), ";" between them, '
                         'e.g. \'{"down_pipeline_stages": 4}\'; each must leave the step '
                         'bit-identical to the default arm\'s')  # fmt: skip
    ap.add_argument("--passes", type=int, default=1,
                    help="time every arm this many times per width, the order reversed every "
                         "other pass; the median of the passes is reported")  # fmt: skip
    ap.add_argument("--k1-config", default=None,
                    help='K1Config overrides (JSON) of both mono arms, e.g. \'{"pipeline_stages": 4}\'')  # fmt: skip
    args = ap.parse_args(argv)
    k1_over = json.loads(args.k1_config) if args.k1_config else {}
    widths = [int(x) for x in args.widths.split(",")]
    if not widths or any(not 1 <= b <= MAX_W for b in widths):
        ap.error(f"--widths: each width in 1..{MAX_W}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    import _vllm_chain as vc

    problem = vc.import_problem()
    d = Dims.from_config(get_preset(PRESET), tp=1)
    kinds = layer_kinds(d)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = make_layers(d, kinds, gen)
    states = make_states(d, kinds, gen)
    bufs = Buffers(d, kinds, gen)
    name = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"device: {name}; copy {bw / 1e12:.2f} TB/s (read + write); layers {','.join(kinds)}")
    mono = MonoArm(d, kinds, layers, states, kv_cache(d, kinds), bufs, kv=problem is None,
                   k1_over=k1_over)  # fmt: skip
    print("builds: " + "; ".join(mono.labels()))
    mono.step(CHECK_WIDTH)
    torch.cuda.synchronize()
    mono.healthy()
    monos, checks = [mono], {}

    def add_if_same(**kw) -> None:
        """Another mono arm of the same layers, timed only if its step is bit-identical."""
        var = MonoArm(d, kinds, layers, states, mono.caches, bufs, kv=mono.kv, k1_over=k1_over,
                      **kw)  # fmt: skip
        same = same_step(mono, var, bufs)
        var.healthy()
        checks[var.arm] = {"bit_identical_to": ARM, "ok": same}
        print(f"  {var.arm}: bit-identical to {ARM} at width {CHECK_WIDTH}: {same}")
        if same:
            monos.append(var)

    if not args.no_pdl:
        add_if_same(pdl=True)
    for over in (json.loads(v) for v in (args.k2_variants or "").split(";") if v.strip()):
        add_if_same(k2_over=over)

    arms = []
    modes = [m for m in args.vllm_modes.split(",") if m]
    if problem is not None:
        print(f"vllm arms skipped: vLLM does not import ({problem})")
        modes = []
    for mode in modes:
        try:
            arm = VllmArm(d, kinds, layers, states, mode)
            arm.step(MAX_W, bufs)  # widest first: vLLM's MoE workspace grows here, not in a capture
            start = [None if s is None else (s[0].clone(), s[1].clone()) for s in mono.states]
            mono.step(CHECK_WIDTH)  # every layer's inputs and outputs, for the check to replay
            torch.cuda.synchronize()
            low, where = check_vllm(mono, arm, bufs, start)
            checks[arm.arm] = {**low, "lowest_hidden": where}
            print(f"  {arm.arm} vs {ARM}, width {CHECK_WIDTH}, lowest cosine per output: {low}")
            print(f"    lowest hidden: {where}")
            if min(low.values()) < STOCK_COSINE:
                print(f"  {arm.arm}: below {STOCK_COSINE}; not timed")
                continue
            arms.append(arm)
        except Exception as e:  # report, and time what can be timed
            print(f"  vllm {mode}: not timed ({type(e).__name__}: {e})")

    rows = []
    for b in widths:
        mono.step(b)
        torch.cuda.synchronize()
        hit = experts_hit(d, layers, bufs, b)
        nbytes = sum(layer_bytes(d, k, b, n) for k, n in zip(kinds, hit, strict=True))
        floor_us = nbytes / bw * 1e6
        bodies = [(m.arm, lambda b=b, m=m: m.step(b), m) for m in monos] + [
            (arm.arm, lambda b=b, arm=arm: arm.step(b, bufs), None) for arm in arms
        ]
        passes = time_arms(bodies, args.passes, lambda body: time_graph(body, args.reps))
        timed = {arm: statistics.median(v) for arm, v in passes.items()}
        mono_arms = {m.arm for m in monos}
        stock = min((us for a, us in timed.items() if a not in mono_arms), default=None)
        for a, us in timed.items():
            row = {
                "width": b,
                "arm": a,
                "step_us": round(us, 2),
                "per_layer_us": round(us / len(kinds), 2),
                "bytes": nbytes,
                "floor_us": round(floor_us, 2),
                "floor_fraction": round(floor_us / us, 3),
                "stock_over_arm": round(stock / us, 3) if stock else None,
                "experts_hit": hit,
                "passes_us": [round(x, 2) for x in passes[a]],
            }
            rows.append(row)
            print(f"  w{b:<2} {a:<14} {us:8.1f} us/step {us / len(kinds):7.1f} us/layer "
                  f"floor {floor_us:6.1f} ({row['floor_fraction']:.2f})"
                  + (f" stock/arm {row['stock_over_arm']:.2f}" if stock else ""))  # fmt: skip
    out = {
        **provenance(name),
        "layers": list(kinds),
        "copy_tb_per_s": round(bw / 1e12, 3),
        "builds": [x for m in monos for x in m.labels()],
        "k1_config": k1_over,
        "k2_variants": args.k2_variants,
        "passes": args.passes,
        "kv_write": problem is None,
        "checks": {"width": CHECK_WIDTH, "min_cosine": STOCK_COSINE, "arms": checks},
        "rows": rows,
    }
    path = args.json or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results",
        f"layer_{name.replace(' ', '_').lower()}.json",
    )  # fmt: skip
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
