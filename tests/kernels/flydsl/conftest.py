"""Generic FlyDSL device code: the gfx950 ISA parser and residency arithmetic (no compiler, base
environment), and, in ``COMPILES``, the toolchain and runtime primitives compiled offline for
gfx950. Those carry the ``flydsl_compile`` marker and run in the ``flydsl`` environment; where
flydsl is not installed they are not collected."""

import importlib.util
from pathlib import Path

from tests._support.markers import mark_folder

HERE = Path(__file__).parent
COMPILES = ("test_toolchain.py", "test_runtime_compile.py")

collect_ignore: list[str] = []
if importlib.util.find_spec("flydsl") is None:
    collect_ignore = list(COMPILES)


def pytest_collection_modifyitems(config, items):
    mark_folder(items, HERE, "flydsl_compile", COMPILES)
