"""Every option that one mode of a ``zero-recipes`` command reads is refused in the others, in one line.

Each case is an option given where it would be ignored; the refusal must name the option and the mode it belongs
to, exit 2, and come before anything runs or is written. Beside them, the same options in their own mode are still
accepted (so the refusal is not a blanket one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.tools import cli

REPO = Path(__file__).resolve().parents[2]

REFUSED = {
    "doctor-sizes-without-collectives": (["doctor", "--sizes", "lots"], "--sizes", "doctor --collectives"),
    "doctor-iters-without-collectives": (["doctor", "--iters", "3"], "--iters", "doctor --collectives"),
    "doctor-hang-sizes": (["doctor", "--hang", "{tmp}", "--sizes", "1MiB"], "--sizes", "doctor --collectives"),
    "doctor-hang-iters": (["doctor", "--hang", "{tmp}", "--iters", "3"], "--iters", "doctor --collectives"),
    "doctor-hang-out": (["doctor", "--hang", "{tmp}", "--out", "{tmp}/o"], "--out", "doctor and doctor --collectives"),
    "doctor-hang-checkpoint-path": (
        ["doctor", "--hang", "{tmp}", "--checkpoint-path", "{tmp}"],
        "--checkpoint-path",
        "doctor and doctor --collectives",
    ),
    "config-nvme-path-without-nvme": (
        ["config", "deepspeed_stage_3_offload", "--nvme-path", "{tmp}"],
        "--nvme-path",
        "NVMe offload",
    ),
    "estimate-host-memory-without-offload": (
        ["estimate", "--params", "7e9", "--offload", "none", "--host-memory", "64GB"],
        "--host-memory",
        "the offload rows",
    ),
    "estimate-bandwidth-without-offload": (
        ["estimate", "--params", "7e9", "--offload", "none", "--bandwidth", "nvme=2"],
        "--bandwidth",
        "the offload rows",
    ),
    "lint-recipe-on-a-deepspeed-json": (
        ["lint", "recipes/nlp/ds_config.json", "--recipe", "nlp"],
        "--recipe",
        "a recipe YAML",
    ),
    "lint-recipe-on-an-accelerate-yaml": (
        ["lint", "recipes/nlp/accelerate.yaml", "--recipe", "nlp"],
        "--recipe",
        "a recipe YAML or a DeepSpeed JSON",
    ),
    "lint-backend-on-an-accelerate-yaml": (
        ["lint", "recipes/nlp/accelerate.yaml", "--backend", "lightning"],
        "--backend",
        "a recipe YAML or a DeepSpeed JSON",
    ),
    "probe-bandwidth-without-offload-candidates": (
        [
            "probe",
            "nlp",
            "--candidates",
            "deepspeed_stage_1,deepspeed_stage_2",
            "--bandwidth",
            "nvme=2",
            "--out",
            "{tmp}/p",
        ],
        "--bandwidth",
        "offload candidates",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_option_outside_its_mode_is_refused_in_one_line(case, tmp_path, capsys, monkeypatch):
    argv, option, belongs_to = REFUSED[case]
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as stop:
        cli.main([a.format(tmp=tmp_path) for a in argv])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {option} applies to {belongs_to}"), err
    assert captured.out == "" and sorted(p.name for p in tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_the_same_options_apply_in_their_own_mode(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli.main(["doctor", "--out", str(tmp_path / "o"), "--checkpoint-path", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "o" / "doctor.json").read_text())
    assert report["hardware"]["checkpoint_path"] == str(tmp_path)
    capsys.readouterr()
    try:  # without libaio the NVMe preset is refused for that reason, which is not the option's mode
        code = cli.main(["config", "deepspeed_stage_3_offload_nvme", "--nvme-path", str(tmp_path)])
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    assert "--nvme-path applies" not in captured.err
    if code == 0:
        zero = json.loads(captured.out)["zero_optimization"]
        assert zero["offload_param"]["nvme_path"] == zero["offload_optimizer"]["nvme_path"] == str(tmp_path)
    else:
        assert "libaio" in captured.err
    assert cli.main(["estimate", "--params", "7e9", "--offload", "optimizer", "--host-memory", "64GB"]) == 0
    assert cli.main(["lint", "recipes/nlp/ds_config.json", "--backend", "lightning"]) in (0, 1)
