"""The FSDP2 presets as names the whole project accepts: every recipe's config, the factory's one dispatch point,
the tools, and each ZeRO-only feature refused in one line before any work."""

from __future__ import annotations

import json

import pytest
import torch
from _util import REPO, recipe_module

from common.errors import ConfigError
from common.lint import lint_run
from common.presets import (
    ALL_PRESET_NAMES,
    FSDP2_PRESET_NAMES,
    PRESETS,
    ZERO_ONLY_FEATURES,
    check_preset_name,
    get_preset,
)
from common.strategy import (
    RunFacts,
    accelerator_kwargs,
    is_fsdp2,
    lightning_trainer_kwargs,
    make_optimizer,
    precision_of,
    resolve_deepspeed_config,
    shard_model,
    write_accelerate_files,
    zero_stage,
)

FACTS = RunFacts(world_size=2, micro_batch_size=4, grad_accum=2, precision="fp32", gradient_clipping=1.0)
# Each recipe's config class, by the folder its scripts import it from.
CONFIGS = {
    "cv": ("cv_config", "CVConfig"),
    "science": ("science_config", "ScienceConfig"),
    "nlp": ("nlp_config", "NLPConfig"),
    "finetune": ("finetune_config", "FinetuneConfig"),
}
# A value that turns each ZeRO-only recipe key on, and the recipe whose config has that key.
RECIPE_KEYS = {
    "nvme_path": ("cv", "/local/nvme"),
    "sequence_parallel": ("nlp", 2),
    "tensor_parallel": ("nlp", 2),
    "expert_parallel": ("nlp", 2),
    "pipeline_parallel": ("nlp", 2),
}
# DeepSpeed overrides that ask for the features no recipe key names.
OVERRIDE_KEYS = {
    "offload_optimizer": "zero_optimization.offload_optimizer.device=cpu",
    "offload_param": "zero_optimization.offload_param.device=cpu",
    "zeropp": "zero_optimization.zero_quantized_weights=true",
}


def config_class(recipe: str):
    module, name = CONFIGS[recipe]
    folder = REPO / "recipes" / ("nlp" if recipe == "finetune" else recipe)
    return getattr(recipe_module(folder, module), name)


def test_every_recipe_config_accepts_both_fsdp2_presets():
    for recipe in CONFIGS:
        for preset in FSDP2_PRESET_NAMES:
            cls = config_class(recipe)
            assert cls(preset=preset).preset == preset, recipe


def test_an_unknown_preset_names_the_nearest_of_every_family_and_lists_them():
    assert set(FSDP2_PRESET_NAMES) < set(ALL_PRESET_NAMES) and set(PRESETS) < set(ALL_PRESET_NAMES)
    with pytest.raises(ConfigError, match=r"did you mean 'fsdp2_grad_op'\?\); valid: .*deepspeed_stage_3.*fsdp2"):
        config_class("cv")(preset="fsdp2_gradop")
    with pytest.raises(ConfigError) as error:
        check_preset_name("fdsp2")
    assert "did you mean 'fsdp2'" in str(error.value) and "\n" not in str(error.value)
    # The DeepSpeed-only lookup says what an FSDP2 name is, not "unknown".
    with pytest.raises(ConfigError, match="FSDP2 preset .* ZeRO counterpart is deepspeed_stage_3"):
        get_preset("fsdp2")


@pytest.mark.parametrize("feature", list(ZERO_ONLY_FEATURES))
def test_each_zero_only_feature_is_refused_before_any_work_naming_its_zero_preset(feature):
    """Through what a user sets: the recipe's config key (both scripts build the config first) or a DeepSpeed
    override (the factory, which both scripts call before any data or model)."""
    what, zero_preset = ZERO_ONLY_FEATURES[feature]
    with pytest.raises(ConfigError) as error:
        if feature in RECIPE_KEYS:
            recipe, value = RECIPE_KEYS[feature]
            config_class(recipe)(preset="fsdp2", **{feature: value})
        else:
            key, value = OVERRIDE_KEYS[feature].split("=")
            resolve_deepspeed_config("fsdp2_grad_op", FACTS, {key: value})
    message = str(error.value)
    assert "\n" not in message and what in message and message.endswith(f"use preset={zero_preset}"), message
    # The same setting under the ZeRO preset it names is not refused by these checks.
    if feature in RECIPE_KEYS and feature != "nvme_path":
        recipe, value = RECIPE_KEYS[feature]
        config_class(recipe)(preset=zero_preset, **{feature: value})


