"""``sequence_parallel=N`` in the NLP recipe (both entry points): DeepSpeed's Ulysses with ZeRO 1, 2 and 3.

Each run is compared with one process training the same global batch (fp32): every step's loss and DeepSpeed's
gradient norm within 1e-5 relative. The norm is what catches a wrong loss scale (Adam hides it from the loss: see
common/sequence_parallel.py); it caught the Lightning entry point training without DeepSpeed's groups, with half the
gradient and the reference's losses.

Which runs (CI time; every stage on each backend): sequence parallel 2 on 2 processes under ZeRO 1, 2 and 3
(Accelerate) and 1 and 3 (Lightning); sequence parallel 2 x data parallel 2 on 4 processes under ZeRO 3 (Accelerate)
and 2 (Lightning, where a missing group shows: ZeRO-3 averages over every rank either way). Every run trains 4
sequences a step, so two one-process references serve them all (one per initialisation: ZeRO 1 and ZeRO 3); the
4-process runs hold half of it per replica. Two of them (Accelerate ZeRO 3, Lightning ZeRO 2) also tile the MLP
and the loss (common/tiling.py), two (Accelerate ZeRO 1, Lightning ZeRO 3) checkpoint every layer through DeepSpeed's
checkpoint offload (common/activation.py). ZeRO 1, 2 and 3 at both layouts with SGD, on DeepSpeed's own engine:
tests/distributed/test_sequence_parallel_grads.py.
"""

from __future__ import annotations

import math

import pytest
from _util import (
    NLP_ENTRY_POINTS,
    NLP_RECIPE,
    PYTHON,
    assert_trained,
    launch_nlp,
    one_error,
    read_json,
    recipe_module,
    run,
    tiny_fp32_run,
    train_metric,
)

from common.errors import ConfigError

RECIPE = NLP_RECIPE
TRAIN, TRAIN_ACCELERATE, TRAIN_PIPELINE = NLP_ENTRY_POINTS.values()
STEPS = 5  # the sequence-parallel runs; the references run 2 more, for the resumed run
PRESET = {1: "deepspeed_stage_1", 2: "deepspeed_stage_2", 3: "deepspeed_stage_3"}


# --- fast: the combinations refused before any work ---------------------------------------------------


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        (TRAIN_ACCELERATE, ["sequence_parallel=2", "devices=2", "seq_len=63"], "seq_len=63 is not divisible by"),
        (TRAIN, ["sequence_parallel=2", "tensor_parallel=2", "devices=2"], "= 4 ranks per replica does not divide"),
        (TRAIN_PIPELINE, ["sequence_parallel=2", "pipeline_parallel=2", "devices=4"], "with the pipeline engine"),
    ],
    ids=["seq_len", "sp_x_tp_over_world", "pipeline"],
)
def test_a_bad_sequence_parallel_is_one_clear_error(script, args, message):
    # ZeRO 1: what tensor, pipeline and expert parallelism accept, so that the refusal is sequence parallel's.
    error = one_error(run([PYTHON, script, "--describe", *args, "preset=deepspeed_stage_1"], timeout=300, check=False))
    assert message in error, error


def check(world_size: int, **keys) -> None:
    """The start-up check every entry point runs (nlp_layout.run_layout), in this process."""
    config_module, pretraining = recipe_module(RECIPE, "nlp_config"), recipe_module(RECIPE, "pretraining")
    layout = recipe_module(RECIPE, "nlp_layout")
    cfg = config_module.NLPConfig(**keys)
    ds_config = pretraining.deepspeed_config(cfg, world_size, pretraining.hidden_size(cfg))
    pipeline_engine = keys.get("pipeline_parallel", 1) > 1
    layout.run_layout(cfg, world_size, pretraining.model_config(cfg, tokenizer=None), ds_config, pipeline_engine)


@pytest.mark.parametrize(
    ("world", "keys", "message"),
    [
        (6, {"sequence_parallel": 3, "seq_len": 66}, "sequence_parallel=3 does not divide the 4 attention heads"),
        (6, {"sequence_parallel": 2, "attention": "eager"}, "needs attention=sdpa"),
        (8, {"sequence_parallel": 2, "tensor_parallel": 2, "preset": "deepspeed_stage_1"}, "use one of them"),
        (6, {"sequence_parallel": 2, "model": "moe_tiny"}, "with a Mixture-of-Experts model does not run"),
        (3, {"sequence_parallel": 2}, "does not divide the 3 rank"),
    ],
    ids=["heads", "eager", "with_tp", "moe", "world"],
)
def test_the_other_refusals_name_the_fix(world, keys, message):
    # In-process (each command-line case above costs a recipe start): the same check the entry points run.
    with pytest.raises(ConfigError, match=message):
        check(world, **keys)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"model": "moe_tiny", "preset": "deepspeed_stage_2", "tiled_mlp_shards": 2}, "with the MoE model"),
        (
            {"tensor_parallel": 2, "preset": "deepspeed_stage_1", "tiled_mlp_shards": 2},
            "with tensor_parallel=2 are not supported",
        ),
        ({"offload_checkpoints": True, "activation_checkpointing": "selective"}, "needs activation_checkpointing=full"),
        (
            {"pipeline_parallel": 2, "preset": "deepspeed_stage_1", "tiled_loss_shards": 2},
            "with the pipeline engine are not supported",
        ),
    ],
    ids=["moe", "tensor_parallel", "offload_needs_full", "pipeline"],
)
def test_a_tiling_or_offload_the_layout_cannot_use_is_refused(keys, message):
    with pytest.raises(ConfigError, match=message):
        check(2, **keys)
    with pytest.raises(ConfigError, match="tiled_loss_shards must be >= 1"):
        recipe_module(RECIPE, "nlp_config").NLPConfig(tiled_loss_shards=0)
    # A tied output layer (tiling.check_tiling) and the tiling itself: tests/unit/test_tiling.py.


