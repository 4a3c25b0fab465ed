"""Where rank 0's CPU time goes within a recipe's training step, for ``bench/peer.py --profile``: per phase, and by
package under cProfile, with no change to the recipe's command.

``ZR_PEER_PROFILE=<folder> ZR_PEER_PROFILE_STEPS=A,B,C PYTHONPATH=<repo>/bench/_peer_comms_site:...`` makes every
Python process of a run call :func:`setup_step_profile` (the folder's ``sitecustomize``). The windows are cut where
rank 0 logs a step's training loss (``common.rundir.MetricsLog.log``, every step at ``log_interval=1``, after the
step's optimizer step and before any evaluation or checkpoint): steps A+1..B are timed by phase, steps B+1..C under
cProfile, and rank 0 writes ``<folder>/rank0.json`` and ``<folder>/rank0.prof``.

Phases: at the window's start, the functions of :data:`PHASES` that the run has imported are wrapped (on the main
thread) so that a clock charges the time between two wrapped calls or returns to the innermost phase open, and the
time with none open to ``other`` (the front-end's loop, logging, data loading). Three clocks: the process's CPU time
(every thread: gloo's threads doing a collective count in the phase that waits for it), the main thread's CPU time
and wall time; and the process's minor page faults. The ZeRO and the FSDP2 functions of a phase are those doing the
same job on each side.
"""

from __future__ import annotations

import cProfile
import functools
import importlib
import json
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

FSDP_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup"
ZERO_OPTIMIZER = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
COLLECTIVES = (
    "all_gather_single",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
)
# phase -> the functions ("module:attribute.path") whose calls it covers; a call inside another phase's call is
# charged to the inner one. Only modules already imported are wrapped (the other side's are not).
PHASES: dict[str, tuple[str, ...]] = {
    "forward and loss": ("pretraining:lm_loss",),
    "parameter all-gather and release": (
        "deepspeed.runtime.zero.stage_1_and_2:all_gather_dp_groups",
        f"{FSDP_GROUP}.pre_forward",
        f"{FSDP_GROUP}.post_forward",
        f"{FSDP_GROUP}.pre_backward",
        f"{FSDP_GROUP}.unshard",
        f"{FSDP_GROUP}.wait_for_unshard",
        f"{FSDP_GROUP}.reshard",
    ),
    "backward (autograd)": ("torch.autograd:backward", f"{ENGINE}.backward"),
    "gradient reduction": (
        f"{ZERO_OPTIMIZER}.reduce_ready_partitions_and_remove_grads",
        f"{ZERO_OPTIMIZER}.overlapping_partition_gradients_reduce_epilogue",
        f"{ZERO_OPTIMIZER}.independent_gradient_partition_epilogue",
        f"{FSDP_GROUP}.post_backward",
        f"{FSDP_GROUP}.finalize_backward",
        "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._root_post_backward_final_callback",
    ),
    "gradient norm and clipping": (
        f"{ZERO_OPTIMIZER}.scaled_global_norm",
        f"{ZERO_OPTIMIZER}.unscale_and_clip_grads",
        "common.fsdp2:clip_grad_norm",
        "torch.nn.utils:clip_grad_norm_",
    ),
    # torch's AdamW on a CPU: one Python loop over the parameters it updates (no foreach kernels off an accelerator):
    # ZeRO's flat fp32 partition per parameter group, FSDP2's sharded parameters (DTensors) one by one.
    "Adam update (torch.optim.adam.adam)": ("torch.optim.adam:adam",),
    # ZeRO's step around the Adam call: the gradient partition flattened and cast to fp32, the fp32 partition copied
    # into the bf16 weights; the engine's and the optimizers' bookkeeping and zero_grad on both sides.
    "optimizer step, rest (flatten, casts, copies)": (
        f"{ZERO_OPTIMIZER}.step",
        f"{ZERO_OPTIMIZER}.zero_grad",
        f"{ENGINE}.step",
        "torch.optim:Optimizer.zero_grad",
    ),
    "collective calls (torch.distributed)": (
        *(f"torch.distributed.distributed_c10d:{name}" for name in COLLECTIVES),
        *(f"torch.distributed:{name}" for name in COLLECTIVES),
        "torch._C._distributed_c10d:Work.wait",
    ),
}
OTHER = "other"
# The process's CPU seconds, the main thread's, wall seconds, and the process's minor page faults (memory mapped
# afresh: glibc serves an allocation above its mmap threshold, at most 32 MiB, with new pages every time).
CLOCKS = ("cpu_s", "thread_s", "wall_s", "minor_faults")


