"""The FSDP2 building blocks that need no process group: presets, precision policy, refusals, front-end arguments."""

from __future__ import annotations

import math

import pytest
import torch

from common.accounting import fsdp2_model_state_bytes
from common.errors import ConfigError
from common.fsdp2 import (
    FSDP2_PRESETS,
    ZERO_ONLY_FEATURES,
    accelerator_fsdp2_kwargs,
    checkpoint_parts,
    clip_grad_norm,
    consolidate_checkpoint,
    dcp_write,
    get_fsdp2_preset,
    is_fsdp2_preset,
    lightning_fsdp2_trainer_kwargs,
    load_checkpoint,
    mixed_precision_policy,
    refuse_zero_only_features,
)
from common.metrics import grad_norm
from common.presets import PRESETS
from common.strategy import accelerate_fsdp2_config


def test_each_preset_reads_as_data_with_its_zero_counterpart():
    assert set(FSDP2_PRESETS) == {"fsdp2", "fsdp2_grad_op"}
    assert not set(FSDP2_PRESETS) & set(PRESETS)  # one namespace in the factory later: no name may mean two things
    for name, spec in FSDP2_PRESETS.items():
        assert "\n" not in spec["why"] and len(spec["why"]) <= 110, name
        assert spec["counterpart"] in PRESETS and PRESETS[spec["counterpart"]]["stage"] in (2, 3), name
        assert isinstance(spec["reshard_after_forward"], bool) and spec["sync_each_micro_batch"] is True, name
    # ZeRO-3 frees gathered weights after the forward; ZeRO-2 keeps them for the backward.
    assert FSDP2_PRESETS["fsdp2"]["reshard_after_forward"] and PRESETS["deepspeed_stage_3"]["stage"] == 3
    assert not FSDP2_PRESETS["fsdp2_grad_op"]["reshard_after_forward"]


def test_an_unknown_preset_names_the_nearest_one():
    with pytest.raises(ConfigError, match=r"did you mean 'fsdp2'") as error:
        get_fsdp2_preset("fsdp")
    assert "\n" not in str(error.value)
    assert get_fsdp2_preset("fsdp2") is not FSDP2_PRESETS["fsdp2"]  # a copy: callers may change it
    assert is_fsdp2_preset("fsdp2_grad_op") and not is_fsdp2_preset("deepspeed_stage_3") and not is_fsdp2_preset(3)


def test_the_precision_contract_is_fp32_master_bf16_compute_fp32_reduction():
    bf16 = mixed_precision_policy("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.output_dtype) == (torch.bfloat16, torch.float32, None)
    fp32 = mixed_precision_policy("fp32")
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, None)  # nothing cast: the fp32 shards are computed with


@pytest.mark.parametrize(
    ("precision", "message"), [("fp16", r"fp16 is not offered .* use bf16 .*deepspeed_stage_3"), ("bf61", "bf16")]
)
def test_fp16_and_unknown_precisions_are_refused_in_one_line(precision, message):
    with pytest.raises(ConfigError, match=message) as error:
        mixed_precision_policy(precision)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("key", list(ZERO_ONLY_FEATURES))
def test_each_zero_only_feature_is_refused_naming_the_zero_preset_that_has_it(key):
    what, zero_preset = ZERO_ONLY_FEATURES[key]
    assert zero_preset in PRESETS
    value = (
        "/local/nvme" if key == "nvme_path" else True if key in ("zeropp", "offload_param", "offload_optimizer") else 2
    )
    with pytest.raises(ConfigError) as error:
        refuse_zero_only_features("fsdp2", {key: value, "micro_batch_size": 8})
    message = str(error.value)
    assert "\n" not in message and key in message and what in message and f"preset={zero_preset}" in message


def test_features_left_at_their_defaults_are_not_refused():
    defaults = {"nvme_path": "", "sequence_parallel": 1, "tensor_parallel": 1, "expert_parallel": 1, "zeropp": False}
    refuse_zero_only_features("fsdp2", {**defaults, "pipeline_parallel": 1, "offload_param": False})


def test_front_end_arguments_leave_precision_to_the_policy(monkeypatch):
    from lightning.pytorch.strategies import ModelParallelStrategy

    # As under a launcher: without one, accelerator_fsdp2_kwargs starts a process group of its own, which would outlive
    # this test and break the next one that starts a default group.
    monkeypatch.setenv("WORLD_SIZE", "1")

    lightning = lightning_fsdp2_trainer_kwargs(world_size=4, grad_accum=2, gradient_clipping=1.0)
    strategy = lightning["strategy"]
    assert isinstance(strategy, ModelParallelStrategy)
    # Every rank data-parallel: Lightning's default would put one node's processes on the tensor-parallel dimension.
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 1)
    assert (lightning["precision"], lightning["accumulate_grad_batches"], lightning["gradient_clip_val"]) == (
        "32-true",
        2,
        1.0,
    )
    assert lightning_fsdp2_trainer_kwargs(2, 1, 0.0)["gradient_clip_val"] is None

    accelerate = accelerator_fsdp2_kwargs("fsdp2_grad_op", "bf16", grad_accum=2)
    plugin = accelerate["fsdp_plugin"]
    assert (plugin.fsdp_version, plugin.reshard_after_forward) == (2, False)
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    assert accelerate["mixed_precision"] == "no"
    assert accelerate["gradient_accumulation_plugin"].sync_each_batch is True
    assert accelerate["gradient_accumulation_plugin"].num_steps == 2


