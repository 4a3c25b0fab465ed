"""Resuming a run: what may change, where to resume from, and resuming on a different number of processes.

``resume=true`` continues the run in ``out_dir`` from the checkpoint ``checkpoints/latest`` names (a
complete one: see :mod:`common.checkpoint`). Three things are checked before any work:

* the new config against the run's saved ``config.yaml``: keys that only say how long or where to run
  (:data:`RESUMABLE_KEYS`) may change, any other difference (model, precision, preset, data, seed...) is
  refused with the list of what differs;
* that a complete checkpoint exists and lies before ``max_steps``;
* the world size the checkpoint was written with (one ZeRO optimizer shard per data-parallel rank).

A ZeRO checkpoint is partitioned by rank: DeepSpeed refuses to load one written by 2 processes into 1 or
4. When the world size differs, the checkpoint is converted with DeepSpeed's own
``deepspeed.checkpoint.ds_to_universal`` into ``out_dir/universal/step_XXXXXX`` (never over the original),
and loaded with ``checkpoint: {load_universal: true}`` in the DeepSpeed config, which re-partitions every
parameter and its Adam moments for the new world size. The conversion needs ``universal_checkpoint_info``
in the saved client state: :func:`mark_universal` puts it on the module before DeepSpeed wraps it.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.checkpoint import checkpoint_step, latest_checkpoint
from common.errors import ConfigError

# Keys that may differ between a run and its resume: how long to train, how often to log/evaluate/save,
# how many processes, how the global batch is cut into micro-batches, how long to wait in a collective.
RESUMABLE_KEYS = frozenset(
    {
        "out_dir",
        "resume",
        "overwrite",
        "max_steps",
        "devices",
        "num_nodes",
        "micro_batch_size",
        "grad_accum",
        "pipeline_micro_batches",  # train_pipeline.py's name for grad_accum
        "eval_interval",
        "checkpoint_interval",
        "keep_last",
        "keep_every",
        "async_save",  # how saves are written, not what they hold
        "log_interval",
        "collective_timeout_s",
        "data_workers",
    }
)
UNIVERSAL = "universal"
LATEST_UNIVERSAL = "latest_universal"  # the tag file DeepSpeed reads when load_universal is on
_OPTIM_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
_MISSING = "<not set>"


def config_differences(saved: dict[str, Any], current: dict[str, Any], allowed=RESUMABLE_KEYS) -> list[str]:
    """``key: saved -> current`` for every key that differs and may not change on resume."""
    lines = []
    for key in sorted(set(saved) | set(current)):
        if key in allowed:
            continue
        old, new = saved.get(key, _MISSING), current.get(key, _MISSING)
        if old != new:
            lines.append(f"{key}: {old!r} -> {new!r}")
    return lines


def check_resume_config(out_dir: str | Path, current: dict[str, Any]) -> dict[str, Any]:
    """Refuse a resume whose config differs from the run's ``config.yaml`` outside :data:`RESUMABLE_KEYS`.

    Returns:
        The saved config.
    """
    path = Path(out_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"resume=true but {path} is missing: {out_dir} is not a run directory of this recipe")
    saved = yaml.safe_load(path.read_text()) or {}
    differences = config_differences(saved, current)
    if differences:
        raise ConfigError(
            f"resume=true with a config that differs from the run in {out_dir} ({'; '.join(differences)}); "
            f"only {', '.join(sorted(RESUMABLE_KEYS - {'out_dir', 'resume', 'overwrite'}))} may change on resume: "
            "start a new run (another out_dir) to change the rest"
        )
    return saved


def saved_world_size(checkpoint: str | Path) -> int | None:
    """Data-parallel ranks that wrote ``checkpoint``: its ZeRO optimizer shards, one per rank (None: no ZeRO)."""
    ranks: set[int] = set()
    for path in Path(checkpoint).glob("*/*_optim_states.pt"):
        match = _OPTIM_SHARD.match(path.name)
        if match:
            ranks.add(int(match.group(1)))
    return len(ranks) or None


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts.

    Attributes:
        checkpoint: the complete checkpoint ``latest`` names.
        step: its optimizer step.
        saved_world_size: ranks that wrote it (None for a stage-0 checkpoint, which is not partitioned).
        world_size: ranks of this run.
        saved_config: the run's ``config.yaml`` (for the global batch it trained with).
    """

    checkpoint: Path
    step: int
    saved_world_size: int | None
    world_size: int
    saved_config: dict[str, Any] = field(default_factory=dict)

    @property
    def universal(self) -> bool:
        """Whether the shards must be re-partitioned (through a universal checkpoint) for this world size."""
        return self.saved_world_size is not None and self.saved_world_size != self.world_size

    @property
    def load_path(self) -> Path:
        """What to hand to the backend's load: the checkpoint itself, or its universal conversion."""
        return universal_path(self.checkpoint) if self.universal else self.checkpoint

    def message(self, current: dict[str, Any]) -> str:
        """One line for the log saying what is resumed, and what changed with the process count."""
        text = f"resuming from {self.checkpoint} (step {self.step})"
        if self.universal:
            text += (
                f": written by {self.saved_world_size} processes, resumed on {self.world_size}; "
                f"converted to a universal checkpoint in {self.load_path}"
            )
            before = global_batch(self.saved_config, self.saved_world_size)
            after = global_batch(current, self.world_size)
            if before != after:
                text += (
                    f"; the global batch changes from {before} to {after} samples "
                    "(scale micro_batch_size or grad_accum with the process count to keep it)"
                )
            else:
                text += f"; the global batch stays {after} samples"
        return text


