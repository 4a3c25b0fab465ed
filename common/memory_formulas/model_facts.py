"""Model facts: what the planner needs to know about a model (:class:`ModelFacts`), from a module, a
config or a bare parameter count."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError

# When only a parameter count is given, assume a Llama-like shape: hidden / layers = 128 (Llama-2 7B
# and 13B), head size 128, vocabulary 32000, MLP 8/3 x hidden.
ASSUMED_ASPECT = 128
ASSUMED_HEAD_DIM = 128
ASSUMED_VOCAB = 32000


# Model types whose blocks are Llama's: RMSNorm computed in float32, rotary embeddings, gated (SwiGLU) MLP.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")


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


def facts_from_module(model: Any, *, architecture: str, hidden_size: int | None, recipe: str) -> ModelFacts:
    """Model facts of a module a recipe built on the ``meta`` device (exact counts, no memory used).

    Args:
        model: the ``torch.nn.Module``, usually on ``meta``.
        architecture: what the planner is told the model is (not ``transformer``: its activations are not estimated).
        hidden_size: the model's width, which scales the presets' bucket sizes; None when it has none.
        recipe: the recipe's name, for the facts' source.

    Returns:
        The parameter counts (shared ones once), each parameter's size and where they come from.
    """
    total, largest = count_module(model)
    return ModelFacts(
        num_params=total,
        largest_layer_params=largest,
        architecture=architecture,
        hidden_size=hidden_size,
        param_numels=param_numels(model),
        source=f"recipe {recipe} ({type(model).__name__}, counted on the meta device)",
    )


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
