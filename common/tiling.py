"""Tiled MLP and tiled loss (Arctic Long Sequence Training, DeepSpeed's ``ulysses_sp`` module).

At long sequences two tensors dominate a step's memory besides attention: the MLP's intermediate activations
(three of ``tokens x intermediate_size`` per layer, about 3.5x the hidden size for Llama) and the logits with
their softmax (``tokens x vocab_size`` in fp32: 8 GB at 16K tokens for a 128K vocabulary). Tiling computes either
one slice of the sequence at a time, keeps nothing but the input for the backward pass, and recomputes each slice
there: one extra MLP / head forward for memory that no longer grows with the whole sequence.

Both run on DeepSpeed's own autograd functions (``TiledMLP``, ``sequence_tiled_compute``), which tell ZeRO not to
reduce a weight's gradient until its last slice (``ds_grad_is_ready``). Not on ``TiledFusedLogitsLoss``: it runs
the backward inside the forward with an incoming gradient of 1 and scales only the input's gradient by the real
one afterwards, so the output layer's gradient ignores whatever the loss is multiplied by later (gradient
accumulation's 1/k, fp16's loss scale, the sequence-parallel factor of :mod:`common.sequence_parallel`).
``sequence_tiled_compute`` recomputes in the backward pass with the real incoming gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from common.errors import ConfigError

IGNORE_INDEX = -100
MLP_CHILDREN = ("gate_proj", "up_proj", "down_proj")  # Llama, Mistral, Qwen: the gated MLP the recipes train


def check_tiling(mlp_shards: int, loss_shards: int, tied_embeddings: bool) -> None:
    """Refuse a tiling the run cannot use, before any work."""
    for name, shards in (("tiled_mlp_shards", mlp_shards), ("tiled_loss_shards", loss_shards)):
        if shards < 1:
            raise ConfigError(f"{name} must be >= 1 (1: not tiled), got {shards}")
    if loss_shards > 1 and tied_embeddings:
        # The tied matrix gets one gradient from the tiled head (its own backward calls) and one from the
        # embedding later in the same pass: ZeRO 1/2 would reduce it twice ("Gradient computed twice").
        raise ConfigError(
            f"tiled_loss_shards={loss_shards} needs an output layer of its own; this model ties it to the input "
            "embedding (tie_word_embeddings=true): use tiled_loss_shards=1"
        )


def _class_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(mlp).forward(mlp, x)


def _tiled_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    if not torch.is_grad_enabled():  # evaluation: nothing is saved for a backward pass anyway
        return _class_forward(mlp, x)
    return TiledMLP.apply(_class_forward, mlp, x, mlp.tiled_shards, list(mlp.parameters()))


def tile_mlp(model: torch.nn.Module, shards: int) -> int:
    """Compute every gated MLP of ``model`` ``shards`` slices of the sequence at a time; returns how many.

    The MLP's own (class) forward runs per slice, so its weights stay where ZeRO-3's hooks gather them."""
    if shards == 1:
        return 0
    tiled = 0
    for module in model.modules():
        if all(isinstance(getattr(module, name, None), torch.nn.Linear) for name in MLP_CHILDREN):
            module.tiled_shards = shards
            module.forward = _tiled_mlp_forward.__get__(module)
            tiled += 1
    if not tiled:
        raise ConfigError(
            f"tiled_mlp_shards={shards}: the model has no gated MLP ({', '.join(MLP_CHILDREN)}) to tile; use 1"
        )
    return tiled


def summed_token_loss(
    lm_head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, shards: int
) -> torch.Tensor:
    """Cross entropy summed over the tokens whose label is not ``IGNORE_INDEX``, in fp32, the logits of one of
    ``shards`` slices of the sequence at a time (all at once when ``shards`` is 1)."""

    def loss(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = lm_head(hidden).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    if shards == 1 or not torch.is_grad_enabled():
        return loss(hidden, labels)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    return sequence_tiled_compute(
        loss,
        seqlen=hidden.shape[1],
        shards=shards,
        kwargs_to_shard={"hidden": hidden, "labels": labels},
        kwargs_to_pass={},
        grad_requiring_tensor_key="hidden",
        compute_params=list(lm_head.parameters()),
        output_unshard_dimension=0,  # one loss per slice, summed
        output_reduction="sum",
    )


def tile_loss(model: torch.nn.Module, shards: int) -> None:
    """Let ``model(..., token_loss_labels=labels)`` return :func:`summed_token_loss` instead of logits.

    The head runs inside the model's own forward (after its decoder, ``model.model``), so a DeepSpeed engine
    wrapping the model, or a module holding it, calls it the usual way and ZeRO-3's hooks see every submodule.
    Any other call returns the model's usual output (evaluation, sampling)."""
    model_forward = model.forward

    def forward(*args: Any, token_loss_labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if token_loss_labels is None:
            return model_forward(*args, **kwargs)
        hidden = model.model(*args, **kwargs).last_hidden_state
        return summed_token_loss(model.lm_head, hidden, token_loss_labels, shards)

    model.forward = forward
