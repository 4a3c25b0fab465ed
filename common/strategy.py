"""The strategy factory: (preset, run facts, overrides) -> one resolved DeepSpeed dict -> both backends.

One preset must give the same numbers to Lightning and to Accelerate. Two things stop a single
DeepSpeed JSON from doing that upstream: ``"auto"`` values are only filled by the Hugging Face
Trainer, and Lightning refuses ``gradient_accumulation_steps`` inside the DeepSpeed dict. So the
factory resolves every value from the run (world size, micro batch, accumulation, precision, hidden
size) into a dict with no ``"auto"`` left, and the thin adapters below hand that same dict to each
backend, moving only what a backend insists on owning (Lightning's accumulation and clipping become
``Trainer`` arguments with the same values).

Example::

    facts = RunFacts(world_size=8, micro_batch_size=4, grad_accum=2, precision="bf16", hidden_size=4096)
    ds_config = resolve_deepspeed_config("nlp", facts)
    trainer = Trainer(accelerator="auto", devices=8, **lightning_trainer_kwargs(ds_config))
    plugin = accelerate_plugin(ds_config)        # Accelerator(deepspeed_plugin=plugin, ...)

An FSDP2 preset (``fsdp2``, ``fsdp2_grad_op``: :data:`common.presets.FSDP2_PRESETS`) goes through the same calls:
:func:`resolve_deepspeed_config` gives its run config (:func:`resolve_fsdp2_config`, the same batch,
clipping and precision keys with an ``fsdp2`` section instead of ``zero_optimization``), and
:func:`lightning_trainer_kwargs`, :func:`accelerator_kwargs` and :func:`shard_model` hand each front-end what FSDP2
needs. This module is the one place that tells the two apart; :mod:`common.fsdp2` (which imports torch) is
imported only when a run is FSDP2's.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from common.errors import ConfigError, nearest
from common.memory_formulas import MIN_SWAPPED_BYTES, swap_threshold_bytes
from common.metrics import barrier
from common.nvme_storage import check_nvme_storage, nvme_sections
from common.presets import (
    FROM_LAYOUT,
    FROM_MODEL,
    get_fsdp2_preset,
    get_preset,
    is_fsdp2_name,
    refuse_deepspeed_overrides,
    refuse_zero_only_features,
)
from common.process_setup import setup_process

PRECISIONS = ("bf16", "fp16", "fp32")

# DeepSpeed's default bucket, a common starting point (5e8 is a steady start; the usual range is 5e8 .. 2e9).
GUIDE_BUCKET_ELEMENTS = 500_000_000

# Top-level DeepSpeed keys an override may touch (DeepSpeed's own config sections).
DEEPSPEED_TOP_LEVEL_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16",
    "fp16",
    "zero_optimization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "steps_per_print",
    "wall_clock_breakdown",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "data_types",
    "activation_checkpointing",
    "checkpoint",
    "aio",
    "flops_profiler",
    "memory_breakdown",
    "dump_state",
    "comms_logger",  # "enabled": summary.json gets the bytes per collective per step (common.comms_log)
)

# DeepSpeed 0.19's ``aio`` keys (deepspeed/runtime/swap_tensor/constants.py); anything else is silently ignored there.
AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds")
# Names older docs (and Lightning's DeepSpeedStrategy arguments) use for the same settings.
AIO_OLD_NAMES = {"thread_count": "intra_op_parallelism"}
# DeepSpeed's default offload_param.buffer_size (elements): the cap of the model-scaled value.
DS_PARAM_BUFFER_ELEMENTS = 100_000_000

# Keys the factory derives from run facts; overriding them would break "same numbers on both backends".
RUN_FACT_KEYS = {
    "train_batch_size": "world_size x micro_batch_size x grad_accum",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum",
}

# Keys where "auto" is DeepSpeed's own setting, not the Hugging Face placeholder the factory resolves: ZenFlow picks
# its important-gradient strategy and intervals itself (deepspeed.runtime.zenflow.zenflow_config.ZenFlowConfig).
DEEPSPEED_AUTO_KEYS = frozenset(
    f"zero_optimization.zenflow.{key}" for key in ("select_strategy", "select_interval", "update_interval")
)


@dataclass(frozen=True)
class RunFacts:
    """What the factory needs to know about the run to leave no value on ``"auto"``.

    Attributes:
        world_size: data-parallel ranks in total (nodes x processes per node).
        micro_batch_size: samples per rank per forward pass.
        grad_accum: micro-batches accumulated per optimizer step.
        precision: ``bf16``, ``fp16`` or ``fp32``; None takes the preset's (bf16 unless it says otherwise).
        hidden_size: the model's hidden size, to scale bucket sizes and the stage-3 persistence threshold.
        gradient_clipping: max gradient norm (0 disables clipping).
        nvme_path: local NVMe folder for the ``*_offload_nvme`` presets.
        devices_per_node: ranks on one node (None: all ranks on one node); ZeRO++'s hpZ shards a second weight
            copy within a node, so ``zero_hpz_partition_size`` comes from it.
        num_params: the model's parameter count, to check that the NVMe folder has room for the swapped states
            (None: only a full disk is refused).
        check_storage: check on this machine that the NVMe folder exists, is writable and has room, and that
            DeepSpeed's async I/O op can be built; False resolves a config for another machine (golden files).
    """

    world_size: int = 1
    micro_batch_size: int = 1
    grad_accum: int = 1
    precision: str | None = None
    hidden_size: int | None = None
    gradient_clipping: float = 1.0
    nvme_path: str | None = None
    devices_per_node: int | None = None
    num_params: int | None = None
    check_storage: bool = True

    def __post_init__(self) -> None:
        for name in ("world_size", "micro_batch_size", "grad_accum", "devices_per_node", "num_params"):
            value = getattr(self, name)
            if value is None and name in ("devices_per_node", "num_params"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.devices_per_node is not None and self.world_size % self.devices_per_node:
            raise ConfigError(
                f"world_size {self.world_size} is not a whole number of nodes of {self.devices_per_node} devices"
            )
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
                f"{nearest(str(self.precision), PRECISIONS)}"
            )
        if self.hidden_size is not None and (
            isinstance(self.hidden_size, bool) or not isinstance(self.hidden_size, int) or self.hidden_size < 1
        ):
            raise ConfigError(f"hidden_size must be a positive integer, got {self.hidden_size!r}")
        if not isinstance(self.gradient_clipping, int | float) or self.gradient_clipping < 0:
            raise ConfigError(f"gradient_clipping must be a number >= 0, got {self.gradient_clipping!r}")

    @classmethod
    def from_fields(cls, cfg: Any, world_size: int, hidden_size: int | None) -> RunFacts:
        """The facts of a run, read from the fields of the same names of a recipe's config or the CLI's arguments.

        Args:
            cfg: a recipe's config dataclass or ``zero-recipes config``'s arguments (``micro_batch_size``,
                ``grad_accum``, ``precision``, ``gradient_clipping``, ``nvme_path``; an empty ``nvme_path`` is none).
            world_size: ranks in the run.
            hidden_size: the model's width; None when it has none.

        Returns:
            The facts :func:`resolve_deepspeed_config` fills the preset from.
        """
        return cls(
            world_size=world_size,
            micro_batch_size=cfg.micro_batch_size,
            grad_accum=cfg.grad_accum,
            precision=cfg.precision,
            hidden_size=hidden_size,
            gradient_clipping=cfg.gradient_clipping,
            nvme_path=cfg.nvme_path or None,
        )


def resolve_fsdp2_config(
    preset: str, facts: RunFacts | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The resolved run config of an FSDP2 preset: what the factory's adapters read, shaped like a DeepSpeed dict.

    The batch, accumulation, clipping and precision keys have DeepSpeed's names and the values the ZeRO presets get
    from the same run, so every reader of a resolved config (``precision_of``, the run files, the lint's batch
    arithmetic) reads an FSDP2 run alike; the ``fsdp2`` section holds the sharding. No ``zero_optimization``:
    DeepSpeed never sees this dict.

    Args:
        preset: an FSDP2 preset name (:data:`common.presets.FSDP2_PRESETS`).
        facts: the run's world size, batch, accumulation, precision and clipping (the hidden size is not used:
            FSDP2 has no buckets to scale).
        overrides: DeepSpeed keys: refused (:func:`common.presets.refuse_deepspeed_overrides`).

    Raises:
        ConfigError: an unknown preset, fp16 (:func:`common.fsdp2.mixed_precision_policy`), an NVMe folder, an
            override.
    """
    facts = facts or RunFacts()
    spec = get_fsdp2_preset(preset)
    refuse_deepspeed_overrides(preset, overrides or {})
    refuse_zero_only_features(preset, {"nvme_path": facts.nvme_path})
    precision = facts.precision or "bf16"
    from common.fsdp2 import mixed_precision_policy  # imports torch: only for an FSDP2 run

    mixed_precision_policy(precision)  # fp16: refused here, before any work
    return {
        "train_batch_size": facts.world_size * facts.micro_batch_size * facts.grad_accum,
        "train_micro_batch_size_per_gpu": facts.micro_batch_size,
        "gradient_accumulation_steps": facts.grad_accum,
        "gradient_clipping": float(facts.gradient_clipping),
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": False},
        "fsdp2": {
            "preset": preset,
            "counterpart": spec["counterpart"],
            "reshard_after_forward": spec["reshard_after_forward"],
            "sync_each_micro_batch": spec["sync_each_micro_batch"],
            "world_size": facts.world_size,
        },
    }


