"""Activations: what a transformer's forward pass saves for the backward pass, per rank, under activation
checkpointing, tensor, sequence and pipeline parallelism."""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.errors import ConfigError
from common.memory_formulas.model_facts import ModelFacts
from common.memory_formulas.model_states import WORKING_BYTES

# Attention implementations (transformers' names) and what the activation count does with them. "auto"
# resolves to FlashAttention-2 or SDPA (nlp.model.resolve_attention): both save the same tensors.
ATTENTIONS = ("sdpa", "flash_attention_2", "eager", "auto")


FP32 = 4  # bytes: RMSNorm's upcast, the log-sum-exp, the softmax and the loss's log-probabilities
INDEX_BYTES = 8  # int64 token ids


def kv_heads_per_rank(facts: ModelFacts, sequence_parallel: int = 1, tensor_parallel: int = 1) -> float:
    """Key/value heads one rank attends with: KV / TP, split over SP ranks, or 1 replicated head when SP > KV / TP."""
    kv = (facts.num_kv_heads or facts.num_heads or 1) / tensor_parallel
    return kv if sequence_parallel == 1 else max(kv / sequence_parallel, 1.0)


@dataclass(frozen=True)
class ActivationParts:
    """Bytes autograd saves for backward, per piece of a transformer (one micro batch, one rank).

    Attributes:
        layer: one block without recomputation.
        attention: the part of ``layer`` saved inside the attention module (what ``selective`` drops).
        block_input: what a checkpointed block keeps: its input hidden states.
        head: the final norm, the float32 log-probabilities of the loss and the token ids.
        rope: the rotary cos/sin tables, shared by every block (saved once, inside attention).
        mask: eager attention's (b, 1, s, s) causal mask, saved once when a checkpoint receives it.
        after_attention: the part of ``layer`` saved after attention (second norm, MLP): the backward pass
            frees it before it recomputes that block's attention (``selective``).
        input_reused: the part of ``layer`` that is the block input itself (fp32: RMSNorm's upcast is a
            no-op), already held by the checkpoint when the block is recomputed.
    """

    layer: float
    attention: float
    block_input: float
    head: float
    rope: float = 0.0
    mask: float = 0.0
    after_attention: float = 0.0
    input_reused: float = 0.0


