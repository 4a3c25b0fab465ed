"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), the measured peer of the ZeRO presets.

FSDP2 shards every parameter as a ``DTensor`` over the data-parallel ranks: each rank keeps 1/N of every weight (and
of its gradient and optimizer state), gathers a block's weights just before the block runs and frees them after. Its
two useful settings map onto two ZeRO stages:

- ``fsdp2``: each block's gathered weights are freed after its forward and gathered again for its backward, so
  parameters, gradients and optimizer state are all sharded between uses: ZeRO-3's counterpart.
- ``fsdp2_grad_op``: each block keeps its gathered weights from its forward to its backward
  (``reshard_after_forward=False``), one all-gather per step instead of two: ZeRO-2's counterpart (FSDP1 called it
  ``SHARD_GRAD_OP``). Between steps the parameters are sharded too, where ZeRO-2 keeps a whole 16-bit copy.

The precision contract: fp32 master weights (the sharded parameters FSDP2 keeps), bf16 compute (each block's weights
cast to bf16 as they are gathered) and fp32 gradient reduction: FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (:func:`mixed_precision_policy`). DeepSpeed's bf16 differs
in one place: its gradient reduction follows the training dtype (``communication_data_type`` defaults to bf16) unless
the config sets ``communication_data_type: fp32``. The front-ends' own mixed precision stays off (Lightning
``32-true``, Accelerate ``"no"``): their autocast on top would cast again.

Both front-ends shard the same way, by :func:`apply_fully_shard` (each block, then the root), so the same preset
gives the same numbers to both: in Lightning's ``ModelParallelStrategy`` from the LightningModule's
``configure_model``, in Accelerate before ``prepare`` (which then leaves an already sharded model as it is). The
recipes reach it through the strategy factory (:func:`common.strategy.shard_model`, which does nothing under ZeRO):
the factory's resolved config says which engine runs (:func:`common.strategy.resolve_fsdp2_config`).

