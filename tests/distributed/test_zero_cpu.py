"""Real ZeRO sharding on a CPU through both backends: 2 processes, gloo, DeepSpeed's own engine.

What is checked, for stages 0-3 on Lightning and on Accelerate:
- bf16 training runs and DeepSpeed built the ZeRO optimizer of the stage (not DDP standing in);
- equivalence (guide 1, 2.1: ZeRO is data parallelism, mathematically): fp32 losses of steps 1..5 of
  stages 1, 2, 3 equal stage 0's within 1e-5 relative; bf16 against fp32 as bf16 DDP does (see BF16_FACTOR);
- both backends run with identical batch, accumulation, clipping, precision and ZeRO fields;
- the bytes each rank holds equal the guide's formulas (common.accounting).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _util import PYTHON, REPO, accelerate_launch, run

from common.accounting import predicted_model_state_bytes
from common.strategy import RunFacts, resolve_deepspeed_config, write_accelerate_files

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "distributed" / "worker.py"
STAGE_PRESETS = {0: "ddp", 1: "deepspeed_stage_1", 2: "deepspeed_stage_2", 3: "deepspeed_stage_3"}
EXPECTED_OPTIMIZER = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
FP32_RTOL = 1e-5
# bf16 keeps 8 mantissa bits (0.4 % relative spacing): a bf16 run strays from exact (fp32) math by
# several percent within 5 steps, stage 0 included (measured here: up to 8.5 % at step 4). The bar is
# relative to that: a ZeRO stage in bf16 may stray from the fp32 reference at most twice as far as plain
# data parallelism in bf16 does (floor 1e-2). A gradient bug (DeepSpeed#8224) breaks this by far.
BF16_FACTOR = 2.0
BF16_FLOOR = 1e-2


def launch(backend: str, preset: str, precision: str, out: Path, extra: list[str] | None = None) -> list[dict]:
    args = [
        "--backend",
        backend,
        "--preset",
        preset,
        "--precision",
        precision,
        "--out",
        str(out),
        "--lr",
        "3e-5",
        *(extra or []),
    ]
    if backend == "lightning":
        run([PYTHON, WORKER, *args], timeout=600)
    else:
        facts = RunFacts(world_size=2, micro_batch_size=4, precision=precision, hidden_size=512)
        cfg = write_accelerate_files(resolve_deepspeed_config(preset, facts), out / "launch", num_processes=2)
        accelerate_launch(WORKER, args, cfg, timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[tuple[str, str, str], list[dict]] = {}

    def get(backend: str, stage: int, precision: str) -> list[dict]:
        key = (backend, STAGE_PRESETS[stage], precision)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{backend}-{stage}-{precision}")
            cache[key] = launch(backend, key[1], precision, out)
        return cache[key]

    return get


def mean_losses(records: list[dict]) -> list[float]:
    """The global loss per step: the mean over ranks of each rank's micro-batch loss."""
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in records))]


def relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_zero_trains_with_real_sharding(runs, backend, stage):
    records = runs(backend, stage, "bf16")
    for record in records:
        assert record["world_size"] == 2 or backend == "lightning"
        assert record["engine"]["zero"]["stage"] == stage
        assert record["engine"]["bf16"] is True
        assert len(record["losses"]) == 5
        if stage:
            assert record["optimizer"] == EXPECTED_OPTIMIZER[stage]
    # Two ranks saw different data: identical losses would mean one process did everything.
    assert records[0]["losses"] != records[1]["losses"]


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_losses_equal_stage0(runs, backend, stage):
    baseline = mean_losses(runs(backend, 0, "fp32"))
    sharded = mean_losses(runs(backend, stage, "fp32"))
    gap = relative_gap(sharded, baseline)
    print(f"{backend} stage {stage} fp32: max relative gap to stage 0 = {gap:.2e}")
    assert gap <= FP32_RTOL, (sharded, baseline)


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_losses_close_to_exact(runs, backend, stage):
    exact = mean_losses(runs(backend, 0, "fp32"))
    ddp_gap = relative_gap(mean_losses(runs(backend, 0, "bf16")), exact)
    gap = relative_gap(mean_losses(runs(backend, stage, "bf16")), exact)
    print(f"{backend} bf16 gap to fp32: stage 0 {ddp_gap:.2e}, stage {stage} {gap:.2e}")
    assert gap <= max(BF16_FACTOR * ddp_gap, BF16_FLOOR)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_both_backends_run_identical_settings(runs, stage):
    lightning = runs("lightning", stage, "bf16")[0]["engine"]
    accelerate = runs("accelerate", stage, "bf16")[0]["engine"]
    assert lightning == accelerate


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_model_state_bytes_match_formula(runs, backend, stage, precision):
    """After a step ZeRO has released gradients: params + optimizer states against the guide's formula.

    Tolerance 0.5 %: DeepSpeed pads each rank's partition to an alignment boundary (a few elements per
    parameter group), which is all that separates the measured bytes from K x bytes-per-param here.
    Buffers (flat 16-bit groups, the stage-3 reduce bucket) are reported apart, not in model states.
    """
    for record in runs(backend, stage, precision):
        measured = record["state_bytes"]
        predicted = predicted_model_state_bytes(
            record["num_params"],
            stage,
            2,
            precision,
            grads_alive=False,
            persistent_params=record["persistent_params"],
        )
        for key in ("params", "optimizer", "model_states"):
            assert measured[key] == pytest.approx(predicted[key], rel=5e-3), (key, measured, predicted)
        assert measured["grads"] == 0


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
def test_zero3_activation_checkpointing_with_frozen_weights(tmp_path, backend):
    """The LoRA situation: stage 3, most weights frozen, blocks checkpointed (reentrant): trains."""
    records = launch(backend, "deepspeed_stage_3", "bf16", tmp_path, ["--frozen", "--activation-checkpointing", "full"])
    for record in records:
        assert len(record["losses"]) == 5
        assert all(loss == loss for loss in record["losses"])  # no NaN
    # The trainable head learned: the loss moved.
    assert records[0]["losses"][0] != records[0]["losses"][-1]
