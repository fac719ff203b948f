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
