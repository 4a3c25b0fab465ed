"""``zero-recipes export`` on checkpoints the NLP recipe really wrote: ZeRO-3 from both backends, ZeRO-1 and 2.

Each run is the recipe as a user starts it (2 CPU processes, real DeepSpeed sharding over gloo, a few steps on a
small corpus folder). Checked:
- the export of a ZeRO-3 run, from Lightning and from Accelerate, loads with ``AutoModelForCausalLM`` and gives
  logits identical to the run's own ``final/`` (which the recipe gathered from the live engine);
- tied input/output embeddings survive: a Llama with ``tie_word_embeddings=True`` (the Lightning run) is written
  once, comes back tied and gives the same logits;
- every exported fp32 tensor equals DeepSpeed's own consolidation (``get_fp32_state_dict_from_zero_checkpoint``),
  for stages 1, 2 and 3;
- ``--verify`` compares with DeepSpeed's own consolidation, not with this project's reader: it reports zero
  differences on a correct export and fails (exit 2, one ``error:`` line) when one exported tensor is changed or
  when the layout code puts a parameter's elements in another parameter's place;
- ``--max-shard-size`` splits the weights over several files;
- each refusal (non-empty OUT_DIR, missing shard, corrupt shard, newer DeepSpeed format, not a checkpoint) is one
  ``error:`` line naming the problem, exit code 2, and nothing deleted or written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _util import PYTHON, REPO, accelerate_launch, run, tied_llama

from common.tools.cli import main as cli_main

RECIPE = REPO / "recipes" / "nlp"
TINY = [
    "seq_len=64",
    "micro_batch_size=2",
    "max_val_tokens=2048",
    "max_train_tokens=20000",
    "eval_interval=2",
    "checkpoint_interval=2",
    "log_interval=1",
    "sample_tokens=0",
    "max_steps=2",
]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 400 kB of standard-library source as a folder of files (the ``data=folder`` path of the recipe)."""
    from nlp.data import stdlib_source_files

    folder = tmp_path_factory.mktemp("corpus")
    for i, f in enumerate([f for f in stdlib_source_files() if 8_000 < f.stat().st_size < 40_000][:24]):
        shutil.copy(f, folder / f"{i:02d}_{f.name}")
    return folder


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    """A tiny Llama whose output matrix is its input embedding (``tie_word_embeddings=True``), as a model folder."""
    folder = tmp_path_factory.mktemp("tied") / "model"
    tied_llama(hidden_size=64, vocab_size=4096, max_positions=256).save_pretrained(folder)
    return folder


def lightning(out_dir: Path, corpus: Path, *extra: str) -> Path:
    run([PYTHON, RECIPE / "train.py", f"out_dir={out_dir}", f"data={corpus}", *TINY, *extra], timeout=600)
    return out_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, tied_model) -> dict[str, Path]:
    """The four runs every test here reads: ZeRO-3 on each backend (Lightning's with tied embeddings), ZeRO-1/2."""
    root = tmp_path_factory.mktemp("runs")
    found = {"lightning_zero3_tied": lightning(root / "l3", corpus, f"model={tied_model}")}
    args = [f"out_dir={root / 'a3'}", f"data={corpus}", *TINY]
    accelerate_launch(RECIPE / "train_accelerate.py", args, RECIPE / "accelerate.yaml")
    found["accelerate_zero3"] = root / "a3"
    found["lightning_zero1"] = lightning(root / "l1", corpus, "preset=deepspeed_stage_1")
    found["lightning_zero2"] = lightning(root / "l2", corpus, "preset=deepspeed_stage_2")
    return found


def export(*args) -> None:
    """``zero-recipes export ...`` in this process (the console script's own entry point)."""
    assert cli_main(["export", *map(str, args), "--quiet"]) == 0


