"""K2's build configuration: grid, tiles, pipeline depths and the options each A/B on a GPU
chose (one build per config; none of it changes per step). Its fields' comments cite the
measurements behind every default."""

from __future__ import annotations

from dataclasses import dataclass

from mono_ext.kernels.triton.limits import next_pow2
from mono_ext.models.qwen3_next.shapes import TailShape

__all__ = ["K2Config"]


@dataclass(frozen=True)
class K2Config:
    """Grid and tiles (one build per config; none of it changes per step).

    Every GEMV is ``W [tile_rows, K] @ x^T [K, Bb]``: weight rows are the MMA's M (64 rows
    over 4 warps: wgmma-sized, no warp re-reads another's weights), the rows of the batch its
    N. ``out_proj_k_splits`` (None: from the grid) splits out_proj's K so that S1 has about
    ``grid`` tasks; its partials are summed in a fixed order by the next stage. Device-side
    constexprs keep the short names (in ``_constexprs``: ``BN``, ``BN3``, ``KS2``, ...).
    """

    grid: int
    num_warps: int = 4
    tile_rows: int = 64  # weight rows per MMA tile of out_proj and the router (16 * num_warps)
    gate_up_rows: int = 64  # gate_up rows per task (half gate, half up): smaller = finer balance
    down_rows: int = 64  # down: H rows per (slot, H block) task
    out_proj_k_chunk: int = 256  # out_proj K chunk
    out_proj_k_splits: int | None = None  # out_proj K splits (power of two)
    # router K splits (a row's partial logits, summed in order by its top-k CTA): once the
    # norm came from the reduce tasks' sums, 4 was ahead of 2 and 8 at the widest steps in
    # two runs and level with 2 at the narrow ones (docs/results/k2_sweep_nir_h200.csv,
    # k2_router_splits_h200.csv)
    router_k_splits: int = 4
    router_k_chunk: int = 256  # router K chunk (within a split)
    # each CTA loads its router tile before S1's hand-offs instead of after the norm's wait:
    # needs one task per CTA of one K chunk (router_k_splits * router_k_chunk >= hidden,
    # experts / tile_rows * router_k_splits <= grid)
    router_preload: bool = False
    gate_up_k_chunk: int = 256  # gate_up K chunk
    down_i_chunk: int = 256  # down I chunk (its K)
    reduce_cols: int = 16  # H columns per reduce task (residual, MoE sum and output)
    act_rows_per_wait: int = 8  # (slot, row) activation rows per down-stage wait (power of two)
    # L2 prefetch of router/shared (after S1) and down planes (S4): off, since K2 was faster
    # without it at every width, 1-7 us (docs/results/k2_sweep_prefetch_h200.csv,
    # k2_vllm_8613b35.csv)
    prefetch: bool = False
    # the same L2 prefetch after S1 of the router alone, or of the shared gate_up alone
    # (both surely read, neither larger than 4 MB), without the down planes'. The router's:
    # on, since K2 was faster with it at every width on the H100 (3.6-4.2 us at width 1) and
    # at widths 2-8 on the H200, level at 1 and 16 (docs/results/k2_ab_c8efdfb_h100.csv,
    # k2_ab_52fb7be_h200.csv)
    prefetch_router: bool = True
    prefetch_shared: bool = False
    # in steps of at most this many rows, the down stage's runs of (slot, H block) tasks are
    # dealt from the last CTA: gate_up deals its tasks round-robin, so the lowest CTAs stream
    # its last round, whose blocks complete the last slots; reversed, those same CTAs take
    # the last slots' down runs and every other run reads slots the earlier rounds completed.
    # The same tasks and sums: bit-identical. Off: alone against neither it was 0.3-1.2 us
    # slower at every width (median of 6 paired H100 reps,
    # docs/results/k2_ab_counter_bitonic_h100.csv)
    down_runs_from_last_rows: int = 0
    # steps of at most this many rows skip the picks hand-off: every CTA takes every row's
    # top-k from the logits itself (the same sums and picks, serial in the rows). Off: 0.9 us
    # slower at width 1 and within 0.5 us elsewhere (same file). fp8_activations builds
    # publish at every width: their top-k CTA also quantizes its row
    local_topk_rows: int = 0
    # bytes of its run's down rows each CTA prefetches (0: the whole run); at width 16 the
    # whole runs add up to several times the L2, so early lines can be evicted before use
    down_prefetch_bytes: int = 0
    # weight chunks in flight (Triton pipeline stages) of each streamed GEMV
    out_proj_pipeline_stages: int = 4
    # router K chunks in flight per task: 3 was faster than 1 and 2 at every width (2-6%) in
    # docs/results/k2_sweep_owners_h200.csv
    router_pipeline_stages: int = 3
    gate_up_pipeline_stages: int = 4
    # down I chunks in flight: 3 was faster than 4 at every width, by 1.2-1.4 us at widths 1-4
    # and 3.5 / 5.5 us at 8 / 16 (median of 14 paired H100 reps), and than 2 at every width
    # (docs/results/k2_sweep_stages_h100.csv); the fp8 widening build level, the a8 build 11 us
    # slower at width 16 (docs/results/k2_down3_fp8_h100.csv)
    down_pipeline_stages: int = 3
    # fp8 block-128 expert planes (w13, w2 and the shared expert's) multiply e4m3
    # activations, quantized per row and 128 columns as vLLM's own fp8 MoE quantizes them, on
    # an e4m3 MMA read from shared memory; False: the codes widen to bf16 for a bf16 MMA with
    # bf16 activations. None: on exactly where every expert plane is fp8 block-128 and the
    # build's chunks allow it (True raises where they do not). Faster than widening at every
    # width on both cards measured (H100: 54 against 68 us at width 1, 244 against 389 at 16,
    # docs/results/k2_vllm_fp8_c9e46f6_h100.csv); False by default because widening is the
    # build whose 80B-shape tests have run on a GPU (docs/perf.md, "Not run")
    fp8_activations: bool | None = False
    trace: bool = False  # per-CTA %globaltimer stamps (benchmarks only; ws.trace)
    pdl: bool = False  # programmatic dependent launch (primitives.pdl_prologue)

    def splits(self, shape: TailShape) -> int:
        """out_proj's K splits for this shape: about one S1 task per CTA."""
        blocks = -(-shape.hidden // self.tile_rows)
        per_block = 1 << max(0, (max(1, self.grid // blocks)).bit_length() - 1)
        chunks = -(-shape.in_dim // self.out_proj_k_chunk)
        splits = self.out_proj_k_splits or min(per_block, max(1, next_pow2(chunks)))
        for name, v in (
            ("out_proj_k_splits", splits),
            ("gate_up_rows", self.gate_up_rows),
            ("down_rows", self.down_rows),
        ):
            if v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        return splits
