"""Host memory a training step frees stays with the process, so the next step does not page-fault it back in.

glibc's ``malloc`` returns memory to the kernel when enough of it is free at the top of the heap (``M_TRIM_THRESHOLD``,
128 KiB at first, raised as the program frees large blocks, at most 64 MiB), and it serves a large request with a
fresh ``mmap`` (``M_MMAP_THRESHOLD``, which moves the same way). A training step on a CPU allocates its activations
and gradients and frees them all at the end of the step, every step: whatever glibc handed back is mapped again by
the next step, one minor page fault (and a zeroed page) per 4 KiB, and that is CPU time of the training thread.
How much depends on the order of frees, so it differs between loops that do the same arithmetic: under glibc's
defaults Lightning's stage-2 loop faulted about twice as often as raw DeepSpeed's, which made its step dearer in CPU
time (bench/overhead.py measures both settings side by side: docs/benchmarks.md, "overhead").

How much glibc gives back under its defaults also depends on the torch build: where a step's blocks come from and
what else lives at the top of the heap are decided by everything the process allocated before. A test loop of 1 MiB
tensors faulted nearly every page of its second step under the CPU build of torch 2.13 and about 6 % under the
default (CUDA) build of torch 2.14.1; docs/benchmarks.md has the training-step figures for both builds.

:func:`keep_freed_memory` fixes both thresholds (which also stops glibc moving them): memory freed at the top of the
heap is kept up to 2 GiB, and only blocks of 32 MiB and more (glibc's largest dynamic threshold) get an ``mmap`` of
their own, so the steps reuse the heap pages of the step before and few faults are left. Peak resident memory is
what the peak step needs, as before; what changes is that the memory stays resident between steps instead of being
returned and faulted back. It is the reuse that jemalloc and tcmalloc (``LD_PRELOAD``) give as well. Both factory
adapters call it; a user's own ``MALLOC_*`` variables or ``GLIBC_TUNABLES`` for malloc win, and
``ZR_KEEP_FREED_MEMORY=off`` turns it off.
"""

from __future__ import annotations

import ctypes
import os

SWITCH_ENV = "ZR_KEEP_FREED_MEMORY"  # "off" leaves glibc's defaults
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc malloc.h)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: keep up to 2 GiB free at the top of the heap
MMAP_THRESHOLD = 32 * 2**20  # glibc's own ceiling for its dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")


def user_configured_malloc(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether the user chose the allocator's behaviour themselves (glibc's variables, its tunables, or another
    allocator preloaded): then it is theirs."""
    if any(name in environ for name in USER_SETTINGS):
        return True
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return True
    return any(name in environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc"))


def keep_freed_memory() -> bool:
    """Make glibc keep the memory a step frees for the next step (module docstring). Returns whether the thresholds
    are set: False off glibc, when the user configured malloc, or with ``ZR_KEEP_FREED_MEMORY=off``. Calling it
    again changes nothing."""
    if os.environ.get(SWITCH_ENV, "").lower() == "off" or user_configured_malloc():
        return False
    libc = ctypes.CDLL(None)  # the malloc this process uses
    if not hasattr(libc, "gnu_get_libc_version"):  # musl, macOS: another allocator, other parameters
        return False
    # mallopt returns 1 on success; a value out of its range (a glibc built otherwise) leaves the default.
    return bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
