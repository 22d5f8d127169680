"""The SGLang adapter (``sglang`` marker: the sglang environment of tools/test.sh): SGLang's own
model classes, weight loading, memory pools and dispatch built on CPU
(tests/engines/_support/sglang_common.py), and the engine on a GPU. Modules skip themselves
where SGLang, or the release they are written for, is not installed."""

from pathlib import Path

from tests._support.markers import mark_folder

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    mark_folder(items, HERE, "sglang")
