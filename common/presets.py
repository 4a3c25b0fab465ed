"""ZeRO presets as plain data.

Each preset is a dict literal you can read top to bottom: the ZeRO stage, the precision, the
``zero_optimization`` fields that differ from DeepSpeed's defaults, and a one-line *why*: the memory
arithmetic and the practice behind the choice (docs/design.md says where the advice comes from).

Values that depend on the run (batch sizes, bucket sizes scaled to the model, world size) are *not*
here: :func:`common.strategy.resolve_deepspeed_config` fills them from the run facts, so that a
resolved config never contains ``"auto"``.

The generic ladder uses Lightning's strategy names (``deepspeed_stage_2_offload`` ...), so a user who
knows ``Trainer(strategy="deepspeed_stage_3")`` finds the same names here.

Beside them, :data:`FSDP2_PRESETS`: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), the peer a user would
pick instead of DeepSpeed, each preset named with the ZeRO preset it is measured against (:mod:`common.fsdp2` runs
them). Every recipe accepts both families' names (:data:`ALL_PRESET_NAMES`, :func:`check_preset_name`).
"""

from __future__ import annotations

import copy
from typing import Any

from common.errors import ConfigError, nearest

# Sentinel for "the factory derives this from the model's hidden size" (see strategy.bucket_sizes).
FROM_MODEL = "from_model"
# Sentinel for "the factory derives this from the run's layout" (devices per node; see strategy.hpz_partition_size).
FROM_LAYOUT = "from_layout"

# The zero_optimization fields every stage-2 preset shares: gradient reduction overlapped with the backward pass,
# gradients copied into one contiguous buffer (no fragmentation), averaged by reduce-scatter, and the updated
# partitions gathered by all-gather (not broadcast). A preset adds its own fields after these.
STAGE_2_ZERO: dict[str, Any] = {
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "allgather_partitions": True,
}
# The same for stage 3, plus the two sizes the factory scales to the model: parameters small enough to stay whole on
# every rank, and how many elements to all-gather ahead of the layer that needs them.
STAGE_3_ZERO: dict[str, Any] = {
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "stage3_param_persistence_threshold": FROM_MODEL,
    "stage3_prefetch_bucket_size": FROM_MODEL,
}

