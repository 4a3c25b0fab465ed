"""``summary.json``'s ``communication`` on the NLP, science and fine-tuning recipes: DeepSpeed's own ``comms_logger``
(turned on through the run's config, ``ds_overrides=comms_logger.enabled=true``) counted each collective per optimizer
step, and the bytes it logged equal a hand count of what ZeRO-2 moves and the planner's bytes for the same config.

One short 2-process ZeRO-2 run per recipe (3 optimizer steps: the two after the first are compared), on the front-end
the recipe's other launches use least here: NLP on Lightning, science and fine-tuning on Accelerate. The CV recipe's
field is checked by its own run directory test.

The hand count (bf16, 2 ranks, one micro-batch a step): stage 2 all-reduces every 2-byte gradient of the trainable
parameters once a micro-batch (DeepSpeed's bucketed "reduce-scatter" is an all-reduce of the bucket), then each rank
all-gathers its updated half of the 2-byte parameters. The trainable elements are counted from the files the run
exported (or, for LoRA, from the adapter's shapes), not from the recipe's figures.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _util import PYTHON, REPO, accelerate_launch, read_json, run, save_tiny_llama
from safetensors import safe_open

STEPS = 3
COMMS_LOG = "ds_overrides=comms_logger.enabled=true"
ZERO2 = ["preset=deepspeed_stage_2", "precision=bf16", "grad_accum=1", COMMS_LOG]
# Bytes no hand count here has: the gradient norm's scalar all-reduce (a few bytes a step) and the padding of each
# parameter group's flat buffer to a multiple of the ranks (a few elements).
SCALARS_AND_PADDING = 32


def exported_elements(folder: Path) -> int:
    """Elements of every tensor in a folder's safetensors files (the run's exported weights)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                shape = f.get_slice(key).get_shape()
                total += math.prod(shape)
    return total


def check_zero2_communication(summary: dict, trainable: int) -> None:
    """Rank 0's logged bytes per step: a 2-byte all-reduce of every trainable gradient and the all-gather of this
    rank's half of the 2-byte trainable parameters; the planner's bytes for the same config agree."""
    communication = summary["communication"]
    assert communication["steps"] == STEPS - 1  # every step but the first
    logged = communication["collectives"]
    assert set(logged) == {"all_reduce", "all_gather"}, logged
    assert logged["all_reduce"]["logged_bytes"] == pytest.approx(2 * trainable, abs=SCALARS_AND_PADDING)
    assert logged["all_gather"]["logged_bytes"] == pytest.approx(2 * trainable / 2, abs=SCALARS_AND_PADDING)
    for name, figures in logged.items():
        assert figures["planned_bytes"] == pytest.approx(figures["logged_bytes"], abs=SCALARS_AND_PADDING), name
        assert figures["calls"] >= 1 and figures["logged_s"] > 0, name


@pytest.mark.slow
def test_nlp_summary_logs_communication_on_lightning(tmp_path):
    out_dir = tmp_path / "nlp"
    small = ["hidden_size=64", "intermediate_size=128", "num_layers=1", "num_heads=4", "vocab_size=512"]
    steps = [f"max_steps={STEPS}", f"eval_interval={STEPS}", f"checkpoint_interval={STEPS}", "log_interval=1"]
    batch = ["seq_len=32", "micro_batch_size=2", "max_train_tokens=20000", "max_val_tokens=512", "sample_tokens=2"]
    args = [f"out_dir={out_dir}", *small, *steps, *batch, *ZERO2]
    run([PYTHON, REPO / "recipes" / "nlp" / "train.py", *args], timeout=600)
    summary = read_json(out_dir / "summary.json")
    check_zero2_communication(summary, trainable=exported_elements(out_dir / "final"))


