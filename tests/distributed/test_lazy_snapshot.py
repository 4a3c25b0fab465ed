"""An asynchronous save whose copy to host memory runs after the save call holds the state of the moment it was
taken, on DeepSpeed's own engine under ZeRO 2 and 3 (2 processes, gloo; ``lazy_snapshot_worker.py``).

The reference is the same state saved by DeepSpeed's own checkpoint engine, synchronously: every tensor of the
asynchronous checkpoint must equal it bit for bit, although the step taken right after the save changed the
BatchNorm statistics (in the forward pass) and the weights, fp32 partitions and moments (in the update) while the
copy was still pending (slowed by the test-only copy delay). The 2-process recipe runs that kill a rank during an
asynchronous write and resume (tests/recipes/test_resume.py) check the same through both backends.

On a machine with GPUs the worker runs one process per GPU over NCCL, and the snapshot takes its CUDA path (pinned
host memory, a side stream for the tensors only an update changes): the same equality, and the path's own facts.
"""

from __future__ import annotations

import json

import pytest
import torch
from _util import PYTHON, REPO, free_port, run

from common.async_checkpoint import COPY_DELAY_ENV

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "distributed" / "lazy_snapshot_worker.py"
ON_GPU = torch.cuda.is_available()
PROCESSES = min(2, torch.cuda.device_count()) if ON_GPU else 2  # NCCL takes one GPU per process


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("lazy_snapshot")
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(PROCESSES)]
    command += ["--master_port", str(free_port())]
    run([*command, WORKER, "--out", out], timeout=600, **{COPY_DELAY_ENV: "0.5"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(PROCESSES)]


@pytest.mark.parametrize("stage", [2, 3])
def test_the_asynchronous_checkpoint_equals_the_synchronous_one_taken_at_the_same_step(ranks, stage):
    for rank, record in enumerate(ranks):
        facts = record[f"stage{stage}"]
        assert facts["lazy_storages"] > 0, (rank, facts)  # some tensors were left to the background copy...
        assert facts["update_waits"] == 1, (rank, facts)  # ...and the next optimizer step waited for it
        assert facts["compared"] >= 8, (rank, facts)  # weights, biases, BatchNorm statistics, partitions, moments
        assert facts["differing"] == [], (rank, facts)
        if ON_GPU:  # the CUDA path: a side stream, pinned host memory
            assert facts["side_streams"] == 1 and facts["pinned_bytes"] > 0, (rank, facts)
        else:
            assert facts["side_streams"] == 0 and facts["pinned_bytes"] == 0, (rank, facts)
