"""The guides' memory formulas and the model facts they need: pure arithmetic, no DeepSpeed, no recipe.

The planner (``zero-recipes estimate``, :mod:`common.tools.memory`) builds its table from these, the linter's
rules (:mod:`common.lint`) check configs with them, and a recipe's ``--describe`` reports its model with
:func:`facts_from_model_config` / :func:`count_module`. See :mod:`common.tools.memory` for what each term is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.errors import ConfigError, nearest

# Bytes per element of the working (16/32-bit) copy of parameters and gradients.
WORKING_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Adam in DeepSpeed: fp32 master copy + exp_avg + exp_avg_sq = 12 bytes per parameter.
ADAM_STATE_BYTES = 12

GB = 1e9  # the guides' GB (112 GB = 7e9 x 16 B)
GIB = 2**30

# Share of device memory a plan may use; the rest is fragmentation and the runtime's context.
USABLE_FRACTION = 0.9

# DeepSpeed's default for stage3_max_live_parameters: gathered parameters kept whole while reused.
DS_MAX_LIVE_PARAMETERS = 1e9

# DeepSpeed's default for the estimators' "additional_buffer_factor".
DS_ADDITIONAL_BUFFER_FACTOR = 1.5

OFFLOADS = ("none", "optimizer", "params", "nvme")  # nvme: stage 3, parameters and optimizer on disk

# When only a parameter count is given, assume a Llama-like shape: hidden / layers = 128 (Llama-2 7B
# and 13B), head size 128, vocabulary 32000, MLP 8/3 x hidden.
ASSUMED_ASPECT = 128
ASSUMED_HEAD_DIM = 128
ASSUMED_VOCAB = 32000

# Attention implementations (transformers' names) and what the activation count does with them. "auto"
# resolves to FlashAttention-2 or SDPA (nlp.model.resolve_attention): both save the same tensors.
ATTENTIONS = ("sdpa", "flash_attention_2", "eager", "auto")
# Model types whose blocks are Llama's: RMSNorm computed in float32, rotary embeddings, gated (SwiGLU) MLP.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
FP32 = 4  # bytes: RMSNorm's upcast, the log-sum-exp, the softmax and the loss's log-probabilities
INDEX_BYTES = 8  # int64 token ids


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs to know about a model.

    Attributes:
        num_params: K, every parameter (shared ones once).
        largest_layer_params: the biggest module's own parameters (DeepSpeed's ``model_to_params``).
        architecture: ``transformer`` (activations estimated) or anything else (not estimated).
        hidden_size: h; also scales bucket sizes the way the presets do.
        num_layers: L.
        num_heads: a.
        vocab_size: V (output logits).
        intermediate_size: MLP width (LoRA adapter count, activations of a gated MLP).
        num_kv_heads: key/value heads (grouped-query attention); None = num_heads.
        head_dim: size of one head; None = hidden / heads.
        block: ``llama`` (RMSNorm, rotary, gated MLP: counted op by op) or ``gpt`` (Korthikanti's formula).
        param_numels: each parameter's element count (shared ones once), for the stage-3 persistence
            threshold; empty when unknown (no parameter is then counted as persistent).
        source: where the facts come from, in words (shown in the output).
        num_experts: routed experts per MoE layer (a Hugging Face config's ``num_local_experts`` / ``num_experts``);
            None for a dense model.
        expert_params: parameters of the routed experts, every layer and expert (in ``num_params``); 0 when dense.
        tensor_replicated_params: dense parameters tensor parallelism keeps whole on every tensor-parallel rank.
            DeepSpeed's AutoTP (the NLP recipe's ``tensor_parallel``) splits ``nn.Linear`` layers only, the output
            layer included; the token embedding, the norm weights and a MoE router stay whole (measured on the
            recipe's model at TP 2 by tests/recipes/test_nlp_tensor_parallel.py). 0 when unknown: every dense
            parameter is then counted as split.
    """

    num_params: int
    largest_layer_params: int | None = None
    architecture: str = "unknown"
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    intermediate_size: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    block: str = "gpt"
    param_numels: tuple[int, ...] = ()
    source: str = "--params"
    num_experts: int | None = None
    expert_params: int = 0
    tensor_replicated_params: int = 0


