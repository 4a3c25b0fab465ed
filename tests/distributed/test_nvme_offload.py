"""NVMe offload (ZeRO-Infinity) for real on a CPU: 2 processes, gloo, DeepSpeed's async I/O op, both backends.

- fp32 losses of stages 2 and 3 with NVMe offload equal stage 0's within 1e-5 relative (ZeRO is data
  parallelism; offload moves where states live, not the math);
- stage 3 really wrote to the disk: while it trained, each rank's swap folder under ``nvme_path`` held parameter
  files (every matrix partition: 4 MiB each here) and optimizer files (fp32 master, m, v, gradients), with the
  sizes the formulas give (common/memory_formulas.nvme_swapped_bytes_per_rank);
- stage 2 with ``offload_optimizer.device: nvme`` trains the same but writes nothing: DeepSpeed 0.19's stage 1/2
  optimizer treats ``nvme`` as CPU offload (lint's ``nvme-offload-stage-1-2`` says so; this test notices the day it
  changes).

The first NVMe run compiles DeepSpeed's async I/O op (about 3-4 minutes on 2 cores, cached in
~/.cache/torch_extensions after), so the runs are few: stage 0, stage 2 + NVMe and stage 3 + NVMe per backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _util import REPO
from _worker_runs import launch_worker, launched_once, mean_losses, relative_gap

from common.memory_formulas import MIN_SWAPPED_BYTES, nvme_swapped_bytes_per_rank
from common.strategy import RunFacts

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "distributed" / "tiers_worker.py"
FP32_RTOL = 1e-5
WIDTH = 1024
# name -> (preset, overrides); stage 2 has no NVMe preset: its ZeRO-Offload preset with the device switched.
RUNS = {
    "stage0": ("ddp", []),
    "stage2_nvme": ("deepspeed_stage_2_offload", ["zero_optimization.offload_optimizer.device=nvme"]),
    "stage3_nvme": ("deepspeed_stage_3_offload_nvme", []),
}


def launch(backend: str, name: str, out: Path) -> list[dict]:
    preset, overrides = RUNS[name]
    swap = out / "swap"
    swap.mkdir(parents=True)
    args = [
        "--backend",
        backend,
        "--preset",
        preset,
        "--out",
        str(out),
        "--nvme-path",
        str(swap),
        "--width",
        str(WIDTH),
    ]
    for override in overrides:
        args += ["--set", override]
    facts = RunFacts(world_size=2, micro_batch_size=4, precision="fp32", hidden_size=WIDTH, nvme_path=str(swap))
    return launch_worker(WORKER, backend, args, out, preset, facts, overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launched_once(tmp_path_factory, launch)


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
@pytest.mark.parametrize("name", ["stage2_nvme", "stage3_nvme"])
def test_fp32_losses_equal_stage0(runs, backend, name):
    baseline, offloaded = runs(backend, "stage0"), runs(backend, name)
    for record in offloaded:
        assert record["world_size_env"] == record["world_size_process_group"] == 2
        zero = record["engine"]["zero"]
        assert zero["offload_optimizer"]["device"] == "nvme", zero["offload_optimizer"]
        assert len(record["losses"]) == 4
    gap = relative_gap(mean_losses(offloaded), mean_losses(baseline))
    print(f"{backend} {name} fp32: max relative gap to stage 0 = {gap:.2e}")
    assert gap <= FP32_RTOL, (mean_losses(offloaded), mean_losses(baseline))
    assert offloaded[0]["fixed_batch_loss"]["after"] < offloaded[0]["fixed_batch_loss"]["before"]


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
def test_stage3_swapped_parameters_and_optimizer_states_to_disk(runs, backend):
    """Each rank's swap folder held its matrices' partitions and its optimizer states while it trained."""
    matrices = 2 * 2  # two blocks, an up and a down matrix each: the only partitions of at least 1 MiB
    partition_bytes = 4 * (WIDTH * 2 * WIDTH // 2)  # fp32, half of a 1024 x 2048 matrix per rank
    for record in runs(backend, "stage3_nvme"):
        rank = f"rank{record['rank']}"
        files = record["swap_files"]
        params = {p: n for p, n in files.items() if f"float32params/{rank}/" in p}
        optimizer = {p: n for p, n in files.items() if f"optimizer/{rank}/" in p}
        print(f"{backend} {rank}: {len(params)} parameter, {len(optimizer)} optimizer files, {sum(files.values())} B")
        assert len(params) == matrices and set(params.values()) == {partition_bytes}, params
        assert all(n >= MIN_SWAPPED_BYTES for n in files.values()), files
        states = [p for p in optimizer if "exp_avg" in p or "_gradient_" not in p]
        assert len(states) == 3, optimizer  # fp32 master, m and v of the rank's one sub-group
        # The optimizer's files hold the rank's whole partition (small parameters included: they are flattened into
        # one sub-group); the formula's 16 B per element (master, m, v, gradient) bounds them.
        partition_elements = {n // 4 for p, n in optimizer.items() if p in states}
        assert len(partition_elements) == 1
        bound = nvme_swapped_bytes_per_rank(2 * partition_elements.pop(), 2, "fp32", False, True)
        assert sum(optimizer.values()) <= bound, (sum(optimizer.values()), bound)


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
def test_stage2_nvme_writes_nothing(runs, backend):
    for record in runs(backend, "stage2_nvme"):
        assert record["swap_files"] == {}, record["swap_files"]
        assert record["optimizer"] == "DeepSpeedZeroOptimizer"
