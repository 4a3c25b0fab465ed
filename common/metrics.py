"""Throughput, MFU and peak memory: the same keys on both backends.

- throughput is reported per device, as ``{"value": ..., "unit": "tokens/s/device"}``;
- MFU uses PaLM's count (Chowdhery et al. 2022, appendix B): 6N + 12·L·H·Q·T FLOPs per token, against
  the GPU's dense bf16 peak; None on a CPU or an unknown GPU (no made-up peak);
- peak memory is the accelerator's max allocated bytes on a GPU, the process's peak RSS on a CPU.
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets.
GPU_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "V100": 125e12,
}


def peak_memory_bytes() -> int:
    """Peak memory of this process: GPU max allocated, or peak resident set size on a CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


def memory_kind() -> str:
    """What :func:`peak_memory_bytes` measures here."""
    import torch

    return "gpu_max_allocated" if torch.cuda.is_available() else "cpu_peak_rss"


def gpu_peak_flops(device_name: str | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of the local GPU, or None when unknown (CPU included)."""
    import torch

    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name(0)
    for key, flops in GPU_PEAK_BF16_FLOPS.items():
        if key in device_name.upper():
            return flops
    return None


def palm_flops_per_token(num_params: int, num_layers: int, num_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6N + 12·L·H·Q·T (PaLM, appendix B)."""
    return 6.0 * num_params + 12.0 * num_layers * num_heads * head_dim * seq_len


def mfu(tokens_per_second_per_device: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None without a known peak."""
    if not peak_flops:
        return None
    return tokens_per_second_per_device * flops_per_token / peak_flops


def throughput(value: float, unit: str) -> dict[str, Any]:
    """The ``summary.json`` form of a rate."""
    return {"value": round(float(value), 3), "unit": unit}


def median(values: list[float]) -> float:
    """Median of a non-empty list."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


class Clock:
    """Wall time since start, and per-step durations that leave out evaluation and checkpoint time."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.step_seconds: list[float] = []

    def step_done(self) -> None:
        now = time.perf_counter()
        self.step_seconds.append(now - self.last)
        self.last = now

    def skip(self) -> None:
        """Do not count the time since the last step (evaluation, checkpoint) as step time."""
        self.last = time.perf_counter()

    def wall(self) -> float:
        return time.perf_counter() - self.start

    def median_step(self) -> float:
        """Median step time, leaving out the first steps (start-up) when there are enough."""
        kept = self.step_seconds[5:] if len(self.step_seconds) > 10 else self.step_seconds
        return median(kept) if kept else math.nan


def all_reduce(tensor: Any, op: str = "sum") -> Any:
    """Sum or max of a tensor over ranks, in place (a no-op in one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    """Every rank waits for the others (a no-op in one process).

    The process group's own barrier, not ``accelerator.wait_for_everyone``: under an FSDP2 preset on a CPU,
    Accelerate 1.15 runs in its distributed type ``NO`` (its FSDP mode is for accelerators), where
    ``wait_for_everyone`` returns at once although the processes share a process group.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def main_process_first(is_main_process: bool) -> Iterator[None]:
    """The main process runs the block first (say, generating a data cache); the others enter it once it has left.

    Every rank must enter it. Over the process group (:func:`barrier`), for the reason given there:
    ``accelerator.main_process_first`` lets every rank in at once under FSDP2 on a CPU.
    """
    if not is_main_process:
        barrier()
    yield
    if is_main_process:
        barrier()


def grad_norm(engine: Any, measured: Any = None) -> float:
    """The last optimizer step's gradient norm before clipping, over every rank (NaN before the first step). The same
    on every rank; sequence parallel: it checks the loss scaling (module docstring of common/sequence_parallel.py),
    which the loss curve alone hides.

    Args:
        engine: DeepSpeed's engine, which computes the norm in its step and keeps it.
        measured: the norm the training loop measured while clipping (an FSDP2 preset, whose engine keeps none:
            :func:`common.strategy.gradient_norm`); when given, it is the one returned.
    """
    if measured is not None:
        return float(measured)
    if not hasattr(engine, "get_global_grad_norm"):  # an FSDP2 model before its first clipping
        return math.nan
    norm = engine.get_global_grad_norm()
    return math.nan if norm is None else float(norm)
