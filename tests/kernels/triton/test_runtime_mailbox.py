"""Mailbox hand-off chains across CTAs: stage k (one CTA) waits for stage k-1's region, so a
value crosses every CTA of the grid in one launch. Stage 0 runs on the *last* CTA, so
consumers are scheduled before their producers and really wait."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mono_ext.kernels.triton.primitives import (  # noqa: E402
    mailbox_get,
    mailbox_put,
    seq_tag,
    step_seq,
)
from mono_ext.runtime.health import decode_health  # noqa: E402
from mono_ext.runtime.layout import (  # noqa: E402
    HandoffError,
    Program,
    Region,
    Stage,
    plan_layout,
    wait,
    write,
)
from mono_ext.runtime.peers import RankState  # noqa: E402

pytestmark = pytest.mark.gpu


@triton.jit(do_not_specialize=["layer"])
def _chain_kernel(
    x_ptr,
    out_ptr,
    mbox_ptr,
    offsets_ptr,
    region_ids_ptr,
    n,
    ctrl_ptr,
    health_ptr,
    layer,
    BLOCK: tl.constexpr,
):
    n_stages = tl.num_programs(0)
    stage = n_stages - 1 - tl.program_id(0)
    tag = seq_tag(step_seq(ctrl_ptr, layer, 1))
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    prev = tl.maximum(stage - 1, 0)
    first = stage == 0
    # stage 0 reads the input; the wait's mask is empty there, so it returns at once
    got, ok = mailbox_get(
        mbox_ptr + tl.load(offsets_ptr + prev),
        offs,
        mask & (stage > 0),
        tag,
        ctrl_ptr,
        health_ptr,
        tl.load(region_ids_ptr + prev),
    )
    x = tl.load(x_ptr + offs, mask=mask & first, other=0)
    v = tl.where(first, x, got) * 3 + stage  # int32, wraps
    mailbox_put(mbox_ptr + tl.load(offsets_ptr + stage), offs, v, mask, tag, False)
    tl.store(out_ptr + offs, v, mask=mask & (stage == n_stages - 1))


def _chain_program(stages: int, words: int) -> Program:
    regions = tuple(Region(f"s{k}", words) for k in range(stages))
    st = [Stage("s0", [write("s0")])]
    st += [Stage(f"s{k}", [wait(f"s{k - 1}"), write(f"s{k}")]) for k in range(1, stages)]
    return Program("chain", regions, tuple(st))


def _expected(x: torch.Tensor, stages: int) -> torch.Tensor:
    v = x.to(torch.int64)
    for k in range(stages):
        v = (v * 3 + k) & 0xFFFFFFFF
    v = torch.where(v >= 2**31, v - 2**32, v)
    return v.to(torch.int32)


@pytest.mark.parametrize("stages", [2, 64, 128])
def test_chain_across_ctas(stages):
    n, block = 1000, 1024
    layout = plan_layout(_chain_program(stages, n))
    offsets = torch.tensor([layout.offsets[f"s{k}"] for k in range(stages)], device="cuda")
    region_ids = torch.tensor(
        [layout.region_id(f"s{k}") for k in range(stages)], dtype=torch.int32, device="cuda"
    )
    mbox = torch.zeros(layout.scratch_words, dtype=torch.int64, device="cuda")
    state = RankState.create(0, "cuda", deadline_s=2.0)
    assert stages <= torch.cuda.get_device_properties(0).multi_processor_count
    for _ in range(5):  # fresh data each launch: a stale word from the last launch would show
        state.bump_epoch()
        x = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
        out = torch.full_like(x, 0x7A7A7A7A)
        _chain_kernel[(stages,)](
            x, out, mbox, offsets, region_ids, n, state.ctrl, state.health, 0, BLOCK=block
        )
        torch.cuda.synchronize()
        health = decode_health(state.health.cpu().tolist(), rank=0)
        assert health.ok, health.describe(layout.describe)
        assert torch.equal(out, _expected(x, stages))


def test_chain_in_wrong_order_is_refused_at_build():
    bad = Program(
        "chain",
        (Region("a", 8), Region("b", 8)),
        (Stage("first", [wait("b"), write("a")]), Stage("second", [wait("a"), write("b")])),
    )
    with pytest.raises(HandoffError, match="'b'"):
        plan_layout(bad)
