"""DeepSpeed's communication log of a training run, per optimizer step: for a run's ``summary.json``, the probe and
``bench/communication.py``.

DeepSpeed counts every collective it calls through ``deepspeed.comm`` when its ``comms_logger`` is on
(``deepspeed.comm.comm.comms_logger.comms_dict``: per op, per message size, the count and each call's latency) but
never says which step a call belonged to. This module cuts its log at optimizer steps, two ways in:

- inside a run: a recipe's DeepSpeed config with ``comms_logger.enabled`` (``ds_overrides=[comms_logger.enabled=true]``)
  makes ``common.process_setup.setup_process`` call :func:`setup_comms_log`, and rank 0 of every recipe puts
  :func:`summary_communication` into ``summary.json``: the bytes, calls and seconds per collective per optimizer
  step beside the planner's bytes for the same config;
- from outside a run (the probe, the bench), with no change to it:

    ZR_COMMS_LOG=/tmp/comms PYTHONPATH=<repo>/common/tools/comms_log_site:$PYTHONPATH python recipes/nlp/train.py ...

  :func:`comms_log_env` returns those two variables. Every process of the run (Lightning's second rank, each rank an
  Accelerate or torchrun launcher starts) then imports ``sitecustomize`` from that folder, which calls
  :func:`setup_comms_log` with the folder: at exit each rank writes ``rank<N>.json`` into it.

:func:`setup_comms_log`: once ``deepspeed.runtime.engine`` is imported, the logger is on (``prof_all``) and each
optimizer step (``DeepSpeedEngine._take_model_step``, the pipeline engine's too) ends with a snapshot of the counts:
per step and op, the calls per message size and the seconds spent in the op.
Nothing else changes in the run: the log's cost is a host synchronisation per collective, none on a CPU.

:func:`read_comms_log` reads a folder back; :func:`steady_steps` drops the first step (it gathers parameters to
record stage 3's trace, and it follows the start-up's broadcasts and first evaluation).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.util
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from common.communication import plan_communication, setup_from_ds_config, with_recipe_moe
from common.describe import RecipeDescription
from common.memory_formulas import ModelFacts
from common.parallel import ParallelLayout

ENV_VAR = "ZR_COMMS_LOG"
STEPS_VAR = "ZR_COMMS_LOG_STEPS"
SITE_FOLDER = Path(__file__).resolve().parent / "tools" / "comms_log_site"

# DeepSpeed's op names in the log, by collective (reduce_scatter_fn logs as reduce_scatter_tensor, allgather_fn as
# all_gather_into_tensor, all_reduce_coalesced and inference_all_reduce as all_reduce).
OP_COLLECTIVE = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "inference_all_reduce": "all_reduce",
    "reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "send": "point_to_point",
    "recv": "point_to_point",
    "isend": "point_to_point",
    "irecv": "point_to_point",
    "batch_isend_irecv": "point_to_point",
    "broadcast": "broadcast",
    "barrier": "barrier",
}


def comms_log_env(folder: Path, steps: int | None = None) -> dict[str, str]:
    """The variables that log a run's communication into ``folder`` (merge them into its environment): for its first
    ``steps`` optimizer steps only when given, after which DeepSpeed's logger is off again (it synchronises the
    device after every collective, which would slow a GPU's later steps)."""
    path = os.pathsep.join(filter(None, [str(SITE_FOLDER), os.environ.get("PYTHONPATH", "")]))
    env = {ENV_VAR: str(folder), "PYTHONPATH": path}
    if steps is not None:
        env[STEPS_VAR] = str(steps)
    return env


def take_snapshot() -> dict[str, tuple[dict[int, int], float]]:
    """DeepSpeed's log so far: ``{op: ({message bytes: calls}, seconds in the op so far)}``.

    DeepSpeed 0.19 records, for each call, its op timer's running total (``timers(log_name).elapsed(reset=False)``
    sums every call so far), not the call's own latency: the op's time so far is the largest value it logged.
    """
    from deepspeed.comm.comm import comms_logger

    snapshot: dict[str, tuple[dict[int, int], float]] = {}
    for name, sizes in comms_logger.comms_dict.items():
        op = name.split(" | ")[0]  # a debug log's "| [Caller Func: ...]" dropped
        calls, total_ms = snapshot.get(op, ({}, 0.0))
        for size, record in sizes.items():
            calls[int(size)] = calls.get(int(size), 0) + record[0]
            total_ms = max(total_ms, max(record[1]))
        snapshot[op] = (calls, total_ms)
    return snapshot


