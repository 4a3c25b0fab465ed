"""The planner's activation column against the bytes autograd really saves for backward.

The reference is independent of the planner's arithmetic: ``torch.autograd.graph.saved_tensors_hooks``
sees every tensor saved for backward by the NLP recipe's own model (nlp/model.py, a transformers Llama
built from a config), during the forward pass and the backward pass (checkpoint recomputation included),
each storage counted once and parameters not at all (common.activation.SavedBytesCounter). Tiny shapes,
one process: seconds. bench/activations.py runs the same comparison on larger shapes.
"""

from __future__ import annotations

import pytest
import torch

from common.activation import AC_PRESETS, SavedBytesCounter, apply_activation_checkpointing, saved_activation_bytes
from common.memory_formulas import facts_from_model_config, transformer_activations
from nlp.model import build_llama_config, build_model_from_config

TOLERANCE = 0.10  # the planner's bar; measured agreement here is within 0.1 %
VOCAB = 128
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Small Llama shapes: plain multi-head, and grouped-query attention with a wider MLP.
SHAPES = {
    "mha": {
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 176,
    },
    "gqa": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 224,
    },
}


def measure_and_plan(shape: str, attention: str, preset: str, seq_len: int, batch: int, precision: str):
    config = build_llama_config("tiny", vocab_size=VOCAB, seq_len=seq_len, **SHAPES[shape])
    torch.manual_seed(0)
    model = build_model_from_config(config, attention, dtype=DTYPES[precision])
    model.train()
    apply_activation_checkpointing(model, preset)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    measured = saved_activation_bytes(model, lambda m: m(input_ids=ids, labels=ids).loss)["peak"]
    facts = facts_from_model_config(config, "test")  # what `estimate --model-config` reads
    planned = transformer_activations(facts, seq_len, batch, preset, precision, attention)
    return measured, planned


@pytest.mark.parametrize("preset", list(AC_PRESETS))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(("shape", "seq_len", "batch"), [("mha", 32, 1), ("gqa", 64, 2), ("mha", 128, 3)])
def test_planner_within_10_percent_of_saved_bytes_bf16(preset, attention, shape, seq_len, batch):
    measured, planned = measure_and_plan(shape, attention, preset, seq_len, batch, "bf16")
    assert abs(planned - measured) <= TOLERANCE * measured, (planned, measured)


@pytest.mark.parametrize("preset", ["none", "full", "selective"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_planner_within_10_percent_of_saved_bytes_fp32(preset, attention):
    measured, planned = measure_and_plan("gqa", attention, preset, 64, 2, "fp32")
    assert abs(planned - measured) <= TOLERANCE * measured, (planned, measured)


def test_sdpa_saves_no_score_matrix_and_eager_does():
    """At a long sequence the difference is the a x s x s softmax eager keeps (float32 + bf16 copy per score)."""
    seq_len, batch, layers, heads = 256, 1, SHAPES["mha"]["num_hidden_layers"], SHAPES["mha"]["num_attention_heads"]
    sdpa, _ = measure_and_plan("mha", "sdpa", "none", seq_len, batch, "bf16")
    eager, _ = measure_and_plan("mha", "eager", "none", seq_len, batch, "bf16")
    scores = layers * heads * seq_len * seq_len * batch
    lse = layers * 4 * heads * seq_len * batch  # SDPA's float32 log-sum-exp, which eager does not keep
    assert eager - sdpa == 6 * scores - lse


def test_counter_counts_a_storage_once_and_frees_it():
    x = torch.randn(1000, requires_grad=True)
    counter = SavedBytesCounter(exclude=[x])
    with counter.hooks():
        y = x.exp()  # saves its output: 4000 bytes
        z = (y * y).sum() + y[:10].sin().sum()  # y again, and a view of y: the same storage
        assert counter.live_bytes == 4000
        z.backward()
    assert counter.peak_bytes == 4000 and counter.live_bytes == 0
