"""Checkpoints that survive a crash, and whole weights out of ZeRO shards.

Crash safety: every rank writes its shards into ``checkpoints/.tmp-step_000100/``; after a barrier
rank 0 renames it to ``checkpoints/step_000100/`` and only then rewrites the ``latest`` file (itself
through a temporary file and ``os.replace``). A crash at any point leaves ``latest`` naming a
complete checkpoint. A ``.tmp-step_*`` folder left by a crash is never read (only ``latest`` is) and
is deleted by the next publish or resume (:func:`clean_partial_checkpoints`).

Whole weights: under ZeRO-3 every rank holds 1/N of each parameter. :func:`gather_full_state_dict`
gathers one parameter at a time (``deepspeed.zero.GatheredParameters``), so the peak is the state
dict on rank 0 plus one parameter, never the whole model on every rank.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from common.errors import ConfigError
from common.rundir import write_text_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """``step_000100`` for step 100 (sorts by name)."""
    return f"step_{step:06d}"


def tmp_checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    """Where ranks write a checkpoint before it is published."""
    return Path(out_dir) / CHECKPOINTS / f".tmp-{step_dir_name(step)}"


def publish_checkpoint(out_dir: str | Path, step: int, keep_last: int = 2) -> Path:
    """Rank 0, after all ranks wrote ``tmp_checkpoint_dir``: rename it into place, then move ``latest``.

    Args:
        out_dir: the run directory.
        step: the optimizer step the checkpoint holds.
        keep_last: complete checkpoints to keep (older ones are deleted after ``latest`` moved).
    """
    root = Path(out_dir) / CHECKPOINTS
    tmp, final = tmp_checkpoint_dir(out_dir, step), root / step_dir_name(step)
    if final.exists():  # the same step saved again (e.g. the last step): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_text_atomic(root / LATEST, final.name + "\n")
    steps = sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))
    for old in steps[:-keep_last] if keep_last > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    clean_partial_checkpoints(out_dir)
    return final


def clean_partial_checkpoints(out_dir: str | Path) -> list[Path]:
    """Rank 0, while no rank is saving: delete ``.tmp-step_*`` folders a crash left half written; return them."""
    root = Path(out_dir) / CHECKPOINTS
    partial = sorted(root.glob(".tmp-step_*")) if root.is_dir() else []
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is none; a dangling pointer is an error."""
    root = Path(out_dir) / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not _STEP_DIR.match(name) or not path.is_dir():
        raise ConfigError(f"{pointer} names {name!r}, which is not a complete checkpoint in {root}")
    return path


def checkpoint_step(path: str | Path) -> int:
    """The step number of a ``step_XXXXXX`` directory."""
    match = _STEP_DIR.match(Path(path).name)
    if not match:
        raise ConfigError(f"{path} is not a step_XXXXXX checkpoint directory")
    return int(match.group(1))


def gather_full_state_dict(
    module: torch.nn.Module, rank: int, dtype: torch.dtype | None = None
) -> dict[str, Any] | None:
    """Whole parameters and buffers of a (possibly ZeRO-3-partitioned) module, on rank 0 only.

    Every rank must call it (the gathers are collective). Parameters are gathered one at a time and
    copied to CPU on rank 0, so no rank ever holds the whole model on the accelerator.

    Args:
        module: the model (``engine.module`` under DeepSpeed).
        rank: this process's global rank.
        dtype: cast floating-point tensors to this dtype (default: keep the training dtype).

    Returns:
        ``{name: tensor}`` on rank 0, None on the other ranks.
    """
    import deepspeed

    state: dict[str, Any] = {}
    for name, param in module.named_parameters():
        partitioned = hasattr(param, "ds_id")
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None, enabled=partitioned):
            if rank == 0:
                tensor = param.detach().to("cpu", copy=True)
                state[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    if rank == 0:
        for name, buffer in module.named_buffers():
            tensor = buffer.detach().to("cpu", copy=True)
            state[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        return state
    return None


def save_hf_model(
    model: Any, state_dict: dict[str, Any], out_dir: str | Path, tokenizer: Any = None, max_shard_size: str = "5GB"
) -> Path:
    """Save a transformers model with the gathered weights as safetensors (plus tokenizer), atomically.

    The folder is written as ``.tmp-<name>`` and renamed, so a crash never leaves a half ``final/``.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