@pytest.mark.slow
def test_science_summary_logs_communication_on_accelerate(tmp_path):
    out_dir = tmp_path / "science"
    small = ["n_train=16", "n_test=8", "grid_size=32", "solve_grid=128", "modes=4", "width=8", "n_layers=1"]
    steps = [f"max_steps={STEPS}", f"eval_interval={STEPS}", f"checkpoint_interval={STEPS}", "log_interval=1"]
    args = [f"out_dir={out_dir}", f"cache_dir={tmp_path / 'cache'}", *small, "proj_width=16", *steps]
    args += ["micro_batch_size=4", "data_workers=1", *ZERO2]
    recipe = REPO / "recipes" / "science"
    accelerate_launch(recipe / "train_accelerate.py", args, recipe / "accelerate.yaml", num_processes=2, timeout=600)
    summary = read_json(out_dir / "summary.json")
    check_zero2_communication(summary, trainable=exported_elements(out_dir / "final"))


def lora_elements(hidden: int, intermediate: int, layers: int, rank: int) -> int:
    """LoRA's trainable elements on every projection of a Llama whose key/value heads are all its heads: A (r x in)
    and B (out x r) per adapted matrix."""
    attention = 4 * rank * (hidden + hidden)  # q, k, v, o: hidden -> hidden
    mlp = 2 * rank * (hidden + intermediate) + rank * (intermediate + hidden)  # gate, up; down
    return layers * (attention + mlp)


@pytest.mark.slow
def test_finetune_summary_logs_communication_on_accelerate(tmp_path):
    base = save_tiny_llama(tmp_path / "base")  # 2 layers, 64 wide, MLP 128, 4 heads
    out_dir = tmp_path / "finetune"
    steps = [f"max_steps={STEPS}", f"eval_interval={STEPS}", f"checkpoint_interval={STEPS}", "log_interval=1"]
    args = [f"out_dir={out_dir}", f"model={base}", "n_train=16", "n_val=4", "micro_batch_size=2", *steps]
    args += ["warmup_steps=1", "lora_r=4", "lora_alpha=8", "max_new_tokens=1", *ZERO2]
    recipe = REPO / "recipes" / "nlp"
    script = recipe / "finetune_accelerate.py"
    accelerate_launch(script, [str(a) for a in args], recipe / "accelerate_finetune.yaml", timeout=600)
    summary = read_json(out_dir / "summary.json")
    trainable = lora_elements(hidden=64, intermediate=128, layers=2, rank=4)
    assert summary["trainable_params"] == trainable
    check_zero2_communication(summary, trainable=trainable)


@pytest.mark.slow
def test_nlp_zero3_on_accelerate_gathers_each_parameter_once_a_step_after_the_first_evaluation(tmp_path):
    """The Accelerate loop evaluates before its first training step. ZeRO-3 would keep the release decisions of that
    forward-only pass (every parameter released after its forward use) and gather every parameter again for the
    backward pass on every later step; after ``common.zero3_trace.retrace_after_evaluation`` a step gathers the
    parameters once and keeps them for the backward pass, as the planner plans (this model is under the live bound)."""
    out_dir = tmp_path / "nlp_zero3"
    small = ["hidden_size=64", "intermediate_size=128", "num_layers=1", "num_heads=4", "vocab_size=512"]
    steps = [f"max_steps={STEPS}", f"eval_interval={STEPS}", f"checkpoint_interval={STEPS}", "log_interval=1"]
    batch = ["seq_len=32", "micro_batch_size=2", "max_train_tokens=20000", "max_val_tokens=512", "sample_tokens=2"]
    zero3 = ["preset=deepspeed_stage_3", "precision=bf16", "grad_accum=1", COMMS_LOG]
    recipe = REPO / "recipes" / "nlp"
    args = [f"out_dir={out_dir}", *small, *steps, *batch, *zero3]
    accelerate_launch(recipe / "train_accelerate.py", args, recipe / "accelerate.yaml", num_processes=2, timeout=600)
    logged = read_json(out_dir / "summary.json")["communication"]["collectives"]
    gathered = logged["all_gather"]["logged_bytes"]
    # At most this rank's half of every 2-byte parameter once (persistent ones are not gathered at all).
    assert gathered <= 2 * exported_elements(out_dir / "final") / 2 + SCALARS_AND_PADDING, logged
    for name in ("all_gather", "reduce_scatter"):
        assert logged[name]["planned_bytes"] == pytest.approx(logged[name]["logged_bytes"], abs=SCALARS_AND_PADDING)
