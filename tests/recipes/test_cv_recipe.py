"""The CV recipe as a user runs it: both entry points, 2 processes, real ZeRO-2, an image folder, resume, bad inputs.

Every run is tiny (a few optimizer steps, micro-batches of 4, a 36-image folder written here); the quality and
time figures of the real default are measured in docs/cv.md, not here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from _util import PYTHON, REPO, accelerate_launch, describe, one_error, read_json, recipe_module, run
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from PIL import Image
from transformers import AutoModelForImageClassification

from common.accounting import predicted_model_state_bytes
from common.config import config_to_dict, load_config
from common.describe import RecipeDescription
from common.rundir import read_metrics
from common.strategy import accelerate_config, write_accelerate_files
from cv.data import load_digits_dataset
from cv.model import build_model, count_parameters

RECIPE = REPO / "recipes" / "cv"
TRAIN = RECIPE / "train.py"
TRAIN_ACCELERATE = RECIPE / "train_accelerate.py"
TINY = {"micro_batch_size": 4, "warmup_steps": 2, "log_interval": 1, "eval_interval": 4}
CLASSES = ["checks", "horizontal", "vertical"]
# Every key of summary.json, in order (docs/cv.md and the benches read them): the same on both backends.
SUMMARY_KEYS = [
    "val_accuracy",
    "val_loss",
    "majority_baseline_accuracy",
    "throughput",
    "peak_memory_bytes",
    "memory_kind",
    "model_state_bytes_per_rank",
    "wall_time_s",
    "preset",
    "zero_stage",
    "world_size",
    "precision",
    "model",
    "data",
    "confusion_matrix",
    "model_state_breakdown",
    "num_params",
    "median_step_s",
    "backend",
    "steps",
    "resumed_from_step",
    "export_check",
]


def overrides(out_dir: Path, **extra) -> list[str]:
    values = {**TINY, "out_dir": out_dir, **extra}
    return [f"{key}={value}" for key, value in values.items()]


def write_image_folder(root: Path, per_class: int = 12) -> Path:
    """Three classes of noisy 32 px patterns (checks, horizontal and vertical stripes) as PNG files, PIL-readable."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:32, 0:32]
    patterns = {"checks": (x // 4 + y // 4) % 2, "horizontal": (y // 4) % 2, "vertical": (x // 4) % 2}
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = 160 * patterns[name][..., None] + rng.integers(0, 96, size=(32, 32, 3))
            Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{i:02d}.png")
    return root


def save_tiny_swin(folder: Path, num_classes: int, class_names: list[str] | None = None) -> Path:
    """A local Hugging Face image classifier, as ``model=`` expects it (save_pretrained, no download)."""
    build_model("tiny", num_classes, 32, class_names).save_pretrained(folder)
    return folder


# --- configs and shipped files --------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((RECIPE / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads_and_opens_with_launch_commands(path):
    cfg = load_config(recipe_module(RECIPE, "cv_config").CVConfig, path)
    assert cfg.preset == "cv" and cfg.precision == "bf16"
    text = path.read_text()
    assert text.startswith("#") and "python recipes/cv/train.py" in text and "accelerate launch" in text


def test_default_config_is_the_dataclass_default_and_the_issue_setup():
    rc = recipe_module(RECIPE, "cv_config")
    cfg = load_config(rc.CVConfig, rc.DEFAULT_CONFIG)
    assert cfg == rc.CVConfig()  # the YAML and the dataclass agree: no hidden second default
    assert (cfg.model, cfg.data, cfg.image_size, cfg.micro_batch_size, cfg.preset) == ("tiny", "digits", 32, 16, "cv")


def test_shipped_accelerate_files_are_the_factory_output_for_the_default(tmp_path):
    rc = recipe_module(RECIPE, "cv_config")
    ds_config = recipe_module(RECIPE, "classification").resolve_ds_config(
        load_config(rc.CVConfig, rc.DEFAULT_CONFIG), 2
    )
    assert json.loads((RECIPE / "ds_config.json").read_text()) == ds_config
    shipped = yaml.safe_load((RECIPE / "accelerate.yaml").read_text())
    assert shipped == accelerate_config("recipes/cv/ds_config.json", num_processes=2)
    written = yaml.safe_load(write_accelerate_files(ds_config, tmp_path, num_processes=2).read_text())
    written["deepspeed_config"]["deepspeed_config_file"] = "recipes/cv/ds_config.json"
    assert written == shipped
    zero = ds_config["zero_optimization"]
    assert zero["stage"] == 2 and zero["overlap_comm"] and zero["contiguous_gradients"] and ds_config["bf16"]["enabled"]
    assert ds_config["train_batch_size"] == 32  # micro batch 16 x 2 ranks, the calibrated global batch


# --- --describe: what the planning tools read, without training ------------------------------------


@pytest.mark.parametrize("script", [TRAIN, TRAIN_ACCELERATE], ids=["lightning", "accelerate"])
def test_describe_reports_the_default_run_without_training_or_writing(tmp_path, script):
    out_dir = tmp_path / "run"
    printed = describe(script, f"out_dir={out_dir}")
    description = RecipeDescription.from_json(printed)
    cv_config = recipe_module(RECIPE, "cv_config")
    expected_config = load_config(cv_config.CVConfig, cv_config.DEFAULT_CONFIG, [f"out_dir={out_dir}"])
    assert description.recipe == "cv" and description.config == config_to_dict(expected_config)
    assert (description.world_size, description.devices_per_node, description.num_nodes) == (2, 2, 1)
    assert description.ds_config == json.loads((RECIPE / "ds_config.json").read_text())  # the shipped dict
    assert description.seq_len is None and description.micro_batch_size == 16
    # The meta-device count against the model the run really builds (digits: 10 classes, 32 px).
    model = build_model("tiny", 10, 32)
    assert description.model.num_params == count_parameters(model) == 210_502
    assert sorted(description.model.param_numels) == sorted(p.numel() for p in model.parameters())
    assert description.model.hidden_size == model.config.hidden_size
    assert description.persistent_params == 0  # stage 2 partitions no parameter
    assert not out_dir.exists()


def test_describe_counts_what_stage_3_keeps_whole(tmp_path):
    printed = describe(TRAIN, "preset=deepspeed_stage_3", "devices=4", "num_nodes=2", "nvme_path=/mnt/nvme")
    assert (printed["world_size"], printed["devices_per_node"], printed["num_nodes"]) == (8, 4, 2)
    assert printed["config"]["nvme_path"] == "/mnt/nvme"
    threshold = printed["ds_config"]["zero_optimization"]["stage3_param_persistence_threshold"]
    numels = [p.numel() for p in build_model("tiny", 10, 32).parameters()]
    assert 0 < printed["persistent_params"] == sum(n for n in numels if n <= threshold) < sum(numels)


def test_describe_with_an_unknown_key_is_one_clear_error():
    proc = run([PYTHON, TRAIN, "--describe", "image_sise=64"], timeout=300, check=False)
    assert "unknown key 'image_sise' (did you mean 'image_size'?)" in one_error(proc) and proc.stdout == ""


# --- bad input: one line, exit 2, nothing touched ---------------------------------------------------


def bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp / "empty"
    empty.mkdir()
    corrupt = write_image_folder(tmp / "corrupt", per_class=3)
    broken = corrupt / "vertical" / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    three = write_image_folder(tmp / "three", per_class=5)
    five = save_tiny_swin(tmp / "five-class-model", 5)
    return {
        "empty_folder": ([f"data={empty}"], "no class subfolders found"),
        "corrupt_image": ([f"data={corrupt}"], f"corrupt or unreadable image file {broken}"),
        "class_mismatch": ([f"data={three}", f"model={five}"], "classifies 5 classes but the data has 3"),
        "unknown_key": (["image_sise=64"], "unknown key 'image_sise' (did you mean 'image_size'?)"),
    }


@pytest.mark.parametrize("case", ["empty_folder", "corrupt_image", "class_mismatch", "unknown_key"])
def test_bad_input_is_one_clear_error(tmp_path, case):
    args, message = bad_inputs(tmp_path)[case]
    out_dir = tmp_path / "run"
    assert message in one_error(run([PYTHON, TRAIN, *overrides(out_dir), *args], timeout=300, check=False))
    assert not out_dir.exists()  # refused before anything was created


def test_existing_out_dir_without_overwrite_is_left_untouched(tmp_path):
    out_dir = tmp_path / "run"
    (out_dir / "checkpoints").mkdir(parents=True)
    (out_dir / "summary.json").write_text('{"val_accuracy": 0.97}')
    (out_dir / "checkpoints" / "latest").write_text("step_000100\n")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out_dir.rglob("*") if p.is_file()}
    error = one_error(run([PYTHON, TRAIN, *overrides(out_dir)], timeout=300, check=False))
    assert "already exists" in error and "overwrite=true" in error
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out_dir.rglob("*") if p.is_file()}
    assert after == before


