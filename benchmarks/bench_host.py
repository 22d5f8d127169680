"""Host time mono_ext spends per decode step outside the kernels, part by part.

What an engine adapter runs on the host for a step that replays a captured graph (vLLM's FULL
decode graphs, SGLang's decode graphs): ``DecodeDriver.after_step(replayed=True)`` (the
launches' ``end_step``: FailStop counts the step), the ticket queued, taken by the engine's
output object and released at the engine's token await (``FailStop.release`` of that step).
The launches here are the hooks every persistent backend shares (``runtime.persistent``)
over a real :class:`~mono_ext.runtime.failstop.FailStop`: on
CUDA over :class:`~mono_ext.runtime.failstop.CudaHealthSource` with a device health block,
each step a replay of a captured graph holding a small device op and the health copy (as a
decode graph holds the step's launches and the copy), elsewhere over the scripted source (the
Python part only).

    python benchmarks/bench_host.py [--steps N] [--engine-work N] [--json PATH] [--profile PATH]

Prints microseconds per step for each part (median over steps) and, on CUDA, per call of each
device API a step's host path asks or once asked (``calls``: the capture query, the stream
by index, an event's record and query, the pinned health copy, the output storage's address;
the step path now asks only the capture query and the address), and writes
them, with the device, date, commit and command, to ``--json`` (default
``docs/results/host_<device>.json``). ``--profile`` also writes the steps' cProfile, slowest
functions first. ``--engine-work N`` runs N random table reads before each step (untimed),
so the hooks run with caches another program has just used, as they do inside an engine.
The driver asks whether the stream is capturing as it does in the engines.
The engine adapters also time themselves in the engine (``host_us`` in vLLM's worker report,
e.g. ``docs/results/e2e_vllm.json``'s ``summary.routed``); this isolates the parts.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime as dt
import json
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from _provenance import commit  # noqa: E402

from mono_ext.core.spec import BuildKey, Step  # noqa: E402
from mono_ext.runtime.failstop import FailStop, ScriptedHealthSource  # noqa: E402
from mono_ext.runtime.host_timer import HostTimer  # noqa: E402
from mono_ext.runtime.persistent import PersistentLaunches, PersistentRuntime  # noqa: E402
from mono_ext.runtime.release import ReleaseQueue  # noqa: E402


def device_calls(health, n: int) -> dict[str, float]:
    """Median microseconds of one call of each device API the per-step host path asks (the
    runtime and the adapters) or would ask to learn whether a copy landed (an event), each
    called ``n`` times in a row."""
    import torch

    from mono_ext.runtime.device import is_capturing

    index = health.device.index
    stream, event = torch.cuda.current_stream(index), torch.cuda.Event()
    event.record(stream)
    torch.cuda.synchronize()
    mirror = torch.empty_like(health, device="cpu").pin_memory()
    calls = {
        "is_capturing": is_capturing,
        "current_stream(index)": lambda: torch.cuda.current_stream(index),
        "event.record(stream)": lambda: event.record(stream),
        "event.query": event.query,
        "health copy to pinned": lambda: mirror.copy_(health, non_blocking=True),
        "storage data_ptr": lambda: health.untyped_storage().data_ptr(),
        "torch.cuda.is_available": torch.cuda.is_available,
    }
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            call()
            times.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
        out[name] = round(statistics.median(times), 2)
    return out


def engine_work(entries: int, seed: int = 0) -> Callable[[], None]:
    """Stand-in for the engine's own host work between two steps: ``entries`` random reads of
    a 200 000-entry table of Python lists. Inside an engine the hooks run with caches that the
    engine's step preparation has just filled with its own code and data; in a tight loop they
    run hot and look several times cheaper than they are there."""
    rng = random.Random(seed)
    table = {i: [rng.random() for _ in range(8)] for i in range(200_000)}
    keys = list(table)

    def work() -> None:
        s = 0.0
        for k in rng.sample(keys, entries):
            s += table[k][3]

    return work


def run_steps(driver, step, replay, sync, n: int, between=None) -> dict[str, list[float]]:
    """``n`` replayed steps' host work, timed part by part (microseconds per step), as the
    engine adapters run it: ``after_step``, the ticket wrapped as they wrap it (counted once
    released, its release timed) and queued, taken by the step's output object, released at the
    next step's token await. ``replay`` runs the step's graph first; ``sync`` stands for the
    engine's wait for the previous step's tokens (async scheduling releases step n-1 after step
    n is enqueued); ``between`` for the engine's own work before each step (untimed)."""
    queue = ReleaseQueue()
    timer = HostTimer()
    released = collections.Counter()

    def count() -> None:
        released["steps"] += 1

    parts: dict[str, list[float]] = {"after_step": [], "queue": [], "release": [], "total": []}
    pending = None
    for _ in range(n):
        if between is not None:
            between()
        if replay is not None:
            replay()  # the step's device work, behind which its health copy lands
        t0 = time.perf_counter_ns()
        ticket = driver.after_step(step, replayed=True)
        t1 = time.perf_counter_ns()
        queue.add(ticket.then(count).timed(timer))
        taken = queue.take()
        t2 = time.perf_counter_ns()
        if pending is not None:
            if sync is not None:
                sync()
            t3 = time.perf_counter_ns()
            queue.release(pending)
            t4 = time.perf_counter_ns()
            parts["release"].append((t4 - t3) / 1e3)
            parts["total"].append((t2 - t0 + t4 - t3) / 1e3)
        parts["after_step"].append((t1 - t0) / 1e3)
        parts["queue"].append((t2 - t1) / 1e3)
        pending = taken
    if released["steps"] != max(n - 1, 0):
        raise RuntimeError(f"{released['steps']} of {n - 1} released steps counted")
    return parts


