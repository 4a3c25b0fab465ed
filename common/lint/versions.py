"""Rules on installed versions: known bugs of PyTorch, DeepSpeed and NCCL, and DeepSpeed keys since removed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.lint.view import Finding, LintView, Rule, version_tuple


def rule_torch_zero_leak(view: LintView) -> list[Finding]:
    """PyTorch before 1.12 leaks memory under ZeRO (a pitfall practitioners report)."""
    version = view.versions.get("torch")
    if not version or view.stage == 0 or version_tuple(version) >= (1, 12):
        return []
    return [
        Finding(
            "torch-zero-memory-leak",
            "error",
            f"PyTorch {version} is installed: versions before 1.12 have a ZeRO memory leak",
            "upgrade: pip install 'torch>=2.4' (a reported stable pairing: PyTorch 2.0 + DeepSpeed 0.9 or newer)",
        )
    ]


def rule_deepspeed_06_zero3(view: LintView) -> list[Finding]:
    """DeepSpeed 0.6's ZeRO-3 has a parameter-synchronisation bug."""
    version = view.versions.get("deepspeed")
    if not version or view.stage != 3 or version_tuple(version)[:2] != (0, 6):
        return []
    return [
        Finding(
            "deepspeed-0.6-zero3-sync",
            "error",
            f"DeepSpeed {version} is installed: 0.6's ZeRO-3 has a parameter synchronisation bug",
            "upgrade: pip install 'deepspeed>=0.16' (a reported stable pairing: DeepSpeed 0.9+ with PyTorch 2.0+)",
        )
    ]


def rule_nccl_version(view: LintView) -> list[Finding]:
    """NCCL 2.10 or newer (older releases are a reported source of ZeRO collective failures)."""
    version = view.versions.get("nccl")
    if not version or version_tuple(version) >= (2, 10):
        return []
    return [
        Finding(
            "nccl-version",
            "warning",
            f"NCCL {version}: use 2.10 or newer for ZeRO's reduce-scatter and all-gather",
            "install a PyTorch build that bundles a newer NCCL",
        )
    ]


@dataclass(frozen=True)
class RemovedKey:
    """A DeepSpeed config key (or optimizer type) that a DeepSpeed release removed, and what to write instead."""

    key: str  # dotted path in the DeepSpeed dict; ``optimizer.type=NAME`` for a removed optimizer
    release: str  # the first DeepSpeed release without it
    feature: str
    fix: str


# DeepSpeed 0.19.7 and 0.19.8 removed these features; both raise DeepSpeedConfigError on a leftover key (their
# runtime/config.py: _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS) and 0.19.7 dropped the 1-bit
# optimizers from its optimizer list. Compared release against release, from the published sources.
REMOVED_DEEPSPEED_KEYS = (
    RemovedKey(
        "nebula",
        "0.19.7",
        "Nebula checkpointing",
        "delete the block; the checkpoint engines of "
        "checkpoint.writer (or async_save=true in a recipe) save in the background",
    ),
    RemovedKey(
        "compression_training",
        "0.19.7",
        "the compression library (quantisation-aware training, pruning)",
        "delete the block; the model would train unquantised, as a leftover block did before",
    ),
    RemovedKey("quantize_training", "0.19.7", "Mixture-of-Quantization (MoQ)", "delete the block"),
    RemovedKey(
        "sparse_attention",
        "0.19.7",
        "DeepSpeed Sparse Attention",
        "delete the block; sdpa or flash_attention_2 attention in the model",
    ),
    RemovedKey(
        "zero_optimization.mics_shard_size",
        "0.19.7",
        "MiCS sharding",
        "delete it; zero_hpz_partition_size (ZeRO++ hpZ) keeps a second, node-local copy of the parameters",
    ),
    RemovedKey(
        "zero_optimization.mics_hierarchical_params_gather",
        "0.19.7",
        "MiCS sharding",
        "delete it; zero_hpz_partition_size (ZeRO++ hpZ) gathers within a node",
    ),
    RemovedKey("optimizer.type=OneBitAdam", "0.19.7", "1-bit Adam", "optimizer type Adam or AdamW"),
    RemovedKey("optimizer.type=ZeroOneAdam", "0.19.7", "0/1 Adam", "optimizer type Adam or AdamW"),
    RemovedKey("optimizer.type=OneBitLamb", "0.19.7", "1-bit LAMB", "optimizer type Lamb"),
    RemovedKey("amp", "0.19.8", "NVIDIA Apex AMP", "delete the block; bf16.enabled (or fp16.enabled) instead"),
    RemovedKey(
        "sparse_gradients",
        "0.19.8",
        "sparse compression of dense embedding gradients",
        "delete it; an embedding built with sparse=True is still reduced sparsely",
    ),
    RemovedKey("eigenvalue", "0.19.8", "eigenvalue-based MoQ", "delete the block"),
    RemovedKey(
        "elasticity",
        "0.19.8",
        "elastic training",
        "delete the block; set train_micro_batch_size_per_gpu and gradient_accumulation_steps directly (the "
        "factory does)",
    ),
    RemovedKey("graph_harvesting", "0.19.8", "graph harvesting", "delete it"),
    RemovedKey(
        "curriculum_learning",
        "0.19.8",
        "the legacy top-level curriculum learning",
        "move it to data_efficiency.data_sampling.curriculum_learning",
    ),
    RemovedKey("progressive_layer_drop", "0.19.8", "Progressive Layer Dropping", "delete the block"),
    RemovedKey(
        "zero_optimization.zeropp_loco_param",
        "0.19.8",
        "LoCo-ZeRO++ error feedback",
        "delete it; zero_quantized_gradients stays, without LoCo's error feedback",
    ),
)


def _has_removed_key(ds_config: dict[str, Any], key: str) -> bool:
    """Whether ``ds_config`` holds ``key`` (:attr:`RemovedKey.key`): a dotted path, or ``optimizer.type=NAME``."""
    path, _, optimizer = key.partition("=")
    if optimizer:
        section = ds_config.get("optimizer")
        name = section.get("type") if isinstance(section, dict) else None
        return isinstance(name, str) and name.lower().replace("_", "") == optimizer.lower()
    node: Any = ds_config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def rule_deepspeed_removed_keys(view: LintView) -> list[Finding]:
    """DeepSpeed 0.19.7 and 0.19.8 removed features and refuse their leftover keys: name the release and the fix."""
    installed = view.versions.get("deepspeed")
    findings = []
    for removed in REMOVED_DEEPSPEED_KEYS:
        if not _has_removed_key(view.ds_config or {}, removed.key):
            continue
        shown = removed.key.replace("=", " ")
        if installed and version_tuple(installed) >= version_tuple(removed.release):
            severity = "error"
            effect = f"DeepSpeed {installed} is installed and refuses the config (DeepSpeedConfigError)"
        else:
            severity = "warning"
            effect = f"the config fails from that release on (installed: {installed or 'unknown'})"
        findings.append(
            Finding(
                "deepspeed-removed-keys",
                severity,
                f"{view.where}{shown}: {removed.feature} was removed in DeepSpeed {removed.release}; {effect}",
                removed.fix,
            )
        )
    return findings


RULES: dict[str, Rule] = {
    "torch-zero-memory-leak": rule_torch_zero_leak,
    "deepspeed-0.6-zero3-sync": rule_deepspeed_06_zero3,
    "nccl-version": rule_nccl_version,
    "deepspeed-removed-keys": rule_deepspeed_removed_keys,
}
