"""The fine-tuning loss: the global batch's response-token mean, however the batch is cut into micro-batches and ranks.

Shared by ``finetune.py`` (Lightning) and ``finetune_accelerate.py`` (Accelerate), beside ``finetuning.py`` (data,
model, export, summary). A mean per micro-batch would weigh a token of a short batch more than one of a long batch,
so the gradient would change with the cut (the gradient-accumulation loss bug transformers fixed in 2024 with
``num_items_in_batch``): each micro-batch back-propagates its summed response-token loss times :func:`loss_scale`,
whose denominator, the step's global response-token count (:func:`global_batch_tokens`), is known from the data
before the step's first forward. tests/unit/test_finetune_token_mean.py checks every cut against one forward of
the whole global batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from common import sequence_parallel
from common.data import StepSampler
from common.metrics import all_reduce
from common.sequence_parallel import SequenceParallel
from nlp.task import IGNORE_INDEX

if TYPE_CHECKING:  # annotations only: finetuning imports this module
    from finetune_config import FinetuneConfig
    from finetuning import SFTData


def sft_loss_sums(model: Any, batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response-token cross entropy (fp32) and the number of response tokens of a batch."""
    logits = model(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device), use_cache=False
    ).logits
    labels = batch["labels"][:, 1:].to(device)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (labels != IGNORE_INDEX).sum()


def response_tokens(labels: list[int]) -> int:
    """Response tokens of one encoded example: the labels the loss reads (every one but the first is a target)."""
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


def global_batch_tokens(data: SFTData, cfg: FinetuneConfig, dp_size: int, step: int) -> int:
    """Response tokens in optimizer step ``step``'s global batch: every micro-batch of every data-parallel rank.

    Known before the step's first forward, without communication: every rank holds all examples, and
    :class:`StepSampler` gives rank ``r`` the ``r``-th slice of each global micro-batch, so one sampler of the whole
    global micro-batch (``micro_batch_size x dp_size`` samples, rank 0 of 1) lists the step's examples. The ranks of
    a sequence-parallel group read the same examples and count them once.
    """
    sampler = StepSampler(
        len(data.train), cfg.micro_batch_size * dp_size, cfg.grad_accum, 0, 1, cfg.seed, step, step + 1
    )
    return sum(data.train_tokens[index] for index in sampler)


def loss_scale(cfg: FinetuneConfig, dp_size: int, global_tokens: int) -> float:
    """What a micro-batch's summed response-token loss is multiplied by before it is back-propagated.

    The training loss is the step's token mean: the summed response-token loss of the whole global batch (every
    micro-batch, every data-parallel rank, every sequence-parallel slice) over that batch's ``global_tokens``
    (:func:`global_batch_tokens`). Each back-propagated loss is divided by ``grad_accum`` once (by DeepSpeed's
    engine under ZeRO; by Lightning's or Accelerate's loop under FSDP2) and the ``dp_size`` ranks' gradients are
    averaged (micro-batches and ranks with equal weight), so the scale carries both factors back. A mean per
    micro-batch instead would weigh a token of a short batch more than one of a long batch: the gradient would change
    with how the global batch is cut into micro-batches and ranks (the gradient-accumulation loss bug transformers
    fixed in 2024 with ``num_items_in_batch``).
    """
    return cfg.grad_accum * dp_size / max(global_tokens, 1)


def train_loss(
    model: Any, batch: dict, device: torch.device, scale: float, sp: SequenceParallel | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to back-propagate, the micro-batch's [summed response-token loss, response tokens], detached).

    ``scale``: :func:`loss_scale`, for the step this micro-batch belongs to. Sequence parallel (``sp``): this rank's
    slice of every sequence, through ``common.sequence_parallel.lm_loss``, whose loss is the micro-batch's token
    mean over the group (own tokens' summed loss over the group's response-token count, times ``grad_scale`` under
    ZeRO-3); times that count it is the own tokens' summed loss, scaled alike. Ulysses drops the attention mask:
    right padding under causal attention leaves every real token's output unchanged and padding is labelled
    ``IGNORE_INDEX``; a left-padded batch would not be, and is refused.
    """
    tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().to(device)  # the whole micro-batch's, on every SP rank
    if sp is None:
        summed, _ = sft_loss_sums(model, batch, device)
        return summed * scale, torch.stack([summed.detach(), tokens.to(summed.dtype)])
    mask = batch["attention_mask"]
    if (mask[:, 1:] > mask[:, :-1]).any():
        raise RuntimeError("sequence_parallel needs right-padded batches: Ulysses attends without the attention mask")
    labels = batch["labels"]  # lm_loss takes next-token labels already shifted: the last position predicts nothing
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    group_mean, mean = sequence_parallel.lm_loss(model, batch["input_ids"].to(device), shifted.to(device), sp)
    count = tokens.to(mean.dtype)
    return group_mean * count * scale, torch.stack([mean * count, count])


def step_token_mean(sums: list[torch.Tensor]) -> float:
    """The logged training loss of a step: its micro-batches' [summed loss, tokens] added over every rank, divided
    (collective). Sequence parallel: each rank of a group holds the group's sums; the ratio counts them once."""
    total = all_reduce(torch.stack(sums).sum(dim=0).double())
    return float(total[0] / total[1].clamp(min=1))


@torch.no_grad()
def evaluate(model: Any, batches: list[dict], device: torch.device) -> float:
    """Mean response-token loss over every rank's held-out batches (all ranks must call it)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        loss, count = sft_loss_sums(model, batch, device)
        total += torch.stack([loss.double(), count.double()])
    model.train(was_training)
    total = all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))
