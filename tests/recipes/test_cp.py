"""``zero-recipes cp``: a copied recipe runs and its smoke test passes from another folder."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _util import REPO, recipe_module, subprocess_env

from common.config import load_config
from common.errors import ConfigError
from common.tools.copy_recipe import copy_recipe
from common.tools.recipes import shipped_recipes


def test_copy_has_scripts_configs_launch_files_and_a_smoke_test(tmp_path):
    written = copy_recipe("science", tmp_path / "mine")
    names = {p.relative_to(tmp_path / "mine").as_posix() for p in written}
    for name in (
        "train.py",
        "train_accelerate.py",
        "science_config.py",
        "operator_learning.py",
        "accelerate.yaml",
        "ds_config.json",
        "configs/tiny_cpu.yaml",
        "configs/paper.yaml",
        "test_smoke.py",
    ):
        assert name in names, name


def test_config_option_copies_one_config_plus_the_default(tmp_path):
    written = copy_recipe("science", tmp_path / "one", config="paper")
    configs = sorted(p.name for p in written if p.parent.name == "configs")
    assert configs == ["paper.yaml", "tiny_cpu.yaml"]


def test_refuses_unknown_names_with_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'science'"):
        copy_recipe("sciense", tmp_path / "x")
    with pytest.raises(ConfigError, match="did you mean 'paper'"):
        copy_recipe("science", tmp_path / "y", config="papr")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_non_empty_destination_is_refused_without_force_and_left_untouched(tmp_path):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("my notes\n")
    with pytest.raises(ConfigError, match="is not empty.*--force"):
        copy_recipe("science", dest)
    assert snapshot(dest) == {"notes.txt": b"my notes\n"}  # nothing copied beside it
    written = copy_recipe("science", dest, force=True)  # --force adds the recipe next to what is there
    assert (dest / "notes.txt").read_text() == "my notes\n" and (dest / "train.py").is_file()
    assert {p.relative_to(dest).as_posix() for p in written} <= set(snapshot(dest))


def test_force_never_replaces_a_changed_file_and_then_writes_nothing(tmp_path):
    dest = tmp_path / "mine"
    copy_recipe("science", dest)
    recipe_train = (REPO / "recipes" / "science" / "train.py").read_bytes()
    assert (dest / "train.py").read_bytes() == recipe_train  # the reference: the recipe's own file
    (dest / "configs" / "paper.yaml").unlink()
    copy_recipe("science", dest, force=True)  # identical files kept, the missing one added back
    assert (dest / "configs" / "paper.yaml").read_bytes() == (REPO / "recipes/science/configs/paper.yaml").read_bytes()
    (dest / "train.py").write_text("# my edits\n")
    (dest / "configs" / "paper.yaml").unlink()
    before = snapshot(dest)
    with pytest.raises(ConfigError, match="train.py differs"):
        copy_recipe("science", dest, force=True)
    assert snapshot(dest) == before  # the edit kept, and the missing file not written either: all or nothing


def test_destination_that_is_a_file_is_refused(tmp_path):
    dest = tmp_path / "mine"
    dest.write_text("not a folder\n")
    with pytest.raises(ConfigError, match="is a file"):
        copy_recipe("science", dest, force=True)
    assert dest.read_text() == "not a folder\n"


def test_cli_refuses_a_non_empty_folder_in_one_line(tmp_path):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "train.py").write_text("# mine\n")
    proc = subprocess.run(
        [shutil.which("zero-recipes"), "cp", "science", str(dest)], capture_output=True, text=True, timeout=120
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "is not empty" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    forced = subprocess.run(
        [shutil.which("zero-recipes"), "cp", "science", str(dest), "--force"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert forced.returncode == 2 and "differs" in forced.stderr and "Traceback" not in forced.stderr, forced.stderr
    assert snapshot(dest) == {"train.py": b"# mine\n"}


def config_class(module):
    """The recipe config dataclass a ``*_config.py`` module defines (``CVConfig``, ``FinetuneConfig``, ...)."""
    (cls,) = [
        value
        for name, value in vars(module).items()
        if name.endswith("Config") and dataclasses.is_dataclass(value) and value.__module__ == module.__name__
    ]
    return cls


def test_every_recipe_config_has_smoke_overrides_that_load_and_shrink_the_run():
    """What ``cp``'s generated smoke test runs: every override names a field of the config and converts to its type
    (load_config refuses anything else), and the run is a few steps, not the default's, and saves a checkpoint."""
    folders = sorted({recipe.folder for recipe in shipped_recipes()})
    assert {folder.name for folder in folders} >= {"cv", "nlp", "science"}
    for folder in folders:
        modules = sorted(folder.glob("*_config.py"))
        assert modules, folder
        for path in modules:
            module = recipe_module(folder, path.stem)
            cls = config_class(module)
            smoke = load_config(cls, module.DEFAULT_CONFIG, module.SMOKE_OVERRIDES)
            default = load_config(cls, module.DEFAULT_CONFIG)
            assert smoke.max_steps < default.max_steps and smoke.max_steps <= 10, (path.name, smoke.max_steps)
            assert smoke.checkpoint_interval <= smoke.max_steps, (path.name, smoke.checkpoint_interval)
            assert smoke != default


@pytest.mark.slow
def test_copied_recipe_smoke_test_passes_from_another_folder(tmp_path):
    dest = tmp_path / "copied"
    copy_recipe("science", dest)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(dest), "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout
