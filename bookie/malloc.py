"""The bookie process's malloc settings: big buffers reused from the heap, not mapped afresh.

A batch read answers with frames of up to a few MiB (a 512-entry batch of 1 KiB entries is
~540 KiB) and reads the records behind them in spans as big. glibc serves an allocation above its
mmap threshold with a fresh ``mmap`` (the threshold starts at 128 KiB and follows the sizes freed),
and gives the heap top back to the system once more than twice that is free: either way the next
buffer of that size is faulted in page by page again. Measured (``benchmarks/read_cpu.py --side
bookie --count 512``, docs/benchmarks.md): ~0.5 page faults per entry read, +1.2 µs of CPU per
entry. Fixed thresholds above the frame size keep such buffers on the heap; at most
``TRIM_THRESHOLD_BYTES`` of freed heap stays mapped.

Called once by ``bookie``'s ``main``; a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 16 * 1024 * 1024
"""Above the largest frame (and record) a bookie builds, so none of them is a fresh mapping."""
TRIM_THRESHOLD_BYTES = 32 * 1024 * 1024
"""Freed heap kept for reuse before the top is given back (bounds what this adds to the RSS)."""


def keep_big_buffers() -> bool:
    """Set the thresholds (glibc's ``mallopt``); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
