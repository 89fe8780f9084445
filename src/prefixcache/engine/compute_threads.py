"""One team of torch compute threads at a time: the engine thread's.

OpenMP (torch's libgomp) keeps a pool of worker threads for every thread that has run a
parallel region. Once the pools hold more threads than there are cores, libgomp stops
letting idle workers spin, and each of a decode step's ~120 parallel regions waits for a
sleeping worker to wake: a server whose main thread built the model and whose engine
thread decodes ran at half the speed of one thread doing both (docs/profiles/decode.md).
`release_pool` frees the calling thread's pool before another thread takes over the work.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, not only park them


def release_pool() -> bool:
    """Free this thread's OpenMP worker threads (they come back if it computes again).

    False where torch's OpenMP is not libgomp, or is older than OpenMP 5.0.
    """
    try:
        libgomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # torch's, already loaded
        pause = libgomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    if pause(_OMP_PAUSE_HARD) != 0:
        log.debug("omp_pause_resource_all refused (inside a parallel region?)")
        return False
    return True
