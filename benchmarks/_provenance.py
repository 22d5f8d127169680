"""Where a benchmark result came from: device, date, commit and command (docs/results/ files)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's commit (``--dirty`` when edited); the device copy of a working tree has no
    git metadata, so ``MONO_EXT_COMMIT`` set by the caller names it there."""
    if os.environ.get("MONO_EXT_COMMIT"):
        return os.environ["MONO_EXT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def provenance(device: str) -> dict:
    return {
        "device": device,
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "command": " ".join(["python", *sys.argv]),
    }
