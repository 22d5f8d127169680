"""gfx950 (AMD Instinct MI355X) limits every FlyDSL launch is checked against at build.

No flydsl import: host-side refusals, the plugin's probe and the metadata checks read these
on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GFX950", "ArchLimits", "BLOCK", "MAX_WIDTH", "PER_STEP_ARGS", "WAVES"]


@dataclass(frozen=True)
class ArchLimits:
    arch: str
    cus: int  # compute units of the product the grid is sized for (one CTA each)
    simds_per_cu: int
    wave_size: int
    vgprs_per_simd_lane: int  # unified VGPR + AGPR file, per lane of one SIMD
    vgpr_granule: int  # allocation granule of the unified file
    max_waves_per_simd: int
    max_sgprs: int  # addressable SGPRs of one wave (what the compiler may use)
    lds_bytes_per_cu: int
    realtime_hz: int  # s_memrealtime: the constant 100 MHz reference clock

    def ns_to_ticks(self, ns: int) -> int:
        return ns * self.realtime_hz // 1_000_000_000


GFX950 = ArchLimits(
    arch="gfx950",
    cus=256,
    simds_per_cu=4,
    wave_size=64,
    vgprs_per_simd_lane=512,
    vgpr_granule=8,
    max_waves_per_simd=8,
    max_sgprs=102,
    lds_bytes_per_cu=160 * 1024,
    realtime_hz=100_000_000,
)

#: Threads per CTA of every persistent launch: one wave per SIMD of a CU.
BLOCK = 256
#: Waves per CTA (4): each owns 16 MFMA rows of a task.
WAVES = BLOCK // GFX950.wave_size
#: Rows one K1/K2 build serves (the step widths 1..16, as the Triton backend).
MAX_WIDTH = 16
#: Launch arguments that change between steps or layers: passed by value, never Constexpr.
PER_STEP_ARGS = ("n_rows", "layer", "layers_per_step")
