"""Config linter: the ZeRO pitfalls of the guides (docs/design.md), those found here and upstream, each with its fix.

``zero-recipes lint CONFIG`` reads a recipe YAML, a DeepSpeed JSON or an accelerate YAML, normalises
it into a :class:`LintView` (the DeepSpeed dict, the recipe config dict or None, the source kind, the
installed versions and whatever is known of the model), and runs every rule of :data:`RULES` on it.
A rule is a small pure function ``(view) -> list[Finding]``; tests build views directly.

Severities: ``error`` (the run fails or silently does the wrong thing; exit code 1), ``warning``
(costs memory, speed or accuracy; fix it or know why not), ``info`` (worth knowing, nothing to fix:
shipped presets may carry info findings on purpose, e.g. ``round_robin_gradients`` in ``science``).

Every recipe lints its resolved config at start (docs/tools.md)::

    findings = lint_run(ds_config, config_to_dict(cfg), backend="lightning", hidden_size=hidden,
                        world_size=world_size, ranks_per_node=devices)
    if rank0:
        print_findings(findings)
    if has_errors(findings):
        raise ConfigError("the config linter found errors (above); docs/tools.md lists the rules")
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from common.errors import ConfigError
from common.memory_formulas import (
    USABLE_FRACTION,
    WORKING_BYTES,
    ModelFacts,
    guide_model_states,
    local_device_memory,
    swap_threshold_bytes,
    transformer_activations,
)
from common.strategy import AIO_KEYS, AIO_OLD_NAMES, auto_placeholders

SEVERITIES = ("error", "warning", "info")

SOURCE_KINDS = ("recipe", "deepspeed", "accelerate", "run")
BACKENDS = ("lightning", "accelerate", "hf_trainer")

GUIDE_BUCKET_MIN = 5e8  # guide 2, 6: "reduce_bucket_size ... between 5e8 and 2e9"
GUIDE_BUCKET_MAX = 2e9
DS_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size / allgather_bucket_size default
DS_DEFAULT_PERSISTENCE = 100_000  # DeepSpeed's stage3_param_persistence_threshold default
# A threshold of 64 h^2 keeps every matrix of a transformer block whole (the largest is ~4-8 h^2 at
# most): stage 3 then shards little more than the embeddings.
PERSISTENCE_MAX_PER_H2 = 64

# ZeRO partitions these optimizers (DeepSpeed's own names and the torch classes the recipes pass in).
PARTITION_OPTIMIZERS = {
    "adam",
    "adamw",
    "fusedadam",
    "cpuadam",
    "deepspeedcpuadam",
    "onebitadam",
    "zerooneadam",
    "lamb",
    "fusedlamb",
    "onebitlamb",
    "adagrad",
    "cpuadagrad",
}

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


@dataclass(frozen=True)
class Finding:
    """One problem: which rule, how bad, what is wrong, and what to do."""

    rule_id: str
    severity: str
    message: str
    fix: str


@dataclass
class LintView:
    """The normalised input every rule reads.

    Attributes:
        ds_config: the DeepSpeed dict (resolved by the factory for a recipe; as written for a JSON).
        recipe_config: the recipe's config as a dict, or None for a bare DeepSpeed / accelerate file.
        source_kind: ``recipe``, ``deepspeed``, ``accelerate`` or ``run`` (a recipe linting itself).
        versions: installed versions, ``{"torch": "2.4.0", "deepspeed": "0.16.1", "nccl": "2.21.5"}``.
        backend: who consumes ``ds_config``: ``lightning``, ``accelerate``, ``hf_trainer`` or None (unknown).
        hidden_size: the model's hidden size, when known.
        num_params: the model's parameter count, when known.
        ranks_per_node: processes per node (offload host RAM).
        world_size: data-parallel ranks.
        host_ram_bytes: host RAM available for pinned offload buffers (None: not checked).
        device_memory_bytes: memory of one device (activation check; None: not checked).
        local_memory: ``(bytes, label)``: what one rank has on this machine (the first GPU's memory, or on a CPU
            the host RAM shared by its ranks; :func:`common.memory_formulas.local_device_memory`), for the
            stage-3 bucket
            check when ``device_memory_bytes`` is not given; None: not checked.
        model: :class:`common.memory_formulas.ModelFacts` for the activation estimate, or None.
        accelerate_config: the accelerate YAML, for accelerate sources.
        path: the file linted, for messages.
        accelerator: ``cuda`` or ``cpu``: what the run has (a recipe linting itself); None when the config may be
            for another machine (a file), so that GPU-only features are reported as info, not as errors.
    """

    ds_config: dict[str, Any] | None
    recipe_config: dict[str, Any] | None = None
    source_kind: str = "deepspeed"
    versions: dict[str, str] = field(default_factory=dict)
    backend: str | None = None
    hidden_size: int | None = None
    num_params: int | None = None
    ranks_per_node: int = 1
    world_size: int = 1
    host_ram_bytes: float | None = None
    device_memory_bytes: float | None = None
    local_memory: tuple[float, str] | None = None
    model: Any = None
    accelerate_config: dict[str, Any] | None = None
    path: str | None = None
    accelerator: str | None = None

    # --- small readers the rules share ---

    @property
    def zero(self) -> dict[str, Any]:
        """``zero_optimization`` (empty when absent)."""
        zero = (self.ds_config or {}).get("zero_optimization")
        return zero if isinstance(zero, dict) else {}

    @property
    def stage(self) -> int:
        """The ZeRO stage (DeepSpeed's default 0 when absent or not a number)."""
        stage = self.zero.get("stage", 0)
        return stage if isinstance(stage, int) and not isinstance(stage, bool) else 0

    def section_enabled(self, name: str) -> bool:
        """Whether ``fp16`` / ``bf16`` is enabled in the DeepSpeed dict."""
        section = (self.ds_config or {}).get(name)
        if isinstance(section, dict):
            return section.get("enabled") is True
        return section is True

    def recipe(self, key: str, default: Any = None) -> Any:
        """A recipe config value, or ``default`` without a recipe config."""
        return (self.recipe_config or {}).get(key, default)

    def offload_device(self, section: str) -> str:
        """``cpu``, ``nvme`` or ``none`` for ``offload_optimizer`` / ``offload_param``."""
        offload = self.zero.get(section)
        if isinstance(offload, dict):
            return str(offload.get("device") or "none").lower()
        return "none"

    @property
    def precision(self) -> str:
        """``fp16``, ``bf16`` or ``fp32`` as the DeepSpeed dict says (the recipe's when there is no dict)."""
        if self.ds_config is None:
            return str(self.recipe("precision", "fp32"))
        if self.section_enabled("fp16"):
            return "fp16"
        if self.section_enabled("bf16"):
            return "bf16"
        return "fp32"

    @property
    def where(self) -> str:
        """``path: `` prefix for messages."""
        return f"{self.path}: " if self.path else ""


Rule = Callable[[LintView], list[Finding]]


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


# --- rules --------------------------------------------------------------------------------------------


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


def rule_round_robin_without_offload(view: LintView) -> list[Finding]:
    """DeepSpeed documents ``round_robin_gradients`` as an optimisation for CPU offload."""
    if not view.zero.get("round_robin_gradients"):
        return []
    if view.offload_device("offload_optimizer") != "none":
        return []
    return [
        Finding(
            "round-robin-without-offload",
            "info",
            "round_robin_gradients is on without optimizer offload: DeepSpeed documents it as a stage 1/2 "
            "optimisation of the CPU-offload gradient copy, so here it changes nothing (the science preset keeps "
            "it because guide 2, 7.3 asks for it)",
            "keep it (harmless) or drop it; it pays off with offload_optimizer.device: cpu",
        )
    ]


def rule_persistence_threshold(view: LintView) -> list[Finding]:
    """Stage-3 persistence threshold vs hidden size: too small gathers norms one by one, too large shards nothing."""
    if view.stage != 3 or not view.hidden_size:
        return []
    raw = view.zero.get("stage3_param_persistence_threshold", DS_DEFAULT_PERSISTENCE)
    threshold = _number(raw)
    if threshold is None:
        return []
    h = view.hidden_size
    if threshold < h:
        return [
            Finding(
                "persistence-threshold",
                "warning",
                f"stage3_param_persistence_threshold {threshold:.0f} is below the hidden size {h}: every norm weight "
                "and bias (h elements) is partitioned and all-gathered on its own, one latency-bound collective each",
                f"set it to about 10 x hidden = {10 * h} (the Hugging Face Trainer's rule; the factory's default)",
            )
        ]
    if threshold >= PERSISTENCE_MAX_PER_H2 * h * h:
        return [
            Finding(
                "persistence-threshold",
                "warning",
                f"stage3_param_persistence_threshold {threshold:.3g} is >= {PERSISTENCE_MAX_PER_H2} x hidden^2 "
                f"({PERSISTENCE_MAX_PER_H2 * h * h:.3g} for hidden {h}): every weight matrix stays whole on every "
                "rank, so stage 3 costs its all-gathers but saves little over stage 2",
                f"set it to about 10 x hidden = {10 * h}, or 1e6 to keep small matrices resident (guide 2, 7.2)",
            )
        ]
    return []


def _buckets(view: LintView) -> list[tuple[str, float]]:
    keys = ["reduce_bucket_size"] + (["allgather_bucket_size"] if view.stage in (1, 2) else [])
    out = []
    for key in keys:
        value = _number(view.zero.get(key, DS_DEFAULT_BUCKET))
        if value is not None:
            out.append((key, value))
    return out


def rule_bucket_size(view: LintView) -> list[Finding]:
    """Guide 2 (6): buckets between 5e8 and 2e9 elements; the presets scale them down for small models.

    Fires (warning) above 2e9; below 5e8 only when the model is known to be big enough for 5e8
    (32 x hidden^2 >= 5e8, the presets' own scaling, i.e. hidden >= ~4000). Below 5e8 with no hidden
    size known, in a DeepSpeed or accelerate file, it is an info: a small bucket is right for a small
    model and wrong for a 7B one, and only the model can tell.
    """
    if view.ds_config is None or view.stage == 0:
        return []
    buckets = _buckets(view)
    scaled = 32 * view.hidden_size**2 if view.hidden_size else None
    big = [f"{k} {v:.3g}" for k, v in buckets if v > GUIDE_BUCKET_MAX]
    small = [f"{k} {v:.3g}" for k, v in buckets if v < GUIDE_BUCKET_MIN]
    findings = []
    if big:
        findings.append(
            Finding(
                "bucket-size",
                "warning",
                f"{', '.join(big)} above guide 2's 2e9: one huge collective blocks the stream instead of overlapping "
                "with compute" + (", and stage 3 preallocates the reduce bucket" if view.stage == 3 else ""),
                "set the bucket sizes between 5e8 and 2e9 (5e8 is the guide's steady start)",
            )
        )
    if small and scaled is not None and scaled >= GUIDE_BUCKET_MIN:
        findings.append(
            Finding(
                "bucket-size",
                "warning",
                f"{', '.join(small)} below guide 2's 5e8 for a model of hidden size {view.hidden_size}: many small "
                "collectives, each paying the network's latency (the presets use min(5e8, 32 x hidden^2) = 5e8 here)",
                f"set them to 5e8, or let the factory size them: zero-recipes config PRESET --hidden-size "
                f"{view.hidden_size}",
            )
        )
    elif small and scaled is None and view.source_kind in ("deepspeed", "accelerate"):
        findings.append(
            Finding(
                "bucket-size",
                "info",
                f"{', '.join(small)} below guide 2's 5e8: right for a small model (the presets use "
                "min(5e8, 32 x hidden^2)), too small for a 7B-class one; the hidden size is not known here",
                "pass --hidden-size (or --model-config) to check them against the model",
            )
        )
    return findings


def rule_stage3_bucket_preallocated(view: LintView) -> list[Finding]:
    """Stage 3 preallocates ``reduce_bucket_size`` elements per rank whatever the model's size (measured)."""
    if view.stage != 3 or not view.hidden_size or view.ds_config is None:
        return []
    value = _number(view.zero.get("reduce_bucket_size", DS_DEFAULT_BUCKET))
    scaled = 32 * view.hidden_size**2
    if value is None or scaled >= GUIDE_BUCKET_MIN or value < GUIDE_BUCKET_MIN:
        return []
    nbytes = value * (4 if view.precision == "fp32" else 2)
    return [
        Finding(
            "stage3-bucket-preallocated",
            "warning",
            f"stage 3 preallocates reduce_bucket_size = {value:.3g} elements per rank: {nbytes / 1e9:.2f} GB whatever "
            f"the model's size (measured: docs/design.md), for a model of hidden size {view.hidden_size}",
            f"scale it to the model: reduce_bucket_size = 32 x hidden^2 = {scaled} (what the presets do)",
        )
    ]


def _bucket_memory_limit(view: LintView) -> tuple[float, str] | None:
    """(bytes, what) one rank's preallocated bucket must fit in: the target device's, else this machine's."""
    if view.device_memory_bytes:
        return view.device_memory_bytes, "the device memory given (--gpu-memory)"
    return view.local_memory


def rule_stage3_bucket_exceeds_memory(view: LintView) -> list[Finding]:
    """Stage 3 preallocates ``reduce_bucket_size`` elements per rank at start: more bytes than the device (or, on
    a CPU, the host RAM) holds is an out-of-memory before the first step, whatever the model's size."""
    if view.stage != 3 or view.ds_config is None:
        return []
    value = _number(view.zero.get("reduce_bucket_size", DS_DEFAULT_BUCKET))
    limit = _bucket_memory_limit(view)
    if value is None or limit is None:
        return []
    nbytes = value * (4 if view.precision == "fp32" else 2)
    have, what = limit
    if nbytes <= have:
        return []
    return [
        Finding(
            "stage3-bucket-exceeds-memory",
            "error",
            f"stage 3 preallocates reduce_bucket_size = {value:.3g} elements per rank at start: {nbytes / 1e9:,.1f} GB "
            f"({view.precision}), more than the {have / 1e9:,.1f} GB one rank has ({what}): the run cannot start",
            "set reduce_bucket_size between 5e8 and 2e9 (guide 2, 6), or let the factory scale it to the model "
            "(32 x hidden^2: zero-recipes config PRESET --hidden-size H)",
        )
    ]


def rule_fp16_in_science(view: LintView) -> list[Finding]:
    """Guide 2 (7.3): scientific models need bf16 or fp32, never fp16."""
    recipe_precision = str(view.recipe("precision", ""))
    science = view.recipe("preset") == "science" or (view.path is not None and "recipes/science" in view.path)
    fp16 = recipe_precision in ("fp16", "16-mixed", "16") or (view.ds_config is not None and view.precision == "fp16")
    if science and fp16:
        return [
            Finding(
                "fp16-in-science",
                "error",
                "fp16 in the science preset: fp16's 5-bit exponent overflows and its 10-bit mantissa drops the small "
                "terms scientific models depend on (guide 2, 7.3)",
                "use precision: bf16 (fp16.enabled false, bf16.enabled true) or fp32",
            )
        ]
    return []


def rule_stage3_full_checkpointing(view: LintView) -> list[Finding]:
    """Guide 2 (6): stage 3 + ``full`` activation checkpointing recomputes (and re-gathers) twice."""
    if view.stage != 3 or view.recipe("activation_checkpointing") != "full":
        return []
    return [
        Finding(
            "stage3-full-checkpointing",
            "warning",
            "ZeRO stage 3 with 'full' activation checkpointing: guide 2 (6) warns it recomputes twice (each recomputed "
            "block re-gathers its parameters), costing throughput",
            "use activation_checkpointing: save_memory_optimized (skips the last block's wasted re-gather), or measure "
            "both: zero-recipes probe RECIPE --activation-checkpointing full,save_memory_optimized",
        )
    ]


def _offload_host_bytes(view: LintView) -> float | None:
    if not view.num_params:
        return None
    offload = "params" if view.offload_device("offload_param") == "cpu" else "optimizer"
    precision = view.precision if view.precision in ("bf16", "fp16", "fp32") else "bf16"
    _, host = guide_model_states(
        ModelFacts(num_params=view.num_params), view.stage, offload, view.world_size, precision
    )
    return host * view.ranks_per_node


def rule_offload_pin_memory(view: LintView) -> list[Finding]:
    """Offload with ``pin_memory``: page-locked host buffers cannot be swapped; check them against host RAM."""
    pinned = [
        s
        for s in ("offload_optimizer", "offload_param")
        if view.offload_device(s) == "cpu" and view.zero[s].get("pin_memory")
    ]
    if not pinned or view.host_ram_bytes is None or view.stage == 0:
        return []
    need = _offload_host_bytes(view)
    if need is None:
        return []
    have = view.host_ram_bytes
    if need <= 0.8 * have:
        return []
    return [
        Finding(
            "offload-pin-memory",
            "error" if need > have else "warning",
            f"{' and '.join(pinned)} pin about {need / 1e9:.1f} GB of host RAM per node "
            f"({view.ranks_per_node} rank(s) x offloaded states of {view.num_params:.3g} parameters), against "
            f"{have / 1e9:.1f} GB available: pinned memory cannot be swapped, so the host runs out first",
            "set pin_memory: false (slower host-device copies, but pageable), offload the optimizer only, or add "
            "nodes (the offloaded share per node falls with them)",
        )
    ]


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


def rule_torch_zero_leak(view: LintView) -> list[Finding]:
    """Guide 2 (6): PyTorch before 1.12 leaks memory under ZeRO."""
    version = view.versions.get("torch")
    if not version or view.stage == 0 or _version_tuple(version) >= (1, 12):
        return []
    return [
        Finding(
            "torch-zero-memory-leak",
            "error",
            f"PyTorch {version} is installed: versions before 1.12 have a ZeRO memory leak (guide 2, 6)",
            "upgrade: pip install 'torch>=2.4' (the guide's stable pairing is PyTorch 2.0 + DeepSpeed 0.9 or newer)",
        )
    ]


def rule_deepspeed_06_zero3(view: LintView) -> list[Finding]:
    """Guide 2 (6): DeepSpeed 0.6's ZeRO-3 has a parameter-synchronisation bug."""
    version = view.versions.get("deepspeed")
    if not version or view.stage != 3 or _version_tuple(version)[:2] != (0, 6):
        return []
    return [
        Finding(
            "deepspeed-0.6-zero3-sync",
            "error",
            f"DeepSpeed {version} is installed: 0.6's ZeRO-3 has a parameter synchronisation bug (guide 2, 6)",
            "upgrade: pip install 'deepspeed>=0.16' (the guide's stable pairing is DeepSpeed 0.9+ with PyTorch 2.0+)",
        )
    ]


def rule_nccl_version(view: LintView) -> list[Finding]:
    """Guide 2 (5.1): NCCL 2.10 or newer."""
    version = view.versions.get("nccl")
    if not version or _version_tuple(version) >= (2, 10):
        return []
    return [
        Finding(
            "nccl-version",
            "warning",
            f"NCCL {version}: guide 2 (5.1) asks for 2.10 or newer for ZeRO's reduce-scatter and all-gather",
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
        if installed and _version_tuple(installed) >= _version_tuple(removed.release):
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


def rule_stage3_needs_checkpointing(view: LintView) -> list[Finding]:
    """Guide 1 (5.1): stage 3 still out of memory -> activation checkpointing. Checked with the estimator, on the
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
            "model states, not activations (guide 1, 5.1)",
            f"activation_checkpointing: save_memory_optimized or full (activations about {full / 1e9:.2f} GB)",
        )
    ]


def rule_offload_order(view: LintView) -> list[Finding]:
    """Guide 1 (3.2-3.3, 5.1): offload optimizer states first, parameters after."""
    if view.offload_device("offload_param") == "none" or view.offload_device("offload_optimizer") != "none":
        return []
    return [
        Finding(
            "offload-order",
            "warning",
            "parameters are offloaded but optimizer states are not: the guide's order is optimizer states first "
            "(12 B/param, touched once per step), parameters last (fetched every layer over PCIe)",
            "offload_optimizer: {device: cpu} first; add offload_param only if that does not fit",
        )
    ]


def rule_offload_stage(view: LintView) -> list[Finding]:
    """Parameter offload needs stage 3; optimizer offload needs stage 1 or more."""
    findings = []
    if view.offload_device("offload_param") != "none" and view.stage != 3:
        findings.append(
            Finding(
                "offload-stage",
                "error",
                f"offload_param needs ZeRO stage 3 (stage is {view.stage}): DeepSpeed ignores or refuses it",
                "use offload_optimizer with stages 1-2, or stage: 3",
            )
        )
    if view.offload_device("offload_optimizer") != "none" and view.stage == 0:
        findings.append(
            Finding(
                "offload-stage",
                "error",
                "offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)",
                "set zero_optimization.stage to 2 (deepspeed_stage_2_offload)",
            )
        )
    return findings


def rule_nvme_path(view: LintView) -> list[Finding]:
    """NVMe offload needs a local NVMe folder."""
    findings = []
    for section in ("offload_optimizer", "offload_param"):
        if view.offload_device(section) == "nvme" and not view.zero[section].get("nvme_path"):
            findings.append(
                Finding(
                    "nvme-path",
                    "error",
                    f"{section}.device is nvme without nvme_path",
                    f"set zero_optimization.{section}.nvme_path to a local NVMe folder (nvme_path=... in a recipe)",
                )
            )
    return findings


def rule_fp16_loss_scaling(view: LintView) -> list[Finding]:
    """Guide 2 (3.2): NaN/Inf with fp16 -> dynamic loss scaling with loss_scale_window, or bf16."""
    if view.ds_config is None or not view.section_enabled("fp16"):
        return []
    fp16 = view.ds_config.get("fp16")
    scale = _number(fp16.get("loss_scale", 0)) if isinstance(fp16, dict) else 0
    if not scale:
        return []
    return [
        Finding(
            "fp16-loss-scaling",
            "warning",
            f"fp16 with a static loss scale ({scale:g}): gradients overflow to Inf/NaN or underflow to zero as their "
            "range drifts (guide 2, 3.2)",
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


def rule_optimizer_partition(view: LintView) -> list[Finding]:
    """Guide 1 (5.1): an optimizer without partition support breaks ZeRO; fall back to the Adam family."""
    names = []
    section = (view.ds_config or {}).get("optimizer")
    if isinstance(section, dict) and section.get("type"):
        names.append(str(section["type"]))
    if isinstance(view.recipe("optimizer"), str):
        names.append(view.recipe("optimizer"))
    bad = [n for n in names if n.lower().replace("_", "").replace("-", "") not in PARTITION_OPTIMIZERS]
    if not bad or view.stage == 0:
        return []
    return [
        Finding(
            "optimizer-partition",
            "warning",
            f"optimizer {bad[0]!r} under ZeRO stage {view.stage}: ZeRO partitions Adam-family optimizers (Adam, AdamW, "
            "Lamb, Adagrad and their DeepSpeed versions); others run untested or fail when their state is "
            "partitioned (guide 1, 5.1)",
            "use AdamW (common.strategy.make_optimizer), or set zero_allow_untested_optimizer and test the result",
        )
    ]


def rule_stage3_consolidate(view: LintView) -> list[Finding]:
    """Guide 1 (5.1): stage-3 checkpoints are sharded; consolidate before loading on one device.

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


def rule_zero_stage_missing(view: LintView) -> list[Finding]:
    """Guide 2 (3.2): out of memory because ZeRO is not in effect."""
    if view.source_kind != "deepspeed" or view.ds_config is None:
        return []
    if "stage" in view.zero:
        return []
    return [
        Finding(
            "zero-stage-missing",
            "warning",
            "no zero_optimization.stage: DeepSpeed defaults to stage 0, every rank holds all 16 B/param "
            "(guide 2, 3.2: 'ZeRO config not in effect')",
            "set zero_optimization.stage explicitly (2 is the guide's baseline)",
        )
    ]


def rule_offload_small_batch(view: LintView) -> list[Finding]:
    """Guide 1 (3.3, 5.1): offload throughput collapses at small batches; raise the batch."""
    if view.offload_device("offload_optimizer") == "none" and view.offload_device("offload_param") == "none":
        return []
    batch = view.recipe("micro_batch_size") or (view.ds_config or {}).get("train_micro_batch_size_per_gpu")
    if not isinstance(batch, int) or batch > 1:
        return []
    return [
        Finding(
            "offload-small-batch",
            "info",
            "offload with micro batch 1: each step pays the host-device copies for little compute",
            "raise micro_batch_size / grad_accum so compute hides the PCIe transfers (guide 1, 3.3)",
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


# --- NVMe offload (ZeRO-Infinity), ZeRO++ and the newer offload engines -------------------------------------


def rule_nvme_offload_stage_1_2(view: LintView) -> list[Finding]:
    """DeepSpeed 0.19's stage 1/2 optimizer treats ``offload_optimizer.device: nvme`` as CPU offload."""
    if view.offload_device("offload_optimizer") != "nvme" or view.stage not in (1, 2):
        return []
    return [
        Finding(
            "nvme-offload-stage-1-2",
            "warning",
            f"offload_optimizer.device is nvme under ZeRO stage {view.stage}: DeepSpeed 0.19's stage 1/2 optimizer "
            "treats it as cpu, so the optimizer states stay in host RAM and nothing is written to nvme_path "
            "(measured: tests/distributed/test_nvme_offload.py)",
            "use stage 3 to swap to disk (preset deepspeed_stage_3_offload_nvme), or device: cpu to say what runs",
        )
    ]


def _swap_threshold_bytes(view: LintView) -> int:
    aio = (view.ds_config or {}).get("aio")
    return swap_threshold_bytes(_number(aio.get("block_size")) if isinstance(aio, dict) else None)


def rule_nvme_small_partitions(view: LintView) -> list[Finding]:
    """DeepSpeed swaps a parameter partition only when it has at least max(1 MiB, aio.block_size) bytes."""
    if view.offload_device("offload_param") != "nvme" or view.model is None or not view.model.param_numels:
        return []
    bytes_per = WORKING_BYTES.get(view.precision, 2)
    threshold = _swap_threshold_bytes(view)
    ranks = max(1, view.world_size)
    swapped = sum(n for n in view.model.param_numels if -(-n // ranks) * bytes_per >= threshold)
    if swapped:
        return []
    return [
        Finding(
            "nvme-small-partitions",
            "warning",
            f"offload_param.device is nvme but no parameter's partition reaches {threshold / 2**20:g} MiB "
            f"({ranks} rank(s), {view.precision}): DeepSpeed swaps only partitions of at least max(1 MiB, "
            "aio.block_size), so every parameter silently stays in host RAM",
            "offload to cpu instead (deepspeed_stage_3_offload), or lower aio.block_size to 1 MiB; NVMe pays off "
            "for models whose matrices are large",
        )
    ]


def rule_nvme_small_sub_groups(view: LintView) -> list[Finding]:
    """DeepSpeed swaps the optimizer's states one sub-group at a time, and only a sub-group whose fp32 states
    reach max(1 MiB, aio.block_size): ``sub_group_size`` below that keeps every state in host RAM, silently."""
    if view.offload_device("offload_optimizer") != "nvme" or view.stage != 3:
        return []
    sub_group = _number(view.zero.get("sub_group_size", 1_000_000_000))
    threshold = _swap_threshold_bytes(view)
    if sub_group is None or sub_group * 4 >= threshold:
        return []
    return [
        Finding(
            "nvme-small-sub-groups",
            "warning",
            f"offload_optimizer.device is nvme but sub_group_size {int(sub_group):,} holds "
            f"{sub_group * 4 / 2**20:.2f} MiB of fp32 states, under DeepSpeed's swap minimum of "
            f"{threshold / 2**20:g} MiB: the optimizer states silently stay in host RAM",
            f"set zero_optimization.sub_group_size >= {-(-threshold // 4):,} (the factory does for its presets)",
        )
    ]


def rule_nvme_param_buffer(view: LintView) -> list[Finding]:
    """``offload_param.buffer_size`` must hold the largest parameter partition (DeepSpeed asserts otherwise)."""
    if view.offload_device("offload_param") != "nvme" or view.model is None or not view.model.param_numels:
        return []
    buffer = _number(view.zero["offload_param"].get("buffer_size", 100_000_000))
    largest = -(-max(view.model.param_numels) // max(1, view.world_size))
    if buffer is None or largest <= buffer:
        return []
    return [
        Finding(
            "nvme-param-buffer",
            "error",
            f"offload_param.buffer_size {buffer:.3g} elements is smaller than the largest parameter partition "
            f"({largest:,} elements on {view.world_size} rank(s)): DeepSpeed stops with 'More elements ... than "
            "buffer size' when it swaps that parameter in",
            f"set zero_optimization.offload_param.buffer_size to at least {largest}",
        )
    ]


def rule_aio_keys(view: LintView) -> list[Finding]:
    """The ``aio`` section: DeepSpeed 0.19 reads six keys and ignores any other without a word."""
    aio = (view.ds_config or {}).get("aio")
    if not isinstance(aio, dict):
        return []
    unknown = [k for k in aio if k not in AIO_KEYS]
    if not unknown:
        return []
    renamed = [f"{k} (now {AIO_OLD_NAMES[k]})" for k in unknown if k in AIO_OLD_NAMES]
    return [
        Finding(
            "aio-keys",
            "warning",
            f"aio keys DeepSpeed 0.19 does not read: {', '.join(unknown)}"
            + (f"; renamed: {', '.join(renamed)}" if renamed else "")
            + ": the settings are silently ignored",
            f"use {', '.join(AIO_KEYS)}; measure the disk with bench/nvme_io.py to choose values",
        )
    ]


def rule_zeropp_quantized_needs_gpu(view: LintView) -> list[Finding]:
    """ZeRO++'s qwZ and qgZ run DeepSpeed's CUDA quantizer kernels."""
    quantized = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if view.zero.get(k) is True]
    if not quantized or view.accelerator == "cuda":
        return []
    on_cpu = view.accelerator == "cpu"
    return [
        Finding(
            "zeropp-quantized-needs-gpu",
            "error" if on_cpu else "info",
            f"{' and '.join(quantized)} need DeepSpeed's CUDA quantizer kernels"
            + (": this run has no GPU, and" if on_cpu else ";")
            + " on a CPU the first quantized collective fails ('This op had not been implemented on CPU backend')",
            "on a CPU set them false (hpZ, zero_hpz_partition_size, runs on a CPU: "
            "--set zero_optimization.zero_quantized_weights=false --set zero_optimization.zero_quantized_gradients="
            "false); on GPUs keep them",
        )
    ]


def rule_hpz_partition(view: LintView) -> list[Finding]:
    """ZeRO++'s hpZ: a secondary weight partition over groups of ``zero_hpz_partition_size`` ranks (a node)."""
    hpz = _number(view.zero.get("zero_hpz_partition_size", 1))
    if hpz is None or hpz <= 1:
        return []
    if view.stage != 3:
        return [
            Finding(
                "hpz-partition",
                "warning",
                f"zero_hpz_partition_size {hpz:g} under ZeRO stage {view.stage}: hpZ partitions stage 3's weights, "
                "other stages ignore it",
                "use stage 3 (preset deepspeed_stage_3_zeropp) or drop the key",
            )
        ]
    world = max(1, view.world_size)
    if world % hpz:
        return [
            Finding(
                "hpz-partition",
                "error",
                f"zero_hpz_partition_size {hpz:g} does not divide the {world} ranks: DeepSpeed cannot form the groups",
                "set it to the devices per node (the factory does: RunFacts(devices_per_node=...))",
            )
        ]
    if hpz >= world:
        return [
            Finding(
                "hpz-partition",
                "warning",
                f"zero_hpz_partition_size {hpz:g} with {world} ranks: the secondary partition spans every rank, so it "
                "duplicates the primary one (16-bit weights / N more memory) and keeps no traffic off the network",
                "on one node leave hpZ off (1); on several, set it to the devices per node",
            )
        ]
    return []


def rule_zenflow(view: LintView) -> list[Finding]:
    """ZenFlow (DeepSpeed 0.18+): stall-free ZeRO-Offload; DeepSpeed refuses its combinations late, at initialize."""
    zenflow = view.zero.get("zenflow")
    if not isinstance(zenflow, dict):
        return []
    problems = []
    if view.offload_device("offload_optimizer") != "cpu":
        problems.append(
            "it extends ZeRO-Offload: offload_optimizer.device must be cpu ('Zenflow must be used with cpu offload')"
        )
    strategy, select = zenflow.get("select_strategy", "auto"), zenflow.get("select_interval", "auto")
    if strategy == "auto" and isinstance(select, int):
        problems.append("select_strategy auto overwrites select_interval (DeepSpeed raises instead of warning)")
    if strategy != "auto" and isinstance(select, str):
        problems.append(f"select_strategy {strategy!r} needs a number for select_interval")
    update = zenflow.get("update_interval", "auto")
    if isinstance(select, int) and isinstance(update, int) and select < update:
        problems.append(f"select_interval {select} is below update_interval {update}")
    if zenflow.get("offload") and not view.zero.get("overlap_comm"):
        problems.append("zenflow.offload needs overlap_comm true")
    if not isinstance((view.ds_config or {}).get("optimizer"), dict):
        # ZenFlowZeroOptimizer builds its selective AdamW with **optimizer_params, the config's optimizer.params.
        problems.append(
            "DeepSpeed builds ZenFlow's optimizers from the config's optimizer section, and there is none: with a "
            "client optimizer (what the recipes pass) initialize fails ('argument after ** must be a mapping, not "
            "NoneType')"
        )
    if not problems:
        return [
            Finding(
                "zenflow",
                "info",
                "ZenFlow updates the top-k gradient columns on the device each step and the rest on the CPU every "
                "update_interval steps, so the GPU does not wait for CPU Adam (DeepSpeed's ZenFlow tutorial)",
                "compare step time and loss with and without it (bench/gpu.sh on a GPU)",
            )
        ]
    return [
        Finding(
            "zenflow",
            "error",
            "zero_optimization.zenflow: " + "; ".join(problems),
            "use offload_optimizer: {device: cpu} with select_strategy auto (see DeepSpeed's ZenFlow tutorial)",
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


# --- tensor, pipeline and expert parallelism ------------------------------------------------------------------
# Not checked: DeepSpeed's native MoE under ZeRO-3. DeepSpeed refuses it ("Native DeepSpeed MoE is not supported with
# ZeRO Stage 3. Use AutoEP or choose ZeRO stage 1/2.", runtime/engine.py _validate_zero3_moe_compatibility), but it
# finds native MoE by the model's modules (isinstance deepspeed.moe.layer.MoE), which no config says.


def _tensor_parallel_size(view: LintView) -> float | None:
    """``tensor_parallel.autotp_size`` (AutoTP), else guide 2's ``tensor.size``; None when neither is set."""
    ds = view.ds_config or {}
    for section, key in (("tensor_parallel", "autotp_size"), ("tensor", "size")):
        value = ds.get(section)
        if isinstance(value, dict) and _number(value.get(key)) is not None:
            return _number(value.get(key))
    return None


def rule_pipeline_zero_stage(view: LintView) -> list[Finding]:
    """DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only.

    ``deepspeed.initialize`` builds ``PipelineEngine`` for any ``deepspeed.pipe.PipelineModule`` (its ``num_stages``
    sets the stages), and that engine is the only reader of a config's ``pipeline`` section (``runtime/config.py``,
    ``get_pipeline_config``): a dict with the section is written for it.
    """
    pipeline = (view.ds_config or {}).get("pipeline")
    if not isinstance(pipeline, dict) or view.stage < 2:
        return []
    stages = _number(pipeline.get("stages"))
    tp = _tensor_parallel_size(view)
    layout = (f"{stages:g} pipeline stages" if stages else "a pipeline section") + (
        f" and tensor parallelism {tp:g}" if tp and tp > 1 else ""
    )
    # DeepSpeed 0.19.8, runtime/pipe/engine.py, PipelineEngine.__init__:
    #     assert self.zero_optimization_stage() < ZeroStageEnum.gradients, \
    #         "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
    return [
        Finding(
            "pipeline-zero-stage",
            "error",
            f"ZeRO stage {view.stage} with {layout}: DeepSpeed's pipeline engine stops at initialize with 'ZeRO-2 and "
            "ZeRO-3 are incompatible with pipeline parallelism' (guide 2's ZeRO-3 + pipeline 4 + tensor 8 cannot run)",
            "keep the pipeline with ZeRO-1 (zero_optimization.stage 1: optimizer states sharded over each stage's "
            "data-parallel ranks; tensor parallelism inside a PipelineModule comes from its topology, "
            "PipeModelDataParallelTopology), or drop the pipeline and use ZeRO-3 with tensor parallelism "
            f"(tensor_parallel.autotp_size {f'{tp:g}' if tp and tp > 1 else 'N'}); compare both with zero-recipes "
            "estimate --tensor-parallel/--pipeline-parallel",
        )
    ]


def rule_parallel_keys_ignored(view: LintView) -> list[Finding]:
    """Parallelism keys DeepSpeed does not read: guide 2's ``tensor`` section and ``pipeline.stages``."""
    ds = view.ds_config or {}
    unread = []
    tensor = ds.get("tensor")
    if tensor is not None:
        size = tensor.get("size") if isinstance(tensor, dict) else None
        said = f"tensor.size {size}" if size is not None else "a 'tensor' section"
        unread.append(f"{said} (guide 2's key; AutoTP reads tensor_parallel.autotp_size)")
    pipeline = ds.get("pipeline")
    if isinstance(pipeline, dict) and pipeline.get("stages", "auto") != "auto":
        # runtime/config.py keeps "stages" in its defaults, but nothing in DeepSpeed 0.19.8 reads it.
        unread.append("pipeline.stages (the stage count is PipelineModule(num_stages=...) in the training script)")
    if not unread:
        return []
    return [
        Finding(
            "parallel-keys-ignored",
            "warning",
            "DeepSpeed does not read " + " or ".join(unread) + ": the setting is silently ignored",
            "set tensor parallelism as tensor_parallel: {autotp_size: N} and pipeline stages in the PipelineModule; "
            "drop the unread keys",
        )
    ]


def _world_known(view: LintView) -> bool:
    """Whether ``view.world_size`` is a fact: a bare DeepSpeed JSON tells it only through its three batch sizes."""
    if view.source_kind != "deepspeed":
        return True
    ds = view.ds_config or {}
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    return all(isinstance(ds.get(k), int) and not isinstance(ds.get(k), bool) and ds.get(k) > 0 for k in keys)


def rule_autotp_size(view: LintView) -> list[Finding]:
    """``tensor_parallel.autotp_size`` must divide the ranks.

    DeepSpeed 0.19.8 (utils/groups.py, ``_init_tp_mesh_device``) takes ``data_parallel_size = world //
    autotp_size`` and builds a (data parallel, tensor parallel) mesh of that shape: the remainder gets no group.
    """
    section = (view.ds_config or {}).get("tensor_parallel")
    size = _number(section.get("autotp_size")) if isinstance(section, dict) else None
    world = max(1, view.world_size)
    if size is None or size <= 1 or not _world_known(view) or world % size == 0:
        return []
    return [
        Finding(
            "autotp-size",
            "error",
            f"tensor_parallel.autotp_size {size:g} does not divide the {world} ranks: DeepSpeed builds a "
            f"{world // int(size)} x {size:g} (data x tensor parallel) device mesh, which leaves "
            f"{world % int(size)} rank(s) without a tensor-parallel group",
            f"set autotp_size to a divisor of {world} (at most the devices of a node, where tensor parallelism's "
            "all-reduces are fast), or change the number of ranks",
        )
    ]


RULES: dict[str, Rule] = {
    "lightning-16-mixed": rule_lightning_16_mixed,
    "grad-accum-in-lightning-dict": rule_grad_accum_in_lightning_dict,
    "auto-values": rule_auto_values,
    "round-robin-without-offload": rule_round_robin_without_offload,
    "persistence-threshold": rule_persistence_threshold,
    "bucket-size": rule_bucket_size,
    "stage3-bucket-preallocated": rule_stage3_bucket_preallocated,
    "stage3-bucket-exceeds-memory": rule_stage3_bucket_exceeds_memory,
    "fp16-in-science": rule_fp16_in_science,
    "stage3-full-checkpointing": rule_stage3_full_checkpointing,
    "stage3-needs-checkpointing": rule_stage3_needs_checkpointing,
    "offload-pin-memory": rule_offload_pin_memory,
    "offload-order": rule_offload_order,
    "offload-stage": rule_offload_stage,
    "offload-small-batch": rule_offload_small_batch,
    "nvme-path": rule_nvme_path,
    "flash-attention-fp32": rule_flash_attention_fp32,
    "fp16-loss-scaling": rule_fp16_loss_scaling,
    "fp16-and-bf16": rule_fp16_and_bf16,
    "optimizer-partition": rule_optimizer_partition,
    "stage3-consolidate": rule_stage3_consolidate,
    "zero-stage-missing": rule_zero_stage_missing,
    "accelerate-precision-mismatch": rule_accelerate_precision,
    "torch-zero-memory-leak": rule_torch_zero_leak,
    "deepspeed-0.6-zero3-sync": rule_deepspeed_06_zero3,
    "nccl-version": rule_nccl_version,
    "deepspeed-removed-keys": rule_deepspeed_removed_keys,
    "nvme-offload-stage-1-2": rule_nvme_offload_stage_1_2,
    "nvme-small-partitions": rule_nvme_small_partitions,
    "nvme-param-buffer": rule_nvme_param_buffer,
    "aio-keys": rule_aio_keys,
    "zeropp-quantized-needs-gpu": rule_zeropp_quantized_needs_gpu,
    "hpz-partition": rule_hpz_partition,
    "nvme-small-sub-groups": rule_nvme_small_sub_groups,
    "zenflow": rule_zenflow,
    "bf16-optimizer-states": rule_bf16_optimizer_states,
    "pipeline-zero-stage": rule_pipeline_zero_stage,
    "parallel-keys-ignored": rule_parallel_keys_ignored,
    "autotp-size": rule_autotp_size,
}

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def run_rules(view: LintView, rules: dict[str, Rule] | None = None) -> list[Finding]:
    """Every rule on ``view``, findings sorted errors first."""
    findings: list[Finding] = []
    for rule in (rules or RULES).values():
        findings += rule(view)
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


def has_errors(findings: list[Finding]) -> bool:
    """Whether any finding is an error (``zero-recipes lint`` then exits 1)."""
    return any(f.severity == "error" for f in findings)


def actionable(findings: list[Finding]) -> list[Finding]:
    """Errors and warnings: what "no finding on a shipped preset" counts (info is documentation)."""
    return [f for f in findings if f.severity != "info"]


def installed_versions() -> dict[str, str]:
    """Installed PyTorch and DeepSpeed versions (package metadata, no import), and NCCL's on a GPU."""
    from importlib import metadata

    versions = {}
    for package in ("torch", "deepspeed"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    try:
        import torch

        if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
            versions["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # no torch or no NCCL: nothing to check
        pass
    return versions


def _available_host_ram() -> float | None:
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except Exception:
        return None


def _local_memory(ranks_per_node: int) -> tuple[float, str] | None:
    """What one rank has on this machine (:func:`common.memory_formulas.local_device_memory`); None when unknown."""
    try:
        return local_device_memory(ranks_per_node)
    except Exception:  # no psutil, or a GPU that cannot be queried: the check is skipped
        return None


def _local_accelerator() -> str:
    """``cuda`` when this machine has a GPU PyTorch can use, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _world_from_ds(ds_config: dict[str, Any]) -> int:
    total, micro, accum = (
        ds_config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    )
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (total, micro, accum)):
        return max(1, total // (micro * accum))
    return 1


def lint_run(
    ds_config: dict[str, Any] | None,
    recipe_config: dict[str, Any] | None = None,
    *,
    backend: str | None = None,
    num_params: int | None = None,
    hidden_size: int | None = None,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    versions: dict[str, str] | None = None,
    accelerator: str | None = None,
) -> list[Finding]:
    """Lint a run as a recipe is about to start it: its resolved DeepSpeed dict and its config as a dict.

    Args:
        ds_config: the factory's resolved dict (``resolve_ds_config(cfg, world_size)``).
        recipe_config: ``common.config.config_to_dict(cfg)``.
        backend: ``lightning`` or ``accelerate`` (the resolved dict is the full one either way: the Lightning
            adapter removes what Lightning refuses, so ``grad-accum-in-lightning-dict`` does not fire here).
        num_params: the model's parameter count (checks pinned offload memory against host RAM).
        hidden_size: the model's hidden size (persistence threshold and bucket checks).
        world_size: data-parallel ranks (default: from the batch sizes in ``ds_config``).
        ranks_per_node: processes per node (default: ``world_size``).
        versions: installed versions (default: :func:`installed_versions`).
        accelerator: ``cuda`` or ``cpu`` (default: what this machine has: the run is here).

    Returns:
        Findings, errors first. Print them with :func:`print_findings`.
    """
    world = world_size or (_world_from_ds(ds_config) if ds_config else 1)
    view = LintView(
        ds_config=ds_config,
        recipe_config=recipe_config,
        source_kind="run",
        versions=installed_versions() if versions is None else versions,
        backend=backend,
        hidden_size=hidden_size,
        num_params=num_params,
        world_size=world,
        ranks_per_node=ranks_per_node or world,
        host_ram_bytes=_available_host_ram(),
        local_memory=_local_memory(ranks_per_node or world),
        accelerator=accelerator or _local_accelerator(),
    )
    return run_rules(view)


def format_finding(finding: Finding) -> str:
    """``error [rule-id] message`` and an indented ``fix:`` line."""
    return f"{finding.severity:<7} [{finding.rule_id}] {finding.message}\n        fix: {finding.fix}"


def print_findings(findings: list[Finding], file: TextIO | None = None, prefix: str = "lint: ") -> None:
    """Print findings (or one line saying there are none) for a person reading the run's log."""
    out = file or sys.stderr
    if not findings:
        print(f"{prefix}no findings", file=out, flush=True)
        return
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    summary = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n)
    print(f"{prefix}{summary}", file=out)
    for finding in findings:
        print(format_finding(finding), file=out)
    out.flush()


def lint_at_start(
    ds_config: dict[str, Any],
    recipe_config: dict[str, Any],
    hidden_size: int | None = None,
    world_size: int | None = None,
) -> list[Finding]:
    """What every recipe calls when it has resolved its DeepSpeed dict: lint, print, refuse on errors.

    Findings are printed by the launcher's rank 0 only (every rank lints, so every rank refuses alike).

    Raises:
        ConfigError: when a rule reports an error.
    """
    from common.rundir import is_launcher_rank_zero

    findings = lint_run(ds_config, recipe_config, hidden_size=hidden_size, world_size=world_size)
    if is_launcher_rank_zero():
        print_findings(findings)
    if has_errors(findings):
        first = next(f for f in findings if f.severity == "error")
        raise ConfigError(f"config linter: [{first.rule_id}] {first.message} (fix: {first.fix})")
    return findings
