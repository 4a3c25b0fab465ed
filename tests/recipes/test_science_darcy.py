"""Darcy flow 2-D through the science recipe as a user runs it: FNO-2D on 2 processes, both backends.

Tiny runs (40 pairs on 21 x 21 nodes solved on 41, an FNO-2D 8 wide with 4 x 4 modes); the 5-minute and
paper-sized configs' figures are measured by bench/science_errors.py into docs/science.md, not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _util import PYTHON, REPO, accelerate_launch, read_json, run
from safetensors.torch import load_file

from common.rundir import read_metrics
from science import darcy
from science.fno import FNO2d, relative_l2

RECIPE = REPO / "recipes" / "science"
TRAIN = RECIPE / "train.py"
CONFIG = RECIPE / "configs" / "darcy.yaml"
TINY_DARCY = {
    "n_train": 40,
    "n_test": 8,
    "grid_size": 21,
    "solve_grid": 41,
    "modes": 4,
    "padding": 2,
    "width": 8,
    "n_layers": 2,
    "proj_width": 16,
    "micro_batch_size": 4,
    "data_workers": 1,
    "lr": 0.01,
    "warmup_steps": 0,
    "log_interval": 1,
    "eval_interval": 6,
    "checkpoint_interval": 6,
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("darcy-cache")


def args(out_dir: Path, cache_dir: Path, **extra) -> list[str]:
    values = {**TINY_DARCY, "out_dir": out_dir, "cache_dir": cache_dir, **extra}
    return ["--config", str(CONFIG), *(f"{key}={value}" for key, value in values.items())]


def launch(backend: str, argv: list[str]) -> None:
    if backend == "lightning":
        run([PYTHON, TRAIN, *argv], timeout=600)
    else:
        accelerate_launch(
            RECIPE / "train_accelerate.py", argv, RECIPE / "accelerate.yaml", num_processes=2, timeout=600
        )


def read_test_pairs(cache_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's test pairs, read back through the generator (its cache): not through the recipe."""
    arrays = darcy.generate_dataset(
        TINY_DARCY["n_train"], TINY_DARCY["n_test"], TINY_DARCY["grid_size"], cache_dir=cache_dir, solve_grid=41
    )
    assert arrays["meta"]["cache_hit"]  # the run generated exactly these
    return torch.from_numpy(arrays["x_test"]), torch.from_numpy(arrays["y_test"])


def exported_model(out_dir: Path) -> FNO2d:
    arch = json.loads((out_dir / "final" / "config.json").read_text())
    assert arch.pop("model") == "fno2d" and arch["input_scale"] > 0 and arch["output_scale"] > 0
    model = FNO2d(**arch)
    model.load_state_dict(load_file(out_dir / "final" / "model.safetensors"))  # strict: every weight is there
    return model.eval()


