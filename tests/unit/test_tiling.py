"""Tiled MLP and tiled loss (common/tiling.py): the untiled model's loss and gradients, without the big tensors.

One process, fp32, the NLP recipe's tiny Llama. The uneven slices (250 tokens in 3 and 4) and a loss multiplied by a
factor before the backward pass are on purpose: DeepSpeed's ``TiledFusedLogitsLoss`` ignores that factor for the
output layer's gradient, which is why the recipe uses ``sequence_tiled_compute``. The same tiling under ZeRO 2 and 3
with sequence parallelism: tests/recipes/test_nlp_sequence_parallel.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from common import tiling
from common.activation import saved_activation_bytes
from common.errors import ConfigError
from nlp.model import build_llama_config, build_model_from_config

BATCH, TOKENS, SCALE = 2, 250, 0.25  # SCALE: what gradient accumulation or a loss scaler would multiply the loss by


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    plain = build_model_from_config(build_llama_config("tiny", vocab_size=4096), attn_implementation="sdpa")
    tiled = copy.deepcopy(plain)
    assert tiling.tile_mlp(tiled, 3) == plain.config.num_hidden_layers
    tiling.tile_loss(tiled, 4)
    return plain, tiled


@pytest.fixture(scope="module")
def batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 4096, (BATCH, TOKENS), generator=generator)
    labels = torch.randint(0, 4096, (BATCH, TOKENS), generator=generator)
    labels[:, :7] = tiling.IGNORE_INDEX  # a prompt the loss skips
    return input_ids, labels


def plain_loss(model, input_ids, labels):
    logits = model(input_ids=input_ids, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=tiling.IGNORE_INDEX, reduction="sum")


def tiled_loss(model, input_ids, labels):
    return model(input_ids=input_ids, use_cache=False, token_loss_labels=labels)


def test_tiled_mlp_and_loss_give_the_untiled_loss_and_gradients(models, batch):
    plain, tiled = models
    losses = []
    for model, loss_of in ((plain, plain_loss), (tiled, tiled_loss)):
        model.zero_grad()
        loss = loss_of(model, *batch)
        (loss * SCALE).backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, p), q in zip(plain.named_parameters(), tiled.parameters()):
        scale = p.grad.abs().max().item()
        assert scale > 0, name
        assert (p.grad - q.grad).abs().max().item() <= 1e-5 * scale, name


def test_evaluation_runs_the_models_own_forward(models, batch):
    plain, tiled = models
    with torch.no_grad():
        expected = plain(input_ids=batch[0], use_cache=False).logits
        found = tiled(input_ids=batch[0], use_cache=False).logits
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


def test_tiling_drops_exactly_the_mlp_intermediates_and_the_logits(models, batch):
    # Every byte of the difference, from the shapes: per layer the MLP saves four tokens x intermediate fp32
    # tensors (gate, its SiLU, up, their product) that tiling recomputes; the loss saves the log-softmax (tokens x
    # vocabulary) and the labels (int64). The tiled loss keeps its input (the final norm's output) as an attribute
    # of its autograd node, which the saved-tensor hooks do not see: it is added back here.
    plain, tiled = models
    config = plain.config
    tokens = BATCH * TOKENS
    mlp = config.num_hidden_layers * 4 * tokens * config.intermediate_size * 4
    logits = tokens * config.vocab_size * 4 + tokens * 8
    hidden_held_outside_hooks = tokens * config.hidden_size * 4
    untiled = saved_activation_bytes(plain, lambda m: plain_loss(m, *batch))["end_of_forward"]
    counted = saved_activation_bytes(tiled, lambda m: tiled_loss(m, *batch))["end_of_forward"]
    assert untiled - (counted + hidden_held_outside_hooks) == pytest.approx(mlp + logits, rel=1e-3)
    assert (counted + hidden_held_outside_hooks) / untiled < 0.45  # the tiny model: 0.42


def test_a_tiling_the_run_cannot_use_is_refused():
    with pytest.raises(ConfigError, match="ties it to the input embedding"):
        tiling.check_tiling(1, 2, tied_embeddings=True)
    with pytest.raises(ConfigError, match="tiled_mlp_shards must be >= 1"):
        tiling.check_tiling(0, 1, tied_embeddings=False)
    tiling.check_tiling(4, 1, tied_embeddings=True)  # the MLP alone does not touch the output layer
    with pytest.raises(ConfigError, match="no gated MLP"):
        tiling.tile_mlp(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2)
