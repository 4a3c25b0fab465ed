"""``tensor_parallel=N`` in the NLP recipe (both entry points): DeepSpeed AutoTP with ZeRO 1 and 2, through the recipe.

The equivalence runs compare tensor parallel 2 on 2 processes (one data-parallel replica) with one process (one
replica, no tensor parallelism): the same micro-batches, the same global batch, so fp32 losses agree to rounding.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from _util import NLP_RECIPE, PYTHON, assert_trained, launch_nlp, one_error, read_json, run, tiny_fp32_run
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.config import config_to_dict, load_config
from common.errors import ConfigError
from common.memory_formulas import facts_from_hf_config
from common.parallel import ParallelLayout, rank_params
from common.resume import find_resume_point
from common.rundir import read_metrics
from common.tools.export import export_checkpoint, load_structure

RECIPE = NLP_RECIPE
TRAIN_ACCELERATE = RECIPE / "train_accelerate.py"
STEPS = 5  # then a resume to STEPS + 2
RUN = [*tiny_fp32_run(STEPS), "preset=deepspeed_stage_1"]


# --- fast: the combinations refused before any work ---------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tensor_parallel=3", "devices=2"], "tensor_parallel=3 does not divide the 2 rank(s)"),
        (["tensor_parallel=3", "devices=3"], "does not divide the model's 4 attention heads"),
        (["tensor_parallel=2"], "use preset=deepspeed_stage_1 or deepspeed_stage_2"),  # the default preset: ZeRO-3
    ],
    ids=["world", "heads", "zero3"],
)
def test_a_bad_tensor_parallel_is_one_clear_error(args, message):
    error = one_error(run([PYTHON, TRAIN_ACCELERATE, "--describe", *args], timeout=300, check=False))
    assert message in error, error
    if "rank(s)" in message:
        assert "use one of 1, 2" in error, error


# --- slow: TP 2 trains like one process, exports one model, and refuses another TP degree on resume ---------


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def joined_shape(checkpoint: Path, name: str) -> torch.Size:
    """The shape rank 0's slice (mp_rank_00) saved for a parameter of the Hugging Face model."""
    states = next(checkpoint.glob("*/mp_rank_00_model_states.pt"))
    shapes = {k: v for group in load_structure(states)["param_shapes"] for k, v in group.items()}
    return next(shape for key, shape in shapes.items() if key.endswith(name))


def logits(folder: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        return model(torch.arange(16).reshape(2, 8)).logits


def train_losses(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_metrics(out_dir) if "train_loss" in r}


def launch(out_dir: Path, tp: int, processes: int, *extra: str) -> None:
    launch_nlp("accelerate", out_dir, processes, f"tensor_parallel={tp}", *RUN, *extra)


@pytest.mark.slow
def test_tensor_parallel_2_trains_and_resumes_like_one_process(tmp_path):
    runs = {2: tmp_path / "tp2", 1: tmp_path / "tp1"}
    launch(runs[2], 2, 2)  # STEPS steps, then resumed from its step-STEPS checkpoint for 2 more
    launch(runs[2], 2, 2, "resume=true", f"max_steps={STEPS + 2}")
    launch(runs[1], 1, 1, f"max_steps={STEPS + 2}")  # the reference: one process, uninterrupted
    # Lightning, TP 2 on 2 processes, under ZeRO-2: the same batches as the Accelerate runs (StepSampler over
    # replicas); with one replica ZeRO-2 partitions nothing more than ZeRO-1, so the TP 1 run is its reference too.
    lightning = tmp_path / "lightning_tp2"
    launch_nlp("lightning", lightning, 2, "tensor_parallel=2", *RUN, "preset=deepspeed_stage_2")
    tp2, tp1, lightning_tp2 = train_losses(runs[2]), train_losses(runs[1]), train_losses(lightning)
    assert sorted(tp2) == sorted(tp1) == list(range(1, STEPS + 3))
    assert sorted(lightning_tp2) == list(range(1, STEPS + 1))
    for step in tp1:
        assert math.isclose(tp2[step], tp1[step], rel_tol=1e-5), (step, tp2, tp1)
    for step in lightning_tp2:
        assert math.isclose(lightning_tp2[step], tp1[step], rel_tol=1e-5), (step, lightning_tp2, tp1)
    assert read_json(lightning / "summary.json")["export_check"]["max_abs_logit_diff"] < 1e-4
    assert_trained(runs[2])  # the loss on the fixed validation blocks went down, not step 1's vs step N's batch
    summary, reference = read_json(runs[2] / "summary.json"), read_json(runs[1] / "summary.json")
    assert math.isclose(summary["val_loss"], reference["val_loss"], rel_tol=1e-5)
    assert read_json(runs[2] / "ds_config.json")["tensor_parallel"] == {"autotp_size": 2}
    assert read_json(lightning / "ds_config.json")["zero_optimization"]["stage"] == 2
    # The export gathers the tensor-parallel shards into one Hugging Face model; final_export reloads it with
    # transformers and compares its logits on a fixed batch with the trained (sharded) model's.
    check = summary["export_check"]
    assert check["ok"] and check["max_abs_logit_diff"] < 1e-4, check
    # Parameter bytes per rank: the engine's count on rank 0 against the planner (`zero-recipes estimate
    # --tensor-parallel 2`) fed the exported model's config.json, and against the plan the recipe printed. AutoTP
    # splits the linear layers and keeps the embedding and norms whole; counting everything as split is 17 % low.
    measured = summary["model_state_bytes_measured"]["params"]
    planned = rank_params(facts_from_hf_config(runs[2] / "final" / "config.json"), ParallelLayout(2, tensor=2))[0]
    assert measured == pytest.approx(4 * planned, rel=0.05), (measured, 4 * planned)  # fp32: 4 bytes each
    assert summary["memory_plan"]["predicted_bytes_per_rank"]["params"] == pytest.approx(measured, rel=0.05)
    # Each rank saved its tensor-parallel slice of the model (DeepSpeed's mp_rank_00/01 files).
    checkpoint = runs[2] / "checkpoints" / f"step_{STEPS + 2:06d}"
    assert len(list(checkpoint.glob("*/mp_rank_0[01]_model_states.pt"))) == 2
    # zero-recipes export joins the slices into one Hugging Face model. The reference is final/, which the recipe
    # gathered from the live sharded model with DeepSpeed's own gather (not the export's reader): same tensors, same
    # logits through from_pretrained.
    exported = export_checkpoint(checkpoint, tmp_path / "export", progress=False)
    assert exported["tensor_parallel"] == 2 and exported["hugging_face"], exported
    final, export = folder_tensors(runs[2] / "final"), folder_tensors(tmp_path / "export")
    assert sorted(export) == sorted(final)
    split = [name for name in final if final[name].shape != joined_shape(checkpoint, name)]
    assert split, "no tensor was split: the test would not see a wrong join"
    for name, tensor in final.items():
        assert torch.equal(export[name], tensor), name
    assert torch.equal(logits(runs[2] / "final"), logits(tmp_path / "export"))
    # Resume with another tensor-parallel degree: refused before any work (tensor_parallel is no resumable key).
    sys.path.insert(0, str(RECIPE))
    from nlp_config import NLPConfig

    other = load_config(NLPConfig, None, [f"out_dir={runs[2]}", "resume=true", "tensor_parallel=1", *RUN])
    with pytest.raises(ConfigError, match="tensor_parallel"):
        find_resume_point(runs[2], config_to_dict(other), 2)
