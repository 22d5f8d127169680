"""SGLang 0.5.17 end to end, flag off vs ``--monokernel`` (``--monokernel-backend triton``), on
the H200.

A Qwen3-Next-80B-A3B-shaped model (``--model next``: the ``qwen3-next-80b-a3b`` preset of
``mono_ext.models.qwen3_next.configs``, ``num_hidden_layers`` and ``layer_types`` cut to 16 and
32 layers, every 4th full attention), or a Qwen3.5-35B-A3B-shaped one (``--model q35``: the
``qwen3.5-35b-a3b`` preset, contiguous qkvz packing, cut the same way), served by SGLang's
offline ``sglang.Engine`` with ``load_format="dummy"`` and no tokenizer
(``skip_tokenizer_init``, token-id prompts through ``input_ids=``), decode CUDA graphs of
batch sizes 1, 2, 4, 8, 16 (prefill graphs off), the overlap scheduler (SGLang's default),
``attention_backend="triton"``, ``sampling_backend="pytorch"``, no grammar, no radix cache
(every prompt prefills the same way in both arms) and ``disable_shared_experts_fusion`` (on
CUDA SGLang otherwise folds the shared expert into the routed experts as an extra slot, which
mono_ext does not read), as ``tests/engines/sglang/test_sglang_gpu.py`` runs the tiny models.

    python benchmarks/e2e_sglang.py --out DIR [--quick] [--model next|q35] [selection]

What one command does (every engine in its own subprocess, its scheduler in another as SGLang
starts it, so GPU memory is freed between them; results merge into ``DIR/e2e_sglang.json``
(``e2e_sglang_q35.json`` for ``--model q35``) after each one, so a later call with the same
``--out`` runs only what is missing; ``--call-budget-s`` stops before an entry that would not
fit the device's 10-minute call, but always runs the first entry of a call):

1. ``bw``: device-to-device copy bandwidth (read + write bytes / time), versions, device.
2. per layer count, arms interleaved ``off, on, on, off`` (``--order``). The ``on`` arm passes
   ``Engine(monokernel=True, monokernel_backend="triton")`` (what ``--monokernel-backend
   triton`` sets on the CLI) and sets ``MONO_EXT_SERVE_UNMEASURED=1`` (the triton backend
   serves no width by default until measured faster than stock); the ``off`` arm runs with
   ``MONO_EXT_SGLANG_MONOKERNEL`` removed from the environment, so only the argument turns it
   on. Per batch B in 1,2,4,8,16 (B requests of ``--prompt-len`` random token ids, the same ids
   in every arm): TPOT by the delta method ``(min T(N2) - min T(N1)) / (N2 - N1)`` (T: wall
   time of one ``Engine.generate`` of the B requests with ``max_new_tokens`` N and
   ``ignore_eos``; min over ``--reps``; prefill cancels). Then one greedy run of
   ``--acc-tokens`` tokens with ``return_logprob`` and ``top_logprobs_num=--logprobs`` for the
   accuracy comparison. Each engine's scheduler writes mono_ext's report
   (``Engine.collective_rpc("mono_ext_report")``: state, refusals, captured and replayed
   graphs, stock decode steps, FailStop), kept with the run.

Reported (printed, the JSON's ``summary``, ``.csv``, ``.png`` when matplotlib is importable),
with the math of ``benchmarks/_e2e_math.py`` shared with ``e2e_vllm.py`` and its row format
(``summary.tpot``: ``arm``, ``batch``, ``tpot_L<n>_ms``, ``per_layer_us``, ``intercept_ms``,
``tpot_L48_ms``, ``floor_per_layer_us``, ``floor_fraction``, ``floor_L48_ms``):

* per arm and batch: TPOT at each layer count (median over the arm's runs), the per-layer cost
  = slope of TPOT over layers (least squares), the intercept, and TPOT at the preset's full
  depth (48 layers for 80B-A3B; ``tpot_L48_ms`` holds it, ``full_layers`` says 40 for the
  35B-A3B);
* the bandwidth floor per layer and its fraction reached (floor / measured slope), bytes as in
  ``e2e_vllm.py`` (dense weights, expected distinct routed experts, GDN state read + written
  per row in the pool's state dtype, fp32 in SGLang unless the report says otherwise, KV read
  per row at the mean context of the N2 run), time = bytes / copy bandwidth;
* accuracy of the same runs: greedy agreement of each run with the first ``off`` run of its
  layer count and KL(off || on) of the top-k logprobs at the decode positions with the same
  context (``on`` vs ``on`` and ``off`` vs ``off`` repeats as the noise floor);
* provenance (``benchmarks/_provenance.py``): device, date, commit, command; per run the Engine
  arguments and environment it was started with.

Dummy weights: SGLang fills every parameter uniform in +-1e-3, identical in both arms. On
CUDA every floating parameter is scaled in place by ``--weight-scale`` (16) in each scheduler
right after graph capture, before any request (``_sglang_scale.py``, through SGLang's
``forward_hooks`` factories), in both arms; graphs keep their pointers and mono_ext reads the
engine's tensors in place.

``--cpu-smoke``: the same code paths on SGLang's CPU build (``SGLANG_USE_CPU_ENGINE=1``,
``device="cpu"``, ``attention_backend="torch_native"``, no CUDA graphs) with the tiny preset
(``qwen3-next-tiny``/``qwen3.5-moe-tiny``, 4 and 8 layers, batches 1 and 2, few tokens, the
``reference`` backend, weights scaled too). The CPU venv has no ``sgl_kernel``: the folder
``benchmarks/_sglang_cpu`` goes on the engine's PYTHONPATH with plain-torch stand-ins for the
ops SGLang's CPU path calls (its ``sitecustomize`` patches the Triton-only ones in every
SGLang process). SGLang's CPU build pads intermediate sizes to multiples of 32, which the
tiny preset's shared expert (48) is not: the smoke config rounds it up so mono_ext binds. The
timings and the accuracy there mean nothing (the stand-ins are not SGLang's kernels).

How to run on the H200 (device calls back to back; /tmp on the device lives only while the
machine stays warm, so results go to /tmp/e2e_sgl and are copied to $OUT after every call):

    bash tools/gpu/run_sglang_e2e.sh prepare            # here, once
    bash tools/gpu/run_sglang_e2e.sh install            # device call 1, carry the bundle
    bash tools/gpu/run_sglang_e2e.sh bench --quick      # device calls 2..: same command,
                                                        # resumes from /tmp/e2e_sgl

``--estimate`` prints the plan with estimated seconds per entry and exits. If the machine
went cold between calls, carry the last JSON back (an ignored path) and pass it with
``--resume-from``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
CPU_STANDINS = HERE.parent / "_sglang_cpu"
sys.path.insert(0, str(HERE.parent))
from _e2e_math import (  # noqa: E402
    accuracy_rows,
    delta_tpot,
    kinds_for,
    merge,
    select,
    tpot_rows,
)

ORDER = ("off", "on", "on", "off")
GRAPH_BS = [1, 2, 4, 8, 16]
MODELS = {  # --model: (H200 preset, CPU smoke preset)
    "next": ("qwen3-next-80b-a3b", "qwen3-next-tiny"),
    "q35": ("qwen3.5-35b-a3b", "qwen3.5-moe-tiny"),
}
# vLLM's stock per-layer us on the H200 (ENGINES.md), for the plan's time estimates only
_SLOPE_US = {1: 79, 2: 118, 4: 152, 8: 238, 16: 333}


def names(model: str) -> tuple[str, str, str]:
    stem = "e2e_sglang" if model == "next" else f"e2e_sglang_{model}"
    return f"{stem}.json", f"{stem}.csv", f"{stem}.png"


# ----------------------------------------------------------------------------------------
# plan, estimates, engine arguments (pure: tests/tools/test_e2e_sglang_bench.py)
# ----------------------------------------------------------------------------------------
def build_plan(layers: list[int], order: list[str]) -> list[dict[str, Any]]:
    """``bw``, then per layer count the arms in ``order`` (repeat k of an arm is its k-th
    occurrence): ids ``L<n>/<arm>/<k>``, as e2e_vllm's offline entries."""
    plan: list[dict[str, Any]] = [{"id": "bw", "kind": "bw"}]
    for n in layers:
        seen: dict[str, int] = {}
        for arm in order:
            rep = seen.get(arm, 0)
            seen[arm] = rep + 1
            plan.append({"id": f"L{n}/{arm}/{rep}", "kind": "offline", "layers": n, "arm": arm})
    return plan


