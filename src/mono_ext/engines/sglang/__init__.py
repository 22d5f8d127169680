"""The SGLang adapter: views of SGLang's objects, in-place binding, the dispatching forward.

Modules (one concern each; none contains math):

============  ================================================================================
flags         ``--monokernel`` / ``--monokernel-backend`` (SGLang 0.5.17), carried to workers
plugin        the ``sglang.srt.plugins`` entry point for 0.5.17: HookRegistry hooks
native_api    the ``nvidia_megakernel`` entry point: SGLang 0.5.23's kernel-plugin API
hooks         the run-time hooks both register: FailStop after ``ModelRunner.forward``, report
views         core views (config, model, caches, step) from SGLang objects
binding       weights, GDN states and step slots bound in place
serving       the three refusal stages, the build and the driver, per model and rank
dispatch      the dispatching ``model.forward`` and the check after CUDA-graph capture
check         check mode's calls into SGLang's own layer code
report        what mono_ext did on each rank, written on ``collective_rpc("mono_ext_report")``
============  ================================================================================

Importing this package imports neither SGLang nor torch.
"""

from __future__ import annotations

__all__ = ["has_native_api"]


def has_native_api() -> bool:
    """True for SGLang releases with the kernel-plugin API (0.5.23 and later)."""
    import importlib.util

    try:
        return importlib.util.find_spec("sglang.kernels.plugin_kernels.nvidia.spec") is not None
    except ModuleNotFoundError:
        return False