def global_batch(config: dict[str, Any], world_size: int | None) -> int | None:
    """Samples per optimizer step: micro_batch_size x grad_accum x world size (None when unknown)."""
    if world_size is None or "micro_batch_size" not in config:
        return None
    return int(config["micro_batch_size"]) * int(config.get("grad_accum", 1)) * world_size


def find_resume_point(out_dir: str | Path, current: dict[str, Any], world_size: int) -> ResumePoint:
    """Check the config against the run's and find the checkpoint to resume from.

    Refuses (ConfigError) a config that differs outside :data:`RESUMABLE_KEYS`, a run with no complete
    checkpoint, and a checkpoint at or past ``max_steps``.
    """
    saved = check_resume_config(out_dir, current)
    latest = latest_checkpoint(out_dir)
    if latest is None:
        raise ConfigError(f"resume=true but {Path(out_dir) / 'checkpoints'} holds no complete checkpoint")
    step, max_steps = checkpoint_step(latest), current["max_steps"]
    if step >= max_steps:
        raise ConfigError(f"{latest} is at step {step}, max_steps is {max_steps}: raise max_steps to train on")
    return ResumePoint(latest, step, saved_world_size(latest), world_size, saved)


def universal_path(checkpoint: str | Path) -> Path:
    """``out_dir/universal/step_XXXXXX`` for ``out_dir/checkpoints/step_XXXXXX``."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent / UNIVERSAL / checkpoint.name


def with_universal_load(ds_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of the DeepSpeed dict that loads universal checkpoints (``checkpoint.load_universal``)."""
    config = copy.deepcopy(ds_config)
    config.setdefault("checkpoint", {})["load_universal"] = True
    return config


def mark_universal(module: Any) -> None:
    """Make DeepSpeed save ``universal_checkpoint_info`` with this module's checkpoints (ds_to_universal needs it).

    Set on the module DeepSpeed wraps (the engine reads ``engine.module.universal_checkpoint_info`` at save).
    """
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    setattr(module, UNIVERSAL_CHECKPOINT_INFO, {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE})


def _tag_dirs(checkpoint: Path) -> list[Path]:
    """DeepSpeed's folders inside a checkpoint (Lightning: ``checkpoint/``, Accelerate: ``pytorch_model/``)."""
    return sorted(p for p in checkpoint.iterdir() if p.is_dir() and any(p.glob("*mp_rank_*_model_states.pt")))


def convert_to_universal(checkpoint: str | Path) -> Path:
    """Convert ``checkpoint`` into :func:`universal_path` (rank 0 only; the original is only read).

    Each DeepSpeed folder inside goes through ``python -m deepspeed.checkpoint.ds_to_universal``; the
    backend's own files beside it (Accelerate's scheduler and RNG states) are copied. The result is
    written as ``.tmp-step_XXXXXX`` and renamed, so a crash here never leaves a half conversion in use;
    an existing conversion is reused.
    """
    checkpoint = Path(checkpoint)
    target = universal_path(checkpoint)
    if (target / LATEST_UNIVERSAL).is_file():
        return target
    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tags = _tag_dirs(checkpoint)
    if not tags:
        raise ConfigError(f"{checkpoint} holds no DeepSpeed model states (*mp_rank_*_model_states.pt)")
    for tag in tags:
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag)]
        command += ["--output_folder", str(tmp / tag.name), "--num_extract_workers", "1", "--num_merge_workers", "1"]
        proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConfigError(f"converting {tag} to a universal checkpoint failed: {last}")
    for path in checkpoint.iterdir():
        if path.is_file() and path.name != "latest":
            shutil.copy2(path, tmp / path.name)
    (tmp / LATEST_UNIVERSAL).write_text(tags[0].name + "\n")
    os.replace(tmp, target)
    return target


def prepare_resume(point: ResumePoint, current: dict[str, Any]) -> None:
    """Rank 0, before any rank loads or saves: delete a crash's half-written checkpoints, convert to a
    universal checkpoint when the process count changed, and say what is resumed."""
    from common.checkpoint import clean_partial_checkpoints

    clean_partial_checkpoints(point.checkpoint.parent.parent)
    if point.universal:
        convert_to_universal(point.checkpoint)
    print(point.message(current), flush=True)


def _torch_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside DeepSpeed's and Accelerate's wrappers."""
    import torch

    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


@contextmanager
def param_groups_kept(optimizer: Any) -> Iterator[None]:
    """Put each param group's hyperparameters (weight decay, betas...) back after a checkpoint load.

    DeepSpeed 0.19's ZeRO-3 universal load (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) copies
    the saved param group 0's settings into *every* group, so the recipes' no-decay group (norms, biases)
    would start decaying. The settings are the run's own (the config cannot change on resume), so the
    values from before the load are the right ones; the learning rate is left to the loaded state.
    """
    inner = _torch_optimizer(optimizer)
    kept = [{key: value for key, value in group.items() if key not in ("params", "lr")} for group in inner.param_groups]
    yield
    for group, settings in zip(_torch_optimizer(optimizer).param_groups, kept):
        group.update(settings)
