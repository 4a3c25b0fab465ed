"""Lint rules of the network and of async_save's host copy, each against a hand-computed figure."""

from __future__ import annotations

import json

import pytest

from common.communication import LINK_CLASSES
from common.errors import ConfigError
from common.lint import RULES, LintView, lint_at_start, lint_run
from common.tools.lint import lint_file

BF16_STAGE = {2: {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}}
BF16_STAGE[3] = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}


def view(stage: int, **kwargs) -> LintView:
    ds = json.loads(json.dumps(BF16_STAGE[stage]))
    ds["zero_optimization"].update(kwargs.pop("zero", {}))
    return LintView(ds_config=ds, **kwargs)


def test_async_save_host_copy_against_host_ram():
    """7B, bf16, 8 ranks on a node: stage 3 copies 12 x 7e9 / 8 = 10.5 GB a rank, 84 GB a node; stage 2 adds the
    2-byte module on the first rank, 24.5 + 7 x 10.5 = 98 GB."""
    rule = RULES["async-save-host-memory"]
    common = {"num_params": 7_000_000_000, "world_size": 8, "ranks_per_node": 8}
    found = rule(view(3, recipe_config={"async_save": True}, host_ram_bytes=64e9, **common))
    assert len(found) == 1 and "84.00 GB per node" in found[0].message and found[0].severity == "warning"
    assert rule(view(3, recipe_config={"async_save": True}, host_ram_bytes=90e9, **common)) == []
    found = rule(view(2, recipe_config={"async_save": True}, host_ram_bytes=90e9, **common))
    assert len(found) == 1 and "98.00 GB per node" in found[0].message
    assert rule(view(3, recipe_config={"async_save": False}, host_ram_bytes=1e9, **common)) == []
    # Offloaded optimizer states are in host RAM already and copied again: 84 + 84 GB.
    offload = {"offload_optimizer": {"device": "cpu"}}
    found = rule(view(3, zero=offload, recipe_config={"async_save": True}, host_ram_bytes=150e9, **common))
    assert len(found) == 1 and "beside 84.00 GB of offloaded states" in found[0].message


def test_stage3_over_a_slow_network():
    """7B, bf16, 4 nodes of 8: a rank sends 3 x 2 B x 7e9 x 31/32 = 40.69 GB every micro-batch, 13.0 s at 25 Gbit/s
    (3.125 GB/s). At 100 Gbit/s, on one node, or at stage 2: no finding."""
    rule = RULES["stage3-slow-network"]
    common = {"num_params": 7_000_000_000, "world_size": 32, "ranks_per_node": 8}
    found = rule(view(3, network=LINK_CLASSES["25gbps"], **common))
    assert len(found) == 1 and "40.69 GB a rank every micro-batch, 13 s" in found[0].message
    assert rule(view(3, network=LINK_CLASSES["100gbps"], **common)) == []
    assert rule(view(3, network=LINK_CLASSES["25gbps"], num_params=7e9, world_size=8, ranks_per_node=8)) == []
    assert rule(view(2, network=LINK_CLASSES["25gbps"], **common)) == []
    assert rule(view(3, **common)) == []  # no --network: nothing known


def test_buckets_out_of_scale_with_the_link():
    """25 Gbit/s moves 7.8M bf16 elements in 5 ms, clamped up to 5e7: 5e8 is 10x that. NVLink moves 7.5e8: 5e7 is
    15x too small; 5e8 is within 4x either way."""
    rule = RULES["bucket-link-scale"]
    slow = rule(view(2, zero={"reduce_bucket_size": 5e8}, network=LINK_CLASSES["25gbps"]))
    assert len(slow) == 1 and "large" in slow[0].message and "5e+07" in slow[0].fix
    fast = rule(view(2, zero={"reduce_bucket_size": 5e7}, network=LINK_CLASSES["nvlink"]))
    assert len(fast) == 1 and "small" in fast[0].message and "7.5e+08" in fast[0].fix
    assert rule(view(2, zero={"reduce_bucket_size": 5e8}, network=LINK_CLASSES["nvlink"])) == []
    assert rule(view(2, zero={"reduce_bucket_size": 5e8})) == []


def test_lint_command_takes_the_network(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**BF16_STAGE[3], "train_batch_size": 32, "train_micro_batch_size_per_gpu": 1,
                                  "gradient_accumulation_steps": 1}))  # fmt: skip
    findings = lint_file(str(config), num_params=7_000_000_000, network="25gbps", nodes=4)
    assert "stage3-slow-network" in {f.rule_id for f in findings}
    with pytest.raises(Exception, match="did you mean 'nvlink'"):
        lint_file(str(config), network="nvlnk")


def stage3_run(num_nodes: int, network: str) -> dict:
    """A recipe's resolved stage-3 dict for 2 ranks and its config as a dict, as a recipe lints them at start."""
    ds = {**json.loads(json.dumps(BF16_STAGE[3])), "train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
          "gradient_accumulation_steps": 1}  # fmt: skip
    ds["zero_optimization"]["reduce_bucket_size"] = 50_000_000  # what 25 Gbit/s suits: only the stage is in question
    return {"ds_config": ds, "recipe_config": {"num_nodes": num_nodes, "network": network}}


def test_a_recipe_config_states_the_network_at_its_start():
    """A recipe lints its config at start (lint_at_start): its ``network`` key and ``num_nodes`` reach the rules as
    --network and --nodes do: 7B over 4 nodes of 8 at 25 Gbit/s is the same 40.69 GB, 13 s as above."""
    run = stage3_run(num_nodes=4, network="25gbps")
    found = lint_run(**run, num_params=7_000_000_000, world_size=32, ranks_per_node=8)
    slow = [f for f in found if f.rule_id == "stage3-slow-network"]
    assert len(slow) == 1 and "40.69 GB a rank every micro-batch, 13 s" in slow[0].message
    # 2 ranks: on 2 nodes the one link is crossed, on 1 node it is not; ranks per node come from num_nodes.
    started = lint_at_start(**stage3_run(2, "25gbps"), world_size=2)
    assert "stage3-slow-network" in {f.rule_id for f in started}
    assert "stage3-slow-network" not in {f.rule_id for f in lint_at_start(**stage3_run(1, "25gbps"), world_size=2)}
    assert "stage3-slow-network" not in {f.rule_id for f in lint_at_start(**stage3_run(2, ""), world_size=2)}
    with pytest.raises(ConfigError, match="did you mean 'nvlink'"):
        lint_at_start(**stage3_run(2, "nvlnk"), world_size=2)


def test_lint_command_reads_the_network_key_of_a_recipe_yaml(tmp_path):
    """``zero-recipes lint`` on a recipe YAML with ``network:``: the rules run without --network."""
    config = tmp_path / "two_nodes.yaml"
    config.write_text("preset: nlp\ndevices: 2\nnum_nodes: 2\nnetwork: 10gbps\n")
    assert "stage3-slow-network" in {f.rule_id for f in lint_file(str(config), recipe="nlp")}
