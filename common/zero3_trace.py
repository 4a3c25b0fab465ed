"""ZeRO-3's parameter trace after an evaluation that ran before the first training step.

DeepSpeed ZeRO-3 learns the order in which modules fetch their parameters from the first passes it sees
(``PartitionedParameterCoordinator``: the trace is recorded on one pass, complete from the next). With a complete
trace it decides, per module and position in the trace, which parameters to release after use, and it caches those
decisions (``__params_to_release`` is a ``functools.lru_cache``). An evaluation before the first training step
completes a forward-only trace: every parameter is released after its forward use, since nothing follows. The
training step then invalidates that trace and records its own, but the cached decisions stay, so on every later step
each parameter the forward pass could have kept for the backward pass is released and gathered again (a run's
``summary.json`` then logs twice the planned all-gather bytes: tests/recipes/test_comm_summary.py).

:func:`retrace_after_evaluation` makes the next training step record the trace afresh with nothing cached.
"""

from __future__ import annotations

from typing import Any


def retrace_after_evaluation(engine: Any) -> None:
    """After forward-only passes under ZeRO-3 (an evaluation before training): the next training step records the
    parameter trace afresh, and the release decisions cached from the forward-only trace are forgotten.

    Does nothing for an engine that is not DeepSpeed's at stage 3 (stages 0-2, FSDP2, a plain module).

    Args:
        engine: the object the loop trains (``accelerator.prepare``'s model: DeepSpeed's engine under ZeRO).
    """
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is None:
        return
    coordinator = offload.get_param_coordinator()
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()  # DeepSpeed's own call when a pass leaves the trace; no public one
    release_plan = cached_release_plan()
    if release_plan is not None:  # a DeepSpeed without the cache has nothing to forget
        release_plan.cache_clear()


def cached_release_plan() -> Any | None:
    """DeepSpeed's ``functools.lru_cache`` of the coordinator's release decisions: the method itself, or the function
    DeepSpeed's NVTX wrapper (``instrument_w_nvtx``, which keeps no ``__wrapped__``) closes over. It is the method's,
    shared by every coordinator of the process (keyed by instance): clearing it costs the others a recomputation."""
    # Imported here: importing DeepSpeed prints its accelerator notice on stdout, and the recipes that import this
    # module also print their --describe JSON there; by the time a ZeRO-3 engine exists DeepSpeed is loaded anyway.
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    method = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    for candidate in (method, *(cell.cell_contents for cell in method.__closure__ or ())):
        if hasattr(candidate, "cache_clear"):
            return candidate
    return None
