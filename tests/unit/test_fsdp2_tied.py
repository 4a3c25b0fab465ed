"""Tied embeddings under FSDP2: ``apply_fully_shard`` shards a causal LM whose output matrix is its input embedding
(``tie_word_embeddings``, as a local model folder may be) and the two stay one parameter, trained as one.

One process (a gloo group of 1 over an in-memory store): the sharding is real, the reference is the same model left
unsharded, trained with the same optimizer on the same batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _util import tied_llama as shared_tied_llama
from transformers import LlamaForCausalLM

from common.fsdp2 import apply_fully_shard

STEPS = 3


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tied_llama() -> LlamaForCausalLM:
    return shared_tied_llama(hidden_size=32, vocab_size=128, max_positions=64)


def train(model: torch.nn.Module, batch: torch.Tensor) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_tied_embeddings_stay_one_parameter_and_train_as_the_unsharded_model(one_rank_group):
    plain = tied_llama()
    sharded = copy.deepcopy(plain)
    assert sharded.lm_head.weight is sharded.model.embed_tokens.weight  # deepcopy keeps the tie
    blocks = apply_fully_shard(sharded, "fsdp2", "fp32")
    assert blocks == ["model.layers.0", "model.layers.1"]  # each decoder layer, then the root (not listed)
    assert sharded.lm_head.weight is sharded.model.embed_tokens.weight
    assert len(list(sharded.parameters())) == len(list(plain.parameters()))  # the tied matrix counted once

    batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    expected, actual = train(plain, batch), train(sharded, batch)
    # An untied output matrix would get the head's gradient alone and the embedding the input's: step 2 would differ.
    assert actual == pytest.approx(expected, rel=1e-6), (actual, expected)
    assert sharded.lm_head.weight is sharded.model.embed_tokens.weight