def estimate_entry_s(e: dict[str, Any], a: argparse.Namespace, warm: set[str]) -> float:
    """Rough device seconds of one entry: engine start (cold: Triton/FLA autotuning and JIT,
    ~8 min for the first engine on the H200 per ENGINES.md; warm: caches reused) plus the
    generate calls at vLLM-stock-like step times."""
    if e["kind"] == "bw":
        return 20.0
    if a.cpu_smoke:
        return 120.0
    n = e["layers"]
    key = f"{e['arm']}/{n}"
    start = (150.0 if warm else 420.0) + (60.0 if key not in warm else 0.0) + 1.5 * n
    warm.add(key)
    s = start
    for b in a.batches:
        step = 1.5e-3 + n * _SLOPE_US.get(b, 333) * 1e-6
        prefill = 0.05 + b * a.prompt_len * n * 2e-7
        gens = a.reps * ((a.n1 + a.n2) * step + 2 * prefill) + 8 * step + prefill
        s += gens + a.acc_tokens * step * 1.5 + prefill
    return s


def cut_config(preset: str, n_layers: int, *, cpu: bool = False) -> dict[str, Any]:
    """The preset cut to ``n_layers`` (every ``full_attention_interval``-th layer full
    attention). ``cpu``: intermediate sizes rounded up to multiples of 32, as SGLang's CPU
    build pads them at load (a padded plane would not match the config mono_ext reads)."""
    from mono_ext.models.qwen3_next.configs import get_preset

    cfg = get_preset(preset)
    cfg["num_hidden_layers"] = n_layers
    cfg["layer_types"] = kinds_for(n_layers, int(cfg.get("full_attention_interval", 4)))
    if cpu:
        for k in ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size"):
            if cfg.get(k):
                cfg[k] = -(-int(cfg[k]) // 32) * 32
    return cfg


def write_config(root: Path, preset: str, n_layers: int, *, cpu: bool = False) -> Path:
    """An HF config dir (no weights: ``load_format="dummy"``) for ``preset`` cut to n."""
    from mono_ext.tools.checkpoint import checkpoint_config

    path = root / f"{preset}-L{n_layers}{'-cpu' if cpu else ''}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = checkpoint_config(cut_config(preset, n_layers, cpu=cpu), num_layers=n_layers)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def make_prompts(rows: int, length: int, vocab: int) -> list[list[int]]:
    """Row r's prompt depends only on r (the same ids in every arm and batch)."""
    out = []
    for r in range(rows):
        rng = random.Random(1000 + r)
        out.append([rng.randrange(3, vocab - 1) for _ in range(length)])
    return out


def engine_kwargs(
    a: argparse.Namespace, model_dir: Path, arm: str, record: Path | None = None
) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments of one arm."""
    kw: dict[str, Any] = dict(
        model_path=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        sampling_backend="pytorch",
        grammar_backend="none",
        disable_radix_cache=True,
        disable_shared_experts_fusion=True,
        max_running_requests=max(16, max(a.batches)),
        context_length=a.max_model_len,
        random_seed=0,
        log_level="info",
    )
    if a.model == "q35":
        kw["enable_multimodal"] = False
    if a.cpu_smoke:
        kw.update(
            device="cpu",
            attention_backend="torch_native",
            disable_cuda_graph=True,
            mem_fraction_static=0.5,
            max_total_tokens=4096,
        )
    else:
        kw.update(
            attention_backend="triton",  # FA3 is not in the device bundle
            mem_fraction_static=a.mem_fraction,
            cuda_graph_bs_decode=GRAPH_BS,
            disable_prefill_cuda_graph=True,
        )
    if a.weight_scale != 1.0:
        kw["forward_hooks"] = [
            {
                "name": "mono_ext_e2e_weight_scale",
                "target_modules": ["lm_head"],
                "hook_factory": "_sglang_scale:factory",
                "config": {"scale": a.weight_scale, "record": str(record) if record else None},
            }
        ]
    if arm == "on":
        kw.update(monokernel=True, monokernel_backend=a.backend)
    return kw


def arm_env(a: argparse.Namespace, arm: str) -> dict[str, str]:
    """Environment of one arm's engine (added to the caller's; PYTHONPATH is set apart)."""
    env = {"MONO_EXT_CHECK": "0", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if arm == "on":
        env["MONO_EXT_SERVE_UNMEASURED"] = "1"
    if a.cpu_smoke:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


def entry_pythonpath(a: argparse.Namespace, inherited: str) -> str:
    """mono_ext's source, this folder (``_sglang_scale`` for the schedulers), the CPU
    stand-ins in smoke mode, then what the caller had."""
    parts = [str(REPO / "src"), str(HERE.parent)]
    if a.cpu_smoke:
        parts.append(str(CPU_STANDINS))
    return os.pathsep.join(parts + [p for p in inherited.split(os.pathsep) if p])


def full_layers_of(dims: Any) -> int:
    return int(dims.num_layers)


# ----------------------------------------------------------------------------------------
# subprocess workers (one engine each)
# ----------------------------------------------------------------------------------------
def worker_bw(spec: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata as md

    import e2e_vllm

    out = e2e_vllm.worker_bw(spec)
    for pkg in ("sglang", "sgl-kernel", "sglang-kernel", "flashinfer-python"):
        with contextlib.suppress(md.PackageNotFoundError):
            out["versions"][pkg] = md.version(pkg)
    return out


def worker_offline(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.time()
    import sglang

    if spec["arm"] == "on":
        print(
            f"[e2e] arm 'on': Engine(monokernel=True, monokernel_backend={spec['backend']!r}), "
            "MONO_EXT_SERVE_UNMEASURED=1 (routes widths not yet measured faster than stock)",
            flush=True,
        )
    engine = sglang.Engine(**spec["engine"])
    up = time.time() - t0
    print(f"[e2e] engine up in {up:.1f}s ({spec['id']})", flush=True)
    scaled = None
    rec = spec.get("scale_record")
    if rec and Path(rec).exists():
        scaled = json.loads(Path(rec).read_text())
        print(f"[e2e] weights scaled in the scheduler: {scaled}", flush=True)
    elif spec["engine"].get("forward_hooks"):
        raise RuntimeError("weight scale asked for, but the scheduler did not record it")

    def gen(prompts: list[list[int]], n: int, topk: int | None = None) -> tuple[float, Any]:
        params = [dict(temperature=0.0, max_new_tokens=n, ignore_eos=True) for _ in prompts]
        kw: dict[str, Any] = {}
        if topk:
            kw.update(return_logprob=True, top_logprobs_num=topk)
        t = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params, **kw)
        return time.perf_counter() - t, outs

    batches = {}
    try:
        for b in spec["batches"]:
            prompts = spec["prompts"][:b]
            gen(prompts, 8)
            row: dict[str, Any] = {}
            t1, t2 = [], []
            for _ in range(spec["reps"]):
                t1.append(gen(prompts, spec["n1"])[0])
                t2.append(gen(prompts, spec["n2"])[0])
            row.update(
                t_n1=t1, t_n2=t2, tpot_s=delta_tpot(min(t1), min(t2), spec["n1"], spec["n2"])
            )
            print(
                f"[e2e] {spec['id']} bs{b}: TPOT {row['tpot_s'] * 1e3:.3f} ms "
                f"(T{spec['n1']} {min(t1):.3f}s, T{spec['n2']} {min(t2):.3f}s)",
                flush=True,
            )
            _, outs = gen(prompts, spec["acc_tokens"], spec["logprobs"])
            row["tokens"] = [list(o["output_ids"]) for o in outs]
            row["logprobs"] = [
                [{str(t): lp for lp, t, *_ in pos} for pos in o["meta_info"]["output_top_logprobs"]]
                for o in outs
            ]
            batches[str(b)] = row
        report_dir = Path(spec["report_dir"])
        report_dir.mkdir(parents=True, exist_ok=True)
        for f in report_dir.glob("*.json"):
            f.unlink()
        engine.collective_rpc("mono_ext_report", path=str(report_dir))
        reports = [json.loads(f.read_text()) for f in sorted(report_dir.glob("*.json"))]
    finally:
        engine.shutdown()
    rep = reports[0] if reports else {}
    print(
        f"[e2e] mono_ext: state {rep.get('state')} backend {rep.get('backend')} "
        f"refusals {rep.get('refusals')} replayed {rep.get('replayed')} stock_decode "
        f"{rep.get('stock_decode')} released {rep.get('released')} failstop "
        f"{rep.get('failstop')}",
        flush=True,
    )
    return {
        "batches": batches,
        "report": rep,
        "reports": reports,
        "scaled": scaled,
        "seconds": {"up": up, "all": time.time() - t0},
    }


def run_worker(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    fn = {"offline": worker_offline, "bw": worker_bw}[spec["kind"]]
    Path(out_path).write_text(json.dumps(fn(spec), default=str))


# ----------------------------------------------------------------------------------------
# orchestration
# ----------------------------------------------------------------------------------------
def preset_dims(preset: str) -> Any:
    import e2e_vllm

    return e2e_vllm.preset_dims(preset)


def entry_spec(e: dict[str, Any], a: argparse.Namespace, work: Path) -> tuple[dict, dict]:
    """(spec for the worker, extra environment) of one plan entry."""
    spec: dict[str, Any] = {"id": e["id"], "kind": e["kind"], "arm": e.get("arm", "on")}
    if e["kind"] == "bw":
        spec.update(bytes=(64 if a.cpu_smoke else 4096) * 2**20, reps=5)
        return spec, {}
    stem = work / e["id"].replace("/", "_")
    model_dir = write_config(work / "configs", a.preset, e["layers"], cpu=a.cpu_smoke)
    record = stem.with_suffix(".scaled.json")
    record.unlink(missing_ok=True)
    spec.update(
        engine=engine_kwargs(a, model_dir, e["arm"], record),
        scale_record=str(record) if a.weight_scale != 1.0 else None,
        backend=a.backend,
        batches=a.batches,
        prompts=make_prompts(max(a.batches), a.prompt_len, preset_dims(a.preset).vocab),
        n1=a.n1,
        n2=a.n2,
        reps=a.reps,
        acc_tokens=a.acc_tokens,
        logprobs=a.logprobs,
        report_dir=str(stem) + ".reports",
    )
    return spec, arm_env(a, e["arm"])


def run_entry(e: dict[str, Any], a: argparse.Namespace, work: Path) -> dict[str, Any]:
    spec, env_extra = entry_spec(e, a, work)
    stem = work / e["id"].replace("/", "_")
    spec_path, out_path = stem.with_suffix(".spec.json"), stem.with_suffix(".out.json")
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, **env_extra}
    env["PYTHONPATH"] = entry_pythonpath(a, env.get("PYTHONPATH", ""))
    if e.get("arm", "on") == "off":
        # only the Engine argument turns mono_ext on; nothing inherited may
        env.pop("MONO_EXT_SERVE_UNMEASURED", None)
        env.pop("MONO_EXT_SGLANG_MONOKERNEL", None)
    print(f"\n== {e['id']} ({e['kind']}) ==", flush=True)
    t = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE), "--worker", str(spec_path), str(out_path)],
            env=env,
            timeout=a.entry_timeout_s,
            start_new_session=True,
        )
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = 124
    wall = time.time() - t
    if rc != 0 or not out_path.exists():
        return {"ok": False, "rc": rc, "wall_s": wall, "entry": e}
    res = json.loads(out_path.read_text())
    res.update(ok=True, wall_s=wall, entry=e)
    if e["kind"] == "offline":
        res["engine"] = spec["engine"]
        res["env"] = env_extra
    return res


# ----------------------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------------------
def summarize(data: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    runs = {k: v for k, v in data.get("runs", {}).items() if v.get("ok")}
    dims = preset_dims(a.preset)
    bw_run = runs.get("bw")
    bw = bw_run["copy_bw_Bps"] if bw_run else None
    ssm_dtype = next(
        (
            (r.get("report") or {}).get("build_extra", {}).get("ssm_dtype")
            for r in runs.values()
            if (r.get("report") or {}).get("build_extra", {}).get("ssm_dtype")
        ),
        None,
    )
    # SGLang's MambaPool keeps the recurrent state in fp32 unless told otherwise
    state_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(ssm_dtype or "float32", 4)
    tp: dict[tuple[str, int, int], list[float]] = {}
    for r in runs.values():
        e = r["entry"]
        if e["kind"] != "offline":
            continue
        for b, row in r["batches"].items():
            if "tpot_s" in row:
                tp.setdefault((e["arm"], e["layers"], int(b)), []).append(row["tpot_s"])
    ctx = a.prompt_len + (a.n1 + a.n2) / 2
    rows = tpot_rows(tp, dims, bw=bw, ctx=ctx, state_bytes=state_bytes)
    if full_layers_of(dims) != 48:
        for row in rows:
            row["full_layers"] = full_layers_of(dims)
    routed = {
        k: {
            key: (r.get("report") or {}).get(key)
            for key in (
                "state",
                "backend",
                "refusals",
                "captured",
                "replayed",
                "replayed_steps",
                "stock_decode",
                "released",
                "failstop",
            )
        }
        for k, r in runs.items()
        if r["entry"]["kind"] == "offline" and r["entry"]["arm"] == "on"
    }
    failed = {k: v.get("rc") for k, v in data.get("runs", {}).items() if not v.get("ok")}
    return {
        "tpot": rows,
        "accuracy": accuracy_rows(runs),
        "routed": routed,
        "failed": failed,
        "floor_model": {
            "copy_bw_TBps": bw / 1e12 if bw else None,
            "ssm_state_dtype": ssm_dtype or "float32 (assumed: SGLang's default)",
            "distinct_experts": "E * (1 - (1 - k/E)**B)",
            "ctx_mean": ctx,
        },
    }


def print_tables(s: dict[str, Any]) -> str:
    import e2e_vllm

    text = e2e_vllm.print_tables({**s, "server": [], "check": {}, "routed": {}})
    for k, v in s["routed"].items():
        line = (
            f"routed {k}: state {v['state']} replayed_steps {v['replayed_steps']} "
            f"stock_decode {v['stock_decode']} released {v['released']}"
        )
        print(line, flush=True)
        text += "\n" + line
    return text


def write_csv(s: dict[str, Any], path: Path) -> None:
    import e2e_vllm

    e2e_vllm.write_csv({**s, "server": []}, path)


def finish(data: dict[str, Any], a: argparse.Namespace) -> None:
    import e2e_vllm

    json_name, csv_name, png_name = names(a.model)
    s = summarize(data, a)
    data["summary"] = s
    tmp = a.out / (json_name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(a.out / json_name)
    write_csv(s, a.out / csv_name)
    meta = data.get("meta", {})
    title = (
        f"SGLang e2e, {a.preset}: flag off vs --monokernel-backend {a.backend}; "
        f"{meta.get('device', '?')}; {meta.get('commit', '?')}; "
        f"{', '.join(f'{k} {v}' for k, v in (meta.get('versions') or {}).items())}"
    )
    print("\n" + "-" * 80)
    print_tables(s)
    print(e2e_vllm.write_plot(s, a.out / png_name, title), flush=True)


# ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results folder (json/csv/png; resumes)")
    p.add_argument("--quick", action="store_true", help="batches 1,4,16, order off,on, reps 2")
    p.add_argument(
        "--cpu-smoke", action="store_true", help="SGLang's CPU build, tiny preset, reference"
    )
    p.add_argument("--model", choices=sorted(MODELS), default="next")
    p.add_argument("--layers", type=_ints, default=None)
    p.add_argument("--batches", type=_ints, default=None)
    p.add_argument("--order", type=_strs, default=None, help="arm order per layer count")
    p.add_argument("--only", type=_strs, default=None, help="plan ids/globs, e.g. 'L16/*,bw'")
    p.add_argument("--redo", action="store_true", help="rerun entries already in the results")
    p.add_argument("--n1", type=int, default=None)
    p.add_argument("--n2", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--acc-tokens", type=int, default=None)
    p.add_argument("--logprobs", type=int, default=10)
    p.add_argument("--weight-scale", type=float, default=16.0)
    p.add_argument("--mem-fraction", type=float, default=0.88, help="SGLang mem_fraction_static")
    p.add_argument("--backend", default=None, help="mono_ext backend of the on arm (triton)")
    p.add_argument(
        "--call-budget-s", type=float, default=0.0, help="stop before exceeding (0: no limit)"
    )
    p.add_argument("--entry-timeout-s", type=float, default=None)
    p.add_argument("--resume-from", type=Path, default=None, help="merge this results JSON first")
    p.add_argument("--estimate", action="store_true", help="print the plan and estimates only")
    a = p.parse_args(argv)
    smoke, quick = a.cpu_smoke, a.quick

    def d(name: str, full: Any, q: Any, s: Any) -> None:
        if getattr(a, name) is None:
            setattr(a, name, s if smoke else q if quick else full)

    d("layers", [16, 32], [16, 32], [4, 8])
    d("batches", [1, 2, 4, 8, 16], [1, 4, 16], [1, 2])
    d("order", list(ORDER), ["off", "on"], ["off", "on"])
    d("n1", 64, 64, 4)
    d("n2", 320, 320, 12)
    d("reps", 3, 2, 1)
    d("prompt_len", 512, 512, 16)
    d("acc_tokens", 64, 64, 8)
    d("backend", "triton", "triton", "reference")
    a.preset = MODELS[a.model][1 if smoke else 0]
    a.max_model_len = 256 if smoke else 1024
    if a.prompt_len + max(a.n2, a.acc_tokens) + 8 > a.max_model_len:
        a.max_model_len = a.prompt_len + max(a.n2, a.acc_tokens) + 64
    if a.entry_timeout_s is None:
        # a worker killed before the device's own limit still leaves the results file whole
        a.entry_timeout_s = a.call_budget_s + 40 if a.call_budget_s else 1800.0
    return a


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _strs(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        run_worker(argv[1], argv[2])
        return 0
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "work"
    work.mkdir(exist_ok=True)
    jpath = a.out / names(a.model)[0]
    data: dict[str, Any] = {"runs": {}, "meta": {}}
    for src in (a.resume_from, jpath):
        if src and src.exists():
            data = merge(data, json.loads(src.read_text()))
    plan = build_plan(a.layers, a.order)
    done = {k for k, v in data["runs"].items() if v.get("ok")}
    todo = select(plan, a.only, done, a.redo)
    warm: set[str] = set()
    est = [(e, estimate_entry_s(e, a, warm)) for e in todo]
    print(f"plan ({len(plan)} entries, {len(done)} done); to run now ({len(todo)}):")
    for e, s in est:
        print(f"  {e['id']:<16} ~{s / 60:5.1f} min")
    where = "SGLang CPU smoke" if a.cpu_smoke else f"H200, {a.preset} shapes"
    print(f"estimated ~{sum(s for _, s in est) / 60:.1f} min ({where})", flush=True)
    if a.estimate:
        return 0
    from _provenance import provenance

    prov = provenance(data["meta"].get("device", "?"))
    prov["command"] = " ".join(["python", "benchmarks/e2e_sglang.py", *argv])
    call = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": prov["commit"],
        "command": prov["command"],
    }
    data = merge(data, {"meta": {"calls": [call]}})
    data["meta"].update(date=prov["date"], commit=prov["commit"], command=prov["command"])
    t_start, rc = time.time(), 0
    for ran, (e, s) in enumerate(est):
        left = a.call_budget_s - (time.time() - t_start)
        if a.call_budget_s and ran and s > left:
            print(
                f"\n[e2e] stop: {e['id']} needs ~{s:.0f}s, {left:.0f}s left in this call; "
                "rerun the same command to continue",
                flush=True,
            )
            rc = 3
            break
        res = run_entry(e, a, work)
        if not res["ok"]:
            print(f"[e2e] {e['id']} FAILED (rc {res['rc']}); see the log above", flush=True)
            rc = 1
        if e["kind"] == "bw" and res.get("ok"):
            data["meta"].update(device=res["device"], versions=res["versions"])
        data = merge(data, {"runs": {e["id"]: res}})
        data["meta"]["args"] = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
        }
        finish(data, a)
    if not est:
        finish(data, a)
    remaining = select(plan, a.only, {k for k, v in data["runs"].items() if v.get("ok")}, False)
    print(f"\n[e2e] remaining plan entries: {[x['id'] for x in remaining] or 'none'}", flush=True)
    if rc == 0 and remaining:
        rc = 3
    return rc


if __name__ == "__main__":
    sys.exit(main())