# --- slow: every layout trains like one process --------------------------------------------------------

# name: (entry point, processes, ZeRO stage, sequence_parallel, micro-batch size, extra): every run trains a global
# batch of 4 sequences, so that one reference per initialisation serves them all (2 processes at sequence parallel 2
# hold one replica: micro-batch 4; 4 processes hold two: micro-batch 2, half the reference's). Tiled runs compute the
# MLP in 3 slices and the loss in 4 (uneven: 32 tokens per rank), on both backends, under ZeRO 2 and 3 (DeepSpeed's
# "not reduced before the last slice" flag, ds_grad_is_ready, is read by both optimizers); offload runs checkpoint
# every layer through DeepSpeed's checkpoint offload (it marks the layer inputs; a CPU moves none), on both backends.
RUNS = {
    "reference_zero1": ("accelerate", 1, 1, 1, 4, ""),
    "reference_zero3": ("accelerate", 1, 3, 1, 4, ""),
    "accelerate_sp2_zero1_offload": ("accelerate", 2, 1, 2, 4, "offload"),
    "accelerate_sp2_zero2": ("accelerate", 2, 2, 2, 4, ""),
    "lightning_sp2_zero1": ("lightning", 2, 1, 2, 4, ""),
    "accelerate_sp2_zero3_tiled": ("accelerate", 2, 3, 2, 4, "tiled"),
    "lightning_sp2_zero3_offload": ("lightning", 2, 3, 2, 4, "offload"),
    "accelerate_sp2_dp2_zero3": ("accelerate", 4, 3, 2, 2, ""),
    "lightning_sp2_dp2_zero2_tiled": ("lightning", 4, 2, 2, 2, "tiled"),
}
EXTRA = {
    "": [],
    "tiled": ["tiled_mlp_shards=3", "tiled_loss_shards=4"],
    "offload": ["activation_checkpointing=full", "offload_checkpoints=true"],
}
RESUMED = "accelerate_sp2_zero3_tiled"


def reference_of(name: str) -> str:
    """One process, the same global batch; ZeRO-3 builds the model inside zero.Init (other initial weights)."""
    _, processes, stage, sp, micro, _ = RUNS[name]
    assert processes // sp * micro == 4, name  # the references' global batch
    return f"reference_zero{3 if stage == 3 else 1}"


def launch(name: str, out_dir, *extra: str) -> None:
    entry, processes, stage, sp, micro, extra_name = RUNS[name]
    steps = STEPS if sp > 1 else STEPS + 2
    args = [*tiny_fp32_run(steps), f"preset={PRESET[stage]}", f"sequence_parallel={sp}", f"micro_batch_size={micro}"]
    launch_nlp(entry, out_dir, processes, *args, *EXTRA[extra_name], *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_parallel")
    for name in RUNS:
        launch(name, root / name)
    # The same layout resumed from its step-STEPS checkpoint for 2 more steps.
    launch(RESUMED, root / RESUMED, "resume=true", f"max_steps={STEPS + 2}")
    return root


def assert_close(found: dict[int, float], expected: dict[int, float], what: str) -> None:
    for step, value in found.items():
        assert math.isclose(value, expected[step], rel_tol=1e-5), f"{what}, step {step}: {found} vs {expected}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in RUNS if not name.startswith("reference")])
def test_sequence_parallel_trains_like_one_process(runs, name):
    out_dir, reference = runs / name, runs / reference_of(name)
    losses = train_metric(out_dir, "train_loss")
    steps = STEPS + 2 if name == RESUMED else STEPS
    assert sorted(losses) == list(range(1, steps + 1))
    assert_close(losses, train_metric(reference, "train_loss"), f"{name} loss")
    assert_close(train_metric(out_dir, "grad_norm"), train_metric(reference, "grad_norm"), f"{name} gradient norm")
    assert_trained(out_dir)  # the loss on the fixed validation blocks went down, not step 1's vs step N's batch
    summary = read_json(out_dir / "summary.json")
    assert summary["export_check"]["ok"], summary["export_check"]
    config = read_json(out_dir / "ds_config.json")
    assert config["zero_optimization"]["stage"] == RUNS[name][2]


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in RUNS if name.endswith("_offload")])
def test_checkpoint_offload_marks_every_layer_input(runs, name):
    # The tiny model's 4 decoder layers, each input marked in every micro-batch; on a CPU none is moved.
    assert (
        "checkpoint offload: 4 layer inputs marked per micro-batch, 0 moved to host"
        in (runs / name / "stdout.txt").read_text()
    )


@pytest.mark.slow
def test_a_sequence_parallel_run_resumed_on_its_layout_continues_the_run(runs):
    resumed = runs / RESUMED
    log = (resumed / "metrics.jsonl").read_text()
    assert log.count('"step": 1,') == 1  # the resumed run appended steps 6-7, it did not start again
    final = read_json(resumed / "summary.json")
    reference = read_json(runs / "reference_zero3" / "summary.json")
    assert math.isclose(final["val_loss"], reference["val_loss"], rel_tol=1e-5)
