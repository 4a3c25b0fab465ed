"""common/host_memory.py: memory a step frees is reused by the next step instead of being faulted back in.

The property is measured, not assumed: a child process runs two "steps" (allocate 200 MiB of 1 MiB tensors, free
them all, as a training step does with its activations) and counts the minor page faults of the second. With
glibc's defaults nearly every page of the second step faults again (a 1 MiB block gets an mmap of its own, given
back on free); the test asserts that too, so it fails on a machine where the premise no longer holds as well as
when keep_freed_memory stops working.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.host_memory import SWITCH_ENV, keep_freed_memory, user_configured_malloc

REPO = Path(__file__).resolve().parents[2]
PAGES_PER_STEP = 200 * 2**20 // 4096
SECOND_STEP_FAULTS = """
import resource, sys
import torch
from common.host_memory import keep_freed_memory

print(keep_freed_memory(), file=sys.stderr)


def step():
    tensors = [torch.ones(2**18) for _ in range(200)]  # 1 MiB each: what glibc serves with mmap by default
    del tensors


step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_step_faults(**env: str) -> int:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != SWITCH_ENV}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", SECOND_STEP_FAULTS], env={**environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage's fault count")
def test_a_step_reuses_the_memory_the_step_before_freed():
    faults_default = second_step_faults(**{SWITCH_ENV: "off"})
    faults_kept = second_step_faults()
    # The premise: glibc's defaults hand the memory back and the second step maps every page again.
    assert faults_default > 0.75 * PAGES_PER_STEP, faults_default
    # Kept: the second step reuses the heap pages of the first (measured: about 5 % of the pages fault).
    assert faults_kept < 0.25 * PAGES_PER_STEP, (faults_kept, faults_default)


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
