"""``sequence_parallel=N`` in the fine-tuning recipe (both entry points): DeepSpeed's Ulysses under LoRA.

Two sequence-parallel runs (2 processes, sequence parallel 2, so one data-parallel replica), each compared with ONE
process reading the same global batch of 8 examples at once (fp32, LoRA dropout off): every step's loss and
DeepSpeed's gradient norm within 1e-5 relative, and the held-out loss at the end. The sequence-parallel runs cut
that batch with gradient accumulation, and the examples' responses differ in length, so the loss must be the global
batch's token mean across micro-batches and slices: Accelerate under ZeRO-3 (every adapter matrix partitioned, loss
times ``grad_scale`` = 2, ``micro_batch_size=4 grad_accum=2``) and Lightning under ZeRO-2 (``grad_scale`` 1,
``micro_batch_size=2 grad_accum=4``, which Lightning would also divide twice without the strategy's fix). The
gradient norm is what catches a wrong loss scale; the later steps' losses catch ranks of a group that read different
examples. Both start from the same base and the same LoRA initialisation as the reference (the adapters are created
outside ``zero.Init``), so one reference serves both stages. The exact match of ``merged/`` must equal the
reference's too: Ulysses' attention, which drops the mask, must be gone before the export generates from left-padded
prompts. "It trained" is the held-out loss (the same examples) before and after the run.
"""

from __future__ import annotations

import json
import math

import pytest
from _util import (
    FINETUNE,
    NLP_RECIPE,
    PYTHON,
    assert_same_metric,
    launch_finetune,
    one_error,
    read_json,
    recipe_module,
    run,
    save_tiny_llama,
    tiny_fp32_finetune,
)

from common import sequence_parallel
from common.errors import ConfigError

STEPS = 3
# The smallest run that shows it: 3 steps of 8 examples (each logged), 4 held-out examples, one checkpoint.
TINY_FP32 = tiny_fp32_finetune(STEPS)
# name: (entry point, processes, preset, sequence_parallel, micro_batch_size, grad_accum): 8 examples a step
RUNS = {
    "reference": ("accelerate", 1, "deepspeed_stage_1", 1, 8, 1),
    "accelerate_sp2_zero3": ("accelerate", 2, "finetune", 2, 4, 2),
    "lightning_sp2_zero2": ("lightning", 2, "deepspeed_stage_2", 2, 2, 4),
}
ZERO_STAGE = {"reference": 1, "accelerate_sp2_zero3": 3, "lightning_sp2_zero2": 2}


def write_count_data(path) -> None:
    """40 Alpaca lines (36 train, 4 held out) whose responses (4 to 26 numbers) are long enough to cross the middle
    of their batch: both ranks of a group hold response tokens (the built-in task's one-digit answers would all sit
    on the second rank)."""
    lines = []
    for n in range(40):
        count = 4 + (7 * n) % 23
        example = {"instruction": f"Count to {count}.", "output": " ".join(str(i) for i in range(1, count + 1))}
        lines.append(json.dumps(example))
    path.write_text("\n".join(lines) + "\n")


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    return LlamaConfig(**{**sizes, "max_position_embeddings": 256, **overrides})


# --- fast: refused before any work ------------------------------------------------------------------


def test_a_bad_sequence_parallel_is_one_clear_error(tmp_path):
    # --describe reads the base's config.json only: a folder holding just that is enough.
    tiny_llama_config(vocab_size=512).save_pretrained(tmp_path / "base")
    args = [f"model={tmp_path / 'base'}", "devices=3", "sequence_parallel=3", "preset=deepspeed_stage_2"]
    error = one_error(run([PYTHON, FINETUNE, "--describe", *args], timeout=300, check=False))
    assert "sequence_parallel=3 does not divide the 4 attention heads" in error, error


def test_the_other_refusals_name_the_fix():
    # In-process: the check both entry points run after resolving the attention.
    fc, ft = recipe_module(NLP_RECIPE, "finetune_config"), recipe_module(NLP_RECIPE, "finetuning")
    config, cfg = tiny_llama_config(vocab_size=512), fc.FinetuneConfig(sequence_parallel=2)
    with pytest.raises(ConfigError, match="does not divide the 3 rank"):
        ft.check_sequence_parallel(cfg, 3, config, "sdpa")
    with pytest.raises(ConfigError, match="needs attention=sdpa"):
        ft.check_sequence_parallel(cfg, 2, config, "eager")
    # Any example length is accepted: batches are padded to a multiple of sequence_parallel.
    ft.check_sequence_parallel(fc.FinetuneConfig(sequence_parallel=2, seq_len=63), 2, config, "sdpa")
    batch = ft.collate_sft_padded([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}], pad_token_id=0, multiple=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0]] and batch["labels"].tolist() == [[-100, 6, 7, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0]]
    with pytest.raises(ConfigError, match="sequence_parallel must be >= 1"):
        fc.FinetuneConfig(sequence_parallel=0)


def test_the_export_gets_transformers_attention_back():
    # register_with_transformers replaces the function process-wide with a wrapper that drops every attention mask;
    # exact match generates from left-padded prompts after training, so the recipe restores it first.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda *args, **kwargs: None
    try:
        sequence_parallel.unregister("sdpa")
        restored = ALL_ATTENTION_FUNCTIONS["sdpa"]
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    assert restored is sdpa_attention_forward


# --- slow: both entry points train like one process -----------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-layer Llama (4 heads), its BPE tokenizer and a small JSONL task, then the three runs on them."""
    root = tmp_path_factory.mktemp("finetune_sp")
    base = save_tiny_llama(root / "base")
    data = root / "count.jsonl"
    write_count_data(data)
    for name, (entry, processes, preset, sp, micro, accum) in RUNS.items():
        args = [f"out_dir={root / name}", f"model={base}", f"data={data}", *TINY_FP32, f"preset={preset}"]
        args += [f"sequence_parallel={sp}", f"micro_batch_size={micro}", f"grad_accum={accum}"]
        if preset == "finetune":  # ZeRO-3: every adapter matrix partitioned, none kept whole by the threshold
            args.append('ds_overrides=["zero_optimization.stage3_param_persistence_threshold=0"]')
        launch_finetune(entry, processes, args)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in RUNS if name != "reference"])
def test_sequence_parallel_fine_tunes_like_one_process(runs, name):
    out_dir, reference = runs / name, runs / "reference"
    for key in ("train_loss", "grad_norm"):
        assert_same_metric(out_dir, reference, key, STEPS)
    summary, expected = read_json(out_dir / "summary.json"), read_json(reference / "summary.json")
    assert summary["val_loss"] < summary["initial_val_loss"]  # it trained: the same held-out examples, lower loss
    assert (summary["sequence_parallel"], summary["world_size"], summary["zero_stage"]) == (2, 2, ZERO_STAGE[name])
    assert math.isclose(summary["val_loss"], expected["val_loss"], rel_tol=1e-5)  # whole sequences, every rank
    assert summary["val_accuracy"] == expected["val_accuracy"]
    assert summary["adapter_logits_check"]["ok"], summary["adapter_logits_check"]
