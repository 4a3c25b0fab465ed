"""Llama models for the NLP recipes: named sizes, construction, attention choice, FLOPs.

Plain transformers code. The recipes wrap construction in DeepSpeed's ``zero.Init`` context
themselves (ZeRO-3 partitions the weights as they are created); nothing here imports DeepSpeed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

ATTENTION_CHOICES = ("auto", "flash_attention_2", "sdpa", "eager")
FLASH_INSTALL_HINT = "pip install zero-recipes[flash]"

# Named sizes as LlamaConfig keyword arguments. ``vocab_size`` is each reference model's own; a
# run's tokenizer overrides it (build_llama_config).
LLAMA_SIZES: dict[str, dict[str, Any]] = {
    # About 5.3M parameters with vocab 4096: learns the standard library in minutes on a CPU.
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 688,
        "vocab_size": 4096,
        "max_position_embeddings": 256,
    },
    # GPT-3 Small shape (125M with a 50k vocabulary) in Llama form.
    "125m": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "intermediate_size": 2048,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
    # TinyLlama-1.1B: grouped-query attention with 4 key/value heads.
    "1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 5632,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
    # Llama-2-7B: the usual example of ZeRO's memory arithmetic (16 B/param: 112 GB on one GPU).
    "7b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    # Llama-3-8B: grouped-query attention (8 key/value heads), a 128k vocabulary, rope_theta 500000; the long-context
    # config (configs/llama_8b_long.yaml) runs it with Ulysses sequence parallelism.
    "8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
}


def _dtype_kwarg() -> str:
    # transformers 4.56 renamed torch_dtype to dtype (the old name warns in 5.x); the project allows both eras.
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


class ModelError(ValueError):
    """A model folder or size that cannot be used; the message says which and why."""


def special_token_ids(tokenizer: Any) -> dict[str, int | None]:
    """A model config's bos, eos and pad token ids from the tokenizer (pad falls back to eos: the BPE has none)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad}


def build_llama_config(
    size: str = "tiny",
    vocab_size: int | None = None,
    seq_len: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    tie_word_embeddings: bool = False,
    **overrides: Any,
) -> LlamaConfig:
    """Build the LlamaConfig of a named size.

    Args:
        size: A key of :data:`LLAMA_SIZES`.
        vocab_size: Vocabulary size; defaults to ``len(tokenizer)``, then to the size's own.
        seq_len: Training sequence length; ``max_position_embeddings`` is raised to it if needed.
        tokenizer: Source of the bos/eos/pad token ids (and of the vocabulary size).
        tie_word_embeddings: Share the input embedding with the output projection.
        **overrides: Further LlamaConfig fields, applied last.

    Returns:
        The config.

    Raises:
        ModelError: On an unknown size or a vocabulary smaller than the tokenizer's.
    """
    if size not in LLAMA_SIZES:
        raise ModelError(f"unknown Llama size {size!r}; choose one of {', '.join(LLAMA_SIZES)}")
    kwargs = dict(LLAMA_SIZES[size])
    if tokenizer is not None:
        if vocab_size is not None and vocab_size < len(tokenizer):
            raise ModelError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
        kwargs["vocab_size"] = vocab_size if vocab_size is not None else len(tokenizer)
        kwargs.update(special_token_ids(tokenizer))
    elif vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    if seq_len is not None:
        kwargs["max_position_embeddings"] = max(int(seq_len), kwargs["max_position_embeddings"])
    kwargs["tie_word_embeddings"] = tie_word_embeddings
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_model_from_config(
    config: LlamaConfig, attn_implementation: str = "sdpa", dtype: torch.dtype | None = None
) -> LlamaForCausalLM:
    """Create a randomly initialised LlamaForCausalLM.

    Call it inside ``deepspeed.zero.Init`` to create the weights already partitioned.

    Args:
        config: Model config.
        attn_implementation: A resolved choice (see :func:`resolve_attention`), not ``auto``.
        dtype: Parameter dtype; None keeps torch's default (fp32).
    """
    if attn_implementation == "auto":
        raise ValueError("resolve 'auto' with resolve_attention() before building the model")
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation}
    if dtype is not None:
        kwargs[_dtype_kwarg()] = dtype
    return AutoModelForCausalLM.from_config(config, **kwargs)


