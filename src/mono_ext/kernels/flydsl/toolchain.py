"""Offline gfx950 compilation of FlyDSL launches and the checks on what the compiler made.

FlyDSL compiles without a GPU when ``COMPILE_ONLY=1`` and ``ARCH`` name the target; the last
step links the code object with ``$ROCM_PATH/llvm/bin/ld.lld``. Where no ROCm is installed
(CI, a laptop), :func:`ensure_lld` puts a two-line shim there that runs the LLD bundled in the
``ziglang`` wheel. ``FLYDSL_DEBUG_DUMP_ASM=1`` makes FlyDSL write the final ISA of every kernel
(``<dump dir>/<kernel>/*_final_isa.s``); its ``.amdgpu_metadata`` block is what
:func:`parse_isa` reads and :func:`check_kernel` judges:

| check          | source (ISA metadata)                              | limit (``limits.GFX950``)    |
|----------------|----------------------------------------------------|------------------------------|
| no spills      | ``.vgpr_spill_count``, ``.sgpr_spill_count``       | 0                            |
| no scratch     | ``.private_segment_fixed_size``,                   | 0, false                     |
|                | ``.uses_dynamic_stack``                            |                              |
| LDS            | ``.group_segment_fixed_size``                      | 160 KiB per CU, all CTAs on  |
|                |                                                    | a CU together                |
| residency      | unified VGPRs (``.vgpr_count``/``.agpr_count``,    | ``grid`` CTAs at most         |
|                | ``.amdhsa_accum_offset``), waves per CTA           | ``per_cu`` per CU over 256   |
|                | (``.max_flat_workgroup_size``)                     | CUs, all resident at once    |

A persistent launch spins on hand-offs from other CTAs, so a grid that is not resident as a
whole can deadlock: the residency check is a correctness check, not a performance one.

The compile itself runs LLVM in this process; :func:`compile_offline` sets FlyDSL's
environment for the call only and restores it after. No flydsl import at module import.

Launching (the backend's binding): ``flyc.compile`` *runs* a launch whose arguments are all
scalars (ours are addresses and ints), so a compile at build time would launch on null
addresses. :func:`compile_offline` therefore takes FlyDSL's compile-without-running path
(``JitFunction._compile_only``) and wraps the artifact into the ``CompiledFunction`` that
``flyc.compile`` returns for placeholder arguments; with ``load=True`` (a gfx950 device) it
also loads the code object now, not at the first launch (a module load while a persistent
kernel spins can deadlock). Those are FlyDSL internals of the version CI pins (0.5.0),
gathered in :func:`_compiled_function`; the loading was never run (no AMD GPU here).
:func:`dry_launch` is what a launch does on a CPU: the arguments are checked against the
launch's parameters, packed the way the ``CompiledFunction`` packs them for the device, and
bound and traced by FlyDSL under ``COMPILE_ONLY``, which must reuse the build's artifact.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .limits import GFX950, ArchLimits

__all__ = [
    "CompileCheckError",
    "Compiled",
    "KernelMeta",
    "ToolchainError",
    "argument_reasons",
    "check_kernel",
    "compile_offline",
    "dry_launch",
    "ensure_lld",
    "flydsl_available",
    "launch_params",
    "parse_isa",
]

_SHIM_DIR = "mono_ext-rocm"  # under sys.prefix: <prefix>/mono_ext-rocm/llvm/bin/ld.lld


class ToolchainError(RuntimeError):
    """FlyDSL, the linker or the target cannot be set up for an offline compile."""


class CompileCheckError(RuntimeError):
    """A kernel compiled but breaks a gfx950 limit (every reason listed)."""

    def __init__(self, label: str, reasons: Sequence[str]):
        self.label = label
        self.reasons = tuple(reasons)
        super().__init__(f"{label}: " + "; ".join(reasons))


def flydsl_available() -> tuple[bool, str]:
    """(importable here, version or why not), without importing it."""
    import importlib.metadata as md
    import importlib.util

    if importlib.util.find_spec("flydsl") is None:
        return False, "flydsl is not installed (pip install flydsl; tools/ci/install_flydsl.sh)"
    return True, md.version("flydsl")


def ensure_lld() -> Path:
    """A ROCm-like root whose ``llvm/bin/ld.lld`` runs; returns it (the ``ROCM_PATH`` to use).

    ``$ROCM_PATH`` (else ``/opt/rocm``) wins when it has an ``ld.lld`` (a real ROCm install).
    Otherwise a shim
    ``<sys.prefix>/mono_ext-rocm/llvm/bin/ld.lld`` that runs ``python -m ziglang ld.lld``.
    """
    for env_root in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if env_root and (Path(env_root) / "llvm" / "bin" / "ld.lld").exists():
            return Path(env_root)
    root = Path(sys.prefix) / _SHIM_DIR
    shim = root / "llvm" / "bin" / "ld.lld"
    if shim.exists():
        return root
    import importlib.util

    if importlib.util.find_spec("ziglang") is None:
        raise ToolchainError(
            "no ld.lld: ROCM_PATH names none and the ziglang package (which bundles LLD) is "
            "not installed; pip install ziglang or set ROCM_PATH to a ROCm install"
        )
    shim.parent.mkdir(parents=True, exist_ok=True)
    tmp = shim.with_name(f"ld.lld.{os.getpid()}")
    tmp.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ziglang ld.lld "$@"\n')
    tmp.chmod(0o755)
    os.replace(tmp, shim)  # atomic: parallel workers may race here
    return root


@contextlib.contextmanager
def _flydsl_env(dump_dir: Path, arch: str, offline: bool = True) -> Iterator[None]:
    want = {
        "COMPILE_ONLY": "1" if offline else None,  # None: unset (a device compile)
        "ARCH": arch,
        "FLYDSL_DEBUG_DUMP_ASM": "1",
        "FLYDSL_DUMP_DIR": str(dump_dir),
        "FLYDSL_DUMP_IR": "0",
        "FLYDSL_RUNTIME_ENABLE_CACHE": "0",  # nothing cached across runs: every key compiles
        "ROCM_PATH": str(ensure_lld()),
    }
    old = {k: os.environ.get(k) for k in want}
    _set_env(want)
    try:
        yield
    finally:
        _set_env(old)


def _set_env(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@dataclass(frozen=True)
class KernelMeta:
    """What the ISA metadata says about one kernel."""

    name: str
    vgpr_count: int  # architectural VGPRs
    agpr_count: int  # accumulation VGPRs (same unified file on gfx950)
    accum_offset: int  # first AGPR in the unified file (0 when unknown)
    sgpr_count: int
    vgpr_spill_count: int
    sgpr_spill_count: int
    lds_bytes: int  # .group_segment_fixed_size
    scratch_bytes: int  # .private_segment_fixed_size
    dynamic_stack: bool
    workgroup_size: int  # .max_flat_workgroup_size

    @property
    def unified_vgprs(self) -> int:
        """VGPRs one lane holds in the unified file (arch, then AGPRs from accum_offset)."""
        if self.agpr_count == 0:
            return self.vgpr_count
        base = self.accum_offset or -(-self.vgpr_count // 4) * 4
        return max(self.vgpr_count, base + self.agpr_count)

    def waves_per_cta(self, arch: ArchLimits = GFX950) -> int:
        return -(-self.workgroup_size // arch.wave_size)

    def ctas_per_cu(self, arch: ArchLimits = GFX950) -> int:
        """How many CTAs of this kernel one CU holds at once (0: not even one)."""
        granule = arch.vgpr_granule
        alloc = max(granule, -(-self.unified_vgprs // granule) * granule)
        waves_per_simd = min(arch.max_waves_per_simd, arch.vgprs_per_simd_lane // alloc)
        simd_waves = -(-self.waves_per_cta(arch) // arch.simds_per_cu)  # per SIMD, per CTA
        by_vgpr = waves_per_simd // simd_waves if simd_waves else 0
        by_lds = arch.lds_bytes_per_cu // self.lds_bytes if self.lds_bytes else by_vgpr
        return min(by_vgpr, by_lds)

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "unified_vgprs": self.unified_vgprs}


_META_INT = {
    "vgpr_count": "vgpr_count",
    "agpr_count": "agpr_count",
    "sgpr_count": "sgpr_count",
    "vgpr_spill_count": "vgpr_spill_count",
    "sgpr_spill_count": "sgpr_spill_count",
    "group_segment_fixed_size": "lds_bytes",
    "private_segment_fixed_size": "scratch_bytes",
    "max_flat_workgroup_size": "workgroup_size",
}
_REQUIRED = ("vgpr_count", "sgpr_count", "lds_bytes", "scratch_bytes", "workgroup_size")


def parse_isa(text: str) -> list[KernelMeta]:
    """Every kernel described in an ISA listing's ``.amdgpu_metadata`` block.

    Raises ValueError when the block is missing or a kernel lacks a field the checks need:
    a listing the checks cannot read must not pass them.
    """
    m = re.search(r"^\s*\.amdgpu_metadata\s*$(.*?)^\s*\.end_amdgpu_metadata", text, re.M | re.S)
    if m is None:
        raise ValueError("no .amdgpu_metadata block in the ISA listing")
    accum = dict(re.findall(r"\.amdhsa_kernel\s+(\S+).*?\.amdhsa_accum_offset\s+(\d+)", text, re.S))
    kernels: list[dict[str, Any]] = []
    in_kernels = False
    for line in m.group(1).splitlines():
        if re.match(r"^amdhsa\.kernels:", line):
            in_kernels = True
            continue
        if re.match(r"^\S", line):  # the next top-level key ends the kernel list
            in_kernels = False
        if not in_kernels:
            continue
        item = re.match(r"^  - (\.\S+):\s*(.*)$", line)
        if item:
            kernels.append({})
            key, value = item.groups()
        else:
            field_ = re.match(r"^    (\.\S+):\s*(.*)$", line)
            if not field_ or not kernels:
                continue
            key, value = field_.groups()
        kernels[-1][key[1:]] = value.strip()
    out = []
    for k in kernels:
        name = k.get("name")
        if not name:
            raise ValueError("a kernel in .amdgpu_metadata has no .name")
        vals: dict[str, Any] = {}
        for src, dst in _META_INT.items():
            if src in k:
                vals[dst] = int(k[src])
        missing = [f for f in _REQUIRED if f not in vals]
        if missing:
            raise ValueError(f"kernel {name}: ISA metadata lacks {missing}")
        out.append(
            KernelMeta(
                name=name,
                vgpr_count=vals["vgpr_count"],
                agpr_count=vals.get("agpr_count", 0),
                accum_offset=int(accum.get(name, 0)),
                sgpr_count=vals["sgpr_count"],
                vgpr_spill_count=vals.get("vgpr_spill_count", 0),
                sgpr_spill_count=vals.get("sgpr_spill_count", 0),
                lds_bytes=vals["lds_bytes"],
                scratch_bytes=vals["scratch_bytes"],
                dynamic_stack=k.get("uses_dynamic_stack", "false") == "true",
                workgroup_size=vals["workgroup_size"],
            )
        )
    if not out:
        raise ValueError("the ISA metadata lists no kernel")
    return out


def check_kernel(
    meta: KernelMeta, *, grid: int, per_cu: int = 1, arch: ArchLimits = GFX950
) -> list[str]:
    """Every gfx950 limit ``meta`` breaks for a persistent launch of ``grid`` CTAs placed
    ``per_cu`` to a CU (empty: it passes)."""
    reasons = []
    if meta.vgpr_spill_count or meta.sgpr_spill_count:
        reasons.append(
            f"spills {meta.vgpr_spill_count} VGPRs and {meta.sgpr_spill_count} SGPRs to scratch"
        )
    if meta.scratch_bytes or meta.dynamic_stack:
        reasons.append(
            f"uses scratch ({meta.scratch_bytes} bytes per lane"
            + (", dynamic stack" if meta.dynamic_stack else "")
            + ")"
        )
    if meta.lds_bytes * per_cu > arch.lds_bytes_per_cu:
        reasons.append(
            f"LDS {meta.lds_bytes} bytes x {per_cu} CTA(s) per CU exceeds "
            f"{arch.lds_bytes_per_cu} ({arch.lds_bytes_per_cu // 1024} KiB)"
        )
    if meta.sgpr_count > arch.max_sgprs:
        reasons.append(f"{meta.sgpr_count} SGPRs exceed {arch.max_sgprs}")
    fits = meta.ctas_per_cu(arch)
    if fits < per_cu:
        reasons.append(
            f"{per_cu} CTA(s) of {meta.workgroup_size} threads with {meta.unified_vgprs} VGPRs "
            f"and {meta.lds_bytes} bytes LDS do not fit on one CU (fits {fits})"
        )
    if grid > arch.cus * per_cu:
        reasons.append(f"grid {grid} exceeds {arch.cus} CUs x {per_cu}: not all resident")
    return reasons


@dataclass
class Compiled:
    """One offline compile: the ISA listing of each kernel it emitted and their metadata, the
    ``@flyc.jit`` launch it compiled, and FlyDSL's ``CompiledFunction`` of it (``launcher``:
    loaded and callable with the launch's arguments and a stream on a gfx950 device only)."""

    label: str
    grid: int
    per_cu: int
    isa: dict[str, str] = field(default_factory=dict)  # kernel name -> listing
    kernels: list[KernelMeta] = field(default_factory=list)
    launch: Any = None
    launcher: Any = None
    cache_key: Any = None  # FlyDSL's key of the artifact (a dry launch must reuse it)

    def reasons(self, arch: ArchLimits = GFX950) -> list[str]:
        return [
            f"{k.name}: {r}"
            for k in self.kernels
            for r in check_kernel(k, grid=self.grid, per_cu=self.per_cu, arch=arch)
        ]

    def check(self, arch: ArchLimits = GFX950) -> Compiled:
        """Raise :class:`CompileCheckError` with every breach; return self when clean."""
        reasons = self.reasons(arch)
        if reasons:
            raise CompileCheckError(self.label, reasons)
        return self


