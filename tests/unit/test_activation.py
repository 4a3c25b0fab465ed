"""Activation-checkpointing presets: which modules each wraps, and that gradients are unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from common.activation import AC_PRESETS, apply_activation_checkpointing, find_blocks, select_modules
from common.errors import ConfigError


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(16, 16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    def forward(self, x, scale=1.0):
        return x + scale * self.mlp(torch.tanh(self.attn(x)))


class Net(torch.nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x, scale=0.5)
        return x.sum()


def test_selection_per_preset():
    blocks = find_blocks(Net(6))
    assert len(blocks) == 6
    assert select_modules(blocks, "none") == []
    assert len(select_modules(blocks, "full")) == 6
    assert [n for n, _ in select_modules(blocks, "every_k", every_k=2)] == ["blocks.1", "blocks.3", "blocks.5"]
    assert [n for n, _ in select_modules(blocks, "every_k", every_k=3)] == ["blocks.2", "blocks.5"]
    assert len(select_modules(blocks, "save_memory_optimized")) == 5
    selective = select_modules(blocks, "selective")
    assert all(isinstance(m, torch.nn.Linear) for _, m in selective) and len(selective) == 6


def test_unknown_preset_names_nearest():
    with pytest.raises(ConfigError, match="did you mean 'full'"):
        apply_activation_checkpointing(Net(), "ful")


@pytest.mark.parametrize("preset", list(AC_PRESETS))
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradients_unchanged(preset, use_reentrant):
    torch.manual_seed(0)
    reference = Net()
    checkpointed = copy.deepcopy(reference)
    apply_activation_checkpointing(checkpointed, preset, every_k=2, use_reentrant=use_reentrant)
    x = torch.randn(3, 16, requires_grad=True)
    reference(x).backward()
    expected = [p.grad.clone() for p in reference.parameters()]
    x.grad = None
    checkpointed(x).backward()
    for got, want in zip((p.grad for p in checkpointed.parameters()), expected):
        torch.testing.assert_close(got, want)


def test_recompute_really_happens():
    calls = {"n": 0}
    net = Net(2)
    net.blocks[0].mlp.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    apply_activation_checkpointing(net, "full")
    net(torch.randn(2, 16, requires_grad=True)).backward()
    assert calls["n"] == 2  # forward + recompute in backward


def tiny_llama(frozen: bool) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if frozen:
        model.requires_grad_(False)
        for block in model.model.layers:
            block.self_attn.q_proj.weight.requires_grad_(True)  # stands in for LoRA adapters
    return model


@pytest.mark.parametrize("preset", ["full", "selective", "save_memory_optimized", "every_k"])
def test_transformers_model_by_block_class(preset):
    model = tiny_llama(frozen=False)
    report = apply_activation_checkpointing(model, preset)  # blocks from model._no_split_modules
    assert report.num_blocks == 3 and report.wrapped
    model.train()
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_frozen_embeddings_still_train_inner_weights():
    """Reentrant checkpointing with frozen embeddings: inputs are made to require grad (LoRA case)."""
    reference, checkpointed = tiny_llama(frozen=True), tiny_llama(frozen=True)
    apply_activation_checkpointing(checkpointed, "full")
    ids = torch.randint(0, 64, (2, 8))
    for model in (reference, checkpointed):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
    for a, b in zip(reference.model.layers, checkpointed.model.layers):
        assert b.self_attn.q_proj.weight.grad is not None
        torch.testing.assert_close(a.self_attn.q_proj.weight.grad, b.self_attn.q_proj.weight.grad)


def test_checkpoint_offload_marks_every_layer_input_and_keeps_the_gradients():
    # DeepSpeed's offload (common.activation.checkpoint_offload) acts on the inputs of transformers' checkpointed
    # layers only: every one must be marked, once per micro-batch. On this CPU it moves none of them (a device that
    # is host memory has nothing to offload), so the gradients must be the plain model's.
    from common.activation import checkpoint_offload, enable_offloadable_checkpointing, offload_text
    from nlp.model import build_llama_config, build_model_from_config

    torch.manual_seed(0)
    plain = build_model_from_config(build_llama_config("tiny", vocab_size=512), attn_implementation="sdpa")
    checkpointed = copy.deepcopy(plain)
    enable_offloadable_checkpointing(checkpointed)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    offload = checkpoint_offload()
    for _ in range(2):  # entered again for the next micro-batch
        checkpointed.zero_grad()
        with offload:
            checkpointed(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        assert offload.stats.marked_tensors == plain.config.num_hidden_layers
    plain(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert "4 layer inputs marked per micro-batch, 0 moved to host" in offload_text(offload.stats)
    with pytest.raises(ConfigError, match="has none"):
        enable_offloadable_checkpointing(Net())
