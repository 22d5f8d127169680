"""Per-rank control/health blocks and peer buffers: real TP over CUDA (or HIP) IPC, virtual TP
on one GPU.

| object       | what it holds                                     | freed                        |
|--------------|---------------------------------------------------|------------------------------|
| RankState    | ctrl (int64 [CTRL_WORDS]), health (int32 [...])   | with the object              |
| IpcPeers     | own buffer (cuMemAlloc), every peer's buffer      | close(): after every graph   |
|              | opened through CUDA IPC, device table [world]     | that uses it is destroyed    |
| HipIpcPeers  | the same through HIP IPC (hipMalloc; ROCm, never  | same                         |
|              | run on an AMD GPU)                                |                              |
| VirtualPeers | one buffer for R ranks, table [R], R streams,     | close(): same rule           |
|              | R RankStates                                      |                              |

The IPC buffer is allocated with the driver's ``cuMemAlloc`` rather than torch's caching
allocator: legacy IPC handles cover a whole allocation and do not work on expandable
(VMM) segments, and a buffer of our own has offset 0 and a lifetime we control. Handles
are exchanged with ``all_gather_object`` over the engine's CPU (gloo) group and opened in
this rank's own device context, so peer access is enabled for the device that runs the
kernels.

The two IPC flavours share the exchange (:func:`_exchange`); a small ctypes driver
(:class:`_IpcDriver`) supplies the allocation and handle calls of each API.

torch is imported lazily; ``libcuda`` / ``libamdhip64`` is loaded only when an IpcPeers /
HipIpcPeers is made.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mono_ext.runtime import health as _h

__all__ = ["HipIpcPeers", "IpcPeers", "PeerBufferError", "RankState", "VirtualPeers"]

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


# --- IPC through the driver API: CUDA (libcuda) or HIP (libamdhip64), one exchange ---------


class _IpcMemHandle(ctypes.Structure):
    """``CUipcMemHandle`` and ``hipIpcMemHandle_t`` alike: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


# CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS and hipIpcMemLazyEnablePeerAccess
_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcDriver:
    """What :class:`IpcPeers` needs from a GPU driver, over ctypes: subclasses name the library,
    their column of ``_ENTRY_POINTS`` and their error names. Device pointers travel as
    integers; ``bind``/``synchronize`` go through torch (``torch.cuda`` is HIP in a ROCm build
    of torch).

    Tests substitute an object with the same methods (``tests/runtime/test_peers_hip.py``).
    """

    api = ""
    libraries: tuple[str, ...] = ()
    column = 0  # of the entry point's name in _ENTRY_POINTS
    memset_byte: Any = ctypes.c_ubyte  # the fill value's type

    def __init__(self, library: str | None = None) -> None:
        self.lib = _load_library(self.api, (library,) if library else self.libraries)
        self.fn = {}
        for role, (*names, args) in _ENTRY_POINTS.items():
            f = getattr(self.lib, names[self.column])
            f.argtypes = [self.memset_byte if a is None else a for a in args]
            f.restype = ctypes.c_int
            self.fn[role] = (names[self.column], f)

    def _call(self, role: str, *args: Any, what: str = "") -> None:
        name, f = self.fn[role]
        rc = f(*args)
        if rc != 0:
            why = f"{self.api} error {rc} ({self.error_name(rc)})"
            raise PeerBufferError(f"{name}{what} failed: {why}")

    def error_name(self, rc: int) -> str:
        raise NotImplementedError

    def bind(self, device: Any) -> None:
        import torch

        torch.cuda.set_device(device)
        torch.cuda.synchronize(device)  # makes the primary context current for the driver

    def synchronize(self, device: Any) -> None:
        import torch

        torch.cuda.synchronize(device)

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("alloc", ctypes.byref(ptr), nbytes)
        return ptr.value

    def memset0(self, ptr: int, nbytes: int) -> None:
        self._call("memset", ptr, 0, nbytes)

    def export(self, ptr: int) -> bytes:
        handle = _IpcMemHandle()
        self._call("export", ctypes.byref(handle), ptr)
        # bytes(handle), not handle.reserved: a c_char array field stops at the first NUL byte.
        return bytes(handle)

    def open(self, raw: bytes, rank: int) -> int:
        peer = ctypes.c_uint64()
        h = _IpcMemHandle.from_buffer_copy(raw)
        flags = _IPC_LAZY_ENABLE_PEER_ACCESS
        self._call("open", ctypes.byref(peer), h, flags, what=f" (rank {rank}'s buffer)")
        return peer.value

    def close(self, ptr: int) -> None:
        self._call("close", ptr)

    def free(self, ptr: int) -> None:
        self._call("free", ptr)


def _load_library(api: str, names: Iterable[str]) -> ctypes.CDLL:
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise PeerBufferError(f"cannot load the {api} library for IPC: " + "; ".join(errors))


