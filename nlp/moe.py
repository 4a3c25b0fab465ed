"""Mixture-of-Experts Llama for the NLP recipe: a Mixtral-shaped model whose MoE blocks are DeepSpeed's ``MoE`` layer.

The model is ``MixtralForCausalLM`` (attention, norms, embeddings as transformers builds them) with every decoder
layer's ``mlp`` replaced by :class:`DeepSpeedMoEBlock`, which wraps ``deepspeed.moe.layer.MoE``: a top-k router
(``TopKGate``) and this rank's share of the experts (``num_experts / expert_parallel``); tokens travel to their
experts' ranks by an all-to-all in each MoE layer. DeepSpeed's MoE layer, not transformers' Mixtral block, because
expert parallelism (the all-to-all, the expert groups ZeRO reduces over) lives there; AutoEP, which would convert
Mixtral's own block, does not run with the installed transformers (docs/moe.md).

The routing is made deterministic so that expert parallelism changes no arithmetic: no random token selection
(``use_rts=False``), no sampled second expert (``top2_2nd_expert_sampling=False``), and every expert initialised
from its global index, whichever rank holds it. By default no token is dropped (``drop_tokens=False``: every expert
takes all the tokens routed to it); the recipe's ``moe_drop_tokens`` gives every expert a slot of DeepSpeed's fixed
capacity (ceil(tokens / experts x k x capacity_factor), at least ``moe_min_capacity``) and drops the tokens beyond
it, which fixes the all-to-all's size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import MixtralConfig

from nlp.model import flops_per_token, special_token_ids

# Named MoE sizes as MixtralConfig keyword arguments (a run's tokenizer overrides vocab_size).
MOE_SIZES: dict[str, dict[str, Any]] = {
    # About 2.2M parameters with vocab 4096 (4 experts of 0.1M per layer): equivalence tests on a CPU.
    "moe_tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 256,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 4096,
        "max_position_embeddings": 256,
    },
    # Mixtral-8x7B's shape (46.7B parameters, 45.1B of them experts): for the planner and launch commands.
    "mixtral_8x7b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rope_theta": 1e6,
    },
}


def build_moe_config(
    size: str, vocab_size: int | None = None, tokenizer: Any = None, seq_len: int | None = None, **overrides: Any
) -> MixtralConfig:
    """The MixtralConfig of a named MoE size, its vocabulary the tokenizer's when one is given; ``overrides``
    (MixtralConfig fields: a width or depth) are applied on top of the size's own."""
    kwargs = {**MOE_SIZES[size], **overrides}
    if tokenizer is not None:
        kwargs["vocab_size"] = len(tokenizer)
        kwargs.update(special_token_ids(tokenizer))
    elif vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    if seq_len is not None:
        kwargs["max_position_embeddings"] = max(int(seq_len), kwargs["max_position_embeddings"])
    return MixtralConfig(tie_word_embeddings=False, **kwargs)


class GatedMLP(nn.Module):
    """One expert: Llama's (and Mixtral's) SwiGLU MLP, ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepSpeedMoEBlock(nn.Module):
    """A decoder layer's MLP as DeepSpeed MoE: output as the dense MLP's; the load-balancing loss kept in ``l_aux``."""

    def __init__(
        self, config: MixtralConfig, expert_parallel: int, drop_tokens: bool = False, min_capacity: int = 4
    ) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(
            hidden_size=config.hidden_size,
            expert=GatedMLP(config.hidden_size, config.intermediate_size),
            num_experts=config.num_local_experts,
            ep_size=expert_parallel,
            k=config.num_experts_per_tok,
            min_capacity=min_capacity,  # the smallest slot when tokens are dropped
            drop_tokens=drop_tokens,  # False: no capacity limit, no token dropped, whatever the expert-parallel size
            use_rts=False,  # random token selection would make the routing depend on the RNG
            top2_2nd_expert_sampling=False,  # Mixtral's top-2: the two largest gates, no sampled second expert
        )
        self.l_aux: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output, self.l_aux, _ = self.moe(hidden_states)
        return output


def moe_blocks(model: nn.Module) -> list[DeepSpeedMoEBlock]:
    return [m for m in model.modules() if isinstance(m, DeepSpeedMoEBlock)]


def build_moe_model(
    config: MixtralConfig,
    expert_parallel: int,
    ep_rank: int,
    seed: int,
    attention: str,
    drop_tokens: bool = False,
    min_capacity: int = 4,
) -> Any:
    """MixtralForCausalLM with DeepSpeed MoE blocks, this rank's experts (``ep_rank`` of ``expert_parallel``);
    ``drop_tokens`` and ``min_capacity`` are DeepSpeed MoE's (the recipe's ``moe_drop_tokens``, ``moe_min_capacity``).

    Dense weights come from ``torch.manual_seed(seed)`` as in the dense model; each MoE weight from a generator
    seeded by (seed, layer, global expert index), so expert ``g`` has the same weights on whichever rank holds it.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    local = config.num_local_experts // expert_parallel
    std = config.initializer_range
    for layer_index, layer in enumerate(model.model.layers):
        block = DeepSpeedMoEBlock(config, expert_parallel, drop_tokens, min_capacity)
        with torch.no_grad():
            router = torch.Generator().manual_seed(seed * 1_000_003 + layer_index * 1009 + 1007)
            block.moe.deepspeed_moe.gate.wg.weight.normal_(0.0, std, generator=router)
            for j, expert in enumerate(block.moe.deepspeed_moe.experts.deepspeed_experts):
                global_index = ep_rank * local + j
                gen = torch.Generator().manual_seed(seed * 1_000_003 + layer_index * 1009 + global_index)
                for param in expert.parameters():
                    param.normal_(0.0, std, generator=gen)
        layer.mlp = block
    return model


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum over MoE layers of the last forward's load-balancing loss (None for a dense model)."""
    losses = [block.l_aux for block in moe_blocks(model) if block.l_aux is not None]
    return torch.stack([loss.float() for loss in losses]).sum() if losses else None


