"""Model states per rank: the ZeRO paper's parameter, gradient and optimizer-state bytes under each ZeRO stage and
offload, DeepSpeed's own estimate beside them, and the communication buffers."""

from __future__ import annotations

from typing import Any

from common.memory_formulas.model_facts import ModelFacts, lora_params, persistent_params

# Bytes per element of the working (16/32-bit) copy of parameters and gradients.
WORKING_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Adam in DeepSpeed: fp32 master copy + exp_avg + exp_avg_sq = 12 bytes per parameter.
ADAM_STATE_BYTES = 12


# Share of device memory a plan may use; the rest is fragmentation and the runtime's context.
USABLE_FRACTION = 0.9

# DeepSpeed's default for stage3_max_live_parameters: gathered parameters kept whole while reused.
DS_MAX_LIVE_PARAMETERS = 1e9

# DeepSpeed's default for the estimators' "additional_buffer_factor".
DS_ADDITIONAL_BUFFER_FACTOR = 1.5

OFFLOADS = ("none", "optimizer", "params", "nvme")  # nvme: stage 3, parameters and optimizer on disk


def guide_model_states(
    facts: ModelFacts,
    stage: int,
    offload: str,
    world_size: int,
    precision: str = "bf16",
    lora_rank: int | None = None,
    persistence_threshold: int = 0,
    grads_alive: bool = True,
) -> tuple[float, float]:
    """(device bytes, host bytes) of model states per rank by the ZeRO paper's formula, with offload moving terms.

    Gradients are counted alive by default (the peak, during backward; ``grads_alive=False`` is the state
    after ``step()``). With LoRA the frozen base holds only its working copy (no gradients, no optimizer
    states) and the adapters follow the formula. Stage 3 on more than one rank adds P bytes for every
    parameter under ``persistence_threshold``: DeepSpeed keeps it whole on every rank as well as its
    partition, which the formula's 16K/N already counts.
    """
    if lora_rank:
        trainable = lora_params(facts, lora_rank)
        frozen = facts.num_params
        p = WORKING_BYTES[precision]
        base = p * frozen / world_size if stage == 3 else p * frozen
        parts = predicted_model_state_bytes(trainable, stage, world_size, precision, grads_alive=grads_alive)
        parts = {**parts, "params": parts["params"] + base}
    else:
        parts = predicted_model_state_bytes(facts.num_params, stage, world_size, precision, grads_alive=grads_alive)
    # On one rank the partition is the whole parameter: no second copy (measured: bench/memory.py).
    sharded = stage == 3 and world_size > 1
    whole_copies = WORKING_BYTES[precision] * persistent_params(facts, persistence_threshold) if sharded else 0
    return place_states(parts, whole_copies, offload)


def place_states(parts: dict[str, float], whole_copies: float, offload: str) -> tuple[float, float]:
    """(device bytes, host bytes): offload moves the optimizer states off the device, ``params`` the rest too."""
    device, host = parts["params"] + parts["grads"] + parts["optimizer"] + whole_copies, 0.0
    if offload in ("optimizer", "params", "nvme"):  # nvme: the off-device bytes are on disk, not in host RAM
        device -= parts["optimizer"]
        host += parts["optimizer"]
    if offload in ("params", "nvme"):
        device -= parts["params"] + parts["grads"]
        host += parts["params"] + parts["grads"]
    return device, host


