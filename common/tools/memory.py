"""Memory planner: per-rank bytes of each ZeRO stage and offload variant, before anything runs.

Everything here is pure arithmetic on a few model facts, so ``zero-recipes estimate`` answers in a
second and a test can check each term. Per rank, for K parameters on N data-parallel ranks:

- **model states** by the ZeRO paper's formula, through
  :func:`common.accounting.predicted_model_state_bytes`: 16K / 4K + 12K/N / 2K + 14K/N / 16K/N for
  stages 0-3 with mixed-precision Adam. Offload moves terms off the device: ``optimizer`` the 12 B of
  fp32 master + Adam moments, ``params`` (stage 3) the parameters and gradients as well. Gradients are
  counted alive (the peak, during the backward pass; ``step()`` releases them). Under stage 3 the
  parameters under ``stage3_param_persistence_threshold`` are kept whole on every rank *besides* their
  partition: + P x K_persistent (P bytes per working element; measured exactly by bench/memory.py).
- **DeepSpeed's own estimate**, the formulas of ``estimate_zero2_model_states_mem_needs`` and
  ``estimate_zero3_model_states_mem_needs`` (DeepSpeed 0.19), re-stated here so that the planner does
  not import DeepSpeed; ``tests/unit/test_memory.py`` calls DeepSpeed's functions and checks that the
  two agree. DeepSpeed counts 18 B/param of sharded state (fp32 gradients included), a largest-layer
  term for stage 3 and has no estimator for stages 0 and 1.
- **activations**: the bytes autograd saves for the backward pass, per tensor, for the attention
  implementation the run uses (:func:`activation_parts`). A Llama-style block (RMSNorm, rotary
  embeddings, gated MLP) is counted op by op from transformers' code and checked against
  ``torch.autograd.graph.saved_tensors_hooks`` (tests/unit/test_activation_bytes.py, bench/activations.py):
  SDPA and FlashAttention save q, k, v, the output and a float32 log-sum-exp per head and token, never
  the ``a x s x s`` score matrix; ``eager`` saves the softmax (float32 and its 16-bit copy). Other
  transformers get Korthikanti et al. 2022 (arXiv:2205.05198, section 4.1), ``s*b*h*(34 + 5*a*s/h)``
  per layer with its score term only under ``eager``. Checkpointing presets keep block inputs, and the
  peak is the larger of the end of the forward pass and the first recomputation in the backward pass.
- **buffers**: an upper bound. DeepSpeed documents ``overlap_comm`` as costing about 4.5 x (reduce +
  all-gather bucket) elements; without it one bucket of each. Under stage 3 the reduce bucket is
  preallocated (``reduce_bucket_size`` elements in the training dtype, measured here) and
  DeepSpeed keeps gathered parameters whole up to ``stage3_max_live_parameters``. bench/memory.py
  measures what is resident at the peak of the backward pass and publishes the ratio.
- **host RAM** per node for offload: the offloaded per-rank bytes times the ranks on a node.
- **tensor, pipeline and expert parallelism** (``--tensor-parallel``, ``--pipeline-parallel``,
  ``--expert-parallel``, :class:`common.parallel.ParallelLayout`): a rank holds dense / (TP x PP) +
  experts / (EP x PP) parameters, and ZeRO partitions them over DP = world / (TP x PP) ranks (experts over DeepSpeed's
  expert data-parallel group, DP / EP). Activations are the first pipeline stage's under 1F1B (PP micro-batches in
  flight through L / PP blocks) with TP splitting each block's tensors (Korthikanti et al. 2022, eq. 2 and 4.2.3).
  DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3, so with PP > 1 those rows never fit; DeepSpeed's
  estimators know nothing of TP, PP or EP, so their column is empty. Bad layouts are refused by
  :func:`common.parallel.check_layout`, the recipes' own rules; with ``--recipe nlp`` also the combinations the
  recipe's DeepSpeed components cannot run (AutoTP with a pipeline, ...), and its rows they refuse are marked.
- **Ulysses sequence parallelism** (``--sequence-parallel N``, DeepSpeed's ``UlyssesSPAttentionHF``): each rank
  holds seq_len / N tokens of every per-token activation and heads / N of attention over the whole sequence
  (:func:`common.memory_formulas.activation_parts`; measured on 2 gloo ranks by
  tests/unit/test_sequence_parallel_activations.py). The SP ranks hold the same samples, so DP = world / (TP x PP x
  SP), but ZeRO partitions model states over them too (DeepSpeed's sequence-data-parallel group): the states
  column is the ZeRO formula with N = world / (TP x PP). :func:`longest_sequence` searches the longest sequence
  each row fits, with and without SP.

A row *fits* when model states + activations + buffers stay within 90 % of the device memory (10 %
kept for fragmentation and the runtime's own context) and, with offload, the host RAM holds the
offloaded states. :func:`recommend` walks the ladder of stages, fastest first, over the rows.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from common.activation import check_preset
from common.errors import ConfigError
from common.machine import host_memory, local_device_memory
from common.memory_formulas import (
    ATTENTIONS,
    GB,
    GUIDE_BANDWIDTH_GBPS,
    LINKS,
    NODE_SHARED_LINKS,
    OFFLOADS,
    USABLE_FRACTION,
    WORKING_BYTES,
    ModelFacts,
    assumed_transformer,
    buffer_bytes,
    deepspeed_estimate,
    facts_from_hf_config,
    fmt_gb,
    fsdp2_memory,
    link_seconds_range,
    lora_params,
    offload_traffic,
    parse_bandwidths,
    parse_bytes,
    parse_count,
    persistent_params,
    pipeline_activations,
)
from common.parallel import (
    ParallelLayout,
    check_layout,
    parallel_model_states,
    rank_params,
    rank_partition,
    stage_refusal,
)
from common.presets import FROM_MODEL, FSDP2_PRESET_NAMES, get_fsdp2_preset, get_preset
from common.snapshot_memory import snapshot_bytes_per_node, snapshot_bytes_per_rank
from common.strategy import bucket_elements, persistence_threshold
from common.tools.estimate_network import (
    NetworkInputs,
    add_arguments,
    fmt_comm,
    network_from_args,
    network_lines,
    network_recommendation,
    row_network,
)
from common.tools.estimate_sequence import longest_lines, longest_sequence, longest_summary
from common.tools.options import refuse_outside_mode
from common.tools.recipes import describe

# (stage, offload) rows of the table, and the generic preset each row stands for.
ROW_PRESETS: dict[tuple[int, str], str] = {
    (0, "none"): "ddp",
    (1, "none"): "deepspeed_stage_1",
    (2, "none"): "deepspeed_stage_2",
    (3, "none"): "deepspeed_stage_3",
    (1, "optimizer"): "deepspeed_stage_1",  # + offload_optimizer (no named preset)
    (2, "optimizer"): "deepspeed_stage_2_offload",
    (3, "optimizer"): "deepspeed_stage_3",  # + offload_optimizer only (no named preset)
    (3, "params"): "deepspeed_stage_3_offload",
    (3, "nvme"): "deepspeed_stage_3_offload_nvme",
}

# The ladder, fastest first: stages in order without offload, then offload optimizer states on stage 2
# (the first offload to try), then stage 3 with optimizer, then parameters too.
LADDER: tuple[tuple[int, str], ...] = (
    (0, "none"),
    (1, "none"),
    (2, "none"),
    (3, "none"),
    (2, "optimizer"),
    (3, "optimizer"),
    (3, "params"),
    (3, "nvme"),
)


@dataclass(frozen=True)
class PlanInputs:
    """The run a plan is for.

    Attributes:
        gpus_per_node: devices (ranks) per node.
        nodes: nodes; data-parallel ranks = gpus_per_node x nodes.
        seq_len: tokens per sample.
        micro_batch_size: samples per rank per forward pass.
        activation_checkpointing: the preset used for the "checkpointed" activations column.
        attention: ``sdpa``, ``flash_attention_2``, ``eager`` (or ``auto``): decides whether the score matrix is saved.
        lora_rank: LoRA rank (frozen base + adapters on attention and MLP projections), None = full training.
        offload: restrict the rows to one offload variant, or None for all.
        precision: ``bf16``, ``fp16`` or ``fp32``.
        device_memory_bytes: memory of one device (or, on a CPU, host RAM per process).
        device_memory_label: where that number comes from.
        host_memory_bytes: host RAM per node, for offload rows (None: not checked).
        bucket_elements: reduce / all-gather bucket size; None scales it to the model like the presets.
        bandwidth_gbps: GB/s of each link as (low, high): typical ranges, or one measured figure (``--bandwidth``).
        tensor_parallel: TP, ranks splitting each matrix (1: none).
        pipeline_parallel: PP, pipeline stages (1: none).
        expert_parallel: EP, ranks splitting a MoE layer's experts (1: none).
        sequence_parallel: SP, ranks splitting each sequence (Ulysses; 1: none).
        async_save: asynchronous checkpoints (``--async-save``, a recipe's ``async_save``): the host copy of each
            rank's share of a checkpoint (:mod:`common.snapshot_memory`) joins the host RAM per node.
    """

    gpus_per_node: int = 1
    nodes: int = 1
    seq_len: int = 2048
    micro_batch_size: int = 1
    activation_checkpointing: str = "full"
    attention: str = "sdpa"
    lora_rank: int | None = None
    offload: str | None = None
    precision: str = "bf16"
    device_memory_bytes: float = 80 * GB
    device_memory_label: str = "--gpu-memory"
    host_memory_bytes: float | None = None
    bucket_elements: int | None = None
    bandwidth_gbps: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(GUIDE_BANDWIDTH_GBPS))
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    sequence_parallel: int = 1
    parallel_components: str = "any"  # "deepspeed": the recipe's own components run each degree (common.parallel)
    async_save: bool = False  # asynchronous checkpoints: each rank's share of a checkpoint held in host RAM
    network: NetworkInputs | None = None  # links and compute: communication seconds per step (estimate_network)

    @property
    def world_size(self) -> int:
        """Ranks in total (data-parallel ranks when there is no tensor or pipeline parallelism)."""
        return self.gpus_per_node * self.nodes

    @property
    def layout(self) -> ParallelLayout:
        """The ranks as tensor x pipeline x sequence x data parallel, with expert parallelism."""
        return ParallelLayout(
            self.world_size,
            self.tensor_parallel,
            self.pipeline_parallel,
            self.expert_parallel,
            self.sequence_parallel,
            components=self.parallel_components,
        )


@dataclass
class Row:
    """One (stage, offload) variant of the plan; bytes are per rank unless named per node."""

    stage: int
    offload: str
    preset: str
    model_states_bytes: float
    model_states_after_step_bytes: float
    model_states_host_bytes: float
    deepspeed_estimate_bytes: float | None
    deepspeed_host_estimate_bytes: float | None
    activations_bytes: float | None
    activations_checkpointed_bytes: float | None
    buffers_bytes: float
    persistent_params: int
    host_ram_per_node_bytes: float
    total_bytes: float | None
    total_checkpointed_bytes: float | None
    fits: bool
    fits_with: str | None
    note: str = ""
    model_states_disk_bytes: float = 0.0
    bytes_moved_per_step: dict[str, dict[str, float]] = field(default_factory=dict)
    link_seconds: dict[str, tuple[float, float]] = field(default_factory=dict)
    offload_seconds: tuple[float, float] | None = None
    slowest_link: str | None = None
    longest_seq_len: int | None = None
    longest_seq_len_without_sp: int | None = None
    async_snapshot_bytes: float = 0.0  # with async_save: the largest rank's host copy of its checkpoint share
    network: dict[str, Any] | None = (
        None  # with --network / --bandwidth-from: communication per step (estimate_network)
    )


@dataclass
class Fsdp2Row:
    """One FSDP2 preset beside its ZeRO counterpart (common.memory_formulas.fsdp2); bytes per rank.

    ``model_states_bytes`` is the peak between forward and backward (gathered weights included), as the ZeRO rows'
    column counts gradients alive; ``gathered_bytes`` is the part of it that is whole working copies.
    """

    preset: str
    counterpart: str
    model_states_bytes: float
    model_states_after_step_bytes: float
    gathered_bytes: float
    buffers_bytes: float
    total_bytes: float | None
    total_checkpointed_bytes: float | None
    fits: bool
    fits_with: str | None
    counterpart_model_states_bytes: float | None = None
    counterpart_buffers_bytes: float | None = None


@dataclass
class Plan:
    """Rows plus the inputs and the ladder's recommendation; the FSDP2 rows stand beside the ladder, not in it."""

    model: ModelFacts
    inputs: PlanInputs
    rows: list[Row] = field(default_factory=list)
    recommendation: dict[str, Any] = field(default_factory=dict)
    fsdp2_rows: list[Fsdp2Row] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form: ``{"rows": [...], "model": ..., "inputs": ..., "recommendation": ...}``."""
        inputs = asdict(self.inputs)
        inputs["world_size"] = self.inputs.world_size
        inputs["data_parallel"] = self.inputs.layout.data_parallel
        inputs["zero_partition_ranks"] = self.inputs.layout.zero_ranks
        model = asdict(self.model)
        model.pop("param_numels")  # one number per parameter: too long to print, persistent_params is per row
        return {
            "rows": [asdict(r) for r in self.rows],
            "fsdp2_rows": [asdict(r) for r in self.fsdp2_rows],
            "model": model,
            "inputs": inputs,
            "usable_fraction": USABLE_FRACTION,
            "recommendation": self.recommendation,
            "longest_sequence": longest_summary(self),
        }


def _preset_zero(stage: int, offload: str, bucket: int, hidden_size: int | None = None) -> dict[str, Any]:
    """The row's preset ``zero_optimization``, with the model-scaled values the factory would fill in."""
    zero = dict(get_preset(ROW_PRESETS[(stage, offload)])["zero_optimization"])
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        zero.setdefault(key, bucket)
    if zero.get("stage3_prefetch_bucket_size") == FROM_MODEL:
        zero["stage3_prefetch_bucket_size"] = int(0.9 * bucket)
    if zero.get("stage3_param_persistence_threshold") == FROM_MODEL:
        zero["stage3_param_persistence_threshold"] = persistence_threshold(hidden_size)
    return zero


def _offload_time(facts: ModelFacts, stage: int, offload: str, inputs: PlanInputs) -> dict[str, Any]:
    """The row's time column: bytes each offload link moves per optimizer step, and the seconds they take.

    Trainable parameters only move (LoRA: the adapters); the floor is the slowest link's time, the step's lower
    bound if every transfer overlapped with compute and with the others.
    """
    trainable = lora_params(facts, inputs.lora_rank) if inputs.lora_rank else facts.num_params
    ranks = inputs.world_size
    if not inputs.layout.trivial:  # the rank's own partition, sharded over its data-parallel group already
        trainable, ranks = rank_partition(facts, inputs.layout), 1
    traffic = offload_traffic(trainable, stage, offload, ranks, inputs.precision)
    if not traffic:
        return {}
    seconds, slowest = link_seconds_range(traffic, inputs.gpus_per_node, inputs.bandwidth_gbps)
    return {
        "bytes_moved_per_step": traffic,
        "link_seconds": seconds,
        "offload_seconds": seconds[slowest],
        "slowest_link": slowest,
    }


def _async_snapshot(facts: ModelFacts, stage: int, inputs: PlanInputs) -> tuple[float, float]:
    """(the largest rank's, the first node's) host bytes of an asynchronous checkpoint's copy (async_save)."""
    layout = inputs.layout
    trainable = lora_params(facts, inputs.lora_rank) if inputs.lora_rank else facts.num_params
    module = float(sum(rank_params(facts, layout)))  # the rank's parameters (all of them without TP, PP or EP)
    partition = rank_partition(facts, layout) if stage else module  # stage 0 shards nothing
    writer, other = snapshot_bytes_per_rank(partition * trainable / facts.num_params, module, stage, inputs.precision)
    writers = layout.tensor * layout.pipeline  # a data-parallel group's first rank each; TP innermost: on node 0
    return writer, snapshot_bytes_per_node(writer, other, inputs.gpus_per_node, writers)


# --- the plan -----------------------------------------------------------------------------------------


def plan(facts: ModelFacts, inputs: PlanInputs) -> Plan:
    """Every (stage, offload) row for ``facts`` on ``inputs``, with the ladder's recommendation."""
    if inputs.offload is not None and inputs.offload not in OFFLOADS:
        raise ConfigError(f"offload must be one of {', '.join(OFFLOADS)}, got {inputs.offload!r}")
    if inputs.precision not in WORKING_BYTES:
        raise ConfigError(f"precision must be bf16, fp16 or fp32, got {inputs.precision!r}")
    layout = inputs.layout
    check_layout(facts, layout, seq_len=inputs.seq_len, attention=inputs.attention)
    sp = layout.sequence
    bucket = inputs.bucket_elements or bucket_elements(facts.hidden_size)
    # TP splits the largest matrix too (the embedding is vocabulary-parallel); an upper bound under EP.
    largest = (facts.largest_layer_params or 0) // layout.tensor
    usable = USABLE_FRACTION * inputs.device_memory_bytes
    ac = inputs.activation_checkpointing
    run = (inputs.seq_len, inputs.micro_batch_size)
    split = (layout.tensor, layout.pipeline, sp)
    act_none = pipeline_activations(facts, *run, "none", inputs.precision, inputs.attention, *split)
    act_ckpt = pipeline_activations(facts, *run, ac, inputs.precision, inputs.attention, *split)
    result = Plan(model=facts, inputs=inputs)
    for stage, offload in ROW_PRESETS:
        if inputs.offload is not None and offload != inputs.offload:
            continue
        zero = _preset_zero(stage, offload, bucket, facts.hidden_size)
        threshold = int(zero.get("stage3_param_persistence_threshold", 0)) if stage == 3 else 0
        states_offload = "params" if offload == "nvme" else offload  # NVMe takes what host RAM would hold
        device, host = parallel_model_states(
            facts, stage, states_offload, layout, inputs.precision, inputs.lora_rank, threshold
        )
        after_step, _ = parallel_model_states(
            facts, stage, states_offload, layout, inputs.precision, inputs.lora_rank, threshold, grads_alive=False
        )
        disk = host if offload == "nvme" else 0.0
        host -= disk
        if inputs.lora_rank or not layout.trivial:  # DeepSpeed's estimators know no LoRA, TP, PP or EP
            ds_gpu, ds_cpu = None, None
        else:
            ds_gpu, ds_cpu = deepspeed_estimate(
                facts.num_params, largest, stage, states_offload, inputs.gpus_per_node, inputs.nodes
            )
            if offload == "nvme":  # DeepSpeed's estimator has no NVMe case: its GPU figure holds, its CPU one not
                ds_cpu = None
        sharded = facts.num_params - persistent_params(facts, threshold)
        if not layout.trivial:
            sharded = int(sum(rank_params(facts, layout))) - persistent_params(facts, threshold) // layout.pipeline
        buffers = buffer_bytes(stage, zero, inputs.precision, largest, bucket, sharded)
        host_node = host * inputs.gpus_per_node
        snapshot, snapshot_node = _async_snapshot(facts, stage, inputs) if inputs.async_save else (0.0, 0.0)
        host_node += snapshot_node
        host_ok = inputs.host_memory_bytes is None or host_node <= inputs.host_memory_bytes
        total = None if act_none is None else device + buffers + act_none
        total_ckpt = None if act_ckpt is None else device + buffers + act_ckpt
        base = device + buffers
        if total is not None:
            fits_with = "none" if total <= usable else (ac if total_ckpt is not None and total_ckpt <= usable else None)
        else:  # activations unknown: model states and buffers only
            fits_with = "unknown activations" if base <= usable else None
        refusal = stage_refusal(facts, layout, stage)  # e.g. DeepSpeed's pipeline engine: ZeRO 0-1 only
        fits = fits_with is not None and host_ok and refusal is None
        note = ""
        if not host_ok:
            note = f"host RAM: needs {fmt_gb(host_node)} per node"
        if refusal:
            note = refusal
        result.rows.append(
            Row(
                stage=stage,
                offload=offload,
                preset=ROW_PRESETS[(stage, offload)],
                model_states_bytes=device,
                model_states_after_step_bytes=after_step,
                model_states_host_bytes=host,
                deepspeed_estimate_bytes=ds_gpu,
                deepspeed_host_estimate_bytes=ds_cpu,
                activations_bytes=act_none,
                activations_checkpointed_bytes=act_ckpt,
                buffers_bytes=buffers,
                persistent_params=persistent_params(facts, threshold),
                host_ram_per_node_bytes=host_node,
                total_bytes=total,
                total_checkpointed_bytes=total_ckpt,
                fits=fits,
                fits_with=fits_with if fits else None,
                note=note,
                model_states_disk_bytes=disk,
                async_snapshot_bytes=snapshot,
                **_offload_time(facts, stage, offload, inputs),
            )
        )
        row = result.rows[-1]
        if inputs.network is not None:
            row.network = row_network(facts, inputs, inputs.network, stage, zero)
        if host_ok and refusal is None:
            row.longest_seq_len = longest_sequence(facts, inputs, base, sp)
            row.longest_seq_len_without_sp = longest_sequence(facts, inputs, base, 1) if sp > 1 else row.longest_seq_len
    result.fsdp2_rows = fsdp2_rows(facts, inputs, result.rows, act_none, act_ckpt)
    result.recommendation = recommend(result)
    result.recommendation = network_recommendation(result, recommend, plan, _rung_name)
    return result


def fsdp2_rows(
    facts: ModelFacts, inputs: PlanInputs, zero_rows: list[Row], act_none: float | None, act_ckpt: float | None
) -> list[Fsdp2Row]:
    """The FSDP2 presets' rows, each beside its ZeRO counterpart's, for plain data parallelism without offload
    or LoRA (what the FSDP2 presets run); none otherwise. Activations are the ZeRO rows' (the same model and batch).
    """
    if not inputs.layout.trivial or inputs.lora_rank or inputs.offload not in (None, "none"):
        return []
    usable = USABLE_FRACTION * inputs.device_memory_bytes
    zero = {r.preset: r for r in zero_rows if r.offload == "none"}
    rows = []
    for name in FSDP2_PRESET_NAMES:
        spec = get_fsdp2_preset(name)
        memory = fsdp2_memory(facts, inputs.world_size, inputs.precision, spec["reshard_after_forward"])
        base = memory.model_states + memory.buffers
        total = None if act_none is None else base + act_none
        total_ckpt = None if act_ckpt is None else base + act_ckpt
        if total is None:
            fits_with = "unknown activations" if base <= usable else None
        else:
            ac = inputs.activation_checkpointing
            fits_with = "none" if total <= usable else (ac if total_ckpt is not None and total_ckpt <= usable else None)
        counterpart = zero.get(spec["counterpart"])
        rows.append(
            Fsdp2Row(
                preset=name,
                counterpart=spec["counterpart"],
                model_states_bytes=memory.model_states,
                model_states_after_step_bytes=memory.model_states_after_step,
                gathered_bytes=memory.gathered,
                buffers_bytes=memory.buffers,
                total_bytes=total,
                total_checkpointed_bytes=total_ckpt,
                fits=fits_with is not None,
                fits_with=fits_with,
                counterpart_model_states_bytes=counterpart.model_states_bytes if counterpart else None,
                counterpart_buffers_bytes=counterpart.buffers_bytes if counterpart else None,
            )
        )
    return rows


def recommend(result: Plan, accept: Callable[[Row], bool] | None = None) -> dict[str, Any]:
    """The first rung of the ladder that fits (and that ``accept`` takes), with the reason.

    Order: stages 0, 1, 2, 3 without offload and without activation checkpointing; then the same with
    checkpointing (compute traded for memory); then stage 2 + optimizer offload (the first offload
    to try), stage 3 + optimizer offload, stage 3 + parameter offload: offload last.
    """
    rows = {(r.stage, r.offload): r for r in result.rows}
    usable = USABLE_FRACTION * result.inputs.device_memory_bytes
    ac = result.inputs.activation_checkpointing
    passes = [("none", [k for k in LADDER if k[1] == "none"])]
    if ac != "none":
        passes.append((ac, [k for k in LADDER if k[1] == "none"]))
    passes.append(("offload", [k for k in LADDER if k[1] != "none"]))
    for mode, keys in passes:
        for key in keys:
            row = rows.get(key)
            if row is None or not row.fits or (accept is not None and not accept(row)):
                continue
            if mode == "none" and row.fits_with not in ("none", "unknown activations"):
                continue
            return _recommendation(row, result, usable, ac)
    return {
        "stage": None,
        "offload": None,
        "preset": None,
        "activation_checkpointing": None,
        "reason": (
            f"nothing fits in {fmt_gb(usable)} per device ({int(USABLE_FRACTION * 100)} % of "
            f"{fmt_gb(result.inputs.device_memory_bytes)}): add devices or nodes, lower the micro batch or "
            "sequence length, or offload to NVMe (deepspeed_stage_3_offload_nvme)"
            + (
                "; rows short of host RAM per node are marked (host/node)"
                if any(r.note.startswith("host RAM") for r in result.rows)
                else ""
            )
        ),
    }


_RUNG_WHY = {
    (0, "none"): "plain data parallelism: no sharding, DDP's communication",
    (1, "none"): "stage 1 shards optimizer states (DeepSpeed 0.19: a gradient all-reduce a step, then an all-gather "
    "of the updated parameters, 1.5x DDP's bytes)",
    (2, "none"): "stage 2 also shards gradients (DeepSpeed 0.19 all-reduces each gradient bucket every micro-batch and "
    "keeps its part: with accumulation more bytes than stage 1; a published GPU ladder measured 0.97x of stage 1)",
    (3, "none"): "stage 3 shards parameters too (all-gathers before forward and backward, a reduce-scatter of the "
    "gradients, every micro-batch; a published GPU ladder measured 0.92x)",
    (1, "optimizer"): "stage 1 with optimizer states in host RAM",
    (2, "optimizer"): "optimizer states in host RAM, the first offload to try (12 B/param leave the device)",
    (3, "optimizer"): "stage 3 with optimizer states in host RAM",
    (3, "params"): "parameters in host RAM too: expect about 0.70x throughput; raise the batch to amortise PCIe",
    (3, "nvme"): "parameters and optimizer states on NVMe (ZeRO-Infinity): host RAM holds buffers only, and the "
    "disk's bandwidth sets the step time (the offload time column)",
}


def _rung_name(row: Row) -> str:
    return f"stage {row.stage}" + (f" + {row.offload} offload" if row.offload != "none" else "")


def _rung_need(row: Row, ac: str) -> str:
    if row.total_bytes is None:
        return f"{fmt_gb(row.model_states_bytes + row.buffers_bytes)} before activations"
    text = fmt_gb(row.total_bytes)
    if row.total_checkpointed_bytes is not None and ac != "none":
        text += f" ({fmt_gb(row.total_checkpointed_bytes)} with {ac} checkpointing)"
    return text


def _recommendation(row: Row, result: Plan, usable: float, ac: str) -> dict[str, Any]:
    checkpointing = "none" if row.fits_with in ("none", "unknown activations") else ac
    total = row.total_bytes if checkpointing == "none" else row.total_checkpointed_bytes
    used = total if total is not None else row.model_states_bytes + row.buffers_bytes
    rows = {(r.stage, r.offload): r for r in result.rows}
    skipped = []
    for key in LADDER:
        if key == (row.stage, row.offload):
            break
        lower = rows.get(key)
        if lower is not None:
            text = f"{_rung_name(lower)} needs {_rung_need(lower, ac)}"
            passed_for_network = lower.fits_with in ("none", "unknown activations") or checkpointing != "none"
            if lower.fits and passed_for_network and lower.network and not lower.network["within_max_share"]:
                text += " (fits, but its communication is over the bar)"
            skipped.append(text + (f", {lower.note}" if lower.note else ""))
    reason = f"{_rung_name(row)} fits in {fmt_gb(used)}"
    if checkpointing != "none":
        reason += f" with {checkpointing!r} activation checkpointing (the lower rungs do not fit without it)"
    elif row.total_bytes is not None:
        reason += " without activation checkpointing"
    reason += f": {_RUNG_WHY[(row.stage, row.offload)]}"
    if skipped:
        reason = "; ".join(skipped) + f" — over the {fmt_gb(usable)} usable; " + reason
    return {
        "stage": row.stage,
        "offload": row.offload,
        "preset": row.preset,
        "activation_checkpointing": checkpointing,
        "per_rank_bytes": used,
        "reason": reason,
    }


# --- output -------------------------------------------------------------------------------------------


def format_plan(result: Plan) -> str:
    """The human table: one line per (stage, offload), GB = 1e9 bytes as memory tables quote it."""
    inp, facts = result.inputs, result.model
    ac = inp.activation_checkpointing
    lines = [
        f"model: {facts.num_params / 1e9:.3g}B parameters — {facts.source}",
        f"run: {inp.gpus_per_node} device(s) x {inp.nodes} node(s) = {inp.world_size} ranks, {inp.precision}, "
        + (f"seq {inp.seq_len}, {inp.attention} attention, " if facts.architecture == "transformer" else "")
        + f"micro batch {inp.micro_batch_size}"
        + (f", LoRA rank {inp.lora_rank}" if inp.lora_rank else ""),
        f"device memory: {fmt_gb(inp.device_memory_bytes)} ({inp.device_memory_label}); a plan fits in "
        f"{int(USABLE_FRACTION * 100)} % of it",
    ]
    if not inp.layout.trivial:
        lines += _layout_lines(result)
    if inp.sequence_parallel > 1:
        lines += _sequence_lines(result)
    if facts.architecture != "transformer":
        lines.append(
            f"activations: not estimated for {facts.architecture} (the formula is a transformer's): "
            "fits counts model states and buffers only; measure with zero-recipes probe"
        )
    lines.append("")
    header = (
        f"{'stage':>5}  {'offload':<9}  {'guide states':>12}  {'DeepSpeed est.':>14}  {'activations':>11}  "
        f"{'act. ' + ac:>16}  {'buffers <=':>10}  {'host/node':>10}  {'offload s/step >=':>17}  "
        + (f"{'comm s share/exp.':>17}  " if inp.network else "")
        + "fits"
    )
    lines += [header, "-" * len(header)]
    for r in result.rows:
        fits = "does not fit"
        if r.fits:
            fits = {"none": "fits", "unknown activations": "fits (before activations)"}.get(
                r.fits_with or "", f"fits with {r.fits_with}"
            )
        if r.note:
            fits += f" ({r.note})"
        lines.append(
            f"{r.stage:>5}  {r.offload:<9}  {fmt_gb(r.model_states_bytes):>12}  "
            f"{fmt_gb(r.deepspeed_estimate_bytes):>14}  {fmt_gb(r.activations_bytes):>11}  "
            f"{fmt_gb(r.activations_checkpointed_bytes):>16}  {fmt_gb(r.buffers_bytes):>10}  "
            f"{fmt_gb(r.host_ram_per_node_bytes):>10}  {_fmt_floor(r):>17}  "
            + (f"{fmt_comm(r):>17}  " if inp.network else "")
            + fits
        )
    rec = result.recommendation
    lines += _fsdp2_lines(result)
    lines += [
        "",
        "guide states: ZeRO's formula per rank, gradients alive — 16K / 4K+12K/N / 2K+14K/N / 16K/N (+ whole copies",
        "  of stage-3 persistent params), offloaded terms moved to host. DeepSpeed est.: estimate_zero{2,3}_model_",
        "  states_mem_needs (18 B/param sharded + largest layer; none for stages 0-1). activations: bytes saved for",
        "  backward at their peak, counted per op for this attention (eager adds the a*s*s softmax; sdpa/flash keep",
        "  a log-sum-exp); checked against autograd (bench/activations.py). buffers <=: an upper bound: overlap_comm",
        "  ~4.5 x buckets; stage 3 reduce bucket + parameters kept gathered (<= stage3_max_live_parameters).",
        "offload s/step >=: bytes one optimizer step moves over each offload link / its bandwidth, the slowest",
        "  link named: a floor if transfers overlap compute. PCIe per device, DRAM and NVMe shared by a node's ranks;",
        f"  {_fmt_bandwidths(inp)}.",
        "  --bandwidth LINK=GB/s sets a measured one (bench/nvme_io.py measures the disk); --offload X shows the sums.",
        "",
    ]
    if inp.async_save:
        lines[-1:-1] = _async_lines(result)
    if inp.network:
        lines[-1:-1] = network_lines(result, _rung_name)
    if inp.sequence_parallel > 1:
        lines += longest_lines(result) + [""]
    if inp.offload not in (None, "none"):
        lines += _traffic_sums(result) + [""]
    recommended = (
        f"recommended: {rec['preset'] or 'none'}"
        + (
            f" (stage {rec['stage']}, offload {rec['offload']}, "
            f"activation_checkpointing {rec['activation_checkpointing']})"
            if rec.get("preset")
            else ""
        )
        + f" — {rec['reason']}"
    )
    lines += textwrap.wrap(recommended, width=len(header), subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(lines)


def _fsdp2_lines(result: Plan) -> list[str]:
    """The FSDP2 presets beside their ZeRO counterparts (not on the ladder: the recommendation is ZeRO's)."""
    if not result.fsdp2_rows:
        return []
    ac = result.inputs.activation_checkpointing
    header = (
        f"{'FSDP2 preset':<14}  {'states':>10}  {'after step':>10}  {'gathered':>10}  {'buffers <=':>10}  "
        f"{'total':>10}  {'total ' + ac:>16}  {'ZeRO counterpart: states + buffers':<40}  fits"
    )
    lines = ["", header, "-" * len(header)]
    for r in result.fsdp2_rows:
        zero = "-"
        if r.counterpart_model_states_bytes is not None:
            zero_bytes = f"{fmt_gb(r.counterpart_model_states_bytes)} + {fmt_gb(r.counterpart_buffers_bytes)}"
            zero = f"{r.counterpart}: {zero_bytes}"
        fits = "does not fit"
        if r.fits:
            fits = {"none": "fits", "unknown activations": "fits (before activations)"}.get(
                r.fits_with or "", f"fits with {r.fits_with}"
            )
        lines.append(
            f"{r.preset:<14}  {fmt_gb(r.model_states_bytes):>10}  {fmt_gb(r.model_states_after_step_bytes):>10}  "
            f"{fmt_gb(r.gathered_bytes):>10}  {fmt_gb(r.buffers_bytes):>10}  {fmt_gb(r.total_bytes):>10}  "
            f"{fmt_gb(r.total_checkpointed_bytes):>16}  {zero:<40}  {fits}"
        )
    text = (
        "FSDP2 (torch's fully_shard, the fsdp2 presets): 16K/N sharded at any precision (fp32 parameters are the "
        "master weights, fp32 gradients, Adam's moments) + gathered working copies held from forward to backward "
        "(fsdp2: the root unit's; fsdp2_grad_op: the whole model's). buffers <=: the next block's all-gather "
        "(fsdp2) and one unit's reduce-scatter in fp32. after step: gradients freed."
    )
    return lines + textwrap.wrap(text, width=110, subsequent_indent="  ")


def _async_lines(result: Plan) -> list[str]:
    """The async_save term of host/node: what each rank's snapshot copies, per row without offload."""
    shown = ", ".join(f"stage {r.stage} {fmt_gb(r.async_snapshot_bytes)}" for r in result.rows if r.offload == "none")
    text = (
        "async_save: host/node includes each rank's host copy of its checkpoint share (optimizer partition 12 B x "
        "trainable / N; stages 0-2: + the module on each data-parallel group's first rank); the largest rank's: "
        + shown
    )
    return textwrap.wrap(text, width=110, subsequent_indent="  ")


def _layout_lines(result: Plan) -> list[str]:
    """What a rank holds under tensor, pipeline and expert parallelism, and how the columns change with it."""
    layout, facts = result.inputs.layout, result.model
    dense, experts = rank_params(facts, layout)
    lines = [
        f"parallel: tensor {layout.tensor} x pipeline {layout.pipeline} x data {layout.data_parallel}"
        + (
            f", experts over {layout.expert} ranks (expert data-parallel {layout.expert_data_parallel})"
            if layout.expert > 1
            else ""
        )
        + f"; a rank holds {dense / 1e9:.4g}B dense"
        + (f" + {experts / 1e9:.4g}B expert" if facts.expert_params else "")
        + " parameters",
        "  model states: the ZeRO formula on the rank's parameters with N = data-parallel ranks (experts: N = "
        "DP / EP); DeepSpeed est.: n/a (its estimators know no TP, PP or EP)",
    ]
    if layout.pipeline > 1:
        lines.append(
            f"  activations: the first of {layout.pipeline} stages under 1F1B, {layout.pipeline} micro-batches in "
            f"flight through {(facts.num_layers or 0) // layout.pipeline} blocks; ZeRO 2-3 rows cannot run "
            "(DeepSpeed's pipeline engine: ZeRO 0-1 only)"
        )
    indent = {True: "    ", False: "  "}  # continuation lines sit under their own line's text
    return [part for line in lines for part in textwrap.wrap(line, width=118, subsequent_indent=indent[line[0] == " "])]


def _sequence_lines(result: Plan) -> list[str]:
    """What a rank holds under Ulysses sequence parallelism, and how the columns change with it."""
    inp, layout = result.inputs, result.inputs.layout
    sp = layout.sequence
    lines = [
        f"sequence parallel: {sp} ranks split each sequence (Ulysses): a rank holds {inp.seq_len // sp:,} of "
        f"{inp.seq_len:,} tokens, and heads / {sp} of attention over the whole sequence; data-parallel degree "
        f"{layout.data_parallel} (= {inp.world_size} ranks / (TP {layout.tensor} x PP {layout.pipeline} x SP {sp})), "
        f"global batch = micro batch x grad_accum x {layout.data_parallel}",
        f"  model states: ZeRO partitions over the SP ranks too (DeepSpeed's sequence-data-parallel group): N = "
        f"{layout.zero_ranks}; activations: the rank's slice of the sequence (all-to-all in each attention layer)",
    ]
    indent = {True: "    ", False: "  "}
    return [part for line in lines for part in textwrap.wrap(line, width=118, subsequent_indent=indent[line[0] == " "])]


def _fmt_seconds(low: float, high: float) -> str:
    digits = 2 if high < 10 else 1 if high < 100 else 0
    return f"{low:.{digits}f}" if round(low, digits) == round(high, digits) else f"{low:.{digits}f}-{high:.{digits}f}"


def _fmt_floor(row: Row) -> str:
    """``0.44-0.88 pcie``: the slowest offload link's seconds per optimizer step (``-`` without offload)."""
    if row.offload_seconds is None:
        return "-"
    return f"{_fmt_seconds(*row.offload_seconds)} {row.slowest_link}"


def _fmt_rate(low: float, high: float) -> str:
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


def _fmt_bandwidths(inputs: PlanInputs) -> str:
    typical = all(inputs.bandwidth_gbps[link] == GUIDE_BANDWIDTH_GBPS[link] for link in LINKS)
    shown = ", ".join(f"{link} {_fmt_rate(*inputs.bandwidth_gbps[link])} GB/s" for link in ("pcie", "dram", "nvme"))
    return ("typical bandwidths: " if typical else "bandwidths: ") + shown


def _traffic_sums(result: Plan) -> list[str]:
    """Per offload row, each link's bytes term by term and the seconds they take: the time column's sums."""
    inp = result.inputs
    lines = [f"bytes moved per optimizer step (one micro-batch a step; {inp.gpus_per_node} ranks a node):"]
    for row in result.rows:
        if not row.bytes_moved_per_step:
            continue
        lines.append(f"  stage {row.stage} + {row.offload} offload:")
        for link, terms in row.bytes_moved_per_step.items():
            per_rank = sum(terms.values())
            total = f"{fmt_gb(per_rank)} per rank"
            if link in NODE_SHARED_LINKS and inp.gpus_per_node > 1:
                total += f" x {inp.gpus_per_node} ranks = {fmt_gb(per_rank * inp.gpus_per_node)}"
            rate, seconds = _fmt_rate(*inp.bandwidth_gbps[link]), _fmt_seconds(*row.link_seconds[link])
            lines.append(f"    {link}: {total} / {rate} GB/s = {seconds} s")
            lines += [f"      {fmt_gb(n):>9}  {what}" for what, n in terms.items()]
    return lines


def to_json_text(result: Plan) -> str:
    """``--json`` output."""
    return json.dumps(
        result.to_json(), indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o
    )


# --- the `zero-recipes estimate` command ----------------------------------------------------------------


def register(sub: Any) -> None:
    """Add ``zero-recipes estimate`` to the CLI's subparsers."""
    p = sub.add_parser(
        "estimate",
        help="plan memory per ZeRO stage and offload variant (ZeRO formula, DeepSpeed's estimator, activations)",
        description="Per-rank memory of ZeRO stages 0-3 and offload variants, and the recommended stage. "
        "Example: zero-recipes estimate --params 7e9 --gpus 8 --gpu-memory 80GB",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="parameter count, e.g. 7e9 or 7B (a Llama-like shape is assumed)")
    src.add_argument("--model-config", help="a Hugging Face config.json (parameters counted exactly)")
    src.add_argument(
        "--recipe", help="a recipe name (zero-recipes ls) or a copy's folder: its model, batch and devices"
    )
    p.add_argument("--config", help="with --recipe: the recipe's YAML config (default: the recipe's own)")
    p.add_argument("--gpus", type=int, default=None, help="devices per node (default 1, or the recipe's)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default 1, or the recipe's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 2048, or the recipe's)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="samples per rank (default 1, or the recipe's)")
    p.add_argument(
        "--activation-checkpointing",
        default=None,
        help="none|full|every_k|selective|save_memory_optimized: the checkpointed-activations column "
        "(default full, or the recipe's when not none)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default=None,
        help="attention implementation: eager saves the s x s scores, sdpa/flash_attention_2 do not "
        "(default sdpa, or the recipe's; auto = flash or sdpa)",
    )
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank: frozen base + adapters on projections")
    p.add_argument("--offload", choices=OFFLOADS, default=None, help="show only this offload variant (default: all)")
    p.add_argument("--precision", choices=tuple(WORKING_BYTES), default=None, help="default bf16, or the recipe's")
    p.add_argument("--gpu-memory", default=None, help="memory per device, e.g. 80GB (default: the local device's)")
    p.add_argument(
        "--host-memory",
        default=None,
        help="host RAM per node for offload rows (default: this machine's when --gpu-memory is not given)",
    )
    p.add_argument(
        "--bucket-size", default=None, help="reduce/all-gather bucket elements (default: scaled like presets)"
    )
    p.add_argument(
        "--bandwidth",
        action="append",
        metavar="LINK=GB/S",
        help="a measured bandwidth for the offload time column, e.g. nvme=3.2 (links: hbm, dram, pcie, nvme; "
        "default: typical ranges)",
    )
    p.add_argument(
        "--tensor-parallel", type=int, default=1, help="TP: ranks splitting each matrix (Megatron / AutoTP; default 1)"
    )
    p.add_argument(
        "--pipeline-parallel", type=int, default=1, help="PP: pipeline stages (DeepSpeed PipelineModule; default 1)"
    )
    p.add_argument(
        "--expert-parallel",
        type=int,
        default=None,
        help="EP: ranks splitting a MoE layer's experts (default 1, or the recipe's expert_parallel)",
    )
    p.add_argument(
        "--sequence-parallel",
        type=int,
        default=None,
        help="SP: ranks splitting each sequence (DeepSpeed Ulysses); must divide the heads and --seq-len "
        "(default 1, or the recipe's sequence_parallel)",
    )
    p.add_argument(
        "--async-save",
        action="store_true",
        default=None,
        help="asynchronous checkpoints: count each rank's host copy of its checkpoint share in host/node "
        "(default: the recipe's async_save)",
    )
    add_arguments(p)  # --network, --bandwidth-from and the compute they are weighed against
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_estimate)


def _recipe_inputs(args: Any) -> tuple[ModelFacts, dict[str, Any]]:
    """The model facts and run defaults of a recipe's config, from the recipe's ``--describe``."""
    run = describe(args.recipe, args.config)
    cfg = run.config
    defaults = {
        "gpus_per_node": run.devices_per_node,
        "nodes": run.num_nodes,
        "seq_len": run.seq_len,
        "micro_batch_size": run.micro_batch_size,
        "precision": cfg.get("precision"),
        "attention": cfg.get("attention"),
        "lora_rank": cfg.get("lora_rank") if cfg.get("lora", True) else None,
        "expert_parallel": cfg.get("expert_parallel"),
        "sequence_parallel": cfg.get("sequence_parallel"),
        "parallel_components": run.parallel_components,
        "async_save": cfg.get("async_save"),
    }
    ac = cfg.get("activation_checkpointing", "none")
    if ac and ac != "none":
        defaults["activation_checkpointing"] = ac
    return run.model, {k: v for k, v in defaults.items() if v is not None}


def cmd_estimate(args: Any) -> int:
    """``zero-recipes estimate``: print the plan table (or JSON)."""
    if args.activation_checkpointing is not None:
        check_preset(args.activation_checkpointing)
    if args.config and not args.recipe:
        raise ConfigError("--config goes with --recipe (a recipe's YAML); for a Hugging Face config use --model-config")
    if args.offload == "none":  # the rows without offload read neither
        refuse_outside_mode(
            args, {"host_memory": "--host-memory", "bandwidth": "--bandwidth"}, "the offload rows", "--offload none"
        )
    recipe_defaults: dict[str, Any] = {}
    if args.params:
        facts = assumed_transformer(parse_count(args.params))
    elif args.model_config:
        facts = facts_from_hf_config(args.model_config)
    else:
        facts, recipe_defaults = _recipe_inputs(args)
    for name in ("gpus", "nodes", "seq_len", "micro_batch_size", "lora_rank"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    gpus = args.gpus or recipe_defaults.get("gpus_per_node", 1)
    nodes = args.nodes or recipe_defaults.get("nodes", 1)
    if args.gpu_memory:
        device_memory, label = parse_bytes(args.gpu_memory), "--gpu-memory"
    else:
        device_memory, label = local_device_memory(gpus)
    if args.host_memory:
        host: float | None = parse_bytes(args.host_memory)
    else:
        host = None if args.gpu_memory else host_memory()
    inputs = PlanInputs(
        gpus_per_node=gpus,
        nodes=nodes,
        seq_len=args.seq_len or recipe_defaults.get("seq_len", 2048),
        micro_batch_size=args.micro_batch_size or recipe_defaults.get("micro_batch_size", 1),
        activation_checkpointing=args.activation_checkpointing
        or recipe_defaults.get("activation_checkpointing", "full"),
        attention=args.attention or recipe_defaults.get("attention", "sdpa"),
        lora_rank=args.lora_rank or recipe_defaults.get("lora_rank"),
        offload=args.offload,
        precision=args.precision or recipe_defaults.get("precision", "bf16"),
        device_memory_bytes=device_memory,
        device_memory_label=label,
        host_memory_bytes=host,
        bucket_elements=parse_count(args.bucket_size) if args.bucket_size else None,
        bandwidth_gbps=parse_bandwidths(args.bandwidth),
        tensor_parallel=args.tensor_parallel,
        pipeline_parallel=args.pipeline_parallel,
        expert_parallel=recipe_defaults.get("expert_parallel", 1)
        if args.expert_parallel is None
        else args.expert_parallel,
        sequence_parallel=recipe_defaults.get("sequence_parallel", 1)
        if args.sequence_parallel is None
        else args.sequence_parallel,
        parallel_components=recipe_defaults.get("parallel_components", "any"),
        async_save=bool(args.async_save or recipe_defaults.get("async_save", False)),
        network=network_from_args(args, gpus * nodes, nodes),
    )
    result = plan(facts, inputs)
    print(to_json_text(result) if args.json else format_plan(result))
    return 0
