"""tests/flydsl: offline gfx950 compiles through FlyDSL. They run in the ``flydsl`` environment
(tools/ci/install_flydsl.sh, a stage of tools/test.sh); where flydsl is not installed the
folder is not collected (the base environment runs tests/unit, which covers the parts of the
backend that need no compiler)."""

import importlib.util

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("flydsl") is None:
    collect_ignore_glob = ["test_*.py"]
