"""glibc's allocator in a process that frees and allocates the same large tensors every step (`ray.keep_freed_memory`).

A CPU tensor of more than glibc's mmap threshold is its own `mmap`, and freed memory at the top of the heap beyond
the trim threshold goes back to the OS; both thresholds start at 128 KiB and only grow as mmapped chunks are freed
(the trim threshold to twice the mmap one). Every step's activations then come back as fresh pages the kernel must
fault in and zero: on the tiny SD3 rollout, 320k page faults a rollout and 13 % of its time
(`benchmarks/rollout_overhead_pipelines.py`). Fixing the thresholds high keeps freed memory in the process for the
next step, as `torch.backends.xeon.run_cpu` does by preloading jemalloc with its decay set to never. The cost: the
process's RSS stays at its peak.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # glibc's ceiling: 32 MiB on 64-bit
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: return heap memory to the OS only past 2 GiB free at its top


def keep_freed_memory() -> bool:
    """Fix glibc's mmap threshold at its ceiling (chunks up to 32 MiB come from the heap) and its trim threshold
    at 2 GiB, for the rest of this process. Returns whether it applied: False where the C library is not glibc
    (macOS, musl), which keeps its own policy."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it)
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                          TRIM_THRESHOLD))