# --- parsing ------------------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")
_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str | float | int) -> float:
    """``"80GB"`` -> 8e10, ``"80GiB"`` -> 80 x 2^30, ``"141e9"`` -> 1.41e11; a plain number is bytes."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(f"cannot read {text!r} as a memory size; write e.g. 80GB, 24GiB or 8e10")
    number, unit, binary = float(match.group(1)), match.group(2).lower(), match.group(3)
    if binary and unit:
        return number * _BINARY_UNITS[unit]
    return number * _SIZE_UNITS[unit]


def parse_count(text: str | float | int) -> int:
    """``"7e9"``, ``"7B"``, ``"125M"``, ``"7000000000"`` -> an integer parameter count."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return int(text)
    raw = str(text).strip().replace("_", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(raw[-1:].lower())
    try:
        value = float(raw[:-1]) * scale if scale else float(raw)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a parameter count; write e.g. 7e9 or 7B") from None
    if value < 1:
        raise ConfigError(f"parameter count must be >= 1, got {text!r}")
    return int(value)


def fmt_gb(nbytes: float | None, digits: int = 2) -> str:
    """Bytes as the guides' GB (1e9), e.g. ``26.25 GB``; None as ``n/a``."""
    if nbytes is None:
        return "n/a"
    if nbytes == 0:
        return "0"
    if abs(nbytes) >= 1e9:
        return f"{nbytes / GB:.{digits}f} GB"
    if abs(nbytes) >= 1e6:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e3:.1f} kB"


# --- model facts --------------------------------------------------------------------------------------


def assumed_transformer(num_params: int) -> ModelFacts:
    """A Llama-like shape for a bare parameter count (12 L h^2 + V h params, h = 128 L), labelled as assumed."""
    # Solve 12 L h^2 + V h = K with h = 128 L for L (monotonic; bisection is plenty).
    lo, hi = 1.0, 1000.0
    for _ in range(100):
        mid = (lo + hi) / 2
        h = ASSUMED_ASPECT * mid
        if 12 * mid * h * h + ASSUMED_VOCAB * h > num_params:
            hi = mid
        else:
            lo = mid
    layers = max(1, round(lo))
    hidden = max(ASSUMED_HEAD_DIM, int(round(ASSUMED_ASPECT * lo / ASSUMED_HEAD_DIM)) * ASSUMED_HEAD_DIM)
    intermediate = int(8 * hidden / 3)
    # Two RMSNorm weights per layer and the final one are the parameters small enough to persist; the
    # matrices are lumped (each is far over any persistence threshold).
    norms = (hidden,) * (2 * layers + 1)
    return ModelFacts(
        num_params=int(num_params),
        largest_layer_params=ASSUMED_VOCAB * hidden,
        architecture="transformer",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // ASSUMED_HEAD_DIM,
        vocab_size=ASSUMED_VOCAB,
        intermediate_size=intermediate,
        num_kv_heads=hidden // ASSUMED_HEAD_DIM,
        head_dim=ASSUMED_HEAD_DIM,
        block="llama",
        param_numels=(*norms, max(0, int(num_params) - sum(norms))),
        tensor_replicated_params=min(int(num_params), ASSUMED_VOCAB * hidden + sum(norms)),
        source=f"--params (shape assumed: {layers} layers, hidden {hidden}, vocab {ASSUMED_VOCAB}; "
        "pass --model-config for exact activations)",
    )


def count_module(model: Any) -> tuple[int, int]:
    """(parameters counted once, largest module's own parameters) of a ``torch.nn.Module``.

    The same counts as DeepSpeed's ``model_to_params``, but shared parameters are recognised by
    identity, so it also works on the ``meta`` device where every ``data_ptr()`` is 0.
    """
    seen: dict[int, int] = {}
    for param in model.parameters():
        seen[id(param)] = param.numel()
    largest = 0
    for module in model.modules():
        largest = max(largest, sum(p.numel() for p in module.parameters(recurse=False)))
    return sum(seen.values()), largest