def activation_parts(
    facts: ModelFacts,
    seq_len: int,
    micro_batch_size: int,
    precision: str = "bf16",
    attention: str = "sdpa",
    tensor_parallel: int = 1,
    sequence_parallel: int = 1,
) -> ActivationParts | None:
    """The saved-for-backward bytes of a transformer's pieces, or None if the facts are not a transformer's.

    ``block == "llama"`` counts transformers' Llama code op by op (P = working bytes, s b tokens):
    each RMSNorm keeps its float32 input (4 h), the normalised 16-bit copy and its output (2 x P h) and a
    float32 reciprocal norm (4) per token; SDPA/FlashAttention keep q and the output (P h each), k and v
    (P h_kv each, grouped-query heads not repeated) and a float32 log-sum-exp (4 a); eager keeps q, k, v
    repeated to every head and the output copy (4 x P h) and the softmax over a s x s scores in float32
    plus its P-byte copy (4 + P per score; 4 in fp32, where the copy is the same tensor); the gated MLP
    keeps gate, up, activation and product (4 x P i). Rotary embedding multiplies by constant tables,
    which autograd saves once for all blocks. Other transformers: Korthikanti et al. 2022, eq. 1,
    ``s*b*h*(34 + 5*a*s/h)`` in 16-bit, with the score term only for eager (a float32 log-sum-exp else).

    ``tensor_parallel`` t > 1 (Megatron-style, without sequence parallelism): each rank keeps 1/t of what lives
    per head or per MLP column and all of what lives per token of width h (the norms, the block input). For other
    transformers that is Korthikanti et al.'s eq. 2, ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``: of the 34, the norms'
    inputs (4), the attention and MLP inputs (2 + 2) and the two dropout masks (1 + 1) stay whole. The output
    layer is vocabulary-parallel (Megatron; AutoTP's ``vocab_parallel_lm_head``): its logits are split by t too.
    A model of that split, not checked against autograd (one rank of a TP group is not run here).

    ``sequence_parallel`` N > 1 is DeepSpeed's Ulysses (``UlyssesSPAttentionHF``, sdpa or FlashAttention): each rank
    holds seq_len / N tokens of every per-token tensor (the norms, the MLP, the block input, the output layer and
    loss, the token ids, the rotary tables of its positions). Inside attention an all-to-all gives each rank the
    whole sequence for heads / N query heads and KV / N key/value heads (one replicated head when N > KV), so q,
    the output and the log-sum-exp are 1/N of a rank's share without SP; k and v are P s b d x max(KV / N, 1). The
    all-to-all itself saves nothing for backward (its backward is another all-to-all), but its output comes back in
    a fresh tensor, so the output projection's input is a copy of its own (P h per local token) where without SP it
    shares the attention output's storage. Measured against autograd on 2 gloo ranks by
    tests/unit/test_sequence_parallel_activations.py.
    """
    if facts.architecture != "transformer" or not (facts.hidden_size and facts.num_layers and facts.num_heads):
        return None
    if attention not in ATTENTIONS:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    eager = attention == "eager"
    n = sequence_parallel  # a size Ulysses can run: common.parallel.check_layout refuses the others first
    p = WORKING_BYTES[precision]
    # Per rank: seq_len / N tokens of every per-token tensor (N = 1: the whole sequence).
    b, s = micro_batch_size, seq_len / n
    tokens = s * b
    h, a = facts.hidden_size, facts.num_heads
    vocab = facts.vocab_size or 0
    t = tensor_parallel
    scores = a * s * tokens  # a x s x s per sample (eager: N = 1)
    lse = FP32 * a * tokens  # N > 1: a / N heads over N s tokens, the same bytes
    ids = 2 * INDEX_BYTES * tokens  # input ids (embedding) and shifted labels (loss)
    if facts.block != "llama":
        scale = p / 2  # the paper's counts are 16-bit
        # Attention's 11 s b h: QKV input and output dropout mask (3, whole); q, k, v, projection input (8 / t).
        attention_part = (5 * scores if eager else lse) * scale / t + (3 + 8 / t) * tokens * h * scale
        layer = (10 + 24 / t) * tokens * h * scale + (5 * scores * scale if eager else lse) / t
        head = FP32 * tokens * vocab / t + 2 * tokens * h * scale + ids
        # After attention: second norm (2) + MLP input and dropout mask (3) + the two 4h-wide tensors (16 / t).
        after = (5 + 16 / t) * tokens * h * scale
        return ActivationParts(layer, attention_part, p * tokens * h, head, after_attention=after)
    head_dim = facts.head_dim or h // a
    inter = facts.intermediate_size or int(8 * h / 3)
    norm = (FP32 + 2 * p) * tokens * h + FP32 * tokens
    # Everything attention and the MLP save lives per head or per MLP column: tensor parallelism splits it all.
    if eager:
        softmax = FP32 + (p if p != FP32 else 0)
        attention_part = (4 * p * tokens * h + softmax * scores) / t
    else:
        # k and v: the rank's KV heads over the whole sequence (N s tokens); N > 1 adds o_proj's own input copy.
        kv = 2 * p * (n * tokens) * head_dim * kv_heads_per_rank(facts, n, t)
        ulysses_copy = p * tokens * h / t if n > 1 else 0.0
        attention_part = (2 * p * tokens * h + lse) / t + kv + ulysses_copy
    mlp = 4 * p * tokens * inter / t
    head = norm + FP32 * tokens * vocab / t + ids
    rope = 2 * p * s * head_dim
    mask = p * b * s * s if eager else 0.0
    block_input = p * tokens * h
    return ActivationParts(
        layer=2 * norm + attention_part + mlp,
        attention=attention_part,
        block_input=block_input,
        head=head,
        rope=rope,
        mask=mask,
        after_attention=norm + mlp,
        input_reused=block_input if p == FP32 else 0.0,
    )


def checkpointed_blocks(checkpointing: str, num_layers: int) -> list[bool]:
    """Which of ``num_layers`` blocks a block-level preset recomputes, by common.activation's own selection."""
    from common.activation import select_modules

    blocks = [(str(i), None) for i in range(num_layers)]
    chosen = {name for name, _ in select_modules(blocks, checkpointing)}  # type: ignore[arg-type]
    return [name in chosen for name, _ in blocks]


def _saved_after_forward(parts: ActivationParts, num_layers: int, checkpointing: str) -> float:
    """Bytes one micro-batch keeps saved through ``num_layers`` blocks between its forward and backward passes,
    the output layer's (``head``) excluded."""
    if checkpointing == "selective":
        return num_layers * (parts.layer - parts.attention) + parts.mask
    wrapped = checkpointed_blocks(checkpointing, num_layers)
    kept = [parts.block_input if w else parts.layer for w in wrapped]
    shared = (parts.rope if not all(wrapped) else 0.0) + (parts.mask if any(wrapped) else 0.0)
    return sum(kept) + shared


