"""One rank of the Ulysses activation measurement: bytes saved for backward at sequence parallel 2 and at 1.

For each case a tiny transformers Llama (fp32, sdpa) is built with the same seed on every rank. Without sequence
parallelism it trains one step on the whole sequence (``labels=ids``, transformers' loss), as
tests/unit/test_activation_bytes.py measures it. Then DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers``
wraps its attention for a sequence-parallel group of both ranks, each rank feeds its slice of the token ids with the
positions of that slice in the whole sequence and computes the loss from pre-shifted labels (the documented recipe:
``model.loss_function(logits, labels=None, shift_labels=...)``). Measured both times: the most bytes autograd holds
for backward at once (common.activation.saved_activation_bytes: parameters excluded, each storage once, checkpoint
recomputation included). No ``deepspeed.initialize``: the engine does not change what autograd saves.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/sequence_parallel_activation_worker.py \\
        --out OUT
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.runtime.sequence_parallel import parallel_state_sp
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from worker_util import run_then_exit, setup_gloo_rank, write_rank_record

from common.activation import apply_activation_checkpointing, saved_activation_bytes
from nlp.model import build_llama_config, build_model_from_config

VOCAB = 128
SHAPES = {
    # Grouped-query: 2 KV heads split over 2 ranks, one each.
    "gqa": {
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 176,
    },
    # Plain multi-head attention, 4 layers (every_k and save_memory_optimized pick different blocks).
    "mha": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 176,
    },
    # One KV head and 2 ranks: Ulysses replicates it, each rank attends with one whole KV head.
    "mqa": {
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "intermediate_size": 176,
    },
}
# (shape, seq_len, micro batch, checkpointing preset)
CASES = [
    ("gqa", 64, 2, "none"),
    ("gqa", 64, 2, "full"),
    ("gqa", 64, 2, "selective"),
    ("gqa", 256, 1, "none"),
    ("mha", 128, 1, "none"),
    ("mha", 128, 1, "every_k"),
    ("mha", 128, 1, "save_memory_optimized"),
    ("mqa", 64, 2, "none"),
]


def build(shape: str, seq_len: int, preset: str) -> torch.nn.Module:
    config = build_llama_config("tiny", vocab_size=VOCAB, seq_len=seq_len, **SHAPES[shape])
    torch.manual_seed(0)
    model = build_model_from_config(config, "sdpa", dtype=torch.float32)
    model.train()
    apply_activation_checkpointing(model, preset)
    return model


def loss_fn(inputs: dict[str, torch.Tensor], shift_labels: torch.Tensor):
    """The documented Ulysses loss on one rank: no ``labels`` (the shift crosses ranks), pre-shifted labels."""

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        logits = model(**inputs).logits
        return model.loss_function(logits=logits, labels=None, shift_labels=shift_labels, vocab_size=VOCAB)

    return loss_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world = setup_gloo_rank()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # register_with_transformers replaces it: restored for each case
    records = []
    for shape, seq_len, batch, preset in CASES:
        ids = torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(0))
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        whole = saved_activation_bytes(
            build(shape, seq_len, preset), lambda m, ids=ids: m(input_ids=ids, labels=ids).loss
        )

        model = build(shape, seq_len, preset)
        parallel_state_sp._release_sequence_parallel_groups()  # a fresh group per case
        UlyssesSPAttentionHF.register_with_transformers(
            model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=world,
            micro_batch_size=batch,
            seq_length=seq_len,
            seq_length_is_variable=True,
        )
        local = seq_len // world
        mine = slice(rank * local, (rank + 1) * local)
        shift_labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]  # shifted before slicing
        inputs = {"input_ids": ids[:, mine], "position_ids": torch.arange(seq_len)[mine].unsqueeze(0)}
        sliced = saved_activation_bytes(model, loss_fn(inputs, shift_labels[:, mine].contiguous()))
        records.append(
            {
                "shape": shape,
                "config": SHAPES[shape],
                "vocab_size": VOCAB,
                "seq_len": seq_len,
                "micro_batch_size": batch,
                "checkpointing": preset,
                "precision": "fp32",
                "attention": "sdpa",
                "sp1_peak": whole["peak"],
                "sp2_peak": sliced["peak"],
            }
        )
        dist.barrier()
    write_rank_record(args.out, rank, {"rank": rank, "world": world, "cases": records})
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)
