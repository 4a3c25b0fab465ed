"""The host copy an asynchronous checkpoint holds (async_save), in ``estimate`` and ``lint``, against hand-computed
figures and against the snapshot bench/checkpoint.py measured."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from common.snapshot_memory import snapshot_bytes_per_node, snapshot_bytes_per_rank

REPO = Path(__file__).resolve().parents[2]


def estimate_json(*args: str) -> dict:
    out = subprocess.run(
        ["zero-recipes", "estimate", *args, "--json"], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_term_is_what_the_snapshot_measured():
    """bench/checkpoint.py held 1,289,902,084 bytes of snapshot per rank: 215M parameters, fp32, ZeRO-3, 2 ranks.
    12 B x 214,983,680 / 2 = 1,289,902,080 (the 4 bytes left are the step counters and scalars)."""
    measured = json.loads((REPO / "bench/results/checkpoint.json").read_text())["results"]["stall"]
    params, ranks = measured["num_params"], measured["world_size"]
    writer, other = snapshot_bytes_per_rank(params / ranks, params, stage=3, precision="fp32")
    assert writer == other == 12 * params / ranks
    assert measured["snapshot_bytes_per_rank"] == pytest.approx(writer, abs=64)


def test_estimate_counts_the_copy_per_node_for_7b_on_8_devices():
    """7B, bf16, 8 devices: stage 3 copies 12 x 7e9 / 8 = 10.5 GB a rank, 84 GB a node; stage 2's first rank also
    copies the 2-byte module (14 GB): 24.5 GB, and the node 24.5 + 7 x 10.5 = 98 GB. Without the flag, no term."""
    run = ("--params", "7e9", "--gpus", "8", "--gpu-memory", "80GB", "--host-memory", "90GB")
    plain = {(r["stage"], r["offload"]): r for r in estimate_json(*run)["rows"]}
    data = estimate_json(*run, "--async-save")
    rows = {(r["stage"], r["offload"]): r for r in data["rows"]}
    assert data["inputs"]["async_save"] is True
    assert rows[(3, "none")]["async_snapshot_bytes"] == 10.5e9
    assert rows[(3, "none")]["host_ram_per_node_bytes"] == 84e9
    assert rows[(2, "none")]["async_snapshot_bytes"] == 24.5e9
    assert rows[(2, "none")]["host_ram_per_node_bytes"] == 98e9
    # Optimizer offload holds 12 B x 7e9 / 8 a rank in host RAM already; the snapshot copies it again: 84 + 84 GB.
    assert rows[(3, "optimizer")]["host_ram_per_node_bytes"] == 168e9
    # 98 GB does not fit 90 GB of host RAM; 84 GB does.
    assert not rows[(2, "none")]["fits"] and "host RAM" in rows[(2, "none")]["note"]
    assert rows[(3, "none")]["fits"] and plain[(2, "none")]["fits"]
    assert plain[(3, "none")]["async_snapshot_bytes"] == 0 and plain[(3, "none")]["host_ram_per_node_bytes"] == 0


def test_a_recipe_config_with_async_save_adds_the_term(tmp_path):
    """The tiny NLP config (5,261,568 parameters, bf16, 2 CPU processes) with async_save: true: stage 3 copies
    12 x 5,261,568 / 2 = 31,569,408 bytes a rank (63,138,816 a node); stage 2's first rank 8 x 5,261,568."""
    config = tmp_path / "tiny_async.yaml"
    shutil.copy(REPO / "recipes/nlp/configs/tiny_cpu.yaml", config)
    config.write_text(config.read_text() + "async_save: true\n")
    data = estimate_json("--recipe", "nlp", "--config", str(config))
    rows = {(r["stage"], r["offload"]): r for r in data["rows"]}
    assert data["model"]["num_params"] == 5_261_568 and data["inputs"]["gpus_per_node"] == 2
    assert rows[(3, "none")]["async_snapshot_bytes"] == 31_569_408
    assert rows[(3, "none")]["host_ram_per_node_bytes"] == 63_138_816
    assert rows[(2, "none")]["async_snapshot_bytes"] == 8 * 5_261_568


def test_writers_per_node():
    """Under TP x PP every data-parallel group has a first rank that writes the module: they count whole."""
    assert snapshot_bytes_per_node(10.0, 4.0, ranks_per_node=8) == 10 + 7 * 4
    assert snapshot_bytes_per_node(10.0, 4.0, ranks_per_node=8, writers=2) == 2 * 10 + 6 * 4
    assert snapshot_bytes_per_node(10.0, 4.0, ranks_per_node=2, writers=4) == 20
    assert snapshot_bytes_per_rank(100, 100, stage=0, precision="fp32") == (4 * 100 + 8 * 100, 0.0)
