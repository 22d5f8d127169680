"""benchmarks/bench_handoff.py on the CPU: both arms of its kernel compile for sm_90a at every
shape it times (each arm on the protocol it names), and its latency is each CTA's seen time
minus the last writer's store."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("offline sm_90a compiles need the compiler", allow_module_level=True)

from mono_ext.kernels.triton.offline import compile_offline  # noqa: E402
from mono_ext.runtime.peers import RankState  # noqa: E402

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_handoff.py"
_spec = importlib.util.spec_from_file_location("bench_handoff", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_latency_is_seen_minus_the_last_store():
    # four CTAs, the last two write (at 5000 and 7000 ns); each sees at its own time
    stamps = [[0, 9000], [0, 7500], [5000, 8000], [7000, 12000]]
    assert bench.latencies_us(stamps, writers=2) == [2.0, 0.5, 1.0, 5.0]
    assert bench.latencies_us(stamps, writers=1) == [2.0, 0.5, 1.0, 5.0]
    assert bench.latencies_us(stamps, writers=3) == [2.0, 0.5, 1.0, 5.0]
    stamps[1][0] = 8000  # a third writer stored last
    assert bench.latencies_us(stamps, writers=3) == [1.0, -0.5, 0.0, 4.0]


@pytest.mark.parametrize("counter", [False, True], ids=["tagged", "counter"])
@pytest.mark.parametrize("shape", bench.SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_arms_compile_for_sm90(shape, counter):
    rows, cols, writers, live = shape
    st = RankState.create(0, "cpu", 1.0)
    words = torch.zeros(rows * cols, dtype=torch.int64)
    data = torch.zeros(rows * cols, dtype=torch.int32)
    ctr = torch.zeros(1, dtype=torch.int32)
    t = torch.zeros(132, 3, dtype=torch.int64)
    args = (words, data, ctr, t, st.ctrl, st.health, writers, 20000)
    cx = {"R": rows, "C": cols, "LIVE": live, "COUNTER": counter, "num_warps": 4}
    try:
        ptx = compile_offline(bench._broadcast_kernel, args, cx, 90).asm["ptx"]
    except Exception as e:  # no ptxas / no NVIDIA backend in this Triton
        pytest.skip(f"Triton cannot compile for sm_90a here: {e!r}")
    if counter:  # one release increment per writer, polled with volatile loads
        assert "atom.global.gpu.release.add" in ptx
        assert "fence.acq_rel.gpu" in ptx
    else:  # tagged 64-bit stores, awaited by the tree's bounded wait
        assert "st.relaxed.gpu.global.b64" in ptx
        assert "ld.volatile.global.b64" in ptx
