"""The fine-tuning loss is the global batch's response-token mean, however the batch is cut (in one process).

``finetune_loss.train_loss`` back-propagates a micro-batch's summed response-token loss times ``loss_scale``; DeepSpeed
then divides each micro-batch's loss by the accumulation steps and averages the data-parallel ranks. Simulating that
average here, every cut of one global batch (micro-batch size x accumulation x ranks) must give the gradient of an
independent reference: ``F.cross_entropy``'s mean over the whole global batch collated at once. The data have
responses of very different lengths, where a mean per micro-batch would weigh the tokens of a short batch more.
``global_batch_tokens`` must count exactly the examples the ranks' loaders deliver in a step, across epochs.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from _util import REPO, recipe_module

RECIPE = REPO / "recipes" / "nlp"
IGNORE = -100
PAD = 0
GLOBAL_BATCH = 8
CUTS = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (1, 2, 4)]  # micro-batch, accum, ranks


@pytest.fixture(scope="module")
def ft():
    return recipe_module(RECIPE, "finetuning"), recipe_module(RECIPE, "finetune_config")


@pytest.fixture(scope="module")
def loss_module():
    return recipe_module(RECIPE, "finetune_loss")


def encoded_examples(n: int) -> list[dict[str, list[int]]]:
    """Prompts of 3-6 tokens, responses of 1 to 40 tokens (the issue's spread)."""
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 2, 3, 20, 40]
    examples = []
    for i in range(n):
        prompt = torch.randint(1, 64, (3 + i % 4,), generator=generator).tolist()
        response = torch.randint(1, 64, (lengths[i % len(lengths)],), generator=generator).tolist()
        examples.append({"input_ids": prompt + response, "labels": [IGNORE] * len(prompt) + response})
    return examples


def sft_data(ft_module, loss_module, examples):
    return ft_module.SFTData(
        tokenizer=SimpleNamespace(pad_token_id=PAD),
        train=examples,
        val=[],
        val_encoded=[],
        fixed_batch={},
        train_tokens=[loss_module.response_tokens(e["labels"]) for e in examples],
    )


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return LlamaForCausalLM(config).float()


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def reference_gradient(model, examples) -> tuple[torch.Tensor, float]:
    """The whole global batch in one forward: cross entropy's own mean over every response token."""
    from nlp.task import collate_sft

    batch = collate_sft(examples, PAD)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE)
    model.zero_grad()
    loss.backward()
    return flat_grad(model), loss.item()


def test_response_tokens_are_the_labels_the_loss_reads(loss_module):
    assert loss_module.response_tokens([IGNORE, IGNORE, 5, 6, 7]) == 3
    assert loss_module.response_tokens([5, 6, 7]) == 2  # the first label is never a target
    assert loss_module.response_tokens([IGNORE, 5, 6, IGNORE]) == 2


@pytest.mark.parametrize(("micro_batch_size", "grad_accum", "ranks"), CUTS)
def test_every_cut_has_the_gradient_of_the_global_token_mean(ft, loss_module, micro_batch_size, grad_accum, ranks):
    finetuning, finetune_config = ft
    examples = encoded_examples(GLOBAL_BATCH)
    cfg = finetune_config.FinetuneConfig(micro_batch_size=micro_batch_size, grad_accum=grad_accum, max_steps=1)
    data = sft_data(finetuning, loss_module, examples)
    model = tiny_model()
    expected, expected_loss = reference_gradient(model, examples)

    # The step's examples in the order the ranks' loaders deliver them (StepSampler), then DeepSpeed's average.
    tokens = loss_module.global_batch_tokens(data, cfg, ranks, 0)
    scale = loss_module.loss_scale(cfg, ranks, tokens)
    model.zero_grad()
    sums = []
    for rank in range(ranks):
        loader = finetuning.sft_loader(data, cfg, rank, ranks, 0, False)
        for batch in loader:
            loss, summed = loss_module.train_loss(model, batch, torch.device("cpu"), scale)
            (loss / (grad_accum * ranks)).backward()  # engine.backward's / grad_accum, then the ranks' mean
            sums.append(summed)
    assert tokens == sum(data.train_tokens)  # one step of a global batch that is the whole data set
    found = flat_grad(model)
    assert torch.allclose(found, expected, rtol=1e-5, atol=1e-7 * expected.abs().max().item())
    assert math.isclose(loss_module.step_token_mean(sums), expected_loss, rel_tol=1e-5)  # the logged train loss


@pytest.mark.parametrize(("micro_batch_size", "grad_accum", "ranks"), [(2, 3, 2), (1, 2, 3), (4, 1, 1)])
def test_global_batch_tokens_counts_what_the_ranks_read(ft, loss_module, micro_batch_size, grad_accum, ranks):
    finetuning, finetune_config = ft
    examples = encoded_examples(23)  # a ragged number: epochs wrap within the run
    steps = 9
    cfg = finetune_config.FinetuneConfig(micro_batch_size=micro_batch_size, grad_accum=grad_accum, max_steps=steps)
    data = sft_data(finetuning, loss_module, examples)
    per_rank = [list(finetuning.sft_loader(data, cfg, r, ranks, 0, False).sampler) for r in range(ranks)]
    per_step = micro_batch_size * grad_accum
    for step in range(steps):
        read = [i for indices in per_rank for i in indices[step * per_step : (step + 1) * per_step]]
        assert loss_module.global_batch_tokens(data, cfg, ranks, step) == sum(data.train_tokens[i] for i in read)