Checkpoints go through ``torch.distributed.checkpoint`` (DCP): every rank writes its shards, and a checkpoint loads
at any world size, DCP re-sharding on load (:func:`load_checkpoint`). They are published like the ZeRO checkpoints
(:mod:`common.checkpoint`): written into ``.tmp-step_N``, renamed into place by rank 0, ``latest`` moved last, either
synchronously (:class:`common.async_checkpoint.Checkpointer` with :func:`dcp_write`, or a front-end's own save) or
in the background (:class:`common.async_checkpoint.DcpAsyncCheckpointer`). :func:`consolidate_checkpoint` turns a
checkpoint folder into whole weights on one process, for a Hugging Face folder.

What only DeepSpeed has (NVMe offload, separate parameter and optimizer offload, ZeRO++, Ulysses, AutoTP, DeepSpeed
MoE, the pipeline engine) is refused under an FSDP2 preset with one line naming the ZeRO preset that has it
(:func:`common.presets.refuse_zero_only_features`, :func:`common.presets.refuse_deepspeed_overrides`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from common.activation import find_blocks
from common.async_checkpoint import WRITE_DELAY_ENV, DcpAsyncCheckpointer  # noqa: F401 - read from here too
from common.errors import ConfigError, nearest
from common.presets import (  # noqa: F401 - the presets' names and refusals are read from here too
    FSDP2_PRESET_NAMES,
    FSDP2_PRESETS,
    ZERO_ONLY_FEATURES,
    get_fsdp2_preset,
    is_active,
    is_fsdp2_preset,
    refuse_zero_only_features,
)

LIGHTNING_FSDP2_PRECISION = "32-true"  # bf16 comes from the MixedPrecisionPolicy, not from Lightning's autocast
ACCELERATE_FSDP2_PRECISION = "no"  # likewise: Accelerate's bf16 would wrap the forward in autocast as well


# --- presets ------------------------------------------------------------------------------------------------------


# --- precision and sharding -------------------------------------------------------------------------------------


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for the project's precision names: fp32 master weights and fp32 gradient reduction, always.

    ``bf16``: weights cast to bf16 as they are gathered (compute in bf16), gradients reduced in fp32 and kept in fp32
    next to the fp32 shards. ``fp32``: nothing cast.

    Raises:
        ConfigError: ``fp16`` (no loss scaling is wired for FSDP2 here), or a name that is not a precision.
    """
    if precision == "fp16":
        raise ConfigError(
            "precision=fp16 is not offered under the FSDP2 presets (no loss scaler is wired for them); use bf16 "
            "(fp32's range, no loss scaling) or fp32, or a ZeRO preset (deepspeed_stage_3) for fp16"
        )
    if precision not in ("bf16", "fp32"):
        raise ConfigError(
            f"precision must be bf16 or fp32, got {precision!r}{nearest(str(precision), ('bf16', 'fp32'))}"
        )
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_fully_shard(
    model: torch.nn.Module,
    preset: str | dict[str, Any],
    precision: str,
    layer_classes: Sequence[type | str] | None = None,
    mesh: Any = None,
) -> list[str]:
    """Shard ``model`` in place: each block (:func:`common.activation.find_blocks`), then the root; return the blocks.

    Activation checkpointing (:func:`common.activation.apply_activation_checkpointing`) goes on first: it wraps
    each block's ``forward``, and FSDP2's hooks gather the weights around the wrapped call and its recomputation
    alike.

    Args:
        model: a module whose parameters are all on one device (a CPU, or the rank's accelerator).
        preset: an FSDP2 preset name or dict (:data:`FSDP2_PRESETS`).
        precision: ``bf16`` or ``fp32`` (:func:`mixed_precision_policy`).
        layer_classes: the block classes or class names; default as :func:`common.activation.find_blocks`.
        mesh: the data-parallel device mesh (Lightning's ``device_mesh["data_parallel"]``); None: every rank.

    Returns:
        The names of the blocks sharded as units of their own (the root is one more).
    """
    spec = get_fsdp2_preset(preset)
    policy = mixed_precision_policy(precision)
    blocks = find_blocks(model, layer_classes)
    for _, block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=spec["reshard_after_forward"], mp_policy=policy)
    # The root (embeddings, final norm, head) keeps its weights after the forward: its backward starts at once, so
    # freeing them would only gather them again (torch's default for the root, None, says the same).
    fully_shard(model, mesh=mesh, reshard_after_forward=None, mp_policy=policy)
    return [name for name, _ in blocks]


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The gradients' global 2-norm before clipping, over every rank's shards; clip them to ``max_norm`` if above 0.

    Both front-ends clip through it (Lightning's ``configure_gradient_clipping``, the Accelerate loop): the norm they
    log is then what DeepSpeed's engine logs for the ZeRO presets (``get_global_grad_norm``), measured the same way on
    both. ``torch.nn.utils.clip_grad_norm_`` returns a DTensor for sharded gradients, a norm the caller must still
    gather; this returns a plain tensor (``full_tensor``), the same on every rank.

    Args:
        parameters: the model's parameters (FSDP2's sharded DTensors, or plain ones in one process).
        max_norm: the clipping threshold (0: measure only).

    Returns:
        A 0-dimensional tensor on the gradients' device.
    """
    parameters = [param for param in parameters if param.grad is not None]
    norm = torch.nn.utils.get_total_norm([param.grad for param in parameters])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# --- front-ends -------------------------------------------------------------------------------------------------


def lightning_fsdp2_trainer_kwargs(
    world_size: int,
    grad_accum: int,
    gradient_clipping: float,
    timeout: timedelta | None = None,
) -> dict[str, Any]:
    """``Trainer`` keyword arguments for an FSDP2 preset: Lightning's ``ModelParallelStrategy`` over every rank.

    The strategy only sets up the process group and the device mesh; the LightningModule's ``configure_model`` calls
    :func:`apply_fully_shard` with ``mesh=self.device_mesh["data_parallel"]``. Its defaults put one node's processes
    on the tensor-parallel dimension: here every rank is data-parallel (``tensor_parallel_size=1``). On a CPU it
    passes no ``device_id`` to the process group and picks gloo itself.

    Lightning's automatic optimization divides each micro-batch's loss by ``accumulate_grad_batches`` once, which is
    right for FSDP2 (the gradients it accumulates are those of the loss as divided), and it reduces every
    micro-batch (it skips the reduction only for DDP), as ``sync_each_micro_batch`` asks. Clipping goes through
    ``torch.nn.utils.clip_grad_norm_``, which computes the global norm over the DTensor shards.

    Args:
        world_size: data-parallel ranks in total (nodes x devices).
        grad_accum: micro-batches per optimizer step.
        gradient_clipping: max gradient norm (0: off).
        timeout: how long a collective may wait; Lightning's default if None.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy_kwargs: dict[str, Any] = {"data_parallel_size": world_size, "tensor_parallel_size": 1}
    if timeout is not None:
        strategy_kwargs["timeout"] = timeout
    return {
        "strategy": ModelParallelStrategy(**strategy_kwargs),
        "precision": LIGHTNING_FSDP2_PRECISION,
        "accumulate_grad_batches": grad_accum,
        "gradient_clip_val": gradient_clipping or None,
    }


def accelerator_fsdp2_kwargs(
    preset: str | dict[str, Any], precision: str, grad_accum: int, timeout: timedelta | None = None
) -> dict[str, Any]:
    """``Accelerator`` keyword arguments for an FSDP2 preset: the FSDP plugin at version 2, gloo on a CPU.

    The script shards the model with :func:`apply_fully_shard` before ``prepare``: Accelerate's own wrapping
    (``fsdp2_prepare_model``) would also carve the embeddings and a tail of final norm and head into groups of their
    own, so the two front-ends would not shard alike. ``sync_each_batch`` keeps Accelerate's ``accumulate`` from
    skipping the reduce-scatter of the first micro-batches (``set_requires_gradient_sync(False)``), which would hold
    a whole unsharded fp32 gradient per rank until the last one. A script started without a launcher (one process)
    gets a process group of its own here, a world of 1: FSDP2 needs one. A launch with a recipe's DeepSpeed
    ``accelerate.yaml`` runs FSDP2 all the same: the launcher's ``ACCELERATE_USE_DEEPSPEED`` is dropped here.

    Args:
        preset: an FSDP2 preset name or dict.
        precision: ``bf16`` or ``fp32`` (the plugin's policy; the script's sharding applies the same one).
        grad_accum: micro-batches per optimizer step.
        timeout: how long a collective may wait; torch's default if None.
    """
    from accelerate.utils import FullyShardedDataParallelPlugin, GradientAccumulationPlugin, InitProcessGroupKwargs

    spec = get_fsdp2_preset(preset)
    # The preset picks the engine, not the launcher's config file: a recipe's accelerate.yaml names DeepSpeed, and
    # `accelerate launch` passes that on as ACCELERATE_USE_DEEPSPEED, which would make Accelerator() build a DeepSpeed
    # plugin beside the FSDP one and run DeepSpeed.
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        # A script started without a launcher is one process with no process group, and the FSDP plugin and
        # fully_shard need one: a world of 1 over an in-memory store (a launcher's processes get Accelerate's).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=spec["reshard_after_forward"],
        mixed_precision_policy=mixed_precision_policy(precision),
        state_dict_type="SHARDED_STATE_DICT",
    )
    pg_kwargs: dict[str, Any] = {"backend": "nccl" if torch.cuda.is_available() else "gloo"}
    if timeout is not None:
        pg_kwargs["timeout"] = timeout
    return {
        "fsdp_plugin": plugin,
        "mixed_precision": ACCELERATE_FSDP2_PRECISION,
        "gradient_accumulation_plugin": GradientAccumulationPlugin(
            num_steps=grad_accum, sync_each_batch=spec["sync_each_micro_batch"]
        ),
        "kwargs_handlers": [InitProcessGroupKwargs(**pg_kwargs)],
    }


# --- checkpoints --------------------------------------------------------------------------------------------------


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
    exclude_frozen_parameters: bool = False,
) -> dict[str, Any]:
    """What a checkpoint holds: this rank's shards of the model and optimizer state, plus ``extra`` (step, RNG ...).

    Keys are the module's own parameter names (``model.layers.0.mlp.up_proj.weight``), whatever the world size.
    ``exclude_frozen_parameters``: leave out the parameters that do not require grad (a fine-tuning run's frozen
    base, which comes from its model folder again on resume), as DeepSpeed's option of that name does.
    """
    options = StateDictOptions(ignore_frozen_params=exclude_frozen_parameters)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optimizer": optimizer_state, "extra": dict(extra or {})}


class _SlowedFileSystemWriter(dcp.FileSystemWriter):
    """DCP's file writer, each write delayed by ``$ZERO_RECIPES_TEST_CHECKPOINT_WRITE_DELAY_S`` (tests: a rank is
    killed while a write is in flight)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(float(os.environ.get(WRITE_DELAY_ENV, "0")))
        return super().write_data(plan, planner)


def _storage_writer(folder: Path) -> dcp.FileSystemWriter:
    writer = _SlowedFileSystemWriter if float(os.environ.get(WRITE_DELAY_ENV, "0")) > 0 else dcp.FileSystemWriter
    return writer(folder, sync_files=True)  # each rank fsyncs its files: on disk before rank 0 publishes


def dcp_write(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
    async_group: Any = None,
    exclude_frozen_parameters: bool = False,
) -> Callable[[Path], Any]:
    """The save call for :meth:`common.async_checkpoint.Checkpointer.save`: writes this rank's shards into a folder.

    Args:
        model, optimizer: the sharded model and its optimizer.
        extra: small state saved with them (the step, the scheduler's state_dict ...).
        async_group: None: a synchronous ``dcp.save``. A gloo process group of every rank
            (:class:`DcpAsyncCheckpointer` makes one): ``dcp.async_save``, which copies the state to host memory
            and returns a ``Future`` while a thread writes it, coordinating the ranks over that group (not over the
            training's, whose collectives run meanwhile).
        exclude_frozen_parameters: write only the parameters that require grad (:func:`training_state`).
    """

    def write(folder: Path) -> Any:
        state = training_state(model, optimizer, extra, exclude_frozen_parameters)
        if async_group is None:
            return dcp.save(state, storage_writer=_storage_writer(folder))
        return dcp.async_save(state, storage_writer=_storage_writer(folder), process_group=async_group)

    return write


def load_checkpoint(
    folder: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    exclude_frozen_parameters: bool = False,
) -> dict[str, Any]:
    """Load a DCP checkpoint into a sharded model and its optimizer, at any world size; return its ``extra``.

    DCP reads, for each rank, the pieces of each saved tensor that overlap the shard this rank holds now, so a
    checkpoint written by 2 ranks loads on 1 or on 4. Every rank calls it. ``exclude_frozen_parameters``: the
    checkpoint was written without the frozen parameters (:func:`training_state`); they keep the values they have.
    """
    state = training_state(model, optimizer, exclude_frozen_parameters=exclude_frozen_parameters)
    del state["extra"]  # DCP fills only the keys it is given, and extra's are not known here: read apart below
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(strict=not exclude_frozen_parameters),
    )
    return _read_part(folder, "extra")


def _read_part(folder: str | Path, part: str) -> Any:
    """One top-level part of a DCP checkpoint, whole, read by this process alone (no collective)."""
    # The loader under dcp.load, as torch's own dcp_to_torch_save calls it: dcp.load hands back only the keys it was
    # given, and a reader that rebuilds the state from the checkpoint's metadata starts from none.
    state: dict[str, Any] = {}
    planner = _EmptyStateDictLoadPlanner(keys={part})
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(folder)), planner=planner, no_dist=True)
    return state.get(part, {})


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Whole weights of a sharded model on rank 0 (CPU tensors), None elsewhere; every rank calls it (collective).

    Each parameter is gathered in turn and moved to host memory (``cpu_offload``), so no rank holds the whole model
    on its accelerator.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if not dist.is_initialized() or dist.get_rank() == 0 else None