def predicted_model_state_bytes(
    num_params: int,
    stage: int,
    world_size: int,
    precision: str = "bf16",
    grads_alive: bool = False,
    persistent_params: int = 0,
) -> dict[str, float]:
    """The ZeRO paper's per-rank model-state bytes, generalised to the precision.

    With P the working bytes per element (2 for bf16/fp16, 4 for fp32), K parameters and N ranks:
    stage 0 holds P*K params + P*K grads + 12K optimizer; stage 1 shards the optimizer (12K/N);
    stage 2 also the gradients (P*K/N); stage 3 also the parameters (P*K/N). For bf16 this is the
    paper's 16K / 4K + 12K/N / 2K + 14K/N / 16K/N.

    Args:
        num_params: K.
        stage: ZeRO stage 0-3.
        world_size: N.
        precision: ``bf16``, ``fp16`` or ``fp32``.
        grads_alive: count gradients (True during backward; after ``step()`` ZeRO has released them).
        persistent_params: stage-3 parameter elements kept whole on every rank (under the persistence threshold),
            besides their partition.
    """
    p = WORKING_BYTES[precision]
    k, n = float(num_params), float(world_size)
    # DeepSpeed partitions every parameter, persistent ones included, and keeps the persistent ones whole
    # besides (measured to the byte by bench/memory.py); on one rank the partition is the whole tensor.
    whole_copies = persistent_params if n > 1 else 0
    params = p * k if stage < 3 else p * (k / n + whole_copies)
    grads = 0.0
    if grads_alive:
        grads = p * k if stage < 2 else p * k / n
    # In fp32 at stage 0 the parameters are their own master copy: Adam adds only m and v (8 B).
    state_bytes = 8 if (precision == "fp32" and stage == 0) else ADAM_STATE_BYTES
    optimizer = state_bytes * k if stage == 0 else state_bytes * k / n
    return {"params": params, "grads": grads, "optimizer": optimizer, "model_states": params + grads + optimizer}


def deepspeed_estimate(
    total_params: int,
    largest_layer_params: int,
    stage: int,
    offload: str,
    gpus_per_node: int,
    nodes: int,
    additional_buffer_factor: float = DS_ADDITIONAL_BUFFER_FACTOR,
) -> tuple[float | None, float | None]:
    """(per-GPU bytes, per-node CPU bytes) as DeepSpeed 0.19's estimators compute them, None where it has none.

    Stage 2 restates ``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs``,
    stage 3 ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` with
    ``zero_init=True``. Stages 0 and 1 and optimizer offload on stage 1 have no DeepSpeed estimator.
    """
    total_gpus = nodes * gpus_per_node
    k = total_params
    if stage == 2:
        if offload == "optimizer":
            return float(int(2 * k)), float(int(k * max(4 * total_gpus, 16) * additional_buffer_factor))
        if offload == "none":
            return float(int(2 * k + int(18 * k / total_gpus))), float(
                int(k * 4 * gpus_per_node * additional_buffer_factor)
            )
        return None, None
    if stage == 3:
        gpus_factor = 1 / nodes
        largest = 4 * largest_layer_params
        if offload == "params":
            gpu, cpu = largest, k * 18 * gpus_factor * additional_buffer_factor
        elif offload == "optimizer":
            gpu, cpu = largest + int(2 * k / total_gpus), k * 16 * gpus_factor * additional_buffer_factor
        else:
            gpu = largest + int(18 * k / total_gpus)
            cpu = largest_layer_params * 4 * gpus_per_node * additional_buffer_factor
        return float(int(gpu)), float(int(cpu))
    return None, None


def buffer_bytes(
    stage: int,
    zero: dict[str, Any],
    precision: str,
    largest_layer_params: int | None,
    bucket: int,
    sharded_params: int = 0,
) -> float:
    """Communication buffers per rank for a preset's ``zero_optimization`` dict.

    Stages 0-2: DeepSpeed documents ``overlap_comm`` as using 4.5 x the reduce and all-gather bucket
    sizes; without it one bucket of each (an upper bound: bench/memory.py measures 1.2-3.4x what is
    resident). Stage 3: the reduce bucket (``reduce_bucket_size`` elements, preallocated) plus the
    gathered parameters: DeepSpeed keeps gathered parameters that it will reuse until
    ``stage3_max_live_parameters`` (default 1e9) are live, so at the backward peak up to that many of the
    ``sharded_params`` are whole (measured: bench/memory.py), at least the prefetch bucket or largest layer.
    """
    p = WORKING_BYTES[precision]
    reduce = float(zero.get("reduce_bucket_size", bucket))
    if stage == 3:
        prefetch = zero.get("stage3_prefetch_bucket_size", int(0.9 * bucket))
        prefetch = float(int(0.9 * bucket) if not isinstance(prefetch, int | float) else prefetch)
        live = min(float(sharded_params), float(zero.get("stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS)))
        return p * (reduce + max(live, prefetch, float(largest_layer_params or 0)))
    allgather = 0.0 if stage == 0 else float(zero.get("allgather_bucket_size", bucket))
    factor = 4.5 if zero.get("overlap_comm") else 1.0
    return p * factor * (reduce + allgather)