class Runtime(PersistentRuntime):
    """The runtime hooks every persistent backend shares, over ``failstop`` (no kernels)."""

    def __init__(self, failstop: FailStop) -> None:
        self.failstop, self.steps = failstop, 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--profile", type=Path, default=None, help="write the steps' cProfile here")
    p.add_argument(
        "--engine-work",
        type=int,
        default=0,
        help="random table reads between steps, standing for the engine's host work (0: none)",
    )
    a = p.parse_args(argv)

    import torch

    from mono_ext.models.qwen3_next.configs import get_preset
    from mono_ext.models.qwen3_next.dims import Dims
    from mono_ext.models.qwen3_next.driver import DecodeDriver
    from mono_ext.models.qwen3_next.launches import BoundLayer

    cuda = torch.cuda.is_available()
    if cuda:
        from mono_ext.runtime.failstop import CudaHealthSource
        from mono_ext.runtime.health import health_init_words

        health = torch.tensor(health_init_words(), dtype=torch.int32, device="cuda")
        source = CudaHealthSource(health)
        work = torch.zeros(1 << 20, device="cuda")
        device = torch.cuda.get_device_name()
    else:
        source, work, device = ScriptedHealthSource(), None, "cpu (scripted health source)"
    key = BuildKey(spec="qwen3_next", backend="triton", width=4, dtype="bfloat16", tp_size=1)
    hooks = PersistentLaunches()
    hooks.key, hooks.runtime = key, Runtime(FailStop(source, agree_every=16))
    replay = None
    if work is not None:  # the step's graph: its device work, then the health copy, as captured
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            work.add_(1.0)
            hooks.health_copy()
        replay = graph.replay
    # one layer of the tiny preset: after_step touches no layer, only the launches' hooks
    dims = Dims.from_config(get_preset("qwen3-next-tiny"))
    layer = BoundLayer(0, "linear_attention", {}, None, None)
    driver = DecodeDriver(
        [layer], {4: hooks}, dims, dtype=torch.bfloat16, device="cpu", null_slot=None, numerics={}
    )
    step = Step(4, key)
    sync = torch.cuda.current_stream().synchronize if cuda else None
    between = engine_work(a.engine_work) if a.engine_work > 0 else None
    parts = run_steps(driver, step, replay, sync, a.steps, between)
    if a.profile:  # a second pass: the profiler's own cost stays out of the times above
        profile = cProfile.Profile()
        profile.enable()
        run_steps(driver, step, replay, sync, a.steps, between)
        profile.disable()
        a.profile.parent.mkdir(parents=True, exist_ok=True)
        with a.profile.open("w") as f:
            pstats.Stats(profile, stream=f).sort_stats("tottime").print_stats(30)
        print(f"wrote {a.profile}")
    us = {k: round(statistics.median(v), 2) for k, v in parts.items()}
    print(f"{device}: host us per step (median of {a.steps}): {us}")
    calls = device_calls(health, a.steps) if cuda else {}
    if calls:
        print(f"{device}: us per call (median of {a.steps}): {calls}")
    out = {
        "device": device,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": " ".join(["python", "benchmarks/bench_host.py", *(argv or sys.argv[1:])]),
        "torch": torch.__version__,
        "steps": a.steps,
        "engine_work": a.engine_work,
        "median_us": us,
        "call_median_us": calls,
        "p90_us": {
            k: round(statistics.quantiles(v, n=10)[-1], 2) for k, v in parts.items() if len(v) > 9
        },
    }
    slug = "".join(c if c.isalnum() else "_" for c in device.split(" (")[0]).strip("_").lower()
    path = a.json or REPO / "docs" / "results" / f"host_{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
