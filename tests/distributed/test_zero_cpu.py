"""Real ZeRO sharding on a CPU through both backends: 2 processes, gloo, DeepSpeed's own engine.

What is checked, for stages 0-3 on Lightning and on Accelerate:
- bf16 training runs on 2 ranks (the launcher's WORLD_SIZE and the process group agree), DeepSpeed built the
  ZeRO optimizer of the stage (not DDP standing in), and the loss on one fixed batch went down;
- equivalence (ZeRO is data parallelism, mathematically): fp32 losses of steps 1..5 of
  stages 1, 2, 3 equal stage 0's within 1e-5 relative; bf16 against fp32 within a measured bar (BF16_RTOL);
- both backends run with identical batch, accumulation, clipping, precision and ZeRO fields, and the engine
  clips at the value the factory wrote, 0 included (DeepSpeed >= 0.19.3 defaults to 1.0, #8068);
- the bytes each rank holds equal the ZeRO paper's formulas (common.accounting), stage 0 included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _util import REPO
from _worker_runs import launch_worker, launched_once, mean_losses, relative_gap

from common.accounting import predicted_model_state_bytes
from common.strategy import RunFacts

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "distributed" / "worker.py"
STAGE_PRESETS = {0: "ddp", 1: "deepspeed_stage_1", 2: "deepspeed_stage_2", 3: "deepspeed_stage_3"}
EXPECTED_OPTIMIZER = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
FP32_RTOL = 1e-5
# bf16 keeps 8 mantissa bits: within 5 steps every bf16 run strays from exact (fp32) math. Measured here
# (test_bf16_losses_close_to_exact -s, clipping 0.5): stages 1-3 3.86 % (Lightning) and 4.18 % (Accelerate), the
# same for all three stages; bf16 stage 0 strays further (8.5 %, 7.0 %). The bar is the largest measured ZeRO
# gap with a 1.4x margin (other CPUs' bf16 kernels may round differently).
BF16_RTOL = 0.06
# "It learned": the loss on one fixed batch must drop by at least this fraction over the 5 steps. Measured for the
# stage 0-3 runs (lr 3e-5): 14-15 % on Lightning, 24-27 % on Accelerate; frozen-body runs (lr 1e-3): 14 %, 22 %.
MIN_LEARNED = 0.05
# Gradient clipping the runs ask the factory for. Neither is DeepSpeed's default (1.0 since 0.19.3, #8068), so an
# engine that fell back to its default, on either backend, fails test_engine_clips_at_the_factorys_value.
MAIN_CLIPPING = 0.5  # the stage 0-3 runs: norms of 7-18, so clipping (a global norm over partitions) acts each step
FROZEN_CLIPPING = 0.0  # the frozen-weights runs: off, which the factory must write as 0.0


def launch(
    backend: str, preset: str, precision: str, out: Path, clipping: float, extra: list[str] | None = None
) -> list[dict]:
    args = ["--backend", backend, "--preset", preset, "--precision", precision, "--out", str(out), "--lr", "3e-5"]
    args += ["--gradient-clipping", str(clipping), *(extra or [])]
    facts = RunFacts(world_size=2, micro_batch_size=4, precision=precision, hidden_size=512, gradient_clipping=clipping)
    return launch_worker(WORKER, backend, args, out, preset, facts, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def launch_stage(backend: str, stage: int, precision: str, out: Path) -> list[dict]:
        return launch(backend, STAGE_PRESETS[stage], precision, out, MAIN_CLIPPING)

    return launched_once(tmp_path_factory, launch_stage)


@pytest.fixture(scope="module")
def frozen_runs(tmp_path_factory):
    """The LoRA situation: stage 3, most weights frozen, blocks checkpointed (reentrant), clipping off."""

    def launch_frozen(backend: str, out: Path) -> list[dict]:
        # lr 1e-3: only the 513-weight head trains; at 3e-5 its bf16 copy barely moves in 5 steps, at 1e-2
        # Adam overshoots (the fixed-batch loss rose 0.83 -> 1.17 on Accelerate).
        extra = ["--frozen", "--activation-checkpointing", "full", "--lr", "1e-3"]
        return launch(backend, "deepspeed_stage_3", "bf16", out, FROZEN_CLIPPING, extra)

    return launched_once(tmp_path_factory, launch_frozen)


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_zero_trains_with_real_sharding(runs, backend, stage):
    records = runs(backend, stage, "bf16")
    for record in records:
        assert record["world_size_env"] == record["world_size_process_group"] == 2
        assert record["engine"]["zero"]["stage"] == stage
        assert record["engine"]["bf16"] is True
        assert len(record["losses"]) == 5
        if stage:
            assert record["optimizer"] == EXPECTED_OPTIMIZER[stage]
    # Two ranks saw different data: identical losses would mean one process did everything.
    assert records[0]["losses"] != records[1]["losses"]
    assert_learned(records, f"{backend} stage {stage} bf16")


def assert_learned(records: list[dict], case: str) -> None:
    """The loss on one fixed batch (the same on both ranks) went down from before training to after it."""
    fixed = records[0]["fixed_batch_loss"]
    print(f"{case}: fixed-batch loss {fixed['before']:.5f} -> {fixed['after']:.5f}")
    assert records[1]["fixed_batch_loss"] == fixed  # one model, one batch: both ranks see the same loss
    assert fixed["after"] <= (1 - MIN_LEARNED) * fixed["before"], (case, fixed)


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
    assert gap <= BF16_RTOL


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_both_backends_run_identical_settings(runs, stage):
    lightning = runs("lightning", stage, "bf16")[0]["engine"]
    accelerate = runs("accelerate", stage, "bf16")[0]["engine"]
    assert lightning == accelerate


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
def test_engine_clips_at_the_factorys_value(runs, frozen_runs, backend):
    """What the engine in each process runs with (``engine.gradient_clipping()``), for a non-zero value and for 0."""
    for stage in (0, 1, 2, 3):
        print(f"{backend} stage {stage} bf16: global grad norms {runs(backend, stage, 'bf16')[0]['grad_norms']}")
        for record in runs(backend, stage, "bf16"):
            # Norms of 7-18 measured: clipping at 0.5 acts in every step, so the runs exercise it.
            assert min(record["grad_norms"]) > MAIN_CLIPPING, record["grad_norms"]
            assert record["factory_gradient_clipping"] == MAIN_CLIPPING
            assert record["engine"]["gradient_clipping"] == MAIN_CLIPPING, (backend, stage)
    for record in frozen_runs(backend):
        assert record["factory_gradient_clipping"] == FROZEN_CLIPPING
        assert record["engine"]["gradient_clipping"] == FROZEN_CLIPPING, backend


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_model_state_bytes_match_formula(runs, backend, stage, precision):
    """After a step ZeRO has released gradients: params + optimizer states against the ZeRO formula.

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
        # Stage 3 keeps a persistent parameter's whole copy besides its partition while it is gathered. Here the
        # Lightning worker finds them released (also when counted in on_train_end; not understood yet), the
        # Accelerate one gathered: 0.27 % of the bytes, so both bounds are allowed. tests/recipes/test_multinode.py
        # checks the whole copies on the NLP recipe, where they are 60 % of the parameters.
        partitions_only = predicted_model_state_bytes(record["num_params"], stage, 2, precision, grads_alive=False)
        per_param = {k: round(measured[k] / record["num_params"], 3) for k in ("params", "optimizer", "buffers")}
        print(f"{backend} stage {stage} {precision}: bytes per parameter {per_param}")
        for key in ("params", "optimizer", "model_states"):
            low, high = sorted((partitions_only[key], predicted[key]))
            assert low * (1 - 5e-3) <= measured[key] <= high * (1 + 5e-3), (key, measured, predicted)
        assert measured["grads"] == 0


@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
def test_zero3_activation_checkpointing_with_frozen_weights(frozen_runs, backend):
    """The LoRA situation: stage 3, most weights frozen, blocks checkpointed (reentrant): trains."""
    records = frozen_runs(backend)
    for record in records:
        assert len(record["losses"]) == 5
        assert all(loss == loss for loss in record["losses"])  # no NaN
    assert_learned(records, f"{backend} stage 3 frozen body")
