"""Per-rank control/health blocks and peer buffers: real TP over CUDA IPC, virtual TP on one GPU.

| object       | what it holds                                     | freed                        |
|--------------|---------------------------------------------------|------------------------------|
| RankState    | ctrl (int64 [CTRL_WORDS]), health (int32 [...])   | with the object              |
| IpcPeers     | own buffer (cuMemAlloc), every peer's buffer      | close(): after every graph   |
|              | opened through CUDA IPC, device table [world]     | that uses it is destroyed    |
| VirtualPeers | one buffer for R ranks, table [R], R streams,     | close(): same rule           |
|              | R RankStates                                      |                              |

The IPC buffer is allocated with the driver's ``cuMemAlloc`` rather than torch's caching
allocator: legacy IPC handles cover a whole allocation and do not work on expandable
(VMM) segments, and a buffer of our own has offset 0 and a lifetime we control. Handles
are exchanged with ``all_gather_object`` over the engine's CPU (gloo) group and opened in
this rank's own device context, so peer access is enabled for the device that runs the
kernels.

torch is imported lazily; ``libcuda`` is loaded only when an IpcPeers is made.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mono_ext.runtime import health as _h

__all__ = ["IpcPeers", "PeerBufferError", "RankState", "VirtualPeers"]

_ALIGN_BYTES = 256


class PeerBufferError(RuntimeError):
    pass


@dataclass
class RankState:
    """One rank's control and health blocks on the device."""

    rank: int
    ctrl: Any  # torch.Tensor int64 [CTRL_WORDS]
    health: Any  # torch.Tensor int32 [HEALTH_WORDS]

    @classmethod
    def create(cls, rank: int, device: Any, deadline_s: float) -> RankState:
        import torch

        ctrl = torch.tensor(_h.ctrl_init_words(rank, deadline_s), dtype=torch.int64, device=device)
        health = torch.tensor(_h.health_init_words(), dtype=torch.int32, device=device)
        return cls(rank, ctrl, health)

    def bump_epoch(self) -> None:
        """Once per step, on the step's stream: a device op, so graph replays bump too."""
        self.ctrl[_h.CTRL_EPOCH : _h.CTRL_EPOCH + 1].add_(1)


class _GraphGuard:
    """Remembers graphs that captured launches on a buffer; the buffer outlives them."""

    def __init__(self) -> None:
        self._graphs: list[weakref.ref] = []

    def register(self, graph: Any) -> None:
        self._graphs.append(weakref.ref(graph))

    def alive(self) -> int:
        return sum(1 for g in self._graphs if g() is not None)


