"""A finished gloo process that ends through ``common.process_setup.end_process_group`` exits cleanly.

gloo lets go of a collective's tensors on its own worker threads, a moment after the collective returned; a process
that starts shutting down first can abort (SIGABRT, "terminate called without an active exception") after healthy
work, and its launcher then fails the run. The worker (``exit_worker.py``) makes it likely: 4 processes on 2 cores,
the group and the collectives' tensors held until the interpreter tears down, as DeepSpeed's engine holds them. On
this 2-core machine most launches aborted when the worker exited straight after its last collective
(``exit_worker.py return``), and most still did with ``end_process_group``'s pause taken out (destroying the group
alone); no launch did with it.

Every entry point that joins a process group (the recipes, the bench workers, ``doctor``) ends through the same
function; tests/unit/test_process_setup.py checks that they call it.
"""

from __future__ import annotations

import pytest
from _util import PYTHON, REPO, free_port, run

pytestmark = pytest.mark.slow

LAUNCHES = 3


def test_a_finished_gloo_process_that_ends_its_group_exits_cleanly_every_time():
    worker = REPO / "tests" / "distributed" / "exit_worker.py"
    for _ in range(LAUNCHES):
        command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port())]
        proc = run([*command, worker, "end"], timeout=300, check=False)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "terminate called" not in output, output[-4000:]