PRESETS: dict[str, dict[str, Any]] = {
    # --- generic ladder (stage 1 -> 2 -> 3 -> offload, fastest first, measured at each step) -------
    "ddp": {
        "why": "Plain data parallelism (ZeRO stage 0): every rank holds all 16 B/param; the ladder's baseline.",
        "stage": 0,
        "zero_optimization": {},
    },
    "deepspeed_stage_1": {
        "why": "Shards optimizer states only (2K + 2K + 12K/N); DeepSpeed 0.19 sends 1.5x DDP's bytes, the first rung.",
        "stage": 1,
        "zero_optimization": {},
    },
    "deepspeed_stage_2": {
        "why": "Shards gradients too (2K + 14K/N); DeepSpeed 0.19 reduces buckets each micro-batch, stage 3's bytes.",
        "stage": 2,
        "zero_optimization": STAGE_2_ZERO,
    },
    "deepspeed_stage_2_offload": {
        "why": "Stage 2 with optimizer states in host RAM: the first offload to try (12 B/param leave the GPU).",
        "stage": 2,
        "zero_optimization": {
            **STAGE_2_ZERO,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    },
    "deepspeed_stage_3": {
        "why": "Shards parameters too (16K/N); an all-gather per layer, use only when stage 2 does not fit.",
        "stage": 3,
        "zero_optimization": STAGE_3_ZERO,
    },
    "deepspeed_stage_3_offload": {
        "why": "Stage 3 with optimizer and parameters in host RAM: about 0.70x throughput, the last resort but NVMe.",
        "stage": 3,
        "zero_optimization": {
            **STAGE_3_ZERO,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        },
    },
    "deepspeed_stage_3_offload_nvme": {
        "why": "Stage 3 with optimizer and parameters on NVMe (2-4 GB/s): fits the most, trains the slowest.",
        "stage": 3,
        "zero_optimization": {
            **STAGE_3_ZERO,
            # No prefetch: DeepSpeed 0.19.8 prefetching NVMe partitions under Accelerate stops at the second forward
            # with "param N already assigned swap buffer id M" (tests/distributed/test_nvme_offload.py); with 0 it
            # trains on both backends. Costs the overlap of the next layer's disk read with this layer's compute.
            "stage3_prefetch_bucket_size": 0,
            # The optimizer steps one sub-group at a time, swapping it in and out whole: this sizes the host buffers.
            "sub_group_size": FROM_MODEL,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": None,
                # Pageable buffers: pinned ones cannot be swapped by the OS, and the disk is the bottleneck anyway.
                "pin_memory": False,
                # Sub-groups in flight (read, step, write back); DeepSpeed's default, measured to train here.
                "buffer_count": 4,
            },
            "offload_param": {
                "device": "nvme",
                "nvme_path": None,
                "pin_memory": False,
                # Parameters swapped in at once (prefetch included): 5 ran out ("Not enough buffers"), 10 trained.
                "buffer_count": 10,
                # Elements per buffer: must hold the largest parameter partition, else DeepSpeed asserts.
                "buffer_size": FROM_MODEL,
                # Parameters kept in host RAM besides the swapped ones: 0 sends every swappable partition to disk.
                "max_in_cpu": 0,
            },
        },
        # DeepSpeed's async I/O (libaio) settings; tune them to the disk with bench/nvme_io.py.
        "aio": {
            # Bytes per read/write request; also the smallest tensor DeepSpeed swaps (max(1 MiB, block_size)).
            "block_size": 1_048_576,
            # Requests in flight per handle: an NVMe drive reaches full bandwidth only with many outstanding.
            "queue_depth": 8,
            # Threads splitting one request (DeepSpeed 0.19's name; older docs call it thread_count).
            "intra_op_parallelism": 1,
            # Submit a queue's requests together, not one by one: fewer system calls.
            "single_submit": False,
            # Overlap submitting new requests with reaping finished ones.
            "overlap_events": True,
        },
    },
    "deepspeed_stage_3_zeropp": {
        "why": "Stage 3 + ZeRO++: int8 weight all-gather, node-local weight copy, int4 gradients (4x less traffic).",
        "stage": 3,
        "zero_optimization": {
            **STAGE_3_ZERO,
            # qwZ: block-quantized int8 weights in the forward all-gather, half of the 16-bit bytes (ZeRO++ tutorial).
            # Needs DeepSpeed's CUDA quantizer: lint refuses it on a CPU.
            "zero_quantized_weights": True,
            # hpZ: a second copy of the weights sharded within each node, so the backward all-gather never leaves
            # the node; costs 16-bit weights / devices-per-node more memory. Set from the run's layout.
            "zero_hpz_partition_size": FROM_LAYOUT,
            # qgZ: gradients averaged by a quantized all-to-all instead of a 16-bit reduce-scatter (CUDA only).
            "zero_quantized_gradients": True,
        },
    },
    # --- domain presets (practitioners' choices per domain) ----------------------------------------
    "cv": {
        "why": "Vision (Swin-like): parameters spread evenly with no giant tensor, so stage 2, not 3.",
        "stage": 2,
        "zero_optimization": STAGE_2_ZERO,
    },
    "nlp": {
        "why": "Language models: huge embeddings need stage 3; params under 1e6 elements stay resident.",
        "stage": 3,
        "zero_optimization": {
            **STAGE_3_ZERO,
            "stage3_param_persistence_threshold": 1_000_000,
        },
    },
    "science": {
        "why": "Scientific models need precision: bf16 (never fp16), stage 2, round-robin gradients.",
        "stage": 2,
        "precision": "bf16",
        "forbid_fp16": True,
        "zero_optimization": {
            **STAGE_2_ZERO,
            # DeepSpeed documents round_robin_gradients as an offload optimisation; the usual advice
            # for scientific models keeps it anyway and it is harmless without offload (lint reports it as info).
            "round_robin_gradients": True,
        },
    },
    "finetune": {
        "why": "LoRA fine-tuning on a big frozen base: stage 3 shards the base, adapters stay whole.",
        "stage": 3,
        "zero_optimization": {
            **STAGE_3_ZERO,
            # Saving adapters and the merged model needs whole weights on rank 0.
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    },
}

PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)

