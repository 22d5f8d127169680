"""The triton backend's LaunchBuilder through the per-step driver, against the reference builder.

Model: the Qwen3-Next-80B-A3B shapes cut to 4 decoder layers (3 GDN + 1 attention), random bf16
weights, fp32 recurrent states in vLLM's layouts (conv [S, K-1, C], null slot 0, one slot table
per GDN layer as vLLM's KV-cache groups have) and a contiguous KV history per request standing
in for the engine's paged attention (``attend`` writes the step's k/v and attends, as the
reference's ``decoder_layer_step`` does; graph-capturable).

For widths 1, 3, 8 and 16, ``STEPS`` decode steps run through ``DecodeDriver`` twice from the
same caches and inputs: with the triton builder, then with the reference builder in lockstep
(every reference launch takes the triton run's inputs of that launch, so each launch output of
each layer is compared on equal inputs, the way the spec's NUMERICS are defined). A
:class:`CheckTracker` holds every comparison (``k1.*`` per GDN / attention front, ``k2.*`` per
tail with router near-tie rows skipped, ``k1.conv_state`` / ``k1.ssm_state`` after the step);
a free-running reference pass (no lockstep) gives the end-to-end step metrics (printed,
sanity-bounded). Also: padding rows (null slot) leave every state slot not in the step
bit-untouched and give o_in = 0; a CUDA graph of the whole step replays bit-identically to
eager; nothing compiles after build; the build cache is sealed by the first step; a wait that
gave up makes the step raise FailStopError, and every later step too.

GPU only (H200); without CUDA or Triton the module skips.
"""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from mono_ext.core.backends import load_target  # noqa: E402
from mono_ext.core.numerics import CheckTracker, metrics  # noqa: E402
from mono_ext.core.spec import BuildContext, Deployment  # noqa: E402
from mono_ext.core.views import ConfigView, StepView  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.driver import DecodeDriver, StepInputs  # noqa: E402
from mono_ext.models.qwen3_next.launches import (  # noqa: E402
    BoundLayer,
    LaunchBuilder,
    LayerLaunches,
)
from mono_ext.models.qwen3_next.reference.attention import decode_attention  # noqa: E402
from mono_ext.models.qwen3_next.reference.common import gemma_rms_norm  # noqa: E402
from mono_ext.models.qwen3_next.reference.tail import route  # noqa: E402
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
DEV = torch.device("cuda" if CUDA else "cpu")
NUM = Qwen3NextSpec.NUMERICS
WIDTHS = (1, 3, 8, 16)
STEPS = int(os.environ.get("MONO_EXT_TEST_STEPS", "3"))
SLOTS, T_MAX, NULL = 40, 64, 0  # state slots per GDN layer / KV rows per request; vLLM's null
LAYOUTS = {"conv_layout": "time_chan", "ssm_layout": "vk", "qkvz_packing": "interleaved"}
EXTRA = {"ssm_dtype": "float32"}


def model_config(preset: str = "qwen3-next-80b-a3b", layers: int = 4) -> dict:
    """The preset's shapes with ``layers`` decoder layers: GDN, GDN, GDN, attention, ..."""
    cfg = dict(get_preset(preset))
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    cfg.update(num_hidden_layers=layers, layer_types=kinds, full_attention_interval=4)
    return cfg


