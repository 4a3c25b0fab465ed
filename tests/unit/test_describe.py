"""``common.describe.RecipeDescription.of`` and ``facts_from_module``: what every recipe's ``describe()`` derives the
same way, checked against counts made here by hand (the shipped recipes' ``--describe`` runs in tests/recipes/)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.describe import RecipeDescription
from common.memory_formulas import ModelFacts, facts_from_module


@dataclass
class RunConfig:
    devices: int = 4
    num_nodes: int = 2
    micro_batch_size: int = 3
    preset: str = "deepspeed_stage_3"


def stage_dict(stage: int, threshold: int = 100) -> dict:
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": threshold}}


def test_of_derives_the_world_the_recorded_config_and_what_stage_3_keeps_whole():
    facts = ModelFacts(num_params=315, param_numels=(10, 200, 5, 100))
    description = RecipeDescription.of("toy", RunConfig(), stage_dict(3), facts, seq_len=64)
    assert (description.world_size, description.devices_per_node, description.num_nodes) == (8, 4, 2)
    assert description.config == {"devices": 4, "num_nodes": 2, "micro_batch_size": 3, "preset": "deepspeed_stage_3"}
    assert (description.micro_batch_size, description.seq_len, description.parallel_components) == (3, 64, "any")
    assert description.persistent_params == 10 + 5 + 100  # DeepSpeed's rule: numel <= threshold
    below_stage_3 = RecipeDescription.of("toy", RunConfig(), stage_dict(2), facts, seq_len=None)
    assert below_stage_3.persistent_params == 0  # nothing is partitioned, so nothing is kept whole
    assert RecipeDescription.from_json(description.to_json()) == description


def test_facts_from_module_counts_a_meta_module_like_the_real_one():
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    real = build()
    with torch.device("meta"):
        on_meta = build()
    facts = facts_from_module(on_meta, architecture="mlp", hidden_size=16, recipe="toy")
    assert facts.num_params == sum(p.numel() for p in real.parameters()) == 8 * 16 + 16 + 16 * 4 + 4
    assert facts.largest_layer_params == 8 * 16 + 16
    assert sorted(facts.param_numels) == sorted(p.numel() for p in real.parameters())
    assert (facts.architecture, facts.hidden_size) == ("mlp", 16)
    assert facts.source == "recipe toy (Sequential, counted on the meta device)"