def refused(capsys, *args) -> str:
    """Run the command expecting a refusal: exit code 2, one ``error:`` line, no traceback; return that line."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", *map(str, args), "--quiet"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1, err
    assert "Traceback" not in err
    return errors[0]


def logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    batch = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=batch).logits.float()


def exported_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(folder / file)))
    assert set(tensors) == set(index["weight_map"])
    return tensors


def deepspeed_consolidation(run_dir: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own reader of the same checkpoint: the independent reference."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    step = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return get_fp32_state_dict_from_zero_checkpoint(str(step))


def check_equals_deepspeed(run_dir: Path, out: Path, prefix: str) -> None:
    ours = exported_tensors(out)
    reference = {k.removeprefix(prefix): v for k, v in deepspeed_consolidation(run_dir).items()}
    assert ours, out
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("backend", ["lightning_zero3_tied", "accelerate_zero3"])
def test_zero3_export_loads_with_the_logits_of_the_runs_final(backend, runs, tmp_path):
    run_dir = runs[backend]
    # As a user types it, with --verify, on the run directory.
    out = tmp_path / "bf16"
    proc = run([PYTHON, "-m", "common.tools.cli", "export", run_dir, out, "--dtype", "bf16", "--verify"], timeout=300)
    assert "exported ZeRO-3 checkpoint" in proc.stdout and "(Hugging Face folder)" in proc.stdout
    assert "verify against DeepSpeed's zero_to_fp32: " in proc.stdout, proc.stdout
    assert "max abs difference 0;" in proc.stdout, proc.stdout
    assert "logits of from_pretrained vs DeepSpeed's tensors: max abs difference 0" in proc.stdout, proc.stdout
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= {p.name for p in out.iterdir()}
    assert torch.equal(logits(out), logits(run_dir / "final"))

    fp32 = tmp_path / "fp32"
    export(run_dir, fp32)
    check_equals_deepspeed(run_dir, fp32, "model." if backend.startswith("lightning") else "")


def test_tied_embeddings_are_written_once_and_come_back_tied(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "tied"
    export(runs["lightning_zero3_tied"], out, "--dtype", "bf16")
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_and_zero2_exports_equal_deepspeeds_consolidation(stage, runs, tmp_path):
    run_dir = runs[f"lightning_zero{stage}"]
    assert json.loads((run_dir / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage
    out = tmp_path / "fp32"
    export(run_dir / "checkpoints" / "step_000002", out, "--max-shard-size", "4MB")  # a step folder, in shards
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    check_equals_deepspeed(run_dir, out, "model.")
    bf16 = tmp_path / "bf16"
    export(run_dir, bf16, "--dtype", "bf16")
    assert torch.equal(logits(bf16), logits(run_dir / "final"))


# --- --verify can fail: a wrong export is caught by a reference the export's code did not produce ----------


def test_verify_fails_when_one_exported_tensor_is_changed(runs, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from common.tools.export import verify_export, verify_failures

    run_dir = runs["lightning_zero2"]
    out = tmp_path / "fp32"
    export(run_dir, out, "--verify")
    assert verify_failures(verify_export(run_dir, out, progress=False)) == []
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    name = sorted(index)[len(index) // 2]
    shard = out / index[name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3  # one element of one tensor
    save_file(tensors, str(shard), metadata={"format": "pt"})
    check = verify_export(run_dir, out, progress=False)
    assert check["differing"] == [name] and check["max_abs_param_diff"] == pytest.approx(1e-3, rel=1e-2)
    assert f"1 tensors differ (e.g. {name}" in verify_failures(check)[0]


def swap_two_parameters(layout_function):
    """The ZeRO-3 layout with two equally sized parameters' places exchanged: a bug the export's own reader shares."""

    def swapped(group_shapes, world_size):
        layout = layout_function(group_shapes, world_size)
        by_size: dict[int, list[str]] = {}
        for name, (_, partition) in layout.items():
            by_size.setdefault(partition, []).append(name)
        a, b = next(names for names in by_size.values() if len(names) >= 2)[:2]
        layout[a], layout[b] = layout[b], layout[a]
        return layout

    return swapped


def test_verify_fails_when_the_layout_code_misplaces_a_parameter(runs, tmp_path, capsys, monkeypatch):
    import common.tools.export

    monkeypatch.setattr(common.tools.export, "zero3_layout", swap_two_parameters(common.tools.export.zero3_layout))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", str(runs["accelerate_zero3"]), str(tmp_path / "out"), "--verify", "--quiet"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "--verify failed" in errors[0] and "2 tensors differ" in errors[0] and "logits differ" in errors[0]


# --- refusals: one error line each, nothing deleted or written ------------------------------------


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture
def checkpoint_copy(runs, tmp_path) -> Path:
    """A copy of the Accelerate ZeRO-3 run's last checkpoint folder, free to damage."""
    step = runs["accelerate_zero3"] / "checkpoints" / "step_000002"
    copy = tmp_path / "step_000002"
    shutil.copytree(step, copy)
    return copy


def test_refuses_a_non_empty_out_dir_without_overwrite(runs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = refused(capsys, runs["accelerate_zero3"], out)
    assert str(out) in line and "--overwrite" in line
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    export(runs["accelerate_zero3"], out, "--overwrite")
    assert not (out / "notes.txt").exists() and (out / "model.safetensors.index.json").is_file()


def test_refuses_a_missing_shard_and_names_it(checkpoint_copy, tmp_path, capsys):
    missing = checkpoint_copy / "pytorch_model" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    missing.unlink()
    before = snapshot(checkpoint_copy)
    line = refused(capsys, checkpoint_copy, tmp_path / "out")
    assert "missing checkpoint shard" in line and str(missing) in line
    assert snapshot(checkpoint_copy) == before and not (tmp_path / "out").exists()


def test_refuses_a_corrupt_shard_and_names_it(checkpoint_copy, tmp_path, capsys):
    corrupt = checkpoint_copy / "pytorch_model" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    corrupt.write_bytes(corrupt.read_bytes()[: corrupt.stat().st_size // 2])  # a save cut off half way
    before = snapshot(checkpoint_copy)
    line = refused(capsys, checkpoint_copy, tmp_path / "out")
    assert "corrupt or unreadable checkpoint shard" in line and str(corrupt) in line
    assert snapshot(checkpoint_copy) == before and not (tmp_path / "out").exists()


def test_refuses_a_checkpoint_from_a_newer_deepspeed(checkpoint_copy, tmp_path, capsys):
    from common.tools.zero_files import deepspeed_pickle_classes

    states = sorted((checkpoint_copy / "pytorch_model").glob("*_model_states.pt"))
    with torch.serialization.safe_globals(deepspeed_pickle_classes()):
        saved = torch.load(states[0], weights_only=True)
    saved["ds_version"] = "99.0.0"
    torch.save(saved, states[0])
    line = refused(capsys, checkpoint_copy, tmp_path / "out")
    assert "DeepSpeed 99.0.0" in line and "newer major version" in line and str(states[0]) in line
    assert not (tmp_path / "out").exists()


def test_refuses_what_is_not_a_checkpoint(corpus, tmp_path, capsys):
    line = refused(capsys, corpus, tmp_path / "out")
    assert "is not a DeepSpeed ZeRO checkpoint: expected a run directory" in line
    assert not (tmp_path / "out").exists()