def padding_rows(width: int) -> list[int]:
    return [] if width == 1 else [width // 2] + ([width - 1] if width >= 8 else [])


# --------------------------------------------------------------------------------- the model


def make_weights(d: Dims, kind: str, gen: torch.Generator) -> dict:
    """Engine-layout planes (``Dims.planes``), scaled so activations and logits are O(1):
    router logits std ~3 (few near ties), decay A in [0.1, 4] (well-conditioned GDN heads)."""
    h = d.hidden
    out = {}
    for name, shape in d.planes(kind).items():
        if name == "A_log":
            a = torch.empty(shape, device=DEV).uniform_(0.1, 4.0, generator=gen)
            out[name] = torch.log(a)  # fp32, as the engines keep it
            continue
        if name == "norm":
            out[name] = (1 + 0.1 * torch.randn(shape, generator=gen, device=DEV)).to(BF16)
            continue
        scale = {
            "input_layernorm": 0.2,
            "post_attention_layernorm": 0.1,
            "q_norm": 0.2,
            "k_norm": 0.2,
            "conv1d": 0.5,
            "dt_bias": 0.5,
            "router": 3 * h**-0.5,
        }.get(
            name, shape[-1] ** -0.5
        )  # projections: 1 / sqrt(fan-in)
        out[name] = (torch.randn(shape, generator=gen, device=DEV) * scale).to(BF16)
    return out


class Model:
    """Weights (shared by both runs) and one set of engine-style caches per run."""

    def __init__(self, cfg: dict, seed: int = 0):
        self.cfg = cfg
        self.d = d = Dims.from_config(cfg)
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.weights = [make_weights(d, kind, gen) for kind in d.kinds]
        self.gdn = [i for i, k in enumerate(d.kinds) if k == "linear_attention"]
        self.attn = [i for i, k in enumerate(d.kinds) if k == "full_attention"]
        # request slot -> GDN state slot, one table per layer; the null slot maps to itself
        cpu = torch.Generator().manual_seed(seed + 1)
        self.table = {
            i: torch.cat([torch.tensor([NULL]), torch.randperm(SLOTS - 1, generator=cpu) + 1])
            .to(torch.int32)
            .to(DEV)
            for i in self.gdn
        }
        self.caches = {"fused": self._caches(gen), "ref": self._caches(gen)}

    def _caches(self, gen: torch.Generator) -> dict:
        d = self.d
        out = {}
        for i in self.gdn:
            conv = torch.randn(SLOTS, d.conv_k - 1, d.conv_dim_r, generator=gen, device=DEV)
            ssm = 0.5 * torch.randn(SLOTS, d.hv_r, d.dv, d.dk, generator=gen, device=DEV)
            out[i] = (conv.to(BF16), ssm)
        for i in self.attn:
            shape = (SLOTS, T_MAX, d.hkv_r, d.head_dim)
            k = torch.randn(shape, generator=gen, device=DEV).to(BF16)
            v = torch.randn(shape, generator=gen, device=DEV).to(BF16)
            out[i] = (k, v)
        return out

    def layers(self, run: str) -> list[BoundLayer]:
        c = self.caches[run]
        return [
            BoundLayer(i, kind, self.weights[i], *(c[i] if i in self.gdn else ()))
            for i, kind in enumerate(self.d.kinds)
        ]

    def snapshot(self, run: str) -> dict:
        return {i: tuple(t.clone() for t in ts) for i, ts in self.caches[run].items()}

    def load(self, run: str, snap: dict) -> None:
        for i, ts in self.caches[run].items():
            for t, s in zip(ts, snap[i], strict=True):
                t.copy_(s)

    def slots(self, requests: torch.Tensor) -> dict:
        return {i: t[requests.long()] for i, t in self.table.items()}

    def attend(self, run: str, requests: torch.Tensor, positions: torch.Tensor):
        """The engine's attention stand-in: write the step's k/v, attend over the history.
        No host reads (graph-capturable); padding rows write their own (null, position) row."""
        d, c = self.d, self.caches[run]
        r, p = requests.long(), positions.long()

        def run_attn(index, q, k, v):
            kc, vc = c[index]
            b = q.shape[0]
            kc[r, p] = k.view(b, d.hkv_r, d.head_dim)
            vc[r, p] = v.view(b, d.hkv_r, d.head_dim)
            out = decode_attention(q.view(b, d.hq_r, d.head_dim), kc[r], vc[r], p + 1)
            return out.to(q.dtype)

        return run_attn


class Recorder:
    """A LayerLaunches wrapper: records every launch's inputs and outputs per layer (``on``)
    and, with ``feed`` (another recorder's log), replaces each launch's inputs with those."""

    def __init__(self, inner):
        self.inner, self.key = inner, inner.key
        self.on, self.feed, self.log = False, None, {}

    def begin_step(self):
        self.inner.begin_step()

    def end_step(self, replayed=False):
        self.inner.end_step(replayed)

    @staticmethod
    def _c(t):
        return None if t is None else t.clone()

    def _in(self, index, name, given):
        return self.feed[index][name] if self.feed is not None else given

    def k1_gdn(self, layer, hidden, residual, slots, *, o_in, residual_out):
        hidden, residual = self._in(layer.index, "k1_in", (hidden, residual))
        self.inner.k1_gdn(layer, hidden, residual, slots, o_in=o_in, residual_out=residual_out)
        if self.on:
            self.log[layer.index] = {
                "k1_in": (self._c(hidden), self._c(residual)),
                "k1_out": {"out": o_in.clone(), "residual": residual_out.clone()},
            }

    def k1_attn(self, layer, hidden, residual, positions, *, q, k, v, gate, residual_out):
        hidden, residual = self._in(layer.index, "k1_in", (hidden, residual))
        self.inner.k1_attn(layer, hidden, residual, positions, q=q, k=k, v=v, gate=gate,
                           residual_out=residual_out)  # fmt: skip
        if self.on:
            outs = {"q": q, "k": k, "v": v, "gate": gate, "residual": residual_out}
            self.log[layer.index] = {
                "k1_in": (self._c(hidden), self._c(residual)),
                "k1_out": {n: t.clone() for n, t in outs.items()},
            }

    def k2(self, layer, o_in, residual, gate, *, hidden_out, residual_out):
        o_in, residual, gate = self._in(layer.index, "k2_in", (o_in, residual, gate))
        self.inner.k2(layer, o_in, residual, gate, hidden_out=hidden_out,
                      residual_out=residual_out)  # fmt: skip
        if self.on:
            self.log[layer.index]["k2_in"] = (o_in.clone(), residual.clone(), self._c(gate))
            self.log[layer.index]["k2_out"] = {
                "hidden": hidden_out.clone(),
                "residual": residual_out.clone(),
            }


def near_ties(model: Model, index: int, residual_out: torch.Tensor) -> torch.Tensor:
    """Rows whose router top-k is a near tie, from a K2's residual output (as check mode)."""
    w, d = model.weights[index], model.d
    x = gemma_rms_norm(residual_out, w["post_attention_layernorm"], d.eps)
    return route(x, w["router"], d.top_k, d.norm_topk)[2]


class Harness:
    """Both drivers over one model: ``fused`` (the builder under test) and ``ref``."""

    def __init__(self, model: Model, builder, widths=WIDTHS, extra=EXTRA):
        self.m = model
        self.spec = Qwen3NextSpec()
        cv = ConfigView(hf_config=model.cfg)
        assert not self.spec.accept_config(cv), self.spec.refuse_config(cv).message()
        self.builder = builder
        self.ref_builder = load_target("mono_ext.models.qwen3_next.reference.backend:build")
        ctx = BuildContext(text_config=model.cfg, device=str(DEV), null_slot=NULL, extra=extra)
        self.fused = self._launches(builder, "triton", widths, ctx)
        self.ref = self._launches(self.ref_builder, "reference", widths, ctx)
        self.rec = {w: Recorder(x) for w, x in self.fused.items()}
        self.rec_ref = {w: Recorder(x) for w, x in self.ref.items()}
        common = dict(dtype=BF16, device=DEV, null_slot=NULL, numerics=NUM)
        self.drv = DecodeDriver(model.layers("fused"), self.rec, model.d, **common)
        self.drv_ref = DecodeDriver(model.layers("ref"), self.rec_ref, model.d, **common)
        self.spec.deploy(Deployment("triton", "bfloat16", 1, tuple(widths), LAYOUTS))

    def _launches(self, builder, name, widths, ctx):
        assert isinstance(builder, LaunchBuilder)
        spec = Qwen3NextSpec()
        spec.deploy(Deployment(name, "bfloat16", 1, tuple(widths), LAYOUTS))
        out = {k.width: builder(k, ctx) for k in spec.build_keys()}
        assert all(isinstance(x, LayerLaunches) for x in out.values())
        return out

    def inputs(self, width: int, gen: torch.Generator, step: int):
        """Distinct live requests, padding rows on the null slot (distinct positions)."""
        d = self.m.d
        req = (torch.randperm(SLOTS - 1, generator=gen, device=DEV)[:width] + 1).to(torch.int32)
        pos = torch.randint(T_MAX // 2, T_MAX, (width,), generator=gen, device=DEV)
        for j in padding_rows(width):
            req[j], pos[j] = NULL, j
        emb = torch.randn(width, d.hidden, generator=gen, device=DEV).to(BF16)
        plan = self.spec.plan(StepView("decode", width))
        return plan, req, pos, StepInputs(emb, pos, self.m.slots(req))

    def run(self, which: str, plan, req, pos, inp):
        drv, run = (self.drv, "fused") if which == "fused" else (self.drv_ref, "ref")
        h, r = drv.run(plan, inp, self.m.attend(run, req, pos))
        return h.clone(), r.clone()


def compare_step(h: Harness, tracker: CheckTracker, width: int, step: int, req, worst: dict):
    """Every launch of every layer (lockstep logs) and the GDN states after the step."""
    m = h.m
    valid = req != NULL
    fused, ref = h.rec[width].log, h.rec_ref[width].log
    idx = {i: m.slots(req)[i][valid].long() for i in m.gdn}

    def check(launch, output, out, want, where, skip=None):
        got = tracker.check(launch, output, out, want, skip_rows=skip, where=where)
        keep = ~skip if skip is not None else slice(None)
        if out[keep].shape[0]:
            mt = metrics(out[keep], want[keep])
            w = worst.setdefault(f"{launch}.{output}", [1.0, 0.0])
            w[0], w[1] = min(w[0], mt["cosine"]), max(w[1], mt["rel_l2"])
        return got

    for i in range(m.d.num_layers):
        where = f"w{width} step {step} layer {i}"
        for name, out in fused[i]["k1_out"].items():
            check("k1", name, out[valid].float(), ref[i]["k1_out"][name][valid].float(), where)
        if i in m.gdn:
            o = fused[i]["k1_out"]["out"]
            assert (o[~valid] == 0).all(), f"{where}: padding rows must give o_in = 0"
        r_ref = ref[i]["k2_out"]["residual"]
        tie = near_ties(m, i, r_ref.float())[valid]
        check("k2", "residual", fused[i]["k2_out"]["residual"][valid].float(),
              r_ref[valid].float(), where)  # fmt: skip
        check("k2", "hidden", fused[i]["k2_out"]["hidden"][valid].float(),
              ref[i]["k2_out"]["hidden"][valid].float(), where, tie)  # fmt: skip
    for i in m.gdn:
        where = f"w{width} step {step} layer {i}"
        if idx[i].numel():
            for n, name in enumerate(("conv_state", "ssm_state")):
                got = m.caches["fused"][i][n][idx[i]].float()
                want = m.caches["ref"][i][n][idx[i]].float()
                check("k1", name, got, want, where)


def untouched(m: Model, before: dict, req) -> None:
    """Every state slot not owned by a live row of the step (the null slot too) is unchanged."""
    valid = req != NULL
    for i in m.gdn:
        owned = set(m.slots(req)[i][valid].tolist())
        keep = torch.tensor([s not in owned for s in range(SLOTS)], device=DEV)
        assert keep[NULL]
        for n, name in enumerate(("conv_state", "ssm_state")):
            now, then = m.caches["fused"][i][n], before[i][n]
            assert torch.equal(
                now[keep], then[keep]
            ), f"layer {i}: {name} of a slot not in the step"


def free_run_metrics(h: Harness, plan, req, pos, inp, before, fused_out, taint) -> dict:
    """The reference driver without lockstep from the same caches: end-to-end step metrics."""
    h.m.load("ref", before)
    h.rec_ref[plan.width].feed = None
    h_ref, r_ref = h.run("ref", plan, req, pos, inp)
    keep = (req != NULL) & ~taint
    out = {}
    if keep.any():
        out["hidden"] = metrics(fused_out[0][keep].float(), h_ref[keep].float())
        out["residual"] = metrics(fused_out[1][keep].float(), r_ref[keep].float())
    return out


def run_width(h: Harness, width: int, steps: int, tracker: CheckTracker, seed: int = 0):
    """``steps`` eager steps of one width: lockstep comparison, untouched slots, free run."""
    m = h.m
    gen = torch.Generator(device=DEV).manual_seed(1000 * width + seed)
    worst, free = {}, []
    for t in range(steps):
        plan, req, pos, inp = h.inputs(width, gen, t)
        before = m.snapshot("fused")
        m.load("ref", before)
        rec, rec_ref = h.rec[width], h.rec_ref[width]
        rec.on, rec.log = True, {}
        out = h.run("fused", plan, req, pos, inp)
        rec.on = False
        untouched(m, before, req)
        rec_ref.on, rec_ref.log, rec_ref.feed = True, {}, rec.log
        h.run("ref", plan, req, pos, inp)
        rec_ref.on, rec_ref.feed = False, None
        compare_step(h, tracker, width, t, req, worst)
        taint = torch.zeros(width, dtype=torch.bool, device=DEV)
        for i in range(m.d.num_layers):
            taint |= near_ties(m, i, rec.log[i]["k2_out"]["residual"].float())
            taint |= near_ties(m, i, rec_ref.log[i]["k2_out"]["residual"].float())
        free.append(free_run_metrics(h, plan, req, pos, inp, before, out, taint))
    return worst, free


# --------------------------------------------------------------------------------- GPU tests


@pytest.fixture(scope="module")
def harness():
    if not CUDA:
        pytest.skip("needs a CUDA device")
    from mono_ext.models.qwen3_next.triton.backend import TritonBuilder

    h = Harness(Model(model_config()), TritonBuilder())
    yield h
    torch.cuda.synchronize()


def _jit_sizes():
    from mono_ext.models.qwen3_next.triton.k1 import k1_attn_kernel, k1_gdn_kernel
    from mono_ext.models.qwen3_next.triton.k2 import k2_kernel
    from mono_ext.runtime.build_cache import jit_cache_size

    return [jit_cache_size(k) for k in (k1_gdn_kernel, k1_attn_kernel, k2_kernel)]


def _healthy(h: Harness) -> None:
    from mono_ext.runtime.health import decode_health

    rt = next(iter(h.fused.values())).runtime
    s = decode_health(rt.state.health.cpu().tolist(), rank=0)
    assert s.ok, s.describe(rt.failstop.name_of)


@gpu
def test_one_runtime_per_deployment(harness):
    from mono_ext.runtime.build_cache import NotBuiltError

    rts = {id(x.runtime) for x in harness.fused.values()}
    assert len(rts) == 1, "every width of a deployment shares one runtime"
    rt = next(iter(harness.fused.values())).runtime
    assert len(rt.cache) == len(WIDTHS)
    print("\nbuilt:", ", ".join(f"{k} ({v.regs_per_thread} regs, {v.shared_bytes} B)"
                                for k, v in rt.compiled.items()))  # fmt: skip
    plan, req, pos, inp = harness.inputs(1, torch.Generator(device=DEV).manual_seed(5), 0)
    harness.run("fused", plan, req, pos, inp)  # the first step seals the build cache
    key = harness.spec.build_key(5)
    ctx = BuildContext(text_config=harness.m.cfg, device=str(DEV), null_slot=NULL, extra=EXTRA)
    with pytest.raises(NotBuiltError):
        harness.builder(key, ctx)
    assert harness.builder(harness.spec.build_key(3), ctx) is harness.fused[3]
    _healthy(harness)


@gpu
@pytest.mark.parametrize("width", WIDTHS)
def test_steps_match_reference_in_lockstep(harness, width):
    n_jit = _jit_sizes()
    tracker = CheckTracker(NUM)
    worst, free = run_width(harness, width, STEPS, tracker)
    torch.cuda.synchronize()
    _healthy(harness)
    print(f"\nwidth {width}: {tracker.summary()}")
    for name, (cos, rl2) in sorted(worst.items()):
        print(f"  {name:18s} worst cosine {cos:.6f}  worst rel_l2 {rl2:.2e}")
    for t, f in enumerate(free):
        line = ", ".join(
            f"{k} cos {v['cosine']:.6f} rel_l2 {v['rel_l2']:.2e}" for k, v in f.items()
        )
        print(f"  free-running step {t}: {line or 'every live row near a router tie'}")
        for k, v in f.items():
            assert v["cosine"] > 0.99, f"free-running step {t}: {k} {v}"
    assert not tracker.problems(), tracker.problems()
    assert _jit_sizes() == n_jit, "a launch compiled after build"


@gpu
@pytest.mark.parametrize("width", WIDTHS)
def test_graph_replay_matches_eager(harness, width):
    """The whole step (epoch bump, every K1/K2, the attention callback) captured once; each
    replay from the same caches is bit-identical to an eager step."""
    h, m = harness, harness.m
    n_jit = _jit_sizes()
    plan, req, pos, inp = h.inputs(width, torch.Generator(device=DEV).manual_seed(77), 0)
    start = m.snapshot("fused")
    eager = h.run("fused", plan, req, pos, inp)
    after = m.snapshot("fused")
    attend = m.attend("fused", req, pos)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hg, rg = h.drv.run(plan, inp, attend)
    for _ in range(2):
        m.load("fused", start)
        hg.fill_(float("nan"))
        rg.fill_(float("nan"))
        graph.replay()
        h.drv.launches[width].end_step(replayed=True)  # what an engine does after each replay
        torch.cuda.synchronize()
        assert torch.equal(hg, eager[0]) and torch.equal(rg, eager[1])
        for i, ts in m.caches["fused"].items():
            for t, s in zip(ts, after[i], strict=True):
                assert torch.equal(t, s), f"layer {i}: caches after replay != after eager"
    assert h.drv.launches[width].inner.release()
    _healthy(h)
    assert _jit_sizes() == n_jit, "capture or replay compiled a launch"
    del graph


@gpu
def test_failed_wait_stops_every_step():
    """A wait that gave up (the sticky failed word) makes the step raise, and every later one."""
    from mono_ext.models.qwen3_next.triton.backend import TritonBuilder
    from mono_ext.runtime.failstop import FailStopError
    from mono_ext.runtime.health import H_FAILED

    cfg = model_config(layers=2)  # two GDN layers are enough
    cfg["layer_types"] = ["linear_attention"] * 2
    h = Harness(Model(cfg, seed=3), TritonBuilder(), widths=(2,))
    rt = h.fused[2].runtime
    plan, req, pos, inp = h.inputs(2, torch.Generator(device=DEV).manual_seed(9), 0)
    h.run("fused", plan, req, pos, inp)
    assert rt.release()
    rt.state.health[H_FAILED] = 1  # as a wait that gave up leaves it: later waits bail out
    with pytest.raises(FailStopError):
        h.run("fused", plan, req, pos, inp)
        # the engine asks only once it holds the step's tokens, so the step's health copy,
        # enqueued before them on the same stream, has landed: the synchronize stands in
        torch.cuda.synchronize()
        rt.release()
    with pytest.raises(FailStopError):
        h.run("fused", plan, req, pos, inp)
    torch.cuda.synchronize()


@gpu
def test_probe_and_target():
    from mono_ext.plugins import triton as plugin

    (backend,) = plugin.mono_ext_kernel_backends()
    assert backend.target == "mono_ext.models.qwen3_next.triton.backend:build"
    assert isinstance(load_target(backend.target), LaunchBuilder)
    ok, why = backend.probe()
    print(f"\nprobe: {ok} {why}")
    if torch.cuda.get_device_capability() == (9, 0):
        assert ok, why


# ---------------------------------------------------------------------- refusals (no GPU)


def _reasons(**over) -> list[str]:
    from mono_ext.models.qwen3_next.triton.backend import TritonBuilder

    cfg = model_config()
    layouts = dict(LAYOUTS)
    tp = over.pop("tp", 1)
    dtype = over.pop("dtype", "bfloat16")
    layouts.update(over.pop("layouts", {}))
    cfg.update(over)
    return TritonBuilder().refusals(ConfigView(cfg, tp_size=tp, dtype=dtype), layouts)


def test_refusals_name_every_reason():
    assert _reasons() == []
    assert _reasons(tp=2) and "TP 2" in _reasons(tp=2)[0]
    why = _reasons(dtype="float16", linear_key_head_dim=96, layouts={"ssm_layout": "xy"})
    assert len(why) >= 3, why
    assert any("float16" in r for r in why)
    assert any("Dk=96" in r for r in why)
    assert any("ssm_layout" in r for r in why)
    assert any("dense" in r for r in _reasons(mlp_only_layers=[1]))
    assert any("mamba_ssm_dtype" in r for r in _reasons(mamba_ssm_dtype="float16"))


def test_builds_only_for_cuda_and_tp1():
    from mono_ext.core.spec import BuildKey
    from mono_ext.models.qwen3_next.triton.backend import TritonBuilder

    key = BuildKey("qwen3_next", "triton", 4, "bfloat16", 1, tuple(sorted(LAYOUTS.items())))
    with pytest.raises(ValueError, match="CUDA"):
        TritonBuilder()(key, BuildContext(text_config=model_config(), device="cpu"))
    tp2 = BuildKey("qwen3_next", "triton", 4, "bfloat16", 2)
    with pytest.raises(ValueError, match="TP 1"):
        TritonBuilder()(tp2, BuildContext(text_config=model_config(), device="cuda"))
