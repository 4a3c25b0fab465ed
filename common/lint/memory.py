"""Rules on memory: bucket sizes, the stage-3 persistence threshold, partitioned optimizers, ZeRO in effect, and
the host copy that asynchronous checkpoints keep."""

from __future__ import annotations

from common.lint.offload import _offload_host_bytes
from common.lint.view import Finding, LintView, Rule, as_number
from common.memory_formulas import fmt_gb
from common.snapshot_memory import snapshot_bytes_per_node, snapshot_bytes_per_rank

GUIDE_BUCKET_MIN = 5e8  # the usual advice: reduce_bucket_size between 5e8 and 2e9 elements (5e8 is DeepSpeed's default)
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


def rule_persistence_threshold(view: LintView) -> list[Finding]:
    """Stage-3 persistence threshold vs hidden size: too small gathers norms one by one, too large shards nothing."""
    if view.stage != 3 or not view.hidden_size:
        return []
    raw = view.zero.get("stage3_param_persistence_threshold", DS_DEFAULT_PERSISTENCE)
    threshold = as_number(raw)
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
                f"set it to about 10 x hidden = {10 * h}, or 1e6 to keep small matrices resident",
            )
        ]
    return []


def _buckets(view: LintView) -> list[tuple[str, float]]:
    keys = ["reduce_bucket_size"] + (["allgather_bucket_size"] if view.stage in (1, 2) else [])
    out = []
    for key in keys:
        value = as_number(view.zero.get(key, DS_DEFAULT_BUCKET))
        if value is not None:
            out.append((key, value))
    return out


def rule_bucket_size(view: LintView) -> list[Finding]:
    """Buckets between 5e8 and 2e9 elements (the usual range); the presets scale them down for small models.

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
                f"{', '.join(big)} above 2e9: one huge collective blocks the stream instead of overlapping "
                "with compute" + (", and stage 3 preallocates the reduce bucket" if view.stage == 3 else ""),
                "set the bucket sizes between 5e8 and 2e9 (5e8, DeepSpeed's default, is a steady start)",
            )
        )
    if small and scaled is not None and scaled >= GUIDE_BUCKET_MIN:
        findings.append(
            Finding(
                "bucket-size",
                "warning",
                f"{', '.join(small)} below 5e8 for a model of hidden size {view.hidden_size}: many small "
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
                f"{', '.join(small)} below 5e8: right for a small model (the presets use "
                "min(5e8, 32 x hidden^2)), too small for a 7B-class one; the hidden size is not known here",
                "pass --hidden-size (or --model-config) to check them against the model",
            )
        )
    return findings


def rule_stage3_bucket_preallocated(view: LintView) -> list[Finding]:
    """Stage 3 preallocates ``reduce_bucket_size`` elements per rank whatever the model's size (measured)."""
    if view.stage != 3 or not view.hidden_size or view.ds_config is None:
        return []
    value = as_number(view.zero.get("reduce_bucket_size", DS_DEFAULT_BUCKET))
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
    value = as_number(view.zero.get("reduce_bucket_size", DS_DEFAULT_BUCKET))
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
            "set reduce_bucket_size between 5e8 and 2e9, or let the factory scale it to the model "
            "(32 x hidden^2: zero-recipes config PRESET --hidden-size H)",
        )
    ]


def rule_optimizer_partition(view: LintView) -> list[Finding]:
    """An optimizer without partition support breaks ZeRO; fall back to the Adam family."""
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
            "partitioned",
            "use AdamW (common.strategy.make_optimizer), or set zero_allow_untested_optimizer and test the result",
        )
    ]


def rule_zero_stage_missing(view: LintView) -> list[Finding]:
    """Out of memory because ZeRO is not in effect (a config without a stage runs plain data parallelism)."""
    if view.source_kind != "deepspeed" or view.ds_config is None:
        return []
    if "stage" in view.zero:
        return []
    return [
        Finding(
            "zero-stage-missing",
            "warning",
            "no zero_optimization.stage: DeepSpeed defaults to stage 0, every rank holds all 16 B/param "
            "(the usual cause of out-of-memory when ZeRO seems on: its config is not in effect)",
            "set zero_optimization.stage explicitly (2 is the usual baseline)",
        )
    ]


def rule_async_save_host_memory(view: LintView) -> list[Finding]:
    """``async_save`` keeps each rank's host copy of its checkpoint share for the run: check it against host RAM."""
    if not view.recipe("async_save") or not view.num_params or view.host_ram_bytes is None:
        return []
    precision = view.precision if view.precision in ("bf16", "fp16", "fp32") else "bf16"
    stage, ranks = view.stage, max(1, view.world_size)
    partition = view.num_params / ranks if stage else view.num_params
    writer, other = snapshot_bytes_per_rank(partition, view.num_params, stage, precision)
    snapshot = snapshot_bytes_per_node(writer, other, view.ranks_per_node)
    offloaded = _offload_host_bytes(view) if view.offload_device("offload_optimizer") == "cpu" else 0.0
    need, have = snapshot + (offloaded or 0.0), view.host_ram_bytes
    if need <= have:
        return []
    module = " + the module on the first rank" if stage < 3 else ""
    beside = f" beside {fmt_gb(offloaded)} of offloaded states" if offloaded else ""
    return [
        Finding(
            "async-save-host-memory",
            "warning",
            f"async_save keeps each rank's checkpoint share in host memory for the run: {fmt_gb(snapshot)} per node "
            f"({view.ranks_per_node} rank(s); the optimizer partition, 12 B x {view.num_params:.3g} / {ranks}{module})"
            f"{beside}, against {fmt_gb(have)} of host RAM",
            "async_save: false (saves then block for the write), more nodes (the share per node falls with them), or "
            "less offload; zero-recipes estimate --async-save shows the term per row",
        )
    ]


RULES: dict[str, Rule] = {
    "persistence-threshold": rule_persistence_threshold,
    "bucket-size": rule_bucket_size,
    "stage3-bucket-preallocated": rule_stage3_bucket_preallocated,
    "stage3-bucket-exceeds-memory": rule_stage3_bucket_exceeds_memory,
    "optimizer-partition": rule_optimizer_partition,
    "zero-stage-missing": rule_zero_stage_missing,
    "async-save-host-memory": rule_async_save_host_memory,
}
