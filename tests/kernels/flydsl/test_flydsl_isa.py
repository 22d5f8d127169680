"""The gfx950 ISA metadata parser and the residency arithmetic (no compiler needed)."""

import pytest

from mono_ext.kernels.flydsl.limits import GFX950
from mono_ext.kernels.flydsl.toolchain import KernelMeta, check_kernel, parse_isa


def _listing(name="k_0", vgpr=40, agpr=0, accum=40, lds=0, scratch=0, spills=0, wg=256):
    return f"""\t.amdhsa_kernel {name}
\t\t.amdhsa_group_segment_fixed_size {lds}
\t\t.amdhsa_accum_offset {accum}
\t.end_amdhsa_kernel
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .agpr_count:     {agpr}
    .args:
      - .offset:         0
        .size:           8
        .value_kind:     by_value
    .group_segment_fixed_size: {lds}
    .max_flat_workgroup_size: {wg}
    .name:           {name}
    .private_segment_fixed_size: {scratch}
    .sgpr_count:     20
    .sgpr_spill_count: 0
    .uses_dynamic_stack: false
    .vgpr_count:     {vgpr}
    .vgpr_spill_count: {spills}
    .wavefront_size: 64
amdhsa.target:   amdgcn-amd-amdhsa-unknown-gfx950
amdhsa.version:
  - 1
  - 2
...
\t.end_amdgpu_metadata
"""


def test_parse_reads_every_field_the_checks_use():
    (k,) = parse_isa(_listing(vgpr=40, agpr=8, accum=40, lds=4096, wg=256))
    assert (k.name, k.vgpr_count, k.agpr_count, k.accum_offset) == ("k_0", 40, 8, 40)
    assert (k.lds_bytes, k.scratch_bytes, k.workgroup_size, k.sgpr_count) == (4096, 0, 256, 20)
    assert k.unified_vgprs == 48  # AGPRs sit after accum_offset in the unified file
    assert check_kernel(k, grid=GFX950.cus) == []


def test_parse_refuses_listings_it_cannot_judge():
    with pytest.raises(ValueError, match="no .amdgpu_metadata"):
        parse_isa("\ts_endpgm\n")
    with pytest.raises(ValueError, match="lacks"):
        parse_isa(_listing().replace("    .vgpr_count:     40\n", ""))


@pytest.mark.parametrize(
    "vgprs,wg,fits",
    [(128, 256, 4), (256, 256, 2), (512, 256, 1), (512, 512, 0), (64, 1024, 2)],
)
def test_ctas_per_cu_from_the_unified_vgpr_file(vgprs, wg, fits):
    # 512 VGPRs per SIMD lane; a CTA of wg threads puts ceil(wg/64/4) waves on every SIMD
    (k,) = parse_isa(_listing(vgpr=vgprs, accum=vgprs, wg=wg))
    assert k.ctas_per_cu() == fits
    reasons = check_kernel(k, grid=GFX950.cus, per_cu=1)
    assert (reasons == []) == (fits >= 1)


def test_every_breach_is_named():
    k = KernelMeta("bad", 600, 0, 0, 110, 3, 1, 200_000, 16, True, 256)
    text = "; ".join(check_kernel(k, grid=GFX950.cus + 1))
    for part in ("spills 3 VGPRs and 1 SGPRs", "scratch (16 bytes", "dynamic stack",
                 "LDS 200000", "110 SGPRs", "do not fit", "not all resident"):  # fmt: skip
        assert part in text, part