def snapshot_difference(before: dict, after: dict) -> dict[str, dict[str, Any]]:
    """``{op: {"calls": {message bytes: calls}, "seconds": s}}`` between two snapshots (sizes as strings: JSON)."""
    out: dict[str, dict[str, Any]] = {}
    for op, (calls, total_ms) in after.items():
        calls0, total_ms0 = before.get(op, ({}, 0.0))
        new = {str(size): n - calls0.get(size, 0) for size, n in calls.items() if n > calls0.get(size, 0)}
        if new:
            out[op] = {"calls": new, "seconds": (total_ms - total_ms0) / 1e3}
    return out


class CommsRecorder:
    """The snapshots of DeepSpeed's log taken at each optimizer step of this process (:func:`setup_comms_log`)."""

    def __init__(self, folder: Path | None, steps: int | None) -> None:
        self.folder = folder
        self.max_steps = steps
        self.snapshots: list[dict] = []
        self.rank = 0
        self.param_groups = 1
        self.elements: tuple[int, int] | None = None  # (trainable, all) parameter elements of the engine's model

    def after_step(self, engine: Any = None) -> None:
        """Snapshot the log at the end of an optimizer step of ``engine`` (the DeepSpeed engine that stepped)."""
        import torch.distributed as dist
        from deepspeed.comm.comm import comms_logger

        if self.max_steps is not None and len(self.snapshots) >= self.max_steps:
            return
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # The groups DeepSpeed's optimizer holds (stages 1-2 all-gather each one's partition in a call of its own):
        # read from the engine, so that no recipe has to count them the way it built them.
        self.param_groups = len(getattr(getattr(engine, "optimizer", None), "param_groups", None) or [None])
        if self.elements is None and hasattr(engine, "module"):
            self.elements = parameter_elements(engine.module)
        self.snapshots.append(take_snapshot())
        if self.max_steps is not None and len(self.snapshots) >= self.max_steps:
            comms_logger.enabled = False  # the steps after these run as they would without the log

    def steps(self) -> list[dict[str, dict[str, Any]]]:
        """Per optimizer step so far: ``{op: {"calls": {message bytes: calls}, "seconds": s}}``."""
        return [snapshot_difference(a, b) for a, b in zip([{}, *self.snapshots], self.snapshots)]

    def write(self) -> None:
        if self.folder is None or not self.snapshots:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        document = {"rank": self.rank, "steps": self.steps()}
        (self.folder / f"rank{self.rank}.json").write_text(json.dumps(document) + "\n")


def parameter_elements(module: Any) -> tuple[int, int]:
    """(trainable, all) parameter elements of a model, whole (a ZeRO-3 parameter's ``ds_numel``, not its shard)."""
    trainable = total = 0
    for param in module.parameters():
        elements = int(getattr(param, "ds_numel", param.numel()))
        total += elements
        trainable += elements if param.requires_grad else 0
    return trainable, total


def _patch_engine(module: Any, recorder: CommsRecorder) -> None:
    from deepspeed.comm.comm import comms_logger

    comms_logger.enabled = True
    comms_logger.prof_all = True
    engine = module.DeepSpeedEngine
    take_step = engine._take_model_step

    def _take_model_step_logged(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = take_step(self, *args, **kwargs)
        recorder.after_step(self)
        return result

    engine._take_model_step = _take_model_step_logged


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after ``name`` is imported (this process imports DeepSpeed only if it trains)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module: Any) -> None:
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec


_RECORDER: CommsRecorder | None = None  # this process's, once set up: DeepSpeed's logger is process-wide too


