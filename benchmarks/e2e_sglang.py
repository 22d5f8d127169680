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
fit the device's 10-minute call, but always runs the first entry of a call; that driver is
``_e2e_runner.py``, shared with ``e2e_vllm.py``):

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
  arguments and environment it was started with;
* with ``--profile-gpu``, per batch the device's busy and idle time per decode step and its
  kernels, from SGLang's own profiler (``Engine.start_profile``), which runs in the scheduler
  process where the model's device work is (a profiler in this process sees none of it; for
  the same reason ``--profile-steps`` is refused).

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
import functools
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
CPU_STANDINS = HERE.parent / "_sglang_cpu"
sys.path.insert(0, str(HERE.parent))  # _e2e_math, _e2e_runner: loaded by path in the unit test
import _e2e_runner as runner  # noqa: E402
from _e2e_math import accuracy_rows, tpot_rows  # noqa: E402
from _e2e_runner import cut_config, make_prompts, preset_dims  # noqa: E402, F401

GRAPH_BS = [1, 2, 4, 8, 16]
MODELS = {  # --model: (H200 preset, CPU smoke preset)
    "next": ("qwen3-next-80b-a3b", "qwen3-next-tiny"),
    "q35": ("qwen3.5-35b-a3b", "qwen3.5-moe-tiny"),
}


def names(model: str) -> tuple[str, str, str]:
    stem = "e2e_sglang" if model == "next" else f"e2e_sglang_{model}"
    return f"{stem}.json", f"{stem}.csv", f"{stem}.png"


# ----------------------------------------------------------------------------------------
# plan, estimates, engine arguments (pure: tests/tools/test_e2e_sglang_bench.py)
# ----------------------------------------------------------------------------------------
def build_plan(layers: list[int], order: list[str]) -> list[dict[str, Any]]:
    """``bw``, then per layer count the arms in ``order`` (repeat k of an arm is its k-th
    occurrence): ids ``L<n>/<arm>/<k>``, as e2e_vllm's offline entries."""
    return [{"id": "bw", "kind": "bw"}, *runner.offline_entries(layers, order)]


#: engine start, s: the first of a call (Triton/FLA autotuning and JIT into cold caches), a
#: later one, and the extra of an arm's first start at a layer count. On one H100 at 8 and 16
#: layers (docs/results/e2e_sglang_h100.json, ``runs.*.seconds.up``) they took 164, 62-72 and
#: about 25 s (ENGINES.md gives ~8 min for a first start of an 8-layer model on the H200, an
#: older bundle). Kept above the measured ones: a call that starts an entry it cannot finish
#: loses the entry.
START_S = {"cold": 240.0, "warm": 90.0, "new_arm": 30.0}


def estimate_entry_s(e: dict[str, Any], a: argparse.Namespace, warm: set[str]) -> float:
    """Rough device seconds of one entry: engine start (:data:`START_S`) plus the generate
    calls at vLLM-stock-like step times."""
    if e["kind"] == "bw":
        return 20.0
    if a.cpu_smoke:
        return 120.0
    n = e["layers"]
    key = f"{e['arm']}/{n}"
    start = START_S["warm" if warm else "cold"] + 1.5 * n
    start += START_S["new_arm"] if key not in warm else 0.0
    warm.add(key)
    s = start
    for b in a.batches:
        step = 1.5e-3 + n * runner.STOCK_SLOPE_US.get(b, 333) * 1e-6
        prefill = 0.05 + b * a.prompt_len * n * 2e-7
        gens = a.reps * ((a.n1 + a.n2) * step + 2 * prefill) + 8 * step + prefill
        s += gens + a.acc_tokens * step * 1.5 + prefill
    return s


