"""ZeRO++ hpZ for real on a CPU: 4 processes as 2 "nodes" of 2, gloo, both backends.

hpZ (``zero_hpz_partition_size``) keeps a second copy of the weights sharded within each node, so the backward
pass gathers them from the node's ranks instead of all ranks (DeepSpeed's ZeRO++ tutorial). It changes where the
weights are gathered from, not the math: fp32 losses must equal plain stage 3's within 1e-5 relative. The preset
``deepspeed_stage_3_zeropp`` with the run's layout (``RunFacts(devices_per_node=2)``) sets hpZ to 2; its quantized
collectives (qwZ, qgZ) need DeepSpeed's CUDA kernels, so they are switched off here as lint advises on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _util import REPO
from _worker_runs import launch_worker, launched_once, mean_losses, relative_gap

from common.strategy import RunFacts

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "distributed" / "tiers_worker.py"
FP32_RTOL = 1e-5
WORLD, PER_NODE, WIDTH = 4, 2, 256
NO_QUANTIZATION = ["zero_optimization.zero_quantized_weights=false", "zero_optimization.zero_quantized_gradients=false"]
RUNS = {"stage3": ("deepspeed_stage_3", []), "hpz": ("deepspeed_stage_3_zeropp", NO_QUANTIZATION)}


def launch(backend: str, name: str, out: Path) -> list[dict]:
    preset, overrides = RUNS[name]
    args = ["--backend", backend, "--preset", preset, "--out", str(out), "--width", str(WIDTH)]
    args += ["--devices", str(WORLD), "--devices-per-node", str(PER_NODE)]
    for override in overrides:
        args += ["--set", override]
    facts = RunFacts(
        world_size=WORLD, micro_batch_size=4, precision="fp32", hidden_size=WIDTH, devices_per_node=PER_NODE
    )
    return launch_worker(WORKER, backend, args, out, preset, facts, overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launched_once(tmp_path_factory, launch)


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
def test_hpz_losses_equal_plain_stage3(runs, backend):
    plain, hpz = runs(backend, "stage3"), runs(backend, "hpz")
    for record in hpz:
        assert record["world_size_env"] == record["world_size_process_group"] == WORLD
        assert record["engine"]["zero"]["zero_hpz_partition_size"] == PER_NODE
        # hpZ really ran: every sharded parameter carries its node-local secondary partition.
        assert record["secondary_partitions"] > 0, record
    assert all(r["secondary_partitions"] == 0 for r in plain)
    a, b = mean_losses(hpz), mean_losses(plain)
    assert len(a) == len(b) == 4
    gap = relative_gap(a, b)
    print(f"{backend} hpZ {PER_NODE} on {WORLD} ranks, fp32: max relative gap to stage 3 = {gap:.2e}")
    assert gap <= FP32_RTOL, (a, b)
    assert hpz[0]["fixed_batch_loss"]["after"] < hpz[0]["fixed_batch_loss"]["before"]
