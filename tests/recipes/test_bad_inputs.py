"""Bad input a careless user gives every recipe: one ``error:`` line, exit code 2, no traceback, nothing written.

Each case runs the real entry point as a subprocess, the way a user types it. The classes covered here (a corrupt
model folder, an ``out_dir`` that is a file, a stage-3 bucket no machine holds) are shared by every recipe, so
each is tried on several of them; the domain-specific bad inputs live in each recipe's own test file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _util import PYTHON, REPO, run
from safetensors.torch import load_file, save_file

from common.errors import ConfigError
from common.model_folder import check_weight_files

HUGE_BUCKET = "ds_overrides=zero_optimization.reduce_bucket_size=5e12"  # 10 TB per rank in bf16


def assert_one_line_error(proc, message: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


def model_folder(root: Path, weights: str = "truncated") -> Path:
    """A Hugging Face-shaped folder: config.json plus a model.safetensors that is whole, truncated or absent."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    if weights != "none":
        save_file({"embed.weight": torch.arange(4096, dtype=torch.float32)}, root / "model.safetensors")
    if weights == "truncated":  # an interrupted copy: the header promises bytes the file does not hold
        data = (root / "model.safetensors").read_bytes()
        (root / "model.safetensors").write_bytes(data[: len(data) // 2])
    return root


# --- the shared check, against safetensors' own full reader -------------------------------------------------


def damaged_variants(root: Path) -> dict[str, Path]:
    whole = model_folder(root / "whole", "whole")
    data = (whole / "model.safetensors").read_bytes()
    variants = {"whole": whole}
    for name, content in {
        "truncated": data[: len(data) // 2],
        "header only": data[:8],
        "empty": b"",
        "one byte more": data + b"\0",
        "garbage": bytes(range(256)) * 4,
    }.items():
        folder = model_folder(root / name.replace(" ", "_"), "none")
        (folder / "model.safetensors").write_bytes(content)
        variants[name] = folder
    return variants


def test_check_weight_files_refuses_exactly_what_safetensors_cannot_load(tmp_path):
    for name, folder in damaged_variants(tmp_path).items():
        try:  # the reference: safetensors reads every tensor of the file
            load_file(folder / "model.safetensors")
            loads = True
        except Exception:
            loads = False
        try:
            check_weight_files(folder)
            accepted = True
        except ConfigError as exc:
            accepted = False
            assert str(folder / "model.safetensors") in str(exc) and "corrupt or truncated" in str(exc)
        assert accepted == loads, name


def test_check_weight_files_names_a_shard_the_index_lists_but_the_folder_lacks(tmp_path):
    folder = model_folder(tmp_path / "sharded", "whole")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors, which is missing"):
        check_weight_files(folder)


# --- through the entry points ----------------------------------------------------------------------------


def truncated_swin(folder: Path) -> Path:
    """A real image classifier saved by ``save_pretrained`` (what ``model=`` expects), then cut in half."""
    from cv.model import build_model

    build_model("tiny", 10, 32, None).save_pretrained(folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return folder


@pytest.mark.parametrize(
    "script",
    ["recipes/cv/train.py", "recipes/nlp/train_accelerate.py", "recipes/nlp/finetune.py"],
    ids=["cv-lightning", "nlp-accelerate", "finetune-lightning"],
)
def test_corrupt_model_folder_is_one_line_naming_the_file(script, tmp_path):
    # The CV case is a real model: without the check it reaches from_pretrained and its SafetensorError traceback.
    folder = truncated_swin(tmp_path / "my_model") if "cv" in script else model_folder(tmp_path / "my_model")
    out_dir = tmp_path / "run"
    proc = run([PYTHON, REPO / script, f"model={folder}", f"out_dir={out_dir}"], timeout=300, check=False)
    assert_one_line_error(proc, f"{folder / 'model.safetensors'} is corrupt or truncated")
    assert not out_dir.exists()


@pytest.mark.parametrize(
    ("script", "extra"),
    [
        ("recipes/nlp/train.py", []),
        ("recipes/cv/train.py", []),
        ("recipes/science/train.py", []),
        ("recipes/nlp/finetune.py", ["model={model}"]),  # a base model that is there, so out_dir is what fails
    ],
    ids=["nlp", "cv", "science", "finetune"],
)
def test_out_dir_that_is_a_file_is_refused_and_left_alone(script, extra, tmp_path):
    out_file = tmp_path / "results.txt"
    out_file.write_text("my results\n")
    model = model_folder(tmp_path / "base", "none")
    args = [a.format(model=model) for a in extra]
    proc = run([PYTHON, REPO / script, f"out_dir={out_file}", *args], timeout=300, check=False)
    assert_one_line_error(proc, f"out_dir {out_file} is a file")
    assert out_file.read_text() == "my results\n"


@pytest.mark.parametrize(
    ("script", "extra"),
    [
        ("recipes/science/train.py", ["preset=deepspeed_stage_3"]),
        ("recipes/nlp/train_accelerate.py", []),  # the nlp preset is stage 3 already
    ],
    ids=["science-lightning", "nlp-accelerate"],
)
def test_stage3_bucket_beyond_memory_refuses_to_start(script, extra, tmp_path):
    out_dir = tmp_path / "run"
    proc = run([PYTHON, REPO / script, *extra, HUGE_BUCKET, f"out_dir={out_dir}"], timeout=300, check=False)
    assert_one_line_error(proc, "[stage3-bucket-exceeds-memory]")
    assert not out_dir.exists()
