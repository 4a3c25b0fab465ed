"""The NLP recipe's two model families behind one interface: a dense Llama and a Mixture-of-Experts model.

A training loop calls the same methods whatever the model: ``config`` and ``build`` make it, ``loss`` adds what
the model adds to the LM loss (a router's load-balancing loss), ``flops_per_token`` counts the matmuls one token
really goes through (``top_k`` experts, not one MLP), ``param_groups`` splits the optimizer groups the way DeepSpeed
needs, ``gather_state_dict`` / ``export_state_dict`` give the whole model under transformers' names, and
``summary`` what ``summary.json`` reports about it. Everything MoE-specific lives in :class:`MixtureOfExperts`
(and nlp/moe.py); :class:`DenseLlama` is the default path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig, MixtralConfig

from nlp.model import LLAMA_SIZES, build_llama_config, build_model_from_config, flops_per_token
from nlp.moe import (
    MOE_SIZES,
    aux_loss,
    build_moe_config,
    build_moe_model,
    gather_moe_state_dict,
    moe_flops_per_token,
    split_moe_param_groups,
    to_mixtral_state_dict,
)

MODEL_SIZES: dict[str, dict[str, Any]] = {**LLAMA_SIZES, **MOE_SIZES}  # every named size, dense and MoE
# The width and depth a run may override on top of a named size (config key -> transformers config field).
SHAPE_KEYS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
}


def shape_overrides(size: str, **keys: int) -> dict[str, int]:
    """The transformers config fields of the width and depth keys set (non-zero) on top of ``size``: a size whose
    heads each have their own key/value head keeps it so when ``num_heads`` changes."""
    fields = {SHAPE_KEYS[key]: value for key, value in keys.items() if value}
    base = MODEL_SIZES.get(size, {})
    if "num_attention_heads" in fields and base.get("num_key_value_heads") == base.get("num_attention_heads"):
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    return fields


Gather = Callable[[torch.nn.Module, int], "dict[str, torch.Tensor] | None"]


@dataclass(frozen=True)
class DenseLlama:
    """A Llama (``LlamaForCausalLM``): the LM loss alone, one MLP per token, nothing more to report."""

    moe = False

    def config(self, size: str, vocab_size: int | None, tokenizer: Any, seq_len: int, **shape: int) -> LlamaConfig:
        """The named size's config, its vocabulary the tokenizer's (or ``vocab_size``), ``shape`` overrides on top."""
        return build_llama_config(size, vocab_size=vocab_size, tokenizer=tokenizer, seq_len=seq_len, **shape)

    def build(self, config: Any, attention: str, seed: int, expert_rank: int = 0) -> torch.nn.Module:
        """A randomly initialised model (weights from ``torch.manual_seed(seed)``)."""
        torch.manual_seed(seed)
        return build_model_from_config(config, attn_implementation=attention)

    def loss(self, lm_loss: torch.Tensor, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss to back-propagate, auxiliary loss or None): the LM loss as it is."""
        return lm_loss, None

    def flops_per_token(self, config: Any, seq_len: int) -> float:
        """Training FLOPs per token (:func:`nlp.model.flops_per_token`)."""
        return flops_per_token(config, seq_len)

    def param_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return groups

    def gather_state_dict(self, model: torch.nn.Module, rank: int, gather: Gather) -> dict[str, Any] | None:
        """Whole weights on rank 0 (collective): ``gather`` (ZeRO's or tensor parallelism's gather)."""
        return gather(model, rank)

    def export_state_dict(self, state: dict[str, Any], skeleton: torch.nn.Module, config: Any) -> dict[str, Any]:
        """``state`` as ``save_pretrained`` takes it: without non-persistent buffers (rotary ``inv_freq``)."""
        keys = set(skeleton.state_dict())
        return {k: v for k, v in state.items() if k in keys}

    def summary(self, config: Any, aux_losses: list[float]) -> dict[str, Any] | None:
        return None


@dataclass(frozen=True)
class MixtureOfExperts:
    """A Mixtral-shaped model with DeepSpeed's MoE layer (nlp/moe.py): a load-balancing loss weighted by
    ``aux_loss_coef``, ``top_k`` expert MLPs per token, experts split over ``expert_parallel`` ranks."""

    aux_loss_coef: float
    expert_parallel: int
    drop_tokens: bool = False
    min_capacity: int = 4
    moe = True

    def config(self, size: str, vocab_size: int | None, tokenizer: Any, seq_len: int, **shape: int) -> MixtralConfig:
        return build_moe_config(size, vocab_size=vocab_size, tokenizer=tokenizer, seq_len=seq_len, **shape)

    def build(self, config: Any, attention: str, seed: int, expert_rank: int = 0) -> torch.nn.Module:
        """This rank's experts (``expert_rank`` of ``expert_parallel``), each seeded by its global index."""
        return build_moe_model(
            config, self.expert_parallel, expert_rank, seed, attention, self.drop_tokens, self.min_capacity
        )

    def loss(self, lm_loss: torch.Tensor, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(LM loss + ``aux_loss_coef`` x the routers' load-balancing loss summed over layers, that loss)."""
        aux = aux_loss(module)
        return (lm_loss if aux is None else lm_loss + self.aux_loss_coef * aux), aux

    def flops_per_token(self, config: Any, seq_len: int) -> float:
        """Training FLOPs per token with ``top_k`` expert MLPs and the router (:func:`nlp.moe.moe_flops_per_token`)."""
        return moe_flops_per_token(config, seq_len)

    def param_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The experts in groups of their own: DeepSpeed's ZeRO 1/2 reduces them over the expert data-parallel ranks."""
        return split_moe_param_groups(groups)

    def gather_state_dict(self, model: torch.nn.Module, rank: int, gather: Gather) -> dict[str, Any] | None:
        """Every expert from its expert-parallel rank (collective); ZeRO 1/2 keeps the dense weights whole."""
        return gather_moe_state_dict(model, self.expert_parallel, rank)

    def export_state_dict(self, state: dict[str, Any], skeleton: torch.nn.Module, config: Any) -> dict[str, Any]:
        """The gathered weights under transformers' Mixtral names (``AutoModelForCausalLM`` loads the export)."""
        return to_mixtral_state_dict(state, config)

    def summary(self, config: Any, aux_losses: list[float]) -> dict[str, Any]:
        """``summary.json``'s ``moe``: the routing setup and the last logged load-balancing loss."""
        return {
            "num_experts": config.num_local_experts,
            "top_k": config.num_experts_per_tok,
            "expert_parallel": self.expert_parallel,
            "aux_loss_coef": self.aux_loss_coef,
            "aux_loss": aux_losses[-1] if aux_losses else None,
            "drop_tokens": self.drop_tokens,
            "min_capacity": self.min_capacity,
        }


ModelFamily = DenseLlama | MixtureOfExperts


def model_family(
    model: str, aux_loss_coef: float = 0.0, expert_parallel: int = 1, drop_tokens: bool = False, min_capacity: int = 4
) -> ModelFamily:
    """The family of a named size (:data:`MODEL_SIZES`); a local model folder trains as it is, a dense model."""
    if model in MOE_SIZES:
        return MixtureOfExperts(aux_loss_coef, expert_parallel, drop_tokens, min_capacity)
    return DenseLlama()
