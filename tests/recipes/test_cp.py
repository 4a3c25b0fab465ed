"""``zero-recipes cp``: a copied recipe runs and its smoke test passes from another folder."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _util import REPO, subprocess_env

from common.copy_recipe import available_recipes, copy_recipe
from common.errors import ConfigError


def test_copy_has_scripts_configs_launch_files_and_a_smoke_test(tmp_path):
    written = copy_recipe("science", tmp_path / "mine")
    names = {p.relative_to(tmp_path / "mine").as_posix() for p in written}
    for name in (
        "train.py",
        "train_accelerate.py",
        "recipe_config.py",
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


def test_refuses_to_overwrite_and_names_nearest(tmp_path):
    copy_recipe("science", tmp_path / "mine")
    before = (tmp_path / "mine" / "train.py").read_text()
    (tmp_path / "mine" / "train.py").write_text("# my edits\n")
    with pytest.raises(ConfigError, match="exists"):
        copy_recipe("science", tmp_path / "mine")
    assert (tmp_path / "mine" / "train.py").read_text() == "# my edits\n"
    copy_recipe("science", tmp_path / "mine", force=True)
    assert (tmp_path / "mine" / "train.py").read_text() == before
    with pytest.raises(ConfigError, match="did you mean 'science'"):
        copy_recipe("sciense", tmp_path / "x")
    with pytest.raises(ConfigError, match="did you mean 'paper'"):
        copy_recipe("science", tmp_path / "y", config="papr")


def test_every_recipe_defines_smoke_overrides():
    for name in available_recipes():
        assert "SMOKE_OVERRIDES" in (REPO / "recipes" / name / "recipe_config.py").read_text(), name


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
