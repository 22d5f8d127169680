"""Qwen3-Next's flydsl backend: its K1/K2 compiled offline for gfx950 through FlyDSL, the launch
binding's dry run, and the device tests (which skip without an MI355X). They carry the
``flydsl_compile`` marker and run in the ``flydsl`` environment (tools/ci/install_flydsl.sh, a
stage of tools/test.sh); where flydsl is not installed the folder is not collected (the base
environment runs the parts of the backend that need no compiler: tests/kernels/flydsl,
tests/plugins)."""

import importlib.util
from pathlib import Path

from tests._support.markers import mark_folder

HERE = Path(__file__).parent

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("flydsl") is None:
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config, items):
    mark_folder(items, HERE, "flydsl_compile")
