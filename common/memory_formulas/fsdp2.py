"""FSDP2's bytes per rank under the project's FSDP2 presets (``torch.distributed.fsdp.fully_shard``, common.fsdp2).

The presets shard each transformer block as a unit of its own, then the root (embeddings, final norm, output
layer), with the precision contract of docs/presets.md: fp32 parameters (the master weights) sharded, compute in
the run's precision (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` under bf16), gradients
reduce-scattered in fp32. For K parameters on N ranks, with W working bytes per element (2 under bf16, 4 under fp32):

- **sharded states**: 4 B fp32 parameters + 4 B fp32 gradients + 8 B Adam moments = 16K/N at any precision (no
  separate master copy: the fp32 shard is the master). ZeRO-3 holds 2 + 2 + 12 = 16K/N under bf16 too.
- **gathered weights held from forward to backward** (W bytes each): ``fsdp2`` frees a block's gathered weights
  after its forward and gathers them again for its backward, but keeps the root's (its backward starts at once);
  ``fsdp2_grad_op`` (``reshard_after_forward=False``) keeps every unit's, W x K at the peak between forward and
  backward: ZeRO-2's whole working copy (2K) is its counterpart.
- **buffers** (transient, an upper bound): the all-gather output of the block being computed and of the next one
  (prefetched) under ``fsdp2``; the reduce-scatter of the largest unit's gradient, unsharded, in the compute dtype
  and, when it differs, its fp32 copy (``reduce_dtype``).

Measured on 2 gloo ranks by tests/unit/test_fsdp2_memory.py (common.accounting counts what each rank holds).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.memory_formulas.model_facts import ModelFacts
from common.memory_formulas.model_states import WORKING_BYTES

# Sharded bytes per parameter under the FSDP2 presets: fp32 parameters (the master weights), fp32 gradients
# (reduce_dtype), Adam's two fp32 moments.
FSDP2_SHARDED_BYTES = {"params": 4, "grads": 4, "optimizer": 8}
REDUCE_BYTES = 4  # gradients are reduce-scattered in fp32 whatever the compute precision


@dataclass(frozen=True)
class Fsdp2Units:
    """How fully_shard cuts a model: ``blocks`` units of ``block_params`` each, and the root's own parameters."""

    blocks: int
    block_params: int
    root_params: int


@dataclass(frozen=True)
class Fsdp2Memory:
    """Per-rank bytes of one FSDP2 preset (see the module docstring for each term).

    Attributes:
        sharded: the rank's shards of parameters, gradients and optimizer state (gradients alive).
        gathered: working copies of weights held from a unit's forward to its backward.
        model_states: ``sharded + gathered``, the peak between forward and backward (the ZeRO rows' column).
        model_states_after_step: the shards after ``optimizer.step()`` and ``zero_grad()``: parameters and
            optimizer state, no gradients, nothing gathered.
        buffers: transient all-gather and reduce-scatter buffers, an upper bound.
    """

    sharded: float
    gathered: float
    model_states: float
    model_states_after_step: float
    buffers: float


def llama_block_params(facts: ModelFacts) -> int | None:
    """Parameters of one Llama-like block (attention with grouped-query k/v, gated MLP, two norms); None without
    the model's shape."""
    if not (facts.hidden_size and facts.num_layers and facts.num_heads):
        return None
    h = facts.hidden_size
    head_dim = facts.head_dim or h // facts.num_heads
    kv = (facts.num_kv_heads or facts.num_heads) * head_dim
    inter = facts.intermediate_size or int(8 * h / 3)
    return 2 * h * facts.num_heads * head_dim + 2 * h * kv + 3 * h * inter + 2 * h


def fsdp2_units(facts: ModelFacts) -> Fsdp2Units:
    """The units of a transformer (its blocks, counted as Llama's, the rest in the root); without the shape, one
    unit: the root. The root holds at least the token embedding: a shape that only approximates the parameter count
    (``--params``) gives the blocks what the embedding leaves."""
    block = llama_block_params(facts)
    if block is None:
        return Fsdp2Units(blocks=0, block_params=0, root_params=facts.num_params)
    layers, embedding = facts.num_layers, (facts.vocab_size or 0) * facts.hidden_size
    root = facts.num_params - layers * block
    if root < embedding:
        root = min(embedding, facts.num_params)
        block = (facts.num_params - root) // layers
    return Fsdp2Units(layers, block, facts.num_params - layers * block)


def fsdp2_memory(facts: ModelFacts, ranks: int, precision: str, reshard_after_forward: bool) -> Fsdp2Memory:
    """Per-rank bytes of ``fsdp2`` (``reshard_after_forward=True``) or ``fsdp2_grad_op`` (False) on ``ranks``.

    Args:
        facts: the model.
        ranks: the data-parallel ranks the states are sharded over.
        precision: ``bf16``, ``fp16`` or ``fp32``: the working copy's bytes per element.
        reshard_after_forward: the preset's setting for the blocks (the root keeps its weights either way).

    Returns:
        The terms of :class:`Fsdp2Memory`.
    """
    working = WORKING_BYTES[precision]
    units = fsdp2_units(facts)
    k = facts.num_params
    sharded = sum(FSDP2_SHARDED_BYTES.values()) * k / ranks
    held = units.root_params if reshard_after_forward else k
    gathered = working * held
    largest_unit = max(units.block_params, units.root_params)
    reduce_scatter = (REDUCE_BYTES + (working if working != REDUCE_BYTES else 0)) * largest_unit
    all_gather = 2 * working * units.block_params if reshard_after_forward else 0
    after_step = (FSDP2_SHARDED_BYTES["params"] + FSDP2_SHARDED_BYTES["optimizer"]) * k / ranks
    return Fsdp2Memory(sharded, gathered, sharded + gathered, after_step, all_gather + reduce_scatter)
