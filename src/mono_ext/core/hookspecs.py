"""pluggy hook specifications: how a package adds model specs and kernel backends.

A third-party distribution declares an entry point in group ``mono_ext`` whose
target is a module (or object) with ``@hookimpl`` functions below; it needs no
change to this repository.
"""

from __future__ import annotations

import pluggy

PROJECT = "mono_ext"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def mono_ext_model_specs():
    """Return a list of ModelSpec subclasses this plugin provides."""


@hookspec
def mono_ext_kernel_backends():
    """Return a list of KernelBackend records this plugin provides."""
