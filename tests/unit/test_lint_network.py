"""Lint rules of the network and of async_save's host copy, each against a hand-computed figure."""

from __future__ import annotations

import json

import pytest

from common.communication import LINK_CLASSES
from common.lint import RULES, LintView
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
