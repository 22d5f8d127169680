"""A virtual rank that never arrives: every other rank's waits give up within deadline + 1 s,
the records name only this kernel's region (and the missing rank's slot), FailStop raises on
all ranks together, and the next launch returns at once."""

import os
import time

import pytest

# virtual TP needs a hardware queue per rank stream; read when CUDA starts
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from mono_ext.kernels.triton.allreduce import VirtualTPAllReduce  # noqa: E402
from mono_ext.runtime.failstop import (  # noqa: E402
    CudaHealthSource,
    FailStopError,
    VirtualFailStop,
)
from mono_ext.runtime.health import decode_health  # noqa: E402

pytestmark = pytest.mark.gpu


def test_stalled_rank_fails_everyone_within_deadline():
    world, stalled, deadline, agree_every = 4, 3, 1.0, 4
    v = VirtualTPAllReduce(world, 2048, grid=4, deadline_s=deadline)
    v.step()  # one healthy step first: compiled, loaded, epochs at 1
    torch.cuda.synchronize()
    fs = VirtualFailStop(
        [CudaHealthSource(s.health) for s in v.peers.ranks],
        agree_every=agree_every,
        name_of=v.ar.layout.describe,
    )
    fs.after_launch(1)
    assert fs.release(1)

    live = [r for r in range(world) if r != stalled]
    v.xs.normal_()
    t = time.perf_counter()
    v.step(ranks=live)  # rank 3 never launches (and never bumps its epoch)
    fs.after_launch(2)
    torch.cuda.synchronize()
    took = time.perf_counter() - t
    assert deadline <= took < deadline + 1.0, took

    region = v.ar.layout.region_id("ar")
    for r in live:
        h = decode_health(v.peers.ranks[r].health.cpu().tolist(), rank=r)
        assert not h.ok and h.records
        for rec in h.records:
            assert rec.region == region, h.describe(v.ar.layout.describe)
            assert rec.rank == r
            assert f"from rank {stalled}," in v.ar.layout.describe(rec.region, rec.index)
    assert decode_health(v.peers.ranks[stalled].health.cpu().tolist(), rank=stalled).ok
    assert not fs.release(2), "tokens of a failed step must not be returned"

    # the next launch returns at once: the sticky failed word makes every wait bail
    t = time.perf_counter()
    v.step(ranks=live)
    torch.cuda.synchronize()
    assert time.perf_counter() - t < 0.2
    fs.after_launch(3)
    assert not fs.release(3)

    with pytest.raises(FailStopError) as err:
        fs.after_launch(4)  # the agreement step: all ranks raise together
    assert sorted(fs.raised) == list(range(world))
    assert set(err.value.failed_ranks) == set(live)
    assert "allreduce.ar[" in str(err.value) and f"from rank {stalled}" in str(err.value)
    with pytest.raises(FailStopError):  # sticky: no fallback after a failure
        fs.after_launch(5)
