"""K1's attention front on the stream engine's deal: host side (checks, build, launch).

The device program (``k1_stream_kernel.py``, Gluon, sm_90) streams each CTA's share of the
weight chunks (``kernels.triton.stream_schedule.ChunkDeal``) through a loader warp's TMA ring
into one consumer warpgroup's wgmma. The launch takes the same tensors as
:class:`mono_ext.models.qwen3_next.triton.k1.K1AttnLaunch` and writes the same outputs, with
bf16 ``qkv_proj`` planes; what it refuses, it names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from mono_ext.kernels.triton.limits import BLOCK_B, SHARED_PER_BLOCK
from mono_ext.kernels.triton.stream_schedule import ChunkDeal
from mono_ext.models.qwen3_next.triton.k1_plan import K1AttnShape, rope_table

__all__ = ["K1AttnStreamLaunch", "StreamConfig"]

# the largest box a TMA copy takes per dimension: a chunk is one box tall
TMA_BOX_MAX = 256
# the launch's warps besides the loader's: one consumer warpgroup, wgmma's unit
NUM_WARPS = 4


@dataclass(frozen=True)
class StreamConfig:
    """How the launch streams (one build per config): the chunk shape, the ring's depth, the
    input norm's column groups, the loader warp's registers, how much of the ring it
    requests before the rows are normed, and how a head's last CTA loads its parts."""

    k_chunk: int = 64  # columns per chunk (a TMA copy is at most 64: one 128-byte row)
    chunk_rows: int | None = None  # rows per chunk and tile; None: a head's (head_dim)
    stages: int = 3  # ring slots
    norm_groups: int = 4  # the input norm's column groups (registers against round trips)
    loader_regs: int = 40  # registers the loader warp keeps after reallocation
    # the loader requests this many chunks, then waits until the rows are normed; None: the
    # whole ring from the start (the norm's loads then wait behind it)
    chunks_before_norm: int | None = None
    # a head's parts loaded all at once by its last part's CTA (a static loop over the deal's
    # most parts, masked); off: one L2 round trip per part, twice for a q or k head
    parts_at_once: bool = False


