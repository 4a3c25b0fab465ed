"""Launching a test worker (worker.py, tiers_worker.py) on both backends and reading what each rank wrote.

The worker takes ``--backend``; Lightning starts its ranks itself, Accelerate gets the launch files the factory
writes for the same DeepSpeed dict. Each rank leaves ``rank{r}.json`` in ``--out``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from _util import PYTHON, accelerate_launch, run

from common.strategy import RunFacts, resolve_deepspeed_config, write_accelerate_files


def launch_worker(
    worker: Path,
    backend: str,
    args: list[str],
    out: Path,
    preset: str,
    facts: RunFacts,
    overrides: list[str] = (),
    timeout: float = 900,
) -> list[dict]:
    """Run ``worker`` with ``args`` on ``facts.world_size`` processes; returns each rank's record, rank order.

    ``overrides`` are ``key=value`` DeepSpeed fields over the preset: the worker gets them as ``--set`` (add them
    to ``args``), the Accelerate launch files from here.
    """
    if backend == "lightning":
        run([PYTHON, worker, *args], timeout=timeout)
    else:
        ds = resolve_deepspeed_config(preset, facts, dict(o.split("=", 1) for o in overrides))
        config = write_accelerate_files(ds, out / "launch", num_processes=facts.world_size)
        accelerate_launch(worker, args, config, num_processes=facts.world_size, timeout=timeout)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(facts.world_size)]


def launched_once(tmp_path_factory, launch: Callable[..., list[dict]]) -> Callable[..., list[dict]]:
    """``get(*key)``: ``launch(*key, out)`` the first time a key is asked for (``out`` a fresh folder), its records
    every time: a module's tests share each run."""
    cache: dict[tuple, list[dict]] = {}

    def get(*key) -> list[dict]:
        if key not in cache:
            cache[key] = launch(*key, tmp_path_factory.mktemp("-".join(map(str, key))))
        return cache[key]

    return get


def mean_losses(records: list[dict]) -> list[float]:
    """The global loss per step: the mean over ranks of each rank's micro-batch loss."""
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in records))]


def relative_gap(a: list[float], b: list[float]) -> float:
    """The largest relative difference of ``a`` from ``b``, step by step."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
