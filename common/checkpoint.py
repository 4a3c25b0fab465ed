"""Checkpoints that survive a crash, and whole weights out of ZeRO shards.

Crash safety: every rank writes its shards into ``checkpoints/.tmp-step_000100/``; after a barrier
rank 0 renames it to ``checkpoints/step_000100/`` and only then rewrites the ``latest`` file (itself
through a temporary file and ``os.replace``). A crash at any point leaves ``latest`` naming a
complete checkpoint. A ``.tmp-step_*`` folder left by a crash is never read (only ``latest`` is) and
is deleted by the next publish (those of earlier steps) or resume (all) (:func:`clean_partial_checkpoints`).

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
from torch.distributed.tensor import DTensor

from common.errors import ConfigError
from common.rundir import fsync_path, write_text_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """``step_000100`` for step 100 (sorts by name)."""
    return f"step_{step:06d}"


def tmp_checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    """Where ranks write a checkpoint before it is published."""
    return Path(out_dir) / CHECKPOINTS / f".tmp-{step_dir_name(step)}"


def check_retention(keep_last: int, keep_every: int, checkpoint_interval: int) -> None:
    """Refuse retention settings that would delete what a user expects kept (a recipe config calls it).

    Args:
        keep_last: newest complete checkpoints kept; at least 1, since ``latest`` (what resume reads) is one of them.
        keep_every: also keep every checkpoint whose step is a multiple of this, for good (0 = off).
        checkpoint_interval: steps between saves; ``keep_every`` must be a multiple of it, or no saved step would
            ever be a multiple of ``keep_every``.
    """
    if keep_last < 1:
        raise ConfigError(
            f"keep_last must be >= 1, got {keep_last}: the newest checkpoint is the one resume=true reads"
        )
    if keep_every < 0:
        raise ConfigError(f"keep_every must be >= 0 (0 = off), got {keep_every}")
    if keep_every and keep_every % checkpoint_interval:
        fit = -(-keep_every // checkpoint_interval) * checkpoint_interval  # the next multiple up
        raise ConfigError(
            f"keep_every={keep_every} keeps steps that are multiples of {keep_every}, but checkpoints are saved every "
            f"checkpoint_interval={checkpoint_interval} steps, so few or none of them would exist; "
            f"use a multiple of {checkpoint_interval}, e.g. keep_every={fit}"
        )


def retained_steps(steps: list[int], newest: int, keep_last: int, keep_every: int = 0) -> set[int]:
    """The complete checkpoints that stay once step ``newest`` is published (a pure function of step numbers).

    Kept: the ``keep_last`` newest steps up to ``newest`` (``newest`` is always one: never delete the only complete
    checkpoint), every multiple of ``keep_every`` (when > 0), and any step after ``newest``. Those last ones were
    written by an earlier attempt that crashed before ``latest`` moved to them; a resumed run replaces each when it
    gets there, and until then they are not this timeline's to delete.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    up_to_newest = sorted(s for s in set(steps) | {newest} if s <= newest)
    kept = set(up_to_newest[-keep_last:]) | {s for s in steps if s > newest}
    if keep_every > 0:
        kept |= {s for s in up_to_newest if s % keep_every == 0}
    return kept


def publish_checkpoint(out_dir: str | Path, step: int, keep_last: int = 2, keep_every: int = 0) -> Path:
    """Rank 0, after all ranks wrote ``tmp_checkpoint_dir``: rename it into place, move ``latest``, apply retention.

    Older checkpoints are deleted only after ``latest`` names the new, complete one (:func:`retained_steps` says
    which stay), so a crash at any point leaves ``latest`` naming a complete checkpoint.

    Args:
        out_dir: the run directory.
        step: the optimizer step the checkpoint holds.
        keep_last: newest complete checkpoints to keep (>= 1).
        keep_every: also keep every checkpoint whose step is a multiple of this (0 = off).
    """
    root = Path(out_dir) / CHECKPOINTS
    tmp, final = tmp_checkpoint_dir(out_dir, step), root / step_dir_name(step)
    if not tmp.is_dir():  # checked before anything is touched: a failed save must not cost a complete checkpoint
        raise RuntimeError(f"nothing to publish: {tmp} does not exist (did every rank write its shards?)")
    if final.exists() and _latest_name(root) == final.name:
        # The published checkpoint of this very step is complete and is what resume reads; replacing it would open a
        # window with no complete checkpoint, and a save of the same step holds the same state. Keep it.
        shutil.rmtree(tmp)
    else:
        if final.exists():  # left by an attempt that crashed before `latest` reached it: not what resume reads
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(root)  # the rename on disk before `latest` names it
        write_text_atomic(root / LATEST, final.name + "\n", durable=True)
    steps = {checkpoint_step(p): p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)}
    kept = retained_steps(list(steps), step, keep_last, keep_every)
    for old_step, path in steps.items():
        if old_step not in kept:
            shutil.rmtree(path, ignore_errors=True)
    clean_partial_checkpoints(out_dir, before=step)
    return final


def _latest_name(root: Path) -> str | None:
    """What the ``latest`` pointer says, as written (None without one)."""
    pointer = root / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def clean_partial_checkpoints(out_dir: str | Path, before: int | None = None) -> list[Path]:
    """Rank 0: delete ``.tmp-step_*`` folders a crash left half written; return them.

    Args:
        out_dir: the run directory.
        before: only those of earlier steps (a publish: with asynchronous saves, another rank may already be writing
            a later step's folder); None: all of them (at resume, before any rank saves).
    """
    root = Path(out_dir) / CHECKPOINTS
    partial = sorted(root.glob(".tmp-step_*")) if root.is_dir() else []
    partial = [path for path in partial if before is None or int(path.name.rsplit("_", 1)[1]) < before]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is none; a dangling pointer is an error."""
    root = Path(out_dir) / CHECKPOINTS
    name = _latest_name(root)
    if name is None:
        return None
    path = root / name
    if not _STEP_DIR.match(name) or not path.is_dir():
        raise ConfigError(f"{root / LATEST} names {name!r}, which is not a complete checkpoint in {root}")
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
    """Whole parameters and buffers of a (possibly ZeRO-3-partitioned or FSDP2-sharded) module, on rank 0 only.

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
            whole = param.detach()
            if isinstance(whole, DTensor):  # an FSDP2 shard: every rank takes part in gathering it
                whole = whole.full_tensor()
            if rank == 0:
                tensor = whole.to("cpu", copy=True)
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