class VirtualPeers:
    """Virtual TP: ``world`` ranks as ``world`` launches on ``world`` streams of one process,
    sharing one buffer, so TP logic runs (and deadlocks, if wrong) on a single GPU.

    All launches that wait on each other must be resident together: build kernels with
    ``co_resident=world``. Every kernel a rank stream launches while peers spin must already
    be loaded: CUDA loads modules lazily, and a load serialises against running kernels
    (seen on H200: a first ``torch.cuda._sleep`` mid-step stalled every rank to the deadline).
    """

    def __init__(self, world: int, peer_words: int, device: Any, deadline_s: float):
        import torch

        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        # Streams beyond the hardware work queues share one: a rank's launch can then queue
        # behind a peer's spinning kernel and both wait until the deadline.
        connections = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))
        if world + 1 > connections:
            raise PeerBufferError(
                f"virtual TP{world} needs {world + 1} hardware queues (ranks + the main stream) "
                f"but CUDA_DEVICE_MAX_CONNECTIONS={connections}: set it to 32 before CUDA starts"
            )
        self.world = world
        self.device = torch.device(device)
        self.stride_words = -(-peer_words * 8 // _ALIGN_BYTES) * _ALIGN_BYTES // 8
        self.buffer = torch.zeros(world * self.stride_words, dtype=torch.int64, device=device)
        base = self.buffer.data_ptr()
        self.table = torch.tensor(
            [base + r * self.stride_words * 8 for r in range(world)],
            dtype=torch.int64,
            device=device,
        )
        self.ranks = [RankState.create(r, device, deadline_s) for r in range(world)]
        self.streams = [torch.cuda.Stream(device=self.device) for _ in range(world)]
        self._graphs = _GraphGuard()

    def peer_buffer(self, rank: int):
        return self.buffer[rank * self.stride_words : (rank + 1) * self.stride_words]

    def run(self, fn: Callable[[int], None], ranks: Iterable[int] | None = None) -> None:
        """Call ``fn(rank)`` with each rank's stream current, forked from and joined back into
        the current stream (legal under graph capture: the ranks become parallel branches)."""
        import torch

        main = torch.cuda.current_stream(self.device)
        fork = torch.cuda.Event()
        fork.record(main)
        joins = []
        for r in range(self.world) if ranks is None else ranks:
            s = self.streams[r]
            s.wait_event(fork)
            with torch.cuda.stream(s):
                fn(r)
            done = torch.cuda.Event()
            done.record(s)
            joins.append(done)
        for done in joins:
            main.wait_event(done)

    def register_graph(self, graph: Any) -> None:
        self._graphs.register(graph)

    def close(self) -> None:
        alive = self._graphs.alive()
        if alive:
            raise PeerBufferError(
                f"{alive} CUDA graph(s) captured on this peer buffer still exist: destroy them "
                "before freeing it (a replay would write freed memory)"
            )
        self.buffer = self.table = None


# --- CUDA IPC through the driver API (libcuda is always there where a GPU is) ---------------


class _CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class _Driver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise PeerBufferError(f"cannot load libcuda.so.1 for CUDA IPC: {e}") from None
        u64 = ctypes.c_uint64
        sigs = {
            "cuMemAlloc_v2": [ctypes.POINTER(u64), ctypes.c_size_t],
            "cuMemFree_v2": [u64],
            "cuMemsetD8_v2": [u64, ctypes.c_ubyte, ctypes.c_size_t],
            "cuIpcGetMemHandle": [ctypes.POINTER(_CUipcMemHandle), u64],
            "cuIpcOpenMemHandle_v2": [ctypes.POINTER(u64), _CUipcMemHandle, ctypes.c_uint],
            "cuIpcCloseMemHandle": [u64],
        }
        for name, args in sigs.items():
            f = getattr(self.lib, name)
            f.argtypes = args
            f.restype = ctypes.c_int

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise PeerBufferError(f"{what} failed: CUDA driver error {rc} ({name.value})")


class _RawDeviceArray:
    """Exposes a raw device allocation to torch through __cuda_array_interface__."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes // 8,),
            "typestr": "<i8",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class IpcPeers:
    """Real TP: one buffer per rank, opened by every other rank through CUDA IPC.

    ``group`` is the engine's CPU (gloo) process group of the TP ranks. Collective: every
    rank constructs and closes it together.
    """

    def __init__(self, peer_words: int, group: Any, device: Any, deadline_s: float):
        import torch
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device(device)
        self.nbytes = -(-peer_words * 8 // _ALIGN_BYTES) * _ALIGN_BYTES
        torch.cuda.set_device(self.device)
        torch.cuda.synchronize(self.device)  # makes the primary context current for the driver
        self._cu = _Driver()
        ptr = ctypes.c_uint64()
        self._cu.check(self._cu.lib.cuMemAlloc_v2(ctypes.byref(ptr), self.nbytes), "cuMemAlloc")
        self._own = ptr.value
        # Zero before the handle leaves this rank, so no tag in it can match a live step.
        self._cu.check(self._cu.lib.cuMemsetD8_v2(self._own, 0, self.nbytes), "cuMemsetD8")
        # cuMemset may return before the device is done; a peer's first write must not be
        # wiped by a memset still in flight.
        torch.cuda.synchronize(self.device)
        handle = _CUipcMemHandle()
        self._cu.check(
            self._cu.lib.cuIpcGetMemHandle(ctypes.byref(handle), self._own), "cuIpcGetMemHandle"
        )
        gathered: list[Any] = [None] * self.world
        # bytes(handle), not handle.reserved: a c_char array field stops at the first NUL byte.
        dist.all_gather_object(gathered, (self.nbytes, bytes(handle)), group=group)
        self._opened: list[int] = []
        addrs = []
        for r, (nbytes, raw) in enumerate(gathered):
            if nbytes != self.nbytes:
                raise PeerBufferError(
                    f"rank {r} made a {nbytes} B peer buffer, this rank {self.nbytes} B"
                )
            if r == self.rank:
                addrs.append(self._own)
                continue
            h = _CUipcMemHandle.from_buffer_copy(raw)
            peer = ctypes.c_uint64()
            self._cu.check(
                self._cu.lib.cuIpcOpenMemHandle_v2(
                    ctypes.byref(peer), h, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                ),
                f"cuIpcOpenMemHandle (rank {r}'s buffer)",
            )
            self._opened.append(peer.value)
            addrs.append(peer.value)
        self.table = torch.tensor(addrs, dtype=torch.int64, device=self.device)
        self.state = RankState.create(self.rank, self.device, deadline_s)
        self._graphs = _GraphGuard()
        dist.barrier(group=group)  # every rank holds every mapping before anyone writes

    def buffer(self, rank: int | None = None):
        """A torch view (int64 words) of a rank's buffer, own by default (debugging, tests)."""
        import torch

        addr = int(self.table[self.rank if rank is None else rank].item())
        return torch.as_tensor(_RawDeviceArray(addr, self.nbytes), device=self.device)

    def register_graph(self, graph: Any) -> None:
        self._graphs.register(graph)

    def close(self) -> None:
        import torch
        import torch.distributed as dist

        if self._own is None:
            return
        alive = self._graphs.alive()
        if alive:
            raise PeerBufferError(
                f"{alive} CUDA graph(s) captured on this peer buffer still exist: destroy them "
                "before freeing it (a replay would write freed memory)"
            )
        torch.cuda.synchronize(self.device)
        for peer in self._opened:
            self._cu.check(self._cu.lib.cuIpcCloseMemHandle(peer), "cuIpcCloseMemHandle")
        self._opened = []
        dist.barrier(group=self.group)  # no peer still maps our buffer when we free it
        self._cu.check(self._cu.lib.cuMemFree_v2(self._own), "cuMemFree")
        self._own = None
        self.table = None
