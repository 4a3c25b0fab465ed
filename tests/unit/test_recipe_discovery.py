"""``common.tools.recipes``: recipes found by name or folder, and ``--describe`` run as the recipe's own process.

The ``--describe`` plumbing is checked on a small recipe written here (its own config class through the real
``parse_recipe_args``), so that these tests take a second; the shipped recipes' descriptions are exercised by
tests/unit/test_lint.py, test_memory.py and tests/recipes/test_copied_recipe_tools.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from common.errors import ConfigError
from common.tools import recipes
from common.tools.recipes import describe, find_recipe, recipe_of_config, shipped_recipes

REPO = Path(__file__).resolve().parents[2]

# A recipe in miniature: a config class, --describe through parse_recipe_args, and what its process sees.
TINY_RECIPE = '''"""A tiny recipe for the discovery tests."""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from common.config import config_to_dict, parse_recipe_args
from common.describe import RecipeDescription
from common.errors import exit_on_user_error
from common.memory_formulas import ModelFacts

HERE = Path(__file__).resolve().parent


@dataclass
class TinyConfig:
    preset: str = "deepspeed_stage_2"
    max_steps: int = 1
    width: int = 4
    devices: int = 1
    crash: bool = False


def describe(cfg):
    if cfg.crash:
        raise RuntimeError("the model would not build")
    print("a library's notice on stdout")  # parse_recipe_args sends it to stderr
    seen = {"cwd": os.getcwd(), "omp": os.environ.get("OMP_NUM_THREADS"), "rank": os.environ.get("LOCAL_RANK")}
    return RecipeDescription(
        recipe="tiny", config=config_to_dict(cfg), world_size=cfg.devices, devices_per_node=cfg.devices, num_nodes=1,
        ds_config=seen, model=ModelFacts(num_params=10 * cfg.width), seq_len=None, micro_batch_size=1,
    )


@exit_on_user_error()
def main():
    parse_recipe_args(TinyConfig, HERE / "configs" / "tiny_cpu.yaml", describe=describe)
    sys.exit("training is not what this test does")


if __name__ == "__main__":
    main()
'''


def make_recipe(folder: Path, entries: tuple[str, ...] = ("train",)) -> Path:
    """A recipe folder as ``zero-recipes cp`` leaves one: entry scripts with their Accelerate twins, configs."""
    (folder / "configs").mkdir(parents=True)
    for entry in entries:
        (folder / f"{entry}.py").write_text(TINY_RECIPE)
        (folder / f"{entry}_accelerate.py").write_text(TINY_RECIPE)
    (folder / "configs" / "tiny_cpu.yaml").write_text("width: 5\n")
    (folder / "configs" / "finetune_tiny.yaml").write_text("width: 6\n")
    (folder / "helpers.py").write_text("")  # a module beside the scripts is no entry point
    return folder


def test_shipped_recipes_by_name():
    names = [r.name for r in shipped_recipes()]
    assert names == ["cv", "nlp", "nlp:finetune", "science"]  # the README's recipe table
    finetune = find_recipe("nlp:finetune")
    assert finetune.script == REPO / "recipes/nlp/finetune.py"
    assert finetune.backend_script("accelerate") == REPO / "recipes/nlp/finetune_accelerate.py"
    assert [p.name for p in finetune.configs()] == ["finetune_tiny_cpu.yaml"]
    assert "finetune_tiny_cpu.yaml" not in [p.name for p in find_recipe("nlp").configs()]
    assert find_recipe("science").run_dir == REPO and find_recipe("science").shown_script("lightning") == (
        "recipes/science/train.py"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nlpp", "did you mean 'nlp'"),
        ("sciense:train", "did you mean 'science'"),
        ("nlp:finetun", "did you mean 'finetune'"),
        ("no/such/folder", "recipe folder not found"),
    ],
)
def test_an_unknown_recipe_names_the_nearest(text, message):
    with pytest.raises(ConfigError, match=message):
        find_recipe(text)


def test_a_copied_recipe_by_folder_entry_or_script(tmp_path, monkeypatch):
    folder = make_recipe(tmp_path / "mine", entries=("train", "finetune"))
    monkeypatch.chdir(tmp_path)
    copy = find_recipe("mine")
    assert (copy.folder, copy.entry, copy.shipped, copy.run_dir) == (folder, "train", False, tmp_path)
    assert copy.shown_script("accelerate") == "mine/train_accelerate.py"
    assert recipes.entry_points(folder) == ["train", "finetune"]
    assert find_recipe("mine:finetune").script == folder / "finetune.py"
    assert find_recipe("mine/finetune_accelerate.py").name == "mine:finetune"
    assert [p.name for p in copy.configs()] == ["tiny_cpu.yaml"]
    with pytest.raises(ConfigError, match="no entry point 'pretrain'"):
        find_recipe("mine:pretrain")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a recipe: it has no train.py"):
        find_recipe("empty")


def test_a_config_belongs_to_the_recipe_whose_configs_folder_holds_it(tmp_path):
    assert recipe_of_config(REPO / "recipes/nlp/configs/tiny_cpu.yaml").name == "nlp"
    assert recipe_of_config(REPO / "recipes/nlp/configs/finetune_tiny_cpu.yaml").name == "nlp:finetune"
    assert recipe_of_config(REPO / "recipes/cv/configs/swin_tiny.yaml").name == "cv"
    folder = make_recipe(tmp_path / "mine", entries=("train", "finetune"))
    copy = recipe_of_config(folder / "configs" / "tiny_cpu.yaml")
    assert (copy.folder, copy.entry, copy.shipped) == (folder, "train", False)
    assert recipe_of_config(folder / "configs" / "finetune_tiny.yaml").entry == "finetune"
    (tmp_path / "loose.yaml").write_text("preset: nlp\n")
    assert recipe_of_config(tmp_path / "loose.yaml") is None


def test_describe_runs_the_recipe_in_its_own_process(tmp_path, monkeypatch):
    folder = make_recipe(tmp_path / "copies" / "mine")
    monkeypatch.setenv("LOCAL_RANK", "3")  # a tool started inside a launched job
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's setting: the recipe's describe needs one thread
    run = describe(str(folder), folder / "configs" / "tiny_cpu.yaml", ["width=7"])
    assert run.recipe == "tiny" and run.config["width"] == 7 and run.model.num_params == 70
    seen = run.ds_config
    assert (seen["cwd"], seen["omp"], seen["rank"]) == (str(tmp_path / "copies"), "1", None)
    assert describe(str(folder)).config["width"] == 5  # the recipe's own default config
    # Cached per (entry, config, overrides): the script is not run again.
    (folder / "train.py").write_text("raise SystemExit('run again')\n")
    assert describe(str(folder), folder / "configs" / "tiny_cpu.yaml", ["width=7"]) == run


def test_describe_turns_the_recipes_refusal_into_one_config_error(tmp_path):
    folder = make_recipe(tmp_path / "mine")
    with pytest.raises(ConfigError, match=r"^unknown key 'widht'.*did you mean 'width'"):
        describe(str(folder), None, ["widht=3"])
    with pytest.raises(ConfigError, match=r"failed \(exit 1\): RuntimeError: the model would not build; run `python"):
        describe(str(folder), None, ["crash=true"])
    with pytest.raises(ConfigError, match="config file not found"):
        describe(str(folder), tmp_path / "missing.yaml")


def test_describe_command_is_what_a_user_types(tmp_path):
    folder = make_recipe(tmp_path / "mine")
    command = recipes.describe_command(find_recipe(str(folder)), folder / "configs" / "tiny_cpu.yaml", ["width=2"])
    assert command[1:] == [str(folder / "train.py"), "--describe", "--config", str(folder / "configs/tiny_cpu.yaml"),
                           "width=2"]  # fmt: skip
    assert json.loads(json.dumps(command)) == command and os.path.isabs(command[0])


def test_describe_configs_answers_for_each_config_what_its_own_describe_process_does(tmp_path, monkeypatch):
    folder = make_recipe(tmp_path / "copies" / "mine")
    configs = folder / "configs"
    (configs / "refused.yaml").write_text("widht: 3\n")
    (configs / "crashes.yaml").write_text("crash: true\n")
    (configs / "wide.yaml").write_text("width: 9\n")
    monkeypatch.setenv("LOCAL_RANK", "3")  # as in the one-config process: no launcher variables, one thread
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    asked = [configs / "refused.yaml", configs / "tiny_cpu.yaml", configs / "crashes.yaml", configs / "wide.yaml"]
    described = recipes.describe_configs(str(folder), asked)
    # A refusal or a crash leaves its config out and does not stop the configs after it.
    assert {path.name: run.config["width"] for path, run in described.items()} == {"tiny_cpu.yaml": 5, "wide.yaml": 9}
    seen = described[configs / "wide.yaml"].ds_config
    assert (seen["cwd"], seen["omp"], seen["rank"]) == (str(tmp_path / "copies"), "1", None)
    # The answers wait in describe's cache, refusals and failures included: the recipe's own error, as its own
    # process gives it; the script is not run again.
    (folder / "train.py").write_text("raise SystemExit('run again')\n")
    assert describe(str(folder), configs / "wide.yaml") is described[configs / "wide.yaml"]
    refusals = {}
    for name in ("refused.yaml", "crashes.yaml"):
        with pytest.raises(ConfigError) as refused:
            describe(str(folder), configs / name)
        refusals[name] = str(refused.value)
        with pytest.raises(ConfigError, match="run again"):  # a refusal is told once; the next ask runs the recipe
            describe(str(folder), configs / name)
    (folder / "train.py").write_text(TINY_RECIPE)
    # Asked afresh, each config's own process gives the same answers.
    monkeypatch.setattr(recipes, "_DESCRIPTIONS", {})
    assert {path: describe(str(folder), path) for path in described} == described
    for name, message in refusals.items():
        with pytest.raises(ConfigError) as refused:
            describe(str(folder), configs / name)
        assert str(refused.value) == message
    assert "refused.yaml: unknown key 'widht' (did you mean 'width'" in refusals["refused.yaml"]
    assert "failed (exit 1): RuntimeError: the model would not build; run `python" in refusals["crashes.yaml"]


def test_describe_runs_answers_each_runs_overrides_from_one_process(tmp_path, monkeypatch):
    """What the probe asks before its first candidate: a config file or none, each with its own overrides, in one
    recipe process; each answer is what describe(config, overrides) then returns without starting another."""
    folder = make_recipe(tmp_path / "mine")
    config = folder / "configs" / "tiny_cpu.yaml"
    started = []
    run_recipe_process = recipes._run_recipe_process
    monkeypatch.setattr(recipes, "_run_recipe_process", lambda *a: started.append(a[1]) or run_recipe_process(*a))
    asked = [(None, ["width=7"]), (config, ["devices=2"]), (config, ["widht=3"])]
    wide, on_two, refused = recipes.describe_runs(str(folder), asked)
    assert len(started) == 1
    assert (wide.config["width"], on_two.config["width"], on_two.world_size) == (7, 5, 2)
    assert isinstance(refused, ConfigError) and "did you mean 'width'" in str(refused)
    assert describe(str(folder), None, ["width=7"]) is wide and describe(str(folder), config, ["devices=2"]) is on_two
    with pytest.raises(ConfigError, match="did you mean 'width'"):
        describe(str(folder), config, ["widht=3"])
    assert len(started) == 1  # every answer came from the one process
