"""Giving freed memory back to the OS (glibc's ``malloc_trim``).

Fragments of a large model are tens of MB, below glibc's mmap threshold once it has adapted
(up to 32 MiB), so a freed fragment stays in the process's heap: a syncer that receives,
merges and drops fragments all day grows its resident memory with the heap's fragmentation,
not with what it holds. The processes trim at each status write; elsewhere (another libc)
this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

_libc: Any = None
_tried = False


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; False where the C library cannot."""
    global _libc, _tried
    if not _tried:
        _tried = True
        try:
            name = ctypes.util.find_library("c")
            lib = ctypes.CDLL(name) if name else None
            _libc = lib if lib is not None and hasattr(lib, "malloc_trim") else None
        except OSError:
            _libc = None
    if _libc is None:
        return False
    return bool(_libc.malloc_trim(0))


def resident_bytes() -> int:
    """This process's resident memory now (``/proc``; 0 where that is not readable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_resident_bytes() -> int:
    """This process's peak resident memory since it started (``VmHWM``; 0 where not readable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class PeakWatch:
    """The process's peak resident size and the phase of its work it was reached in: a phase
    is noted as it ends (and at each status write), so a rise of the peak since the last note
    belongs to the phase noted."""

    def __init__(self) -> None:
        self.bytes = 0
        self.phase = ""

    def note(self, phase: str) -> None:
        now = peak_resident_bytes()
        if now > self.bytes:
            self.bytes, self.phase = now, phase
