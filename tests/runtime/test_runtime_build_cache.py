"""Build keys, the startup-only build cache, residency and specialisation checks (CPU)."""

import dataclasses
from types import SimpleNamespace

import pytest

from mono_ext.core.spec import BuildKey
from mono_ext.runtime import build_cache as bc
from mono_ext.runtime.layout import Program, Region, Stage, allreduce, plan_layout

KEY = BuildKey("qwen3_next", "triton", 8, "bfloat16", 4, (("layout", "ab" * 32),))
H200 = bc.DeviceLimits(sm_count=132)


def test_key_digest_covers_key_and_sources(tmp_path):
    a = tmp_path / "k.py"
    a.write_text("x = 1\n")
    d1 = bc.source_digest([a])
    a.write_text("x = 2\n")
    d2 = bc.source_digest([a])
    assert d1 != d2
    assert KEY.digest(d1) != KEY.digest(d2)
    assert KEY.digest(d1) != dataclasses.replace(KEY, width=16).digest(d1)
    assert "w8" in KEY.label() and "tp4" in KEY.label()


def test_layout_digest_changes_with_world():
    prog = Program("p", (Region("ar", 64, peer=True),), (Stage("s", [allreduce("ar")]),))
    assert bc.layout_digest(plan_layout(prog, 2)) != bc.layout_digest(plan_layout(prog, 4))


def test_cache_builds_at_startup_then_only_looks_up():
    built = []
    cache = bc.BuildCache(lambda k: built.append(k) or f"kernel-{k.width}", sources=[bc.__file__])
    cache.build_all([KEY, KEY])
    assert built == [KEY] and cache.get(KEY) == "kernel-8" and KEY in cache
    cache.seal()
    other = dataclasses.replace(KEY, width=16)
    with pytest.raises(bc.NotBuiltError, match="w16"):
        cache.get(other)
    with pytest.raises(bc.NotBuiltError, match="after startup"):
        cache.build_all([other])
    assert len(cache.digest(KEY)) == 64


def test_occupancy_rules():
    # 4 warps, 40 regs: threads allow 16 blocks, registers 65536 / (40*32*4 -> 1280*4) = 12
    assert bc.blocks_per_sm(bc.KernelResources(40, 4, 16), H200) == 12
    # shared memory bound: 100 KiB per block -> 2 per SM
    assert bc.blocks_per_sm(bc.KernelResources(32, 4, 100 * 1024), H200) == 2
    # 255 registers, 8 warps: 65536 / (8160 -> 8192 * 8) = 1
    assert bc.blocks_per_sm(bc.KernelResources(255, 8, 0), H200) == 1


def test_residency_refuses_a_grid_that_cannot_all_be_resident():
    big = bc.KernelResources(255, 8, 0)  # one CTA per SM
    assert bc.check_residency("ok", 132, big, H200) == 1
    with pytest.raises(bc.ResidencyError, match="133 CTAs") as e:
        bc.check_residency("virtual tp8", 8 * 17 - 3, big, H200)
    assert "virtual tp8" in str(e.value)


def _fake_jit(**params):
    return SimpleNamespace(
        __name__="k",
        params=[
            SimpleNamespace(name=n, is_constexpr=c == "constexpr", do_not_specialize=c == "dns")
            for n, c in params.items()
        ],
    )


def test_per_step_args_must_not_specialise():
    bc.check_unspecialized(_fake_jit(x="spec", layer="dns"), ["layer"])
    with pytest.raises(bc.SpecialisationError, match="layer"):
        bc.check_unspecialized(_fake_jit(layer="spec"), ["layer"])
    with pytest.raises(bc.SpecialisationError, match="epoch"):
        bc.check_unspecialized(_fake_jit(epoch="constexpr"), ["epoch"])
    with pytest.raises(bc.SpecialisationError, match="no argument"):
        bc.check_unspecialized(_fake_jit(), ["rank"])


def test_jit_cache_size_counts_variants():
    fn = SimpleNamespace(device_caches={0: ({"a": 1, "b": 2}, None), 1: ({"c": 3}, None)})
    assert bc.jit_cache_size(fn) == 3
    assert bc.jit_cache_size(object()) == 0


def test_host_runtime_imports_without_triton_or_cuda():
    import subprocess
    import sys

    code = (
        "import sys, mono_ext.runtime as r; "
        "import mono_ext.runtime.failstop, mono_ext.runtime.peers, mono_ext.runtime.build_cache; "
        "bad = [m for m in ('triton', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