def now() -> tuple[float, float, float, float]:
    return (
        time.process_time(),
        time.thread_time(),
        time.perf_counter(),
        resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
    )


class PhaseClock:
    """Exclusive time per phase: the time since the last wrapped call or return goes to the innermost open phase."""

    def __init__(self) -> None:
        self.active = False
        self.stack: list[str] = []
        self.totals: dict[str, list[float]] = {}
        self.calls: dict[str, int] = {}
        self.last = now()
        self.thread = threading.get_ident()

    def charge(self) -> None:
        current = now()
        phase = self.stack[-1] if self.stack else OTHER
        spent = self.totals.setdefault(phase, [0.0] * len(CLOCKS))
        for i, (a, b) in enumerate(zip(self.last, current)):
            spent[i] += b - a
        self.last = current

    def start(self) -> None:
        self.stack, self.totals, self.calls, self.last, self.active = [], {}, {}, now(), True

    def stop(self) -> dict[str, dict[str, float]]:
        self.charge()
        self.active = False
        return {
            phase: {**dict(zip(CLOCKS, spent)), "calls": self.calls.get(phase, 0)}
            for phase, spent in self.totals.items()
        }

    def wrap(self, function: Any, phase: str) -> Any:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active or threading.get_ident() != self.thread:
                return function(*args, **kwargs)
            self.charge()
            self.stack.append(phase)
            self.calls[phase] = self.calls.get(phase, 0) + 1
            try:
                return function(*args, **kwargs)
            finally:
                self.charge()
                self.stack.pop()

        return timed


def resolve(target: str) -> tuple[Any, str] | None:
    """(owner, attribute) of ``module:attr.path``, None when the module is not imported or lacks it."""
    module_name, path = target.split(":")
    if module_name not in sys.modules:
        return None
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent, None)
        if owner is None:
            return None
    return (owner, name) if hasattr(owner, name) else None


def install(clock: PhaseClock) -> list[str]:
    """Wrap every function of :data:`PHASES` the process has imported; the targets wrapped."""
    wrapped = []
    for phase, targets in PHASES.items():
        for target in targets:
            found = resolve(target)
            if found is not None:
                owner, name = found
                setattr(owner, name, clock.wrap(getattr(owner, name), phase))
                wrapped.append(target)
    return wrapped


class StepProfile:
    """Rank 0's windows, driven by its training-loss log calls (module docstring)."""

    def __init__(self, folder: Path, start: int, switch: int, stop: int) -> None:
        self.folder, self.start, self.switch, self.stop = folder, start, switch, stop
        self.clock = PhaseClock()
        self.profiler: cProfile.Profile | None = None
        self.result: dict[str, Any] = {"phase_steps": [start + 1, switch], "profile_steps": [switch + 1, stop]}

    def on_log(self, step: int) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            return
        if step == self.start:
            self.result["wrapped"] = install(self.clock)
            self.clock.start()
        elif step == self.switch:
            self.result["phases"] = self.clock.stop()
            self.profiler = cProfile.Profile(time.thread_time)  # the thread's CPU time, as bench/overhead.py
            self.profiler.enable()
        elif step == self.stop and self.profiler is not None:
            self.profiler.disable()
            self.folder.mkdir(parents=True, exist_ok=True)
            self.profiler.dump_stats(str(self.folder / "rank0.prof"))
            (self.folder / "rank0.json").write_text(json.dumps(self.result, indent=1) + "\n")


def setup_step_profile(folder: Path, steps: str) -> StepProfile:
    """Profile rank 0 of this run into ``folder`` at ``steps`` ("A,B,C": module docstring)."""
    from common.rundir import MetricsLog

    profile = StepProfile(folder, *(int(s) for s in steps.split(",")))
    original = MetricsLog.log

    @functools.wraps(original)
    def log(self: MetricsLog, step: int, **values: float) -> None:
        original(self, step, **values)
        if "train_loss" in values:
            profile.on_log(step)

    MetricsLog.log = log
    return profile


# --- pure: a profile's figures per step ---------------------------------------------------------------------------


def phase_ms_per_step(phases: dict[str, dict[str, float]], steps: int, clock: str = "cpu_s") -> dict[str, float]:
    """Milliseconds a step per phase on ``clock``, in :data:`PHASES`' order, then ``other``; phases never entered
    count 0 (the other side's functions)."""
    order = [*PHASES, OTHER]
    unknown = set(phases) - set(order)
    if unknown:
        raise ValueError(f"phases not in PHASES: {sorted(unknown)}")
    return {phase: phases.get(phase, {}).get(clock, 0.0) * 1e3 / steps for phase in order}
