"""Environment markers by folder: a folder's conftest marks what it holds, so ``tools/test.sh``
selects each environment's tests with ``-m`` and a test module needs no marker of its own."""

from __future__ import annotations

from pathlib import Path

import pytest


def mark_folder(items, folder: Path, marker: str, modules=None) -> None:
    """Add ``marker`` to every item under ``folder`` (only ``modules``' items, where named).

    ``pytest_collection_modifyitems`` of any conftest sees the items of the whole session, so
    each folder picks its own out by path."""
    folder = folder.resolve()
    mark = getattr(pytest.mark, marker)
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.is_relative_to(folder) and (modules is None or path.name in modules):
            item.add_marker(mark)
