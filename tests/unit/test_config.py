"""Recipe configs: YAML + key=value overrides into a dataclass, with errors that name the nearest key."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.config import load_config, parse_value
from common.errors import ConfigError
from common.rundir import prepare_run_dir, refuse_existing_out_dir


@dataclass
class Demo:
    out_dir: str = "runs/demo"
    max_steps: int = 10
    lr: float = 1e-3
    resume: bool = False
    devices: int = 1
    model: str = "tiny"
    data: str | None = None
    layers: list[int] | None = None

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")


@pytest.mark.parametrize(
    ("text", "value"),
    [("2", 2), ("1e6", 1e6), ("1e-3", 1e-3), ("true", True), ("null", None), ("[1, 2]", [1, 2]), ("abc", "abc")],
)
def test_parse_value(text, value):
    assert parse_value(text) == value


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 5\nlr: 3.0e-4\nlayers: [2, 2]\n")
    cfg = load_config(Demo, path, ["max_steps=7", "resume=true", "data=/x", "devices=2"])
    assert (cfg.max_steps, cfg.lr, cfg.resume, cfg.data, cfg.devices, cfg.layers) == (7, 3e-4, True, "/x", 2, [2, 2])


def test_none_values():
    assert load_config(Demo, None, ["data=none"]).data is None
    # A plain str field keeps the word: activation_checkpointing=none must not become None or "None".
    assert load_config(Demo, None, ["model=none"]).model == "none"
    assert load_config(Demo, None, ["layers=[1, 2]"]).layers == [1, 2]
    assert load_config(Demo, None, ["layers=3,4"]).layers == [3, 4]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["max_step=5"], "did you mean 'max_steps'"),
        (["max_steps=five"], "max_steps: expected an integer"),
        (["lr=fast"], "lr: expected a number"),
        (["resume=maybe"], "resume: expected true or false"),
        (["max_steps=0"], "max_steps must be >= 1"),
        (["max_steps"], "not key=value"),
    ],
)
def test_bad_overrides(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Demo, None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(Demo, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Demo, bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("modle: tiny\n")
    with pytest.raises(ConfigError, match="did you mean 'model'"):
        load_config(Demo, typo)
    unsafe = tmp_path / "unsafe.yaml"
    unsafe.write_text("model: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Demo, unsafe)


@pytest.mark.parametrize(
    ("flags", "below"),
    [({}, False), ({"overwrite": True}, False), ({"resume": True}, False), ({}, True)],
    ids=["plain", "overwrite", "resume", "below-a-file"],
)
def test_out_dir_that_is_a_file_is_refused_and_kept(tmp_path, flags, below):
    existing = tmp_path / "results.txt"
    existing.write_text("mine\n")
    out_dir = existing / "run" if below else existing
    with pytest.raises(ConfigError, match=f"out_dir {out_dir} .*a file, not a folder"):
        refuse_existing_out_dir(out_dir, resume=flags.get("resume", False), overwrite=flags.get("overwrite", False))
    with pytest.raises(ConfigError, match="a file, not a folder"):
        prepare_run_dir(out_dir, **flags)  # overwrite=true replaces a run directory, never a file
    assert existing.read_text() == "mine\n"
