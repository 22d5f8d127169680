"""CUDA-event timing shared by the kernel and layer benchmarks (bench_k2.py, bench_layer.py):
a body captured in one CUDA graph and replayed, and the device-to-device copy bandwidth that
their percentages of HBM are taken against."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def event_times_us(fn: Callable[[], object], reps: int) -> list[float]:
    """Microseconds of each of ``reps`` calls of ``fn``, between CUDA events around it."""
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return times


def graph_times_us(body: Callable[[], object], reps: int) -> list[float]:
    """``body`` run once (compiles, module loads, workspaces), captured in one CUDA graph,
    replayed three times untimed, then ``reps`` timed replays: microseconds of each."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = event_times_us(graph.replay, reps)
    del graph
    return times


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy of ``nbytes`` random bytes: bytes read + written per second
    (median of ``reps``)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    for _ in range(3):
        b.copy_(a)
    us = statistics.median(event_times_us(lambda: b.copy_(a), reps))
    return 2 * nbytes / (us * 1e-6)
