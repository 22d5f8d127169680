"""CudaHealthSource on a GPU: the health copy captured in a graph, read at each release.

A step's graph holds its device work and the health copy; each replay is followed only by the
host's end_step. Healthy replays release; once the device block records a wait that gave up,
the next step's release raises with that wait named, and its tokens are never released.
"""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from mono_ext.runtime import health as h  # noqa: E402
from mono_ext.runtime.failstop import CudaHealthSource, FailStop, FailStopError  # noqa: E402
from mono_ext.runtime.persistent import PersistentRuntime  # noqa: E402


class Runtime(PersistentRuntime):
    def __init__(self, failstop):
        self.failstop, self.steps = failstop, 0


def test_captured_health_copy_stops_the_step_that_failed():
    block = torch.tensor(h.health_init_words(), dtype=torch.int32, device="cuda")
    source = CudaHealthSource(block)
    rt = Runtime(FailStop(source, agree_every=1000, name_of=lambda r, i: f"region{r}[{i}]"))
    work = torch.zeros(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work.add_(1.0)
        rt.health_copy()
    copies = []
    real_copy = source.copy
    source.copy = lambda: copies.append(1) or real_copy()
    for step in range(1, 6):
        graph.replay()
        assert rt.end_step(replayed=True) == step
        torch.cuda.synchronize()  # stands for the engine's wait for the step's tokens
        assert rt.release(step)
    assert copies == []  # every replay brought its own copy: none issued by the host
    record = [3, 17, 9, 8, 5, 0, 7, 10**6]  # region 3, word 17, CTA 5 gave up
    block[h.H_RECORDS : h.H_RECORDS + h.RECORD_WORDS] = torch.tensor(record, dtype=torch.int32)
    block[h.H_FAILED] = 1
    released = []
    with pytest.raises(FailStopError, match=r"region3\[17\]"):
        graph.replay()
        rt.end_step(replayed=True)
        torch.cuda.synchronize()
        released.append(rt.release(6))
    assert released == []  # step 6's tokens never go
    with pytest.raises(FailStopError):  # sticky: no later step either
        rt.begin_step()
