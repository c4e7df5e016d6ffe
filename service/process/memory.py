"""A worker's resident memory: reading it, and handing freed heap back to the system.

glibc keeps what a large request freed (tokenising two 100k-character texts on a worker thread
left +85 MB resident, for good) until `malloc_trim` returns it: 174 -> 89 MB in 15 ms, measured
by a script beside a thread's tokenising. The handler trims after requests that large, at most
once a second; the supervisor's recycling (`max_worker_rss_mb`) reads `rss_mb`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
TRIM_EVERY_S = 1.0


def rss_mb() -> float:
    """This process's resident memory in MiB (Linux; 0 where /proc is absent)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE / 2**20
    except OSError:
        return 0.0


def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


class Trimmer:
    """Return freed heap to the system (`trim`, off the event loop), at most once a second
    (`due`, on it)."""

    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._last = -TRIM_EVERY_S

    def due(self) -> bool:
        now = time.monotonic()
        if self._trim is None or now - self._last < TRIM_EVERY_S:
            return False
        self._last = now
        return True

    def trim(self) -> None:
        if self._trim is not None:
            self._trim(0)
