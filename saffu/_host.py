"""The host allocator: keep freed memory mapped, so an XLA program's buffers are not page-faulted
in afresh at every call.

XLA's CPU runtime allocates a compiled program's temporaries (a training step's activations:
hundreds of MB) at each call and frees them after. glibc's ``malloc`` serves blocks that large
with ``mmap`` and gives them back with ``munmap`` (or trims them from a thread's arena), so every
step touches that memory as new pages: about 100,000 page faults a step for the default
transformer, a sixth of its time on one core (``experiments/bench_train.py``). Told not to map
large blocks, not to trim and to keep one arena, glibc reuses the same pages call after call, as
tcmalloc does. The settings are process-wide, cost nothing where no large block is freed, and
change no result; ``SAFFU_HOST_MALLOC=default`` leaves glibc as it is.
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt(3) parameters
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_applied: bool | None = None


def keep_host_memory() -> bool:
    """Set glibc's allocator to keep freed memory (no ``mmap`` for large blocks, no trimming,
    one arena) once per process; returns whether it is set (False off glibc, where
    ``mallopt`` fails, or with ``SAFFU_HOST_MALLOC=default``). Takes full effect when called
    before JAX starts its CPU backend (``import saffu`` does it)."""
    global _applied
    if _applied is None:
        _applied = False
        if os.environ.get("SAFFU_HOST_MALLOC", "") != "default" and platform.libc_ver()[0] == "glibc":
            try:
                mallopt = ctypes.CDLL("libc.so.6").mallopt
            except OSError:
                return False
            _applied = all(mallopt(option, value) == 1 for option, value in
                           ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))
    return _applied