def transformer_activations(
    facts: ModelFacts,
    seq_len: int,
    micro_batch_size: int,
    checkpointing: str = "none",
    precision: str = "bf16",
    attention: str = "sdpa",
    tensor_parallel: int = 1,
    with_head: bool = True,
    sequence_parallel: int = 1,
) -> float | None:
    """Peak bytes saved for backward per rank, or None if not a transformer.

    Without recomputation every block keeps :func:`activation_parts`' ``layer``. A checkpointed block
    keeps its input, and during the backward pass the last checkpointed block is recomputed whole while
    everything saved before it is still alive: the peak is the larger of the end of the forward pass
    (with the loss's log-probabilities) and that moment (the loss's saved tensors are freed by then).
    ``selective`` recomputes only attention. Which blocks a preset wraps comes from common.activation.
    ``tensor_parallel`` splits each block's tensors (:func:`activation_parts`); ``with_head=False`` leaves out the
    output layer and loss (a pipeline stage other than the last). ``sequence_parallel`` N > 1 is Ulysses: the same
    peaks on the rank's seq_len / N tokens (:func:`activation_parts`); ``seq_len`` is the whole sequence.
    """
    from common.activation import check_preset

    check_preset(checkpointing)
    parts = activation_parts(facts, seq_len, micro_batch_size, precision, attention, tensor_parallel, sequence_parallel)
    if parts is None:
        return None
    if not with_head:
        parts = replace(parts, head=0.0)
    n_layers = facts.num_layers or 0
    # The embedding's ids (the rank's slice), alive until the very end.
    token_ids = INDEX_BYTES * seq_len * micro_batch_size / sequence_parallel
    if checkpointing == "selective":
        kept = _saved_after_forward(parts, n_layers, checkpointing)
        # The last block's attention is recomputed once its MLP and second norm have been freed.
        during_backward = kept - parts.after_attention + parts.attention + parts.rope + token_ids
        return float(max(kept + parts.head, during_backward))
    wrapped = checkpointed_blocks(checkpointing, n_layers)
    kept = [parts.block_input if w else parts.layer for w in wrapped]
    end_of_forward = _saved_after_forward(parts, n_layers, checkpointing) + parts.head
    if not any(wrapped):
        return float(end_of_forward)
    last = max(i for i, w in enumerate(wrapped) if w)
    recomputed = parts.layer - parts.input_reused
    during_backward = sum(kept[: last + 1]) + recomputed + parts.rope + parts.mask + token_ids
    return float(max(end_of_forward, during_backward))


def pipeline_activations(
    facts: ModelFacts,
    seq_len: int,
    micro_batch_size: int,
    checkpointing: str = "none",
    precision: str = "bf16",
    attention: str = "sdpa",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    sequence_parallel: int = 1,
) -> float | None:
    """Peak bytes saved for backward on the busiest pipeline stage, or None if not a transformer.

    Under the 1F1B schedule (DeepSpeed's ``TrainSchedule``, Megatron's default) stage i runs up to PP - i forward
    passes before its first backward pass, so the first stage holds PP micro-batches in flight through its L / PP
    blocks: PP - 1 waiting for their backward pass (each keeping what its forward pass saved) and one at its
    backward peak. Without recomputation that adds up to L blocks of one micro-batch whatever PP: Korthikanti et al.
    2022 (arXiv:2205.05198), section 4.2.3 ("the first stage must store activations for p microbatches ... L/p
    layers each"). The last stage holds one micro-batch and the output layer; the answer is the larger of the two.
    It assumes at least PP micro-batches a step (gradient accumulation >= PP; fewer leave the pipeline idle).
    One stage is :func:`transformer_activations` (``sequence_parallel``: Ulysses, the rank's slice of the sequence).
    """
    sp = sequence_parallel
    if pipeline_parallel == 1:
        return transformer_activations(
            facts, seq_len, micro_batch_size, checkpointing, precision, attention, tensor_parallel, sequence_parallel=sp
        )
    stage = replace(facts, num_layers=(facts.num_layers or 0) // pipeline_parallel)
    run = (seq_len, micro_batch_size, checkpointing, precision, attention, tensor_parallel)
    last = transformer_activations(stage, *run, sequence_parallel=sp)
    parts = activation_parts(stage, seq_len, micro_batch_size, precision, attention, tensor_parallel, sp)
    if last is None or parts is None:
        return None
    in_backward = transformer_activations(stage, *run, with_head=False, sequence_parallel=sp) or 0.0
    waiting = _saved_after_forward(parts, stage.num_layers or 0, checkpointing)
    return float(max(last, (pipeline_parallel - 1) * waiting + in_backward))
