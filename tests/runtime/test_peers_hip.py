"""HIP IPC peer buffers (runtime.peers.HipIpcPeers) on a CPU: what can be checked without an
AMD GPU. The exchange runs for real over a two-process gloo group with a stand-in driver that
records every call and simulates handles and mappings; the ctypes layer runs against a
stand-in ``libamdhip64`` (and ``libcuda``) compiled here. The real libamdhip64 path (device
memory, IPC mappings across processes) is untestable here and has never run."""

import ctypes
import json
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from mono_ext.runtime import peers as P  # noqa: E402
from tests._support.gloo import leave  # noqa: E402

WORDS = 100  # -> 1024-byte buffers (800 rounded up to 256)
NBYTES = 1024


class FakeDriver:
    """Records calls; rank r's buffer lives at 0x1000 * (r + 1) << 20, a mapping of rank p's
    buffer opened by rank r at 0x7000 << 20 + (p << 12) + r; handles carry (rank, address)
    between NUL bytes (what a handle's bytes must survive through all_gather_object)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.calls: list[list] = []

    def bind(self, device):
        self.calls.append(["bind", str(device)])

    def synchronize(self, device):
        self.calls.append(["synchronize"])

    def alloc(self, nbytes):
        self.calls.append(["alloc", nbytes])
        return (0x1000 * (self.rank + 1)) << 20

    def memset0(self, ptr, nbytes):
        self.calls.append(["memset0", ptr, nbytes])

    def export(self, ptr):
        self.calls.append(["export", ptr])
        raw = b"\0" + struct.pack("<iQ", self.rank, ptr)
        return raw + b"\0" * (64 - len(raw))

    def open(self, raw, rank):
        assert len(raw) == 64 and raw[0] == 0
        owner, addr = struct.unpack("<iQ", raw[1:13])
        self.calls.append(["open", owner, addr, rank])
        return (0x7000 << 20) + (owner << 12) + self.rank

    def close(self, ptr):
        self.calls.append(["close", ptr])

    def free(self, ptr):
        self.calls.append(["free", ptr])


def _worker(rank, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    out = {}
    for name, cls in (("hip", P.HipIpcPeers), ("cuda", P.IpcPeers)):
        drv = FakeDriver(rank)
        peers = cls(WORDS, dist.group.WORLD, "cpu", 1.0, driver=drv)
        table = peers.table.tolist()
        ctrl = peers.state.ctrl.tolist()
        peers.close()
        peers.close()  # a second close does nothing
        out[name] = {"calls": drv.calls, "table": table, "ctrl": ctrl, "nbytes": peers.nbytes}
    try:  # rank 1 asks for a larger buffer: both ranks refuse, naming the other
        P.HipIpcPeers(
            NBYTES * (1 + rank) // 8, dist.group.WORLD, "cpu", 1.0, driver=FakeDriver(rank)
        )
    except P.PeerBufferError as e:
        out["mismatch"] = str(e)
    Path(out_dir, f"r{rank}.json").write_text(json.dumps(out))
    leave(dist)


def _addr(rank):
    return (0x1000 * (rank + 1)) << 20


def _mapped(owner, rank):
    return (0x7000 << 20) + (owner << 12) + rank


def test_exchange_over_two_gloo_ranks():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        res = [json.loads(Path(tmp, f"r{r}.json").read_text()) for r in range(2)]
    for rank, out in enumerate(res):
        peer = 1 - rank
        for name in ("hip", "cuda"):  # one exchange serves both APIs
            got = out[name]
            assert got["nbytes"] == NBYTES
            own = _addr(rank)
            assert got["calls"] == [
                ["bind", "cpu"],
                ["alloc", NBYTES],
                ["memset0", own, NBYTES],  # zeroed, and the zeroing waited for,
                ["synchronize"],
                ["export", own],  # before the handle leaves the rank
                ["open", peer, _addr(peer), peer],  # the peer's handle only, never its own
                # close: wait for the device, unmap the peer's buffer, then free our own
                ["synchronize"],
                ["close", _mapped(peer, rank)],
                ["free", own],
            ], (rank, name)
            want = [own, _mapped(peer, rank)] if rank == 0 else [_mapped(peer, rank), own]
            assert got["table"] == want  # rank order
            assert got["ctrl"][2] == rank  # its RankState knows its rank
        assert f"rank {peer} made a {NBYTES * (1 + peer)} B peer buffer" in out["mismatch"]
        assert f"this rank {NBYTES * (1 + rank)} B" in out["mismatch"]


_STANDIN = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef struct { char reserved[64]; } handle_t;
static int lazy_flag_seen = -1;
int last_flags(void) { return lazy_flag_seen; }
static int alloc_(uint64_t *p, size_t n) { if (!n) return 2; *p = (uint64_t)malloc(n); return 0; }
static int export_(handle_t *h, uint64_t p) {
  memset(h, 0, sizeof *h); memcpy(h->reserved + 8, &p, 8); h->reserved[63] = 'H'; return 0; }
static int open_(uint64_t *out, handle_t h, unsigned flags) {
  lazy_flag_seen = (int)flags; if (h.reserved[63] != 'H') return 1;
  memcpy(out, h.reserved + 8, 8); return 0; }
int hipMalloc(uint64_t *p, size_t n) { return alloc_(p, n); }
int hipFree(uint64_t p) { free((void *)p); return 0; }
int hipMemset(uint64_t p, int v, size_t n) { memset((void *)p, v, n); return 0; }
int hipIpcGetMemHandle(handle_t *h, uint64_t p) { return export_(h, p); }
int hipIpcOpenMemHandle(uint64_t *out, handle_t h, unsigned f) { return open_(out, h, f); }
int hipIpcCloseMemHandle(uint64_t p) { return p ? 0 : 1; }
const char *hipGetErrorName(int rc) { return rc == 2 ? "hipErrorOutOfMemory" : "hipErrorX"; }
int cuMemAlloc_v2(uint64_t *p, size_t n) { return alloc_(p, n); }
int cuMemFree_v2(uint64_t p) { free((void *)p); return 0; }
int cuMemsetD8_v2(uint64_t p, unsigned char v, size_t n) { memset((void *)p, v, n); return 0; }
int cuIpcGetMemHandle(handle_t *h, uint64_t p) { return export_(h, p); }
int cuIpcOpenMemHandle_v2(uint64_t *out, handle_t h, unsigned f) { return open_(out, h, f); }
int cuIpcCloseMemHandle(uint64_t p) { return p ? 0 : 1; }
int cuGetErrorName(int rc, const char **s) { *s = rc == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : "X"; return 0; }
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in library")
    d = tmp_path_factory.mktemp("standin")
    (d / "s.c").write_text(_STANDIN)
    lib = d / "libstandin.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(d / "s.c")], check=True)
    return str(lib)


@pytest.mark.parametrize("cls", [P._HipDriver, P._CudaDriver])
def test_ctypes_calls_against_a_standin_library(standin, cls):
    """Marshalling only (argument types, the 64-byte handle by value, the lazy peer-access
    flag, status codes and error names): the stand-in 'device memory' is host memory."""
    drv = cls(library=standin)
    ptr = drv.alloc(NBYTES)
    ctypes.memset(ptr, 0xFF, NBYTES)
    drv.memset0(ptr, NBYTES)
    assert ctypes.string_at(ptr, NBYTES) == b"\0" * NBYTES
    raw = drv.export(ptr)
    assert len(raw) == 64 and raw[:8] == b"\0" * 8 and raw[63:] == b"H"  # NULs kept
    assert drv.open(raw, 1) == ptr
    assert ctypes.CDLL(standin).last_flags() == 1  # lazy peer access asked for
    with pytest.raises(P.PeerBufferError, match=r"\(rank 3's buffer\) failed"):
        drv.open(b"\0" * 64, 3)
    drv.close(ptr)
    drv.free(ptr)
    with pytest.raises(P.PeerBufferError, match=r"(?i)failed: .* error 2 \(.*out_?of_?memory"):
        drv.alloc(0)


def test_no_hip_runtime_here_is_a_clear_error():
    try:
        ctypes.CDLL("libamdhip64.so")
    except OSError:
        pass
    else:
        pytest.skip("a HIP runtime is installed here")
    with pytest.raises(P.PeerBufferError, match="cannot load the HIP library for IPC"):
        P._HipDriver()
    assert ctypes.sizeof(P._IpcMemHandle) == 64
