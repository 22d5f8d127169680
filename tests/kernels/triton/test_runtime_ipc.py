"""Real-TP peer buffers: two processes (one GPU is enough) exchange CUDA IPC handles over a
gloo group, each reads the other's buffer through the opened mapping and the device table,
and the buffer refuses to be freed while a graph that used it is alive."""

import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

pytestmark = pytest.mark.gpu
WORDS = 4096


def _worker(rank: int, world: int, init_file: str) -> None:
    from mono_ext.runtime.peers import IpcPeers, PeerBufferError

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        peers = IpcPeers(WORDS + 64, dist.group.WORLD, dev, deadline_s=1.0)
        own = peers.buffer()
        assert own.shape[0] * 8 == peers.nbytes and (own == 0).all()
        gen = torch.Generator(device=dev).manual_seed(100 + rank)
        mine = torch.randint(-(2**62), 2**62, (WORDS,), generator=gen, device=dev)
        own[:WORDS].copy_(mine)
        torch.cuda.synchronize(dev)
        dist.barrier()
        for r in range(world):
            gen = torch.Generator(device=dev).manual_seed(100 + r)
            want = torch.randint(-(2**62), 2**62, (WORDS,), generator=gen, device=dev)
            got = peers.buffer(r)[:WORDS]
            assert torch.equal(got, want), f"rank {rank} reads a wrong buffer for rank {r}"
        # a peer write lands in the owner's buffer
        other = (rank + 1) % world
        dist.barrier()
        peers.buffer(other)[WORDS + rank] = 1000 + rank
        torch.cuda.synchronize(dev)
        dist.barrier()
        assert own[WORDS + (rank - 1) % world].item() == 1000 + (rank - 1) % world
        table = peers.table.cpu().tolist()
        assert len(set(table)) == world and all(table)
        graph = torch.cuda.CUDAGraph()  # stands in for a captured step
        peers.register_graph(graph)
        try:
            peers.close()
            raise AssertionError("close() freed a buffer a live graph may still use")
        except PeerBufferError:
            pass
        del graph
        peers.close()
    finally:
        dist.destroy_process_group()


def test_ipc_peer_buffers_two_processes():
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world, init_file), nprocs=world, join=True)
