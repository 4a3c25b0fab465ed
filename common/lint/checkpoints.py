"""Rules on checkpoints: activation checkpointing under stage 3 and consolidating stage-3 saves."""

from __future__ import annotations

from common.errors import ConfigError
from common.lint.view import Finding, LintView, Rule
from common.memory_formulas import (
    USABLE_FRACTION,
    transformer_activations,
)


def rule_stage3_full_checkpointing(view: LintView) -> list[Finding]:
    """Stage 3 + ``full`` activation checkpointing recomputes (and re-gathers) twice."""
    if view.stage != 3 or view.recipe("activation_checkpointing") != "full":
        return []
    return [
        Finding(
            "stage3-full-checkpointing",
            "warning",
            "ZeRO stage 3 with 'full' activation checkpointing recomputes twice (each recomputed block re-gathers its "
            "parameters), costing throughput",
            "use activation_checkpointing: save_memory_optimized (skips the last block's wasted re-gather), or measure "
            "both: zero-recipes probe RECIPE --activation-checkpointing full,save_memory_optimized",
        )
    ]


def rule_stage3_needs_checkpointing(view: LintView) -> list[Finding]:
    """Stage 3 still out of memory -> activation checkpointing. Checked with the estimator, on the
    rank's share of the sequence under Ulysses sequence parallelism. Silent under tiling (``tiled_mlp_shards``,
    ``tiled_loss_shards``): the estimator does not model what tiling keeps, and a warning computed without it would
    count activations the run never holds."""
    if view.stage != 3 or view.model is None or not view.device_memory_bytes:
        return []
    if view.recipe("activation_checkpointing", "none") != "none":
        return []
    if int(view.recipe("tiled_mlp_shards") or 1) > 1 or int(view.recipe("tiled_loss_shards") or 1) > 1:
        return []
    seq_len = int(view.recipe("seq_len") or 0)
    batch = int(view.recipe("micro_batch_size") or (view.ds_config or {}).get("train_micro_batch_size_per_gpu") or 1)
    if not seq_len:
        return []
    precision = view.precision if view.precision in ("bf16", "fp16", "fp32") else "bf16"
    sequence_parallel = int(view.recipe("sequence_parallel") or 1)
    try:
        none, full = (
            transformer_activations(view.model, seq_len, batch, preset, precision, sequence_parallel=sequence_parallel)
            for preset in ("none", "full")
        )
    except ConfigError:
        return []  # a sequence-parallel size the model cannot split: the recipe refuses it with its own message
    if none is None or full is None:
        return []
    states = 16 * view.model.num_params / max(1, view.world_size)
    usable = USABLE_FRACTION * view.device_memory_bytes
    if states + none <= usable or states + full > usable:
        return []
    return [
        Finding(
            "stage3-needs-checkpointing",
            "warning",
            f"stage 3 without activation checkpointing: model states {states / 1e9:.2f} GB + activations "
            f"{none / 1e9:.2f} GB per rank (Korthikanti et al.) exceed {usable / 1e9:.2f} GB usable; stage 3 shards "
            "model states, not activations",
            f"activation_checkpointing: save_memory_optimized or full (activations about {full / 1e9:.2f} GB)",
        )
    ]


def rule_stage3_consolidate(view: LintView) -> list[Finding]:
    """Stage-3 checkpoints are sharded; consolidate before loading on one device.

    Not reported for recipes: they consolidate into ``final/`` themselves.
    """
    if view.stage != 3 or view.zero.get("stage3_gather_16bit_weights_on_model_save"):
        return []
    if view.source_kind in ("recipe", "run"):
        return []
    return [
        Finding(
            "stage3-consolidate",
            "info",
            "stage-3 checkpoints are sharded per rank and do not load on one device as they are",
            "consolidate first: zero-recipes export RUN_DIR (DeepSpeed's zero_to_fp32), then load; re-shard by "
            "loading the consolidated weights into a new run with the new world size",
        )
    ]


RULES: dict[str, Rule] = {
    "stage3-full-checkpointing": rule_stage3_full_checkpointing,
    "stage3-needs-checkpointing": rule_stage3_needs_checkpointing,
    "stage3-consolidate": rule_stage3_consolidate,
}