def compile_offline(
    launch: Callable[..., Any],
    args: Sequence[Any],
    *,
    label: str,
    grid: int,
    per_cu: int = 1,
    hints: dict[str, Any] | None = None,
    arch: str = GFX950.arch,
    load: bool = False,
) -> Compiled:
    """Compile the ``@flyc.jit`` ``launch`` with ``args`` for ``arch`` and read back every
    kernel's ISA and metadata; nothing is launched. ``load``: also load the code object onto
    the current device (a gfx950 GPU; never run here). A compile error propagates (as FlyDSL
    raises it)."""
    ok, why = flydsl_available()
    if not ok:
        raise ToolchainError(why)
    jf = _jit_function(launch)
    if hints:  # what flyc.compile[hints] does
        jf.compile_hints = {**jf.compile_hints, **hints}
    dump = Path(tempfile.mkdtemp(prefix="mono_ext-flydsl-"))
    try:
        with _flydsl_env(dump, arch, offline=not load):
            jf._compile_only(*args)
            launcher, key = _compiled_function(jf, args)
            if load:
                launcher._keepalive._get_func_exe()  # hipModuleLoad now, not at a launch
        out = Compiled(label=label, grid=grid, per_cu=per_cu, launch=launch, launcher=launcher,
                       cache_key=key)  # fmt: skip
        for path in sorted(dump.rglob("*final_isa.s")):
            text = path.read_text()
            for meta in parse_isa(text):
                out.isa[meta.name] = text
                out.kernels.append(meta)
        if not out.kernels:
            raise ToolchainError(f"{label}: FlyDSL wrote no ISA listing under {dump}")
        return out
    finally:
        shutil.rmtree(dump, ignore_errors=True)


