"""Host memory an asynchronous checkpoint holds: the copy of each rank's share of the checkpoint.

``async_save=true`` (:class:`common.async_checkpoint.AsyncCheckpointer`) copies every tensor DeepSpeed hands to its
checkpoint engine into host memory and keeps that copy (reused by the next save) for the whole run. What a rank
hands over is what DeepSpeed 0.19's ``save_checkpoint`` writes for it:

- **optimizer partition** (stages 1-3, every rank): the ``zero_pp_rank_*_optim_states.pt`` file, the fp32 master
  partition and Adam's two moments, 12 bytes per trainable element of the rank's partition (12 K / N). In fp32 the
  master *is* the fp32 partition, so 12 bytes as well. Gradients are never saved; under stage 3 the working-precision
  parameters are not either (the module's state dict holds empty placeholders for partitioned parameters).
- **module** (stages 0-2, the first rank of each data-parallel group only: DeepSpeed's ``save_non_zero_checkpoint``):
  the ``mp_rank_*_model_states.pt`` file, the module's state dict, P bytes per parameter the rank holds (frozen ones
  included). Stage 0 keeps its optimizer state in that file too: 12 bytes per trainable parameter, unsharded (8 in
  fp32: torch's Adam has no master copy).

Measured here (docs/checkpoints.md): 215M parameters, fp32, ZeRO-3, 2 processes, a snapshot of 1.29 GB per rank =
12 B x 215M / 2. Offloaded optimizer states are copied again (host to host): offload does not change the term.
"""

from __future__ import annotations

from common.memory_formulas import ADAM_STATE_BYTES, WORKING_BYTES


def snapshot_bytes_per_rank(
    trainable_partition: float, module_params: float, stage: int, precision: str = "bf16"
) -> tuple[float, float]:
    """(bytes the writing rank copies, bytes every other rank copies) for one asynchronous checkpoint.

    Args:
        trainable_partition: trainable elements in one rank's ZeRO partition (trainable / N; stage 0: all of them).
        module_params: parameters one rank holds in its module (all of them without tensor or pipeline parallelism).
        stage: the ZeRO stage, 0-3.
        precision: ``bf16``, ``fp16`` or ``fp32``: the module's bytes per parameter.

    Returns:
        The first rank of a data-parallel group (the one that also writes the module under stages 0-2) and the rest.
    """
    # Stage 0 in fp32 runs torch's own Adam: two moments and no master copy.
    state_bytes = 8 if (stage == 0 and precision == "fp32") else ADAM_STATE_BYTES
    optimizer = state_bytes * trainable_partition
    if stage == 3:
        return optimizer, optimizer
    module = WORKING_BYTES[precision] * module_params
    if stage == 0:
        return module + optimizer, 0.0
    return module + optimizer, optimizer


def snapshot_bytes_per_node(writer_bytes: float, other_bytes: float, ranks_per_node: int, writers: int = 1) -> float:
    """Host bytes the snapshots of one node hold: its writing ranks' copies plus everyone else's.

    Args:
        writer_bytes: a writing rank's copy (:func:`snapshot_bytes_per_rank`'s first value).
        other_bytes: every other rank's copy.
        ranks_per_node: processes on the node.
        writers: data-parallel groups whose first rank is on this node (TP x PP on the first node; 1 without them).
    """
    writers = min(writers, ranks_per_node)
    return writers * writer_bytes + (ranks_per_node - writers) * other_bytes
