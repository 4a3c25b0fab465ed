"""The ``zero-recipes`` command as a user runs it: output, files, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

EXE = shutil.which("zero-recipes")
REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    assert EXE, "zero-recipes is not installed: pip install -e ."
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)


def test_ls_lists_every_preset_with_its_why():
    out = cli("ls")
    assert out.returncode == 0
    for name in ("ddp", "deepspeed_stage_3_offload_nvme", "cv", "nlp", "science", "finetune"):
        assert f"  {name} " in out.stdout


def test_config_nlp_prints_stage3_and_persistence():
    out = cli("config", "nlp", "--world-size", "8", "--micro-batch-size", "4", "--hidden-size", "4096")
    assert out.returncode == 0, out.stderr
    assert '"stage": 3' in out.stdout
    cfg = json.loads(out.stdout)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 1_000_000
    assert cfg["train_batch_size"] == 32


def test_config_science_and_cv():
    science = json.loads(cli("config", "science", "--world-size", "8", "--micro-batch-size", "4").stdout)
    assert science["bf16"]["enabled"] is True and science["fp16"]["enabled"] is False
    assert science["zero_optimization"]["stage"] == 2
    assert science["zero_optimization"]["round_robin_gradients"] is True
    cv = json.loads(cli("config", "cv", "--world-size", "8", "--micro-batch-size", "4").stdout)
    assert cv["zero_optimization"]["stage"] == 2


def test_config_writes_accelerate_pair(tmp_path):
    out = cli("config", "cv", "--world-size", "2", "--format", "accelerate", "--out", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    launch = yaml.safe_load((tmp_path / "run" / "accelerate.yaml").read_text())
    assert launch["num_processes"] == 2
    ds = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["config", "nlpp"], "did you mean 'nlp'"),
        (["config", "cv", "--set", "zero_optimization.stag=2"], "did you mean 'stage'"),
        (["config", "cv", "--set", "stage=7"], "must be 0, 1, 2 or 3"),
        (["config", "science", "--precision", "fp16"], "refuses fp16"),
        (["config", "deepspeed_stage_3_offload_nvme"], "NVMe offload needs a path"),
        (["config", "cv", "--world-size", "two"], "expected a positive integer"),
        (["config", "cv", "--set", "zero_optimization.reduce_bucket_size=lots"], "reduce_bucket_size"),
        (["config", "cv", "--set", "novalue"], "not key=value"),
        (["nosuchcommand"], "invalid choice"),
    ],
)
def test_bad_input_one_line_exit_2(args, message):
    out = cli(*args)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["config", "nlp"],
        ["ls"],
        ["estimate", "--params", "7e9", "--gpus", "8", "--gpu-memory", "80GB"],
        ["lint", "recipes/nlp/ds_config.json"],
        ["lint", "recipes/nlp/configs/tiny_cpu.yaml"],  # resolved through the recipe, which lints at its start
    ],
    ids=["config", "ls", "estimate", "lint-json", "lint-recipe-yaml"],
)
def test_commands_print_nothing_on_stderr(args):
    """DeepSpeed's "Setting accelerator to CPU" notice (printed when it is imported without a GPU) stays out."""
    out = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout and out.stderr == ""


def test_deepspeed_still_logs_its_other_messages():
    """The filter drops one notice, not DeepSpeed's logger: its warnings still reach the user."""
    code = (
        "import logging; from common.tools.cli import quiet_deepspeed_cpu_notice; quiet_deepspeed_cpu_notice(); "
        "import deepspeed; from deepspeed.utils import logger; logger.warning('a real warning')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    both = out.stdout + out.stderr
    assert "a real warning" in both and "Setting accelerator to CPU" not in both


@pytest.mark.parametrize(
    "args",
    [
        ["config", "nlp", "--out", "{file}"],
        ["config", "cv", "--format", "accelerate", "--out", "{file}/sub"],
        ["probe", "nlp", "--out", "{file}"],
        ["cp", "science", "{file}"],
        ["export", "{file}", "{file}"],
    ],
    ids=["config", "config-below-a-file", "probe", "cp", "export"],
)
def test_an_output_folder_that_is_a_file_is_refused(args, tmp_path):
    existing = tmp_path / "notes.txt"
    existing.write_text("mine\n")
    out = cli(*[a.format(file=existing) for a in args])
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(existing) in errors[0] and "file" in errors[0], out.stderr
    assert "Traceback" not in out.stderr
    assert existing.read_text() == "mine\n"


NO_RECIPES = "error: the recipes ship with the source checkout: git clone"


@pytest.mark.parametrize(
    "args",
    [
        ["ls"],
        ["cp", "nlp", "mine"],
        ["probe", "nlp"],
        ["estimate", "--recipe", "nlp"],
        ["lint", "x.yaml", "--recipe", "nlp"],
    ],
    ids=["ls", "cp", "probe", "estimate", "lint"],
)
def test_an_install_without_the_source_checkout_says_where_the_recipes_are(args, tmp_path):
    """A wheel holds ``common`` alone: every command that needs a shipped recipe says so in one line, exit 2."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "common", site / "common", ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    (work / "x.yaml").write_text("preset: nlp\n")
    out = subprocess.run(
        [sys.executable, "-m", "common.tools.cli", *args],
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith(NO_RECIPES) and "pip install -e ." in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and str(site / "recipes") in out.stderr, out.stderr
    assert sorted(p.name for p in work.iterdir()) == ["x.yaml"]  # nothing written
    if args == ["ls"]:
        assert "  deepspeed_stage_3 " in out.stdout  # the presets still listed above the error