def _mapped(stem: str) -> tuple[str, ...]:
    """Paths of the libraries named ``stem*`` mapped into this process (Linux; else none)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    paths = (line.split()[-1] for line in maps.splitlines() if f"/{stem}" in line)
    return tuple(dict.fromkeys(paths))


_U64 = ctypes.c_uint64
_HANDLE_P = ctypes.POINTER(_IpcMemHandle)
# role: (CUDA driver API, HIP runtime, argtypes; None: the memset byte's type); each returns a
# status, 0 on success
_ENTRY_POINTS: dict[str, tuple[str, str, list]] = {
    "alloc": ("cuMemAlloc_v2", "hipMalloc", [ctypes.POINTER(_U64), ctypes.c_size_t]),
    "free": ("cuMemFree_v2", "hipFree", [_U64]),
    "memset": ("cuMemsetD8_v2", "hipMemset", [_U64, None, ctypes.c_size_t]),
    "export": ("cuIpcGetMemHandle", "hipIpcGetMemHandle", [_HANDLE_P, _U64]),
    "open": ("cuIpcOpenMemHandle_v2", "hipIpcOpenMemHandle",
             [ctypes.POINTER(_U64), _IpcMemHandle, ctypes.c_uint]),  # fmt: skip
    "close": ("cuIpcCloseMemHandle", "hipIpcCloseMemHandle", [_U64]),
}


class _CudaDriver(_IpcDriver):
    """The CUDA driver API (libcuda is always there where an NVIDIA GPU is)."""

    api = "CUDA driver"
    libraries = ("libcuda.so.1",)

    def error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(name))
        return (name.value or b"?").decode()


class _HipDriver(_IpcDriver):
    """The HIP runtime (ROCm). **Never run here**: no ROCm and no AMD GPU where it was
    written; only its ctypes marshalling was exercised, against a stand-in library
    (``tests/runtime/test_peers_hip.py``). hipMalloc'd memory is a whole allocation at offset 0,
    which hipIpcGetMemHandle needs, as cuMemAlloc's is for CUDA."""

    api = "HIP"
    # The unversioned name first (a ROCm install), then the sonames ROCm 6 and 7 ship.
    libraries = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")
    column = 1
    memset_byte = ctypes.c_int

    def __init__(self, library: str | None = None) -> None:
        # The copy torch already loaded first: a ROCm wheel of torch bundles its own
        # libamdhip64, and memory of a second HIP runtime in the process is not torch's device's.
        self.libraries = (*_mapped("libamdhip64.so"), *type(self).libraries)
        super().__init__(library)

    def error_name(self, rc: int) -> str:
        f = self.lib.hipGetErrorName
        f.argtypes, f.restype = [ctypes.c_int], ctypes.c_char_p
        return (f(rc) or b"?").decode()


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


def _exchange(drv: Any, nbytes: int, group: Any, device: Any) -> tuple[int, list[int], list[int]]:
    """Allocate, zero and export this rank's buffer, all-gather every rank's handle over the
    CPU group and open every peer's: (own address, opened addresses, table in rank order)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    own = drv.alloc(nbytes)
    # Zero before the handle leaves this rank, so no tag in it can match a live step; the
    # memset may return before the device is done, and a peer's first write must not be wiped
    # by a memset still in flight.
    drv.memset0(own, nbytes)
    drv.synchronize(device)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (nbytes, drv.export(own)), group=group)
    opened: list[int] = []
    addrs = []
    for r, (their_nbytes, raw) in enumerate(gathered):
        if their_nbytes != nbytes:
            raise PeerBufferError(
                f"rank {r} made a {their_nbytes} B peer buffer, this rank {nbytes} B"
            )
        if r == rank:
            addrs.append(own)
            continue
        opened.append(drv.open(raw, r))
        addrs.append(opened[-1])
    return own, opened, addrs


class IpcPeers:
    """Real TP: one buffer per rank, opened by every other rank through CUDA IPC.

    ``group`` is the engine's CPU (gloo) process group of the TP ranks. Collective: every
    rank constructs and closes it together. ``driver`` replaces the ctypes driver (tests).
    """

    _driver_class: type[_IpcDriver] = _CudaDriver

    def __init__(
        self, peer_words: int, group: Any, device: Any, deadline_s: float, driver: Any = None
    ):
        import torch
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device(device)
        self.nbytes = -(-peer_words * 8 // _ALIGN_BYTES) * _ALIGN_BYTES
        self._drv = driver if driver is not None else self._driver_class()
        self._drv.bind(self.device)
        self._own, self._opened, addrs = _exchange(self._drv, self.nbytes, group, self.device)
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
        import torch.distributed as dist

        if self._own is None:
            return
        alive = self._graphs.alive()
        if alive:
            raise PeerBufferError(
                f"{alive} CUDA graph(s) captured on this peer buffer still exist: destroy them "
                "before freeing it (a replay would write freed memory)"
            )
        self._drv.synchronize(self.device)
        for peer in self._opened:
            self._drv.close(peer)
        self._opened = []
        dist.barrier(group=self.group)  # no peer still maps our buffer when we free it
        self._drv.free(self._own)
        self._own = None
        self.table = None


class HipIpcPeers(IpcPeers):
    """Real TP on ROCm: :class:`IpcPeers` with the HIP runtime's IPC (``libamdhip64``:
    hipMalloc, hipMemset, hipIpcGetMemHandle / hipIpcOpenMemHandle / hipIpcCloseMemHandle,
    hipFree; 64-byte ``hipIpcMemHandle_t``), the same exchange over the engine's gloo group.

    **Never run on an AMD GPU**: none was available where it was written. What ran is the
    exchange (allocate, zero, export, all-gather, open every peer's handle, rank-ordered
    table, close order) over a real two-process gloo group with a recording stand-in driver,
    and the ctypes calls against a stand-in ``libamdhip64`` (``tests/runtime/test_peers_hip.py``).
    Whether ``torch.as_tensor`` takes :meth:`buffer`'s ``__cuda_array_interface__`` on ROCm is
    also unverified.
    """

    _driver_class = _HipDriver
