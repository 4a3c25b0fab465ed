"""Count the bytes one rank really holds for parameters, gradients, optimizer states and ZeRO buffers.

The ZeRO paper's memory formulas say what each stage *should* hold; this module reads what the
DeepSpeed engine *does* hold, so a test can compare the two. Every tensor storage is counted once
(views of a flat buffer share its storage), and each storage goes to one category:

- ``params``: the module's parameters as this rank stores them (the 16/32-bit working copy; under
  stage 3 only this rank's partition ``ds_tensor`` plus the parameters kept whole by the persistence
  threshold);
- ``optimizer``: what the inner optimizer owns: fp32 master partitions and Adam's ``exp_avg`` and
  ``exp_avg_sq``;
- ``grads``: gradient tensors that are alive (after ``step()`` ZeRO frees most of them);
- ``buffers``: every other tensor the ZeRO optimizer keeps (flat 16-bit groups, reduce buckets, ...).

:func:`common.memory_formulas.predicted_model_state_bytes` gives that formula for the same quantities, per
precision (imported here as well).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

# The ZeRO formula lives with the other memory formulas (torch-free, for the planner); it is named here too
# because what this module counts is compared with it.
from common.memory_formulas import predicted_model_state_bytes  # noqa: F401


def category_totals(counted: dict[tuple[int, int], str]) -> dict[str, int]:
    """Bytes by category from each counted storage, plus ``model_states`` (params + grads + optimizer) and ``total``.

    Args:
        counted: ``(data pointer, bytes) -> category`` (``params``, ``grads``, ``optimizer`` or ``buffers``), each
            storage once.

    Returns:
        The keys of :func:`model_state_bytes`, shared by the DeepSpeed and the FSDP2 counts.
    """
    totals = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}
    for (_, nbytes), category in counted.items():
        totals[category] += nbytes
    totals["model_states"] = totals["params"] + totals["grads"] + totals["optimizer"]
    totals["total"] = totals["model_states"] + totals["buffers"]
    return totals


def _storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if storage.nbytes() == 0:
        return None
    return storage.data_ptr(), storage.nbytes()


def _walk_tensors(obj: Any, depth: int, seen: set[int]) -> Iterator[torch.Tensor]:
    """Yield tensors reachable from ``obj`` through attributes, lists, tuples and dicts (bounded depth)."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
        ds_tensor = getattr(obj, "ds_tensor", None)
        if isinstance(ds_tensor, torch.Tensor):
            yield ds_tensor
        return
    if isinstance(obj, torch.nn.Module):
        return  # the module is walked separately, as parameters
    if isinstance(obj, dict):
        children: Any = list(obj.values())
    elif isinstance(obj, list | tuple | set):
        children = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("deepspeed", "torch.optim")):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        yield from _walk_tensors(child, depth - 1, seen)


# Where ZeRO optimizers keep their fp32 master partitions. Stage 3 swaps them out of the inner
# optimizer's param_groups between steps, so reading param_groups alone would miss them.
MASTER_ATTRIBUTES = (
    "single_partition_of_fp32_groups",  # stages 1 and 2
    "fp32_partitioned_groups_flat",  # stage 3
    "fp32_groups_flat_partition",  # bf16 optimizer (stage 0)
    "fp32_groups_flat",  # fp16 unfused optimizer (stage 0)
)