def setup_comms_log(folder: str | Path | None = None, steps: int | None = None) -> CommsRecorder:
    """Log this process's DeepSpeed collectives per optimizer step (module docstring), for the first ``steps``
    optimizer steps (all when None), and write them into ``folder`` at exit when one is given.

    A process-wide change: DeepSpeed's logger is switched on and ``DeepSpeedEngine._take_model_step`` wrapped, once
    ``deepspeed.runtime.engine`` is imported (at once if it already is). A second call returns the first's recorder
    (the probe's environment and a config's ``comms_logger`` may both ask): the engine is wrapped once.
    """
    global _RECORDER
    if _RECORDER is not None:
        return _RECORDER
    recorder = _RECORDER = CommsRecorder(Path(folder) if folder is not None else None, steps)
    engine_module = "deepspeed.runtime.engine"
    if engine_module in sys.modules:
        _patch_engine(sys.modules[engine_module], recorder)
    else:
        sys.meta_path.insert(0, _AfterImport(engine_module, lambda m: _patch_engine(m, recorder)))
    atexit.register(recorder.write)
    return recorder


def logs_communication(ds_config: dict[str, Any]) -> bool:
    """Whether a DeepSpeed config turns DeepSpeed's communication log on (its ``comms_logger.enabled``)."""
    return bool((ds_config.get("comms_logger") or {}).get("enabled"))


def logged_steps() -> list[dict[str, dict[str, Any]]]:
    """This process's logged optimizer steps (:meth:`CommsRecorder.steps`); none when the log is not set up."""
    return _RECORDER.steps() if _RECORDER is not None else []


def summary_communication(
    ds_config: dict[str, Any], describe_run: Callable[[], RecipeDescription]
) -> dict[str, Any] | None:
    """A recipe's ``summary.json`` ``communication``: this rank's collectives per optimizer step beside the planner's
    bytes (:func:`communication_beside_plan`) when the DeepSpeed config turns ``comms_logger`` on; None otherwise.

    Every recipe calls it the same way when it writes its summary (rank 0, after training).

    Args:
        ds_config: the run's resolved DeepSpeed config.
        describe_run: the recipe's ``describe`` for the run's config (what ``--describe`` prints), called only when
            the log is on: the planner's model, DeepSpeed config and layout.

    Returns:
        ``{"steps", "collectives"}`` (:func:`communication_beside_plan`), or None when the log is off or no step after
        the first was logged.
    """
    if not logs_communication(ds_config):
        return None
    groups = _RECORDER.param_groups if _RECORDER is not None else 1
    elements = _RECORDER.elements if _RECORDER is not None else None
    run = describe_run()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        run = with_launched_world(run, torch.distributed.get_world_size())
    return communication_beside_plan(logged_steps(), run, param_groups=groups, elements=elements)


