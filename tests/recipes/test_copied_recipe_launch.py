"""A recipe copied by ``zero-recipes cp`` launches through its own ``accelerate.yaml`` from another folder.

What a user does after copying the NLP recipe to start their own work, typed from a folder outside the repository:

    zero-recipes cp nlp my_nlp
    accelerate launch --config_file my_nlp/accelerate.yaml my_nlp/train_accelerate.py <SMOKE_OVERRIDES> out_dir=run

The run (2 processes, ZeRO-3, gloo) must train with the copy's own modules and write the whole run directory.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _util import PYTHON, free_port, read_json, run, subprocess_env


def smoke_overrides(recipe_copy: Path) -> list[str]:
    """``SMOKE_OVERRIDES`` of the copy's ``nlp_config.py`` (the tiny run ``cp``'s generated smoke test uses)."""
    spec = importlib.util.spec_from_file_location("copied_nlp_config", recipe_copy / "nlp_config.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return list(module.SMOKE_OVERRIDES)


@pytest.mark.slow
def test_copied_nlp_recipe_launches_through_its_accelerate_yaml(tmp_path):
    recipe_copy, out_dir = tmp_path / "my_nlp", tmp_path / "run"
    copied = subprocess.run(
        [shutil.which("zero-recipes"), "cp", "nlp", str(recipe_copy)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert copied.returncode == 0, copied.stderr
    overrides = smoke_overrides(recipe_copy)
    proc = run(
        [
            PYTHON,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            recipe_copy / "accelerate.yaml",
            "--main_process_port",  # a free port: other tests may be launching too
            free_port(),
            recipe_copy / "train_accelerate.py",
            *overrides,
            f"out_dir={out_dir}",
        ],
        cwd=tmp_path,  # not the repository: the copy stands on its own
        timeout=900,
    )
    assert "memory plan: ZeRO-3" in proc.stdout, proc.stdout[-3000:]
    summary = read_json(out_dir / "summary.json")
    steps = int(next(o for o in overrides if o.startswith("max_steps=")).split("=")[1])
    assert summary["backend"] == "accelerate" and summary["world_size"] == 2 and summary["zero_stage"] == 3
    assert summary["steps"] == steps and summary["export_check"]["ok"], summary["export_check"]
    for name in ("config.yaml", "ds_config.json", "env.json", "metrics.jsonl", "tokenizer", "final/model.safetensors"):
        assert (out_dir / name).exists(), name
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:06d}"