def load_pretrained(
    folder: str | Path,
    torch_dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM from a local Hugging Face folder (never from a hub).

    Args:
        folder: Folder with ``config.json`` and weights (e.g. a run's ``final/``).
        torch_dtype: Parameter dtype; None loads the dtype saved in the folder.
        attn_implementation: A resolved choice (see :func:`resolve_attention`), not ``auto``.
        trust_remote_code: Allow model code shipped inside the folder to run.

    Raises:
        ModelError: If the folder or its ``config.json`` is missing, or loading fails.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ModelError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: no config.json; expected a Hugging Face model folder (save_pretrained output)")
    if attn_implementation == "auto":
        raise ValueError("resolve 'auto' with resolve_attention() before loading the model")
    kwargs: dict[str, Any] = {
        "attn_implementation": attn_implementation,
        "local_files_only": True,
        "trust_remote_code": trust_remote_code,
    }
    if torch_dtype is not None:
        kwargs[_dtype_kwarg()] = torch_dtype
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{path}: cannot load the model ({exc})") from exc


def flash_attn_installed() -> bool:
    """Whether the ``flash_attn`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(requested: str, device_type: str, dtype: torch.dtype, flash_installed: bool | None = None) -> str:
    """Choose the attention implementation to pass to transformers.

    ``auto`` takes FlashAttention-2 where it runs (package installed, CUDA device, bf16 or fp16)
    and PyTorch's SDPA otherwise. An explicit ``flash_attention_2`` that cannot run is an error
    naming every reason, rather than a silent fallback that would change the run's speed.

    Args:
        requested: ``auto``, ``flash_attention_2``, ``sdpa`` or ``eager``.
        device_type: ``torch.device.type`` of the run (``cuda``, ``cpu``, ...).
        dtype: Compute dtype of the model (the autocast or parameter dtype).
        flash_installed: Whether flash-attn is installed; None checks with :func:`flash_attn_installed`.

    Returns:
        ``flash_attention_2``, ``sdpa`` or ``eager``.

    Raises:
        ValueError: On an unknown choice, or ``flash_attention_2`` where it cannot run.
    """
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"unknown attention {requested!r}; choose one of {', '.join(ATTENTION_CHOICES)}")
    if requested in ("sdpa", "eager"):
        return requested
    installed = flash_attn_installed() if flash_installed is None else flash_installed
    reasons = []
    if not installed:
        reasons.append(f"flash-attn is not installed ({FLASH_INSTALL_HINT})")
    if device_type != "cuda":
        reasons.append(f"no GPU (device is {device_type})")
    if dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"dtype is {str(dtype).removeprefix('torch.')} (FlashAttention needs bf16 or fp16)")
    if requested == "auto":
        return "sdpa" if reasons else "flash_attention_2"
    if reasons:
        raise ValueError("attention flash_attention_2 cannot run here: " + "; ".join(reasons))
    return requested


def llama_block_class() -> type[torch.nn.Module]:
    """The decoder layer class: the unit of activation checkpointing and of FSDP-style wrapping."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def _head_dim(config: LlamaConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama_param_count(config: LlamaConfig, include_input_embedding: bool = True) -> int:
    """Count a LlamaForCausalLM's parameters from its config alone.

    Works without building the model (and so under ZeRO-3, where the built parameters are
    partitioned and report size 0). Biases are counted where the config enables them.

    Args:
        config: Model config.
        include_input_embedding: Count the input embedding table. With tied embeddings the one
            shared matrix is counted once, as the output projection, either way.
    """
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = _head_dim(config)
    q_out = config.num_attention_heads * head_dim
    kv_out = (config.num_key_value_heads or config.num_attention_heads) * head_dim
    attn = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if getattr(config, "attention_bias", False):
        attn += q_out + 2 * kv_out + hidden
    mlp = 3 * hidden * inter + ((2 * inter + hidden) if getattr(config, "mlp_bias", False) else 0)
    per_layer = attn + mlp + 2 * hidden  # two RMSNorm weights
    embedding = config.vocab_size * hidden
    total = layers * per_layer + hidden + embedding  # final norm + output projection
    if include_input_embedding and not config.tie_word_embeddings:
        total += embedding
    return total


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N + 12 L H Q T`` (PaLM, Chowdhery et al. 2022, appendix B).

    ``6 N`` is the forward (2 N) and backward (4 N) cost of the weight matmuls, with N the
    parameters that take part in a matmul: every parameter except the input embedding table,
    which is a lookup (the output projection is a matmul and counts). ``12 L H Q T`` is the
    attention score and value matmuls, with L layers, H heads, Q head dimension and T the
    sequence length, counted over the full (non-causal) matrix as PaLM does. Model FLOPs
    utilisation (MFU) divides ``tokens/s x flops_per_token`` by the hardware's peak FLOP/s;
    activation recomputation is deliberately not counted.

    Args:
        config: Model config.
        seq_len: Training sequence length T.

    Returns:
        FLOPs per trained token.
    """
    n_matmul = llama_param_count(config, include_input_embedding=False)
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * _head_dim(config) * seq_len
    return float(6 * n_matmul + attention)


@torch.no_grad()
def generate_sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    max_new_tokens: int = 64,
    **generate_kwargs: Any,
) -> str:
    """Greedily continue ``prompt`` and return only the new text.

    Under ZeRO-3 the weights are partitioned: call this on every rank (DeepSpeed gathers the
    weights layer by layer) or on a gathered copy, never on one rank alone.

    Args:
        generate_kwargs: Further ``model.generate`` arguments (e.g. ``repetition_penalty``).
    """
    device = next(model.parameters()).device
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    if tokenizer.bos_token_id is not None:
        # Training documents follow an end-of-text token, so a prompt starts the same way.
        ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
    ids = ids.to(device)
    was_training = model.training
    model.eval()
    try:
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **generate_kwargs,
        )
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