# -- launching: FlyDSL internals (0.5.0) in one place ----------------------------------------


def _jit_function(launch: Any) -> Any:
    from flydsl.compiler.jit_function import _unwrap_jit_function

    jf, _ = _unwrap_jit_function(launch)
    if jf is None:
        raise TypeError(f"expected a @flyc.jit launch, got {type(launch).__name__}")
    return jf


def _compiled_function(jf: Any, args: Sequence[Any]) -> tuple[Any, Any]:
    """(``CompiledFunction``, artifact key) of the specialisation ``jf._compile_only(*args)``
    just made: what ``flyc.compile`` returns for placeholder arguments (its runtime state is
    made at the first call, from the packing spec of ``args``' types)."""
    try:
        key = jf._last_compiled[0]
        bound = jf._sig.bind(*args)
        bound.apply_defaults()
        jf._resolve_arguments(bound.arguments)
        return jf._make_compiled_function(key, bound, None), key
    except (AttributeError, TypeError) as exc:
        import importlib.metadata as md

        raise ToolchainError(
            f"FlyDSL {md.version('flydsl')}: its compile-without-launch internals changed "
            f"(written against 0.5.0): {exc}"
        ) from exc


_KINDS = {"Int64": "i64", "Int32": "i32", "Stream": "stream"}


