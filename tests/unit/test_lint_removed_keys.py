"""Lint rule ``deepspeed-removed-keys``: every key DeepSpeed removed, with the release that removed it.

The reference is the installed DeepSpeed itself, not the rule's table: from the release that removed a key on,
DeepSpeed's own config parser raises DeepSpeedConfigError on it (and its optimizer list no longer names a removed
optimizer), and every key it refuses must be in the table. Under an older DeepSpeed (the lower bound of the tested
window) the same configs parse, and the rule warns instead of failing the run.
"""

from __future__ import annotations

from importlib import metadata

import pytest
from deepspeed.runtime import config as ds_config_module
from packaging.version import Version

from common.lint import LintView, run_rules
from common.lint.versions import REMOVED_DEEPSPEED_KEYS, _has_removed_key

INSTALLED = metadata.version("deepspeed")
BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1}


# A value each key took before its removal (DeepSpeed's own examples), so that an older DeepSpeed parses it.
EXAMPLE_VALUES = {
    "zero_optimization.mics_shard_size": 2,
    "zero_optimization.mics_hierarchical_params_gather": True,
    "zero_optimization.zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
    "sparse_gradients": True,
    "graph_harvesting": False,
    "sparse_attention": {"mode": "fixed"},
    "curriculum_learning": {"enabled": False},
}


def config_with(key: str) -> dict:
    """The smallest DeepSpeed dict that holds the removed ``key`` (:attr:`common.lint.versions.RemovedKey.key`)."""
    path, _, optimizer = key.partition("=")
    if optimizer:
        return {**BASE, "optimizer": {"type": optimizer, "params": {"lr": 1e-3}}}
    config: dict = {**BASE, "zero_optimization": {"stage": 3}}
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = EXAMPLE_VALUES.get(key, {"enabled": False})
    return config


def findings(config: dict, deepspeed: str | None) -> list:
    versions = {"torch": "2.13.0", **({"deepspeed": deepspeed} if deepspeed else {})}
    view = LintView(ds_config=config, versions=versions)
    return [f for f in run_rules(view) if f.rule_id == "deepspeed-removed-keys"]


@pytest.mark.parametrize("removed", REMOVED_DEEPSPEED_KEYS, ids=lambda r: r.key)
def test_each_removed_key_is_named_with_its_release(removed):
    config = config_with(removed.key)
    assert _has_removed_key(config, removed.key)
    before = f"0.19.{int(removed.release.split('.')[-1]) - 1}"
    (error,) = findings(config, removed.release)
    (warning,) = findings(config, before)
    (unknown,) = findings(config, None)
    assert (error.severity, warning.severity, unknown.severity) == ("error", "warning", "warning")
    assert f"removed in DeepSpeed {removed.release}" in error.message and removed.fix == error.fix
    assert findings({**BASE, "zero_optimization": {"stage": 3}}, removed.release) == []


@pytest.mark.parametrize("removed", REMOVED_DEEPSPEED_KEYS, ids=lambda r: r.key)
def test_the_installed_deepspeed_agrees(removed):
    """From the release on, DeepSpeed refuses the key; before it, it parses it (the optimizer: names it)."""
    config = config_with(removed.key)
    removed_here = Version(INSTALLED) >= Version(removed.release)
    _, _, optimizer = removed.key.partition("=")
    if optimizer:
        assert (optimizer.lower() not in ds_config_module.DEEPSPEED_OPTIMIZERS) == removed_here
        return
    if removed_here:
        with pytest.raises(ds_config_module.DeepSpeedConfigError):
            ds_config_module.DeepSpeedConfig(config)
    else:
        ds_config_module.DeepSpeedConfig(config)


def test_every_key_the_installed_deepspeed_refuses_is_in_the_table():
    refused = set(getattr(ds_config_module, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
    refused |= {f"zero_optimization.{k}" for k in getattr(ds_config_module, "_REMOVED_ZERO_CONFIG_KEYS", {})}
    if Version(INSTALLED) >= Version("0.19.8"):
        assert refused, "DeepSpeed moved its table of removed keys: read it from its new place"
    assert refused <= {r.key for r in REMOVED_DEEPSPEED_KEYS}
