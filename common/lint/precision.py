"""Rules on precision: fp16 and bf16 engines, loss scaling, attention kernels and optimizer-state dtypes."""

from __future__ import annotations

from common.lint.view import Finding, LintView, Rule, as_number


def rule_lightning_16_mixed(view: LintView) -> list[Finding]:
    """Lightning's ``16-mixed`` under DeepSpeed is DeepSpeed's fp16 engine, not ``torch.autocast``."""
    values = [view.recipe("precision")]
    trainer = view.recipe("trainer")
    if isinstance(trainer, dict):
        values.append(trainer.get("precision"))
    if any(str(v) in ("16-mixed", "16", "16-true") for v in values if v is not None):
        return [
            Finding(
                "lightning-16-mixed",
                "warning",
                "Lightning's precision '16-mixed' under DeepSpeedStrategy switches on DeepSpeed fp16: the engine "
                "holds fp16 weights with dynamic loss scaling; it is not torch.autocast with fp32 weights",
                "use precision: bf16 (Lightning 'bf16-mixed'); keep fp16 only on hardware without bf16, with "
                "dynamic loss scaling (fp16.loss_scale 0, loss_scale_window 1000)",
            )
        ]
    return []


def rule_fp16_in_science(view: LintView) -> list[Finding]:
    """Scientific models need bf16 or fp32, never fp16."""
    recipe_precision = str(view.recipe("precision", ""))
    science = view.recipe("preset") == "science" or (view.path is not None and "recipes/science" in view.path)
    fp16 = recipe_precision in ("fp16", "16-mixed", "16") or (view.ds_config is not None and view.precision == "fp16")
    if science and fp16:
        return [
            Finding(
                "fp16-in-science",
                "error",
                "fp16 in the science preset: fp16's 5-bit exponent overflows and its 10-bit mantissa drops the small "
                "terms scientific models depend on",
                "use precision: bf16 (fp16.enabled false, bf16.enabled true) or fp32",
            )
        ]
    return []


def rule_flash_attention_fp32(view: LintView) -> list[Finding]:
    """FlashAttention kernels take fp16/bf16 only."""
    requested = [view.recipe(k) for k in ("attention", "attn_implementation", "attention_implementation")]
    flash = (
        any(isinstance(v, str) and v.startswith("flash") for v in requested) or view.recipe("flash_attention") is True
    )
    if flash and view.precision == "fp32":
        return [
            Finding(
                "flash-attention-fp32",
                "error",
                "FlashAttention with fp32: its kernels accept only fp16 and bf16 inputs, so the run fails (or "
                "transformers falls back to another attention)",
                "use precision: bf16, or attention: sdpa for fp32",
            )
        ]
    return []


def rule_fp16_loss_scaling(view: LintView) -> list[Finding]:
    """NaN/Inf with fp16 -> dynamic loss scaling with loss_scale_window, or bf16."""
    if view.ds_config is None or not view.section_enabled("fp16"):
        return []
    fp16 = view.ds_config.get("fp16")
    scale = as_number(fp16.get("loss_scale", 0)) if isinstance(fp16, dict) else 0
    if not scale:
        return []
    return [
        Finding(
            "fp16-loss-scaling",
            "warning",
            f"fp16 with a static loss scale ({scale:g}): gradients overflow to Inf/NaN or underflow to zero as their "
            "range drifts",
            "set fp16.loss_scale: 0 (dynamic) with loss_scale_window: 1000, or use bf16",
        )
    ]


def rule_fp16_and_bf16(view: LintView) -> list[Finding]:
    """DeepSpeed refuses both precisions at once."""
    if view.ds_config is None or not (view.section_enabled("fp16") and view.section_enabled("bf16")):
        return []
    return [
        Finding(
            "fp16-and-bf16",
            "error",
            "fp16 and bf16 are both enabled: DeepSpeed refuses the config",
            "enable one: bf16.enabled true and fp16.enabled false (or the reverse on hardware without bf16)",
        )
    ]


def rule_accelerate_precision(view: LintView) -> list[Finding]:
    """accelerate YAML ``mixed_precision`` and the DeepSpeed JSON's fp16/bf16 must agree."""
    acc = view.accelerate_config or {}
    mixed = acc.get("mixed_precision")
    if not mixed or view.ds_config is None or not (acc.get("deepspeed_config") or {}).get("deepspeed_config_file"):
        return []
    wanted = {"bf16": "bf16", "fp16": "fp16", "no": "fp32"}.get(str(mixed))
    if wanted is None or wanted == view.precision:
        return []
    return [
        Finding(
            "accelerate-precision-mismatch",
            "error",
            f"accelerate mixed_precision '{mixed}' but the DeepSpeed JSON trains in {view.precision}: Accelerate "
            "refuses or silently takes one of the two",
            "drop mixed_precision from the accelerate YAML (the JSON decides) or make them equal",
        )
    ]


def rule_bf16_optimizer_states(view: LintView) -> list[Finding]:
    """``bf16.bf16_optimizer_states`` / ``bf16_master_weights_and_grads`` (DeepSpeed 0.19): what DeepSpeed requires."""
    section = (view.ds_config or {}).get("bf16")
    if not isinstance(section, dict):
        return []
    states, master = section.get("bf16_optimizer_states") is True, section.get("bf16_master_weights_and_grads") is True
    if not (states or master):
        return []
    problems = []
    if not section.get("enabled"):
        problems.append("bf16 is not enabled")
    if view.stage == 0:
        problems.append("they need ZeRO stage 1, 2 or 3")
    if states and not master:
        problems.append("bf16_optimizer_states needs bf16_master_weights_and_grads")
    if master and not states and view.offload_device("offload_optimizer") == "none":
        problems.append("bf16 master weights with fp32 optimizer states need ZeRO-Offload (offload_optimizer cpu)")
    if problems:
        return [
            Finding(
                "bf16-optimizer-states",
                "error",
                "bf16 master weights / optimizer states: " + "; ".join(problems) + " (DeepSpeed asserts at initialize)",
                "set bf16.enabled, bf16_master_weights_and_grads and bf16_optimizer_states together at stage 1-3",
            )
        ]
    kept = "6 B" if states else "4 + 8 B"
    return [
        Finding(
            "bf16-optimizer-states",
            "info",
            f"bf16 master weights{' and Adam moments' if states else ''}: about {kept} of optimizer state per "
            "parameter instead of 12 B, at the cost of bf16 rounding in the update (compare the loss with fp32 states)",
            "keep it when memory decides; common.strategy.make_optimizer builds DeepSpeedCPUAdam with bf16 moments "
            "under offload",
        )
    ]


RULES: dict[str, Rule] = {
    "lightning-16-mixed": rule_lightning_16_mixed,
    "fp16-in-science": rule_fp16_in_science,
    "flash-attention-fp32": rule_flash_attention_fp32,
    "fp16-loss-scaling": rule_fp16_loss_scaling,
    "fp16-and-bf16": rule_fp16_and_bf16,
    "accelerate-precision-mismatch": rule_accelerate_precision,
    "bf16-optimizer-states": rule_bf16_optimizer_states,
}
