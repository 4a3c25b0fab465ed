"""The tools work on a recipe copied by ``zero-recipes cp`` into another folder, outside the repository.

The tools talk to a recipe only through its command line (``--describe`` and its measured runs), so a copy the
user edited is estimated, linted and probed as its own recipe: the copy's model, not the shipped one.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from _util import subprocess_env

from science.fno import FNO1d, count_parameters

# The probe's candidate run: a few steps on a small grid (what the recipe's SMOKE_OVERRIDES run), with the copy's own
# width (the fixture's edit), so that what the probe measures shows whose model it ran.
TINY_MODEL = {"modes": 8, "n_layers": 2, "proj_width": 32}
TINY_SCIENCE = [
    arg
    for kv in ("n_train=40", "n_test=8", "grid_size=64", "solve_grid=256", "micro_batch_size=4", "data_workers=1",
               *(f"{key}={value}" for key, value in TINY_MODEL.items()))
    for arg in ("--set", kv)
]  # fmt: skip
COPY_WIDTH, SHIPPED_WIDTH = 96, 64


def zr(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [shutil.which("zero-recipes"), *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture
def science_copy(tmp_path):
    """A copy of the science recipe whose model the user widened (``width`` 64 -> 96 in the copy's config)."""
    out = zr("cp", "science", "my_science", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    config = tmp_path / "my_science" / "configs" / "tiny_cpu.yaml"
    text = config.read_text()
    assert f"\nwidth: {SHIPPED_WIDTH} " in text, "the science tiny config's width changed: update SHIPPED_WIDTH"
    lines = [(f"width: {COPY_WIDTH}" if line.startswith("width: ") else line) for line in text.splitlines()]
    config.write_text("\n".join(lines) + "\n")
    return tmp_path


def params_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("model: "))


def test_estimate_and_lint_read_the_copy_not_the_shipped_recipe(science_copy):
    copied = zr("estimate", "--recipe", "my_science", cwd=science_copy)
    shipped = zr("estimate", "--recipe", "science", cwd=science_copy)
    assert copied.returncode == 0 and shipped.returncode == 0, copied.stderr + shipped.stderr
    # The widened model of the copy has more parameters than the shipped one: the copy's own code counted it.
    assert params_line(copied.stdout) != params_line(shipped.stdout)

    for args in (["my_science/configs/tiny_cpu.yaml"], ["my_science/configs/tiny_cpu.yaml", "--recipe", "my_science"]):
        linted = zr("lint", *args, cwd=science_copy)
        assert linted.returncode == 0, linted.stdout + linted.stderr
        assert "recipe-unknown" not in linted.stdout, linted.stdout  # linted as the copy's own recipe
        assert "Traceback" not in linted.stderr


@pytest.mark.slow
def test_probe_measures_the_copy(science_copy):
    out = science_copy / "probe"
    probed = zr(
        "probe", "my_science", "--candidates", "deepspeed_stage_2", "--steps", "2", "--devices", "1",
        "--out", str(out), *TINY_SCIENCE, cwd=science_copy,
    )  # fmt: skip
    assert probed.returncode == 0, probed.stdout[-2000:] + probed.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["world_size"] == 1, row
    # The copy's model, counted here from its architecture: the width the copy's config sets, not the shipped one.
    copy_params, shipped_params = (
        count_parameters(FNO1d(width=width, fp32_head=True, **TINY_MODEL)) for width in (COPY_WIDTH, SHIPPED_WIDTH)
    )
    assert json.loads((science_copy / row["out_dir"] / "summary.json").read_text())["num_params"] == copy_params
    assert copy_params > shipped_params
    # Measured on the copy's DeepSpeed engine: ZeRO-2 in bf16 on one rank, once the step has released the gradients,
    # holds 2 B of bf16 weights and 12 B of fp32 master weights, m and v per parameter (ZeRO's 2K + 12K/N, N = 1).
    assert row["model_state_bytes_per_rank"] == pytest.approx(14 * copy_params, rel=1e-3), row
    assert (out / "recommended.yaml").is_file()
