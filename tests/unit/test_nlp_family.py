"""The NLP recipe's model families (nlp/family.py): the loops call the same methods for a dense and a MoE model.

The MoE FLOPs are checked against a count by hand: every matmul one token goes through, its router and ``top_k``
expert MLPs included, times 6 (forward 2, backward 4), plus the attention scores (PaLM's 12 L H Q T).
"""

from __future__ import annotations

import pytest
import torch

from nlp.family import DenseLlama, MixtureOfExperts, model_family, shape_overrides
from nlp.model import build_llama_config, flops_per_token
from nlp.moe import build_moe_config

V, T = 64, 32  # vocabulary and sequence length of the hand counts


def moe_flops_by_hand(top_k: int) -> float:
    """moe_tiny: hidden 128, 2 layers, 4 heads of 32 (4 key/value heads), MLP width 256, 4 experts."""
    h, layers, heads, head_dim, inter, experts = 128, 2, 4, 32, 256, 4
    attention = 4 * h * h  # q, k, v, o (4 key/value heads: k and v are h wide)
    mlps = top_k * 3 * h * inter  # gate, up, down of each of the top_k experts the token is routed to
    router = h * experts  # the gate's logits over the experts
    norms = 2 * h
    matmul_params = layers * (attention + mlps + router + norms) + h + V * h  # + final norm, output layer
    return 6.0 * matmul_params + 12 * layers * heads * head_dim * T


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moe_flops_count_top_k_expert_mlps_per_token(top_k):
    config = build_moe_config("moe_tiny", vocab_size=V, num_experts_per_tok=top_k)
    family = model_family("moe_tiny", aux_loss_coef=0.01, expert_parallel=1)
    assert isinstance(family, MixtureOfExperts)
    assert family.flops_per_token(config, T) == moe_flops_by_hand(top_k)
    # The dense formula on the same config counts one MLP and no router: an undercount as soon as top_k > 1.
    assert flops_per_token(config, T) < family.flops_per_token(config, T)


def test_the_dense_family_is_the_llama_formula_and_adds_nothing():
    family = model_family("tiny")
    assert isinstance(family, DenseLlama) and model_family("/some/folder") == family
    config = build_llama_config("tiny", vocab_size=V)
    assert family.flops_per_token(config, T) == flops_per_token(config, T)
    loss = torch.tensor(2.5)
    assert family.loss(loss, torch.nn.Linear(2, 2)) == (loss, None)
    groups = [{"params": [], "weight_decay": 0.1}]
    assert family.param_groups(groups) is groups and family.summary(config, [1.0]) is None


def test_width_and_depth_are_overrides_on_top_of_a_size():
    fields = shape_overrides("tiny", hidden_size=512, num_layers=2, num_heads=8, intermediate_size=0)
    assert fields == {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8}
    config = DenseLlama().config("tiny", V, None, 64, **fields)
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (512, 2, 8)
    assert build_llama_config("tiny").hidden_size == 256  # the named size itself is untouched
    # A grouped-query size keeps its key/value heads when the query heads change.
    assert shape_overrides("1b", num_heads=16) == {"num_attention_heads": 16}
    moe = MixtureOfExperts(0.01, 1).config("moe_tiny", V, None, 64, num_hidden_layers=3)
    assert moe.num_hidden_layers == 3 and moe.num_local_experts == 4
