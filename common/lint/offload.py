"""Rules on CPU and NVMe offload (ZeRO-Offload, ZeRO-Infinity), asynchronous I/O and ZenFlow."""

from __future__ import annotations

from common.lint.view import Finding, LintView, Rule, as_number
from common.memory_formulas import (
    WORKING_BYTES,
    ModelFacts,
    guide_model_states,
    swap_threshold_bytes,
)
from common.strategy import AIO_KEYS, AIO_OLD_NAMES


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
            "it as the usual advice for scientific models)",
            "keep it (harmless) or drop it; it pays off with offload_optimizer.device: cpu",
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


def rule_offload_order(view: LintView) -> list[Finding]:
    """Offload optimizer states first, parameters after: each tier down is slower, and parameters move every layer."""
    if view.offload_device("offload_param") == "none" or view.offload_device("offload_optimizer") != "none":
        return []
    return [
        Finding(
            "offload-order",
            "warning",
            "parameters are offloaded but optimizer states are not: offload optimizer states first "
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


def rule_offload_small_batch(view: LintView) -> list[Finding]:
    """Offload throughput collapses at small batches (little compute to hide the copies); raise the batch."""
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
            "raise micro_batch_size / grad_accum so compute hides the PCIe transfers",
        )
    ]


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
    return swap_threshold_bytes(as_number(aio.get("block_size")) if isinstance(aio, dict) else None)


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
    sub_group = as_number(view.zero.get("sub_group_size", 1_000_000_000))
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
    buffer = as_number(view.zero["offload_param"].get("buffer_size", 100_000_000))
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


RULES: dict[str, Rule] = {
    "round-robin-without-offload": rule_round_robin_without_offload,
    "offload-pin-memory": rule_offload_pin_memory,
    "offload-order": rule_offload_order,
    "offload-stage": rule_offload_stage,
    "offload-small-batch": rule_offload_small_batch,
    "nvme-path": rule_nvme_path,
    "nvme-offload-stage-1-2": rule_nvme_offload_stage_1_2,
    "nvme-small-partitions": rule_nvme_small_partitions,
    "nvme-param-buffer": rule_nvme_param_buffer,
    "aio-keys": rule_aio_keys,
    "nvme-small-sub-groups": rule_nvme_small_sub_groups,
    "zenflow": rule_zenflow,
}