# --- real runs: 2 processes, ZeRO-2 ------------------------------------------------------------------


def launch(backend: str, args: list[str]) -> None:
    if backend == "lightning":
        run([PYTHON, TRAIN, *args], timeout=600)
    else:
        accelerate_launch(TRAIN_ACCELERATE, args, RECIPE / "accelerate.yaml", num_processes=2, timeout=600)


def check_run_directory(out_dir: Path, backend: str, max_steps: int, precision: str, extra_keys: tuple = ()) -> dict:
    for name in ("config.yaml", "ds_config.json", "env.json", "metrics.jsonl", "summary.json"):
        assert (out_dir / name).is_file(), name
    assert list((out_dir / "tb").glob("events.out.tfevents.*")), "no TensorBoard events"
    assert (out_dir / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == f"step_{max_steps:06d}"
    assert (out_dir / "final" / "model.safetensors").is_file()

    summary = read_json(out_dir / "summary.json")
    assert list(summary) == [*SUMMARY_KEYS, *extra_keys]
    assert summary["backend"] == backend and summary["steps"] == max_steps
    run_facts = [summary[key] for key in ("preset", "zero_stage", "world_size", "precision")]
    assert run_facts == ["cv", 2, 2, precision]
    assert summary["throughput"]["unit"] == "samples/s/device" and summary["throughput"]["value"] > 0
    assert summary["peak_memory_bytes"] > 0 and summary["wall_time_s"] > 0
    # final/ reloaded with from_pretrained gives exactly the trained model's logits (same dtype, same weights).
    assert summary["export_check"]["identical"] and summary["export_check"]["max_abs_logit_diff"] == 0.0
    assert summary["export_check"]["dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[precision]
    # Real ZeRO-2 sharding: each rank holds whole working weights + half of the optimizer state (2K + 12K/N).
    predicted = predicted_model_state_bytes(summary["num_params"], stage=2, world_size=2, precision=precision)
    assert summary["model_state_bytes_per_rank"] == pytest.approx(predicted["model_states"], rel=1e-3)
    matrix = np.array(summary["confusion_matrix"])
    assert matrix.sum() == summary["data"]["val_size"]
    assert summary["val_accuracy"] == pytest.approx(np.trace(matrix) / matrix.sum())

    records = read_metrics(out_dir)
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(losses) == max_steps and all(np.isfinite(losses))
    vals = [r for r in records if "val_accuracy" in r]
    assert vals[-1]["step"] == max_steps and vals[-1]["val_accuracy"] == summary["val_accuracy"]
    return summary


def check_communication(communication: dict, num_params: int) -> None:
    """Rank 0's collectives per optimizer step, as DeepSpeed's comms_logger counted them in the run, equal the
    planner's bytes for this stage-2 config and a hand count (bf16, 2 ranks, one micro-batch a step): one all-reduce
    of every 2-byte gradient, then the all-gather of this rank's updated half of the 2-byte parameters."""
    assert communication["steps"] == 5  # the six steps but the first
    logged = communication["collectives"]
    assert set(logged) == {"all_reduce", "all_gather"}
    # Bytes no figure here counts: the gradient norm's and overflow check's scalars (a few bytes a step) and the
    # padding of each parameter group's flat buffer to an even split (an element or two).
    scalars_and_padding = 16
    for name in logged:
        assert logged[name]["logged_bytes"] == pytest.approx(logged[name]["planned_bytes"], abs=scalars_and_padding)
    assert logged["all_reduce"]["logged_bytes"] == pytest.approx(2 * num_params, abs=scalars_and_padding)
    assert logged["all_gather"]["logged_bytes"] == pytest.approx(2 * num_params / 2, abs=scalars_and_padding)
    assert logged["all_gather"]["calls"] == 2  # one per parameter group (decayed, not decayed)
    assert all(c["logged_s"] > 0 for c in logged.values())


def load_final(out_dir: Path):
    return AutoModelForImageClassification.from_pretrained(str(out_dir / "final"), local_files_only=True).eval()


@pytest.mark.slow
def test_lightning_bf16_zero2_on_digits_writes_a_complete_run_directory(tmp_path):
    out_dir = tmp_path / "run"
    comms_log = "comms_logger.enabled=true"  # DeepSpeed's communication log: summary.json gets 'communication'
    launch("lightning", overrides(out_dir, max_steps=6, checkpoint_interval=3, ds_overrides=comms_log))
    summary = check_run_directory(out_dir, "lightning", max_steps=6, precision="bf16", extra_keys=("communication",))
    assert summary["data"]["num_classes"] == 10 and summary["data"]["val_size"] == 360  # stratified digits split
    assert summary["model"] == "tiny" and summary["num_params"] == 210_502
    check_communication(summary["communication"], num_params=210_502)
    assert read_json(out_dir / "ds_config.json")["zero_optimization"]["stage"] == 2
    model = load_final(out_dir)
    assert type(model).__name__ == "SwinForImageClassification" and model.config.num_labels == 10
    assert model(pixel_values=torch.zeros(2, 3, 32, 32, dtype=model.dtype)).logits.shape == (2, 10)


@pytest.mark.slow
def test_accelerate_fine_tunes_a_local_model_on_an_image_folder(tmp_path):
    data = write_image_folder(tmp_path / "images")
    base = save_tiny_swin(tmp_path / "base-model", 3, CLASSES)
    out_dir = tmp_path / "run"
    launch("accelerate", overrides(out_dir, data=data, model=base, max_steps=12, checkpoint_interval=6, lr=3e-3))
    summary = check_run_directory(out_dir, "accelerate", max_steps=12, precision="bf16")
    assert summary["data"]["class_names"] == CLASSES and summary["data"]["val_size"] == 8  # 36 images, 20 % held out
    losses = [r["train_loss"] for r in read_metrics(out_dir) if "train_loss" in r]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])  # it learns from the PNG files
    model = load_final(out_dir)
    assert [model.config.id2label[i] for i in range(3)] == CLASSES


