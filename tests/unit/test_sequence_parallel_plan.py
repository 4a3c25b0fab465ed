"""Ulysses sequence parallelism in the planner's layout, `zero-recipes estimate` and `zero-recipes probe`.

The activation formula itself is checked against autograd in tests/unit/test_sequence_parallel_activations.py; here
the layout arithmetic (DP = world / (TP x PP x SP), ZeRO over DP x SP), the longest-sequence search, the command's
output and errors, and the probe's plumbing of ``sequence_parallel=N`` into what each candidate runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from common.errors import ConfigError
from common.memory_formulas import (
    USABLE_FRACTION,
    ModelFacts,
    ParallelLayout,
    check_layout,
    facts_from_hf_config,
    pipeline_activations,
)
from common.tools import memory, probe
from common.tools.cli import main as cli_main
from common.tools.memory import PlanInputs
from common.tools.probe import Candidate
from common.tools.recipes import find_recipe
from nlp.model import build_llama_config, llama_param_count

EXE = shutil.which("zero-recipes")


def cli(*args: str) -> subprocess.CompletedProcess:
    assert EXE, "zero-recipes is not installed: pip install -e ."
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    """The recipe's ``8b`` size (Llama-3-8B) as a config.json, as a user's would be."""
    folder = tmp_path_factory.mktemp("llama3")
    build_llama_config("8b").save_pretrained(folder)
    return folder / "config.json"


def test_the_8b_size_is_llama_3_8b():
    config = build_llama_config("8b")
    assert llama_param_count(config) == 8_030_261_248  # Meta-Llama-3-8B's count
    assert (config.num_key_value_heads, config.vocab_size, config.intermediate_size) == (8, 128256, 14336)
    assert config.rope_parameters["rope_theta"] == 500000.0


# --- layout -----------------------------------------------------------------------------------------------------


def test_sp_divides_the_data_parallel_degree_but_zero_shards_over_it():
    layout = ParallelLayout(world_size=16, tensor=2, sequence=4)
    assert (layout.data_parallel, layout.zero_ranks) == (2, 8)  # 16 / (2 x 4) replicas; ZeRO over 16 / 2
    assert ParallelLayout(world_size=8, sequence=8).trivial  # every rank holds the whole model


def test_sp_model_states_are_the_guides_formula_over_every_rank(llama3):
    """SP ranks hold the whole model and DeepSpeed shards it over them too: the states do not change with SP."""
    facts = facts_from_hf_config(llama3)
    k = facts.num_params

    def states(sp: int) -> dict[tuple[int, str], float]:
        inputs = PlanInputs(gpus_per_node=8, seq_len=8192, sequence_parallel=sp, device_memory_bytes=80e9)
        return {(r.stage, r.offload): r.model_states_bytes for r in memory.plan(facts, inputs).rows}

    assert states(8) == states(1)
    assert states(8)[(2, "none")] == pytest.approx(2 * k + 14 * k / 8, rel=1e-12)


# --- the command ------------------------------------------------------------------------------------------------


def test_estimate_prints_activations_per_rank_and_the_longest_sequence(llama3):
    args = ["--model-config", str(llama3), "--gpus", "8", "--gpu-memory", "80GB", "--seq-len", "32768"]
    out = cli("estimate", *args, "--sequence-parallel", "8", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    facts = facts_from_hf_config(llama3)
    expected = pipeline_activations(facts, 32768, 1, "none", "bf16", "sdpa", sequence_parallel=8)
    assert data["rows"][0]["activations_bytes"] == pytest.approx(expected, rel=1e-12)
    assert (data["inputs"]["sequence_parallel"], data["inputs"]["data_parallel"]) == (8, 1)
    assert data["inputs"]["zero_partition_ranks"] == 8

    longest = data["longest_sequence"]
    with_sp, without = longest["with_sp"]["on_device"], longest["without_sp"]["on_device"]
    assert with_sp["stage"] == without["stage"] == 3 and with_sp["offload"] == "none"
    assert 7 * without["seq_len"] < with_sp["seq_len"] < 9 * without["seq_len"]  # about SP x longer
    # The search's answer is the last multiple of 1024 tokens that fits: one step more does not.
    row = next(r for r in data["rows"] if (r["stage"], r["offload"]) == (3, "none"))
    base, usable = row["model_states_bytes"] + row["buffers_bytes"], USABLE_FRACTION * 80e9
    for sp, seq_len in ((8, with_sp["seq_len"]), (1, without["seq_len"])):
        at, after = (
            pipeline_activations(facts, s, 1, "full", "bf16", "sdpa", 1, 1, sp) for s in (seq_len, seq_len + 1024)
        )
        assert base + at <= usable < base + after, (sp, seq_len)

    text = cli("estimate", *args, "--sequence-parallel", "8")
    assert text.returncode == 0, text.stderr
    assert (
        "sequence parallel: 8 ranks split each sequence (Ulysses): a rank holds 4,096 of 32,768 tokens" in text.stdout
    )
    stage3 = next(line for line in text.stdout.splitlines() if line.startswith("  stage 3:"))
    assert f"{without['seq_len']:,} tokens without SP, {with_sp['seq_len']:,} tokens with SP 8" in stage3


def test_estimate_without_sp_prints_no_longest_sequence_block_but_has_it_in_json():
    out = cli("estimate", "--params", "7e9", "--gpus", "8", "--gpu-memory", "80GB")
    assert out.returncode == 0 and "longest sequence" not in out.stdout
    data = json.loads(cli("estimate", "--params", "7e9", "--gpus", "8", "--gpu-memory", "80GB", "--json").stdout)
    assert data["longest_sequence"]["without_sp"] == data["longest_sequence"]["with_sp"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "6", "--sequence-parallel", "3"], "--sequence-parallel 3 does not divide the 32 attention heads"),
        (["--gpus", "8", "--sequence-parallel", "8", "--seq-len", "4100"], "--seq-len 4100 is not divisible by"),
        (["--gpus", "4", "--sequence-parallel", "8"], "4 ranks do not split into tensor 1 x pipeline 1 x sequence 8"),
        (["--gpus", "8", "--sequence-parallel", "8", "--attention", "eager"], "refuses eager"),
        (["--gpus", "8", "--sequence-parallel", "0"], "--sequence-parallel must be >= 1"),
    ],
    ids=["heads", "seq-len", "world", "eager", "zero"],
)
def test_bad_sequence_parallel_is_a_one_line_error(args, message, llama3, capsys):
    # In-process (a console-script start costs seconds): an exception other than the exit would fail the test.
    with pytest.raises(SystemExit) as stop:
        cli_main(["estimate", "--model-config", str(llama3), "--gpu-memory", "80GB", *args])
    out = capsys.readouterr()
    assert stop.value.code == 2, out.out
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out.err


def test_kv_heads_must_split_over_sp_or_sp_over_them():
    facts = ModelFacts(num_params=1, architecture="transformer", hidden_size=384, num_layers=2, num_heads=12)
    check_layout(replace(facts, num_kv_heads=2), ParallelLayout(4, sequence=4))  # 2 KV heads, 4 ranks: 1 replicated
    check_layout(replace(facts, num_kv_heads=12), ParallelLayout(4, sequence=4))  # 3 each
    with pytest.raises(ConfigError, match="the 6 key/value heads"):
        check_layout(replace(facts, num_kv_heads=6), ParallelLayout(4, sequence=4))


def test_the_long_context_config_plans_with_its_own_sequence_parallel():
    out = cli(
        "estimate", "--recipe", "nlp", "--config", "recipes/nlp/configs/llama_8b_long.yaml", "--gpu-memory", "80GB",
        "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["inputs"]["sequence_parallel"] == 8 and data["inputs"]["seq_len"] == 65536
    assert data["model"]["num_params"] == 8_030_261_248
    fits = {(r["stage"], r["offload"]): r["fits"] for r in data["rows"]}
    assert fits[(3, "none")]  # the config's ZeRO-3 preset fits 8 x 80 GB by the planner


# --- the probe --------------------------------------------------------------------------------------------------


def test_candidate_command_carries_sequence_parallel(tmp_path):
    nlp = find_recipe("nlp")
    args = (nlp, "lightning", 5, 4, tmp_path / "run", tmp_path / "c.yaml")
    assert "sequence_parallel=2" in probe.candidate_command(*args, sequence_parallel=2)
    assert not any(k.startswith("sequence_parallel") for k in probe.candidate_command(*args))
    acc = probe.candidate_command(nlp, "accelerate", 5, 4, tmp_path / "run", tmp_path / "c.yaml", None, 2)
    assert acc[-1] == "sequence_parallel=2" and "train_accelerate.py" in acc[acc.index("--use_deepspeed") + 1]


def test_probe_runs_every_candidate_with_sequence_parallel(tmp_path):
    """A fake runner records the commands: each candidate's config and command hold sequence_parallel=2, and the
    report and recommended.yaml say so (no real run: the recipe's side is tested in tests/recipes/)."""
    commands: list[list[str]] = []

    def runner(command: list[str], log: Path, timeout_s: float) -> tuple[int, str]:
        commands.append(command)
        out_dir = Path(next(k for k in command if k.startswith("out_dir=")).partition("=")[2])
        out_dir.mkdir(parents=True, exist_ok=True)
        summary = {"throughput": {"value": 100.0, "unit": "tokens/s/device"}, "peak_memory_bytes": 10**9}
        (out_dir / "summary.json").write_text(json.dumps(summary))
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("ok\n")
        return 0, "ok\n"

    out = tmp_path / "probe"
    result = probe.run_probe(
        "nlp", [Candidate("deepspeed_stage_2")], steps=2, devices=2, out=out, runner=runner, progress=False,
        sequence_parallel=2,
    )  # fmt: skip
    assert result.sequence_parallel == 2 and len(commands) == 1
    assert "sequence_parallel=2" in commands[0]
    assert yaml.safe_load((out / "configs" / "deepspeed_stage_2.yaml").read_text())["sequence_parallel"] == 2
    assert yaml.safe_load((out / "recommended.yaml").read_text())["sequence_parallel"] == 2
    assert json.loads((out / "report.json").read_text())["sequence_parallel"] == 2
    assert "Sequence parallel 2 (Ulysses) in every candidate" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    ("devices", "sp", "message"),
    [(2, 4, "does not divide the 2 processes"), (3, 3, "--sequence-parallel 3 does not divide the 4 attention heads")],
)
def test_probe_refuses_what_cannot_split_before_running(tmp_path, devices, sp, message):
    def runner(command: list[str], log: Path, timeout_s: float) -> tuple[int, str]:
        raise AssertionError("nothing runs")

    with pytest.raises(ConfigError, match=message):
        probe.run_probe(
            "nlp", [Candidate("deepspeed_stage_2")], devices=devices, out=tmp_path, runner=runner, progress=False,
            sequence_parallel=sp,
        )  # fmt: skip
