"""The science recipe as a user runs it: both entry points, 2 processes, real ZeRO-2 bf16, resume, bad inputs.

Every run is tiny (40 training pairs on a 64-point grid, a 2-layer FNO 16 wide, a few steps) and keeps
its Burgers cache in a temporary folder; the quality and time figures of the real defaults are measured
in docs/science.md, not here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from _util import PYTHON, REPO, accelerate_launch, check_async_saves, describe, one_error, read_json, recipe_module, run
from safetensors.torch import load_file

from common.accounting import predicted_model_state_bytes
from common.config import config_to_dict, load_config
from common.describe import RecipeDescription
from common.rundir import read_metrics
from common.strategy import accelerate_config, write_accelerate_files
from science.fno import FNO1d, count_parameters

RECIPE = REPO / "recipes" / "science"
TRAIN = RECIPE / "train.py"
TRAIN_ACCELERATE = RECIPE / "train_accelerate.py"
TINY = {
    "n_train": 40,
    "n_test": 8,
    "grid_size": 64,
    "solve_grid": 256,
    "modes": 8,
    "width": 16,
    "n_layers": 2,
    "proj_width": 32,
    "micro_batch_size": 4,
    "data_workers": 1,
    "log_interval": 1,
    "eval_interval": 4,
}
# Every key of summary.json, in order (docs/science.md and the benches read them): the same on both backends.
# The two super-resolution keys are there only when the run tested at a finer grid.
SUMMARY_KEYS = [
    "val_rel_l2",
    "throughput",
    "peak_memory_bytes",
    "memory_kind",
    "model_state_bytes_per_rank",
    "wall_time_s",
    "preset",
    "zero_stage",
    "round_robin_gradients",
    "world_size",
    "precision",
    "param_dtype",
    "fft_input_dtypes",
    "data",
    "model",
    "viscosity",
    "grid_size",
    "n_train",
    "n_test",
    "num_params",
    "model_state_breakdown",
    "backend",
    "steps",
    "resumed_from_step",
    "val_rel_l2_superres",
    "superres_grid_size",
    "data_meta",
]
SUPERRES_KEYS = ("val_rel_l2_superres", "superres_grid_size")


def overrides(out_dir: Path, cache_dir: Path, **extra) -> list[str]:
    values = {**TINY, "out_dir": out_dir, "cache_dir": cache_dir, **extra}
    return [f"{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("burgers-cache")


# --- configs and shipped files --------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((RECIPE / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads_and_opens_with_launch_commands(path):
    cfg = load_config(recipe_module(RECIPE, "science_config").ScienceConfig, path)
    assert cfg.preset == "science" and cfg.precision in ("bf16", "fp32")
    assert path.read_text().startswith("#") and "python recipes/science/train.py" in path.read_text()


def test_shipped_accelerate_files_are_the_factory_output_for_the_default(tmp_path):
    rc = recipe_module(RECIPE, "science_config")
    cfg = load_config(rc.ScienceConfig, rc.DEFAULT_CONFIG)
    ds_config = recipe_module(RECIPE, "operator_learning").resolve_ds_config(cfg, world_size=2)
    assert json.loads((RECIPE / "ds_config.json").read_text()) == ds_config
    shipped = yaml.safe_load((RECIPE / "accelerate.yaml").read_text())
    assert shipped == accelerate_config("recipes/science/ds_config.json", num_processes=2)
    written = yaml.safe_load(write_accelerate_files(ds_config, tmp_path, num_processes=2).read_text())
    written["deepspeed_config"]["deepspeed_config_file"] = "recipes/science/ds_config.json"
    assert written == shipped
    assert ds_config["zero_optimization"]["stage"] == 2
    assert ds_config["zero_optimization"]["round_robin_gradients"] is True
    assert ds_config["bf16"]["enabled"] and not ds_config["fp16"]["enabled"]


def test_fp32_head_gives_float32_predictions_from_a_bf16_model():
    torch.manual_seed(0)
    plain = FNO1d(modes=8, width=16, n_layers=2, proj_width=32)
    head = copy.deepcopy(plain)
    head.fp32_head = True
    x = torch.randn(3, 64)
    torch.testing.assert_close(head(x), plain(x), rtol=1e-6, atol=1e-7)  # the same function in fp32
    low = head.bfloat16()  # what DeepSpeed bf16 does to the module
    out = low(x)
    assert out.dtype == torch.float32  # the prediction is never rounded to bf16
    out.square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in low.parameters())


# --- --describe: what the planning tools read, without training ------------------------------------


@pytest.mark.parametrize("script", [TRAIN, TRAIN_ACCELERATE], ids=["lightning", "accelerate"])
def test_describe_reports_the_default_run_without_training_or_writing(tmp_path, script):
    out_dir, cache = tmp_path / "run", tmp_path / "cache"
    printed = describe(script, f"out_dir={out_dir}", f"cache_dir={cache}")
    description = RecipeDescription.from_json(printed)
    science_config = recipe_module(RECIPE, "science_config")
    overrides = [f"out_dir={out_dir}", f"cache_dir={cache}"]
    expected_config = load_config(science_config.ScienceConfig, science_config.DEFAULT_CONFIG, overrides)
    assert description.recipe == "science" and description.config == config_to_dict(expected_config)
    assert (description.world_size, description.devices_per_node, description.num_nodes) == (2, 2, 1)
    assert description.ds_config == json.loads((RECIPE / "ds_config.json").read_text())  # the shipped dict
    assert description.seq_len is None and description.micro_batch_size == 10
    # The meta-device count against the model the run really builds (docs/science.md: 549,569 parameters).
    model = FNO1d(modes=16, width=64, n_layers=4, proj_width=128, fp32_head=True)
    assert description.model.num_params == count_parameters(model) == 549_569
    assert sorted(description.model.param_numels) == sorted(p.numel() for p in model.parameters())
    assert description.model.hidden_size == 64 and description.persistent_params == 0
    assert not out_dir.exists() and not cache.exists()  # no data generated, nothing written


def test_describe_counts_what_stage_3_keeps_whole():
    printed = describe(TRAIN, "preset=deepspeed_stage_3", "devices=8", "width=32", "nvme_path=/mnt/nvme")
    assert (printed["world_size"], printed["config"]["width"], printed["config"]["nvme_path"]) == (8, 32, "/mnt/nvme")
    threshold = printed["ds_config"]["zero_optimization"]["stage3_param_persistence_threshold"]
    numels = [p.numel() for p in FNO1d(modes=16, width=32, n_layers=4, proj_width=128).parameters()]
    assert 0 < printed["persistent_params"] == sum(n for n in numels if n <= threshold) < sum(numels)


def test_describe_with_an_unknown_key_is_one_clear_error():
    proc = run([PYTHON, TRAIN, "--describe", "lrr=0.01"], timeout=300, check=False)
    assert "unknown key 'lrr' (did you mean 'lr'?)" in one_error(proc) and proc.stdout == ""


# --- bad input: one line, exit 2, nothing touched ---------------------------------------------------


def save_npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    corrupt = tmp / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 this is not a zip archive")
    mismatch = save_npz(tmp / "mismatch.npz", x=np.zeros((6, 64)), y=np.zeros((6, 128)))
    return {
        "missing_npz": ([f"data={tmp / 'missing.npz'}"], "data file not found"),
        "corrupt_npz": ([f"data={corrupt}"], "not a readable .npz file"),
        "shape_mismatch": ([f"data={mismatch}"], "'x' and 'y' must have the same shape"),
        "unknown_key": (["lrr=0.01"], "unknown key 'lrr' (did you mean 'lr'?)"),
        "fp16": (["precision=fp16"], "refuses fp16: scientific models need bf16 or fp32"),
    }


@pytest.mark.parametrize("case", ["missing_npz", "corrupt_npz", "shape_mismatch", "unknown_key", "fp16"])
def test_bad_input_is_one_clear_error(tmp_path, cache_dir, case):
    args, message = bad_inputs(tmp_path)[case]
    out_dir = tmp_path / "run"
    error = one_error(run([PYTHON, TRAIN, *overrides(out_dir, cache_dir), *args], timeout=300, check=False))
    assert message in error
    assert not out_dir.exists()  # refused before anything was created
    if case == "fp16":
        assert "10-bit mantissa loses the small terms" in error


def test_existing_out_dir_without_overwrite_is_left_untouched(tmp_path, cache_dir):
    out_dir = tmp_path / "run"
    (out_dir / "checkpoints").mkdir(parents=True)
    (out_dir / "summary.json").write_text('{"val_rel_l2": 0.001}')
    (out_dir / "checkpoints" / "latest").write_text("step_000100\n")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out_dir.rglob("*") if p.is_file()}
    error = one_error(run([PYTHON, TRAIN, *overrides(out_dir, cache_dir)], timeout=300, check=False))
    assert "already exists" in error and "overwrite=true" in error
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out_dir.rglob("*") if p.is_file()}
    assert after == before


def test_print_config_prints_the_resolved_yaml(tmp_path):
    proc = run([PYTHON, TRAIN, "--print-config", "lr=0.002", "precision=fp32"], timeout=300)
    printed = yaml.safe_load(proc.stdout)
    assert printed["lr"] == 0.002 and printed["precision"] == "fp32" and printed["preset"] == "science"
    path = tmp_path / "printed.yaml"
    path.write_text(proc.stdout)
    load_config(recipe_module(RECIPE, "science_config").ScienceConfig, path)  # round-trips into the config class


# --- real runs: 2 processes, ZeRO-2 ------------------------------------------------------------------


def launch(backend: str, args: list[str]) -> None:
    if backend == "lightning":
        run([PYTHON, TRAIN, *args], timeout=600)
    else:
        accelerate_launch(TRAIN_ACCELERATE, args, RECIPE / "accelerate.yaml", num_processes=2, timeout=600)


def check_bf16_zero2_run(out_dir: Path, backend: str, max_steps: int) -> None:
    for name in ("config.yaml", "ds_config.json", "env.json", "metrics.jsonl", "summary.json"):
        assert (out_dir / name).is_file(), name
    assert list((out_dir / "tb").glob("events.out.tfevents.*")), "no TensorBoard events"
    for png in ("predictions.png", "predictions_superres.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == f"step_{max_steps:06d}"

    summary = read_json(out_dir / "summary.json")
    assert list(summary) == SUMMARY_KEYS
    assert summary["backend"] == backend and summary["steps"] == max_steps
    assert (summary["preset"], summary["zero_stage"], summary["world_size"], summary["precision"]) == (
        "science",
        2,
        2,
        "bf16",
    )
    assert summary["round_robin_gradients"] is True
    assert summary["throughput"]["unit"] == "samples/s/device" and summary["throughput"]["value"] > 0
    assert summary["peak_memory_bytes"] > 0 and summary["wall_time_s"] > 0
    assert 0 < summary["val_rel_l2"] < 10 and 0 < summary["val_rel_l2_superres"] < 10
    assert summary["superres_grid_size"] == 4 * TINY["grid_size"]
    # DeepSpeed holds bf16 weights, yet everything that reached torch.fft was float32 / complex64.
    assert summary["param_dtype"] == "bfloat16"
    assert summary["fft_input_dtypes"] and set(summary["fft_input_dtypes"]) <= {"float32", "complex64"}
    # Real ZeRO-2 sharding: this rank holds 2K bf16 weights + 12K/N optimizer state (N = 2), as the ZeRO formula says.
    predicted = predicted_model_state_bytes(summary["num_params"], stage=2, world_size=2, precision="bf16")
    assert summary["model_state_bytes_per_rank"] == pytest.approx(predicted["model_states"], rel=1e-3)

    ds_config = read_json(out_dir / "ds_config.json")
    assert ds_config["zero_optimization"]["round_robin_gradients"] is True and ds_config["bf16"]["enabled"]
    records = read_metrics(out_dir)
    losses = [r["train_rel_l2"] for r in records if "train_rel_l2" in r]
    assert len(losses) == max_steps and all(np.isfinite(losses))
    vals = [r for r in records if "val_rel_l2" in r]
    assert vals[-1]["step"] == max_steps and vals[-1]["val_rel_l2"] == summary["val_rel_l2"]
    assert vals[0]["step"] == 0 and summary["val_rel_l2"] < 0.9 * vals[0]["val_rel_l2"]  # training lowered it

    arch = json.loads((out_dir / "final" / "config.json").read_text())
    model = FNO1d(**{k: v for k, v in arch.items() if k != "model"})
    model.load_state_dict(load_file(out_dir / "final" / "model.safetensors"))  # strict: every weight is there
    assert model(torch.zeros(1, TINY["grid_size"])).shape == (1, TINY["grid_size"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
def test_bf16_zero2_run_writes_a_complete_run_directory(tmp_path, cache_dir, backend):
    out_dir = tmp_path / "run"
    # Burgers with shocks: the public generator's field at viscosity 1e-3, solved on 1,024 points.
    shocks = {"viscosity": 0.001, "initial_field": "public_generator", "solve_grid": 1024, "lr": 0.01}
    # async_save: both checkpoints are written in the background and the last is published before final/.
    launch(backend, overrides(out_dir, cache_dir, max_steps=8, checkpoint_interval=4, async_save="true", **shocks))
    check_bf16_zero2_run(out_dir, backend, max_steps=8)
    check_async_saves(out_dir, saved_steps=[4, 8])


@pytest.mark.slow
def test_users_npz_on_any_grid_trains(tmp_path, cache_dir):
    rng = np.random.default_rng(0)
    grid = np.arange(48) / 48  # not a power of two
    amplitude, phase = rng.normal(size=(24, 1)), rng.uniform(0, 2 * np.pi, size=(24, 1))
    x = amplitude * np.sin(2 * np.pi * grid + phase)
    data = save_npz(tmp_path / "pairs.npz", x=x, y=0.1 * x + 0.01 * x**2)
    out_dir = tmp_path / "run"
    launch("lightning", overrides(out_dir, cache_dir, data=data, max_steps=4, checkpoint_interval=4))
    summary = read_json(out_dir / "summary.json")
    assert summary["data"] == str(data) and summary["grid_size"] == 48
    assert (summary["n_train"], summary["n_test"]) == (19, 5)  # val_fraction 0.2
    assert list(summary) == [key for key in SUMMARY_KEYS if key not in SUPERRES_KEYS]  # no finer data to test on
    assert np.isfinite(summary["val_rel_l2"]) and (out_dir / "predictions.png").is_file()


def train_losses(out_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["train_rel_l2"], r["lr"]) for r in read_metrics(out_dir) if "train_rel_l2" in r]


@pytest.mark.slow
def test_fp32_resume_reproduces_the_uninterrupted_losses_on_both_backends(tmp_path, cache_dir):
    # Warmup then a constant lr, so that a first segment that stops at step 4 follows the same schedule.
    fp32 = {"precision": "fp32", "warmup_steps": 2, "min_lr_ratio": 1.0, "checkpoint_interval": 4, "superres_factor": 1}
    whole = tmp_path / "whole"
    launch("lightning", overrides(whole, cache_dir, max_steps=8, **fp32))
    reference = train_losses(whole)
    assert [step for step, _, _ in reference] == list(range(1, 9))

    for backend in ("lightning", "accelerate"):
        split = tmp_path / f"split-{backend}"
        launch(backend, overrides(split, cache_dir, max_steps=4, **fp32))
        launch(backend, overrides(split, cache_dir, max_steps=8, resume="true", **fp32))
        resumed = train_losses(split)
        assert [step for step, _, _ in resumed] == list(range(1, 9)), backend
        for (step, loss, lr), (_, expected, expected_lr) in zip(resumed, reference):
            assert loss == pytest.approx(expected, rel=1e-6), (backend, step)
            assert lr == pytest.approx(expected_lr, rel=1e-12), (backend, step)
        assert read_json(split / "summary.json")["resumed_from_step"] == 4