@dataclass
class K1AttnStreamLaunch:
    """One attention-front build on ``ctas`` CTAs (at most one per SM: its SMEM takes one).

    The parts' scratch and counters belong to the build: its launches must run one after
    another (one stream), as a rank's decode steps do; a second stream needs a second build.
    """

    shape: K1AttnShape
    ctas: int
    config: StreamConfig = StreamConfig()
    max_positions: int = 8192
    positions_dtype: str = "int64"
    trace: bool = False  # stamp k1_stream_kernel.TRACE_POINTS per CTA into ``stamps``
    deal: ChunkDeal = field(init=False)
    rope: Any = field(init=False, default=None)
    parts: Any = field(init=False, default=None)
    count: Any = field(init=False, default=None)
    stamps: Any = field(init=False, default=None)
    _descs: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        bad = self.refusals()
        if bad:
            raise ValueError("k1 attention stream front: " + "; ".join(bad))
        s = self.shape
        tiles = (2 * s.hq + 2 * s.hkv) * (s.head_dim // self.chunk_rows)
        self.deal = ChunkDeal(tiles, s.hidden // self.config.k_chunk, self.ctas)

    @property
    def chunk_rows(self) -> int:
        return self.config.chunk_rows or self.shape.head_dim

    @property
    def heads(self) -> int:
        """q, gate, k and v heads: the launch's units of output."""
        return 2 * self.shape.hq + 2 * self.shape.hkv

    def refusals(self) -> list[str]:
        s, c = self.shape, self.config
        bad = list(s.refusals())
        d = s.head_dim
        if d & (d - 1) or d < 64:  # wgmma's M per warpgroup
            bad.append(f"head_dim={d}: heads of whole tiles need a power of two >= 64")
        cr = c.chunk_rows or d
        if cr not in (64, 128, 256) or d % cr:
            bad.append(
                f"chunk_rows={cr}: a tile is 64, 128 or {TMA_BOX_MAX} rows (wgmma M, TMA box) "
                f"dividing head_dim {d}"
            )
        if c.k_chunk & (c.k_chunk - 1) or c.k_chunk < 16:
            bad.append(f"k_chunk={c.k_chunk}: a power of two >= 16")
        if s.hidden % (c.k_chunk * c.norm_groups):
            bad.append(
                f"hidden={s.hidden} is not a multiple of k_chunk {c.k_chunk} x norm_groups "
                f"{c.norm_groups}"
            )
        if self.positions_dtype not in ("int32", "int64"):
            bad.append(f"positions_dtype={self.positions_dtype}: int32 or int64")
        hold = c.chunks_before_norm
        if hold is not None and not 0 <= hold <= c.stages:
            bad.append(f"chunks_before_norm={hold}: 0..stages ({c.stages}), or None")
        if self.smem_bytes() > SHARED_PER_BLOCK:
            bad.append(f"needs {self.smem_bytes()} B of SMEM, over {SHARED_PER_BLOCK}")
        return bad

    def smem_bytes(self) -> int:
        """The ring and the resident x^T. The compiler adds the barriers and the input norm's
        layout-change scratch (its own choice, at most one column group of x^T in fp32)."""
        s, c = self.shape, self.config
        return c.stages * self.chunk_rows * c.k_chunk * 2 + s.hidden * BLOCK_B * 2

    def label(self) -> str:
        s, c = self.shape, self.config
        return (
            f"k1 attn stream h{s.hidden} hq{s.hq} hkv{s.hkv} d{s.head_dim} rd{s.rotary_dim} "
            f"ctas{self.ctas} cr{self.chunk_rows} bk{c.k_chunk} ns{c.stages} "
            f"ng{c.norm_groups}"
            + ("" if c.chunks_before_norm is None else f" hold{c.chunks_before_norm}")
            + (" parts1" if c.parts_at_once else "")
        )

    def build(self, device: Any = "cuda") -> None:
        """The RoPE table, the parts' scratch and zeroed counters, then one launch on stand-in
        tensors, so the kernel is compiled and loaded before any step."""
        import torch

        dev = torch.device(device)
        s, deal = self.shape, self.deal
        self.rope = rope_table(s, self.max_positions, dev)
        self.parts = torch.empty(
            deal.tiles * deal.max_parts * BLOCK_B * self.chunk_rows,
            dtype=torch.float32,
            device=dev,
        )
        self.count = torch.zeros(self.heads, dtype=torch.int32, device=dev)
        self.stamps = torch.zeros(self.ctas, 16, dtype=torch.int64, device=dev)
        bf = torch.bfloat16
        qd, kvd = s.hq * s.head_dim, s.hkv * s.head_dim
        one = torch.zeros(1, s.hidden, dtype=bf, device=dev)
        w = {
            "input_layernorm": torch.zeros(s.hidden, dtype=bf, device=dev),
            "qkv_proj": torch.zeros(s.qkv_rows, s.hidden, dtype=bf, device=dev),
            "q_norm": torch.zeros(s.head_dim, dtype=bf, device=dev),
            "k_norm": torch.zeros(s.head_dim, dtype=bf, device=dev),
        }
        outs = [torch.empty(1, n, dtype=bf, device=dev) for n in (qd, kvd, kvd, qd)]
        pos = torch.zeros(1, dtype=getattr(torch, self.positions_dtype), device=dev)
        self.launch(one, None, w, pos, *outs, torch.empty_like(one))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self._descs.clear()

    def _desc(self, w: Any) -> Any:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        key = (w.data_ptr(), tuple(w.shape))
        desc = self._descs.get(key)
        if desc is None:
            block = [self.chunk_rows, self.config.k_chunk]
            layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
            desc = self._descs[key] = TensorDescriptor.from_tensor(w, block, layout)
        return desc

    def check(self, hidden, residual, weights, positions, q, k, v, gate, residual_out) -> int:
        """The step's rows, after every tensor's shape, dtype and layout is what the kernel
        reads and writes; a ValueError names the first that is not."""
        import torch

        s, bf = self.shape, torch.bfloat16
        n = hidden.shape[0] if hidden.dim() == 2 else -1
        qd, kvd = s.hq * s.head_dim, s.hkv * s.head_dim
        want = {
            "hidden": (hidden, (n, s.hidden), bf),
            "residual_out": (residual_out, (n, s.hidden), bf),
            "q": (q, (n, qd), bf),
            "gate": (gate, (n, qd), bf),
            "k": (k, (n, kvd), bf),
            "v": (v, (n, kvd), bf),
            "input_layernorm": (weights["input_layernorm"], (s.hidden,), bf),
            "qkv_proj": (weights["qkv_proj"], (s.qkv_rows, s.hidden), bf),
            "q_norm": (weights["q_norm"], (s.head_dim,), bf),
            "k_norm": (weights["k_norm"], (s.head_dim,), bf),
        }
        if residual is not None:
            want["residual"] = (residual, (n, s.hidden), bf)
        if not 1 <= n <= BLOCK_B:
            raise ValueError(f"{self.label()}: {n} rows; a step takes 1..{BLOCK_B}")
        for name, (t, shape, dtype) in want.items():
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(
                    f"{self.label()}: {name} is {tuple(t.shape)} {t.dtype}"
                    f"{'' if t.is_contiguous() else ' non-contiguous'}, wants {shape} {dtype}"
                    " contiguous"
                )
        pos_dtype = getattr(torch, self.positions_dtype)
        if tuple(positions.shape) != (n,) or positions.dtype != pos_dtype:
            raise ValueError(
                f"{self.label()}: positions are {tuple(positions.shape)} {positions.dtype}, the "
                f"build takes [{n}] {pos_dtype}"
            )
        return n

    @functools.cached_property
    def constexprs(self) -> dict:
        """The build's constexprs, made once: a launch passes them as they are."""
        from triton.experimental.gluon import language as gl

        s, c = self.shape, self.config
        return dict(
            H=s.hidden, HQ=s.hq, HKV=s.hkv, D=s.head_dim, RD=s.rotary_dim, BB=BLOCK_B,
            BK=c.k_chunk, NS=c.stages, MAXP=self.deal.max_parts, NG=c.norm_groups,
            X_LAYOUT=gl.NVMMASharedLayout.get_default_for([c.k_chunk, BLOCK_B], gl.bfloat16),
            LOADER_REGS=c.loader_regs, TRACE=self.trace,
            HOLD=-1 if c.chunks_before_norm is None else c.chunks_before_norm,
            UNROLL=c.parts_at_once,
        )  # fmt: skip

    def compile_offline(self, arch: int = 90) -> Any:
        """The kernel compiled for ``arch`` without a device, specialised as a launch is
        (16-byte aligned pointers; the per-step integers not specialised)."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon._runtime import GluonASTSource

        from mono_ext.models.qwen3_next.triton.k1_stream_kernel import k1_attn_stream_kernel

        cx = self.constexprs
        block = [self.chunk_rows, self.config.k_chunk]
        w_layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        pos = "*i32" if self.positions_dtype == "int32" else "*i64"
        types = {
            "hid_ptr": "*bf16", "res_ptr": "*bf16", "rout_ptr": "*bf16", "nw_ptr": "*bf16",
            "w_desc": f"tensordesc<bf16[{block[0]}, {block[1]}],{w_layout!r}>",
            "qn_ptr": "*bf16", "kn_ptr": "*bf16", "rope_ptr": "*fp32", "pos_ptr": pos,
            "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "gate_ptr": "*bf16",
            "parts_ptr": "*fp32", "count_ptr": "*i32", "trace_ptr": "*i64", "n_rows": "i32",
            "has_res": "i32",
            "max_pos": "i32", "eps": "fp32",
        }  # fmt: skip
        signature = {**types, **{name: "constexpr" for name in cx}}
        aligned = [i for i, t in enumerate(types.values()) if t.startswith("*")]
        src = GluonASTSource(
            k1_attn_stream_kernel,
            signature,
            constexprs=cx,
            attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
        )
        options = {"num_warps": NUM_WARPS}
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)

    def launch(self, hidden, residual, weights, positions, q, k, v, gate, residual_out, *,
               validate: bool = True) -> None:  # fmt: skip
        n = hidden.shape[0]
        if validate:
            n = self.check(hidden, residual, weights, positions, q, k, v, gate, residual_out)
        head = (hidden, hidden if residual is None else residual, residual_out,
                weights["input_layernorm"])  # fmt: skip
        tail = (n, int(residual is not None), self.max_positions, float(self.shape.eps))
        outs = (weights["q_norm"], weights["k_norm"], self.rope, positions, q, k, v, gate)
        from mono_ext.models.qwen3_next.triton.k1_stream_kernel import k1_attn_stream_kernel

        k1_attn_stream_kernel[(self.ctas,)](
            *head, self._desc(weights["qkv_proj"]), *outs, self.parts, self.count, self.stamps,
            *tail, num_warps=NUM_WARPS, **self.constexprs,
        )  # fmt: skip
