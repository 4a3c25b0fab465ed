"""Every recipe's shipped ``accelerate*.yaml`` says how it is launched and how its DeepSpeed JSON is made, truly.

Each file opens with a header written by ``common.strategy.write_accelerate_files``: the ``accelerate launch`` line
(with the recipe's own script) and the ``zero-recipes config ...`` command that writes the JSON beside it. Checked,
for each file: the launch line names this file and a script next to it; the command, run through the CLI, prints
the shipped JSON byte for byte; and the factory, given the same script and command, writes the shipped YAML byte
for byte (so neither file was edited by hand, and the header cannot drift from the files).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from _util import REPO

from common.strategy import write_accelerate_files
from common.tools.cli import main as cli_main

# The recipes' factory-written files (recipes/launch/ holds hand-written multi-node templates).
SHIPPED = sorted(p for p in REPO.glob("recipes/*/accelerate*.yaml") if (p.parent / "train.py").is_file())
LAUNCH = "#   accelerate launch --config_file "


def header_lines(text: str) -> tuple[list[str], str]:
    """(the launch command's words, the command that writes the JSON) from a YAML's header."""
    lines = text.splitlines()
    launch = next(line for line in lines if line.startswith(LAUNCH))
    regenerate = next(line for line in lines if line.startswith("#   zero-recipes config "))
    return shlex.split(launch.removeprefix("#")), regenerate.removeprefix("#").strip()


def test_every_recipe_ships_its_accelerate_files():
    assert {p.relative_to(REPO).as_posix() for p in SHIPPED} >= {
        "recipes/nlp/accelerate.yaml",
        "recipes/nlp/accelerate_finetune.yaml",
        "recipes/cv/accelerate.yaml",
        "recipes/science/accelerate.yaml",
    }


@pytest.mark.parametrize("yaml_path", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shipped_files_are_what_their_header_commands_write(yaml_path: Path, tmp_path, monkeypatch, capsys):
    shipped = yaml_path.read_text()
    launch, regenerate = header_lines(shipped)
    assert launch[:3] == ["accelerate", "launch", "--config_file"]
    config_file, script = launch[3:]
    assert config_file == yaml_path.relative_to(REPO).as_posix()
    assert (REPO / script).is_file() and Path(script).parent == Path(config_file).parent
    assert Path(script).name.endswith("_accelerate.py")

    # The command prints the JSON that the YAML names, byte for byte.
    command, redirect, target = regenerate.partition(" > ")
    assert redirect and shlex.split(command)[:2] == ["zero-recipes", "config"]
    launch_config = yaml.safe_load(shipped)
    assert launch_config["deepspeed_config"]["deepspeed_config_file"] == target
    monkeypatch.chdir(REPO)
    assert cli_main(shlex.split(command)[1:]) == 0
    printed = capsys.readouterr().out
    assert printed == (REPO / target).read_text()

    # The factory writes this YAML, header included, from the repository root's point of view.
    monkeypatch.chdir(tmp_path)
    written = write_accelerate_files(
        json.loads(printed),
        Path(config_file).parent,
        num_processes=launch_config["num_processes"],
        num_machines=launch_config["num_machines"],
        use_cpu=launch_config["use_cpu"],
        json_name=Path(target).name,
        yaml_name=yaml_path.name,
        script=script,
        regenerate=regenerate,
    )
    assert written.read_text() == shipped


def test_a_file_written_without_a_recipe_names_the_general_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    written = write_accelerate_files({"zero_optimization": {"stage": 2}}, "cfg", num_processes=8)
    text = written.read_text()
    assert "#   accelerate launch --config_file cfg/accelerate.yaml YOUR_SCRIPT.py\n" in text
    assert "zero-recipes config PRESET" in text and "without a DeepSpeed plugin reads it" in text
    loaded = yaml.safe_load(text)  # the header is comments only
    assert loaded["num_processes"] == 8 and loaded["deepspeed_config"]["deepspeed_config_file"] == "cfg/ds_config.json"
