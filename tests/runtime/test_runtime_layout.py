"""Scratch/mailbox layout and the build-time hand-off check (CPU)."""

import pytest

from mono_ext.runtime.layout import (
    ALIGN_WORDS,
    HandoffError,
    Program,
    Region,
    Stage,
    allreduce,
    parity_of,
    plan_layout,
    push,
    step_seq,
    tag_of,
    wait,
    write,
)


def k2_like() -> Program:
    return Program(
        "k2",
        regions=(
            Region("attn_out", 1000),
            Region("ar_o", 2048, peer=True),
            Region("router", 37),
            Region("ar_moe", 2048, peer=True),
        ),
        stages=(
            Stage("o_proj", [write("attn_out")]),
            Stage("allreduce_o", [wait("attn_out"), allreduce("ar_o"), write("router")]),
            Stage("experts", [wait("router"), allreduce("ar_moe")]),
        ),
    )


def test_layout_places_regions_aligned_and_double_buffers_peers():
    lay = plan_layout(k2_like(), world=4)
    assert lay.offsets["attn_out"] == 0
    assert lay.offsets["router"] == 1008  # 1000 rounded up to 16 words
    assert lay.scratch_words == 1008 + 48
    assert lay.offsets["ar_o"] == 0
    assert lay.offsets["ar_moe"] == 2 * 4 * 2048
    assert lay.peer_words == 2 * (2 * 4 * 2048)
    assert all(off % ALIGN_WORDS == 0 for off in lay.offsets.values())
    seq = step_seq(epoch=5, layer=3, layers_per_step=48)
    assert lay.slot_offset("ar_moe", seq, src=2) == 2 * 4 * 2048 + (parity_of(seq) * 4 + 2) * 2048


def test_describe_names_region_parity_source_word():
    lay = plan_layout(k2_like(), world=4)
    rid = lay.region_id("ar_o")
    assert lay.describe(rid, (1 * 4 + 3) * 2048 + 17) == "k2.ar_o[parity 1, from rank 3, word 17]"
    assert lay.describe(lay.region_id("router"), 5) == "k2.router[word 5]"
    assert "unknown region" in lay.describe(99, 0)


def test_tags_and_parity_follow_the_step_sequence():
    layers = 48
    seqs = [step_seq(e, layer, layers) for e in (1, 2) for layer in range(layers)]
    assert seqs == list(range(48, 48 + 96))
    assert [parity_of(s) for s in seqs[:4]] == [0, 1, 0, 1]  # flips every use, also per layer
    assert tag_of(2**32 + 7) == 7
    with pytest.raises(ValueError):
        step_seq(1, layers, layers)


@pytest.mark.parametrize(
    "stages, region",
    [
        # consumer before producer
        ((Stage("a", [wait("x")]), Stage("b", [write("x")])), "'x'"),
        # same-stage hand-off: CTAs of one stage are unordered
        ((Stage("a", [write("x"), wait("x")]),), "'x'"),
        # waits for a region nobody writes
        ((Stage("a", [wait("x")]),), "'x'"),
    ],
)
def test_local_waits_need_an_earlier_writer(stages, region):
    prog = Program("bad", (Region("x", 8),), stages)
    with pytest.raises(HandoffError, match=region) as e:
        plan_layout(prog)
    assert "deadlock" in str(e.value)


def test_peer_wait_before_own_push_is_refused():
    prog = Program("bad", (Region("ar", 8, peer=True),), (Stage("s", [wait("ar"), push("ar")]),))
    with pytest.raises(HandoffError, match="peer region 'ar' before its own push"):
        plan_layout(prog, world=2)


def test_every_reason_is_collected():
    prog = Program(
        "bad",
        (Region("x", 8), Region("y", 8), Region("ar", 8, peer=True)),
        (
            Stage("a", [wait("y"), write("x"), push("x")]),
            Stage("b", [write("x"), write("ar"), wait("nope")]),
        ),
    )
    with pytest.raises(HandoffError) as e:
        plan_layout(prog)
    text = str(e.value)
    for bit in (
        "'y'",
        "pushes local region 'x'",
        "written 3 times",
        "peer region 'ar' locally",
        "undeclared region 'nope'",
    ):
        assert bit in text, bit
    assert len(e.value.reasons) == 5


def test_region_used_twice_per_launch_is_refused():
    prog = Program(
        "bad",
        (Region("ar", 8, peer=True),),
        (Stage("a", [allreduce("ar")]), Stage("b", [allreduce("ar")])),
    )
    with pytest.raises(HandoffError, match="'ar' is written 2 times"):
        plan_layout(prog, world=2)


def test_region_validation():
    with pytest.raises(ValueError):
        Region("bad name", 4)
    with pytest.raises(ValueError):
        Region("x", 0)
    with pytest.raises(ValueError):
        plan_layout(k2_like(), world=0)