def train_losses(out_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["train_loss"], r["lr"]) for r in read_metrics(out_dir) if "train_loss" in r]


def final_logits(out_dir: Path) -> torch.Tensor:
    pixels = load_digits_dataset(32).val.tensors[0][:16]
    with torch.no_grad():
        return load_final(out_dir)(pixel_values=pixels).logits


def crash_after(out_dir: Path, copy: Path, step: int) -> Path:
    """A copy of a finished run as a crash right after the step-``step`` checkpoint would leave it."""
    shutil.copytree(out_dir, copy)
    for later in (copy / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (copy / "checkpoints" / "latest").write_text(f"step_{step:06d}\n")
    return copy


@pytest.mark.slow
def test_fp32_resume_reproduces_the_uninterrupted_run_on_both_backends(tmp_path):
    fp32 = {"precision": "fp32", "max_steps": 8, "checkpoint_interval": 4, "eval_interval": 100}
    whole = {}
    for backend in ("lightning", "accelerate"):
        whole[backend] = tmp_path / f"whole-{backend}"
        launch(backend, overrides(whole[backend], **fp32))
        check_run_directory(whole[backend], backend, max_steps=8, precision="fp32")
    reference = train_losses(whole["lightning"])
    assert [step for step, _, _ in reference] == list(range(1, 9))
    # The same training on both backends: same data order, initial weights, DeepSpeed dict and dropped blocks.
    other = train_losses(whole["accelerate"])
    assert [loss for _, loss, _ in other] == pytest.approx([loss for _, loss, _ in reference], rel=1e-6)
    check_export_is_the_checkpoint(whole["lightning"], step=8)

    for backend in ("lightning", "accelerate"):
        split = crash_after(whole[backend], tmp_path / f"split-{backend}", step=4)
        launch(backend, overrides(split, resume="true", **fp32))
        resumed = train_losses(split)[-4:]  # the records the resumed run appended
        assert [step for step, _, _ in resumed] == [5, 6, 7, 8], backend
        for (step, loss, lr), (_, expected, expected_lr) in zip(resumed, reference[4:]):
            assert loss == pytest.approx(expected, rel=1e-6), (backend, step)
            assert lr == pytest.approx(expected_lr, rel=1e-12), (backend, step)
        assert read_json(split / "summary.json")["resumed_from_step"] == 4
        assert torch.equal(final_logits(split), final_logits(whole[backend])), backend  # the same final weights


def check_export_is_the_checkpoint(out_dir: Path, step: int) -> None:
    """final/ holds exactly the fp32 weights DeepSpeed checkpointed (consolidated from both ranks' shards)."""
    shards = get_fp32_state_dict_from_zero_checkpoint(str(out_dir / "checkpoints" / f"step_{step:06d}"))
    consolidated = {k.removeprefix("model."): v for k, v in shards.items()}  # Lightning keeps the model at .model
    # from_pretrained maps the file's key names to the module's (transformers renames Swin's q/k/v on save).
    exported = dict(load_final(out_dir).named_parameters())
    assert set(exported) == set(consolidated) - {k for k in consolidated if "relative_position_index" in k}
    for name, tensor in exported.items():
        assert torch.equal(tensor, consolidated[name]), name
