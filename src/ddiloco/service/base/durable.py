"""Making a file system change durable: the one directory fsync (a rename or a new file is on
disk only once its folder is)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(d: Path) -> None:
    """fsync the folder ``d`` (its entries: names made, renamed or removed in it)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
