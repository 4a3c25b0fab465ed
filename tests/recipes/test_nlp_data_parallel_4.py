"""ZeRO with TP or PP on 4 processes: TP 2 x DP 2 and PP 2 x DP 2 train like 4 data-parallel replicas.

One reference serves both: 4 Accelerate replicas, ZeRO 1, fp32, a micro-batch of 2 sequences each, 8 sequences per
optimizer step. The tensor-parallel run (Accelerate, TP 2 x DP 2) reads the same 8 as a micro-batch of 4 on each of
its 2 replicas (both ranks of a tensor-parallel group read the same one); the pipeline run (train_pipeline.py,
PP 2 x DP 2) as 2 micro-batches of 2 in flight on each replica. ``StepSampler`` gives every optimizer step the same
global batch whatever the layout, so the fp32 training losses agree to rounding. The pipeline's validation loss
leaves out a rank's shorter last micro-batch: only the training losses are compared. This is the independent check
of the pipeline engine (tests/recipes/test_nlp_pipeline.py compares it with itself on one stage): Accelerate's loop
computes the reference without PipelineModule.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _util import NLP_RECIPE, assert_trained, launch_nlp, read_json, tiny_fp32_run

from common.rundir import read_metrics

RECIPE = NLP_RECIPE
STEPS = 5
RUN = [*tiny_fp32_run(STEPS), "preset=deepspeed_stage_1"]


def train_losses(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_metrics(out_dir) if "train_loss" in r}


def accelerate(out_dir: Path, *extra: str) -> dict[int, float]:
    launch_nlp("accelerate", out_dir, 4, *RUN, *extra)
    assert read_json(out_dir / "summary.json")["world_size"] == 4
    assert_trained(out_dir)  # the loss on the fixed validation blocks went down, not step 1's vs step N's batch
    return train_losses(out_dir)


def assert_same_losses(losses: dict[int, float], reference: dict[int, float]) -> None:
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    for step in reference:
        assert math.isclose(losses[step], reference[step], rel_tol=1e-5), (step, losses, reference)


@pytest.fixture(scope="module")
def data_parallel_4(tmp_path_factory) -> dict[int, float]:
    """The reference: 4 data-parallel replicas (Accelerate), the per-step training losses."""
    return accelerate(tmp_path_factory.mktemp("dp4") / "run")


@pytest.mark.slow
def test_tensor_parallel_2_by_data_parallel_2_trains_like_data_parallel_4(data_parallel_4, tmp_path):
    losses = accelerate(tmp_path / "tp2dp2", "tensor_parallel=2", "micro_batch_size=4")
    assert read_json(tmp_path / "tp2dp2" / "ds_config.json")["tensor_parallel"] == {"autotp_size": 2}
    assert_same_losses(losses, data_parallel_4)


@pytest.mark.slow
def test_pipeline_2_by_data_parallel_2_trains_like_data_parallel_4(data_parallel_4, tmp_path):
    out_dir = tmp_path / "pp2dp2"
    launch_nlp("pipeline", out_dir, 4, "pipeline_parallel=2", *RUN, "pipeline_micro_batches=2")
    assert_trained(out_dir)
    pipeline = read_json(out_dir / "summary.json")["pipeline"]
    assert pipeline["stages"] == 2 and pipeline["micro_batches"] == 2
    assert_same_losses(train_losses(out_dir), data_parallel_4)
