"""nlp/lora.py: target names checked with the nearest valid name, adapters read back and refused when incomplete."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nlp.lora import adapter_key, check_adapter, check_target_modules, linear_module_names, lora_config, save_adapter
from nlp.model import ModelError


@pytest.fixture
def tiny_llama():  # function scope: peft wraps the model in place
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def test_linear_module_names_are_the_llama_projections(tiny_llama):
    assert linear_module_names(tiny_llama) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


def test_unknown_target_names_the_nearest_valid_one(tiny_llama):
    names = linear_module_names(tiny_llama)
    with pytest.raises(ModelError, match=r"'q_prj' \(did you mean 'q_proj'\?\).*'attention_out' \(no close match\)"):
        check_target_modules(["q_prj", "v_proj", "attention_out"], names)
    with pytest.raises(ModelError, match="lora_targets is empty"):
        check_target_modules([], names)
    assert check_target_modules(["v_proj"], names) == ["v_proj"]


def _adapter(model, tmp_path, targets=("q_proj", "v_proj")):
    from peft import get_peft_model

    peft_model = get_peft_model(model, lora_config(list(targets), linear_module_names(model), 4, 8.0, 0.0))
    shapes = {n: tuple(p.shape) for n, p in peft_model.named_parameters() if p.requires_grad}
    return peft_model, shapes


def test_a_trained_adapter_passes_and_is_counted(tiny_llama, tmp_path):
    peft_model, shapes = _adapter(tiny_llama, tmp_path)
    state = {n: torch.randn_like(p) if p.requires_grad else p.detach() for n, p in peft_model.named_parameters()}
    info = check_adapter(save_adapter(peft_model, state, tmp_path / "adapter"), shapes)
    assert info["tensors"] == info["trainable_tensors"] == len(shapes) == 4  # A and B for q_proj and v_proj
    assert info["elements"] == sum(torch.Size(s).numel() for s in shapes.values())
    assert info["min_norm"] > 0
    assert all(adapter_key(n) != n and ".default." not in adapter_key(n) for n in shapes)


def test_empty_shards_and_untrained_adapters_are_refused(tiny_llama, tmp_path):
    peft_model, shapes = _adapter(tiny_llama, tmp_path)
    params = dict(peft_model.named_parameters())
    # What a save without gathering writes under ZeRO-3: empty tensors where the partitions were.
    sharded = {n: torch.empty(0) if p.requires_grad else p.detach() for n, p in params.items()}
    with pytest.raises(ModelError, match=r"adapter is incomplete: .*lora_A.weight: shape \[0\], expected \[4, 16\]"):
        check_adapter(save_adapter(peft_model, sharded, tmp_path / "sharded"), shapes)
    # peft's own init: lora_B is zero, so the adapter changes nothing.
    fresh = {n: p.detach() for n, p in params.items()}
    with pytest.raises(ModelError, match=r"lora_B.weight: norm 0.0"):
        check_adapter(save_adapter(peft_model, fresh, tmp_path / "fresh"), shapes)
    # The trained model had more adapted layers than the file holds.
    more = dict(shapes, **{"base_model.model.model.layers.0.self_attn.k_proj.lora_A.default.weight": (4, 16)})
    trained = {n: torch.randn_like(p) if p.requires_grad else p.detach() for n, p in params.items()}
    with pytest.raises(ModelError, match=r"k_proj.lora_A.weight: missing"):
        check_adapter(save_adapter(peft_model, trained, tmp_path / "short"), more)


def test_a_folder_without_an_adapter_is_refused(tmp_path):
    with pytest.raises(ModelError, match="not a peft adapter folder"):
        check_adapter(tmp_path, {})
