"""Compile a Triton kernel for an NVIDIA target without a device (``ptx_digest``, CPU tests).

The arguments are bound and specialised by the kernel's own binder, exactly as a launch's
``warmup`` on the device would (CPU stand-in tensors give the same pointer dtypes and 16-byte
alignment), then compiled for ``GPUTarget("cuda", arch, 32)``; no driver is touched.

:func:`normalised_ptx` drops what names source files or lines (``.loc``, ``.file``, debug
sections, comments), so two sources that generate the same code digest the same.
:func:`resources` reads registers, stack, spill instructions and shared memory from the cubin
with the ``cuobjdump`` Triton ships. Triton is imported inside the functions: the module loads
on a box without it.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["OfflineResources", "compile_offline", "normalised_ptx", "ptx_digest", "resources"]


def compile_offline(kernel: Any, args: tuple, constexprs: dict, arch: int = 90) -> Any:
    """``kernel`` (a ``triton.JITFunction``) compiled for ``arch`` with the specialisation a
    launch with ``args`` and ``constexprs`` (options such as ``num_warps`` included) gets."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(constexprs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, cx, attrs = kernel._pack_args(backend, kwargs, bound, specialization,
                                                      options)  # fmt: skip
    src = ASTSource(kernel, signature, cx, attrs)
    return compile(src, target=target, options=options.__dict__)


_DROP = re.compile(r"^\s*(\.loc\b|\.file\b|//|$)")
_DEBUG_LABEL = re.compile(r"^\$L__(tmp\d+|func_begin\d+|func_end\d+):$")  # DWARF ranges only


def normalised_ptx(ptx: str) -> str:
    """The PTX without line info, file names, comments, DWARF sections and the labels only
    DWARF refers to (their count follows the inlining tree, not the code)."""
    out = []
    depth, in_debug = 0, False  # inside a ``.section .debug_* { ... }``
    for line in ptx.splitlines():
        s = line.split("//", 1)[0].strip()
        if s.startswith(".section") and ".debug" in s:
            in_debug, depth = True, 0
        if in_debug:
            depth += s.count("{") - s.count("}")
            if depth <= 0 and ("}" in s or (s.startswith(".section") and "{" in s)):
                in_debug = False
            continue
        if _DROP.match(line) or _DEBUG_LABEL.match(s):
            continue
        out.append(line.split("//", 1)[0].rstrip())
    return "\n".join(out) + "\n"


def ptx_digest(compiled: Any) -> str:
    return hashlib.sha256(normalised_ptx(compiled.asm["ptx"]).encode()).hexdigest()


@dataclass(frozen=True)
class OfflineResources:
    regs: int  # registers per thread
    stack: int  # bytes of stack frame per thread (where spills go)
    spill_stores: int  # STL instructions in the SASS
    spill_loads: int  # LDL instructions in the SASS
    shared: int  # bytes of shared memory per block (Triton's allocation)
    num_warps: int


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resources(compiled: Any) -> OfflineResources:
    """Resource facts of a compiled kernel from its cubin (``cuobjdump -res-usage`` and the
    SASS), and the shared memory Triton allocates (its metadata)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(path)], check=True,
                               capture_output=True, text=True).stdout  # fmt: skip
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(path)], check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    return OfflineResources(
        regs=int(fields["REG"]),
        stack=int(fields["STACK"]),
        spill_stores=len(re.findall(r"\bSTL(\.\w+)*\s", sass)),
        spill_loads=len(re.findall(r"\bLDL(\.\w+)*\s", sass)),
        shared=int(compiled.metadata.shared),
        num_warps=int(compiled.metadata.num_warps),
    )