def bucket_elements(hidden_size: int | None) -> int:
    """Communication bucket size in elements, scaled to the model.

    DeepSpeed's default (and the usual starting point) is 5e8 elements. Under stage 3 the reduce
    bucket is preallocated: 5e8 bf16 elements cost 1 GB per rank whatever the model's size (measured
    here: docs/design.md), so small models get smaller buckets. 32 x hidden^2 reaches the default 5e8 at
    hidden ~4000 (7B class) and gives ~2e6 for a 256-wide model.
    """
    if hidden_size is None:
        return GUIDE_BUCKET_ELEMENTS
    return int(min(GUIDE_BUCKET_ELEMENTS, 32 * hidden_size * hidden_size))


def persistence_threshold(hidden_size: int | None) -> int:
    """Stage-3 parameters smaller than this stay whole on every rank (no all-gather for them).

    10 x hidden follows the Hugging Face Trainer's ``"auto"`` rule: biases and norms stay resident,
    matrices are sharded.
    """
    return 10 * hidden_size if hidden_size else 100_000


def _precision_sections(precision: str) -> dict[str, Any]:
    fp16: dict[str, Any] = {"enabled": precision == "fp16"}
    if precision == "fp16":
        # Dynamic loss scaling; a loss_scale_window is the usual first fix for NaN/Inf under fp16.
        fp16.update(loss_scale=0, loss_scale_window=1000, initial_scale_power=16, hysteresis=2, min_loss_scale=1)
    return {"bf16": {"enabled": precision == "bf16"}, "fp16": fp16}


