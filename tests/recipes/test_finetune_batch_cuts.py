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
from _util import assert_same_metric, launch_finetune, read_json, save_tiny_llama, tiny_fp32_finetune

STEPS = 3
GLOBAL_BATCH = 8
RESPONSE_WORDS = [1, 2, 3, 20, 40]
TINY_FP32 = tiny_fp32_finetune(STEPS)
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name)``: the run's folder (launched on first use, on one base model and data file)."""
    root = tmp_path_factory.mktemp("finetune_cuts")
    save_tiny_llama(root / "base")
    write_variable_length_data(root / "data.jsonl")

    def get(name: str):
        out_dir = root / name
        if not out_dir.is_dir():
            entry, processes, micro, accum = RUNS[name]
            args = [f"out_dir={out_dir}", f"model={root / 'base'}", f"data={root / 'data.jsonl'}", *TINY_FP32]
            args += [f"micro_batch_size={micro}", f"grad_accum={accum}"]
            launch_finetune(entry, processes, args)
        return out_dir

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in RUNS if name != "reference"])
def test_a_cut_of_the_global_batch_trains_like_the_whole_batch(runs, name):
    out_dir, reference = runs(name), runs("reference")
    for key in ("grad_norm", "train_loss"):
        assert_same_metric(out_dir, reference, key, STEPS)
    summary, expected = read_json(out_dir / "summary.json"), read_json(reference / "summary.json")
    assert math.isclose(summary["val_loss"], expected["val_loss"], rel_tol=1e-5), (summary["val_loss"], expected)
    entry, processes, _, _ = RUNS[name]
    assert (summary["backend"], summary["world_size"]) == (entry, processes)


@pytest.mark.slow
def test_the_reference_learned(runs):
    """The held-out loss (the same examples before and after) is lower after the 3 steps than before them."""
    summary = read_json(runs("reference") / "summary.json")
    assert summary["val_loss"] < summary["initial_val_loss"], summary
