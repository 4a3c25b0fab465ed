"""Ulysses sequence parallelism (DeepSpeed's ``UlyssesSPAttentionHF``) for transformers models.

Each of the N ranks of a sequence-parallel group reads the same sequences and keeps 1/N of every sequence's tokens:
outside attention a rank's activations are those of its slice; around attention an all-to-all gives each rank the
whole sequence for 1/N of the heads and back. DeepSpeed builds the groups from consecutive ranks (``ranks i * N ..
i * N + N - 1``, ``parallel_state_sp.initialize_sequence_parallel``); a run's data-parallel size is world / N.

The loss, and two traps of the published recipe (measured here, fp32, SGD, against the same model on one rank):

- The documented loss gathers every rank's loss with ``torch.distributed.nn.functional.all_gather`` so that each
  rank back-propagates the whole sequence's mean. Its backward sums the N copies, so every rank's gradients come
  out N times too large; ZeRO-3 averages gradients over all N x DP ranks and cancels it, ZeRO 0-2 average over the
  DP ranks only and keep it (their gradients are the sum over the group). With Adam the curve barely shows it;
  clipping and SGD see N times the gradient.
- That autograd ``all_gather`` fails on gloo once the group is not ranks 0..N-1 (any data parallelism).

So here a rank back-propagates its own tokens' loss divided by the group's token count (a non-differentiable
all-reduce of two numbers), times N under ZeRO-3: the group's gradients then sum (ZeRO 0-2) or average (ZeRO-3) to
exactly the one-rank gradient of the mean loss. :func:`grad_scale` holds that rule; the recipe tests check the
gradient norms against the run without sequence parallelism, at every stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from common.memory_formulas import ModelFacts
from common.parallel import ParallelLayout, check_layout, recipe_option

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SequenceParallel:
    """One rank's place in its sequence-parallel group, and the factor its loss is scaled by (:func:`grad_scale`)."""

    size: int
    rank: int
    group: Any
    grad_scale: float


def grad_scale(zero_stage: int, size: int) -> float:
    """What a rank's (own tokens' loss / group's tokens) is multiplied by so that DeepSpeed's gradient reduction
    yields the one-rank gradient: ZeRO-3 divides the sum over the N x DP ranks by N x DP, ZeRO 0-2 by DP only."""
    return float(size) if zero_stage == 3 else 1.0


def check_sequence_parallel(
    size: int,
    world_size: int,
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    attention: str,
    tensor_parallel: int = 1,
) -> None:
    """Refuse a ``sequence_parallel`` the run cannot use, before any work (one ConfigError naming the fix): the
    layout rules of :func:`common.parallel.check_layout`, in a recipe's vocabulary, for a model given by its heads."""
    if size == 1:
        return
    facts = ModelFacts(
        num_params=0, architecture="transformer", num_heads=num_heads, num_kv_heads=num_kv_heads, source="the model"
    )
    layout = ParallelLayout(world_size, tensor=tensor_parallel, sequence=size, components="deepspeed")
    check_layout(facts, layout, recipe_option, seq_len=seq_len, attention=attention)


def register(model: Any, size: int, micro_batch_size: int, attention: str) -> Any:
    """Route the model's attention through Ulysses and build the groups; returns the ``mpu`` for
    ``deepspeed.initialize``. In eval mode attention runs unsplit (every rank evaluates whole sequences)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=attention,
        sequence_parallel_size=size,
        micro_batch_size=micro_batch_size,
        seq_length_is_variable=True,
        disable_in_eval=True,
    )


def unregister(attention: str) -> None:
    """Give ``attention`` back transformers' own function, after training.

    ``register_with_transformers`` replaces it process-wide with Ulysses' wrapper, which drops every attention mask,
    in eval mode too: a batched generate from left-padded prompts (the fine-tuning export's exact match) would attend
    to the padding.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    ALL_ATTENTION_FUNCTIONS[attention] = AttentionInterface()[attention]  # a fresh interface: the library's mapping


def this_rank(size: int, zero_stage: int) -> SequenceParallel | None:
    """After ``deepspeed.initialize``: this rank's group (None without sequence parallelism)."""
    if size == 1:
        return None
    from deepspeed.utils import groups  # the engine's view: the mpu deepspeed.initialize was given

    found = groups._get_sequence_parallel_world_size()
    if found != size:
        raise RuntimeError(
            f"DeepSpeed's engine has sequence-parallel groups of {found} rank(s), the run asked for {size}"
        )
    return SequenceParallel(
        size, groups._get_sequence_parallel_rank(), groups._get_sequence_parallel_group(), grad_scale(zero_stage, size)
    )


def shard(tensor: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """This rank's contiguous slice of the sequence dimension (dim 1)."""
    chunk = tensor.shape[1] // sp.size
    return tensor[:, sp.rank * chunk : (sp.rank + 1) * chunk]


def lm_loss(
    model: Any, input_ids: torch.Tensor, labels: torch.Tensor, sp: SequenceParallel, tiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to back-propagate, the whole sequences' mean loss, detached) for next-token labels already shifted.

    The forward runs on this rank's slice with its positions in the whole sequence (Ulysses gathers them for the
    causal mask); the second value is the same on every rank of the group. ``tiled``: the model computes the summed
    loss itself, a slice of the logits at a time (:func:`common.tiling.tile_loss`).
    """
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    inputs = {"input_ids": shard(input_ids, sp), "position_ids": shard(positions, sp), "use_cache": False}
    local = shard(labels, sp)
    if tiled:
        summed = model(**inputs, token_loss_labels=local)
    else:
        logits = model(**inputs).logits.float()
        summed = F.cross_entropy(logits.flatten(0, 1), local.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    totals = torch.stack([summed.detach(), (local != IGNORE_INDEX).sum().to(summed.dtype)])
    torch.distributed.all_reduce(totals, group=sp.group)  # not autograd's: see the module docstring
    count = totals[1].clamp(min=1)
    return summed / count * sp.grad_scale, totals[0] / count


def accelerate_parallelism(size: int, attention: str, world_size: int) -> Any:
    """Accelerate's ``ParallelismConfig`` for Ulysses: it registers the attention and passes DeepSpeed the groups
    (``mpu``) in ``prepare``; the recipes prepare no data loader, so its sequence-sharding loader adapter stays out
    and :func:`lm_loss` shards instead. ``dp_shard_size`` is the data-parallel size: Accelerate computes DeepSpeed's
    ``train_batch_size`` from it (1 by default, which DeepSpeed then refuses)."""
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation=attention)
    return ParallelismConfig(sp_backend="deepspeed", sp_size=size, dp_shard_size=world_size // size, sp_handler=handler)