def with_launched_world(run: RecipeDescription, world_size: int) -> RecipeDescription:
    """``run`` planned for the ranks actually launched.

    A description takes its ranks from the config (``devices=0``: every local GPU), while a launcher may start fewer
    processes than the host has GPUs; the plan of a finished run must use the ranks that moved the logged bytes.

    Args:
        run: the recipe's description of the run (``--describe``).
        world_size: the process group's size.

    Returns:
        ``run`` itself when the sizes agree; else a copy with ``world_size`` and ``devices_per_node`` (the ranks spread
        over the description's nodes) replaced.
    """
    if world_size == run.world_size:
        return run
    return replace(run, world_size=world_size, devices_per_node=max(1, world_size // run.num_nodes))


# --- reading a log back ------------------------------------------------------------------------------------------


def read_comms_log(folder: str | Path) -> dict[int, list[dict[str, dict[str, Any]]]]:
    """``{rank: [step: {op: {"calls": {message bytes: calls}, "seconds": s}}]}`` from a folder
    :func:`setup_comms_log` wrote."""
    ranks = {}
    for path in sorted(Path(folder).glob("rank*.json")):
        data = json.loads(path.read_text())
        ranks[int(data["rank"])] = data["steps"]
    return ranks


def steady_steps(steps: list[dict]) -> list[dict]:
    """The steps after the first (which records stage 3's trace and follows the start-up's collectives)."""
    return steps[1:]


def step_totals(step: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """One step's ``{collective: {"bytes": message bytes, "calls": n, "seconds": s}}`` (barriers left out)."""
    totals: dict[str, dict[str, float]] = {}
    for op, logged in step.items():
        collective = OP_COLLECTIVE.get(op, op)
        if collective == "barrier":
            continue
        entry = totals.setdefault(collective, {"bytes": 0.0, "calls": 0.0, "seconds": 0.0})
        for size, calls in logged["calls"].items():
            entry["bytes"] += int(size) * calls
            entry["calls"] += calls
        entry["seconds"] += logged["seconds"]
    return totals


def median_step(steps: list[dict]) -> dict[str, dict[str, float]]:
    """Per collective, the median over ``steps`` of its bytes, calls and seconds per step."""
    totals = [step_totals(s) for s in steps]
    names = sorted({name for t in totals for name in t})
    return {
        name: {
            key: statistics.median(t.get(name, {}).get(key, 0.0) for t in totals)
            for key in ("bytes", "calls", "seconds")
        }
        for name in names
    }


def trainable_model(facts: ModelFacts, stage: int, elements: tuple[int, int] | None) -> ModelFacts | None:
    """The model as the planner must see it when part of it is frozen (a LoRA run): ``facts`` when every parameter
    trains; under stages 0-2 a model of the trainable elements alone (only their gradients are reduced and their
    partitions gathered after the step; frozen ones stay whole on every rank and move nothing); None under stage 3,
    which gathers the frozen parameters too and reduces only the trainable ones' gradients (not modelled).

    Args:
        facts: the whole model (a recipe's ``--describe``).
        stage: the ZeRO stage.
        elements: (trainable, all) parameter elements of the model the engine trains; None when unknown (every
            parameter taken to train).
    """
    if elements is None or elements[0] >= elements[1]:
        return facts
    if stage == 3:
        return None
    trainable = elements[0]
    return replace(facts, num_params=trainable, param_numels=(trainable,), expert_params=0, largest_layer_params=None)


def communication_beside_plan(
    steps: list[dict], run: RecipeDescription, param_groups: int, elements: tuple[int, int] | None = None
) -> dict[str, Any] | None:
    """One rank's logged communication per optimizer step (the median over the steps after the first) beside the
    planner's bytes for the same config (:func:`common.communication.plan_communication`).

    Args:
        steps: the rank's logged steps (:func:`logged_steps`, or a rank of :func:`read_comms_log`).
        run: the run as the planning tools see it (a recipe's ``--describe``): model, DeepSpeed config, layout.
        param_groups: the optimizer's parameter groups (stages 1-2 all-gather each group's partition in one call).
        elements: (trainable, all) parameter elements of the engine's model (:func:`trainable_model`); None when
            unknown.

    Returns:
        ``{"steps": n, "collectives": {name: {"logged_bytes", "calls", "logged_s", "planned_bytes"}}}``, or None when
        no step after the first was logged. ``planned_bytes`` is None, and ``not_planned`` says why, where the planner
        does not model the run (stage 3 with frozen parameters).
    """
    steady = steady_steps(steps)
    if not steady:
        return None
    logged = median_step(steady)
    cfg = run.config
    layout = ParallelLayout(
        world_size=run.world_size,
        tensor=int(cfg.get("tensor_parallel") or 1),
        expert=int(cfg.get("expert_parallel") or 1),
        sequence=int(cfg.get("sequence_parallel") or 1),
    )
    tokens = run.micro_batch_size * (run.seq_len or 0)
    setup = with_recipe_moe(
        setup_from_ds_config(run.ds_config, tokens, run.devices_per_node, param_groups=param_groups), cfg
    )
    model = trainable_model(run.model, setup.stage, elements)
    not_planned = None
    planned: dict[str, float] = {}
    if model is None:
        not_planned = f"stage 3 with frozen parameters ({elements[0]:,} of {elements[1]:,} elements train)"
    else:
        with contextlib.suppress(ValueError):  # a layout the planner does not model: the logged figures stand alone
            planned = plan_communication(model, setup, layout).by_collective()
    names = [n for n in (*planned, *logged) if n != "broadcast"]
    collectives = {}
    for name in dict.fromkeys(names):
        seen = logged.get(name, {})
        collectives[name] = {
            "logged_bytes": seen.get("bytes", 0.0),
            "calls": seen.get("calls", 0.0),
            "logged_s": seen.get("seconds", 0.0),
            "planned_bytes": None if not_planned else planned.get(name, 0.0),
        }
    result: dict[str, Any] = {"steps": len(steady), "collectives": collectives}
    if not_planned:
        result["not_planned"] = not_planned
    return result
