"""The strategy factory: golden configs per preset, the guides' settings, and one DeepSpeed dict for both backends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from common.errors import ConfigError
from common.presets import PRESETS
from common.strategy import (
    RunFacts,
    accelerate_plugin,
    accelerator_kwargs,
    bucket_elements,
    lightning_strategy_config,
    lightning_trainer_kwargs,
    resolve_deepspeed_config,
    write_accelerate_files,
)

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
FACTS = RunFacts(world_size=8, micro_batch_size=4, grad_accum=2, hidden_size=1024, nvme_path="/local_nvme")


def _resolve(name: str) -> dict:
    return resolve_deepspeed_config(name, FACTS)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_resolves_to_golden_json(name):
    """Every preset, fixed run facts -> the checked-in JSON. UPDATE_GOLDEN=1 rewrites them (review the diff)."""
    resolved = _resolve(name)
    path = GOLDEN / f"{name}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(json.dumps(resolved, indent=2) + "\n")
    assert resolved == json.loads(path.read_text())


@pytest.mark.parametrize("name", list(PRESETS))
def test_no_auto_and_batch_arithmetic(name):
    resolved = _resolve(name)
    assert "auto" not in json.dumps(resolved)
    assert resolved["train_batch_size"] == 8 * 4 * 2
    assert resolved["train_micro_batch_size_per_gpu"] == 4
    assert resolved["gradient_accumulation_steps"] == 2
    assert PRESETS[name]["why"]


def test_domain_presets_follow_the_guides():
    nlp = resolve_deepspeed_config("nlp", RunFacts(world_size=8, micro_batch_size=4, hidden_size=4096))
    assert nlp["zero_optimization"]["stage"] == 3
    assert nlp["zero_optimization"]["stage3_param_persistence_threshold"] == 1_000_000
    science = resolve_deepspeed_config("science", RunFacts(world_size=8, micro_batch_size=4))
    assert science["bf16"]["enabled"] and not science["fp16"]["enabled"]
    assert science["zero_optimization"]["stage"] == 2
    assert science["zero_optimization"]["round_robin_gradients"] is True
    cv = resolve_deepspeed_config("cv", RunFacts(world_size=8, micro_batch_size=4))
    assert cv["zero_optimization"]["stage"] == 2
    assert cv["zero_optimization"]["overlap_comm"] and cv["zero_optimization"]["contiguous_gradients"]
    finetune = resolve_deepspeed_config("finetune", RunFacts())
    assert finetune["zero_optimization"]["stage"] == 3


def test_bucket_sizes_scale_with_the_model():
    assert bucket_elements(None) == 500_000_000
    assert bucket_elements(8192) == 500_000_000  # big models: the guide's 5e8
    assert bucket_elements(256) == 32 * 256 * 256  # small models: no 1 GB stage-3 bucket
    small = resolve_deepspeed_config("deepspeed_stage_3", RunFacts(hidden_size=256))
    assert small["zero_optimization"]["reduce_bucket_size"] == 32 * 256 * 256


def test_overrides_apply_and_are_validated():
    cfg = resolve_deepspeed_config("cv", RunFacts(), {"zero_optimization.reduce_bucket_size": 200_000_000})
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 200_000_000
    cfg = resolve_deepspeed_config("deepspeed_stage_2", RunFacts(), {"stage": 1})
    assert cfg["zero_optimization"]["stage"] == 1


@pytest.mark.parametrize(
    ("preset", "facts", "overrides", "message"),
    [
        ("nlpp", RunFacts(), None, "did you mean 'nlp'"),
        ("cv", RunFacts(), {"zero_optimization.stag": 2}, "did you mean 'stage'"),
        ("cv", RunFacts(), {"zero_optimisation.stage": 2}, "did you mean 'zero_optimization'"),
        ("cv", RunFacts(), {"stage": 4}, "must be 0, 1, 2 or 3"),
        ("cv", RunFacts(), {"stage": "two"}, "must be 0, 1, 2 or 3"),
        ("science", RunFacts(precision="fp16"), None, "refuses fp16"),
        ("science", RunFacts(), {"fp16.enabled": True}, "refuses fp16"),
        ("deepspeed_stage_3_offload_nvme", RunFacts(), None, "NVMe offload needs a path"),
        ("cv", RunFacts(), {"zero_optimization.reduce_bucket_size": "big"}, "reduce_bucket_size"),
        ("cv", RunFacts(), {"train_batch_size": 64}, "derived from the run"),
        ("deepspeed_stage_2", RunFacts(), {"zero_optimization.offload_param.device": "cpu"}, "needs ZeRO stage 3"),
    ],
)
def test_bad_input_is_one_clear_error(preset, facts, overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_deepspeed_config(preset, facts, overrides)


@pytest.mark.parametrize("bad", [{"world_size": 0}, {"micro_batch_size": "4"}, {"precision": "bf17"}])
def test_bad_run_facts(bad):
    with pytest.raises(ConfigError):
        RunFacts(**bad)


@pytest.mark.parametrize("name", ["cv", "nlp", "science", "deepspeed_stage_3_offload"])
def test_lightning_and_accelerate_get_the_same_numbers(name):
    """Batch, accumulation, clipping, precision and every ZeRO field: identical on both backends."""
    ds = resolve_deepspeed_config(name, RunFacts(world_size=2, micro_batch_size=3, grad_accum=4, hidden_size=256))
    trainer_kwargs = lightning_trainer_kwargs(ds)
    lightning_cfg = trainer_kwargs["strategy"].config
    assert "gradient_accumulation_steps" not in lightning_cfg  # Lightning refuses it there
    assert trainer_kwargs["accumulate_grad_batches"] == 4
    assert trainer_kwargs["gradient_clip_val"] == ds["gradient_clipping"]
    assert trainer_kwargs["precision"] == "bf16-mixed"
    plugin = accelerate_plugin(ds)
    acc_cfg = plugin.deepspeed_config
    assert plugin.gradient_accumulation_steps == 4
    for key in ("train_micro_batch_size_per_gpu", "gradient_clipping", "bf16", "fp16", "zero_optimization"):
        assert lightning_cfg[key] == acc_cfg[key] == ds[key], key
    assert lightning_strategy_config(ds) == lightning_cfg


def test_accelerator_kwargs_use_gloo_on_cpu():
    ds = resolve_deepspeed_config("cv", RunFacts(precision="fp32"))
    kwargs = accelerator_kwargs(ds)
    assert kwargs["mixed_precision"] == "no"
    assert kwargs["kwargs_handlers"][0].backend == "gloo"


def test_accelerate_files_point_at_their_json(tmp_path):
    ds = resolve_deepspeed_config("nlp", RunFacts(world_size=2, hidden_size=256))
    yaml_path = write_accelerate_files(ds, tmp_path, num_processes=2)
    launch = yaml.safe_load(yaml_path.read_text())
    assert launch["distributed_type"] == "DEEPSPEED"
    assert launch["num_processes"] == 2
    assert launch["deepspeed_config"]["zero3_init_flag"] is True
    json_path = Path(launch["deepspeed_config"]["deepspeed_config_file"])
    assert json.loads(json_path.read_text()) == ds
