"""The run directory: refuse to clobber, write files atomically, record environment, metrics and summary.

Layout (docs/run_directory.md describes each file)::

    out_dir/config.yaml  ds_config.json  env.json  metrics.jsonl  tb/  checkpoints/  final/  summary.json

Launchers start every rank as its own process before any process group exists, so "am I rank 0?"
is read from the launcher's environment: ``RANK`` (torchrun, accelerate, deepspeed) or, for the
processes Lightning spawns itself, ``NODE_RANK`` and ``LOCAL_RANK``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import socket
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from common.errors import ConfigError

PACKAGES = ("torch", "deepspeed", "lightning", "accelerate", "transformers", "peft", "tokenizers", "flash-attn")


def launcher_rank() -> int:
    """The global rank the launcher gave this process (0 when not launched as a group)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "LOCAL_RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", 1)) > 1 and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"])  # srun started every rank itself (recipes/launch/slurm_lightning)
    node, local = int(os.environ.get("NODE_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    return node * 1000 + local  # only "is it zero" matters here


def is_launcher_rank_zero() -> bool:
    """True in the one process that should create and write the run directory."""
    return launcher_rank() == 0


def wait_for_rank0_file(path: str | Path, timeout_s: float = 600, poll_s: float = 0.5) -> Path:
    """Wait until rank 0 has written ``path``: ranks on other nodes (or started by srun) start with it, not after.

    Raises:
        ConfigError: ``path`` did not appear within ``timeout_s`` (most often: ``out_dir`` is not on a file system
            that every node sees).
    """
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise ConfigError(
                f"waited {timeout_s:.0f} s for {path}, which rank 0 writes; on several nodes out_dir must be "
                "on a file system that every node sees"
            )
        time.sleep(poll_s)
    return path


def prepare_run_dir(out_dir: str | Path, overwrite: bool = False, resume: bool = False) -> Path:
    """Create ``out_dir`` for a new run, or accept it for a resume; never clobber by accident.

    Args:
        out_dir: the run directory.
        overwrite: delete an existing directory first (the user asked for it).
        resume: continue the run already in ``out_dir``; it must exist and hold checkpoints.

    Raises:
        ConfigError: the directory exists with content and neither flag is set, resume finds no run, or
            ``out_dir`` is a file.
    """
    path = Path(out_dir)
    if resume and overwrite:
        raise ConfigError("resume=true and overwrite=true contradict each other; pick one")
    refuse_file_as_out_dir(path)
    if resume:
        if not (path / "checkpoints").is_dir():
            raise ConfigError(f"resume=true but {path} holds no checkpoints/ to resume from")
        return path
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"out_dir {path} already exists and is not empty; pass overwrite=true to replace it, "
                "resume=true to continue it, or choose another out_dir"
            )
        if is_launcher_rank_zero():
            shutil.rmtree(path)
    if is_launcher_rank_zero():
        path.mkdir(parents=True, exist_ok=True)
    return path


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write JSON to ``path`` through a temporary file and ``os.replace``: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def write_text_atomic(path: str | Path, text: str, durable: bool = False) -> Path:
    """Write text through a temporary file and ``os.replace``; ``durable``: on disk (fsynced) when this returns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_path(path.parent)  # the rename itself
    return path


def fsync_path(path: str | Path) -> None:
    """Flush one file or folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages a run depends on (None when absent)."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def env_info(device: str, world_size: int) -> dict[str, Any]:
    """What ``env.json`` records: versions, device, world size, host, time."""
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "device": device,
        "world_size": world_size,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "packages": package_versions(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


class MetricsLog:
    """``metrics.jsonl`` plus TensorBoard scalars, written by rank 0 only.

    Each record is one JSON object per line (``{"step": 10, "train_loss": 2.3, ...}``) so that a crash
    loses at most the line being written, and ``tensorboard --logdir out_dir/tb`` shows the same numbers.
    """

    def __init__(self, out_dir: str | Path, enabled: bool = True, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.writer = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tb"))
            except ImportError:  # tensorboard missing: metrics.jsonl alone still tells the story
                self.writer = None

    def log(self, step: int, **values: float) -> None:
        """Append one record and mirror numeric values to TensorBoard."""
        if not self.enabled:
            return
        record = {"step": step, **values}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``metrics.jsonl`` (a truncated last line is skipped)."""
    path = Path(out_dir) / "metrics.jsonl"
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def set_cpu_threads(local_processes: int) -> None:
    """One intra-op thread per core per process on a CPU (2 threads per process on 2 cores: 4x slower)."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_processes)))


def free_port() -> int:
    """A TCP port nobody listens on right now (for ``MASTER_PORT``, ``--master_port``, ``--main_process_port``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def refuse_file_as_out_dir(out_dir: str | Path, name: str = "out_dir") -> None:
    """Refuse an ``out_dir`` that is an existing file (or sits below one): a run directory must be a folder.

    ``overwrite=true`` does not change this: it replaces a run directory, never a file the user made.

    Args:
        out_dir: the folder a run or command is about to write into.
        name: how the user gave it (``out_dir``, ``--out``), for the message.
    """
    path = Path(out_dir)
    for folder in (path, *path.parents):
        if folder.exists() and not folder.is_dir():
            where = "is" if folder == path else f"is below {folder}, which is"
            raise ConfigError(f"{name} {path} {where} a file, not a folder; choose another {name}")


RUN_DIR_REMEDY = "pass overwrite=true to replace it, resume=true to continue it, or choose another out_dir"


def refuse_existing_out_dir(
    out_dir: str | Path, resume: bool, overwrite: bool, name: str = "out_dir", remedy: str = RUN_DIR_REMEDY
) -> None:
    """Refuse an output folder that is a file, or exists and is not empty, before anything is read or written.

    A recipe calls it first thing (:func:`prepare_run_dir` acts later); ``zero-recipes export`` calls it before
    it opens the checkpoint (it replaces the folder only once the export has succeeded).

    Args:
        out_dir: the folder about to be written.
        resume: the run continues in it (a recipe's ``resume=true``).
        overwrite: the folder may be replaced.
        name: how the user gave the folder (``out_dir``, ``OUT_DIR``), for the message.
        remedy: what the message tells the user to do about a non-empty folder.

    Raises:
        ConfigError: ``out_dir`` is a file (or below one), or is not empty without ``resume`` or ``overwrite``.
    """
    path = Path(out_dir)
    refuse_file_as_out_dir(path, name)
    if not resume and not overwrite and path.exists() and any(path.iterdir()):
        raise ConfigError(f"{name} {path} already exists and is not empty; {remedy}")


def summary_fields(summary: Any) -> dict[str, Any]:
    """A recipe's summary dataclass as its ``summary.json`` fields, ``communication`` left out when the run did not
    log it (DeepSpeed's comms log off): a run without the log writes the keys it always wrote."""
    fields = dataclasses.asdict(summary)
    if fields.get("communication", {}) is None:
        del fields["communication"]
    return fields
