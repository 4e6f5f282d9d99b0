"""Giving back to the system the memory a save, a load or a build freed.

Gathers and scatters allocate and free blocks of 2 to 32 MB; glibc's allocator keeps freed blocks below its mmap
threshold in the heap, so a process's resident memory stays at its peak after a save although nothing is in use.
``malloc_trim(0)`` releases them. Elsewhere (another C library) this does nothing; ``MALLOC_MMAP_THRESHOLD_``
(docs/keras.md, "Memory") does the same for every allocation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from typing import Any, Optional

log = logging.getLogger("keras_dtensor_mixfix")


@functools.lru_cache(maxsize=None)
def _trim() -> Optional[Any]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def return_freed_memory() -> None:
    """Release the heap's free blocks to the system (glibc's ``malloc_trim``); a no-op where there is none."""
    trim = _trim()
    if trim is not None:
        trim(0)
