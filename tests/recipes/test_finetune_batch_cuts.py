"""The fine-tuning recipe trains the same however its global batch is cut, on both entry points.

An Alpaca file whose responses are 1, 2, 3, 20 or 40 words, a 2-layer Llama base made here, LoRA without dropout,
fp32, a global batch of 8 examples for 3 steps. The reference is one process reading all 8 at once (Accelerate,
``micro_batch_size=8``); the others cut the same 8 examples into micro-batches, accumulation steps and processes:

- one process, ``micro_batch_size=2 grad_accum=4``; 2 processes, ``micro_batch_size=4`` (Accelerate);
- 2 processes, ``micro_batch_size=2 grad_accum=2`` and ``micro_batch_size=1 grad_accum=4``, on Lightning and on
  Accelerate (the accumulation 2 and 4 runs also compare the two entry points with each other).

Every step's training loss and DeepSpeed's gradient norm must equal the reference's within 1e-5 relative, and so
must the held-out loss at the end. A loss averaged per micro-batch fails this on such data (each token of a short
batch weighs more); Lightning dividing twice by the accumulation fails the gradient norm. The sequence-parallel
cuts are in ``test_finetune_sequence_parallel.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _util import PYTHON, REPO, accelerate_launch, read_json, run, train_metric

RECIPE = REPO / "recipes" / "nlp"
FINETUNE = RECIPE / "finetune.py"
FINETUNE_ACCELERATE = RECIPE / "finetune_accelerate.py"
STEPS = 3
GLOBAL_BATCH = 8
RESPONSE_WORDS = [1, 2, 3, 20, 40]
TINY_FP32 = [
    "precision=fp32",
    f"max_steps={STEPS}",
    "warmup_steps=1",
    "min_lr_ratio=1.0",
    f"eval_interval={STEPS}",
    f"checkpoint_interval={STEPS}",
    "log_interval=1",
    "lora_r=4",
    "lora_alpha=8",
    "lora_dropout=0.0",  # dropout masks follow the micro-batch: the cuts would draw other ones
    "max_new_tokens=1",
]
# name: (entry point, processes, micro_batch_size, grad_accum); processes x micro-batch x accumulation = 8
RUNS = {
    "reference": ("accelerate", 1, 8, 1),
    "accelerate_1x2x4": ("accelerate", 1, 2, 4),
    "accelerate_2x4x1": ("accelerate", 2, 4, 1),
    "accelerate_2x2x2": ("accelerate", 2, 2, 2),
    "lightning_2x2x2": ("lightning", 2, 2, 2),
    "accelerate_2x1x4": ("accelerate", 2, 1, 4),
    "lightning_2x1x4": ("lightning", 2, 1, 4),
}


def write_variable_length_data(path) -> None:
    """40 Alpaca lines (36 train, 4 held out); the responses cycle through 1, 2, 3, 20 and 40 words."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    lines = []
    for n in range(40):
        length = RESPONSE_WORDS[n % len(RESPONSE_WORDS)]
        output = " ".join(words[(n + i) % len(words)] for i in range(length))
        lines.append(
            json.dumps({"instruction": f"Say {length} words, starting at {words[n % len(words)]}.", "output": output})
        )
    path.write_text("\n".join(lines) + "\n")


def make_base(folder) -> None:
    """A 2-layer Llama (4 heads) and its BPE tokenizer, trained on a few standard-library files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nlp.data import read_files, stdlib_source_files, train_bpe_tokenizer

    files = [f for f in stdlib_source_files() if 8_000 < f.stat().st_size < 40_000][:4]
    tokenizer = train_bpe_tokenizer(read_files(files), vocab_size=512, out_dir=folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name)``: the run's folder (launched on first use, on one base model and data file)."""
    root = tmp_path_factory.mktemp("finetune_cuts")
    make_base(root / "base")
    write_variable_length_data(root / "data.jsonl")

    def get(name: str):
        out_dir = root / name
        if not out_dir.is_dir():
            entry, processes, micro, accum = RUNS[name]
            args = [f"out_dir={out_dir}", f"model={root / 'base'}", f"data={root / 'data.jsonl'}", *TINY_FP32]
            args += [f"micro_batch_size={micro}", f"grad_accum={accum}"]
            if entry == "accelerate":
                config = RECIPE / "accelerate_finetune.yaml"
                accelerate_launch(FINETUNE_ACCELERATE, args, config, num_processes=processes)
            else:
                run([PYTHON, FINETUNE, f"devices={processes}", *args], timeout=600)
        return out_dir

    return get


def assert_close(found: dict[int, float], expected: dict[int, float], what: str) -> None:
    assert sorted(found) == list(range(1, STEPS + 1)), f"{what}: {found}"
    for step, value in found.items():
        assert math.isclose(value, expected[step], rel_tol=1e-5), f"{what}, step {step}: {found} vs {expected}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in RUNS if name != "reference"])
def test_a_cut_of_the_global_batch_trains_like_the_whole_batch(runs, name):
    out_dir, reference = runs(name), runs("reference")
    assert_close(train_metric(out_dir, "grad_norm"), train_metric(reference, "grad_norm"), f"{name} gradient norm")
    assert_close(train_metric(out_dir, "train_loss"), train_metric(reference, "train_loss"), f"{name} loss")
    summary, expected = read_json(out_dir / "summary.json"), read_json(reference / "summary.json")
    assert math.isclose(summary["val_loss"], expected["val_loss"], rel_tol=1e-5), (summary["val_loss"], expected)
    entry, processes, _, _ = RUNS[name]
    assert (summary["backend"], summary["world_size"]) == (entry, processes)


@pytest.mark.slow
def test_the_reference_learned(runs):
    """The held-out loss (the same examples before and after) is lower after the 3 steps than before them."""
    summary = read_json(runs("reference") / "summary.json")
    assert summary["val_loss"] < summary["initial_val_loss"], summary