def val_errors(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_rel_l2"] for r in read_metrics(out_dir) if "val_rel_l2" in r}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
def test_darcy_trains_on_both_backends_and_lowers_the_test_error(tmp_path, cache_dir, backend):
    out_dir = tmp_path / "run"
    launch(backend, args(out_dir, cache_dir, max_steps=12))
    summary = read_json(out_dir / "summary.json")
    assert (summary["model"], summary["data"], summary["grid_size"], summary["backend"]) == (
        "fno2d",
        "darcy",
        21,
        backend,
    )
    assert (summary["zero_stage"], summary["precision"], summary["round_robin_gradients"]) == (2, "bf16", True)
    assert "val_rel_l2_superres" not in summary and summary["viscosity"] is None
    assert summary["fft_input_dtypes"] and set(summary["fft_input_dtypes"]) <= {"float32", "complex64"}
    errors = val_errors(out_dir)
    assert sorted(errors) == [0, 6, 12]  # step 0: the untrained model's error
    assert errors[12] == summary["val_rel_l2"] < 0.8 * errors[0], errors
    assert (out_dir / "predictions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The exported weights, with the standardisation in config.json, predict as the run measured (bf16 training:
    # the run evaluated with bf16 weights and the export holds the same values in fp32, hence the tolerance).
    x_test, y_test = read_test_pairs(cache_dir)
    with torch.no_grad():
        exported_error = relative_l2(exported_model(out_dir)(x_test), y_test).item()
    assert exported_error == pytest.approx(summary["val_rel_l2"], rel=0.05)

    if backend == "lightning":  # a checkpoint trained on 21 x 21 nodes does not resume on another grid
        before = (out_dir / "checkpoints" / "latest").read_text()
        proc = run([PYTHON, TRAIN, *args(out_dir, cache_dir, max_steps=16, grid_size=11, resume="true")], check=False)
        errors_printed = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors_printed) == 1, proc.stderr[-3000:]
        assert "grid_size" in errors_printed[0] and "Traceback" not in proc.stderr
        assert (out_dir / "checkpoints" / "latest").read_text() == before


def train_losses(out_dir: Path) -> list[float]:
    return [r["train_rel_l2"] for r in read_metrics(out_dir) if "train_rel_l2" in r]


@pytest.mark.slow
def test_zero3_shards_the_complex_spectral_weights_and_matches_stage_0_in_fp32(tmp_path, cache_dir):
    """The spectral weights are complex numbers stored as real [in, out, m, m, 2] tensors: ZeRO-3 partitions
    them flat and gathers them whole for each forward; the fp32 losses equal the unsharded stage-0 run's."""
    common = {"precision": "fp32", "max_steps": 6, "eval_interval": 6}
    stage0, stage3 = tmp_path / "stage0", tmp_path / "stage3"
    launch(
        "lightning",
        [*args(stage0, cache_dir, preset="deepspeed_stage_1", **common), "ds_overrides=zero_optimization.stage=0"],
    )
    launch("lightning", args(stage3, cache_dir, preset="deepspeed_stage_3", **common))
    summary0, summary3 = read_json(stage0 / "summary.json"), read_json(stage3 / "summary.json")
    assert (summary0["zero_stage"], summary3["zero_stage"]) == (0, 3)
    # Partitioned: each of the 2 ranks holds half of the fp32 weights that stage 0 holds whole.
    params0, params3 = summary0["model_state_breakdown"]["params"], summary3["model_state_breakdown"]["params"]
    assert params0 == 4 * summary0["num_params"]
    assert params3 == pytest.approx(params0 / 2, rel=1e-3)
    losses0, losses3 = train_losses(stage0), train_losses(stage3)
    assert len(losses0) == len(losses3) == 6
    np.testing.assert_allclose(losses3, losses0, rtol=1e-5)
    # Gathered back whole: the stage-3 export predicts the test set as the run measured it.
    x_test, y_test = read_test_pairs(cache_dir)
    with torch.no_grad():
        exported_error = relative_l2(exported_model(stage3)(x_test), y_test).item()
    assert exported_error == pytest.approx(summary3["val_rel_l2"], rel=1e-5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"model": "fno1d"}, "data=darcy needs model=fno2d"),
        ({"solve_grid": 40}, "grid_size - 1 (20) must divide solve_grid - 1 (39)"),
        ({"precision": "fp16"}, "refuses fp16"),
    ],
)
def test_bad_darcy_input_is_one_clear_error(tmp_path, cache_dir, extra, message):
    out_dir = tmp_path / "run"
    proc = run([PYTHON, TRAIN, *args(out_dir, cache_dir, **extra)], timeout=300, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out_dir.exists()


def test_a_two_dimensional_npz_is_refused_for_the_one_dimensional_model(tmp_path, cache_dir):
    data = tmp_path / "fields.npz"
    np.savez(data, x=np.ones((6, 21, 21)), y=np.ones((6, 21, 21)))
    out_dir = tmp_path / "run"
    proc = run([PYTHON, TRAIN, *args(out_dir, cache_dir, data=data, model="fno1d")], timeout=300, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "model=fno2d" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out_dir.exists()