def launch_params(launch: Any) -> list[tuple[str, str]]:
    """(name, ``i64`` | ``i32`` | ``stream``) of every parameter of a ``@flyc.jit`` launch.
    In this backend's launches every ``i64`` parameter is a byte address."""
    import inspect

    out = []
    for name, p in inspect.signature(_jit_function(launch).func).parameters.items():
        ann = p.annotation if isinstance(p.annotation, str) else p.annotation.__name__
        if ann not in _KINDS:
            raise TypeError(f"parameter {name}: {ann} is none of {sorted(_KINDS)}")
        out.append((name, _KINDS[ann]))
    return out


def argument_reasons(launch: Any, args: Sequence[Any]) -> list[str]:
    """Every way ``args`` (positional, the stream last) do not fit the launch's parameters:
    count, non-int values, int64 values that are not addresses, int32 range (FlyDSL's own
    packing accepts floats and wraps overflow silently)."""
    params = launch_params(launch)
    if len(args) != len(params):
        names = ", ".join(n for n, _ in params)
        return [f"{len(args)} arguments for the {len(params)} parameters ({names})"]
    bad = []
    for (name, kind), v in zip(params, args, strict=True):
        if kind == "stream":
            if not (v is None or isinstance(v, int) or hasattr(v, "cuda_stream")):
                bad.append(f"{name}={v!r} is not a stream")
        elif type(v) is not int:
            bad.append(f"{name}={v!r} is not an int")
        elif kind == "i64" and not 0 < v < 2**63:
            bad.append(f"{name}={v:#x} is not a device address")
        elif kind == "i32" and not -(2**31) <= v < 2**31:
            bad.append(f"{name}={v} does not fit int32")
    return bad