def param_numels(model: Any) -> tuple[int, ...]:
    """Each parameter's element count, shared parameters once (by identity: works on ``meta``)."""
    return tuple({id(p): p.numel() for p in model.parameters()}.values())


def expert_numel(model: Any) -> int:
    """Parameters of routed experts: those under a module named ``experts`` (Mixtral's ``mlp.experts``, Qwen-MoE's
    ``mlp.experts``; a shared expert, ``shared_expert``, is dense), shared parameters once."""
    seen: dict[int, int] = {}
    for name, param in model.named_parameters():
        if "experts" in name.split("."):
            seen[id(param)] = param.numel()
    return sum(seen.values())


def persistent_params(facts: ModelFacts, threshold: int) -> int:
    """Parameters stage 3 keeps whole on every rank: those of at most ``threshold`` elements (DeepSpeed's rule)."""
    return sum(n for n in facts.param_numels if n <= threshold)


def facts_from_model_config(config: Any, source: str) -> ModelFacts:
    """Model facts from a transformers config object: the model is built on PyTorch's ``meta`` device.

    ``AutoModelForCausalLM.from_config`` (falling back to ``AutoModel``) on ``meta`` gives exact counts
    for any architecture transformers knows and uses no memory.
    """
    import torch
    import transformers

    model = None
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            with torch.device("meta"):
                model = auto.from_config(config)
            break
        except (ValueError, KeyError):
            continue
    if model is None:
        raise ConfigError(f"{source}: transformers cannot build model_type {config.model_type!r}")
    total, largest = count_module(model)
    hidden = getattr(config, "hidden_size", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    llama_like = config.model_type in LLAMA_LIKE and getattr(config, "intermediate_size", None)
    # Mixtral names it num_local_experts, Qwen-MoE and OLMoE num_experts.
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return ModelFacts(
        num_params=total,
        largest_layer_params=largest,
        architecture="transformer" if hidden and layers and heads else config.model_type,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        vocab_size=getattr(config, "vocab_size", None),
        intermediate_size=getattr(config, "intermediate_size", None),
        num_kv_heads=getattr(config, "num_key_value_heads", None),
        head_dim=getattr(config, "head_dim", None),
        block="llama" if llama_like else "gpt",
        param_numels=param_numels(model),
        source=f"{source} ({config.model_type}, counted on the meta device)",
        num_experts=int(experts) if experts else None,
        expert_params=expert_numel(model) if experts else 0,
        tensor_replicated_params=tensor_replicated_numel(model),
    )


def facts_from_hf_config(path: str | Path) -> ModelFacts:
    """Model facts from a Hugging Face ``config.json`` (see :func:`facts_from_model_config`)."""
    from transformers import AutoConfig

    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"model config not found: {path}")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError for unknown configs
        raise ConfigError(f"{path}: not a Hugging Face model config ({str(exc).splitlines()[0]})") from None
    return facts_from_model_config(config, f"--model-config {path}")


def lora_params(facts: ModelFacts, rank: int) -> int:
    """LoRA adapter parameters on the attention (q, k, v, o) and MLP (gate, up, down) projections.

    Each adapted ``d_in x d_out`` matrix adds ``rank x (d_in + d_out)``; grouped-query k/v are counted
    as full width (a slight overestimate).
    """
    if not (facts.hidden_size and facts.num_layers):
        raise ConfigError("--lora-rank needs the model's shape: pass --model-config (or --params for a Llama shape)")
    h = facts.hidden_size
    inter = facts.intermediate_size or int(8 * h / 3)
    per_layer = 4 * rank * (h + h) + 3 * rank * (h + inter)
    return facts.num_layers * per_layer


def tensor_replicated_numel(model: Any) -> int:
    """Dense parameters outside ``nn.Linear`` layers (embeddings, norms, routers): what AutoTP leaves whole on
    every tensor-parallel rank (:attr:`ModelFacts.tensor_replicated_params`). Routed experts are not counted (expert
    parallelism splits them); shared parameters once, by identity (works on ``meta``), and a weight tied to a
    ``Linear`` (a tied output layer) counts as split with it."""
    import torch

    linear: set[int] = set()
    others: dict[int, int] = {}
    for module_name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if isinstance(module, torch.nn.Linear):
            linear.update(id(p) for p in own)
        elif "experts" not in module_name.split("."):
            others.update((id(p), p.numel()) for p in own)
    return sum(n for key, n in others.items() if key not in linear)