# PyTorch FSDP2 presets: the same sharding, done by torch instead of DeepSpeed (common/fsdp2.py runs them).
FSDP2_PRESETS: dict[str, dict[str, Any]] = {
    "fsdp2": {
        "why": "Parameters, gradients and optimizer state sharded (ZeRO-3's counterpart): two all-gathers per block.",
        # The ZeRO preset that shards the same states: compared with it side by side (bench/peer.py).
        "counterpart": "deepspeed_stage_3",
        # Free each block's gathered weights after its forward, gather again for its backward: 16K/N at rest.
        "reshard_after_forward": True,
        # Reduce-scatter every micro-batch, as ZeRO-2/3 do: the whole unsharded gradient never waits for the next.
        "sync_each_micro_batch": True,
    },
    "fsdp2_grad_op": {
        "why": "Weights stay gathered from a block's forward to its backward (ZeRO-2's counterpart): one all-gather.",
        "counterpart": "deepspeed_stage_2",
        # Keep gathered weights through the backward: one all-gather per step, the whole model gathered at the peak.
        "reshard_after_forward": False,
        # As under fsdp2: DeepSpeed's stage 2 reduces every micro-batch's gradients into its partition too.
        "sync_each_micro_batch": True,
    },
}

FSDP2_PRESET_NAMES: tuple[str, ...] = tuple(FSDP2_PRESETS)
# Recipe settings that only DeepSpeed runs, each with what it is and the ZeRO preset (or stage) that has it.
ZERO_ONLY_FEATURES: dict[str, tuple[str, str]] = {
    "nvme_path": ("NVMe offload (ZeRO-Infinity)", "deepspeed_stage_3_offload_nvme"),
    "offload_optimizer": ("optimizer-state offload apart from the parameters", "deepspeed_stage_2_offload"),
    "offload_param": ("parameter offload to host memory", "deepspeed_stage_3_offload"),
    "zeropp": ("ZeRO++ (quantized all-gather, hpZ, quantized gradients)", "deepspeed_stage_3_zeropp"),
    "sequence_parallel": ("Ulysses sequence parallelism", "deepspeed_stage_3"),
    "tensor_parallel": ("AutoTP tensor parallelism", "deepspeed_stage_2"),
    "expert_parallel": ("DeepSpeed MoE expert parallelism", "deepspeed_stage_2"),
    "pipeline_parallel": ("the DeepSpeed pipeline engine", "deepspeed_stage_1"),
}

# DeepSpeed override keys (their first dotted parts) that ask for one of the ZeRO-only features above.
OVERRIDE_FEATURES: dict[str, str] = {
    "zero_optimization.offload_optimizer": "offload_optimizer",
    "zero_optimization.offload_param": "offload_param",
    "zero_optimization.zero_quantized_weights": "zeropp",
    "zero_optimization.zero_quantized_gradients": "zeropp",
    "zero_optimization.zero_hpz_partition_size": "zeropp",
    "aio": "nvme_path",
}

# What a recipe's ``preset`` key accepts: the ZeRO presets, then the FSDP2 ones.
ALL_PRESET_NAMES: tuple[str, ...] = PRESET_NAMES + FSDP2_PRESET_NAMES


def get_preset(name: str) -> dict[str, Any]:
    """Return a deep copy of a preset, or raise :class:`common.errors.ConfigError` naming the nearest one.

    Args:
        name: a key of :data:`PRESETS`.
    """
    if is_fsdp2_name(name):
        raise ConfigError(
            f"{name} is an FSDP2 preset (torch's fully_shard), not a DeepSpeed one: it has no DeepSpeed config; "
            f"its ZeRO counterpart is {FSDP2_PRESETS[name]['counterpart']}"
        )
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(
            f"unknown preset {name!r}{nearest(str(name), PRESET_NAMES)}; valid: {', '.join(PRESET_NAMES)}"
        )
    return copy.deepcopy(PRESETS[name])