def moe_flops_per_token(config: MixtralConfig, seq_len: int) -> float:
    """Training FLOPs per token of a MoE model: :func:`nlp.model.flops_per_token` (``6 N + 12 L H Q T``) with N the
    matmul parameters one token goes through: the router (``hidden x experts``) and ``top_k`` expert MLPs in every
    layer, where the dense formula counts one MLP (``3 x hidden x intermediate``, the size of one expert)."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    extra_per_layer = (config.num_experts_per_tok - 1) * 3 * hidden * inter + hidden * config.num_local_experts
    return flops_per_token(config, seq_len) + 6.0 * layers * extra_per_layer


def expert_numels(model: nn.Module) -> tuple[int, int]:
    """(dense, expert) parameter elements this rank holds (experts: DeepSpeed marks them ``allreduce=False``)."""
    dense = experts = 0
    for param in model.parameters():
        if getattr(param, "allreduce", True):
            dense += param.numel()
        else:
            experts += param.numel()
    return dense, experts


def split_moe_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer groups with expert parameters moved to groups of their own (``moe: True``, named by their
    expert group): DeepSpeed's ZeRO 1/2 reduces and partitions those over the expert data-parallel ranks."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [{**group, "name": f"group{i}"} for i, group in enumerate(groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)


def gather_moe_state_dict(model: nn.Module, expert_parallel: int, rank: int) -> dict[str, torch.Tensor] | None:
    """Rank 0: the whole MoE model's weights (every expert under its global index); None elsewhere. Collective.

    Under ZeRO 1/2 every rank holds whole parameters: the dense ones are the same everywhere, the experts are
    gathered from the ranks of rank 0's expert-parallel group (ranks 0 .. EP-1) and renumbered.
    """
    import torch.distributed as dist

    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    marker = ".deepspeed_experts."
    mine = {k: v for k, v in state.items() if marker in k}
    everyone: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    whole = {k: v for k, v in state.items() if marker not in k}
    for ep_rank in range(expert_parallel):
        for key, value in everyone[ep_rank].items():
            head, tail = key.split(marker)
            local, rest = tail.split(".", 1)
            num_local = len({k.split(marker)[1].split(".")[0] for k in everyone[ep_rank] if k.startswith(head)})
            whole[f"{head}{marker}{ep_rank * num_local + int(local)}.{rest}"] = value
    return whole


def to_mixtral_state_dict(state: dict[str, torch.Tensor], config: MixtralConfig) -> dict[str, torch.Tensor]:
    """The gathered DeepSpeed-MoE weights under transformers' Mixtral names (fused ``gate_up_proj``, ``down_proj``
    per layer, the router as ``mlp.gate.weight``), so that ``AutoModelForCausalLM`` loads the export."""
    out = {k: v for k, v in state.items() if ".mlp.moe." not in k}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp"
        experts = f"{prefix}.moe.deepspeed_moe.experts.deepspeed_experts"
        out[f"{prefix}.gate.weight"] = state[f"{prefix}.moe.deepspeed_moe.gate.wg.weight"]
        e = range(config.num_local_experts)
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{experts}.{g}.gate_proj.weight"], state[f"{experts}.{g}.up_proj.weight"]]) for g in e]
        )
        out[f"{prefix}.experts.down_proj"] = torch.stack([state[f"{experts}.{g}.down_proj.weight"] for g in e])
    return out
