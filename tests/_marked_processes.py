"""Finding every process a test started, by a marker in its environment, and leaving none of them behind.

A launcher's ranks, torchrun's workers in sessions of their own and the children they start all inherit the
environment of the command the test ran, so ``MARKER=run_id`` in it finds them in /proc wherever they went.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def marked_processes(marker: str, run_id: str) -> dict[int, str]:
    """pid -> command line of the live (not zombie) processes whose environment holds ``marker=run_id``."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().split(")")[-1].split()[0]
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone since the listing, or not ours to read
            continue
        if f"{marker}={run_id}".encode() in environ and state != "Z":
            found[int(proc.name)] = cmdline
    return found


def kill_left_after(marker: str, run_id: str, seconds: float) -> dict[int, str]:
    """Wait up to ``seconds`` for the marked processes to exit; SIGKILL those left (so that they do not hold ports
    and cores for the rest of the suite) and return them, for the test to fail on."""
    deadline = time.monotonic() + seconds
    while (left := marked_processes(marker, run_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):  # it exited since the last look
            os.kill(pid, signal.SIGKILL)
    return left