def _zero_config_class() -> Any:
    """DeepSpeed's pydantic ZeRO config class, imported with its start-up log sent to stderr.

    DeepSpeed logs "Setting accelerator to CPU" to stdout when first imported; ``zero-recipes config``
    prints JSON on stdout, which must stay parseable.
    """
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return DeepSpeedZeroConfig


def _set_dotted(config: dict[str, Any], dotted_key: str, value: Any) -> None:
    """Set ``config["a"]["b"] = value`` for ``"a.b"``; unknown keys name the nearest valid one."""
    DeepSpeedZeroConfig = _zero_config_class()  # noqa: N806

    parts = dotted_key.split(".")
    top = parts[0]
    if top == "stage":  # the one shortcut users reach for
        parts, top = ["zero_optimization", "stage"], "zero_optimization"
    if top not in DEEPSPEED_TOP_LEVEL_KEYS:
        raise ConfigError(f"unknown DeepSpeed key {dotted_key!r}{nearest(top, DEEPSPEED_TOP_LEVEL_KEYS)}")
    if top in RUN_FACT_KEYS:
        raise ConfigError(f"{top} is derived from the run ({RUN_FACT_KEYS[top]}); set those instead")
    if top == "zero_optimization" and len(parts) > 1:
        valid = set()
        for name, field in DeepSpeedZeroConfig.model_fields.items():
            valid.add(field.alias or name)
        if parts[1] not in valid:
            raise ConfigError(f"unknown zero_optimization key {parts[1]!r}{nearest(parts[1], sorted(valid))}")
    node = config
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {} if child is None else {"enabled": child}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _fill_from_model(zero: dict[str, Any], hidden_size: int | None, swap_min_bytes: int = MIN_SWAPPED_BYTES) -> None:
    bucket = bucket_elements(hidden_size)
    derived = {
        "stage3_param_persistence_threshold": persistence_threshold(hidden_size),
        # The HF Trainer prefetches 0.9 x its bucket: slightly under one bucket keeps one gather in flight.
        "stage3_prefetch_bucket_size": int(0.9 * bucket),
    }
    for key, value in derived.items():
        if zero.get(key) == FROM_MODEL:
            zero[key] = value
    if zero.get("sub_group_size") == FROM_MODEL:
        # One bucket's worth: the optimizer swaps sub-groups in and out whole (NVMe), so this bounds its buffers.
        # But never under DeepSpeed's swap minimum (max(1 MiB, aio.block_size) of fp32 states): a smaller
        # sub-group is silently kept in host RAM, and a small model's optimizer states never reached the disk
        # (the science recipe's 64-wide FNO, tests/recipes/test_nvme_recipes.py).
        swapped = (zero.get("offload_optimizer") or {}).get("device") == "nvme"
        zero["sub_group_size"] = max(bucket, -(-swap_min_bytes // 4)) if swapped else bucket
    offload_param = zero.get("offload_param")
    if isinstance(offload_param, dict) and offload_param.get("buffer_size") == FROM_MODEL:
        # A buffer holds one parameter partition: the bucket covers a transformer's matrices (32 h^2), capped
        # at DeepSpeed's default (1e8 elements) so that buffer_count buffers stay a few GB of host RAM.
        offload_param["buffer_size"] = min(DS_PARAM_BUFFER_ELEMENTS, bucket)
    if zero.get("stage", 0) in (1, 2):
        zero.setdefault("reduce_bucket_size", bucket)
        zero.setdefault("allgather_bucket_size", bucket)
    elif zero.get("stage", 0) == 3:
        zero.setdefault("reduce_bucket_size", bucket)


def hpz_partition_size(facts: RunFacts) -> int:
    """ZeRO++ hpZ's secondary partition: the devices of one node, or 1 (off) when every rank is on one node.

    hpZ keeps a second copy of the 16-bit weights sharded across a node's devices so that the backward pass
    gathers them over the node's fast links instead of the network (ZeRO++ tutorial). On one node the primary
    partition is already node-local: a secondary copy would only cost memory.
    """
    per_node = facts.devices_per_node or facts.world_size
    return per_node if per_node < facts.world_size else 1


def _fill_from_layout(zero: dict[str, Any], facts: RunFacts) -> None:
    if zero.get("zero_hpz_partition_size") == FROM_LAYOUT:
        zero["zero_hpz_partition_size"] = hpz_partition_size(facts)
    hpz = zero.get("zero_hpz_partition_size", 1)
    if isinstance(hpz, int) and not isinstance(hpz, bool) and hpz > 1 and facts.world_size % hpz:
        raise ConfigError(
            f"zero_hpz_partition_size {hpz} does not divide world_size {facts.world_size}: hpZ shards a weight copy "
            "over groups of that many ranks; use the devices per node"
        )


def _check_aio(aio: Any) -> None:
    """The ``aio`` section: DeepSpeed 0.19's keys with positive sizes (an unknown key is silently ignored there)."""
    if not isinstance(aio, dict):
        raise ConfigError(f"aio must be a mapping of {', '.join(AIO_KEYS)}, got {aio!r}")
    for key, value in aio.items():
        if key in AIO_OLD_NAMES:
            raise ConfigError(
                f"aio.{key} is not read by DeepSpeed 0.19 (it would be silently ignored); it is called "
                f"aio.{AIO_OLD_NAMES[key]} now"
            )
        if key not in AIO_KEYS:
            raise ConfigError(f"unknown aio key {key!r}{nearest(key, AIO_KEYS)}; valid: {', '.join(AIO_KEYS)}")
        if key in ("block_size", "queue_depth", "intra_op_parallelism") and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ConfigError(f"aio.{key} must be a positive integer, got {value!r}")
        if key in ("single_submit", "overlap_events", "use_gds") and not isinstance(value, bool):
            raise ConfigError(f"aio.{key} must be true or false, got {value!r}")


def _check_offload_paths(zero: dict[str, Any], nvme_path: str | None) -> None:
    """Fill each NVMe section's ``nvme_path`` from the run facts; one is required."""
    for section in nvme_sections(zero):
        offload = zero[section]
        offload["nvme_path"] = offload.get("nvme_path") or nvme_path
        if not offload["nvme_path"]:
            raise ConfigError(
                f"zero_optimization.{section}: NVMe offload needs a path; pass nvme_path=/local/nvme "
                f"(or --set zero_optimization.{section}.nvme_path=/local/nvme)"
            )


def _validate(config: dict[str, Any], preset_name: str, forbid_fp16: bool) -> None:
    DeepSpeedZeroConfig = _zero_config_class()  # noqa: N806

    zero = config["zero_optimization"]
    stage = zero.get("stage")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if forbid_fp16 and config["fp16"].get("enabled"):
        raise ConfigError(
            f"preset {preset_name!r} refuses fp16: scientific models need bf16 or fp32 "
            "(fp16's 5-bit exponent overflows and its 10-bit mantissa loses the small terms)"
        )
    if config["fp16"].get("enabled") and config["bf16"].get("enabled"):
        raise ConfigError("fp16 and bf16 cannot both be enabled; pick one precision")
    if "offload_param" in zero and zero["offload_param"] and stage != 3:
        raise ConfigError(f"offload_param needs ZeRO stage 3 (stage is {stage}); use offload_optimizer for 1/2")
    if stage == 0 and zero.get("offload_optimizer"):
        raise ConfigError("offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)")
    try:
        DeepSpeedZeroConfig(**zero)
    except Exception as exc:  # pydantic's ValidationError: report DeepSpeed's own reason in one line
        first = str(exc).splitlines()
        detail = " ".join(line.strip() for line in first[1:3]) if len(first) > 1 else str(exc)
        raise ConfigError(f"invalid zero_optimization: {detail}") from None
    placeholders = auto_placeholders(config)
    if placeholders:
        raise ConfigError(f"{placeholders[0]} is 'auto'; the factory resolves every value, pass a number")


def auto_placeholders(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys (``zero_optimization.reduce_bucket_size``) whose value is the Hugging Face placeholder
    ``"auto"``; DeepSpeed's own ``"auto"`` settings (:data:`DEEPSPEED_AUTO_KEYS`) are not one."""
    if isinstance(node, dict):
        return [found for key, value in node.items() for found in auto_placeholders(value, f"{prefix}{key}.")]
    if isinstance(node, list):
        return [found for index, value in enumerate(node) for found in auto_placeholders(value, f"{prefix}{index}.")]
    key = prefix[:-1]
    return [key] if node == "auto" and key not in DEEPSPEED_AUTO_KEYS else []


def resolve_deepspeed_config(
    preset: str | dict[str, Any],
    facts: RunFacts | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Resolve a preset into a complete DeepSpeed config dict with no ``"auto"`` left.

    Args:
        preset: a preset name (see :data:`common.presets.PRESETS`) or a preset-shaped dict.
        facts: the run's world size, batch, accumulation, precision and hidden size.
        overrides: dotted DeepSpeed keys to set last, e.g. ``{"zero_optimization.reduce_bucket_size": 2e8}``.

    Returns:
        A dict to pass to ``deepspeed.initialize``, Lightning or Accelerate (through the adapters below).

    Raises:
        ConfigError: unknown preset or key, bad stage, fp16 where the preset forbids it, NVMe without a path, and
            (``facts.check_storage``) an NVMe folder that is missing, not writable or full, or no libaio.
    """
    if is_fsdp2_name(preset):  # torch's FSDP2, not DeepSpeed: the same keys, an fsdp2 section
        return resolve_fsdp2_config(preset, facts, overrides)
    facts = facts or RunFacts()
    spec = get_preset(preset) if isinstance(preset, str) else copy.deepcopy(preset)
    name = preset if isinstance(preset, str) else spec.get("name", "custom")
    precision = facts.precision or spec.get("precision", "bf16")
    if spec.get("forbid_fp16") and precision == "fp16":
        _validate({"zero_optimization": {"stage": spec["stage"]}, **_precision_sections("fp16")}, name, True)

    zero = {"stage": spec["stage"], **copy.deepcopy(spec.get("zero_optimization", {}))}
    config: dict[str, Any] = {
        "train_batch_size": facts.world_size * facts.micro_batch_size * facts.grad_accum,
        "train_micro_batch_size_per_gpu": facts.micro_batch_size,
        "gradient_accumulation_steps": facts.grad_accum,
        "gradient_clipping": float(facts.gradient_clipping),
        **_precision_sections(precision),
        "zero_optimization": zero,
        # Client optimizers (torch AdamW, DeepSpeedCPUAdam) are what the recipes pass in.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,  # the recipes log themselves; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }
    if "aio" in spec:
        config["aio"] = copy.deepcopy(spec["aio"])
    for key, value in (overrides or {}).items():
        _set_dotted(config, key, value)
    zero = config["zero_optimization"]
    block_size = (config.get("aio") or {}).get("block_size")
    _fill_from_model(zero, facts.hidden_size, swap_threshold_bytes(block_size if isinstance(block_size, int) else None))
    _fill_from_layout(zero, facts)
    if "aio" in config:
        _check_aio(config["aio"])
    _check_offload_paths(zero, facts.nvme_path)
    _validate(config, name, bool(spec.get("forbid_fp16")))
    if facts.check_storage:
        check_nvme_storage(
            zero, precision_of(config), facts.num_params, facts.world_size, facts.devices_per_node or facts.world_size
        )
    return config


def torch_dtype(precision: str) -> Any:
    """The ``torch.dtype`` of a precision name (``bf16`` -> ``torch.bfloat16``); torch is imported only here."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def is_fsdp2(config: dict[str, Any]) -> bool:
    """Whether a resolved config is an FSDP2 preset's (:func:`resolve_fsdp2_config`), not DeepSpeed's."""
    return "fsdp2" in config


def zero_stage(ds_config: dict[str, Any]) -> int:
    """The ZeRO stage of a resolved config; for an FSDP2 preset, that of the ZeRO preset it is measured against
    (``fsdp2``: 3, ``fsdp2_grad_op``: 2)."""
    if is_fsdp2(ds_config):
        return int(get_preset(ds_config["fsdp2"]["counterpart"])["stage"])
    return int(ds_config["zero_optimization"]["stage"])


def precision_of(ds_config: dict[str, Any]) -> str:
    """``bf16``, ``fp16`` or ``fp32`` as the resolved config says."""
    if ds_config.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def offloads_optimizer(ds_config: dict[str, Any]) -> bool:
    """Whether the optimizer states live off the accelerator (CPU or NVMe)."""
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return offload.get("device", "none") in ("cpu", "nvme")


# --- optimizer ----------------------------------------------------------------------------------------


def make_optimizer(
    params: Any,
    ds_config: dict[str, Any],
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> Any:
    """AdamW for the config: DeepSpeedCPUAdam when optimizer states are offloaded, else ``torch.optim.AdamW``, fused
    where torch has a fused kernel for the parameters' device and dtype (CPU and CUDA floating point).

    ZeRO partitions Adam-family optimizers (an optimizer without partition support breaks the run),
    and with offload DeepSpeed insists on its CPU Adam, which it compiles on first use.

    Why fused: torch's default AdamW builds its denominator in full-size temporaries, tensor by tensor. ZeRO-1 and 2
    hand it one flat fp32 partition per parameter group, so on a CPU those temporaries are hundreds of MB at a 125M
    model, above glibc's largest mmap threshold, mapped and faulted in afresh every step (docs/benchmarks.md,
    "peer-125m-profile"). The fused kernel updates in place in one pass, on ZeRO's flat partition and on FSDP2's
    DTensor shards alike.
    """
    import torch

    if offloads_optimizer(ds_config):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # bf16.bf16_optimizer_states keeps Adam's moments in bf16; under offload DeepSpeed insists that the CPU
        # Adam was built that way (it asserts otherwise).
        fp32_states = not ds_config.get("bf16", {}).get("bf16_optimizer_states", False)
        return DeepSpeedCPUAdam(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=True,
            fp32_optimizer_states=fp32_states,
        )
    params = list(params)  # a generator would be spent by a first try
    try:
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
    except RuntimeError:  # no fused kernel for these parameters' device or dtype
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup: ``(step + 1) / warmup_steps`` during the first ``warmup_steps`` steps, then 1."""
    return (step + 1) / warmup_steps if step < warmup_steps else 1.0


def cosine_with_warmup(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay to ``min_ratio`` (a LambdaLR function)."""
    if step < warmup_steps:
        return warmup_factor(step, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def step_decay_with_warmup(step: int, warmup_steps: int, every: int, gamma: float) -> float:
    """Learning-rate multiplier: linear warmup, then ``gamma`` once every ``every`` steps (torch's StepLR)."""
    return warmup_factor(step, warmup_steps) * gamma ** (step // every)


# --- Lightning adapter --------------------------------------------------------------------------------

LIGHTNING_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}


def lightning_strategy_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed dict Lightning accepts: the same dict less the keys Lightning insists on setting.

    Lightning raises if ``gradient_accumulation_steps`` is in the dict (it takes it from
    ``Trainer(accumulate_grad_batches=...)``) and DeepSpeed derives ``train_batch_size`` itself.
    """
    config = copy.deepcopy(ds_config)
    config.pop("gradient_accumulation_steps", None)
    config.pop("train_batch_size", None)
    return config


def lightning_trainer_kwargs(
    ds_config: dict[str, Any], timeout: timedelta | None = None, run_dir: str | Path | None = None
) -> dict[str, Any]:
    """``Trainer`` keyword arguments for a resolved config: strategy, precision, accumulation, clipping.

    The strategy is :class:`common.lightning_cpu.ZeroDeepSpeedStrategy`, which is Lightning's own
    ``DeepSpeedStrategy`` on a GPU and also runs real ZeRO on a CPU. It also makes the process-wide settings of a run
    (:func:`common.process_setup.setup_process`: hang detection, the ``zero.Init`` dtype patch, freed host memory
    kept unless offloading), as every entry point does first in its ``main()``: a script of your own that calls only
    this adapter gets the same process, and the banner naming each setting and its off switch prints once.

    Args:
        ds_config: the factory's resolved config.
        timeout: how long a collective may wait (the recipes' ``collective_timeout_s``); torch's 30 min if None.
        run_dir: the run directory; a hang's reports go to ``run_dir/hang/``.
    """
    from common.lightning_cpu import ZeroDeepSpeedStrategy

    setup_process(ds_config, timeout, run_dir)  # process-wide; a second call in one process prints nothing
    if is_fsdp2(ds_config):
        from common.fsdp2 import lightning_fsdp2_trainer_kwargs

        fsdp2 = ds_config["fsdp2"]
        clip = ds_config["gradient_clipping"]
        return lightning_fsdp2_trainer_kwargs(
            fsdp2["world_size"], ds_config["gradient_accumulation_steps"], clip, timeout
        )
    kwargs: dict[str, Any] = {"config": lightning_strategy_config(ds_config)}
    if timeout is not None:
        kwargs["timeout"] = timeout
    clip = ds_config.get("gradient_clipping", 0.0)
    return {
        "strategy": ZeroDeepSpeedStrategy(**kwargs),
        "precision": LIGHTNING_PRECISION[precision_of(ds_config)],
        "accumulate_grad_batches": ds_config["gradient_accumulation_steps"],
        "gradient_clip_val": clip or None,
    }


# --- Accelerate adapter -------------------------------------------------------------------------------

ACCELERATE_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def accelerate_plugin(ds_config: dict[str, Any], zero3_init: bool | None = None) -> Any:
    """An Accelerate ``DeepSpeedPlugin`` holding (a copy of) the resolved dict.

    Args:
        ds_config: the factory's resolved config.
        zero3_init: construct models inside ``deepspeed.zero.Init`` (default: on for stage 3), so that
            ``from_pretrained`` partitions weights as it loads and no rank holds the whole model.
    """
    from accelerate.utils import DeepSpeedPlugin

    stage3 = zero_stage(ds_config) == 3
    return DeepSpeedPlugin(
        hf_ds_config=copy.deepcopy(ds_config), zero3_init_flag=stage3 if zero3_init is None else zero3_init
    )


def accelerator_kwargs(
    ds_config: dict[str, Any], timeout: timedelta | None = None, run_dir: str | Path | None = None
) -> dict[str, Any]:
    """``Accelerator`` keyword arguments: plugin, mixed precision, accumulation, and a gloo-safe process group.

    With ``--use_deepspeed`` on a CPU a plain ``Accelerator()`` may count one process while DeepSpeed runs
    two; naming the backend explicitly fixes it (docs/design.md, "Found on the way"). It also makes the process-wide
    settings (:func:`common.process_setup.setup_process`), as :func:`lightning_trainer_kwargs` does; ``timeout`` and
    ``run_dir`` as there.
    """
    import torch
    from accelerate.utils import InitProcessGroupKwargs

    setup_process(ds_config, timeout, run_dir)  # process-wide; a second call in one process prints nothing
    if is_fsdp2(ds_config):
        from common.fsdp2 import accelerator_fsdp2_kwargs

        grad_accum = ds_config["gradient_accumulation_steps"]
        return accelerator_fsdp2_kwargs(ds_config["fsdp2"], precision_of(ds_config), grad_accum, timeout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    pg_kwargs = {"backend": backend}
    if timeout is not None:
        pg_kwargs["timeout"] = timeout
    return {
        "deepspeed_plugin": accelerate_plugin(ds_config),
        "mixed_precision": ACCELERATE_PRECISION[precision_of(ds_config)],
        "gradient_accumulation_steps": ds_config["gradient_accumulation_steps"],
        "kwargs_handlers": [InitProcessGroupKwargs(**pg_kwargs)],
    }


def shard_model(model: Any, ds_config: dict[str, Any], mesh: Any = None, layer_classes: Any = None) -> Any:
    """Shard ``model`` for the run, where the front-end leaves it to the script; return it.

    Under a ZeRO preset DeepSpeed partitions the model inside ``deepspeed.initialize`` (Lightning's strategy and
    Accelerate's ``prepare`` call it): nothing to do here. Under an FSDP2 preset
    :func:`common.fsdp2.apply_fully_shard` shards each block, then the root, with the preset's
    ``reshard_after_forward`` and the precision contract's ``MixedPrecisionPolicy``: from the LightningModule's
    ``configure_model`` (``mesh=self.device_mesh["data_parallel"]``), or before the optimizer is built under
    Accelerate. Call it once the process group exists.

    Args:
        model: the module to shard, on the rank's device.
        ds_config: the factory's resolved config.
        mesh: the data-parallel device mesh (Lightning's); None: every rank.
        layer_classes: the block classes (default: :func:`common.activation.find_blocks`'s).
    """
    if is_fsdp2(ds_config):
        from common.fsdp2 import apply_fully_shard

        apply_fully_shard(model, ds_config["fsdp2"], precision_of(ds_config), layer_classes, mesh)
    return model


def gradient_norm(model: Any, ds_config: dict[str, Any], clip: bool = False) -> Any:
    """At an optimizer step's boundary, before the step: the gradients' norm before clipping, where the engine keeps
    none; with ``clip``, the gradients clipped as well.

    Under an FSDP2 preset: :func:`common.fsdp2.clip_grad_norm`, clipping at the config's ``gradient_clipping`` when
    ``clip`` (the Accelerate loop clips through it; Lightning clips by itself, from the trainer's
    ``gradient_clip_val``, after its ``on_before_optimizer_step`` hook measured the norm); the loop logs what it returns
    (:func:`common.metrics.grad_norm`'s ``measured``). Under a ZeRO preset: None, nothing done: DeepSpeed clips inside
    its step and keeps the norm itself.

    Args:
        model: the model being trained (a LightningModule, or Accelerate's prepared model).
        ds_config: the factory's resolved config.
        clip: clip the gradients too (FSDP2 presets).
    """
    if not is_fsdp2(ds_config):
        return None
    from common.fsdp2 import clip_grad_norm

    return clip_grad_norm(model.parameters(), ds_config["gradient_clipping"] if clip else 0.0)


@dataclass
class AccelerateCheckpointIO:
    """How an Accelerate loop saves and loads its training state, whichever engine the preset picks.

    Under a ZeRO preset: ``accelerator.save_state`` / ``load_state`` (DeepSpeed's shards, the schedulers registered
    with ``register_for_checkpointing``, the RNG states). Under an FSDP2 preset: ``torch.distributed.checkpoint``
    (:func:`common.fsdp2.dcp_write`, :func:`common.fsdp2.load_checkpoint`): every rank's shards of the model and the
    optimizer, and the scheduler's state, loadable at any world size. Accelerate's own ``save_state`` writes FSDP2
    shards only in its FSDP mode, which Accelerate 1.15 turns on for accelerators alone: on a CPU it would save rank
    0's shards as if they were the whole model.

    Attributes:
        accelerator: the run's ``Accelerator``.
        ds_config: the factory's resolved config.
        model, optimizer: as ``accelerator.prepare`` returned them.
        scheduler: the learning-rate scheduler (registered for checkpointing under ZeRO).
        exclude_frozen_parameters: leave the parameters that do not require grad out of the checkpoint (a
            fine-tuning run's frozen base, loaded from its model folder again on resume), under either engine.
    """

    accelerator: Any
    ds_config: dict[str, Any]
    model: Any
    optimizer: Any
    scheduler: Any
    exclude_frozen_parameters: bool = False

    def save(self, folder: Path) -> Any:
        """Every rank: write the training state into ``folder`` (the call :class:`~common.async_checkpoint.Checkpointer`
        makes)."""
        if not is_fsdp2(self.ds_config):
            frozen_left_out = {"exclude_frozen_parameters": True} if self.exclude_frozen_parameters else {}
            return self.accelerator.save_state(str(folder), **frozen_left_out)
        from common.fsdp2 import dcp_write

        extra = {"scheduler": self.scheduler.state_dict()}
        optimizer = _torch_optimizer(self.optimizer)
        return dcp_write(self.model, optimizer, extra, exclude_frozen_parameters=self.exclude_frozen_parameters)(folder)

    def barrier(self) -> None:
        """Every rank waits for the others (the checkpointer's barrier): the process group's own
        (:func:`common.metrics.barrier`), since ``accelerator.wait_for_everyone`` returns at once under FSDP2 on a
        CPU."""
        barrier()

    def load(self, folder: Path) -> None:
        """Every rank: load the training state saved in ``folder``, re-sharded for this world size under FSDP2."""
        if not is_fsdp2(self.ds_config):
            # A checkpoint without the frozen parameters loads into the model that holds them already.
            frozen_left_out = {"load_module_strict": False} if self.exclude_frozen_parameters else {}
            self.accelerator.load_state(str(folder), **frozen_left_out)
            return
        from common.fsdp2 import load_checkpoint

        optimizer = _torch_optimizer(self.optimizer)
        extra = load_checkpoint(folder, self.model, optimizer, self.exclude_frozen_parameters)
        self.scheduler.load_state_dict(extra["scheduler"])


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer``."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def accelerate_config(
    ds_config_file: str,
    num_processes: int,
    num_machines: int = 1,
    zero3_init: bool = False,
    use_cpu: bool = False,
    main_process_port: int = 29500,
) -> dict[str, Any]:
    """The accelerate config YAML (as a dict) that launches with the DeepSpeed JSON at ``ds_config_file``."""
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {
            "deepspeed_config_file": ds_config_file,
            "zero3_init_flag": zero3_init,
            "deepspeed_multinode_launcher": "standard",
        },
        **accelerate_launch_fields(num_processes, num_machines, main_process_port, use_cpu),
    }


def accelerate_fsdp2_config(
    preset: str | dict[str, Any], num_processes: int, num_machines: int = 1, main_process_port: int = 29500
) -> dict[str, Any]:
    """The accelerate config YAML (as a dict) that launches a script under FSDP2."""
    spec = get_fsdp2_preset(preset)
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": spec["reshard_after_forward"],
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        },
        **accelerate_launch_fields(num_processes, num_machines, main_process_port, use_cpu=False),
    }


def accelerate_launch_fields(
    num_processes: int, num_machines: int, main_process_port: int, use_cpu: bool
) -> dict[str, Any]:
    """The launch fields of an accelerate config YAML, the same whichever engine the file selects."""
    return {
        "machine_rank": 0,
        "main_process_port": main_process_port,
        "main_training_function": "main",
        "num_machines": num_machines,
        "num_processes": num_processes,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": use_cpu,
    }


def write_accelerate_files(
    ds_config: dict[str, Any],
    out_dir: str | Path,
    num_processes: int,
    num_machines: int = 1,
    use_cpu: bool = False,
    json_name: str = "ds_config.json",
    yaml_name: str = "accelerate.yaml",
    script: str | None = None,
    regenerate: str | None = None,
) -> Path:
    """Write ``ds_config.json`` and ``accelerate.yaml`` (pointing at it) into ``out_dir``; return the YAML path.

    The YAML names the JSON by its path relative to the current directory when it is inside it (so a
    shipped recipe config works from the repository root), else by its absolute path. It opens with a comment
    header: the command that launches it, where the JSON comes from, and who reads the JSON.

    Args:
        script: the training script it launches (a recipe's ``train_accelerate.py``, as the user types it from
            the current directory). A recipe's script builds its DeepSpeed plugin from the recipe config, not
            from the JSON, and the header says so; None: the header names ``YOUR_SCRIPT.py``.
        regenerate: the command that writes the JSON again (for a recipe's shipped files, the exact
            ``zero-recipes config ...`` line); None: the general ``zero-recipes config`` form.
    """
    from common.config import dump_yaml

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, yaml_path = out_dir / json_name, out_dir / yaml_name
    json_path.write_text(json.dumps(ds_config, indent=2) + "\n")

    def shown(path: Path) -> str:
        try:
            return str(path.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            return str(path.resolve())

    if is_fsdp2(ds_config):  # Accelerate's FSDP plugin at version 2; the JSON holds the run config, for reading
        yaml_dict = accelerate_fsdp2_config(ds_config["fsdp2"], num_processes, num_machines)
    else:
        yaml_dict = accelerate_config(
            shown(json_path), num_processes, num_machines, zero3_init=zero_stage(ds_config) == 3, use_cpu=use_cpu
        )
    engine = "FSDP2" if is_fsdp2(ds_config) else "DeepSpeed"
    json_role = "run config (for reading: this file sets FSDP2)" if is_fsdp2(ds_config) else "DeepSpeed config it names"
    header = [
        f"# Launches a training script under {engine} with Accelerate:",
        "#",
        f"#   accelerate launch --config_file {shown(yaml_path)} {script or 'YOUR_SCRIPT.py'}",
        "#",
        f"# {json_name} beside this file is the {json_role}, the factory's resolved dict, written by:",
        f"#   {regenerate or 'zero-recipes config PRESET --world-size N ... --format accelerate --out DIR'}",
    ]
    if script:
        header += [
            f"# {Path(script).name} does not read it: it builds its DeepSpeed plugin from the recipe config",
            "# (common.strategy.accelerator_kwargs), so a changed micro_batch_size or preset needs no edit of either",
            "# file. This file sets the launcher's side: processes, machines, zero3_init_flag.",
        ]
    else:
        header.append("# A script that builds Accelerator() without a DeepSpeed plugin reads it through this file.")
    yaml_path.write_text("\n".join(header) + "\n\n" + dump_yaml(yaml_dict))
    return yaml_path
