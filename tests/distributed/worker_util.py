"""What the distributed test workers share: joining the gloo group, a quiet Lightning trainer, one JSON record a rank.

The workers run as scripts (``python tests/distributed/x_worker.py``, under torchrun or ``accelerate launch``), so
their folder is on ``sys.path`` and they import this module by its bare name.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import deepspeed
import torch


def setup_gloo_rank() -> tuple[int, int]:
    """Keep this process to one intra-op thread (two ranks share two cores) and join the gloo process group through
    DeepSpeed, as ``deepspeed.initialize`` would. Returns ``(rank, world size)``."""
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def quiet_cpu_trainer(devices: int, max_steps: int, **trainer_kwargs):
    """A Lightning ``Trainer`` on CPU that writes and prints nothing of its own: no logger, no checkpoint callback,
    no progress bar, no model summary. A worker records what its test reads itself; ``trainer_kwargs`` carry the
    strategy (``lightning_trainer_kwargs``, ``lightning_fsdp2_trainer_kwargs``) and anything else the worker sets,
    such as ``use_distributed_sampler=False`` when each rank already holds its own batches."""
    # Imported here: the Accelerate and plain-torch paths of the same workers never pay for importing Lightning.
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )


def write_rank_record(out: Path | str, rank: int, record: dict) -> Path:
    """Write one rank's results as ``out/rank{rank}.json`` (the folder is created if needed); returns the file."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{rank}.json"
    path.write_text(json.dumps(record, indent=1))
    return path


def run_then_exit(main: Callable[[], None]) -> NoReturn:
    """Run a worker's ``main`` and leave without interpreter shutdown once it returns.

    A worker's records are written when ``main`` returns; what remains is tearing down objects torch and DeepSpeed
    keep in module globals (DeepSpeed's process-group tables, gloo's work queues). Done by a finalizing interpreter,
    that teardown aborted a rank in CI after its records were written ("terminate called without an active
    exception", SIGABRT, twice in stage-3 runs; destroying the process group first did not prevent it; ZenFlow's
    one-process run later failed its test the same way, its record written), and the test failed for nothing it
    checks. An exception from ``main`` still ends the process as usual: traceback, exit code 1.
    """
    main()
    # Interpreter exit would end the daemon processes a library started (ZenFlow's optimizer process); so does this.
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=30)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