# --- per-rank activations under tensor and sequence parallelism ------------------------------------------


def kv_heads_per_rank(facts: ModelFacts, sequence_parallel: int = 1, tensor_parallel: int = 1) -> float:
    """Key/value heads one rank attends with: KV / TP, split over SP ranks, or 1 replicated head when SP > KV / TP."""
    kv = (facts.num_kv_heads or facts.num_heads or 1) / tensor_parallel
    return kv if sequence_parallel == 1 else max(kv / sequence_parallel, 1.0)


# --- the terms ----------------------------------------------------------------------------------------


def guide_model_states(
    facts: ModelFacts,
    stage: int,
    offload: str,
    world_size: int,
    precision: str = "bf16",
    lora_rank: int | None = None,
    persistence_threshold: int = 0,
    grads_alive: bool = True,
) -> tuple[float, float]:
    """(device bytes, host bytes) of model states per rank by guide 1's formula, with offload moving terms.

    Gradients are counted alive by default (the peak, during backward; ``grads_alive=False`` is the state
    after ``step()``). With LoRA the frozen base holds only its working copy (no gradients, no optimizer
    states) and the adapters follow the formula. Stage 3 on more than one rank adds P bytes for every
    parameter under ``persistence_threshold``: DeepSpeed keeps it whole on every rank as well as its
    partition, which the guide's 16K/N already counts.
    """
    if lora_rank:
        trainable = lora_params(facts, lora_rank)
        frozen = facts.num_params
        p = WORKING_BYTES[precision]
        base = p * frozen / world_size if stage == 3 else p * frozen
        parts = predicted_model_state_bytes(trainable, stage, world_size, precision, grads_alive=grads_alive)
        parts = {**parts, "params": parts["params"] + base}
    else:
        parts = predicted_model_state_bytes(facts.num_params, stage, world_size, precision, grads_alive=grads_alive)
    # On one rank the partition is the whole parameter: no second copy (measured: bench/memory.py).
    sharded = stage == 3 and world_size > 1
    whole_copies = WORKING_BYTES[precision] * persistent_params(facts, persistence_threshold) if sharded else 0
    return place_states(parts, whole_copies, offload)


def place_states(parts: dict[str, float], whole_copies: float, offload: str) -> tuple[float, float]:
    """(device bytes, host bytes): offload moves the optimizer states off the device, ``params`` the rest too."""
    device, host = parts["params"] + parts["grads"] + parts["optimizer"] + whole_copies, 0.0
    if offload in ("optimizer", "params", "nvme"):  # nvme: the off-device bytes are on disk, not in host RAM
        device -= parts["optimizer"]
        host += parts["optimizer"]
    if offload in ("params", "nvme"):
        device -= parts["params"] + parts["grads"]
        host += parts["params"] + parts["grads"]
    return device, host


def predicted_model_state_bytes(
    num_params: int,
    stage: int,
    world_size: int,
    precision: str = "bf16",
    grads_alive: bool = False,
    persistent_params: int = 0,
) -> dict[str, float]:
    """The guide's per-rank model-state bytes (guide 1, 2.2), generalised to the precision.

    With P the working bytes per element (2 for bf16/fp16, 4 for fp32), K parameters and N ranks:
    stage 0 holds P*K params + P*K grads + 12K optimizer; stage 1 shards the optimizer (12K/N);
    stage 2 also the gradients (P*K/N); stage 3 also the parameters (P*K/N). For bf16 this is the
    guide's 16K / 4K + 12K/N / 2K + 14K/N / 16K/N.

    Args:
        num_params: K.
        stage: ZeRO stage 0-3.
        world_size: N.
        precision: ``bf16``, ``fp16`` or ``fp32``.
        grads_alive: count gradients (True during backward; after ``step()`` ZeRO has released them).
        persistent_params: stage-3 parameter elements kept whole on every rank (under the persistence threshold),
            besides their partition.
    """
    p = WORKING_BYTES[precision]
    k, n = float(num_params), float(world_size)
    # DeepSpeed partitions every parameter, persistent ones included, and keeps the persistent ones whole
    # besides (measured to the byte by bench/memory.py); on one rank the partition is the whole tensor.
    whole_copies = persistent_params if n > 1 else 0
    params = p * k if stage < 3 else p * (k / n + whole_copies)
    grads = 0.0
    if grads_alive:
        grads = p * k if stage < 2 else p * k / n
    # In fp32 at stage 0 the parameters are their own master copy: Adam adds only m and v (8 B).
    state_bytes = 8 if (precision == "fp32" and stage == 0) else ADAM_STATE_BYTES
    optimizer = state_bytes * k if stage == 0 else state_bytes * k / n
    return {"params": params, "grads": grads, "optimizer": optimizer, "model_states": params + grads + optimizer}