def write_config(root: Path, preset: str, n_layers: int, *, cpu: bool = False) -> Path:
    """An HF config dir (no weights: ``load_format="dummy"``) for ``preset`` cut to n."""
    from mono_ext.tools.checkpoint import checkpoint_config

    path = root / f"{preset}-L{n_layers}{'-cpu' if cpu else ''}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = checkpoint_config(cut_config(preset, n_layers, cpu=cpu), num_layers=n_layers)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


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
    return runner.pythonpath(parts, inherited)


def full_layers_of(dims: Any) -> int:
    return int(dims.num_layers)


# ----------------------------------------------------------------------------------------
# subprocess workers (one engine each)
# ----------------------------------------------------------------------------------------
def worker_bw(spec: dict[str, Any]) -> dict[str, Any]:
    return runner.worker_bw(spec, ("sglang", "sgl-kernel", "sglang-kernel", "flashinfer-python"))


def worker_offline(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.time()
    import sglang

    runner.announce_arm(spec, f"Engine(monokernel=True, monokernel_backend={spec['backend']!r})")
    engine = sglang.Engine(**spec["engine"])
    up = runner.up_since(t0, spec)
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

    def scheduler_events(fn: Any) -> list[tuple[str, float, float]]:
        """``fn()`` under SGLang's own torch.profiler, which runs in the scheduler process,
        where the model's device work is: the device events of the trace it exports."""
        out = Path(spec["report_dir"] + ".gpu_profile")
        shutil.rmtree(out, ignore_errors=True)
        engine.start_profile(output_dir=str(out), activities=["GPU"], profile_id="e2e")
        try:
            fn()
        finally:
            engine.stop_profile()
        traces = sorted(out.glob("*.trace.json*"))
        if len(traces) != 1:  # TP 1: one scheduler, one trace
            raise RuntimeError(f"SGLang's profiler wrote {len(traces)} traces into {out}, not 1")
        events = runner.chrome_device_events(traces[0])
        shutil.rmtree(out, ignore_errors=True)
        return events

    batches = {}
    try:
        for b in spec["batches"]:
            prompts = spec["prompts"][:b]
            gen(prompts, 8)
            on_cpu = spec["engine"].get("device") == "cpu"  # no device work to profile
            row = runner.time_batch(spec, gen, prompts, b, None if on_cpu else scheduler_events)
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


WORKERS = {"offline": worker_offline, "bw": worker_bw}


# ----------------------------------------------------------------------------------------
# orchestration
# ----------------------------------------------------------------------------------------
def entry_spec(e: dict[str, Any], a: argparse.Namespace, work: Path) -> tuple[dict, dict]:
    """(spec for the worker, extra environment) of one plan entry."""
    spec = runner.entry_spec(e, a)
    if e["kind"] == "bw":
        return spec, {}
    stem = runner.entry_stem(work, e)
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
    # the off arm: only the Engine argument turns mono_ext on; nothing inherited may
    unset = ("MONO_EXT_SERVE_UNMEASURED", "MONO_EXT_SGLANG_MONOKERNEL")
    env = runner.entry_env(env_extra, e, functools.partial(entry_pythonpath, a), unset)
    res = runner.spawn_entry(HERE, e, spec, env, work, a.entry_timeout_s, own_session=True)
    if res["ok"] and e["kind"] == "offline":
        res["engine"] = spec["engine"]
        res["env"] = env_extra
    return res


# ----------------------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------------------
def summarize(data: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    runs = runner.ok_runs(data)
    dims = preset_dims(a.preset)
    bw = runner.copy_bw(runs)
    ssm_dtype = runner.first_found(
        runs, lambda r: (r.get("report") or {}).get("build_extra", {}).get("ssm_dtype")
    )
    # SGLang's MambaPool keeps the recurrent state in fp32 unless told otherwise
    state_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(ssm_dtype or "float32", 4)
    ctx = a.prompt_len + (a.n1 + a.n2) / 2
    rows = tpot_rows(runner.offline_tpot(runs), dims, bw=bw, ctx=ctx, state_bytes=state_bytes)
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
                # mono_ext's own host time per step by hook (us per call; runtime.host_timer)
                "host_us",
                "host_us_median",
                "host_calls",
                "host_profile",  # under MONO_EXT_PROFILE_HOST=1 only
            )
        }
        for k, r in runs.items()
        if r["entry"]["kind"] == "offline" and r["entry"]["arm"] == "on"
    }
    return {
        "tpot": rows,
        "accuracy": accuracy_rows(runs),
        "routed": routed,
        "gpu_profile": runner.gpu_profile_rows(runs),
        "gpu_profile_fit": runner.gpu_profile_fit_rows(runs),
        "failed": runner.failed_runs(data),
        "floor_model": runner.floor_model(
            bw, ssm_dtype or "float32 (assumed: SGLang's default)", ctx
        ),
    }


