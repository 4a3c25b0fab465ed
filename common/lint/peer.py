"""Rules on DeepSpeed ZeRO against its peer, PyTorch FSDP2 (the ``fsdp2`` and ``fsdp2_grad_op`` presets).

Under an FSDP2 preset a config asking for what only DeepSpeed has is refused before any work (common.presets). On a
ZeRO config these rules say which of the two applies: ZeRO is the only choice (the run uses a ZeRO-only feature), or
the measured table (bench/results/peer.json, written by bench/peer.py) found the FSDP2 counterpart of its stage
cheaper in every repetition. Without that file (an installed copy without bench/) the second rule says nothing.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from common.lint.view import Finding, LintView, Rule, as_number
from common.presets import FSDP2_PRESETS, ZERO_ONLY_FEATURES

PEER_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "peer.json"
# The peer bar: ZeRO at most 1.00x FSDP2's CPU time per step and 1.10x its model-state bytes per rank.
BARS = {"cpu_s_per_step": 1.00, "model_state_bytes": 1.10}
FIGURES = {"cpu_s_per_step": "CPU time per step", "model_state_bytes": "model-state bytes per rank"}
# Recipe keys of the parallel degrees only DeepSpeed runs (common.presets.ZERO_ONLY_FEATURES), used when above 1.
PARALLEL_KEYS = ("sequence_parallel", "tensor_parallel", "expert_parallel", "pipeline_parallel")


def _offload_device(section: Any) -> str:
    return str(section.get("device", "none")) if isinstance(section, dict) else "none"


def zero_only_features(view: LintView) -> list[str]:
    """The ZeRO-only features (keys of :data:`ZERO_ONLY_FEATURES`) the run's DeepSpeed dict or recipe config uses."""
    zero, recipe = view.zero, view.recipe_config or {}
    used = []
    devices = {_offload_device(zero.get("offload_optimizer")), _offload_device(zero.get("offload_param"))}
    if "nvme" in devices or recipe.get("nvme_path"):
        used.append("nvme_path")
    if _offload_device(zero.get("offload_optimizer")) == "cpu":
        used.append("offload_optimizer")
    if _offload_device(zero.get("offload_param")) == "cpu":
        used.append("offload_param")
    hpz = as_number(zero.get("zero_hpz_partition_size", 1)) or 1
    if hpz > 1 or zero.get("zero_quantized_weights") is True or zero.get("zero_quantized_gradients") is True:
        used.append("zeropp")
    autotp = (view.ds_config or {}).get("tensor_parallel")
    for key in PARALLEL_KEYS:
        degree = as_number(recipe.get(key, 1)) or 1
        if key == "tensor_parallel" and isinstance(autotp, dict):
            degree = max(degree, as_number(autotp.get("autotp_size", 1)) or 1)
        if degree > 1:
            used.append(key)
    return used


def rule_zero_only_feature(view: LintView) -> list[Finding]:
    """The run uses what only DeepSpeed has: the FSDP2 presets are no alternative for it."""
    used = zero_only_features(view)
    if not used:
        return []
    what = ", ".join(ZERO_ONLY_FEATURES[key][0] for key in used)
    return [
        Finding(
            "zero-only-feature",
            "info",
            f"this run uses {what}: only DeepSpeed has it, so ZeRO is the only choice here (the FSDP2 presets, "
            "fsdp2 and fsdp2_grad_op, refuse it)",
            "keep the ZeRO preset; to weigh FSDP2, first try the run without "
            + " / ".join(ZERO_ONLY_FEATURES[key][0] for key in used),
        )
    ]


@functools.lru_cache(maxsize=1)
def measured_peer_table(path: Path = PEER_RESULTS) -> dict[str, Any] | None:
    """bench/peer.py's results (``{"reps", "rows": [...]}``), or None where the file is absent or unreadable."""
    try:
        return json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError):
        return None


def favoured_fsdp2(table: dict[str, Any], zero_preset: str) -> list[str]:
    """Where the table found ``zero_preset`` over a bar against its FSDP2 counterpart in every repetition: one
    phrase per (recipe, front-end, figure), with the median ratio and its range."""
    phrases = []
    for row in table.get("rows", []):
        if row.get("zero") != zero_preset or row.get("error"):
            continue
        zero, fsdp2 = row["runs"][row["zero"]], row["runs"][row["fsdp2"]]
        for field, bar in BARS.items():
            ratios = sorted(z[field] / f[field] for z, f in zip(zero, fsdp2) if f[field])
            if ratios and ratios[0] > bar:
                middle = ratios[len(ratios) // 2]
                phrases.append(
                    f"{row['recipe']} on {row['front_end']}: {FIGURES[field]} {middle:.2f}x "
                    f"({ratios[0]:.2f}-{ratios[-1]:.2f}) {row['fsdp2']}'s"
                )
    return phrases


def peer_findings(view: LintView, table: dict[str, Any] | None) -> list[Finding]:
    """The ``peer-measured-faster`` finding of ``view`` against a measured table (None: no finding)."""
    counterparts = {spec["counterpart"]: name for name, spec in FSDP2_PRESETS.items()}
    zero_preset = {2: "deepspeed_stage_2", 3: "deepspeed_stage_3"}.get(view.stage)
    # Not at a recipe's own start (source "run"): the run has chosen already; the finding is for a config being planned.
    if table is None or zero_preset is None or view.source_kind == "run" or zero_only_features(view):
        return []
    phrases = favoured_fsdp2(table, zero_preset)
    if not phrases:
        return []
    fsdp2 = counterparts[zero_preset]
    return [
        Finding(
            "peer-measured-faster",
            "info",
            f"measured here (bench/results/peer.json, 2 CPU processes), stage {view.stage} cost more than its FSDP2 "
            f"counterpart in every repetition: " + "; ".join(phrases),
            f"on a recipe that runs FSDP2 (cv, science, nlp), try preset={fsdp2} (the same states sharded, by torch) "
            f"and measure both on your machine: zero-recipes probe RECIPE --candidates {zero_preset},{fsdp2}",
        )
    ]


def rule_peer_measured_faster(view: LintView) -> list[Finding]:
    """The measured table favours the FSDP2 counterpart of the run's stage (and the run needs nothing ZeRO-only)."""
    return peer_findings(view, measured_peer_table())


RULES: dict[str, Rule] = {
    "zero-only-feature": rule_zero_only_feature,
    "peer-measured-faster": rule_peer_measured_faster,
}
