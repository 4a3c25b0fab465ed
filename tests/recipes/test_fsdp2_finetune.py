"""The fine-tuning recipe (LoRA) under the FSDP2 presets, run as a user runs it: fp32 on 2 processes, gradient
accumulation 2, clipping, 5 optimizer steps, through ``finetune.py`` (Lightning) and ``finetune_accelerate.py``
(Accelerate, launched with the recipe's own ``accelerate_finetune.yaml``).

Every run loads one saved base model folder (a 2-layer Llama made here) and seeds LoRA's random matrices after the
load, so all start from the same weights. Each FSDP2 run is compared with its ZeRO counterpart (real DeepSpeed
sharding, same weights and batches), one pair per front-end so that each front-end and each preset appears once:
Lightning ``fsdp2`` against Lightning ``deepspeed_stage_3``, Accelerate ``fsdp2_grad_op`` against Accelerate
``deepspeed_stage_2``. Losses within 1e-5 relative at every step, logged gradient norms (before clipping) within
1e-4 (as in test_fsdp2_nlp.py), and the ZeRO norm above the clipping threshold at every step so that clipping acts
in both (this model's norms were 0.8-1.3: it clips at 0.5). The adapters each FSDP2 run exports (``adapter/``,
gathered from the shards) are the ZeRO run's within 1e-5, and so are the tensors ``zero-recipes export`` reads out
of its last checkpoint; its held-out loss on the same examples fell.

Both FSDP2 runs save DCP checkpoints in the background (``async_save=true``) at steps 3 and 5, without the frozen
base (only LoRA tensors in the checkpoint, and ``base_model.json`` beside them). A copy of each step-3 checkpoint
resumes, Lightning on 2 processes and Accelerate on 1 (the global batch kept, DCP re-sharding on load), and must log
steps 4-5 within 1e-6 of the uninterrupted run. What only DeepSpeed runs (Ulysses, NVMe offload, DeepSpeed
overrides) is refused by the config in one line naming the ZeRO preset that has it.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from _util import REPO, launch_finetune, read_json, recipe_module, save_tiny_llama, tiny_fp32_finetune

from common.errors import ConfigError
from common.presets import FSDP2_PRESET_NAMES
from common.rundir import read_metrics
from common.tools.cli import main as cli_main

STEPS = 5
SAVED_STEP = 3
FP32_RTOL = 1e-5
NORM_RTOL = 1e-4
RESUME_RTOL = 1e-6
ADAPTER_ATOL = 1e-5
CLIP = 0.5
RUN = [
    *tiny_fp32_finetune(STEPS),
    f"checkpoint_interval={SAVED_STEP}",
    "n_train=64",
    "n_val=8",
    "micro_batch_size=2",
    "grad_accum=2",
    f"gradient_clipping={CLIP}",
]
# (front-end, FSDP2 preset) -> its ZeRO counterpart on the same front-end.
PAIRS = {
    ("lightning", "fsdp2"): "deepspeed_stage_3",
    ("accelerate", "fsdp2_grad_op"): "deepspeed_stage_2",
}


def test_what_only_deepspeed_runs_is_refused_in_one_line_naming_its_zero_preset():
    config = recipe_module(REPO / "recipes" / "nlp", "finetune_config").FinetuneConfig
    for preset in FSDP2_PRESET_NAMES:
        for setting, zero_preset in (
            ({"sequence_parallel": 2}, "deepspeed_stage_3"),
            ({"nvme_path": "/nvme"}, "deepspeed_stage_3_offload_nvme"),
        ):
            with pytest.raises(ConfigError) as error:
                config(preset=preset, **setting)
            message = str(error.value)
            assert "\n" not in message and f"not under preset={preset}" in message, message
            assert message.endswith(f"use preset={zero_preset}"), message
        config(preset="deepspeed_stage_3", sequence_parallel=2)  # the same setting where DeepSpeed runs it


def logged(out_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out_dir) if "train_loss" in r}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("base") / "model")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base):
    """``runs(front_end, preset)``: the run's folder, launched on first use (an FSDP2 run saves in the background)."""
    root = tmp_path_factory.mktemp("fsdp2-finetune")

    def get(front_end: str, preset: str) -> Path:
        out_dir = root / f"{front_end}-{preset}"
        if not out_dir.is_dir():
            async_save = (front_end, preset) in PAIRS
            args = [*RUN, f"model={base}", f"out_dir={out_dir}", f"preset={preset}", f"async_save={async_save}"]
            launch_finetune(front_end, 2, args)
        return out_dir

    return get