def consolidate_checkpoint(folder: str | Path, part: str = "model") -> dict[str, torch.Tensor]:
    """Whole weights from a DCP checkpoint folder, in one process without a process group (``zero-recipes export``).

    Reads only the weights (not the optimizer's moments) and rebuilds each tensor from the shards every rank wrote.

    Args:
        folder: the checkpoint folder (the one holding DCP's ``.metadata``).
        part: the top-level key the weights were saved under: ``model`` for :func:`dcp_write` and for Accelerate's
            ``save_state`` (its ``pytorch_model_fsdp_0`` folder), ``state_dict`` for Lightning's
            ``ModelParallelStrategy`` (names prefixed by the LightningModule's attribute, ``model.``).

    Returns:
        ``{name: tensor}`` on the CPU, in the dtype the shards were saved in.

    Raises:
        ConfigError: the folder is not a DCP checkpoint, or holds no ``part``.
    """
    if not (Path(folder) / ".metadata").is_file():
        raise ConfigError(f"{folder} is not a torch.distributed.checkpoint folder (no .metadata in it)")
    weights = _read_part(folder, part)
    if not weights:
        raise ConfigError(f"{folder} holds no {part!r} part; saved parts: {', '.join(checkpoint_parts(folder))}")
    return weights


def checkpoint_parts(folder: str | Path) -> list[str]:
    """The top-level keys a DCP checkpoint was saved with (``model``, ``optimizer``, ``extra`` ...)."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    return sorted({path[0] for path in (metadata.planner_data or {}).values()})
