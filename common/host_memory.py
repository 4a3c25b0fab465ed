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
returned and faulted back. It is the reuse that jemalloc and tcmalloc (``LD_PRELOAD``) give as well.

The price is resident memory: after the peak step the process stays at its peak instead of falling back between
steps. Under CPU or NVMe offload the host also holds the optimizer state, and there keeping raised the resident
memory between steps (bench/allocator_offload.py), so such a run keeps glibc's defaults unless asked
(:func:`keeps_freed_memory_by_default`). ``common.process_setup.setup_process`` applies it at the start of every
recipe; a user's own ``MALLOC_*`` variables or ``GLIBC_TUNABLES`` for malloc win, ``ZR_KEEP_FREED_MEMORY=off`` turns
it off everywhere and ``=on`` keeps freed memory on offload runs too.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

SWITCH_ENV = "ZR_KEEP_FREED_MEMORY"  # "off" leaves glibc's defaults, "on" keeps freed memory on offload runs too
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


def offloads_to_host(ds_config: dict[str, Any]) -> bool:
    """Whether a resolved DeepSpeed config puts the optimizer state or the parameters in host memory (or on NVMe,
    through host buffers)."""
    zero = ds_config.get("zero_optimization", {})
    return any(
        str(zero.get(section, {}).get("device", "none")).lower() in ("cpu", "nvme")
        for section in ("offload_optimizer", "offload_param")
    )


def keeps_freed_memory_by_default(ds_config: dict[str, Any]) -> bool:
    """Whether a run with ``ds_config`` keeps freed host memory unless ``ZR_KEEP_FREED_MEMORY`` says otherwise.

    Not under CPU or NVMe offload: there the host holds the optimizer state as well as the step's activations, and
    keeping what the peak step freed raised the resident memory between steps (docs/benchmarks.md,
    "allocator-offload"), which is what such a run is short of first.
    """
    return not offloads_to_host(ds_config)


def switch_setting(environ: dict[str, str] | os._Environ = os.environ) -> bool | None:
    """``ZR_KEEP_FREED_MEMORY``: True for ``on``, False for ``off``, None when unset (the run's default)."""
    value = environ.get(SWITCH_ENV, "").strip().lower()
    if value in ("off", "0", "false", "no"):
        return False
    if value in ("on", "1", "true", "yes"):
        return True
    return None


def keep_freed_memory(by_default: bool = True) -> bool:
    """Make glibc keep the memory a step frees for the next step (module docstring).

    Args:
        by_default: whether to keep it when ``ZR_KEEP_FREED_MEMORY`` is unset (:func:`keeps_freed_memory_by_default`
            for a run's config); ``on`` and ``off`` override it.

    Returns:
        Whether the thresholds are set: False off glibc, when the user configured malloc, or when switched off.
        Calling it again changes nothing.
    """
    chosen = switch_setting()
    if not (by_default if chosen is None else chosen) or user_configured_malloc():
        return False
    libc = ctypes.CDLL(None)  # the malloc this process uses
    if not hasattr(libc, "gnu_get_libc_version"):  # musl, macOS: another allocator, other parameters
        return False
    # mallopt returns 1 on success; a value out of its range (a glibc built otherwise) leaves the default.
    return bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
