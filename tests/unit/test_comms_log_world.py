"""A finished run's planned communication uses the ranks that were launched, not the ranks its config would give
(``devices=0`` means every local GPU, while a launcher may start fewer processes)."""

from __future__ import annotations

from common.comms_log import communication_beside_plan, with_launched_world
from common.describe import RecipeDescription
from common.memory_formulas import ModelFacts

STAGE_2 = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}
# One logged step after the first (the first is dropped): enough for the plan to be written beside it.
LOGGED = [{}, {"all_reduce": {"calls": {1024: 1}, "seconds": 0.01}}]


def description(world: int, nodes: int = 1) -> RecipeDescription:
    return RecipeDescription(
        recipe="tiny", config={}, world_size=world, devices_per_node=world // nodes, num_nodes=nodes,
        ds_config=STAGE_2, model=ModelFacts(num_params=1_000_000), seq_len=None, micro_batch_size=1,
    )  # fmt: skip


def planned(run: RecipeDescription) -> dict[str, float]:
    found = communication_beside_plan(LOGGED, run, param_groups=1)
    return {name: row["planned_bytes"] for name, row in found["collectives"].items()}


def test_the_plan_follows_the_launched_ranks():
    described_for_8 = description(8)
    # Stage 2's all-gather moves (N-1)/N of the parameters per rank: 8 ranks and 2 ranks plan different bytes.
    assert planned(described_for_8) != planned(description(2))
    assert planned(with_launched_world(described_for_8, 2)) == planned(description(2))
    assert with_launched_world(description(8, nodes=2), 4).devices_per_node == 2
    assert with_launched_world(described_for_8, 8) is described_for_8
