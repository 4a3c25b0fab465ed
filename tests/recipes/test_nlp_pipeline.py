"""``recipes/nlp/train_pipeline.py``: DeepSpeed's pipeline engine on the NLP recipe's Llama, ZeRO 1, through the recipe.

The equivalence run compares pipeline parallel 2 on 2 processes (one data-parallel replica, launched by torchrun;
stopped after RESUME_AT steps and resumed) with one stage in one process (a bare ``python`` run, uninterrupted): the
same micro-batches, the same global batch, so fp32 losses agree to rounding. Both run through the same pipeline
engine (``PipelineModule`` and ``train_batch``), so this checks the stages against one stage, resume and the export,
not the engine against an independent loop: the check that counts, pipeline 2 x data parallel 2 against Accelerate's
4 data-parallel replicas, is tests/recipes/test_nlp_data_parallel_4.py. One set of runs serves every slow assertion
(a module-scoped fixture).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from _util import NLP_RECIPE, PYTHON, REPO, assert_trained, launch_nlp, one_error, read_json, run, tiny_fp32_run

from common.config import load_config
from common.errors import ConfigError
from common.memory_formulas import facts_from_model_config
from common.parallel import ParallelLayout, rank_params
from common.rundir import read_metrics
from common.tools.export import open_checkpoint

RECIPE = NLP_RECIPE
TRAIN_PIPELINE = RECIPE / "train_pipeline.py"
STEPS = 5
RESUME_AT = 3  # the PP 2 run stops here, then resume=true trains it to STEPS (the learning rate is constant by then)
# Each run trains its own tokenizer: the run directory checked below holds it, as a user's run does.
RUN = [*tiny_fp32_run(STEPS, own_tokenizer=True), "preset=deepspeed_stage_1", "pipeline_micro_batches=2"]


# --- fast: the combinations refused before any work ---------------------------------------------------


@pytest.fixture(scope="module")
def recipe_modules():
    """``nlp_config``, ``pretraining`` and ``nlp_layout``, imported the way the entry points do (from the script's
    folder)."""
    sys.path.insert(0, str(RECIPE))
    import nlp_config
    import nlp_layout
    import pretraining

    yield nlp_config, pretraining, nlp_layout
    sys.path.remove(str(RECIPE))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pipeline_parallel=2"], 'ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"); use preset=deep'),
        (["pipeline_parallel=2", "preset=deepspeed_stage_2"], "ZeRO stage 2 with the pipeline engine"),
        (["preset=deepspeed_stage_2"], "ZeRO stage 2 with the pipeline engine (pipeline_parallel=1)"),  # one stage
        (["pipeline_parallel=5", "devices=5", "preset=deepspeed_stage_1"], "more than the model's 4 layers"),
        (["pipeline_parallel=3", "devices=3", "preset=deepspeed_stage_1"], "stages of equal depth; use one of 1, 2, 4"),
        (["pipeline_parallel=2", "devices=3", "preset=deepspeed_stage_1"], "does not divide the 3 rank(s)"),
        (
            ["pipeline_parallel=2", "tensor_parallel=2", "devices=4", "preset=deepspeed_stage_1"],
            "AutoTP shards a plain module inside deepspeed.initialize and is not wired into PipelineModule",
        ),
        (["activation_checkpointing=selective", "preset=deepspeed_stage_1"], "not available on the pipeline engine"),
    ],
    ids=[
        "zero3",
        "zero2",
        "zero2_one_stage",
        "more_stages_than_layers",
        "unequal_stages",
        "world",
        "tensor_parallel",
        "selective_checkpointing",
    ],
)
def test_a_bad_pipeline_is_one_clear_error(recipe_modules, args, message):
    nlp_config, pretraining, _ = recipe_modules
    cfg = load_config(nlp_config.NLPConfig, nlp_config.DEFAULT_CONFIG, args)
    with pytest.raises(ConfigError) as error:
        pretraining.describe(cfg, pipeline_engine=True)
    assert message in str(error.value), error.value


def test_lightning_and_accelerate_refuse_pipeline_parallel(recipe_modules):
    nlp_config, pretraining, _ = recipe_modules
    cfg = load_config(nlp_config.NLPConfig, nlp_config.DEFAULT_CONFIG, ["pipeline_parallel=2"])
    with pytest.raises(ConfigError, match="runs on recipes/nlp/train_pipeline.py"):
        pretraining.describe(cfg)  # what train.py and train_accelerate.py ask
    with pytest.raises(ConfigError, match="both set the micro-batches per step"):
        load_config(nlp_config.NLPConfig, nlp_config.DEFAULT_CONFIG, ["pipeline_micro_batches=4", "grad_accum=2"])


def test_the_entry_point_prints_one_error_line():
    # A bare `python` run is one process: two stages need a launcher.
    proc = run([PYTHON, TRAIN_PIPELINE, "pipeline_parallel=2", "out_dir=unused"], timeout=300, check=False)
    assert "pipeline_parallel=2 does not divide the 1 rank(s)" in one_error(proc)
    assert not (REPO / "unused").exists()


# --- slow: PP 2 trains like one stage, holds half the parameters per rank, exports one model -------------------


def train_losses(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_metrics(out_dir) if "train_loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    pp2, pp1 = root / "pp2", root / "pp1"
    launch_nlp("pipeline", pp2, 2, "pipeline_parallel=2", *RUN, f"max_steps={RESUME_AT}")
    launch_nlp("pipeline", pp2, 2, "pipeline_parallel=2", *RUN, "resume=true")
    launch_nlp("pipeline", pp1, 1, *RUN)  # one process, one stage, no launcher
    return {2: pp2, 1: pp1}


@pytest.mark.slow
def test_pipeline_2_trains_and_resumes_like_one_stage(runs, recipe_modules):
    pp2, pp1 = train_losses(runs[2]), train_losses(runs[1])
    assert sorted(pp2) == sorted(pp1) == list(range(1, STEPS + 1))
    for step in pp1:
        assert math.isclose(pp2[step], pp1[step], rel_tol=1e-5), (step, pp2, pp1)
    assert_trained(runs[2])  # the loss on the fixed validation blocks went down, not step 1's vs step N's batch
    summary, reference = read_json(runs[2] / "summary.json"), read_json(runs[1] / "summary.json")
    assert math.isclose(summary["val_loss"], reference["val_loss"], rel_tol=1e-5)
    assert summary["pipeline"]["stages"] == 2 and summary["pipeline"]["micro_batches"] == 2
    assert summary["backend"] == "deepspeed_pipeline" and summary["world_size"] == 2
    # The run directory and summary.json of the other entry points.
    for name in ("config.yaml", "ds_config.json", "env.json", "metrics.jsonl", "tokenizer", "final"):
        assert (runs[2] / name).exists(), name
    assert {"val_loss", "initial_val_loss", "throughput", "tokens_per_step", "export_check", "sample"} <= set(summary)
    # Resume with another number of stages: refused before any work (pipeline_parallel is no resumable key).
    nlp_config, _, nlp_layout = recipe_modules
    other = load_config(nlp_config.NLPConfig, None, [f"out_dir={runs[2]}", "resume=true", "pipeline_parallel=1", *RUN])
    with pytest.raises(ConfigError, match="pipeline_parallel"):
        nlp_layout.resume_point(other, ParallelLayout(2), pipeline_engine=True)


@pytest.mark.slow
def test_each_stage_holds_the_parameters_the_planner_gives(runs):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(runs[2] / "final", local_files_only=True)
    facts = facts_from_model_config(config, source="test")
    dense, _ = rank_params(facts, ParallelLayout(world_size=2, pipeline=2))
    planned = dense * 4  # fp32 weights
    measured = read_json(runs[2] / "summary.json")["pipeline"]["params_bytes_per_rank"]
    assert len(measured) == 2
    for held in measured:
        assert abs(held - planned) <= 0.05 * planned, (measured, planned)
    # ... and the plan the entry point printed before training (summary.json's memory_plan) is the planner's.
    printed = read_json(runs[2] / "summary.json")["memory_plan"]["predicted_bytes_per_rank"]["params"]
    assert abs(printed - planned) <= 0.05 * planned, (printed, planned)
    one_stage = read_json(runs[1] / "summary.json")["pipeline"]["params_bytes_per_rank"]
    assert one_stage == [facts.num_params * 4]


@pytest.mark.slow
def test_final_is_the_trained_pipeline_and_export_refuses_its_checkpoint(runs):
    # final_export reloads final/ with transformers and compares its logits with the pipeline engine's own.
    check = read_json(runs[2] / "summary.json")["export_check"]
    assert check["ok"] and check["max_abs_logit_diff"] < 1e-4, check
    checkpoint = runs[2] / "checkpoints" / f"step_{STEPS:06d}"
    assert len(list(checkpoint.glob("*/layer_*-model_states.pt"))) == 6  # embedding, 4 decoder layers, output
    with pytest.raises(ConfigError, match="pipeline engine"):
        open_checkpoint(checkpoint)
