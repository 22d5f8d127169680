"""K2 builds that change only when words are loaded, not what is computed, give the default
build's outputs bit for bit on the H200 (80B-A3B tail shapes, TP 1, every width), and their
waits still give up within the deadline and name the region they waited on.

The CPU interpreter runs one stage per launch and so never takes these paths: the GPU is the
only place they can be checked.
"""

import os
import time

import pytest

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.triton.k2 import (  # noqa: E402
    BLOCK_B,
    STAGES_ALL,
    K2Config,
    K2Launch,
    K2Shape,
    shard_tail_weights,
)
from mono_ext.models.qwen3_next.triton.k2_kernel import S1_REDUCE, S3_EXPERT  # noqa: E402
from mono_ext.runtime.health import decode_health  # noqa: E402
from mono_ext.runtime.peers import VirtualPeers  # noqa: E402
from tests.models.qwen3_next.triton.tail_weights import random_tail_weights  # noqa: E402

pytestmark = pytest.mark.gpu
PRESET = "qwen3-next-80b-a3b"
GRID = 132
# name -> K2Config overrides; each must leave every output bit unchanged
SCHEDULES = {
    "norm lookahead": {"norm_lookahead": True},
    "norm lookahead, one row per wait": {"norm_lookahead": True, "norm_rows_per_wait": 1},
    "norm and act lookahead": {"norm_lookahead": True, "act_lookahead": True},
}


DEADLINE_S = 1.0


class OneRank:
    def __init__(self, dims: Dims, weights: dict, **config):
        self.k2 = K2Launch(K2Shape.from_dims(dims), K2Config(grid=GRID, **config))
        self.k2.build("cuda")
        self.peers = VirtualPeers(1, max(self.k2.peer_words, 16), "cuda", DEADLINE_S)
        self.ws = self.k2.workspace("cuda")
        self.w = weights

    def run(self, o_in: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h = res.shape
        out_h = torch.full((b, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        out_r = torch.full_like(out_h, float("nan"))
        st = self.peers.ranks[0]
        st.bump_epoch()
        self.k2.launch(o_in, res, self.w, out_h, out_r, ws=self.ws, ctrl=st.ctrl,
                       health=st.health, peers=None)  # fmt: skip
        torch.cuda.synchronize()
        health = decode_health(st.health.cpu().tolist(), rank=0)
        assert health.ok, health.describe(self.k2.layout.describe)
        return out_h, out_r


@pytest.fixture(scope="module")
def setup():
    dims = Dims.from_config(get_preset(PRESET), tp=1)
    full = random_tail_weights(dims, torch.Generator(device="cuda").manual_seed(4321))
    weights = shard_tail_weights(full, 1, 0, None)
    default = OneRank(dims, weights)
    yield dims, weights, default
    torch.cuda.synchronize()
    default.peers.close()


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_gives_the_default_outputs_bit_for_bit(setup, name):
    dims, weights, default = setup
    other = OneRank(dims, weights, **SCHEDULES[name])
    gen = torch.Generator(device="cuda").manual_seed(99)
    try:
        for b in range(1, BLOCK_B + 1):
            o_in = torch.randn(b, dims.hv * dims.dv, generator=gen, device="cuda").bfloat16()
            res = torch.randn(b, dims.hidden, generator=gen, device="cuda").bfloat16()
            want_h, want_r = default.run(o_in, res)
            got_h, got_r = other.run(o_in, res)
            assert not torch.isnan(want_h).any(), f"default left width {b} unwritten"
            assert torch.equal(got_h, want_h), f"{name}: hidden differs at width {b}"
            assert torch.equal(got_r, want_r), f"{name}: residual differs at width {b}"
    finally:
        torch.cuda.synchronize()
        other.peers.close()


def random_rows(dims: Dims, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    o_in = torch.randn(b, dims.hv * dims.dv, generator=gen, device="cuda").bfloat16()
    return o_in, torch.randn(b, dims.hidden, generator=gen, device="cuda").bfloat16()


@pytest.mark.parametrize(
    "config, never_written",
    [
        ({"norm_lookahead": True}, "resid"),
        ({"act_lookahead": True}, "act"),
    ],
)
def test_a_wait_loaded_ahead_still_gives_up_in_time_and_names_its_region(
    setup, config, never_written
):
    """The stage that writes the region is left out of the build, so its words keep the
    previous step's tag: the wait that reads them ahead must still give up at the deadline,
    with records that name that region."""
    dims, weights, _ = setup
    whole = OneRank(dims, weights, **config)
    cut = K2Launch(
        K2Shape.from_dims(dims),
        K2Config(grid=GRID, **config),
        stages=STAGES_ALL & ~{"resid": S1_REDUCE, "act": S3_EXPERT}[never_written],
    )
    cut.build("cuda")
    try:
        o_in, res = random_rows(dims, 5, seed=3)
        whole.run(o_in, res)  # healthy: tags, union and routing tables of a real step
        out_h = torch.empty_like(res)
        out_r = torch.empty_like(res)
        st = whole.peers.ranks[0]
        st.bump_epoch()
        t = time.perf_counter()
        cut.launch(o_in, res, weights, out_h, out_r, ws=whole.ws, ctrl=st.ctrl,
                   health=st.health, peers=None)  # fmt: skip
        torch.cuda.synchronize()
        took = time.perf_counter() - t
        health = decode_health(st.health.cpu().tolist(), rank=0)
        assert not health.ok and health.records, "a wait on unwritten words did not give up"
        assert DEADLINE_S <= took < DEADLINE_S + 1.0, took
        region = cut.layout.region_id(never_written)
        assert {r.region for r in health.records} == {region}, health.describe(cut.layout.describe)
    finally:
        torch.cuda.synchronize()
        whole.peers.close()
