"""Build keys, the build cache, and the residency check.

Every build key compiles at startup; the hot path only looks kernels up. A compile (or a
module load) while a persistent kernel spins can deadlock the device: the spinning CTAs
wait for a launch that is stuck behind the loader. Triton specialises integer arguments
equal to 1 or divisible by 16, so any argument that changes between steps (epoch, rank,
layer) must live in device memory or be listed in ``do_not_specialize``;
:func:`check_unspecialized` enforces that, :func:`jit_cache_size` lets tests prove no
compile happened after warm-up.

A persistent launch whose CTAs wait on each other must be all-resident: :func:`check_residency`
refuses a grid larger than the SMs can hold at the kernel's occupancy.

Triton and torch are imported lazily: this module loads on a CPU-only box.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from mono_ext.core.spec import BuildKey  # one key type for specs, backends and this cache

__all__ = [
    "BuildCache",
    "DeviceLimits",
    "KernelResources",
    "NotBuiltError",
    "ResidencyError",
    "SpecialisationError",
    "blocks_per_sm",
    "check_residency",
    "check_unspecialized",
    "device_limits",
    "jit_cache_size",
    "kernel_resources",
    "source_digest",
]

T = TypeVar("T")


def layout_digest(layout: Any) -> str:
    """Stable digest of a :class:`~mono_ext.runtime.layout.Layout` (regions, offsets, world)."""
    items = sorted(layout.offsets.items())
    text = repr((layout.program.name, layout.world, layout.program.regions, items))
    return hashlib.sha256(text.encode()).hexdigest()


def source_digest(sources: Iterable[Any]) -> str:
    """sha256 over kernel sources: file paths, modules or functions (their defining file)."""
    h = hashlib.sha256()
    seen: set[str] = set()
    for src in sources:
        if isinstance(src, (str, Path)):
            path = Path(src)
        else:
            fn = getattr(src, "fn", src)  # a triton JITFunction keeps the Python function in .fn
            path = Path(inspect.getsourcefile(fn) or "")
        key = str(path.resolve())
        if key in seen:
            continue
        seen.add(key)
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class NotBuiltError(RuntimeError):
    """A launch asked for a key that was not built at startup (no JIT on the hot path)."""


class ResidencyError(RuntimeError):
    """A persistent launch could not be all-resident, so its hand-offs could deadlock."""


class SpecialisationError(RuntimeError):
    """A per-step integer argument would make Triton compile a new variant mid-step."""


class BuildCache(Generic[T]):
    """Compiles every key at startup, then only looks up.

    ``builder(key)`` compiles and loads one key (for Triton: ``warmup`` then load the module)
    and returns what the launch needs. After :meth:`seal`, building is refused.
    """

    def __init__(self, builder: Callable[[BuildKey], T], sources: Iterable[Any] = ()):
        self._builder = builder
        self.sources = source_digest(sources)
        self._built: dict[BuildKey, tuple[str, T]] = {}
        self._sealed = False

    def build_all(self, keys: Iterable[BuildKey]) -> None:
        for key in keys:
            if key in self._built:
                continue
            if self._sealed:
                raise NotBuiltError(
                    f"build {key.label()} requested after startup: compiling now could deadlock "
                    "against a spinning persistent kernel; add the key to the startup list"
                )
            self._built[key] = (key.digest(self.sources), self._builder(key))

    def seal(self) -> None:
        self._sealed = True

    def get(self, key: BuildKey) -> T:
        try:
            return self._built[key][1]
        except KeyError:
            known = ", ".join(k.label() for k in self._built) or "none"
            raise NotBuiltError(
                f"no build for {key.label()} (built: {known}); every key compiles at startup"
            ) from None

    def digest(self, key: BuildKey) -> str:
        return self._built[key][0]

    def __contains__(self, key: BuildKey) -> bool:
        return key in self._built

    def __len__(self) -> int:
        return len(self._built)


@dataclass(frozen=True)
class DeviceLimits:
    """Per-SM limits that bound occupancy (defaults: sm_90, H100/H200)."""

    sm_count: int
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 233472  # 228 KiB usable by blocks
    smem_reserved_per_block: int = 1024  # the driver keeps 1 KiB per resident block
    warp_size: int = 32
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of 256


@dataclass(frozen=True)
class KernelResources:
    regs_per_thread: int
    num_warps: int
    shared_bytes: int


def blocks_per_sm(res: KernelResources, dev: DeviceLimits) -> int:
    """How many CTAs of this kernel one SM holds at once (the occupancy calculator's rule)."""
    threads = res.num_warps * dev.warp_size
    by_threads = dev.max_threads_per_sm // threads
    regs_per_warp = -(-max(res.regs_per_thread, 1) * dev.warp_size // dev.reg_alloc_unit)
    regs_per_warp *= dev.reg_alloc_unit
    by_regs = dev.regs_per_sm // (regs_per_warp * res.num_warps)
    smem = res.shared_bytes + dev.smem_reserved_per_block
    by_smem = dev.smem_per_sm // smem
    return max(0, min(by_threads, by_regs, by_smem, dev.max_blocks_per_sm))


def check_residency(label: str, ctas: int, res: KernelResources, dev: DeviceLimits) -> int:
    """Refuse ``ctas`` concurrently-resident CTAs (all launches that wait on each other).

    Returns the CTAs per SM the kernel allows. For virtual TP pass ``ranks * grid``.
    """
    per_sm = blocks_per_sm(res, dev)
    capacity = per_sm * dev.sm_count
    if ctas > capacity:
        raise ResidencyError(
            f"{label}: {ctas} CTAs must be resident together but the device holds {capacity} "
            f"({dev.sm_count} SMs x {per_sm} per SM at {res.regs_per_thread} regs/thread, "
            f"{res.num_warps} warps, {res.shared_bytes} B shared): a CTA left unscheduled "
            "would make its peers spin until the deadline"
        )
    return per_sm


def device_limits(device: Any = None) -> DeviceLimits:
    """Read the limits of a CUDA device through torch (imported here, not at module load)."""
    import torch

    p = torch.cuda.get_device_properties(device)
    kw: dict[str, int] = {"sm_count": p.multi_processor_count}
    for ours, theirs in (
        ("regs_per_sm", "regs_per_multiprocessor"),
        ("max_threads_per_sm", "max_threads_per_multi_processor"),
        ("smem_per_sm", "shared_memory_per_multiprocessor"),
    ):
        value = getattr(p, theirs, None)
        if value:
            kw[ours] = int(value)
    return DeviceLimits(**kw)


def kernel_resources(compiled: Any) -> KernelResources:
    """Resources of a Triton CompiledKernel (loads its module if not loaded yet)."""
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()  # loads the module now, at build time, never mid-step
    return KernelResources(
        regs_per_thread=int(compiled.n_regs),
        num_warps=int(compiled.metadata.num_warps),
        shared_bytes=int(compiled.metadata.shared),
    )


def check_unspecialized(jit_fn: Any, names: Iterable[str]) -> None:
    """Refuse a Triton kernel whose per-step integer arguments are specialised."""
    params = {p.name: p for p in getattr(jit_fn, "params", [])}
    bad = []
    for name in names:
        p = params.get(name)
        if p is None:
            raise SpecialisationError(f"{jit_fn}: no argument {name!r}")
        # A constexpr is worse than a specialised int: every value is its own compile.
        if p.is_constexpr or not p.do_not_specialize:
            bad.append(name)
    if bad:
        raise SpecialisationError(
            f"{getattr(jit_fn, '__name__', jit_fn)}: per-step argument(s) {', '.join(bad)} are "
            "specialised (a value of 1 or a multiple of 16 compiles a new variant mid-step); "
            "add them to do_not_specialize or pass them in device memory"
        )


def jit_cache_size(jit_fn: Any) -> int:
    """Number of compiled variants a Triton JITFunction holds, over all devices."""
    caches = getattr(jit_fn, "device_caches", {})
    return sum(len(entry[0]) for entry in caches.values())
