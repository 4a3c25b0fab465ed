"""Ulysses sequence parallelism in the planner's activation column, against the bytes autograd really saves.

tests/distributed/sequence_parallel_activation_worker.py runs on 2 gloo processes (seconds): for each case a tiny
transformers Llama (fp32, sdpa) trains one step on the whole sequence in one rank, then with DeepSpeed's
``UlyssesSPAttentionHF`` registered for a sequence-parallel group of both ranks, each rank on its half of the
sequence. The bars: at SP 2 a rank saves at most 55 % of what SP 1 saves for the same sequence, and the
planner (``transformer_activations(..., sequence_parallel=2)``, what ``zero-recipes estimate --sequence-parallel 2``
prints) is within 10 % of the measurement. The worker measured the planner within 0.5 % in every case, so a
second, tighter bound (1 %) catches a dropped term that 10 % would not, such as the output projection's copy.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from _util import PYTHON, REPO, free_port, run

from common.errors import ConfigError
from common.memory_formulas import (
    FP32,
    INDEX_BYTES,
    ModelFacts,
    activation_parts,
    facts_from_model_config,
    transformer_activations,
)
from nlp.model import build_llama_config

WORKER = REPO / "tests" / "distributed" / "sequence_parallel_activation_worker.py"
ISSUE_BAR = 0.10  # planner vs measured
TIGHT = 0.01  # measured here: 0.5 % at most
RATIO_BAR = 0.55  # SP 2 / SP 1 per rank, same sequence


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    """Every case of the worker, as both ranks measured it (they hold the same shapes: equal bytes)."""
    out = tmp_path_factory.mktemp("sequence_parallel")
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    run([*command, WORKER, "--out", out], timeout=600)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world"] == 2 and ranks[0]["cases"] == ranks[1]["cases"]
    return ranks[0]["cases"]


def planned(case: dict, sequence_parallel: int) -> float:
    config = build_llama_config("tiny", vocab_size=case["vocab_size"], seq_len=case["seq_len"], **case["config"])
    facts = facts_from_model_config(config, "test")  # what `estimate --model-config` reads
    return transformer_activations(
        facts,
        case["seq_len"],
        case["micro_batch_size"],
        case["checkpointing"],
        case["precision"],
        case["attention"],
        sequence_parallel=sequence_parallel,
    )


def label(case: dict) -> str:
    return f"{case['shape']} s{case['seq_len']} b{case['micro_batch_size']} {case['checkpointing']}"


def test_the_worker_covers_every_shape_and_preset(measured):
    assert {c["shape"] for c in measured} == {"gqa", "mha", "mqa"}
    assert {c["checkpointing"] for c in measured} == {"none", "full", "selective", "every_k", "save_memory_optimized"}


def test_sp2_saves_at_most_55_percent_of_sp1_per_rank(measured):
    ratios = {label(c): c["sp2_peak"] / c["sp1_peak"] for c in measured}
    assert all(r <= RATIO_BAR for r in ratios.values()), ratios
    assert all(r >= 0.45 for r in ratios.values()), ratios  # half, not less: the sequence split is the saving


@pytest.mark.parametrize("sequence_parallel", [1, 2])
def test_planner_within_the_issue_bar_and_within_1_percent(measured, sequence_parallel):
    key = f"sp{sequence_parallel}_peak"
    errors = {label(c): planned(c, sequence_parallel) / c[key] - 1 for c in measured}
    assert all(abs(e) <= ISSUE_BAR for e in errors.values()), errors
    assert all(abs(e) <= TIGHT for e in errors.values()), errors


# --- the formula, by hand ---------------------------------------------------------------------------------------

H, A, KV, D, MLP, V, L = 4096, 32, 8, 128, 14336, 128256, 32  # Llama-3-8B
LLAMA3 = ModelFacts(
    num_params=8_030_261_248,
    architecture="transformer",
    hidden_size=H,
    num_layers=L,
    num_heads=A,
    num_kv_heads=KV,
    head_dim=D,
    intermediate_size=MLP,
    vocab_size=V,
    block="llama",
)


@pytest.mark.parametrize("sp", [2, 4, 8, 16, 32])
def test_one_block_at_sp_n_by_hand(sp):
    """bf16, per rank, T = s b tokens: norms and MLP on T / N tokens; q, output, log-sum-exp on A / N heads over T;
    k, v on max(KV / N, 1) heads over T; plus o_proj's input copy (2 h T / N)."""
    s, b, p = 32768, 1, 2
    t_local = s * b / sp
    norm = (FP32 + 2 * p) * t_local * H + FP32 * t_local
    kv_heads = max(KV / sp, 1)
    attention = 2 * p * t_local * H + FP32 * A * t_local + 2 * p * s * b * D * kv_heads + p * t_local * H
    mlp = 4 * p * t_local * MLP
    parts = activation_parts(LLAMA3, s, b, "bf16", "sdpa", sequence_parallel=sp)
    assert parts.attention == pytest.approx(attention, rel=1e-12)
    assert parts.layer == pytest.approx(2 * norm + attention + mlp, rel=1e-12)
    assert parts.block_input == pytest.approx(p * t_local * H, rel=1e-12)
    assert parts.head == pytest.approx(norm + FP32 * t_local * V + 2 * INDEX_BYTES * t_local, rel=1e-12)
    assert parts.rope == pytest.approx(2 * p * (s / sp) * D, rel=1e-12)


def test_sp_1_is_the_formula_without_sequence_parallelism():
    for preset in ("none", "full", "selective"):
        plain = transformer_activations(LLAMA3, 8192, 1, preset, "bf16", "sdpa")
        assert transformer_activations(LLAMA3, 8192, 1, preset, "bf16", "sdpa", sequence_parallel=1) == plain


def test_full_checkpointing_at_sp_8_is_an_eighth_of_the_token_terms():
    """Checkpointed: block inputs (2 h per token) on s / 8 tokens, one block recomputed, the rank's token ids."""
    s, sp = 65536, 8
    parts = activation_parts(LLAMA3, s, 1, "bf16", "sdpa", sequence_parallel=sp)
    expected = L * parts.block_input + parts.layer + parts.rope + INDEX_BYTES * s / sp
    expected = max(expected, L * parts.block_input + parts.head)
    assert transformer_activations(LLAMA3, s, 1, "full", "bf16", "sdpa", sequence_parallel=sp) == pytest.approx(
        expected, rel=1e-12
    )


@pytest.mark.parametrize(
    ("facts", "kwargs", "message"),
    [
        (LLAMA3, {"seq_len": 4096, "sp": 3}, "--sequence-parallel 3 does not divide the 32 attention heads"),
        (replace(LLAMA3, num_kv_heads=6, num_heads=24), {"seq_len": 4096, "sp": 4}, "the 6 key/value heads"),
        (LLAMA3, {"seq_len": 4100, "sp": 8}, "--seq-len 4100 is not divisible by --sequence-parallel 8"),
        (LLAMA3, {"seq_len": 4096, "sp": 2, "attention": "eager"}, "refuses eager"),
    ],
    ids=["heads", "kv-heads", "seq-len", "eager"],
)
def test_what_ulysses_cannot_split_is_refused(facts, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        activation_parts(facts, kwargs["seq_len"], 1, "bf16", kwargs.get("attention", "sdpa"), 1, kwargs["sp"])
