"""The whole suite: Triton kernels with NVIDIA PTX are not for a ROCm device.

The Triton kernels carry NVIDIA PTX (inline asm for the bounded waits, tagged stores,
%globaltimer): on a ROCm build of torch (the MI355X Buildkite step) the tests under
``PTX_FOLDERS`` are skipped with that reason rather than failing; the flydsl backend's GPU
tests are its own. The folders' own conftests hold their fixtures and environment markers.
"""

import pytest

#: the folders whose tests run or compile Triton kernels (paths as pytest reports them)
PTX_FOLDERS = ("tests/kernels/triton/", "tests/models/qwen3_next/triton/")


def pytest_collection_modifyitems(config, items):
    try:
        import torch
    except ImportError:
        return
    if getattr(torch.version, "hip", None):
        skip = pytest.mark.skip(reason="Triton kernels with NVIDIA PTX: not for a ROCm device")
        for item in items:
            path = str(item.fspath).replace("\\", "/")
            if any(folder in path for folder in PTX_FOLDERS):
                item.add_marker(skip)