@pytest.mark.slow
@pytest.mark.parametrize(("front_end", "preset"), list(PAIRS))
def test_fsdp2_lora_matches_its_zero_counterpart(runs, front_end, preset):
    reference, actual = logged(runs(front_end, PAIRS[front_end, preset])), logged(runs(front_end, preset))
    assert sorted(reference) == sorted(actual) == list(range(1, STEPS + 1))
    for step in reference:
        expected, loss = reference[step]["train_loss"], actual[step]["train_loss"]
        assert abs(loss - expected) <= FP32_RTOL * abs(expected), (preset, step, loss, expected)
        expected, norm = reference[step]["grad_norm"], actual[step]["grad_norm"]
        assert math.isfinite(norm) and abs(norm - expected) <= NORM_RTOL * expected, (preset, step, norm, expected)
    norms = [reference[step]["grad_norm"] for step in reference]
    assert min(norms) > CLIP, f"clipping must act at every step for the comparison to cover it: {norms}"
    summary = read_json(runs(front_end, preset) / "summary.json")
    assert (summary["preset"], summary["backend"], summary["world_size"]) == (preset, front_end, 2)
    assert summary["adapter_logits_check"]["ok"], summary["adapter_logits_check"]
    assert summary["val_loss"] < summary["initial_val_loss"], summary  # the same held-out examples, before and after


@pytest.mark.slow
@pytest.mark.parametrize(("front_end", "preset"), list(PAIRS))
def test_the_exported_adapter_is_the_zero_runs(runs, front_end, preset):
    """``adapter/`` gathered from FSDP2's shards holds what ``adapter/`` of the ZeRO run holds (an independent
    gather: DeepSpeed's), tensor for tensor."""
    from safetensors.torch import load_file

    adapter = load_file(str(runs(front_end, preset) / "adapter" / "adapter_model.safetensors"))
    expected = load_file(str(runs(front_end, PAIRS[front_end, preset]) / "adapter" / "adapter_model.safetensors"))
    assert sorted(adapter) == sorted(expected) and adapter
    for name, tensor in adapter.items():
        assert tensor.shape == expected[name].shape, name
        assert torch.allclose(tensor.float(), expected[name].float(), rtol=0, atol=ADAPTER_ATOL), name


@pytest.mark.slow
@pytest.mark.parametrize(("front_end", "preset"), list(PAIRS))
def test_zero_recipes_export_of_an_fsdp2_fine_tune_gives_the_zero_runs_tensors(runs, front_end, preset, tmp_path):
    """A fine-tuning run has no ``final/``: the export of its last checkpoint is the adapters' tensors as plain
    safetensors, under the checkpoint's names, from a DCP checkpoint as from DeepSpeed's."""
    from safetensors.torch import load_file

    def exported(run_dir: Path) -> dict[str, torch.Tensor]:
        out = tmp_path / run_dir.name
        assert cli_main(["export", str(run_dir), str(out), "--quiet"]) == 0
        return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    found, expected = exported(runs(front_end, preset)), exported(runs(front_end, PAIRS[front_end, preset]))
    assert sorted(found) == sorted(expected) and all(".lora_" in name for name in found), sorted(found)[:3]
    for name, tensor in found.items():
        assert torch.allclose(tensor, expected[name], rtol=0, atol=ADAPTER_ATOL), name


def checkpoint_tensors(folder: Path) -> list[str]:
    """The model tensors a DCP checkpoint holds (its ``model`` or Lightning's ``state_dict`` part)."""
    import torch.distributed.checkpoint as dcp

    names = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return [name for name in names if name.split(".")[0] in ("model", "state_dict")]


@pytest.mark.slow
@pytest.mark.parametrize(("front_end", "preset"), list(PAIRS))
def test_an_async_fsdp2_checkpoint_holds_the_adapters_only_and_resumes(runs, base, front_end, preset, tmp_path):
    whole = runs(front_end, preset)
    checkpoints = whole / "checkpoints"
    assert not list(checkpoints.glob(".tmp-*"))
    assert (checkpoints / "latest").read_text().strip() == f"step_{STEPS:06d}"
    name = f"step_{SAVED_STEP:06d}"
    saved = checkpoint_tensors(checkpoints / name)
    assert saved and all(".lora_" in tensor for tensor in saved), [t for t in saved if ".lora_" not in t][:3]
    assert (checkpoints / name / "base_model.json").is_file()

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoints / name, resumed / "checkpoints" / name)
    (resumed / "checkpoints" / "latest").write_text(name + "\n")
    # Accelerate resumes on 1 process (DCP re-shards the 2 ranks' shards for it), the global batch kept.
    processes, batch = (2, ["micro_batch_size=2"]) if front_end == "lightning" else (1, ["micro_batch_size=4"])
    args = [*RUN, *batch, f"model={base}", f"out_dir={resumed}", f"preset={preset}", "resume=true"]
    launch_finetune(front_end, processes, args)
    expected, actual = logged(whole), logged(resumed)
    assert sorted(actual) == list(range(SAVED_STEP + 1, STEPS + 1)), actual
    for step in actual:
        loss, reference = actual[step]["train_loss"], expected[step]["train_loss"]
        assert abs(loss - reference) <= RESUME_RTOL * abs(reference), (front_end, step, loss, reference)
