"""K1 and K2 builds compiled without a device (``tools/ptx_digest.py``, the sm_90 CPU test).

Each :class:`OfflineBuild` is what a launch's ``build()`` hands ``warmup`` on the device: the
launch's own stand-in arguments and constexprs, the tensors on the CPU (same dtypes, 16-byte
aligned), for the Qwen3-Next-80B-A3B shapes at TP1 on an H200 (132 CTAs). ``width`` is the
``n_rows`` argument, which no build specialises: width 1 and 16 are one compile.

| build                 | what                                                               |
|-----------------------|--------------------------------------------------------------------|
| k1 gdn                | default: interleaved qkvz, fp32 vk state, time_chan conv state     |
| k1 gdn conv-chan_time | conv state [S, C, K-1] (strides are arguments: the same compile)   |
| k1 gdn contiguous     | contiguous qkvz / ba packing                                       |
| k1 gdn bf16-state     | bf16 recurrent state                                               |
| k1 gdn kv-state       | [Hv, Dk, Dv] state slots                                           |
| k1 gdn fp8_block128   | fp8 in_proj_qkvz, bf16 in_proj_ba (an FP8 checkpoint's mix)        |
| k1 gdn dv-split-4     | the recurrence as 4 tasks per (row, head), the gated norm after it |
| k1 gdn trace          | default with the trace stamps (``bench_k1.py --trace``)            |
| k1 gdn norm-once      | each row normed once and handed to every CTA (norm_once_above 0)   |
| k1 attn               | default                                                            |
| k1 attn fp8_block128  | fp8 qkv_proj                                                       |
| k1 attn trace         | the trace stamps, every CTA norming every row (norm_once_above 16: |
|                       | with the default's hand-off the stamps spill one word)             |
| k1 attn every-cta     | every CTA norms every row itself (norm_once_above 16)              |
| k2 gdn bf16           | default (out_proj)                                                 |
| k2 gdn fp8_block128   | out_proj, w13, w2 and the shared expert fp8 block-128              |
| k2 attn gated bf16    | the attention layers' build (o_proj, output gate folded into S1)   |
| k2 gdn bf16 down-prefetch-256k | each CTA prefetches the first 256 KB of its down rows only |
| k2 gdn bf16 no-router-prefetch | S1 prefetches nothing into L2 (the default: the router)     |
| k2 gdn bf16 prefetch-shared | S1 prefetches the shared gate_up into L2 too                    |
| k2 gdn bf16 router-preload | each CTA loads its router tile before S1's hand-offs (8 K splits) |
| k2 gdn bf16 narrow-steps | a one-row step takes its top-k in every CTA, steps of up to two   |
|                       | rows deal down runs from the last CTA (the narrow-step options)    |

Torch and Triton are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_BUILDS",
    "GRID",
    "OfflineBuild",
    "build_names",
    "offline_build",
    "offline_builds",
]

GRID = 132  # H200 SMs: one CTA per SM
PRESET = "qwen3-next-80b-a3b"
FP8_K2 = ("out_proj", "o_proj", "w13", "w2", "shared_gate_up", "shared_down")

#: name -> (kernel family, keyword arguments of its launch class)
_BUILDS: dict[str, tuple[str, dict]] = {
    "k1 gdn": ("k1 gdn", {}),
    "k1 gdn conv-chan_time": ("k1 gdn", {"conv": "chan_time"}),
    "k1 gdn contiguous": ("k1 gdn", {"packing": "contiguous"}),
    "k1 gdn bf16-state": ("k1 gdn", {"state_dtype": "bfloat16"}),
    "k1 gdn kv-state": ("k1 gdn", {"ssm_layout": "kv"}),
    "k1 gdn fp8_block128": ("k1 gdn", {"formats": {"in_proj_qkvz": "fp8_block128"}}),
    "k1 gdn dv-split-4": ("k1 gdn", {"config": {"dv_split": 4, "state_row_slices": 1}}),
    "k1 gdn trace": ("k1 gdn", {"config": {"trace": True}}),
    "k1 gdn norm-once": ("k1 gdn", {"config": {"norm_once_above": 0}}),
    "k1 attn": ("k1 attn", {}),
    "k1 attn fp8_block128": ("k1 attn", {"formats": {"qkv_proj": "fp8_block128"}}),
    "k1 attn trace": ("k1 attn", {"config": {"trace": True, "norm_once_above": 16}}),
    "k1 attn every-cta": ("k1 attn", {"config": {"norm_once_above": 16}}),
    "k2 gdn bf16": ("k2", {"kind": "gdn"}),
    "k2 gdn fp8_block128": (
        "k2",
        {"kind": "gdn", "formats": dict.fromkeys(FP8_K2, "fp8_block128")},
    ),
    "k2 gdn fp8_block128 a8": (
        "k2",
        {
            "kind": "gdn",
            "formats": dict.fromkeys(FP8_K2, "fp8_block128"),
            "config": {"fp8_activations": True},
        },
    ),
    "k2 attn gated bf16": ("k2", {"kind": "attn", "gated": True}),
    "k2 gdn bf16 down-prefetch-256k": (
        "k2",
        {"kind": "gdn", "config": {"prefetch": True, "down_prefetch_bytes": 256 * 1024}},
    ),
    "k2 gdn bf16 no-router-prefetch": (
        "k2",
        {"kind": "gdn", "config": {"prefetch_router": False}},
    ),
    "k2 gdn bf16 prefetch-shared": ("k2", {"kind": "gdn", "config": {"prefetch_shared": True}}),
    "k2 gdn bf16 router-preload": (
        "k2",
        {"kind": "gdn", "config": {"router_preload": True, "router_k_splits": 8}},
    ),
    "k2 gdn bf16 narrow-steps": (
        "k2",
        {"kind": "gdn", "config": {"down_runs_from_last_rows": 2, "local_topk_rows": 1}},
    ),
}
#: the builds a deployment of the 80B-A3B preset compiles by default
DEFAULT_BUILDS = ("k1 gdn", "k1 attn", "k2 gdn bf16")


@dataclass(frozen=True)
class OfflineBuild:
    name: str  # build name and width, e.g. "k2 gdn bf16 w16"
    label: str  # the launch's own label
    kernel: Any  # triton.JITFunction
    args: tuple
    constexprs: dict

    def compile(self, arch: int = 90) -> Any:
        from mono_ext.kernels.triton.offline import compile_offline

        return compile_offline(self.kernel, self.args, self.constexprs, arch)


def build_names() -> tuple[str, ...]:
    return tuple(_BUILDS)


def _set(kernel: Any, args: list, **named: Any) -> None:
    """Replace the arguments called ``named`` (by the kernel's parameter names)."""
    names = kernel.arg_names
    for name, value in named.items():
        args[names.index(name)] = value


def _dims() -> Any:
    from mono_ext.models.qwen3_next.configs import get_preset
    from mono_ext.models.qwen3_next.dims import Dims

    return Dims.from_config(get_preset(PRESET), tp=1)


def _k1(kind: str, kw: dict, width: int) -> OfflineBuild:
    import torch

    from mono_ext.models.qwen3_next.triton import k1 as k1m
    from mono_ext.runtime.peers import RankState

    d, dev, kw = _dims(), torch.device("cpu"), dict(kw)
    conv = kw.pop("conv", "time_chan")
    cfg = k1m.K1Config(grid=GRID, **kw.pop("config", {}))
    if kind == "k1 gdn":
        launch = k1m.K1GdnLaunch(k1m.K1GdnShape.from_dims(d), cfg, **kw)
    else:
        launch = k1m.K1AttnLaunch(k1m.K1AttnShape.from_dims(d), cfg, **kw)
        launch.rope = k1m.rope_table(launch.shape, launch.max_positions, dev)
    one = torch.zeros(16, dtype=torch.bfloat16, device=dev)
    ws = k1m.K1Workspace(torch.zeros(16, dtype=torch.int64, device=dev), one)
    st = RankState.create(0, dev, 1.0)
    args = list(launch._warmup_args(dev, one, ws, st.ctrl, st.health))
    kernel = launch._KERNEL
    _set(kernel, args, n_rows=width)
    if kind == "k1 gdn":  # a conv state of the real shape, in the build's layout
        s = launch.shape
        if conv == "time_chan":
            cs = torch.zeros(1, s.conv_k - 1, s.conv_dim, dtype=torch.bfloat16)
            cs_t, cs_c = cs.stride(1), cs.stride(2)
        else:
            cs = torch.zeros(1, s.conv_dim, s.conv_k - 1, dtype=torch.bfloat16)
            cs_t, cs_c = cs.stride(2), cs.stride(1)
        _set(kernel, args, conv_ptr=cs, cs_slot=cs.stride(0), cs_t=cs_t, cs_c=cs_c)
    return OfflineBuild("", launch.label(), kernel, tuple(args), launch._constexprs())


def _k2(kw: dict, width: int) -> OfflineBuild:
    import torch

    from mono_ext.models.qwen3_next.triton import k2 as k2m

    kw = dict(kw)
    cfg = k2m.K2Config(grid=GRID, **kw.pop("config", {}))
    launch = k2m.K2Launch(k2m.K2Shape.from_dims(_dims(), kw["kind"]), cfg, **kw)
    args = launch._warmup_args(torch.device("cpu"), n_rows=width)
    return OfflineBuild("", launch.label(), k2m.k2_kernel, args, launch._constexprs())


def offline_build(name: str, width: int) -> OfflineBuild:
    """The build ``name`` (see :func:`build_names`) at ``width`` rows."""
    import dataclasses
    import os

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("offline builds compile for the GPU: unset TRITON_INTERPRET")
    family, kw = _BUILDS[name]
    b = _k2(kw, width) if family == "k2" else _k1(family, kw, width)
    return dataclasses.replace(b, name=f"{name} w{width}")


def offline_builds(names: Iterable[str], widths: Iterable[int]) -> list[OfflineBuild]:
    return [offline_build(n, w) for n in names for w in widths]
