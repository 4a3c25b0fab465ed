"""Memory planner: per-rank bytes of each ZeRO stage and offload variant, before anything runs.

Everything here is pure arithmetic on a few model facts, so ``zero-recipes estimate`` answers in a
second and a test can check each term. Per rank, for K parameters on N data-parallel ranks:

- **model states** by guide 1's formula (section 2.2), through
  :func:`common.accounting.predicted_model_state_bytes`: 16K / 4K + 12K/N / 2K + 14K/N / 16K/N for
  stages 0-3 with mixed-precision Adam. Offload moves terms off the device: ``optimizer`` the 12 B of
  fp32 master + Adam moments, ``params`` (stage 3) the parameters and gradients as well. Gradients are
  counted alive (the peak, during the backward pass; ``step()`` releases them). Under stage 3 the
  parameters under ``stage3_param_persistence_threshold`` are kept whole on every rank *besides* their
  partition: + P x K_persistent (P bytes per working element; measured exactly by bench/memory.py).
- **DeepSpeed's own estimate**, the formulas of ``estimate_zero2_model_states_mem_needs`` and
  ``estimate_zero3_model_states_mem_needs`` (DeepSpeed 0.19), re-stated here so that the planner does
  not import DeepSpeed; ``tests/unit/test_memory.py`` calls DeepSpeed's functions and checks that the
  two agree. DeepSpeed counts 18 B/param of sharded state (fp32 gradients included), a largest-layer
  term for stage 3 and has no estimator for stages 0 and 1.
- **activations**: the bytes autograd saves for the backward pass, per tensor, for the attention
  implementation the run uses (:func:`activation_parts`). A Llama-style block (RMSNorm, rotary
  embeddings, gated MLP) is counted op by op from transformers' code and checked against
  ``torch.autograd.graph.saved_tensors_hooks`` (tests/unit/test_activation_bytes.py, bench/activations.py):
  SDPA and FlashAttention save q, k, v, the output and a float32 log-sum-exp per head and token, never
  the ``a x s x s`` score matrix; ``eager`` saves the softmax (float32 and its 16-bit copy). Other
  transformers get Korthikanti et al. 2022 (arXiv:2205.05198, section 4.1), ``s*b*h*(34 + 5*a*s/h)``
  per layer with its score term only under ``eager``. Checkpointing presets keep block inputs, and the
  peak is the larger of the end of the forward pass and the first recomputation in the backward pass.
- **buffers**: an upper bound. DeepSpeed documents ``overlap_comm`` as costing about 4.5 x (reduce +
  all-gather bucket) elements; without it one bucket of each. Under stage 3 the reduce bucket is
  preallocated (``reduce_bucket_size`` elements in the training dtype, measured here: DESIGN.md) and
  DeepSpeed keeps gathered parameters whole up to ``stage3_max_live_parameters``. bench/memory.py
  measures what is resident at the peak of the backward pass and publishes the ratio.
- **host RAM** per node for offload: the offloaded per-rank bytes times the ranks on a node.

A row *fits* when model states + activations + buffers stay within 90 % of the device memory (10 %
kept for fragmentation and the runtime's own context) and, with offload, the host RAM holds the
offloaded states. :func:`recommend` walks guide 1's ladder (section 5.3) over the rows.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.strategy import bucket_elements

# Bytes per element of the working (16/32-bit) copy; the same table as common.accounting.WORKING_BYTES,
# repeated so that the CLI does not import torch just to build its parser.
WORKING_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

GB = 1e9  # the guides' GB (112 GB = 7e9 x 16 B)
GIB = 2**30

# Share of device memory a plan may use; the rest is fragmentation and the runtime's context.
USABLE_FRACTION = 0.9

# DeepSpeed's default for stage3_max_live_parameters: gathered parameters kept whole while reused.
DS_MAX_LIVE_PARAMETERS = 1e9

# DeepSpeed's default for the estimators' "additional_buffer_factor".
DS_ADDITIONAL_BUFFER_FACTOR = 1.5

OFFLOADS = ("none", "optimizer", "params")

# (stage, offload) rows of the table, and the generic preset each row stands for.
ROW_PRESETS: dict[tuple[int, str], str] = {
    (0, "none"): "ddp",
    (1, "none"): "deepspeed_stage_1",
    (2, "none"): "deepspeed_stage_2",
    (3, "none"): "deepspeed_stage_3",
    (1, "optimizer"): "deepspeed_stage_1",  # + offload_optimizer (no named preset)
    (2, "optimizer"): "deepspeed_stage_2_offload",
    (3, "optimizer"): "deepspeed_stage_3",  # + offload_optimizer only (no named preset)
    (3, "params"): "deepspeed_stage_3_offload",
}

# Guide 1, 5.3 and 3.3: stages in order without offload, then offload optimizer states on stage 2
# (the guide's first offload), then stage 3 with optimizer, then parameters too.
LADDER: tuple[tuple[int, str], ...] = (
    (0, "none"),
    (1, "none"),
    (2, "none"),
    (3, "none"),
    (2, "optimizer"),
    (3, "optimizer"),
    (3, "params"),
)

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


@dataclass(frozen=True)
class PlanInputs:
    """The run a plan is for.

    Attributes:
        gpus_per_node: devices (ranks) per node.
        nodes: nodes; data-parallel ranks = gpus_per_node x nodes.
        seq_len: tokens per sample.
        micro_batch_size: samples per rank per forward pass.
        activation_checkpointing: the preset used for the "checkpointed" activations column.
        attention: ``sdpa``, ``flash_attention_2``, ``eager`` (or ``auto``): decides whether the score matrix is saved.
        lora_rank: LoRA rank (frozen base + adapters on attention and MLP projections), None = full training.
        offload: restrict the rows to one offload variant, or None for all.
        precision: ``bf16``, ``fp16`` or ``fp32``.
        device_memory_bytes: memory of one device (or, on a CPU, host RAM per process).
        device_memory_label: where that number comes from.
        host_memory_bytes: host RAM per node, for offload rows (None: not checked).
        bucket_elements: reduce / all-gather bucket size; None scales it to the model like the presets.
    """

    gpus_per_node: int = 1
    nodes: int = 1
    seq_len: int = 2048
    micro_batch_size: int = 1
    activation_checkpointing: str = "full"
    attention: str = "sdpa"
    lora_rank: int | None = None
    offload: str | None = None
    precision: str = "bf16"
    device_memory_bytes: float = 80 * GB
    device_memory_label: str = "--gpu-memory"
    host_memory_bytes: float | None = None
    bucket_elements: int | None = None

    @property
    def world_size(self) -> int:
        """Data-parallel ranks in total."""
        return self.gpus_per_node * self.nodes


@dataclass
class Row:
    """One (stage, offload) variant of the plan; bytes are per rank unless named per node."""

    stage: int
    offload: str
    preset: str
    model_states_bytes: float
    model_states_after_step_bytes: float
    model_states_host_bytes: float
    deepspeed_estimate_bytes: float | None
    deepspeed_host_estimate_bytes: float | None
    activations_bytes: float | None
    activations_checkpointed_bytes: float | None
    buffers_bytes: float
    persistent_params: int
    host_ram_per_node_bytes: float
    total_bytes: float | None
    total_checkpointed_bytes: float | None
    fits: bool
    fits_with: str | None
    note: str = ""


@dataclass
class Plan:
    """Rows plus the inputs and the ladder's recommendation."""

    model: ModelFacts
    inputs: PlanInputs
    rows: list[Row] = field(default_factory=list)
    recommendation: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form: ``{"rows": [...], "model": ..., "inputs": ..., "recommendation": ...}``."""
        inputs = asdict(self.inputs)
        inputs["world_size"] = self.inputs.world_size
        model = asdict(self.model)
        model.pop("param_numels")  # one number per parameter: too long to print, persistent_params is per row
        return {
            "rows": [asdict(r) for r in self.rows],
            "model": model,
            "inputs": inputs,
            "usable_fraction": USABLE_FRACTION,
            "recommendation": self.recommendation,
        }


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
    from common.accounting import predicted_model_state_bytes

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
    device, host = parts["params"] + parts["grads"] + parts["optimizer"] + whole_copies, 0.0
    if offload in ("optimizer", "params"):
        device -= parts["optimizer"]
        host += parts["optimizer"]
    if offload == "params":
        device -= parts["params"] + parts["grads"]
        host += parts["params"] + parts["grads"]
    return device, host


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
    facts: ModelFacts, seq_len: int, micro_batch_size: int, precision: str = "bf16", attention: str = "sdpa"
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
    """
    if facts.architecture != "transformer" or not (facts.hidden_size and facts.num_layers and facts.num_heads):
        return None
    if attention not in ATTENTIONS:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    eager = attention == "eager"
    p = WORKING_BYTES[precision]
    tokens, b, s = seq_len * micro_batch_size, micro_batch_size, seq_len
    h, a = facts.hidden_size, facts.num_heads
    vocab = facts.vocab_size or 0
    scores = a * s * tokens  # a x s x s per sample
    lse = FP32 * a * tokens
    ids = 2 * INDEX_BYTES * tokens  # input ids (embedding) and shifted labels (loss)
    if facts.block != "llama":
        scale = p / 2  # the paper's counts are 16-bit
        attention_part = (5 * scores if eager else lse) * scale + 11 * tokens * h * scale  # QKV, scores, dropout
        layer = 34 * tokens * h * scale + (5 * scores * scale if eager else lse)
        head = FP32 * tokens * vocab + 2 * tokens * h * scale + ids
        return ActivationParts(layer, attention_part, p * tokens * h, head, after_attention=21 * tokens * h * scale)
    h_kv = (facts.num_kv_heads or a) * (facts.head_dim or h // a)
    inter = facts.intermediate_size or int(8 * h / 3)
    norm = (FP32 + 2 * p) * tokens * h + FP32 * tokens
    if eager:
        softmax = FP32 + (p if p != FP32 else 0)
        attention_part = 4 * p * tokens * h + softmax * scores
    else:
        attention_part = 2 * p * tokens * h + 2 * p * tokens * h_kv + lse
    mlp = 4 * p * tokens * inter
    head = norm + FP32 * tokens * vocab + ids
    rope = 2 * p * s * (facts.head_dim or h // a)
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


def transformer_activations(
    facts: ModelFacts,
    seq_len: int,
    micro_batch_size: int,
    checkpointing: str = "none",
    precision: str = "bf16",
    attention: str = "sdpa",
) -> float | None:
    """Peak bytes saved for backward per rank (no tensor or sequence parallelism), or None if not a transformer.

    Without recomputation every block keeps :func:`activation_parts`' ``layer``. A checkpointed block
    keeps its input, and during the backward pass the last checkpointed block is recomputed whole while
    everything saved before it is still alive: the peak is the larger of the end of the forward pass
    (with the loss's log-probabilities) and that moment (the loss's saved tensors are freed by then).
    ``selective`` recomputes only attention. Which blocks a preset wraps comes from common.activation.
    """
    from common.activation import check_preset

    check_preset(checkpointing)
    parts = activation_parts(facts, seq_len, micro_batch_size, precision, attention)
    if parts is None:
        return None
    n_layers = facts.num_layers or 0
    token_ids = INDEX_BYTES * seq_len * micro_batch_size  # the embedding's ids, alive until the very end
    if checkpointing == "selective":
        kept = n_layers * (parts.layer - parts.attention) + parts.mask
        # The last block's attention is recomputed once its MLP and second norm have been freed.
        during_backward = kept - parts.after_attention + parts.attention + parts.rope + token_ids
        return float(max(kept + parts.head, during_backward))
    wrapped = checkpointed_blocks(checkpointing, n_layers)
    kept = [parts.block_input if w else parts.layer for w in wrapped]
    shared = (parts.rope if not all(wrapped) else 0.0) + (parts.mask if any(wrapped) else 0.0)
    end_of_forward = sum(kept) + shared + parts.head
    if not any(wrapped):
        return float(end_of_forward)
    last = max(i for i, w in enumerate(wrapped) if w)
    recomputed = parts.layer - parts.input_reused
    during_backward = sum(kept[: last + 1]) + recomputed + parts.rope + parts.mask + token_ids
    return float(max(end_of_forward, during_backward))


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


def _preset_zero(stage: int, offload: str, bucket: int, hidden_size: int | None = None) -> dict[str, Any]:
    """The row's preset ``zero_optimization``, with the model-scaled values the factory would fill in."""
    from common.presets import FROM_MODEL, get_preset
    from common.strategy import persistence_threshold

    zero = dict(get_preset(ROW_PRESETS[(stage, offload)])["zero_optimization"])
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        zero.setdefault(key, bucket)
    if zero.get("stage3_prefetch_bucket_size") == FROM_MODEL:
        zero["stage3_prefetch_bucket_size"] = int(0.9 * bucket)
    if zero.get("stage3_param_persistence_threshold") == FROM_MODEL:
        zero["stage3_param_persistence_threshold"] = persistence_threshold(hidden_size)
    return zero


# --- the plan -----------------------------------------------------------------------------------------


def plan(facts: ModelFacts, inputs: PlanInputs) -> Plan:
    """Every (stage, offload) row for ``facts`` on ``inputs``, with the ladder's recommendation."""
    if inputs.offload is not None and inputs.offload not in OFFLOADS:
        raise ConfigError(f"offload must be one of {', '.join(OFFLOADS)}, got {inputs.offload!r}")
    if inputs.precision not in WORKING_BYTES:
        raise ConfigError(f"precision must be bf16, fp16 or fp32, got {inputs.precision!r}")
    n = inputs.world_size
    bucket = inputs.bucket_elements or bucket_elements(facts.hidden_size)
    largest = facts.largest_layer_params or 0
    usable = USABLE_FRACTION * inputs.device_memory_bytes
    ac = inputs.activation_checkpointing
    run = (inputs.seq_len, inputs.micro_batch_size)
    act_none = transformer_activations(facts, *run, "none", inputs.precision, inputs.attention)
    act_ckpt = transformer_activations(facts, *run, ac, inputs.precision, inputs.attention)
    result = Plan(model=facts, inputs=inputs)
    for stage, offload in ROW_PRESETS:
        if inputs.offload is not None and offload != inputs.offload:
            continue
        zero = _preset_zero(stage, offload, bucket, facts.hidden_size)
        threshold = int(zero.get("stage3_param_persistence_threshold", 0)) if stage == 3 else 0
        device, host = guide_model_states(facts, stage, offload, n, inputs.precision, inputs.lora_rank, threshold)
        after_step, _ = guide_model_states(
            facts, stage, offload, n, inputs.precision, inputs.lora_rank, threshold, grads_alive=False
        )
        if inputs.lora_rank:
            ds_gpu, ds_cpu = None, None
        else:
            ds_gpu, ds_cpu = deepspeed_estimate(
                facts.num_params, largest, stage, offload, inputs.gpus_per_node, inputs.nodes
            )
        sharded = facts.num_params - persistent_params(facts, threshold)
        buffers = buffer_bytes(stage, zero, inputs.precision, largest, bucket, sharded)
        host_node = host * inputs.gpus_per_node
        host_ok = inputs.host_memory_bytes is None or host_node <= inputs.host_memory_bytes
        total = None if act_none is None else device + buffers + act_none
        total_ckpt = None if act_ckpt is None else device + buffers + act_ckpt
        base = device + buffers
        if total is not None:
            fits_with = "none" if total <= usable else (ac if total_ckpt is not None and total_ckpt <= usable else None)
        else:  # activations unknown: model states and buffers only
            fits_with = "unknown activations" if base <= usable else None
        fits = fits_with is not None and host_ok
        note = ""
        if not host_ok:
            note = f"host RAM: needs {fmt_gb(host_node)} per node"
        result.rows.append(
            Row(
                stage=stage,
                offload=offload,
                preset=ROW_PRESETS[(stage, offload)],
                model_states_bytes=device,
                model_states_after_step_bytes=after_step,
                model_states_host_bytes=host,
                deepspeed_estimate_bytes=ds_gpu,
                deepspeed_host_estimate_bytes=ds_cpu,
                activations_bytes=act_none,
                activations_checkpointed_bytes=act_ckpt,
                buffers_bytes=buffers,
                persistent_params=persistent_params(facts, threshold),
                host_ram_per_node_bytes=host_node,
                total_bytes=total,
                total_checkpointed_bytes=total_ckpt,
                fits=fits,
                fits_with=fits_with if fits else None,
                note=note,
            )
        )
    result.recommendation = recommend(result)
    return result


def recommend(result: Plan) -> dict[str, Any]:
    """The first rung of guide 1's ladder (section 5.3) that fits, with the reason in words.

    Order: stages 0, 1, 2, 3 without offload and without activation checkpointing; then the same with
    checkpointing (compute traded for memory, guide 1, 5.1); then stage 2 + optimizer offload (the
    guide's first offload, 3.3), stage 3 + optimizer offload, stage 3 + parameter offload: offload last.
    """
    rows = {(r.stage, r.offload): r for r in result.rows}
    usable = USABLE_FRACTION * result.inputs.device_memory_bytes
    ac = result.inputs.activation_checkpointing
    passes = [("none", [k for k in LADDER if k[1] == "none"])]
    if ac != "none":
        passes.append((ac, [k for k in LADDER if k[1] == "none"]))
    passes.append(("offload", [k for k in LADDER if k[1] != "none"]))
    for mode, keys in passes:
        for key in keys:
            row = rows.get(key)
            if row is None or not row.fits:
                continue
            if mode == "none" and row.fits_with not in ("none", "unknown activations"):
                continue
            return _recommendation(row, result, usable, ac)
    return {
        "stage": None,
        "offload": None,
        "preset": None,
        "activation_checkpointing": None,
        "reason": (
            f"nothing fits in {fmt_gb(usable)} per device ({int(USABLE_FRACTION * 100)} % of "
            f"{fmt_gb(result.inputs.device_memory_bytes)}): add devices or nodes, lower the micro batch or "
            "sequence length, or offload to NVMe (deepspeed_stage_3_offload_nvme)"
        ),
    }


_RUNG_WHY = {
    (0, "none"): "plain data parallelism: no sharding, DDP's communication",
    (1, "none"): "stage 1 shards optimizer states at DDP's communication cost",
    (2, "none"): "stage 2 also shards gradients (reduce-scatter; guide 1 measured 0.97x of stage 1)",
    (3, "none"): "stage 3 shards parameters too (an all-gather per layer; guide 1 measured 0.92x)",
    (1, "optimizer"): "stage 1 with optimizer states in host RAM",
    (2, "optimizer"): "optimizer states in host RAM, the guide's first offload (12 B/param leave the device)",
    (3, "optimizer"): "stage 3 with optimizer states in host RAM",
    (3, "params"): "parameters in host RAM too: expect about 0.70x throughput; raise the batch to amortise PCIe",
}


def _rung_name(row: Row) -> str:
    return f"stage {row.stage}" + (f" + {row.offload} offload" if row.offload != "none" else "")


def _rung_need(row: Row, ac: str) -> str:
    if row.total_bytes is None:
        return f"{fmt_gb(row.model_states_bytes + row.buffers_bytes)} before activations"
    text = fmt_gb(row.total_bytes)
    if row.total_checkpointed_bytes is not None and ac != "none":
        text += f" ({fmt_gb(row.total_checkpointed_bytes)} with {ac} checkpointing)"
    return text


def _recommendation(row: Row, result: Plan, usable: float, ac: str) -> dict[str, Any]:
    checkpointing = "none" if row.fits_with in ("none", "unknown activations") else ac
    total = row.total_bytes if checkpointing == "none" else row.total_checkpointed_bytes
    used = total if total is not None else row.model_states_bytes + row.buffers_bytes
    rows = {(r.stage, r.offload): r for r in result.rows}
    skipped = []
    for key in LADDER:
        if key == (row.stage, row.offload):
            break
        lower = rows.get(key)
        if lower is not None:
            text = f"{_rung_name(lower)} needs {_rung_need(lower, ac)}"
            skipped.append(text + (f", {lower.note}" if lower.note else ""))
    reason = f"{_rung_name(row)} fits in {fmt_gb(used)}"
    if checkpointing != "none":
        reason += f" with {checkpointing!r} activation checkpointing (the lower rungs do not fit without it)"
    elif row.total_bytes is not None:
        reason += " without activation checkpointing"
    reason += f": {_RUNG_WHY[(row.stage, row.offload)]}"
    if skipped:
        reason = "; ".join(skipped) + f" — over the {fmt_gb(usable)} usable; " + reason
    return {
        "stage": row.stage,
        "offload": row.offload,
        "preset": row.preset,
        "activation_checkpointing": checkpointing,
        "per_rank_bytes": used,
        "reason": reason,
    }


# --- output -------------------------------------------------------------------------------------------


def format_plan(result: Plan) -> str:
    """The human table: one line per (stage, offload), GB = 1e9 bytes as in the guides."""
    inp, facts = result.inputs, result.model
    ac = inp.activation_checkpointing
    lines = [
        f"model: {facts.num_params / 1e9:.3g}B parameters — {facts.source}",
        f"run: {inp.gpus_per_node} device(s) x {inp.nodes} node(s) = {inp.world_size} ranks, {inp.precision}, "
        + (f"seq {inp.seq_len}, {inp.attention} attention, " if facts.architecture == "transformer" else "")
        + f"micro batch {inp.micro_batch_size}"
        + (f", LoRA rank {inp.lora_rank}" if inp.lora_rank else ""),
        f"device memory: {fmt_gb(inp.device_memory_bytes)} ({inp.device_memory_label}); a plan fits in "
        f"{int(USABLE_FRACTION * 100)} % of it",
    ]
    if facts.architecture != "transformer":
        lines.append(
            f"activations: not estimated for {facts.architecture} (the formula is a transformer's): "
            "fits counts model states and buffers only; measure with zero-recipes probe"
        )
    lines.append("")
    header = (
        f"{'stage':>5}  {'offload':<9}  {'guide states':>12}  {'DeepSpeed est.':>14}  {'activations':>11}  "
        f"{'act. ' + ac:>16}  {'buffers <=':>10}  {'host/node':>10}  fits"
    )
    lines += [header, "-" * len(header)]
    for r in result.rows:
        fits = "does not fit"
        if r.fits:
            fits = {"none": "fits", "unknown activations": "fits (before activations)"}.get(
                r.fits_with or "", f"fits with {r.fits_with}"
            )
        if r.note:
            fits += f" ({r.note})"
        lines.append(
            f"{r.stage:>5}  {r.offload:<9}  {fmt_gb(r.model_states_bytes):>12}  "
            f"{fmt_gb(r.deepspeed_estimate_bytes):>14}  {fmt_gb(r.activations_bytes):>11}  "
            f"{fmt_gb(r.activations_checkpointed_bytes):>16}  {fmt_gb(r.buffers_bytes):>10}  "
            f"{fmt_gb(r.host_ram_per_node_bytes):>10}  {fits}"
        )
    rec = result.recommendation
    lines += [
        "",
        "guide states: guide 1 (2.2) per rank, gradients alive — 16K / 4K+12K/N / 2K+14K/N / 16K/N (+ whole copies",
        "  of stage-3 persistent params), offloaded terms moved to host. DeepSpeed est.: estimate_zero{2,3}_model_",
        "  states_mem_needs (18 B/param sharded + largest layer; none for stages 0-1). activations: bytes saved for",
        "  backward at their peak, counted per op for this attention (eager adds the a*s*s softmax; sdpa/flash keep",
        "  a log-sum-exp); checked against autograd (bench/activations.py). buffers <=: an upper bound: overlap_comm",
        "  ~4.5 x buckets; stage 3 reduce bucket + parameters kept gathered (<= stage3_max_live_parameters).",
        "",
    ]
    recommended = (
        f"recommended: {rec['preset'] or 'none'}"
        + (
            f" (stage {rec['stage']}, offload {rec['offload']}, "
            f"activation_checkpointing {rec['activation_checkpointing']})"
            if rec.get("preset")
            else ""
        )
        + f" — {rec['reason']}"
    )
    lines += textwrap.wrap(recommended, width=len(header), subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(lines)


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


def to_json_text(result: Plan) -> str:
    """``--json`` output."""
    return json.dumps(
        result.to_json(), indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o
    )


# --- the `zero-recipes estimate` command ----------------------------------------------------------------


def register(sub: Any) -> None:
    """Add ``zero-recipes estimate`` to the CLI's subparsers."""
    p = sub.add_parser(
        "estimate",
        help="plan memory per ZeRO stage and offload variant (guide formula, DeepSpeed's estimator, activations)",
        description="Per-rank memory of ZeRO stages 0-3 and offload variants, and the guide's recommended stage. "
        "Example: zero-recipes estimate --params 7e9 --gpus 8 --gpu-memory 80GB",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="parameter count, e.g. 7e9 or 7B (a Llama-like shape is assumed)")
    src.add_argument("--model-config", help="a Hugging Face config.json (parameters counted exactly)")
    src.add_argument("--recipe", help="a recipe name (zero-recipes ls): its model, batch and devices")
    p.add_argument("--config", help="with --recipe: the recipe's YAML config (default: its tiny_cpu.yaml)")
    p.add_argument("--gpus", type=int, default=None, help="devices per node (default 1, or the recipe's)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default 1, or the recipe's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 2048, or the recipe's)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="samples per rank (default 1, or the recipe's)")
    p.add_argument(
        "--activation-checkpointing",
        default=None,
        help="none|full|every_k|selective|save_memory_optimized: the checkpointed-activations column "
        "(default full, or the recipe's when not none)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default=None,
        help="attention implementation: eager saves the s x s scores, sdpa/flash_attention_2 do not "
        "(default sdpa, or the recipe's; auto = flash or sdpa)",
    )
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank: frozen base + adapters on projections")
    p.add_argument("--offload", choices=OFFLOADS, default=None, help="show only this offload variant (default: all)")
    p.add_argument("--precision", choices=tuple(WORKING_BYTES), default=None, help="default bf16, or the recipe's")
    p.add_argument("--gpu-memory", default=None, help="memory per device, e.g. 80GB (default: the local device's)")
    p.add_argument(
        "--host-memory",
        default=None,
        help="host RAM per node for offload rows (default: this machine's when --gpu-memory is not given)",
    )
    p.add_argument(
        "--bucket-size", default=None, help="reduce/all-gather bucket elements (default: scaled like presets)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_estimate)


def _recipe_inputs(args: Any) -> tuple[ModelFacts, dict[str, Any]]:
    from common.probe import load_recipe_config, recipe_model_facts, recipe_world

    module, cfg = load_recipe_config(args.recipe, args.config)
    facts = recipe_model_facts(module, cfg)
    gpus, nodes = recipe_world(cfg)
    defaults = {
        "gpus_per_node": gpus,
        "nodes": nodes,
        "seq_len": getattr(cfg, "seq_len", None),
        "micro_batch_size": getattr(cfg, "micro_batch_size", None),
        "precision": getattr(cfg, "precision", None),
        "attention": getattr(cfg, "attention", None),
        "lora_rank": getattr(cfg, "lora_rank", None) if getattr(cfg, "lora", True) else None,
    }
    ac = getattr(cfg, "activation_checkpointing", "none")
    if ac and ac != "none":
        defaults["activation_checkpointing"] = ac
    return facts, {k: v for k, v in defaults.items() if v is not None}


def cmd_estimate(args: Any) -> int:
    """``zero-recipes estimate``: print the plan table (or JSON)."""
    if args.activation_checkpointing is not None:
        from common.activation import check_preset

        check_preset(args.activation_checkpointing)
    if args.config and not args.recipe:
        raise ConfigError("--config goes with --recipe (a recipe's YAML); for a Hugging Face config use --model-config")
    recipe_defaults: dict[str, Any] = {}
    if args.params:
        facts = assumed_transformer(parse_count(args.params))
    elif args.model_config:
        facts = facts_from_hf_config(args.model_config)
    else:
        facts, recipe_defaults = _recipe_inputs(args)
    for name in ("gpus", "nodes", "seq_len", "micro_batch_size", "lora_rank"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    gpus = args.gpus or recipe_defaults.get("gpus_per_node", 1)
    nodes = args.nodes or recipe_defaults.get("nodes", 1)
    if args.gpu_memory:
        device_memory, label = parse_bytes(args.gpu_memory), "--gpu-memory"
    else:
        device_memory, label = local_device_memory(gpus)
    if args.host_memory:
        host: float | None = parse_bytes(args.host_memory)
    else:
        host = None if args.gpu_memory else host_memory()
    inputs = PlanInputs(
        gpus_per_node=gpus,
        nodes=nodes,
        seq_len=args.seq_len or recipe_defaults.get("seq_len", 2048),
        micro_batch_size=args.micro_batch_size or recipe_defaults.get("micro_batch_size", 1),
        activation_checkpointing=args.activation_checkpointing
        or recipe_defaults.get("activation_checkpointing", "full"),
        attention=args.attention or recipe_defaults.get("attention", "sdpa"),
        lora_rank=args.lora_rank or recipe_defaults.get("lora_rank"),
        offload=args.offload,
        precision=args.precision or recipe_defaults.get("precision", "bf16"),
        device_memory_bytes=device_memory,
        device_memory_label=label,
        host_memory_bytes=host,
        bucket_elements=parse_count(args.bucket_size) if args.bucket_size else None,
    )
    result = plan(facts, inputs)
    print(to_json_text(result) if args.json else format_plan(result))
    return 0