def test_other_deepspeed_overrides_and_fp16_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"ds_overrides \(gradient_clipping\) .* builds no DeepSpeed config"):
        resolve_deepspeed_config("fsdp2", FACTS, {"gradient_clipping": 2.0})
    with pytest.raises(ConfigError, match="fp16 is not offered under the FSDP2 presets"):
        resolve_deepspeed_config("fsdp2", RunFacts(precision="fp16"))


def test_the_factory_resolves_an_fsdp2_run_with_the_zero_presets_batch_and_clipping_keys():
    for preset in FSDP2_PRESET_NAMES:
        config = resolve_deepspeed_config(preset, FACTS)
        zero = resolve_deepspeed_config(config["fsdp2"]["counterpart"], FACTS)
        assert is_fsdp2(config) and "zero_optimization" not in config  # DeepSpeed never reads it
        shared = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        assert {k: config[k] for k in shared} == {k: zero[k] for k in shared}
        assert config["gradient_clipping"] == zero["gradient_clipping"] == 1.0
        assert precision_of(config) == "fp32" and zero_stage(config) == zero_stage(zero)
        assert config["fsdp2"]["reshard_after_forward"] is (preset == "fsdp2")
        assert json.loads(json.dumps(config)) == config  # written to the run directory as it is
    assert precision_of(resolve_deepspeed_config("fsdp2", RunFacts())) == "bf16"  # the presets' default


def test_the_front_end_adapters_hand_each_front_end_fsdp2(monkeypatch):
    from lightning.pytorch.strategies import ModelParallelStrategy

    # As under a launcher: without one, the Accelerate adapter starts a process group of its own, which would outlive
    # this test and break the next one that starts a default group.
    monkeypatch.setenv("WORLD_SIZE", "1")

    config = resolve_deepspeed_config("fsdp2_grad_op", RunFacts(world_size=2, grad_accum=2, precision="bf16"))
    lightning = lightning_trainer_kwargs(config)
    assert isinstance(lightning["strategy"], ModelParallelStrategy)
    assert (lightning["precision"], lightning["accumulate_grad_batches"], lightning["gradient_clip_val"]) == (
        "32-true",  # bf16 comes from FSDP2's policy: Lightning's autocast would cast again
        2,
        1.0,
    )
    accelerate = accelerator_kwargs(config)
    plugin = accelerate["fsdp_plugin"]
    assert (plugin.fsdp_version, plugin.reshard_after_forward, accelerate["mixed_precision"]) == (2, False, "no")
    assert plugin.mixed_precision_policy.reduce_dtype == torch.float32  # the precision contract's fp32 reduction
    assert "deepspeed_plugin" not in accelerate
    assert type(make_optimizer(torch.nn.Linear(2, 2).parameters(), config, lr=1e-3)) is torch.optim.AdamW


def test_shard_model_leaves_a_zero_run_to_deepspeed():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    before = [p for p in model.parameters()]
    assert shard_model(model, resolve_deepspeed_config("deepspeed_stage_3", FACTS)) is model
    assert [p for p in model.parameters()] == before  # untouched: DeepSpeed partitions it in initialize


def test_lint_and_the_accelerate_files_know_an_fsdp2_run(tmp_path):
    config = resolve_deepspeed_config("fsdp2", FACTS)
    findings = lint_run(config, world_size=2)
    assert [(f.rule_id, f.severity) for f in findings] == [("fsdp2-preset", "info")]
    assert "preset=deepspeed_stage_3" in findings[0].fix
    yaml_path = write_accelerate_files(config, tmp_path, num_processes=2)
    text = yaml_path.read_text()
    assert "distributed_type: FSDP\n" in text and "fsdp_version: 2" in text and "DEEPSPEED" not in text


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"model": "moe_tiny"}, r"model=moe_tiny is built with DeepSpeed's MoE layer.* use preset=deepspeed_stage_2"),
        ({"offload_checkpoints": True}, r"offload_checkpoints=true .* use preset=deepspeed_stage_3"),
    ],
)
def test_the_nlp_recipe_refuses_its_deepspeed_layers_under_fsdp2_in_one_line(setting, message):
    nlp_config = config_class("nlp")
    with pytest.raises(ConfigError, match=message) as error:
        nlp_config(preset="fsdp2", **setting)
    assert "\n" not in str(error.value)
    nlp_config(preset="deepspeed_stage_2", **setting)  # the ZeRO preset named takes it
