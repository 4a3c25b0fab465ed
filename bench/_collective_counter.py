"""Bytes each rank sends per optimizer step, for bench/peer.py: DeepSpeed's own log under ZeRO, a count of
``torch.distributed``'s collectives under FSDP2 (which DeepSpeed's log does not see).

``ZR_PEER_COMMS=<folder> PYTHONPATH=<repo>/bench/_peer_comms_site:...`` makes every Python process of a run call
:func:`setup_collective_count` (the folder's ``sitecustomize``), with no change to the recipe's command:

- ``<folder>/deepspeed/rank<N>.json``: DeepSpeed's communication log cut at its optimizer steps
  (``common.comms_log.setup_comms_log``, what the recipes put in ``summary.json``), written by a ZeRO run;
- ``<folder>/torch/rank<N>.json``: every call of the ``torch.distributed`` collectives FSDP2 uses, cut at each
  optimizer step (``torch.optim``'s global step hook), in the same format and message convention (DeepSpeed's
  ``comms_logger``: the tensor passed in, this rank's shard of an all-gather, the whole buffer of a reduce-scatter or an
  all-reduce). Collectives called through DTensor's functional ops (the gradient norm's scalar) are not counted.

:func:`sent_bytes_per_step` turns one step of either log into the bytes one rank sends with ring algorithms (the
planner's convention, ``common.communication.Transfer.sent_bytes``), so that the two sides compare as equals.
"""

from __future__ import annotations

import atexit
import functools
import json
import statistics
from pathlib import Path
from typing import Any

from common.comms_log import setup_comms_log, step_totals
from common.communication import BUS_FACTOR, Transfer

# torch.distributed's collectives at the bottom of its call chains (all_gather_into_tensor and reduce_scatter_tensor
# call the "_single" ones), each with its collective and the argument that is the message: (position, name).
COUNTED = {
    "all_gather_single": ("all_gather", 1, "input_tensor"),
    "all_gather": ("all_gather", 1, "tensor"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "all_reduce": ("all_reduce", 0, "tensor"),
    "all_to_all_single": ("all_to_all", 1, "input"),
    "broadcast": ("broadcast", 0, "tensor"),
}


def message_bytes(args: tuple, kwargs: dict, position: int, name: str) -> int:
    """The bytes of a call's message tensor, given as ``args[position]`` or ``kwargs[name]``."""
    tensor = args[position] if len(args) > position else kwargs[name]
    return tensor.element_size() * tensor.nelement()


def sent_bytes_per_step(step: dict[str, dict[str, Any]], group_size: int) -> dict[str, float]:
    """One logged step (``{op: {"calls": {message bytes: calls}, "seconds": s}}``) as ``{collective: bytes this rank
    sends}`` with ring algorithms; broadcasts and barriers (start-up and checkpoint traffic) left out."""
    sent = {}
    for collective, total in step_totals(step).items():
        if collective in BUS_FACTOR:
            transfer = Transfer(collective, "logged", total["bytes"], int(total["calls"]), group_size, "intra_node")
            sent[collective] = transfer.sent_bytes
    return sent


def steady_sent_bytes(steps: list[dict], first: int, last: int, group_size: int) -> dict[str, float]:
    """Per collective, the median over optimizer steps ``first``..``last`` (1-based, inclusive) of the bytes this
    rank sends; ``{}`` when the log holds no such step."""
    chosen = [sent_bytes_per_step(step, group_size) for step in steps[first - 1 : last]]
    names = sorted({name for step in chosen for name in step})
    return {name: statistics.median(step.get(name, 0.0) for step in chosen) for name in names}


def read_rank_steps(folder: Path, rank: int = 0) -> list[dict] | None:
    """A rank's logged steps from ``folder/rank<rank>.json``; None when the run wrote none there."""
    path = folder / f"rank{rank}.json"
    return json.loads(path.read_text())["steps"] if path.is_file() else None


class CollectiveCounter:
    """The calls of :data:`COUNTED` in this process, closed at each optimizer step."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.rank = 0
        self.current: dict[str, dict[int, int]] = {}
        self.steps: list[dict] = []

    def count(self, collective: str, size: int) -> None:
        calls = self.current.setdefault(collective, {})
        calls[size] = calls.get(size, 0) + 1

    def close_step(self, *_: Any) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        step = {
            op: {"calls": {str(s): n for s, n in calls.items()}, "seconds": 0.0} for op, calls in self.current.items()
        }
        self.steps.append(step)
        self.current = {}

    def write(self) -> None:
        if not self.steps:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{self.rank}.json").write_text(json.dumps({"rank": self.rank, "steps": self.steps}) + "\n")


def _counted(function: Any, counter: CollectiveCounter, collective: str, position: int, name: str) -> Any:
    @functools.wraps(function)
    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.count(collective, message_bytes(args, kwargs, position, name))
        return function(*args, **kwargs)

    return counted


def setup_collective_count(folder: Path) -> CollectiveCounter:
    """Count this process's collectives into ``folder`` (module docstring). Process-wide: wraps the functions of
    :data:`COUNTED` in ``torch.distributed`` and its ``distributed_c10d`` module, registers a global optimizer step
    hook, switches DeepSpeed's communication log on once DeepSpeed's engine is imported, and writes at exit."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.optim.optimizer import register_optimizer_step_post_hook

    setup_comms_log(folder / "deepspeed")
    counter = CollectiveCounter(folder / "torch")
    for function_name, (collective, position, name) in COUNTED.items():
        wrapped = _counted(getattr(c10d, function_name), counter, collective, position, name)
        setattr(c10d, function_name, wrapped)  # the callers inside c10d (all_gather_into_tensor, ...)
        setattr(dist, function_name, wrapped)  # FSDP2's ``dist.all_gather_single`` and every other caller
    register_optimizer_step_post_hook(counter.close_step)
    atexit.register(counter.write)
    return counter