def deepspeed_estimate(
    total_params: int,
    largest_layer_params: int,
    stage: int,
    offload: str,
    gpus_per_node: int,
    nodes: int,
    additional_buffer_factor: float = DS_ADDITIONAL_BUFFER_FACTOR,
) -> tuple[float | None, float | None]:
    """(per-GPU bytes, per-node CPU bytes) as DeepSpeed 0.19's estimators compute them, None where it has none.

    Stage 2 restates ``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs``,
    stage 3 ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` with
    ``zero_init=True``. Stages 0 and 1 and optimizer offload on stage 1 have no DeepSpeed estimator.
    """
    total_gpus = nodes * gpus_per_node
    k = total_params
    if stage == 2:
        if offload == "optimizer":
            return float(int(2 * k)), float(int(k * max(4 * total_gpus, 16) * additional_buffer_factor))
        if offload == "none":
            return float(int(2 * k + int(18 * k / total_gpus))), float(
                int(k * 4 * gpus_per_node * additional_buffer_factor)
            )
        return None, None
    if stage == 3:
        gpus_factor = 1 / nodes
        largest = 4 * largest_layer_params
        if offload == "params":
            gpu, cpu = largest, k * 18 * gpus_factor * additional_buffer_factor
        elif offload == "optimizer":
            gpu, cpu = largest + int(2 * k / total_gpus), k * 16 * gpus_factor * additional_buffer_factor
        else:
            gpu = largest + int(18 * k / total_gpus)
            cpu = largest_layer_params * 4 * gpus_per_node * additional_buffer_factor
        return float(int(gpu)), float(int(cpu))
    return None, None


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


