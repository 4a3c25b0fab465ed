"""common/host_memory.py: memory a step frees is reused by the next step instead of being faulted back in.

The property is measured, not assumed: a child process runs two "steps" (allocate 200 MiB of 1 MiB tensors, free
them all, as a training step does with its activations) and counts the minor page faults of the second.

Whether glibc's defaults give that memory back depends on the torch build, not only on glibc: with the CPU build
(torch 2.13.0+cpu) nearly every page of the second step faults again; with the default CUDA build of torch 2.14.1
only about 6 % do, because what that build allocates on the way leaves the freed pages in the heap. So the premise
is made to hold rather than hoped for: a child that pins glibc's start-up thresholds (128 KiB, what every glibc
process begins with) must fault nearly every page, and keep_freed_memory called after that must bring the faults
down. The build's own defaults are measured too: where its premise does not hold the test says so (a warning in
pytest's summary) and checks what still holds, that keeping the memory is never worse than the defaults.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from common.host_memory import SWITCH_ENV, keep_freed_memory, user_configured_malloc

REPO = Path(__file__).resolve().parents[2]
PAGES_PER_STEP = 200 * 2**20 // 4096
GLIBC_START_THRESHOLD = 128 * 1024  # M_TRIM_THRESHOLD and M_MMAP_THRESHOLD before glibc moves them
SECOND_STEP_FAULTS = """
import ctypes, os, resource, sys
import torch
from common.host_memory import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, keep_freed_memory

if os.environ.get("PIN_GLIBC_START_THRESHOLDS"):  # glibc's start-up values, fixed: what a fresh process has
    libc = ctypes.CDLL(None)
    start = int(os.environ["PIN_GLIBC_START_THRESHOLDS"])
    assert libc.mallopt(M_TRIM_THRESHOLD, start) == 1 and libc.mallopt(M_MMAP_THRESHOLD, start) == 1
print(keep_freed_memory(), file=sys.stderr)


def step():
    tensors = [torch.ones(2**18) for _ in range(200)]  # 1 MiB each: what glibc serves with mmap at start-up
    del tensors


step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage's faults")


def second_step_faults(**env: str) -> int:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != SWITCH_ENV}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", SECOND_STEP_FAULTS], env={**environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip())


@linux_only
def test_a_step_reuses_the_memory_the_step_before_freed():
    pinned = {"PIN_GLIBC_START_THRESHOLDS": str(GLIBC_START_THRESHOLD)}
    faults_start = second_step_faults(**pinned, **{SWITCH_ENV: "off"})
    faults_kept = second_step_faults(**pinned)
    # The premise, made to hold: with glibc's start-up thresholds each 1 MiB block is an mmap of its own, given back
    # on free, and the second step maps every page again (whatever the torch build allocated before).
    assert faults_start > 0.75 * PAGES_PER_STEP, faults_start
    # Kept: the second step reuses the heap pages of the first (measured: 5-6 % of the pages fault, on both builds).
    assert faults_kept < 0.25 * PAGES_PER_STEP, (faults_kept, faults_start)


@linux_only
def test_the_builds_own_defaults_and_what_keeping_changes_there():
    # The fewest faults of three children each: on the CUDA build both settings wander between about 2,300 and
    # 4,900 faults from one child to the next (measured), with what each process allocates before the steps.
    faults_default = min(second_step_faults(**{SWITCH_ENV: "off"}) for _ in range(3))
    faults_kept = min(second_step_faults() for _ in range(3))
    assert faults_kept < 0.25 * PAGES_PER_STEP, (faults_kept, faults_default)
    if faults_default > 0.75 * PAGES_PER_STEP:  # the premise holds on this build (the CPU build of torch 2.13)
        return
    warnings.warn(
        f"torch {torch.__version__}: with glibc's defaults the second step faulted only {faults_default:,} of "
        f"{PAGES_PER_STEP:,} pages (premise: most of them), so keep_freed_memory has little to save here; checked "
        f"instead that keeping the memory is no worse ({faults_kept:,} faults)",
        stacklevel=1,
    )
    # What still holds: the kept setting faults no more than the defaults, give or take 5 % of a step's pages (10 MiB),
    # the width of that child-to-child wander. A kept setting that gave the step back would fault most of its pages.
    assert faults_kept <= faults_default + 0.05 * PAGES_PER_STEP, (faults_kept, faults_default)


def test_the_users_allocator_settings_win(monkeypatch):
    assert not user_configured_malloc({})
    assert user_configured_malloc({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert user_configured_malloc({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"})
    assert not user_configured_malloc({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert user_configured_malloc({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"})
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert keep_freed_memory() is False  # the user's threshold stays
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv(SWITCH_ENV, "off")
    assert keep_freed_memory() is False