def _inner_optimizer(ds_optimizer: Any) -> torch.optim.Optimizer | None:
    if isinstance(ds_optimizer, torch.optim.Optimizer) and not hasattr(ds_optimizer, "optimizer"):
        return ds_optimizer  # fp32 stage 0: DeepSpeed steps the client optimizer directly
    inner = getattr(ds_optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def model_state_bytes(engine: Any, optimizer: Any = None) -> dict[str, int]:
    """Bytes this rank holds, by category, for a ``deepspeed.DeepSpeedEngine`` or an FSDP2-sharded model.

    Args:
        engine: the engine returned by ``deepspeed.initialize`` (Lightning: ``trainer.strategy.model``;
            Accelerate: the prepared model); under an FSDP2 preset the model that holds the sharded modules.
        optimizer: FSDP2 only (DeepSpeed's engine holds its own): the run's optimizer, or a front-end's wrapper of
            it, for its state's shards; None counts none.

    Returns:
        ``{"params", "grads", "optimizer", "buffers", "model_states", "total"}`` in bytes, where
        ``model_states = params + grads + optimizer`` (the formulas' quantity) and ``total`` adds buffers.
    """
    if any(isinstance(module, FSDPModule) for module in engine.modules()):
        while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = getattr(optimizer, "optimizer", None)  # Accelerate's AcceleratedOptimizer wraps it
        return fsdp2_model_state_bytes(engine, optimizer)
    counted: dict[tuple[int, int], str] = {}

    def add(tensor: torch.Tensor | None, category: str) -> None:
        if tensor is None or not isinstance(tensor, torch.Tensor):
            return
        key = _storage_key(tensor)
        if key is not None and key not in counted:
            counted[key] = category

    module = engine.module
    for param in module.parameters():
        ds_tensor = getattr(param, "ds_tensor", None)
        if ds_tensor is not None:
            add(ds_tensor, "params")
            if param.data.numel() > 0 and getattr(param, "ds_persist", False):
                add(param.data, "params")
        else:
            add(param.data, "params")
    ds_optimizer = engine.optimizer
    inner = _inner_optimizer(ds_optimizer)
    for name in MASTER_ATTRIBUTES:
        for master in getattr(ds_optimizer, name, None) or []:
            if isinstance(master, torch.Tensor):
                add(master, "optimizer")
                add(master.grad, "grads")
    if inner is not None:
        for group in inner.param_groups:
            for master in group["params"]:
                add(master, "optimizer")
                add(master.grad, "grads")
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    add(value, "optimizer")
    for param in module.parameters():
        add(param.grad, "grads")
    if ds_optimizer is not None:
        for tensor in _walk_tensors(ds_optimizer, depth=4, seen=set()):
            add(tensor, "buffers")

    return category_totals(counted)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def fsdp2_model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds, by category, counted from the tensors it holds (each storage once).

    ``params``: the local shards of the parameters (padding included: a shard is a view of a padded storage);
    ``grads``: the local shards of gradients that are alive; ``optimizer``: the local shards of the optimizer's
    state (Adam's moments); ``buffers``: the module's buffers and any gathered (unsharded) weights alive now
    (FSDP2 swaps them in for the module's parameters: the shards are read from its own records).
    The same keys as :func:`model_state_bytes` for a DeepSpeed engine.
    """
    counted: dict[tuple[int, int], str] = {}

    def add(tensor: Any, category: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        storage = _local(tensor).untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key[1] and key not in counted:
            counted[key] = category

    # The shards first, from FSDP2's own records: while a unit's weights are gathered (the root after any forward, each
    # block after an evaluation forward under reshard_after_forward=False, which no backward reshards), the module's
    # parameters are the whole gathered tensors: counted here as buffers, not as the parameters this rank keeps.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for fsdp_param in _fsdp_params(module):
                add(fsdp_param.sharded_param, "params")
                add(fsdp_param.sharded_param.grad, "grads")
                add(getattr(fsdp_param, "_unsharded_param", None), "buffers")  # a storage of 0 bytes when resharded
    for param in model.parameters():  # any FSDP2 does not manage (a gathered one is counted above already)
        add(param, "params")
        add(param.grad, "grads")
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    add(value, "optimizer")
    for buffer in model.buffers():
        add(buffer, "buffers")

    return category_totals(counted)


def _fsdp_params(module: FSDPModule) -> list[Any]:
    """The ``FSDPParam`` records of one FSDP unit (torch's private state: an empty list if it moved)."""
    state = fully_shard.state(module)
    group = getattr(getattr(state, "_fsdp_param_group", None), "fsdp_params", None)
    return list(group or [])
