"""Compile a Triton kernel for an NVIDIA target without a device (``ptx_digest``, CPU tests).

The arguments are bound and specialised by the kernel's own binder, exactly as a launch's
``warmup`` on the device would (CPU stand-in tensors give the same pointer dtypes and 16-byte
alignment), then compiled for ``GPUTarget("cuda", arch, 32)``; no driver is touched.

:func:`normalised_ptx` drops what names source files or lines (``.loc``, ``.file``, debug
sections, comments), so two sources that generate the same code digest the same.
:func:`resources` reads registers, stack, spill instructions and shared memory from the cubin
with the ``cuobjdump`` Triton ships; :func:`sass_by_function` says how much of the code each
source function inlined into it is (``nvdisasm`` line info). Triton is imported inside the
functions: the module loads on a box without it.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "OfflineResources",
    "compile_offline",
    "normalised_ptx",
    "ptx_digest",
    "resources",
    "sass_by_function",
    "sass_opcodes",
]


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


def _cuobjdump(compiled: Any, *flags: str) -> str:
    """``cuobjdump`` of a compiled kernel's cubin, as text."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        return subprocess.run([_tool("cuobjdump"), *flags, str(path)], check=True,
                              capture_output=True, text=True).stdout  # fmt: skip


def resources(compiled: Any) -> OfflineResources:
    """Resource facts of a compiled kernel from its cubin (``cuobjdump -res-usage`` and the
    SASS), and the shared memory Triton allocates (its metadata)."""
    usage = _cuobjdump(compiled, "-res-usage")
    sass = _cuobjdump(compiled, "-sass")
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    return OfflineResources(
        regs=int(fields["REG"]),
        stack=int(fields["STACK"]),
        spill_stores=len(re.findall(r"\bSTL(\.\w+)*\s", sass)),
        spill_loads=len(re.findall(r"\bLDL(\.\w+)*\s", sass)),
        shared=int(compiled.metadata.shared),
        num_warps=int(compiled.metadata.num_warps),
    )


# one SASS instruction line: /*0a70*/ [@P0 | @!P1 | @UP2] OPCODE.MODIFIERS operands ;
_SASS_OP = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def sass_opcodes(compiled: Any) -> dict[str, int]:
    """How often each SASS opcode (with its modifiers, e.g. ``QGMMA.64x16x32.F32.E4M3.E4M3``)
    occurs in a compiled kernel: what a test asserts when a design relies on an instruction."""
    counts: dict[str, int] = {}
    for op in _SASS_OP.findall(_cuobjdump(compiled, "-sass")):
        counts[op] = counts.get(op, 0) + 1
    return counts


# nvdisasm -g: "//## File "PATH", line N" before the instructions that line generated
_SASS_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


def _functions(path: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of every function defined at the top of a source file;
    none where the file is not there to read."""
    import ast

    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError):
        return []
    return [(n.lineno, n.end_lineno or n.lineno, n.name) for n in tree.body
            if isinstance(n, ast.FunctionDef)]  # fmt: skip


def sass_by_function(compiled: Any) -> dict[str, int]:
    """SASS instructions of a compiled kernel by the source function that generated them
    (``file.py:function``; every jitted helper is inlined, so this is where the
    kernel's code size comes from), from the cubin's line info; ``?`` where none is given."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([_tool("nvdisasm"), "-c", "-g", str(path)], check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
    spans: dict[str, list[tuple[int, int, str]]] = {}
    counts: dict[str, int] = {}
    where = "?"
    for line in text.splitlines():
        m = _SASS_LINE.search(line)
        if m:
            file, lineno = m.group(1), int(m.group(2))
            if file not in spans:
                spans[file] = _functions(file)
            name = next((f for a, b, f in spans[file] if a <= lineno <= b), "?")
            where = f"{Path(file).name}:{name}"
        elif _SASS_OP.match(line):
            counts[where] = counts.get(where, 0) + 1
    return counts