def dry_launch(c: Compiled, args: Sequence[Any], arch: str = GFX950.arch) -> list[Any]:
    """A launch of ``c`` on a CPU: check ``args`` (:func:`argument_reasons`), pack them as
    ``c.launcher`` packs them for the device (returns the packed values, in ABI order), then
    call the ``@flyc.jit`` launch under ``COMPILE_ONLY``: FlyDSL binds the arguments to the
    parameters, traces, and returns without launching. It must find the build's artifact: a
    call that made a new specialisation raises (no compile after the build)."""
    bad = argument_reasons(c.launch, args)
    if bad:
        raise ValueError(f"{c.label}: " + "; ".join(bad))
    packed = []
    for index, ctype, fill in c.launcher._call_spec:
        slot = ctype()
        if fill is not None:
            fill(args[index], slot)
        packed.append(slot.value)
    jf = _jit_function(c.launch)
    dump = Path(tempfile.mkdtemp(prefix="mono_ext-flydsl-"))
    try:
        with _flydsl_env(dump, arch):
            from flydsl.expr.typing import Stream

            c.launch(*args[:-1], Stream(args[-1]))
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    if jf._last_compiled[0] != c.cache_key:
        raise ToolchainError(f"{c.label}: the launch compiled a new specialisation")
    return packed
