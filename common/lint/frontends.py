"""Rules on the keys the front-ends treat their own way: ``"auto"`` values and Lightning's refused keys."""

from __future__ import annotations

from common.lint.view import Finding, LintView, Rule
from common.strategy import auto_placeholders

# Keys whose "auto" Accelerate fills (from its config, the prepared model's hidden size and DummyOptim).
ACCELERATE_AUTO_KEYS = {
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "fp16.enabled",
    "bf16.enabled",
    "zero_optimization.stage",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_param.device",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "optimizer.params.lr",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps",
}


def rule_grad_accum_in_lightning_dict(view: LintView) -> list[Finding]:
    """Lightning raises if ``gradient_accumulation_steps`` is inside the DeepSpeed dict it is given."""
    if view.ds_config is None or "gradient_accumulation_steps" not in view.ds_config:
        return []
    if view.backend == "lightning":
        severity = "error"
        message = (
            "gradient_accumulation_steps is inside the DeepSpeed dict given to Lightning: DeepSpeedStrategy raises "
            "'Do not set gradient_accumulation_steps in the DeepSpeed config'"
        )
    elif view.backend is None and view.source_kind == "deepspeed":
        severity = "info"
        message = (
            "gradient_accumulation_steps is set: fine for Accelerate and deepspeed.initialize, but Lightning's "
            "DeepSpeedStrategy(config=...) raises on it"
        )
    else:
        return []
    return [
        Finding(
            "grad-accum-in-lightning-dict",
            severity,
            message,
            "pass Trainer(accumulate_grad_batches=N) and drop the key; common.strategy.lightning_trainer_kwargs "
            "does both from one resolved dict",
        )
    ]


def rule_auto_values(view: LintView) -> list[Finding]:
    """``"auto"`` is filled only by the Hugging Face Trainer (Accelerate fills a documented subset)."""
    if view.ds_config is None or view.backend == "hf_trainer":
        return []
    keys = auto_placeholders(view.ds_config)
    if not keys:
        return []
    fix = (
        "write numbers: zero-recipes config PRESET --world-size N --micro-batch-size B --hidden-size H resolves "
        "every value (or run under the Hugging Face Trainer, which fills 'auto')"
    )
    if view.backend == "accelerate":
        unfilled = [k for k in keys if k not in ACCELERATE_AUTO_KEYS]
        if not unfilled:
            return [
                Finding(
                    "auto-values",
                    "info",
                    f"'auto' in {', '.join(keys)}: Accelerate fills these from its config, the prepared model's "
                    "hidden_size and the prepared DataLoader's batch size; nothing else does",
                    fix,
                )
            ]
        keys = unfilled
        who = "Accelerate fills only batch, accumulation, clipping, precision, stage/offload and hidden-size keys"
    else:
        who = "deepspeed.initialize and Lightning fill none"
    return [
        Finding(
            "auto-values",
            "error",
            f"'auto' in {', '.join(keys)}: only the Hugging Face Trainer resolves 'auto' ({who}); "
            "DeepSpeed then fails on the string",
            fix,
        )
    ]


RULES: dict[str, Rule] = {
    "grad-accum-in-lightning-dict": rule_grad_accum_in_lightning_dict,
    "auto-values": rule_auto_values,
}
