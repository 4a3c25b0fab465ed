"""ZeRO presets as plain data.

Each preset is a dict literal you can read top to bottom: the ZeRO stage, the precision, the
``zero_optimization`` fields that differ from DeepSpeed's defaults, and a one-line *why* taken from
the guides in ``shared/seeds`` (guide 1: memory and stages; guide 2: practice and domains).

Values that depend on the run (batch sizes, bucket sizes scaled to the model, world size) are *not*
here: :func:`common.strategy.resolve_deepspeed_config` fills them from the run facts, so that a
resolved config never contains ``"auto"``.

The generic ladder uses Lightning's strategy names (``deepspeed_stage_2_offload`` ...), so a user who
knows ``Trainer(strategy="deepspeed_stage_3")`` finds the same names here.
"""

from __future__ import annotations

import copy
from typing import Any

# Sentinel for "the factory derives this from the model's hidden size" (see strategy.bucket_sizes).
FROM_MODEL = "from_model"

PRESETS: dict[str, dict[str, Any]] = {
    # --- generic ladder (guide 1, 5.3: stage 1 -> 2 -> 3 -> offload, measured at each step) -------
    "ddp": {
        "why": "Plain data parallelism (ZeRO stage 0): every rank holds all 16 B/param; the ladder's baseline.",
        "stage": 0,
        "zero_optimization": {},
    },
    "deepspeed_stage_1": {
        "why": "Shards optimizer states only (2K + 2K + 12K/N): same communication as DDP, the first rung.",
        "stage": 1,
        "zero_optimization": {},
    },
    "deepspeed_stage_2": {
        "why": "Shards gradients too (2K + 14K/N); reduce-scatter replaces all-reduce, about 3 % slower than stage 1.",
        "stage": 2,
        "zero_optimization": {
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "allgather_partitions": True,
        },
    },
    "deepspeed_stage_2_offload": {
        "why": "Stage 2 with optimizer states in host RAM: the guide's first offload (12 B/param leave the GPU).",
        "stage": 2,
        "zero_optimization": {
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "allgather_partitions": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    },
    "deepspeed_stage_3": {
        "why": "Shards parameters too (16K/N); an all-gather per layer, use only when stage 2 does not fit.",
        "stage": 3,
        "zero_optimization": {
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "stage3_param_persistence_threshold": FROM_MODEL,
            "stage3_prefetch_bucket_size": FROM_MODEL,
        },
    },
    "deepspeed_stage_3_offload": {
        "why": "Stage 3 with optimizer and parameters in host RAM: about 0.70x throughput, the last resort but NVMe.",
        "stage": 3,
        "zero_optimization": {
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "stage3_param_persistence_threshold": FROM_MODEL,
            "stage3_prefetch_bucket_size": FROM_MODEL,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        },
    },
    "deepspeed_stage_3_offload_nvme": {
        "why": "Stage 3 with optimizer and parameters on NVMe (2-4 GB/s): fits the most, trains the slowest.",
        "stage": 3,
        "zero_optimization": {
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "stage3_param_persistence_threshold": FROM_MODEL,
            "stage3_prefetch_bucket_size": FROM_MODEL,
            "offload_optimizer": {"device": "nvme", "pin_memory": True, "nvme_path": None},
            "offload_param": {"device": "nvme", "pin_memory": True, "nvme_path": None},
        },
    },
    # --- domain presets (guide 2, section 7) -----------------------------------------------------
    "cv": {
        "why": "Vision (Swin-like): parameters spread evenly with no giant tensor, so stage 2, not 3 (guide 2, 7.1).",
        "stage": 2,
        "zero_optimization": {
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "allgather_partitions": True,
        },
    },
    "nlp": {
        "why": "Language models: huge embeddings need stage 3; params under 1e6 elements stay resident (guide 2, 7.2).",
        "stage": 3,
        "zero_optimization": {
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "stage3_param_persistence_threshold": 1_000_000,
            "stage3_prefetch_bucket_size": FROM_MODEL,
        },
    },
    "science": {
        "why": "Scientific models need precision: bf16 (never fp16), stage 2, round-robin gradients (guide 2, 7.3).",
        "stage": 2,
        "precision": "bf16",
        "forbid_fp16": True,
        "zero_optimization": {
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "allgather_partitions": True,
            # DeepSpeed documents round_robin_gradients as an offload optimisation; the guide asks
            # for it anyway and it is harmless without offload (lint reports it as info).
            "round_robin_gradients": True,
        },
    },
    "finetune": {
        "why": "LoRA fine-tuning on a big frozen base: stage 3 shards the base, adapters stay whole (guide 2, 4.2).",
        "stage": 3,
        "zero_optimization": {
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "stage3_param_persistence_threshold": FROM_MODEL,
            "stage3_prefetch_bucket_size": FROM_MODEL,
            # Saving adapters and the merged model needs whole weights on rank 0.
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    },
}

PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


def get_preset(name: str) -> dict[str, Any]:
    """Return a deep copy of a preset, or raise :class:`common.errors.ConfigError` naming the nearest one.

    Args:
        name: a key of :data:`PRESETS`.
    """
    from common.errors import ConfigError, nearest

    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(
            f"unknown preset {name!r}{nearest(str(name), PRESET_NAMES)}; valid: {', '.join(PRESET_NAMES)}"
        )
    return copy.deepcopy(PRESETS[name])
