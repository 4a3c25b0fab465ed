"""``common.metrics.barrier`` and ``main_process_first`` hold the other ranks back under an FSDP2 preset's
``Accelerator`` on a CPU, where Accelerate's own ``wait_for_everyone`` and ``main_process_first`` return at once (its
distributed type is ``NO`` there): 2 processes, rank 0 sleeping 1 s inside each guarded block."""

from __future__ import annotations

import json

import pytest
from _util import PYTHON, REPO, free_port, run

pytestmark = pytest.mark.slow


def test_the_other_rank_waits_for_the_main_one_under_fsdp2_on_a_cpu(tmp_path):
    worker = REPO / "tests" / "distributed" / "collectives_worker.py"
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    run([*command, worker, tmp_path], timeout=300)
    seen = json.loads((tmp_path / "rank1.json").read_text())
    assert seen["main_process_first"], "rank 1 entered the block before rank 0 had left it"
    assert seen["barrier"], "rank 1 passed the barrier before rank 0 reached it"