def is_fsdp2_name(name: Any) -> bool:
    """Whether ``name`` names one of :data:`FSDP2_PRESETS` (run by torch's FSDP2, not by DeepSpeed)."""
    return isinstance(name, str) and name in FSDP2_PRESETS


def check_preset_name(name: Any) -> None:
    """Refuse a name that is neither a ZeRO nor an FSDP2 preset, in one line naming the nearest and listing all.

    Raises:
        ConfigError: ``name`` is not in :data:`ALL_PRESET_NAMES`.
    """
    if not isinstance(name, str) or name not in ALL_PRESET_NAMES:
        raise ConfigError(
            f"unknown preset {name!r}{nearest(str(name), ALL_PRESET_NAMES)}; valid: {', '.join(ALL_PRESET_NAMES)}"
        )


def is_active(value: Any) -> bool:
    """Whether a recipe setting turns its feature on: a degree above 1, a non-empty path, true."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value > 1
    return bool(value)


def refuse_zero_only_features(preset: str, settings: dict[str, Any]) -> None:
    """Refuse, in one line, the first setting that only DeepSpeed runs, naming the ZeRO preset that has it.

    Args:
        preset: the run's FSDP2 preset name.
        settings: the recipe's values of :data:`ZERO_ONLY_FEATURES`' keys (others are ignored), e.g.
            ``{"sequence_parallel": 2, "nvme_path": ""}``.

    Raises:
        ConfigError: a ZeRO-only feature is on.
    """
    for key, (what, zero_preset) in ZERO_ONLY_FEATURES.items():
        if is_active(settings.get(key)):
            raise ConfigError(
                f"{key}={settings[key]} ({what}) runs only on DeepSpeed, not under preset={preset}: "
                f"use preset={zero_preset}"
            )


def refuse_deepspeed_overrides(preset: str, overrides: dict[str, Any]) -> None:
    """Refuse DeepSpeed ``key=value`` overrides under an FSDP2 preset, in one line: a ZeRO-only feature names the
    ZeRO preset that has it, any other key says that no DeepSpeed config is built.

    Raises:
        ConfigError: ``overrides`` is not empty.
    """
    for key, value in overrides.items():
        for prefix, feature in OVERRIDE_FEATURES.items():
            if key == prefix or key.startswith(prefix + "."):
                what, zero_preset = ZERO_ONLY_FEATURES[feature]
                raise ConfigError(
                    f"ds_overrides {key}={value} ({what}) runs only on DeepSpeed, not under preset={preset}: "
                    f"use preset={zero_preset}"
                )
    if overrides:
        keys = ", ".join(overrides)
        raise ConfigError(
            f"ds_overrides ({keys}) set DeepSpeed keys, and preset={preset} builds no DeepSpeed config: drop them, "
            f"or use preset={FSDP2_PRESETS[preset]['counterpart']}"
        )


def is_fsdp2_preset(name: Any) -> bool:
    """Whether ``name`` is one of :data:`FSDP2_PRESETS` (a preset dict counts when it has ``reshard_after_forward``)."""
    if isinstance(name, dict):
        return "reshard_after_forward" in name
    return isinstance(name, str) and name in FSDP2_PRESETS


def get_fsdp2_preset(preset: str | dict[str, Any]) -> dict[str, Any]:
    """A deep copy of an FSDP2 preset (a name or a preset-shaped dict); an unknown name names the nearest one.

    Raises:
        ConfigError: ``preset`` is not an FSDP2 preset.
    """
    if isinstance(preset, dict) and is_fsdp2_preset(preset):
        return copy.deepcopy(preset)
    if not is_fsdp2_preset(preset):
        raise ConfigError(
            f"unknown FSDP2 preset {preset!r}{nearest(str(preset), FSDP2_PRESET_NAMES)}; "
            f"valid: {', '.join(FSDP2_PRESET_NAMES)}"
        )
    return copy.deepcopy(FSDP2_PRESETS[preset])