def test_the_launch_config_names_fsdp_version_2():
    config = accelerate_fsdp2_config("fsdp2", num_processes=2)
    assert config["distributed_type"] == "FSDP"
    assert config["fsdp_config"] == {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }


def trained_linear(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def test_a_checkpoint_round_trips_model_optimizer_and_extra_state(tmp_path):
    # One process, no process group: DCP reads and writes the same folders as it does sharded (the 2-, 1- and
    # 4-process runs are tests/distributed/test_fsdp2_checkpoint.py).
    model, optimizer = trained_linear(0)
    dcp_write(model, optimizer, {"step": 7, "scheduler": {"last_epoch": 7}})(tmp_path / "ckpt")
    other, other_optimizer = trained_linear(1)
    extra = load_checkpoint(tmp_path / "ckpt", other, other_optimizer)
    assert extra == {"step": 7, "scheduler": {"last_epoch": 7}}
    for name, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(other_optimizer.state[other.weight][key], optimizer.state[model.weight][key]), key


def test_consolidation_reads_the_weights_alone_and_says_what_a_folder_holds(tmp_path):
    model, optimizer = trained_linear(0)
    dcp_write(model, optimizer, {"step": 1})(tmp_path / "ckpt")
    weights = consolidate_checkpoint(tmp_path / "ckpt")
    assert sorted(weights) == ["bias", "weight"] and torch.equal(weights["weight"], model.weight.detach())
    assert checkpoint_parts(tmp_path / "ckpt") == ["extra", "model", "optimizer"]
    with pytest.raises(ConfigError, match=r"no 'state_dict' part; saved parts: extra, model, optimizer"):
        consolidate_checkpoint(tmp_path / "ckpt", part="state_dict")
    with pytest.raises(ConfigError, match="not a torch.distributed.checkpoint folder"):
        consolidate_checkpoint(tmp_path)


def test_model_state_bytes_count_what_the_tensors_hold():
    model, optimizer = trained_linear(0)
    num_params = sum(p.numel() for p in model.parameters())
    state = fsdp2_model_state_bytes(model, optimizer)
    assert (state["params"], state["grads"], state["optimizer"]) == (4 * num_params, 0, 8 * num_params)
    assert (state["buffers"], state["model_states"], state["total"]) == (0, 12 * num_params, 12 * num_params)
    model(torch.randn(2, 4)).sum().backward()
    assert fsdp2_model_state_bytes(model, optimizer)["grads"] == 4 * num_params


def test_a_deferred_dcp_save_writes_the_state_as_it_was_at_the_call(tmp_path):
    """What DcpAsyncCheckpointer does with a front-end's own synchronous save: ``dcp.save`` inside the block only
    stages a host copy; the next optimizer step changes the live tensors in place; the writer then writes the copy."""
    import torch.distributed.checkpoint as dcp

    from common.async_checkpoint import deferred_dcp_saves, write_deferred

    model, optimizer = trained_linear(seed=0)
    weight, original = model.weight.detach().clone(), dcp.save
    with deferred_dcp_saves() as deferred:
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    assert len(deferred) == 1 and not (tmp_path / "ckpt").exists()  # staged, nothing written yet
    model(torch.randn(2, 4)).square().sum().backward()
    optimizer.step()  # in place, after the save call: must not reach the checkpoint
    assert not torch.equal(model.weight, weight)
    assert dcp.save is original  # the package's own save is back after the block
    write_deferred(deferred, group=None)
    loaded = {"model": {name: torch.zeros_like(value) for name, value in model.state_dict().items()}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
    assert torch.equal(loaded["model"]["weight"], weight)


def test_clipping_returns_the_norm_before_clipping_and_scales_the_gradients_to_the_threshold():
    """One process, plain tensors (the sharded DTensors on 2 processes are compared with DeepSpeed's norm in
    tests/recipes/test_fsdp2_recipes.py); the reference norm is summed here by hand."""
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(3, 4)),
        torch.nn.Parameter(torch.randn(5)),
        torch.nn.Parameter(torch.ones(2)),
    ]
    grads = [torch.randn(3, 4), torch.randn(5)]
    for param, grad in zip(params, grads, strict=False):
        param.grad = grad.clone()  # the third has none (frozen): left out
    expected = math.sqrt(sum(float((grad**2).sum()) for grad in grads))

    norm = clip_grad_norm(params, max_norm=0.0)  # measured only
    assert norm.item() == pytest.approx(expected, rel=1e-6) and norm.dim() == 0
    assert all(torch.equal(param.grad, grad) for param, grad in zip(params, grads, strict=False))

    norm = clip_grad_norm(params, max_norm=expected / 4)
    assert norm.item() == pytest.approx(expected, rel=1e-6)  # before clipping
    for param, grad in zip(params, grads, strict=False):
        torch.testing.assert_close(param.grad, grad / 4, rtol=1e-5, atol=0)
    assert grad_norm(engine=None, measured=norm) == pytest.approx(expected, rel=1e-6)  # what the loop logs
    assert math.isnan(grad_norm(engine=None))  # no engine norm, none measured yet
