"""LoRA for the fine-tuning recipe: the peft config from target names, saving adapters, checking they are whole.

Plain peft and transformers code; nothing here imports DeepSpeed. Under ZeRO-3 every rank holds 1/N of each LoRA
matrix, and a plain ``save_pretrained`` writes those shards as they are: tensors of shape ``[0]`` (peft#2500,
accelerate#3508, DeepSpeed#4295). So :func:`save_adapter` takes a state dict the caller gathered
(``common.checkpoint.gather_full_state_dict``), and :func:`check_adapter` reads the saved file back and refuses an
adapter with a missing, empty, wrong-shaped or all-zero tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from nlp.model import ModelError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Short names of the model's ``nn.Linear`` layers (``q_proj``, ``down_proj``, ...): what LoRA can target.

    The output projection (``lm_head``) is left out: adapting it is not LoRA on a transformer block.
    """
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names.discard("lm_head")
    return sorted(names)


def check_target_modules(targets: Sequence[str], available: Sequence[str]) -> list[str]:
    """Return ``targets`` if every name is a Linear layer of the model, else raise naming the nearest valid names.

    Raises:
        ModelError: For an empty list, or for each unknown name with its nearest valid one.
    """
    from common.errors import nearest

    if not targets:
        raise ModelError(f"lora_targets is empty; choose from {', '.join(available)}")
    unknown = [t for t in targets if t not in available]
    if unknown:
        hints = "; ".join(f"{t!r}{nearest(t, available) or ' (no close match)'}" for t in unknown)
        raise ModelError(f"unknown LoRA target module(s): {hints}; this model's Linear layers: {', '.join(available)}")
    return list(targets)


def lora_config(targets: Sequence[str], available: Sequence[str], r: int, alpha: float, dropout: float) -> Any:
    """A peft ``LoraConfig`` for a causal LM, after checking the target names against the model's layers."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=check_target_modules(targets, available),
        bias="none",
    )


def trainable_parameter_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Whole shape of every trainable parameter (``ds_shape`` when ZeRO-3 has partitioned it)."""
    return {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in model.named_parameters() if p.requires_grad}


def adapter_key(param_name: str, adapter_name: str = "default") -> str:
    """The key a trainable parameter has in ``adapter_model.safetensors`` (peft drops the adapter name)."""
    return param_name.replace(f".{adapter_name}.", ".")


def save_adapter(peft_model: Any, gathered_state: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """Write the adapter in peft format (``adapter_config.json``, ``adapter_model.safetensors``).

    Args:
        peft_model: the ``PeftModel`` (``engine.module`` under DeepSpeed).
        gathered_state: whole tensors by parameter name, gathered on this rank (partitioned ones are empty).
        out_dir: the adapter folder, created if needed.
    """
    out_dir = Path(out_dir)
    peft_model.save_pretrained(str(out_dir), state_dict=gathered_state, safe_serialization=True)
    return out_dir


def check_adapter(adapter_dir: str | Path, expected_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Read a saved adapter back and check it against the trainable parameters it should hold.

    Every trainable parameter must be in the file with its whole shape and a finite, non-zero norm, and the file
    must hold nothing else. An adapter saved from ZeRO-3 shards fails this (shape ``[0]``), and so does one whose
    ``lora_B`` never left its zero init (norm 0: the adapter does nothing).

    Args:
        adapter_dir: a folder written by :func:`save_adapter`.
        expected_shapes: :func:`trainable_parameter_shapes` of the trained model.

    Returns:
        ``{"tensors", "trainable_tensors", "elements", "min_norm", "bytes"}``.

    Raises:
        ModelError: Naming the first problems found.
    """
    from safetensors.torch import load_file

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file() or not (Path(adapter_dir) / ADAPTER_CONFIG).is_file():
        raise ModelError(f"{adapter_dir}: no {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}; not a peft adapter folder")
    saved = load_file(str(path))
    expected = {adapter_key(name): shape for name, shape in expected_shapes.items()}
    problems = [f"{k}: missing" for k in expected if k not in saved]
    problems += [f"{k}: not a trainable parameter" for k in saved if k not in expected]
    norms = []
    for key, tensor in saved.items():
        if key not in expected:
            continue
        if tuple(tensor.shape) != expected[key]:
            problems.append(f"{key}: shape {list(tensor.shape)}, expected {list(expected[key])}")
            continue
        norm = tensor.float().norm().item()
        norms.append(norm)
        if not math.isfinite(norm) or norm == 0.0:
            problems.append(f"{key}: norm {norm}")
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ModelError(f"{path}: adapter is incomplete: {'; '.join(problems[:3])}{more}")
    return {
        "tensors": len(saved),
        "trainable_tensors": len(expected),
        "elements": sum(t.numel() for t in saved.values()),
        "min_norm": min(norms),
        "bytes": path.stat().st_size,
    }


def folder_bytes(paths: Iterable[Path]) -> int:
    """Total size of the files under the given folders (checkpoint sizes)."""
    return sum(f.stat().st_size for p in paths for f in Path(p).rglob("*") if f.is_file())