def buffer_bytes(
    stage: int,
    zero: dict[str, Any],
    precision: str,
    largest_layer_params: int | None,
    bucket: int,
    sharded_params: int = 0,
) -> float:
    """Communication buffers per rank for a preset's ``zero_optimization`` dict.

    Stages 0-2: DeepSpeed documents ``overlap_comm`` as using 4.5 x the reduce and all-gather bucket
    sizes; without it one bucket of each (an upper bound: bench/memory.py measures 1.2-3.4x what is
    resident). Stage 3: the reduce bucket (``reduce_bucket_size`` elements, preallocated) plus the
    gathered parameters: DeepSpeed keeps gathered parameters that it will reuse until
    ``stage3_max_live_parameters`` (default 1e9) are live, so at the backward peak up to that many of the
    ``sharded_params`` are whole (measured: bench/memory.py), at least the prefetch bucket or largest layer.
    """
    p = WORKING_BYTES[precision]
    reduce = float(zero.get("reduce_bucket_size", bucket))
    if stage == 3:
        prefetch = zero.get("stage3_prefetch_bucket_size", int(0.9 * bucket))
        prefetch = float(int(0.9 * bucket) if not isinstance(prefetch, int | float) else prefetch)
        live = min(float(sharded_params), float(zero.get("stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS)))
        return p * (reduce + max(live, prefetch, float(largest_layer_params or 0)))
    allgather = 0.0 if stage == 0 else float(zero.get("allgather_bucket_size", bucket))
    factor = 4.5 if zero.get("overlap_comm") else 1.0
    return p * factor * (reduce + allgather)


def local_device_memory(ranks_per_node: int = 1) -> tuple[float, str]:
    """(bytes, label): the first GPU's total memory, or on a CPU the host RAM shared by ``ranks_per_node``."""
    import psutil
    import torch

    if torch.cuda.is_available():
        _, total = torch.cuda.mem_get_info(0)
        return float(total), f"local GPU: {torch.cuda.get_device_name(0)}"
    total = float(psutil.virtual_memory().total)
    share = max(1, ranks_per_node)
    return total / share, f"no GPU: host RAM {fmt_gb(total)} / {share} process(es)"


def host_memory() -> float:
    """Total host RAM of this machine in bytes."""
    import psutil

    return float(psutil.virtual_memory().total)


# --- offload tiers: bytes moved per optimizer step and the time they take ---------------------------------

# DeepSpeed swaps a tensor to NVMe only when it has at least this many bytes (MIN_AIO_BYTES, 1 MiB; or
# aio.block_size when larger): smaller partitions stay in host RAM.
MIN_SWAPPED_BYTES = 2**20


def swap_threshold_bytes(block_size: float | None) -> int:
    """The fewest bytes DeepSpeed swaps to NVMe: max(1 MiB, ``aio.block_size``); smaller tensors stay in RAM."""
    return int(max(MIN_SWAPPED_BYTES, block_size or 0))


# Guide 1 (3.2): bandwidth of each tier in GB/s (1e9 bytes/s), as (low, high) of the guide's range.
GUIDE_BANDWIDTH_GBPS: dict[str, tuple[float, float]] = {
    "hbm": (1000.0, 2000.0),
    "dram": (50.0, 100.0),
    "pcie": (16.0, 32.0),
    "nvme": (2.0, 4.0),
}
LINKS = tuple(GUIDE_BANDWIDTH_GBPS)
# Links the ranks of a node share, so that their bytes add up: host memory and the node's NVMe drives. Each
# device has a PCIe link (and HBM) of its own.
NODE_SHARED_LINKS = ("dram", "nvme")
FP32_MASTER_AND_MOMENTS = 12  # bytes per parameter: Adam's fp32 master copy, m and v


def nvme_swapped_bytes_per_rank(
    num_params: int, world_size: int, precision: str, params_on_nvme: bool, optimizer_on_nvme: bool
) -> float:
    """Bytes one rank's swap files hold under stage-3 NVMe offload (ZeRO-Infinity), before alignment padding.

    Parameters: the rank's 16-bit (fp32: 4-byte) partition. Optimizer: the fp32 master copy, m and v (12 B) and
    the fp32 gradients DeepSpeed swaps out during the backward pass (4 B), of the rank's partition. Stages 1-2
    never swap (DeepSpeed 0.19 treats their ``device: nvme`` as CPU offload).
    """
    partition = math.ceil(num_params / world_size)
    total = 0.0
    if params_on_nvme:
        total += WORKING_BYTES[precision] * partition
    if optimizer_on_nvme:
        total += (FP32_MASTER_AND_MOMENTS + FP32) * partition
    return total


def offload_traffic(
    num_params: int, stage: int, offload: str, world_size: int, precision: str = "bf16", grad_accum: int = 1
) -> dict[str, dict[str, float]]:
    """Bytes one optimizer step moves per rank across each offload link, term by term: ``{link: {what: bytes}}``.

    k = the rank's partition (K/N elements; stage 0 has no offload), P = working bytes, A = micro-batches per
    optimizer step. ``offload``:

    - ``optimizer`` (ZeRO-Offload): PCIe carries the gradient partition to host RAM every micro-batch (A P k)
      and the updated 16-bit parameters back (P k); host RAM serves DeepSpeedCPUAdam, which reads the fp32
      master, m, v and gradient (16 k) and writes master, m, v and the 16-bit copy ((12 + P) k), plus the
      gradients landing in fp32 (4 A k).
    - ``params`` (stage 3): also the parameter partition fetched to the device before each all-gather, in the
      forward and the backward pass (2 A P k over PCIe, read from host RAM).
    - ``nvme`` (stage 3, ZeRO-Infinity, ``max_in_cpu: 0``): PCIe and host RAM as ``params``; the node's NVMe
      reads the parameters for each fetch (2 A P k), the master, m and v (12 k) and the fp32 gradients (4 k),
      and writes the updated parameters (P k), master, m and v (12 k) and the gradients (4 A k).

    An upper estimate of the unavoidable traffic: caching and prefetch can save re-reads, nothing here is
    counted twice. ``none`` moves nothing over these links (HBM traffic is not an offload cost).
    """
    if offload not in ("optimizer", "params", "nvme") or stage == 0:
        return {}
    if offload in ("params", "nvme") and stage != 3:
        raise ConfigError(f"{offload} offload needs ZeRO stage 3, got stage {stage}")
    k = math.ceil(num_params / world_size)
    p, a = WORKING_BYTES[precision], grad_accum
    pcie = {"gradients to host": a * p * k, "updated parameters back": p * k}
    dram = {
        "CPU Adam reads master, m, v, gradients": (FP32_MASTER_AND_MOMENTS + FP32) * k,
        "CPU Adam writes master, m, v, 16-bit copy": (FP32_MASTER_AND_MOMENTS + p) * k,
        "gradients land in fp32": FP32 * a * k,
    }
    traffic: dict[str, dict[str, float]] = {"pcie": pcie, "dram": dram}
    if offload in ("params", "nvme"):
        pcie["parameter fetches, forward and backward"] = 2 * a * p * k
        dram["parameter fetches, forward and backward"] = 2 * a * p * k
    if offload == "nvme":
        traffic["nvme"] = {
            "parameter reads, forward and backward": 2 * a * p * k,
            "updated parameters written": p * k,
            "master, m, v read and written": 2 * FP32_MASTER_AND_MOMENTS * k,
            "fp32 gradients written and read": FP32 * (a + 1) * k,
        }
    return {link: {what: float(n) for what, n in terms.items()} for link, terms in traffic.items()}


def link_seconds(
    traffic: dict[str, dict[str, float]], ranks_per_node: int, bandwidth_gbps: dict[str, float]
) -> dict[str, float]:
    """Seconds each link needs for one optimizer step's bytes: per rank on PCIe, the node's sum on shared links."""
    seconds = {}
    for link, terms in traffic.items():
        sharing = ranks_per_node if link in NODE_SHARED_LINKS else 1
        seconds[link] = sum(terms.values()) * sharing / (bandwidth_gbps[link] * GB)
    return seconds


def link_seconds_range(
    traffic: dict[str, dict[str, float]], ranks_per_node: int, bandwidth_gbps: dict[str, tuple[float, float]]
) -> tuple[dict[str, tuple[float, float]], str]:
    """Each link's seconds at the high and at the low end of its bandwidth range, and the slowest link (the step's
    floor when every transfer overlaps compute and the others): the planner's time column."""
    fast = link_seconds(traffic, ranks_per_node, {k: v[1] for k, v in bandwidth_gbps.items()})
    slow = link_seconds(traffic, ranks_per_node, {k: v[0] for k, v in bandwidth_gbps.items()})
    return {link: (fast[link], slow[link]) for link in traffic}, max(slow, key=slow.__getitem__)


def parse_bandwidths(items: list[str] | None) -> dict[str, tuple[float, float]]:
    """Guide 1's bandwidth table, with ``link=GB/s`` items (``nvme=3.2``) replacing a link's range by one figure."""
    table = dict(GUIDE_BANDWIDTH_GBPS)
    for item in items or []:
        link, sep, value = str(item).partition("=")
        link = link.strip().lower()
        if not sep or link not in table:
            raise ConfigError(
                f"--bandwidth takes LINK=GB/s with LINK one of {', '.join(LINKS)}, got {item!r}{nearest(link, LINKS)}"
            )
        try:
            gbps = float(value)
        except ValueError:
            gbps = -1.0
        if not gbps > 0 or math.isinf(gbps):
            raise ConfigError(f"--bandwidth {link}: GB/s must be a positive number, got {value!r}")
        table[link] = (gbps, gbps)
    return table
