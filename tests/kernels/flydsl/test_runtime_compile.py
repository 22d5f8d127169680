"""The FlyDSL runtime primitives compiled for gfx950: clean metadata, and the ISA shows the
protocol's pieces (cache-bypassing spin loads, s_memrealtime deadlines, the health atomic,
scope-correct tagged stores). Running them needs an MI355X (tests run there by Buildkite)."""

import re

import pytest

from mono_ext.kernels.flydsl.limits import BLOCK, GFX950
from mono_ext.kernels.flydsl.runtime import allreduce_launch, build_allreduce, build_mailbox


def _body(isa: str, name: str) -> str:
    m = re.search(rf"^{name}:\n(.*?)\ts_endpgm", isa, re.S | re.M)
    assert m, f"no body for {name}"
    return m.group(1)


def _spin_loop(body: str) -> str:
    """The bounded-wait loop: the block that branches back to itself while exec is live."""
    for label in re.findall(r"^(\.LBB\d+_\d+):", body, re.M):
        m = re.search(rf"^{re.escape(label)}:\n(.*?)s_cbranch_execnz {re.escape(label)}\n", body,
                      re.S | re.M)  # fmt: skip
        if m and "s_memrealtime" in m.group(1):
            return m.group(1)
    raise AssertionError("no loop re-reading s_memrealtime")


def test_mailbox_handoff_compiles_clean_with_a_bounded_wait():
    c = build_mailbox().check()
    (k,) = c.kernels
    assert k.workgroup_size == BLOCK and k.ctas_per_cu() >= 1 and c.grid == GFX950.cus
    loop = _spin_loop(_body(c.isa[k.name], k.name))
    # every spin re-loads the word and the sticky failed word past the caches
    assert len(re.findall(r"global_load_dword(?:x2)? .* sc0 sc1", loop)) >= 2
    body = _body(c.isa[k.name], k.name)
    assert "global_atomic_add" in body  # a give-up bumps the health block's failed word
    assert re.search(r"global_store_dwordx2 .* sc1", body)  # agent-scope tagged store


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_allreduce_compiles_clean_for_every_tp(world):
    c = build_allreduce(world).check()
    (k,) = c.kernels
    body = _body(c.isa[k.name], k.name)
    _spin_loop(body)
    # system scope: pushes to peers write through both cache levels (visible across XGMI)
    stores = re.findall(r"global_store_dwordx2 .*", body)
    assert stores and all(s.endswith("sc0 sc1") for s in stores)


def test_allreduce_scope_follows_the_build():
    c = build_allreduce(2, system=False).check()
    (k,) = c.kernels
    stores = re.findall(r"global_store_dwordx2 .*", _body(c.isa[k.name], k.name))
    assert stores and not any("sc0" in s for s in stores)  # agent scope: L2 is coherent


def test_refusals_before_compiling():
    with pytest.raises(ValueError, match="world must be 1, 2, 4 or 8"):
        allreduce_launch(3, True)
    with pytest.raises(ValueError, match="hidden must be even"):
        build_allreduce(2, hidden=2047)