def print_tables(s: dict[str, Any]) -> str:
    """The shared tables, then SGLang's routing counts (its report's keys, not vLLM's)."""
    text = runner.print_tables({**s, "routed": {}})
    for k, v in s["routed"].items():
        line = (
            f"routed {k}: state {v['state']} replayed_steps {v['replayed_steps']} "
            f"stock_decode {v['stock_decode']} released {v['released']} "
            f"host_us_median {v.get('host_us_median')}"
        )
        print(line, flush=True)
        text += "\n" + line
    return text


def finish(data: dict[str, Any], a: argparse.Namespace) -> None:
    data["summary"] = summarize(data, a)
    meta = data.get("meta", {})
    title = (
        f"SGLang e2e, {a.preset}: flag off vs --monokernel-backend {a.backend}; "
        f"{meta.get('device', '?')}; {meta.get('commit', '?')}; "
        f"{', '.join(f'{k} {v}' for k, v in (meta.get('versions') or {}).items())}"
    )
    runner.write_results(data, a.out, names(a.model), title, print_tables)


# ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runner.add_head_args(
        p,
        "batches 1,4,16, order off,on, reps 5",
        "SGLang's CPU build, tiny preset, reference",
    )
    p.add_argument("--model", choices=sorted(MODELS), default="next")
    runner.add_selection_args(p)
    runner.add_decode_args(p)
    p.add_argument("--mem-fraction", type=float, default=0.88, help="SGLang mem_fraction_static")
    p.add_argument("--backend", default=None, help="mono_ext backend of the on arm (triton)")
    runner.add_call_args(p, entry_timeout_s=None)
    a = p.parse_args(argv)
    if a.profile_steps:
        p.error(
            "--profile-steps: SGLang runs the model in its scheduler process, which a cProfile "
            "of this one does not see (--profile-gpu profiles there, through SGLang's profiler)"
        )
    runner.apply_defaults(a, runner.DECODE_DEFAULTS)
    a.preset = MODELS[a.model][1 if a.cpu_smoke else 0]
    runner.fit_context(a, max(a.n2, a.acc_tokens))
    if a.entry_timeout_s is None:
        # a worker killed before the device's own limit still leaves the results file whole
        a.entry_timeout_s = a.call_budget_s + 40 if a.call_budget_s else 1800.0
    return a


def bench(a: argparse.Namespace) -> runner.Bench:
    where = "SGLang CPU smoke" if a.cpu_smoke else f"H200, {a.preset} shapes"
    return runner.Bench(
        script="benchmarks/e2e_sglang.py",
        json_name=names(a.model)[0],
        plan=build_plan(a.layers, a.order),
        estimate_entry_s=estimate_entry_s,
        run_entry=run_entry,
        finish=finish,
        estimate_fmt="estimated ~{min:.1f} min (" + where + ")",
        id_width=16,
        provenance=True,
        first_always=True,
        rc_incomplete=True,
    )


def main(argv: list[str] | None = None) -> int:
    return runner.main(argv, WORKERS, parse_args, bench)


if __name__ == "__main__":
    sys.exit(main())
