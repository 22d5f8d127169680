"""Device primitives on their own: %globaltimer, tagged store/load, a wait that gives up
(health record + sticky failed word), and the next launch bailing at once."""

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mono_ext.kernels.triton.primitives import (  # noqa: E402
    global_timer_ns,
    mailbox_get,
    mailbox_put,
    seq_tag,
    step_seq,
)
from mono_ext.runtime.health import H_FAILED, decode_health  # noqa: E402
from mono_ext.runtime.layout import step_seq as host_seq  # noqa: E402
from mono_ext.runtime.layout import tag_of  # noqa: E402
from mono_ext.runtime.peers import RankState  # noqa: E402

pytestmark = pytest.mark.gpu


@triton.jit(do_not_specialize=["spin_ns"])
def _timer_kernel(out_ptr, spin_ns):
    t0 = global_timer_ns()
    t = t0
    while t - t0 < spin_ns:
        t = global_timer_ns()
    tl.store(out_ptr, t0)
    tl.store(out_ptr + 1, t)


@triton.jit(do_not_specialize=["layer"])
def _roundtrip_kernel(
    src_ptr, region_ptr, out_ptr, ok_ptr, n, ctrl_ptr, health_ptr, layer, BLOCK: tl.constexpr
):
    tag = seq_tag(step_seq(ctrl_ptr, layer, 4))
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    mailbox_put(region_ptr, offs, tl.load(src_ptr + offs, mask=mask), mask, tag, False)
    got, ok = mailbox_get(region_ptr, offs, mask, tag, ctrl_ptr, health_ptr, 5)
    tl.store(out_ptr + offs, got, mask=mask)
    tl.store(ok_ptr, ok.to(tl.int32))


@triton.jit(do_not_specialize=["layer"])
def _never_written_kernel(region_ptr, ok_ptr, n, ctrl_ptr, health_ptr, layer, BLOCK: tl.constexpr):
    tag = seq_tag(step_seq(ctrl_ptr, layer, 1))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    got, ok = mailbox_get(region_ptr, offs, offs < n, tag, ctrl_ptr, health_ptr, 3)
    tl.store(ok_ptr + tl.program_id(0), ok.to(tl.int32))


def _check():
    torch.cuda.synchronize()  # surfaces a launch error here rather than in the next test


def test_globaltimer_counts_nanoseconds():
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    _timer_kernel[(1,)](out, 1000)  # compile + warm
    _check()
    t = time.perf_counter()
    _timer_kernel[(1,)](out, 50_000_000)
    _check()
    host = time.perf_counter() - t
    dev = (out[1] - out[0]).item() / 1e9
    assert 0.05 <= dev < 0.06, dev
    assert 0.045 < host < 0.5, host


def test_tagged_roundtrip_value_and_tag():
    state = RankState.create(0, "cuda", deadline_s=2.0)
    n, block = 1000, 1024
    region = torch.full((block,), -1, dtype=torch.int64, device="cuda")
    for step in range(3):
        state.bump_epoch()
        layer = 2
        src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
        out = torch.full_like(src, 0x5A5A5A5A)
        ok = torch.zeros(1, dtype=torch.int32, device="cuda")
        _roundtrip_kernel[(1,)](
            src, region, out, ok, n, state.ctrl, state.health, layer, BLOCK=block
        )
        _check()
        assert ok.item() == 1
        assert torch.equal(out, src)
        want_tag = tag_of(host_seq(step + 1, layer, 4))
        tags = (region[:n] >> 32) & 0xFFFFFFFF
        assert (tags == want_tag).all(), (tags[:4], want_tag)
        assert torch.equal((region[:n] & 0xFFFFFFFF), src.to(torch.int64) & 0xFFFFFFFF)
        assert (region[n:] == -1).all()  # masked lanes untouched
    assert state.health[H_FAILED].item() == 0


def test_wait_gives_up_records_and_next_launch_bails():
    deadline = 0.3
    state = RankState.create(7, "cuda", deadline_s=deadline)
    n, block, ctas = 512, 128, 4
    # tags far from any this test can want; values random
    tags = torch.randint(2**20, 2**30, (n,), dtype=torch.int64, device="cuda")
    region = (tags << 32) | torch.randint(0, 2**31, (n,), dtype=torch.int64, device="cuda")
    ok = torch.full((ctas,), 9, dtype=torch.int32, device="cuda")
    # compile against a throwaway health block that already failed, so nothing spins
    dummy = RankState.create(0, "cuda", deadline_s=deadline)
    dummy.health[H_FAILED] = 1
    _never_written_kernel[(ctas,)](region, ok, n, dummy.ctrl, dummy.health, 0, BLOCK=block)
    _check()
    state.bump_epoch()
    t = time.perf_counter()
    _never_written_kernel[(ctas,)](region, ok, n, state.ctrl, state.health, 0, BLOCK=block)
    _check()
    took = time.perf_counter() - t
    assert deadline <= took < deadline + 1.0, took
    assert (ok == 0).all()
    summary = decode_health(state.health.cpu().tolist(), rank=7)
    assert 1 <= summary.failed_waits <= ctas
    for rec in summary.records:
        assert rec.region == 3 and rec.rank == 7 and rec.epoch == 1
        assert rec.wanted_tag == tag_of(host_seq(1, 0, 1))
        cta = rec.cta
        assert rec.index == cta * block  # first word of the CTA's block
        assert rec.seen_tag == (region[rec.index].item() >> 32) & 0xFFFFFFFF
        assert rec.waited_us >= deadline * 1e6
    before = summary.failed_waits
    state.bump_epoch()
    t = time.perf_counter()
    _never_written_kernel[(ctas,)](region, ok, n, state.ctrl, state.health, 0, BLOCK=block)
    _check()
    assert time.perf_counter() - t < 0.1  # sticky: bails at once
    assert state.health[H_FAILED].item() == before  # a bail is not a new record
