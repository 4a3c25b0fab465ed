"""The network half of choosing a stage: bytes each rank sends per optimizer step, and the seconds they take.

Pure arithmetic, no DeepSpeed, no torch. :func:`plan_communication` lists every collective one rank takes part in
during one optimizer step, as DeepSpeed 0.19 schedules it (read from its sources and checked against its own
communication log, ``comms_logger``, by ``bench/communication.py``):

- stage 0 and 1: one all-reduce of every gradient per optimizer step, at the gradient-accumulation boundary
  (``engine.allreduce_gradients``); stage 1 then all-gathers the updated 16-bit parameters (each rank's partition);
- stage 2: the gradients are reduced every micro-batch, as each bucket fills in the backward pass. DeepSpeed's
  "reduce_scatter" is an all-reduce of the whole bucket of which each rank keeps its part
  (``use_multi_rank_bucket_allreduce``, on by default), then the same all-gather after the step;
- stage 3: every micro-batch all-gathers each sharded parameter before its forward pass, all-gathers again in the
  backward pass the parameters it released in between, and reduce-scatters every gradient. Which are released is
  DeepSpeed's parameter coordinator's decision, replayed here over the module trace (:func:`stage3_gathers`): a
  parameter stays gathered when its next use lies within ``stage3_max_reuse_distance`` elements of the trace (with the
  default 1e9 a model under about 1e9 parameters keeps them all), or when the prefetch, which gathers up to
  ``stage3_max_live_parameters`` elements ahead of compute, has already passed its backward use. Parameters of at most
  ``stage3_param_persistence_threshold`` elements are not gathered for compute (they stay whole on every rank) but
  their gradients are reduce-scattered like the rest, and after the step each rank's updated partition of them is
  all-gathered once. hpZ (``zero_hpz_partition_size``) gathers the backward pass's parameters from a
  second copy sharded inside the node; qwZ (``zero_quantized_weights``) sends int8 weights in the forward all-gather
  and qgZ (``zero_quantized_gradients``) replaces the reduce-scatter by an int4 all-to-all;
- tensor parallelism (AutoTP) all-reduces activations, sequence parallelism (Ulysses) sends queries, keys, values and
  the attention output through all-to-alls, expert parallelism (DeepSpeed MoE) sends tokens to their experts and
  back through all-to-alls: those scale with the tokens of a micro-batch, not with the parameters.

Bytes are counted two ways. ``message_bytes`` is what DeepSpeed's ``comms_logger`` records for a call: the bytes of
the tensor it passes in (``deepspeed.comm.utils.get_msg_size_from_args``): the whole buffer for an all-reduce and a
reduce-scatter, this rank's shard for an all-gather, its whole input for an all-to-all. ``sent_bytes`` is what the
rank puts on the wire with ring algorithms: nccl-tests' "bus" convention, (n - 1) / n of the whole buffer for a
reduce-scatter, an all-gather or an all-to-all and twice that for an all-reduce. A bus bandwidth (what ``zero-recipes
doctor --collectives`` measures, as nccl-tests do) divides ``sent_bytes`` into seconds: the bandwidth measured in the
dtype the transfer moves (``Transfer.dtype``), since a backend may reduce one dtype slower than another per byte
(gloo's bf16 all-reduce on a CPU is slower than its fp32 one).
"""

from __future__ import annotations

import bisect
import math
import re
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from common.errors import ConfigError, nearest
from common.memory_formulas import WORKING_BYTES, ModelFacts
from common.parallel import ParallelLayout, rank_params

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "point_to_point")
SCOPES = ("intra_node", "inter_node")

# DeepSpeed's defaults for the stage-3 schedule (deepspeed/runtime/zero/config.py).
DS_MAX_REUSE_DISTANCE = 1_000_000_000
DS_BUCKET_ELEMENTS = 500_000_000
DS_PREFETCH_ELEMENTS = 50_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000

FP32_BYTES = 4
INT8_BYTES = 1
INT4_BYTES = 0.5

# Transfers that run after the optimizer step, when no compute is left to hide them under.
AFTER_STEP = "updated parameters after the step (each rank's partition)"
EXPERTS_AFTER_STEP = "updated expert parameters after the step"
PERSISTENT_AFTER_STEP = "persistent parameters gathered whole again after the step"

# ``doctor --collectives`` measures fp32, bf16 and fp16 buffers; a transfer of another dtype (qwZ's int8, qgZ's int4) or
# of one not measured is priced at a measured dtype of its width, else at fp32's (doctor's first and oldest rows).
SAME_WIDTH = {"bf16": "fp16", "fp16": "bf16"}

# nccl-tests' bus factor: the share of the whole buffer each rank sends with ring algorithms (doctor's figures too).
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "point_to_point": lambda n: 1.0,
}


@dataclass(frozen=True)
class Transfer:
    """One kind of call in an optimizer step, as one rank takes part in it.

    Attributes:
        collective: one of :data:`COLLECTIVES`.
        purpose: what it carries and when, in words (``gradients, every micro-batch``).
        message_bytes: the calls' message sizes summed over the step, in DeepSpeed's ``comms_logger`` convention (the
            tensor passed in: the whole buffer of an all-reduce or reduce-scatter, this rank's shard of an all-gather).
        calls: calls per optimizer step.
        group_size: ranks in the collective's group.
        scope: ``intra_node`` when the group lies inside one node, else ``inter_node``.
        dtype: what its buffer holds (``bf16``, ``fp16``, ``fp32``, ``int8``, ``int4``): the measured bandwidth that
            prices it (:func:`link_for`).
    """

    collective: str
    purpose: str
    message_bytes: float
    calls: int
    group_size: int
    scope: str
    dtype: str = "fp32"

    @property
    def buffer_bytes(self) -> float:
        """nccl-tests' data size: the whole buffer (an all-gather's output: its shard times the group size)."""
        return self.message_bytes * (self.group_size if self.collective == "all_gather" else 1)

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends with ring algorithms: the buffer times nccl-tests' bus factor."""
        if self.group_size <= 1:
            return 0.0
        return self.buffer_bytes * BUS_FACTOR[self.collective](self.group_size)


@dataclass(frozen=True)
class CommPlan:
    """Every transfer of one rank in one optimizer step (:func:`plan_communication`)."""

    transfers: tuple[Transfer, ...]

    def message_bytes(self, collective: str | None = None) -> float:
        """DeepSpeed-logged bytes per step, of one collective or of all."""
        return sum(t.message_bytes for t in self.transfers if collective in (None, t.collective))

    def sent_bytes(self, scope: str | None = None) -> float:
        """Bytes this rank sends per step, over one scope (``intra_node`` / ``inter_node``) or both."""
        return sum(t.sent_bytes for t in self.transfers if scope in (None, t.scope))

    def calls(self, collective: str | None = None) -> int:
        """Calls per step, of one collective or of all."""
        return sum(t.calls for t in self.transfers if collective in (None, t.collective))

    def by_collective(self) -> dict[str, float]:
        """DeepSpeed-logged bytes per step for each collective that occurs."""
        return {c: self.message_bytes(c) for c in COLLECTIVES if any(t.collective == c for t in self.transfers)}


@dataclass(frozen=True)
class CommSetup:
    """What decides the collectives besides the model and the layout: the ZeRO config and the batch.

    Attributes:
        stage: ZeRO stage 0-3.
        precision: ``bf16``, ``fp16`` or ``fp32``: the working copy's bytes (parameters gathered, gradients reduced).
        grad_accum: micro-batches per optimizer step.
        offload: ``none``, ``optimizer``, ``params`` or ``nvme``: where partitions live; it moves no collective byte
            (the partition is copied to the device before it is sent), listed so that callers need not drop it.
        persistence_threshold: ``stage3_param_persistence_threshold``: parameters of at most this many elements stay
            whole on every rank and are never gathered.
        max_reuse_distance: ``stage3_max_reuse_distance``, elements: a parameter used again within this many
            elements of the trace stays gathered from its forward to its backward use.
        hpz_partition_size: ``zero_hpz_partition_size``: ranks sharing hpZ's second copy (1 = off).
        quantized_weights: qwZ, int8 weights in the forward all-gather (DeepSpeed's CUDA quantizer).
        quantized_gradients: qgZ, an int4 all-to-all instead of the gradient reduce-scatter (CUDA).
        reduce_bucket_size: elements per gradient reduction (``reduce_bucket_size``): sets the calls, not the bytes.
        prefetch_bucket_size: ``stage3_prefetch_bucket_size``: stage 3 gathers this many elements per call ahead of
            use (0: one call per module, no look-ahead).
        max_live_parameters: ``stage3_max_live_parameters``: gathered elements the prefetch may hold at once (how
            far ahead it reaches, and so which parameters stay gathered for the backward pass).
        tokens_per_micro_batch: micro batch x sequence length per replica: the activations that TP, SP and EP send.
        ranks_per_node: ranks on one node (None: all on one node): which groups cross the network.
        param_groups: optimizer parameter groups (stages 1-2 all-gather each group's partition in one call).
        moe_capacity_factor: with ``moe_drop_tokens``, DeepSpeed MoE's ``capacity_factor``: every expert's slot holds
            that many times its even share of the tokens, exactly (:func:`expert_capacity`). Without, the effective
            factor: DeepSpeed pads every slot to the busiest expert's load, which follows the routing; 1.0 is perfectly
            even routing, a lower bound.
        moe_top_k: experts each token goes to.
        moe_drop_tokens: DeepSpeed MoE's ``drop_tokens``: slots of a fixed capacity (tokens beyond it are dropped), so
            the all-to-all's bytes do not depend on the routing.
        moe_min_capacity: DeepSpeed MoE's ``min_capacity``: the smallest slot with ``moe_drop_tokens``.
    """

    stage: int
    precision: str = "bf16"
    grad_accum: int = 1
    offload: str = "none"
    persistence_threshold: int = 0
    max_reuse_distance: float = DS_MAX_REUSE_DISTANCE
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False
    reduce_bucket_size: float = DS_BUCKET_ELEMENTS
    prefetch_bucket_size: float = DS_PREFETCH_ELEMENTS
    max_live_parameters: float = DS_MAX_LIVE_PARAMETERS
    tokens_per_micro_batch: int = 0
    ranks_per_node: int | None = None
    param_groups: int = 1
    moe_capacity_factor: float = 1.0
    moe_top_k: int = 2
    moe_drop_tokens: bool = False
    moe_min_capacity: int = 4

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage}")
        if self.precision not in WORKING_BYTES:
            raise ConfigError(f"unknown precision {self.precision!r}{nearest(self.precision, WORKING_BYTES)}")
        for name in ("grad_accum", "hpz_partition_size", "param_groups", "moe_top_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("persistence_threshold", "max_reuse_distance", "tokens_per_micro_batch"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.reduce_bucket_size <= 0:
            raise ConfigError(f"reduce_bucket_size must be > 0, got {self.reduce_bucket_size}")


def setup_from_ds_config(
    ds_config: dict[str, Any], tokens_per_micro_batch: int = 0, ranks_per_node: int | None = None, param_groups: int = 1
) -> CommSetup:
    """The :class:`CommSetup` of a resolved DeepSpeed config (``common.strategy.resolve_deepspeed_config``'s output),
    with DeepSpeed's defaults where the config leaves a key out."""
    zero = ds_config.get("zero_optimization") or {}
    precision = "bf16" if (ds_config.get("bf16") or {}).get("enabled") else "fp32"
    if (ds_config.get("fp16") or {}).get("enabled"):
        precision = "fp16"
    param_device = (zero.get("offload_param") or {}).get("device", "none")
    optimizer_device = (zero.get("offload_optimizer") or {}).get("device", "none")
    offload = "nvme" if param_device == "nvme" else "params" if param_device == "cpu" else "none"
    if offload == "none" and optimizer_device in ("cpu", "nvme"):
        offload = "optimizer"
    return CommSetup(
        stage=int(zero.get("stage", 0)),
        precision=precision,
        grad_accum=int(ds_config.get("gradient_accumulation_steps", 1)),
        offload=offload,
        persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 100_000)),
        max_reuse_distance=float(zero.get("stage3_max_reuse_distance", DS_MAX_REUSE_DISTANCE)),
        hpz_partition_size=int(zero.get("zero_hpz_partition_size", 1)),
        quantized_weights=bool(zero.get("zero_quantized_weights", False)),
        quantized_gradients=bool(zero.get("zero_quantized_gradients", False)),
        reduce_bucket_size=float(zero.get("reduce_bucket_size", DS_BUCKET_ELEMENTS)),
        prefetch_bucket_size=float(zero.get("stage3_prefetch_bucket_size", DS_PREFETCH_ELEMENTS)),
        max_live_parameters=float(zero.get("stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS)),
        tokens_per_micro_batch=tokens_per_micro_batch,
        ranks_per_node=ranks_per_node,
        param_groups=param_groups,
    )


def with_recipe_moe(setup: CommSetup, recipe_config: dict[str, Any]) -> CommSetup:
    """``setup`` with the MoE routing a recipe config states: its ``moe_drop_tokens`` and ``moe_min_capacity``
    (the NLP recipe passes both to DeepSpeed's MoE layer; a config without them keeps DeepSpeed MoE as the recipe
    builds it by default: no token dropped).

    Args:
        setup: the collectives' setup from the DeepSpeed config (:func:`setup_from_ds_config`).
        recipe_config: the recipe's resolved config as a dict.

    Returns:
        The setup with ``moe_drop_tokens`` and ``moe_min_capacity`` from the recipe config.
    """
    return replace(
        setup,
        moe_drop_tokens=bool(recipe_config.get("moe_drop_tokens", False)),
        moe_min_capacity=int(recipe_config.get("moe_min_capacity", setup.moe_min_capacity)),
    )


# --- which groups cross the network -------------------------------------------------------------------------


def group_scope(group_size: int, stride: int, ranks_per_node: int | None) -> str:
    """``intra_node`` when a group of ``group_size`` ranks ``stride`` apart fits in one node, else ``inter_node``.

    The layout of DeepSpeed and Megatron: tensor-parallel ranks are neighbours (stride 1), sequence-parallel ones
    next (stride TP), data-parallel ones furthest apart (stride TP x SP), so the network is crossed first by DP.
    """
    if group_size <= 1 or ranks_per_node is None:
        return "intra_node"
    return "intra_node" if group_size * stride <= ranks_per_node else "inter_node"


# --- the parameters a stage-3 step gathers ------------------------------------------------------------------


def shard_elements(numel: int, ranks: int) -> int:
    """Elements of one rank's partition of a parameter: DeepSpeed pads each parameter to a multiple of the ranks."""
    return -(-numel // ranks)


def stage3_module_trace(param_count: int) -> tuple[tuple[int, ...], ...]:
    """The modules stage 3 fetches in one micro-batch, in order (forward, then backward), as the indices (in
    registration order) of the parameters each holds directly; ``()`` for a container, which takes a step of
    DeepSpeed's trace and holds nothing.

    A list of 3 + 9 x layers parameters is read as a ``transformers`` Llama: registered as the embedding, per layer
    q, k, v, o, gate, up, down and the two norms, then the final norm and the output layer; called as the causal LM,
    the model, the embedding, the rotary embedding, per layer the layer, its input norm, the attention (q, k, v, o),
    the post-attention norm, the MLP (gate, the activation, up, down); the final norm and the output layer. The
    backward pass fetches the modules whose outputs need a gradient (not the rotary embedding) in reverse: autograd
    on a CPU runs the ready node created last first, so a container comes before its children. Any other list is one
    module per parameter under one container.
    """
    none: tuple[int, ...] = ()
    layers, rest = divmod(param_count - 3, 9)
    if rest or layers < 1:
        forward = [none, *((i,) for i in range(param_count))]
        return (*forward, none, *((i,) for i in reversed(range(param_count))))
    norm, head = param_count - 2, param_count - 1
    forward = [none, none, (0,), none]  # the causal LM, the model, the embedding, the rotary embedding
    backward = [none, (head,), none, (norm,)]  # the causal LM, the output layer, the model, the final norm
    for layer in range(layers):
        q, k, v, o, gate, up, down, input_norm, attention_norm = range(1 + 9 * layer, 10 + 9 * layer)
        forward += [none, (input_norm,), none, (q,), (k,), (v,), (o,), (attention_norm,)]
        forward += [none, (gate,), none, (up,), (down,)]
    for layer in reversed(range(layers)):
        q, k, v, o, gate, up, down, input_norm, attention_norm = range(1 + 9 * layer, 10 + 9 * layer)
        backward += [none, none, (down,), (up,), none, (gate,), (attention_norm,)]
        backward += [none, (o,), (v,), (k,), (q,), (input_norm,)]
    return (*forward, (norm,), (head,), *backward, (0,))


def stage3_gathers(
    trace: tuple[tuple[int, ...], ...],
    numels: tuple[int, ...],
    persistent_threshold: int,
    prefetch_bucket_size: float,
    max_live_parameters: float,
    max_reuse_distance: float,
) -> list[int]:
    """How many times stage 3 all-gathers each parameter in one micro-batch: DeepSpeed's
    ``PartitionedParameterCoordinator`` replayed over a module trace (:func:`stage3_module_trace`).

    At each module of the trace, in order: its parameters not available are gathered (``fetch_sub_module``); its
    entries are popped off the parameter queue; with prefetch on, the queue is popped further while the elements it
    gathers stay under ``min(max_live_parameters - elements available, prefetch_bucket_size)``, each use it passes
    marked as fetched and each parameter not available gathered ahead; then the module's parameters are released
    (``__params_to_release``) unless a later use of theirs was marked by the prefetch, or they occur again among the
    next modules whose parameters add up to less than ``max_reuse_distance`` elements. Persistent parameters (at most
    ``persistent_threshold`` elements) are never gathered. A prefetch whose live bound holds the whole model thus
    sweeps the backward uses too and nothing is gathered twice; bounded under it, the modules it reached before the
    forward pass ended (the last ones, used first by the backward pass) stay gathered. Every micro-batch starts with
    nothing gathered, as DeepSpeed's ``reset_step`` and its release of what backward left.
    """
    persistent = [n <= persistent_threshold for n in numels]
    uses: dict[int, list[int]] = {}
    for step, module in enumerate(trace):
        for i in module:
            uses.setdefault(i, []).append(step)
    # Elements of the trace before each step: the reuse-distance window of a step is a difference of two of them.
    before = [0]
    for module in trace:
        before.append(before[-1] + sum(numels[i] for i in module))
    queue = deque((i, step) for step, module in enumerate(trace) for i in sorted(module))
    available = {i for i, kept in enumerate(persistent) if kept}
    live = 0
    marked: dict[int, int] = {}  # DeepSpeed's __most_recent_step_id_param_fetched_for
    gathers = [0] * len(numels)

    def gather(params: set[int] | tuple[int, ...]) -> None:
        nonlocal live
        for i in params:
            if i not in available:
                available.add(i)
                live += numels[i]
                gathers[i] += 1

    for step, module in enumerate(trace):
        gather(module)
        unmarked = {i for i in module if marked.get(i, -1) < step}
        popped: set[int] = set()
        while queue and len(popped) < len(unmarked):
            i, use = queue.popleft()
            marked[i] = use
            popped.add(i)
        if prefetch_bucket_size > 0:
            budget = min(max_live_parameters - live, prefetch_bucket_size)
            ahead: set[int] = set()
            elements = 0
            while queue and elements < budget:
                i, use = queue.popleft()
                marked[i] = max(marked.get(i, -1), use)
                if i not in available and i not in ahead:
                    ahead.add(i)
                    elements += numels[i]
            gather(ahead)
        now = step + 1  # the coordinator counts the fetch before the module's release
        for i in module:
            if persistent[i] or marked.get(i, -1) > now:
                continue
            later = [use for use in uses[i] if use >= now]
            if later and before[later[0]] - before[now] < max_reuse_distance:
                continue
            if i in available:
                available.discard(i)
                live -= numels[i]
    return gathers


# --- the account ---------------------------------------------------------------------------------------------


def forward_numels(facts: ModelFacts) -> tuple[int, ...]:
    """The model's parameters in forward order: ``param_numels`` when they list the matrices one by one, else a
    Llama-shaped list from the shape in registration order (embedding; per layer the attention's four matrices, the
    MLP's three and two norms; the final norm and the output layer) scaled to ``num_params``.

    ``assumed_transformer`` (a bare ``--params``) lumps every matrix into one entry, which would hide the order that
    stage 3's reuse distance reads; a lump is recognised as one entry holding over half of the parameters.
    """
    numels = facts.param_numels
    lumped = not numels or (max(numels) > facts.num_params / 2 and (facts.num_layers or 0) > 1)
    if not lumped or not (facts.hidden_size and facts.num_layers):
        return numels or (facts.num_params,)
    h, layers = facts.hidden_size, facts.num_layers
    inter = facts.intermediate_size or int(8 * h / 3)
    vocab = facts.vocab_size or 0
    layer = (h * h, h * h, h * h, h * h, h * inter, h * inter, h * inter, h, h)  # registration order
    shape = (vocab * h, *(layer * layers), h, vocab * h)
    scale = facts.num_params / sum(shape)
    return tuple(max(1, round(n * scale)) for n in shape)


def _rank_numels(facts: ModelFacts, layout: ParallelLayout) -> tuple[tuple[int, ...], int]:
    """(dense parameters of this rank in forward order, expert parameters of this rank): the model's parameters
    scaled to the rank's tensor/pipeline slice (:func:`common.memory_formulas.rank_params`)."""
    dense, experts = rank_params(facts, layout)
    numels = forward_numels(facts)
    total_dense = facts.num_params - facts.expert_params
    scale = dense / total_dense if total_dense else 0.0
    # Experts are a lump of their own (a separate ZeRO group); the rest scales to the rank's slice.
    dense_numels = tuple(max(1, round(n * scale)) for n in numels)
    if facts.expert_params and facts.param_numels:
        # param_numels lists the experts too: drop as many elements from the end of the list as they hold.
        dense_numels = _without_experts(dense_numels, round(facts.expert_params * scale))
    return dense_numels, int(experts)


def _without_experts(numels: tuple[int, ...], expert_elements: int) -> tuple[int, ...]:
    kept, dropped = [], 0
    for n in sorted(numels, reverse=True):
        if dropped + n <= expert_elements:
            dropped += n
        else:
            kept.append(n)
    return tuple(kept)


def plan_communication(facts: ModelFacts, setup: CommSetup, layout: ParallelLayout) -> CommPlan:
    """Every collective one rank takes part in during one optimizer step (module docstring).

    Args:
        facts: the model; ``param_numels`` in registration order (a Llama's is read as such) gives the stage-3
            schedule exactly, without it the model is one lump.
        setup: the ZeRO config and batch.
        layout: world size and the TP, PP, EP and SP degrees.

    Returns:
        The plan: one :class:`Transfer` per kind of call.
    """
    numels, expert_numel = _rank_numels(facts, layout)
    p = WORKING_BYTES[setup.precision]
    a = setup.grad_accum
    rpn = setup.ranks_per_node
    tp, sp = layout.tensor, layout.sequence
    zero_ranks = layout.zero_ranks  # DP x SP: ZeRO shards over them
    # ZeRO's group: DP x SP ranks, stride TP (sequence-parallel ranks are part of it).
    zero_scope = group_scope(zero_ranks, tp, rpn)
    transfers: list[Transfer] = []
    # Under sequence parallelism stages 1-2 reduce in fp32 (stage_1_and_2.allreduce_bucket).
    grad_dtype = "fp32" if (sp > 1 and setup.stage in (1, 2)) else setup.precision
    grad_bytes = WORKING_BYTES[grad_dtype]
    dense_total = sum(numels)

    def add(collective: str, purpose: str, message: float, calls: int, group: int, scope: str, dtype: str) -> None:
        # DeepSpeed reduces gradients over its data-parallel group even when tensor parallelism leaves it one rank
        # (logged, nothing sent); it skips the all-gather after the step there.
        called = group > 1 or (collective == "all_reduce" and layout.world_size > 1)
        if called and message > 0:
            transfers.append(Transfer(collective, purpose, float(message), int(calls), group, scope, dtype))

    bucket_calls = max(1, math.ceil(dense_total / setup.reduce_bucket_size))
    if setup.stage in (0, 1):
        add("all_reduce", "gradients, once per step", grad_bytes * dense_total, bucket_calls, zero_ranks, zero_scope,
            grad_dtype)  # fmt: skip
    elif setup.stage == 2:
        add(
            "all_reduce",
            "gradients, every micro-batch (DeepSpeed's bucketed 'reduce-scatter')",
            a * grad_bytes * dense_total,
            a * bucket_calls,
            zero_ranks,
            zero_scope,
            grad_dtype,
        )
    if setup.stage in (1, 2):
        shard = shard_elements(dense_total, zero_ranks)
        add(
            "all_gather",
            AFTER_STEP,
            p * shard,
            setup.param_groups,
            zero_ranks,
            zero_scope,
            setup.precision,
        )
    if setup.stage >= 1:
        # The gradient norm (and, in 16-bit, the overflow check) is summed over the ranks once a step: bytes that do
        # not count, calls that do (stage_1_and_2.get_grad_norm_direct / has_overflow, stage3's norm in fp64).
        checks = 1 if setup.stage == 3 or setup.precision == "fp32" else 2
        add("all_reduce", "gradient norm and overflow check", 8.0 if setup.stage == 3 else 3 + checks, checks,
            zero_ranks, zero_scope, "fp32")  # fmt: skip
    if setup.stage == 3:
        transfers += _stage3(numels, setup, zero_ranks, zero_scope, tp)
    if expert_numel:
        transfers += _experts(expert_numel, setup, layout, grad_dtype)
    transfers += _activations(facts, setup, layout)
    return CommPlan(tuple(transfers))


def _stage3(numels: tuple[int, ...], setup: CommSetup, ranks: int, scope: str, tp: int) -> list[Transfer]:
    p = WORKING_BYTES[setup.precision]
    a = setup.grad_accum
    gathered = [n for n in numels if n > setup.persistence_threshold]
    counts = stage3_gathers(
        stage3_module_trace(len(numels)),
        numels,
        setup.persistence_threshold,
        setup.prefetch_bucket_size,
        setup.max_live_parameters,
        setup.max_reuse_distance,
    )
    # Gathered a second time (or more): released after the forward use, needed again by the backward pass.
    regathered = [n for n, count in zip(numels, counts) for _ in range(count - 1)]
    weight_bytes = INT8_BYTES if setup.quantized_weights else p
    transfers = []
    if gathered and ranks > 1:
        forward = sum(shard_elements(n, ranks) for n in gathered)
        # With prefetch DeepSpeed coalesces the parameters of the next prefetch_bucket_size elements into one call.
        prefetch = min(setup.prefetch_bucket_size, setup.max_live_parameters)
        forward_calls = min(len(gathered), math.ceil(sum(gathered) / prefetch)) if prefetch > 0 else len(gathered)
        transfers.append(
            Transfer(
                "all_gather",
                "sharded parameters before their forward use, every micro-batch"
                + (" (qwZ: int8)" if setup.quantized_weights else ""),
                a * weight_bytes * forward,
                a * forward_calls,
                ranks,
                scope,
                "int8" if setup.quantized_weights else setup.precision,
            )
        )
    if regathered and ranks > 1:
        hpz = setup.hpz_partition_size
        group = hpz if hpz > 1 else ranks
        backward = sum(shard_elements(n, group) for n in regathered)
        transfers.append(
            Transfer(
                "all_gather",
                "parameters released after forward, gathered again for backward"
                + (f" (hpZ: from the copy sharded over {hpz} ranks)" if hpz > 1 else ""),
                a * p * backward,
                a * len(regathered),
                group,
                group_scope(group, tp, setup.ranks_per_node) if hpz > 1 else scope,
                setup.precision,
            )
        )
    persistent = [n for n in numels if n <= setup.persistence_threshold]
    if persistent and ranks > 1:
        # Each rank updated its partition of the persistent parameters: DeepSpeed gathers them whole again after the
        # step (stage3._post_step), one call per parameter.
        transfers.append(
            Transfer(
                "all_gather",
                PERSISTENT_AFTER_STEP,
                p * sum(shard_elements(n, ranks) for n in persistent),
                len(persistent),
                ranks,
                scope,
                setup.precision,
            )
        )
    if ranks > 1:
        padded = sum(shard_elements(n, ranks) * ranks for n in numels)
        calls = a * max(1, math.ceil(sum(numels) / setup.reduce_bucket_size))
        if setup.quantized_gradients:
            transfers.append(
                Transfer(
                    "all_to_all",
                    "gradients as int4, every micro-batch (qgZ)",
                    a * INT4_BYTES * padded,
                    calls,
                    ranks,
                    scope,
                    "int4",
                )
            )
        else:
            transfers.append(
                Transfer(
                    "reduce_scatter",
                    "gradients, every micro-batch",
                    a * p * padded,
                    calls,
                    ranks,
                    scope,
                    setup.precision,
                )
            )
    return transfers


def _experts(expert_numel: int, setup: CommSetup, layout: ParallelLayout, grad_dtype: str) -> list[Transfer]:
    """Expert parameters are ZeRO-partitioned over the expert-data-parallel group (DP / EP ranks, stride EP x TP)."""
    group = layout.expert_data_parallel
    if layout.world_size <= 1:
        return []
    scope = group_scope(group, layout.expert * layout.tensor, setup.ranks_per_node)
    a = setup.grad_accum
    per_step = a if setup.stage >= 2 else 1
    transfers = [
        Transfer(
            "all_reduce",
            "expert gradients over the expert-data-parallel group",
            per_step * WORKING_BYTES[grad_dtype] * expert_numel,
            per_step,
            group,
            scope,
            grad_dtype,
        )
    ]
    if setup.stage in (1, 2) and group > 1:
        transfers.append(
            Transfer(
                "all_gather",
                EXPERTS_AFTER_STEP,
                WORKING_BYTES[setup.precision] * shard_elements(expert_numel, group),
                1,
                group,
                scope,
                setup.precision,
            )
        )
    return transfers


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int) -> int:
    """Tokens in each expert's slot of a micro-batch when DeepSpeed MoE drops tokens (``drop_tokens=True``).

    ``deepspeed/moe/sharded_moe.py``: ``_capacity`` gives ceil(tokens / experts x factor), at least ``min_capacity``;
    top-1 gating passes ``capacity_factor``, top-2 ``2 x capacity_factor``, top-k ``k x capacity_factor``. Every
    slot is padded to it, so the dispatched buffer is experts x capacity x hidden whatever the routing.

    Args:
        tokens: tokens of this rank's micro-batch (micro batch x sequence length).
        num_experts: experts of the MoE layer in total (over the expert-parallel ranks).
        top_k: experts each token goes to.
        capacity_factor: DeepSpeed MoE's ``capacity_factor``.
        min_capacity: DeepSpeed MoE's ``min_capacity``.

    Returns:
        The slot's tokens.
    """
    return max(math.ceil(tokens / num_experts * (capacity_factor * top_k)), min_capacity)


def _activations(facts: ModelFacts, setup: CommSetup, layout: ParallelLayout) -> list[Transfer]:
    """TP, SP and EP traffic: activations of a micro-batch, forward and backward, per layer of this rank's stage."""
    tokens = setup.tokens_per_micro_batch
    if not tokens or not facts.hidden_size or not facts.num_layers:
        return []
    p = WORKING_BYTES[setup.precision]
    a = setup.grad_accum
    h = facts.hidden_size
    layers = facts.num_layers // layout.pipeline
    rpn = setup.ranks_per_node
    transfers = []
    if layout.tensor > 1:
        # AutoTP: row-parallel layers (attention output, MLP down) all-reduce their output in the forward pass; each
        # column-parallel one (q, k, v, gate, up) all-reduces its input's gradient in the backward pass: 7 a layer.
        # The output layer is column-parallel too: its logits are all-gathered forward, its input gradient reduced.
        scope = group_scope(layout.tensor, 1, rpn)
        local = tokens / layout.sequence
        calls = 7 * layers + 1
        transfers.append(
            Transfer(
                "all_reduce",
                "tensor parallel: layer outputs forward, input gradients backward",
                a * calls * local * h * p,
                a * calls,
                layout.tensor,
                scope,
                setup.precision,
            )
        )
        if facts.vocab_size:
            transfers.append(
                Transfer(
                    "all_gather",
                    "tensor parallel: the output layer's logits",
                    a * local * facts.vocab_size / layout.tensor * p,
                    a,
                    layout.tensor,
                    scope,
                    setup.precision,
                )
            )
    if layout.sequence > 1:
        heads = facts.num_heads or 1
        head_dim = facts.head_dim or h // heads
        kv = (facts.num_kv_heads or heads) * head_dim
        local = tokens / layout.sequence
        # Forward: q, k, v in, the attention output back; backward the same four the other way.
        per_layer = local * (h + 2 * kv + h) / layout.tensor
        transfers.append(
            Transfer(
                "all_to_all",
                "sequence parallel: q, k, v and attention output, forward and backward",
                a * 2 * layers * per_layer * p,
                a * 2 * 4 * layers,
                layout.sequence,
                group_scope(layout.sequence, layout.tensor, rpn),
                setup.precision,
            )
        )
    if layout.expert > 1 and facts.num_experts:
        # Dispatch and combine, forward and backward: the (experts, capacity, hidden) buffer of every expert's slot.
        if setup.moe_drop_tokens:
            capacity = expert_capacity(
                tokens, facts.num_experts, setup.moe_top_k, setup.moe_capacity_factor, setup.moe_min_capacity
            )
            message = facts.num_experts * capacity * h * p
        else:  # top-k copies of each token, padded to the busiest expert: the factor is the routing's
            message = setup.moe_top_k * tokens * setup.moe_capacity_factor * h * p
        transfers.append(
            Transfer(
                "all_to_all",
                "expert parallel: tokens to their experts and back, forward and backward",
                a * 4 * layers * message,
                a * 4 * layers,
                layout.expert,
                group_scope(layout.expert, layout.tensor, rpn),
                setup.precision,
            )
        )
    return transfers


# --- links: bandwidth and latency -----------------------------------------------------------------------------

GBPS = 1e9 / 8  # bytes/s in one Gbit/s


@dataclass(frozen=True)
class Link:
    """A link's bus bandwidth per rank (bytes/s) and the fixed cost of one collective call (s).

    A measured link also carries the points it was fitted to (``points``: bus bytes of one call, seconds of one call,
    ascending): a call is then priced at the measured time for its size (:func:`call_seconds`), since a real
    collective's cost per byte changes with the message size (caches, protocol switches) in ways one line does not
    follow; the fit prices sizes outside the measured ones and is what the text shows.
    """

    name: str
    bus_bytes_per_s: float
    latency_s: float = 0.0
    source: str = ""
    points: tuple[tuple[float, float], ...] = ()

    def seconds(self, sent_bytes: float, calls: int) -> float:
        """Seconds for ``calls`` calls that send ``sent_bytes`` in all."""
        if self.points and calls > 0:
            return calls * call_seconds(self.points, sent_bytes / calls, self.bus_bytes_per_s)
        return calls * self.latency_s + sent_bytes / self.bus_bytes_per_s


def call_seconds(points: tuple[tuple[float, float], ...], bus_bytes: float, bus_bytes_per_s: float) -> float:
    """Seconds of one call moving ``bus_bytes``, from measured ``(bus bytes, seconds)`` points: linear between the two
    measured sizes around it; outside them, the nearest point's time plus (or minus, never below zero) the difference
    in bytes at ``bus_bytes_per_s``. A larger message never takes less time than a smaller one (each point's time is
    at least the one before it: a dip is the noise of a shared machine)."""
    xs, ys, slowest = [], [], 0.0
    for size, seconds in sorted(points):
        slowest = max(slowest, seconds)
        xs.append(size)
        ys.append(slowest)
    if bus_bytes <= xs[0] or bus_bytes >= xs[-1]:
        i = 0 if bus_bytes <= xs[0] else -1
        return max(0.0, ys[i] + (bus_bytes - xs[i]) / bus_bytes_per_s)
    i = bisect.bisect_right(xs, bus_bytes)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (bus_bytes - x0) * (y1 - y0) / (x1 - x0)


# Link classes: nominal one-direction rates (PCIe 3.0/4.0 x16 at 16-32 GB/s; the 25 and 100 Gbit/s networks at which
# practitioners report stage 2 and stage 3 to stay usable). Real collectives reach less: pass a measured figure.
LINK_CLASSES: dict[str, Link] = {
    "nvlink": Link("nvlink", 300e9, 5e-6, "NVLink 3 (A100): 300 GB/s per GPU per direction, nominal"),
    "pcie3": Link("pcie3", 16e9, 10e-6, "PCIe 3.0 x16: 16 GB/s, nominal"),
    "pcie4": Link("pcie4", 32e9, 10e-6, "PCIe 4.0 x16: 32 GB/s, nominal"),
    "pcie5": Link("pcie5", 64e9, 10e-6, "PCIe 5.0 x16: 64 GB/s, nominal"),
    "25gbps": Link("25gbps", 25 * GBPS, 30e-6, "25 Gbit/s Ethernet (below it, stay on stage 2)"),
    "100gbps": Link("100gbps", 100 * GBPS, 10e-6, "100 Gbit/s InfiniBand (stage 3 reported within 15 % of the step)"),
    "400gbps": Link("400gbps", 400 * GBPS, 10e-6, "400 Gbit/s InfiniBand, nominal"),
}

_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(gbps|gbit/s|gb/s|gbyte/s)\s*$", re.I)


def parse_link(text: str) -> Link:
    """A link class (``nvlink``, ``pcie3``/``4``/``5``, ``25gbps``/``100gbps``/``400gbps``) or a figure (``12.5GB/s``
    in bytes, ``100Gbps`` in bits).

    Raises:
        ConfigError: an unknown class (naming the nearest) or a rate that is not a positive number.
    """
    key = str(text).strip().lower().replace(" ", "").replace(".0", "").replace("-", "")
    if key in LINK_CLASSES:
        return LINK_CLASSES[key]
    match = _RATE_RE.match(str(text))
    if match:
        number, unit = float(match.group(1)), match.group(2).lower()
        rate = number * (GBPS if unit in ("gbps", "gbit/s") else 1e9)
        if not rate > 0 or math.isinf(rate):
            raise ConfigError(f"--network {text!r}: a bandwidth must be a positive number")
        return Link(str(text).strip(), rate, 0.0, f"{text.strip()} given on the command line")
    if re.match(r"^\s*-", str(text)):
        raise ConfigError(f"--network {text!r}: a bandwidth must be a positive number, e.g. 12.5GB/s or 100Gbps")
    raise ConfigError(
        f"--network: unknown link {text!r}{nearest(key, LINK_CLASSES)}; use one of {', '.join(LINK_CLASSES)} "
        "or a figure such as 12.5GB/s or 100Gbps"
    )


@dataclass(frozen=True)
class MeasuredLinks:
    """Per collective, a link measured by ``doctor --collectives``: its timings at each size it measured, and the fit
    seconds = latency + bus bytes / rate through them (:func:`fit_link`).

    Attributes:
        world_size: the ranks doctor measured over.
        links: per collective, fp32's fit (or, where doctor measured no fp32, its first dtype's).
        by_dtype: per measured dtype, per collective, its fit.
    """

    world_size: int
    links: dict[str, Link] = field(default_factory=dict)
    by_dtype: dict[str, dict[str, Link]] = field(default_factory=dict)

    def for_dtype(self, dtype: str) -> dict[str, Link]:
        """The fits that price a buffer of ``dtype``: its own, else a measured dtype of its width, else
        :attr:`links` (see :data:`SAME_WIDTH`)."""
        return self.by_dtype.get(dtype) or self.by_dtype.get(SAME_WIDTH.get(dtype, "")) or self.links


def fit_link(name: str, rows: list[tuple[float, float]]) -> Link:
    """Least-squares ``seconds = latency + bytes / rate`` through (bus bytes, seconds) points, latency >= 0; the link
    keeps the points, which price the sizes between them (:meth:`Link.seconds`)."""
    points = tuple(sorted(rows))
    if len(rows) == 1:
        sent, seconds = rows[0]
        return Link(name, sent / seconds, 0.0, "measured (one size)", points)
    n = len(rows)
    mean_x = sum(x for x, _ in rows) / n
    mean_y = sum(y for _, y in rows) / n
    var = sum((x - mean_x) ** 2 for x, _ in rows)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in rows) / var if var else 0.0
    latency = mean_y - slope * mean_x
    if slope <= 0 or latency < 0:  # noise: fall back to the largest message's bandwidth, no latency
        sent, seconds = max(rows)
        return Link(name, sent / seconds, 0.0, "measured (largest size)", points)
    return Link(name, 1 / slope, latency, "measured", points)


def links_from_doctor(document: dict[str, Any], world_size: int | None = None) -> MeasuredLinks:
    """Measured links per collective from the ``doctor.json`` that ``zero-recipes doctor --collectives`` writes.

    Raises:
        ConfigError: no ``measured`` section (doctor was run without ``--collectives``), or measured over another
            number of ranks than the plan's ``world_size``.
    """
    measured = document.get("measured") if isinstance(document, dict) else None
    if not isinstance(measured, dict) or not measured.get("collectives"):
        raise ConfigError(
            "--bandwidth-from: no measured collectives in this doctor.json: run "
            "'torchrun --nproc_per_node N -m common.tools.doctor --collectives' first"
        )
    ranks = int(measured["world_size"])
    if world_size is not None and ranks != world_size:
        raise ConfigError(
            f"--bandwidth-from: doctor.json measured {ranks} ranks but the plan has {world_size}: a collective's bus "
            "bandwidth depends on how many ranks share it; measure again with the run's ranks"
        )
    points: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for row in measured["collectives"]:
        op, size, seconds = row["op"], float(row["bytes"]), float(row["seconds"])
        dtype = row.get("dtype", "fp32")  # a doctor.json from before doctor measured per dtype: fp32 buffers
        if op in BUS_FACTOR and seconds > 0:
            points.setdefault(dtype, {}).setdefault(op, []).append((size * BUS_FACTOR[op](ranks), seconds))
    by_dtype = {
        dtype: {op: fit_link(f"{op} ({dtype})" if dtype != "fp32" else op, rows) for op, rows in ops.items()}
        for dtype, ops in points.items()
    }
    default = by_dtype.get("fp32") or next(iter(by_dtype.values()), {})
    return MeasuredLinks(ranks, default, by_dtype)


def transfer_seconds(transfer: Transfer, link: Link) -> float:
    """Seconds one step's calls of ``transfer`` take over ``link``."""
    if transfer.group_size <= 1:
        return 0.0
    return link.seconds(transfer.sent_bytes, transfer.calls)


def link_for(transfer: Transfer, intra: Link | MeasuredLinks, inter: Link | MeasuredLinks | None) -> Link:
    """The link a transfer runs on: the network for a group that crosses nodes (the slower link bounds a ring),
    else the node's; a measured set gives the collective's own fit in the dtype the transfer moves
    (:meth:`MeasuredLinks.for_dtype`; all-to-all and point-to-point borrow all-gather's, the collective of the same
    bus factor)."""
    chosen = inter if (transfer.scope == "inter_node" and inter is not None) else intra
    if isinstance(chosen, MeasuredLinks):
        links = chosen.for_dtype(transfer.dtype)
        op = transfer.collective if transfer.collective in links else "all_gather"
        return links[op]
    return chosen


def plan_seconds(plan: CommPlan, intra: Link | MeasuredLinks, inter: Link | MeasuredLinks | None = None) -> float:
    """Communication seconds of one optimizer step if nothing overlapped: the sum over transfers."""
    return sum(transfer_seconds(t, link_for(t, intra, inter)) for t in plan.transfers)


# --- compute and the share of the step ---------------------------------------------------------------------------


def compute_seconds(flops_per_step: float, peak_flops: float, utilisation: float) -> float:
    """Seconds of compute per optimizer step: the step's FLOPs per rank over the device's dense peak at a utilisation.

    Raises:
        ConfigError: a peak or utilisation that is not positive, a utilisation above 1.
    """
    if not peak_flops > 0:
        raise ConfigError(f"the device's peak FLOP/s must be positive, got {peak_flops}")
    if not 0 < utilisation <= 1:
        raise ConfigError(f"utilisation must be in (0, 1], got {utilisation}")
    return flops_per_step / (peak_flops * utilisation)


def training_flops_per_rank(num_params: float, tokens_per_step_per_rank: float) -> float:
    """6 x parameters x tokens: forward (2) and backward (4) FLOPs of a dense model (Kaplan et al. 2020)."""
    return 6.0 * num_params * tokens_per_step_per_rank


@dataclass(frozen=True)
class StepShare:
    """Communication against compute in one step.

    Attributes:
        comm_s: communication seconds if nothing overlapped.
        compute_s: compute seconds.
        overlappable_s: communication that can run under compute (DeepSpeed's ``overlap_comm``: the gradient
            reductions and the prefetched all-gathers; what a step must wait for at its edges cannot).
        exposed_s: communication left on the step's critical path with overlap: ``comm_s - min(overlappable_s,
            compute_s)``.
    """

    comm_s: float
    compute_s: float
    overlappable_s: float

    @property
    def exposed_s(self) -> float:
        """Communication the step waits for with overlap."""
        return self.comm_s - min(self.overlappable_s, self.compute_s)

    @property
    def share(self) -> float:
        """Communication's share of the step without overlap: comm / (comm + compute)."""
        total = self.comm_s + self.compute_s
        return self.comm_s / total if total else 0.0

    @property
    def exposed_share(self) -> float:
        """The share with overlap: exposed / (exposed + compute)."""
        total = self.exposed_s + self.compute_s
        return self.exposed_s / total if total else 0.0


# Transfers that cannot hide under compute: the all-gather after the step (nothing left to compute) and the first
# micro-batch's first gathers; the rest runs beside the backward/forward passes when overlap_comm is on.
_NOT_OVERLAPPABLE = (AFTER_STEP, EXPERTS_AFTER_STEP, PERSISTENT_AFTER_STEP)


def step_share(
    plan: CommPlan, compute_s: float, intra: Link | MeasuredLinks, inter: Link | MeasuredLinks | None = None
) -> StepShare:
    """The communication share of a step, and how much of it overlap can hide under ``compute_s``."""
    total = overlappable = 0.0
    for t in plan.transfers:
        seconds = transfer_seconds(t, link_for(t, intra, inter))
        total += seconds
        if t.purpose not in _NOT_OVERLAPPABLE and not t.purpose.startswith(("tensor parallel", "sequence parallel")):
            overlappable += seconds
    return StepShare(comm_s=total, compute_s=compute_s, overlappable_s=overlappable)


# --- bucket sizes from the link ----------------------------------------------------------------------------------

# A bucket whose transfer takes about this long amortises the call's latency (>= 95 % of the link's rate) and still
# leaves room to overlap with one layer's compute.
BUCKET_TARGET_S = 0.005


def suggested_bucket_elements(link: Link, precision: str, lo: float = 5e7, hi: float = 2e9) -> int:
    """``reduce_bucket_size`` / ``allgather_bucket_size`` for a link (smaller on a slow network,
    larger on a fast interconnect): the elements one call moves in :data:`BUCKET_TARGET_S`, and at least 20 x the
    link's latency worth, clamped to [``lo``, ``hi``] (the usual advice: 5e8 to 2e9 on fast links)."""
    seconds = max(BUCKET_TARGET_S, 20 * link.latency_s)
    elements = seconds * link.bus_bytes_per_s / WORKING_BYTES[precision]
    return int(min(hi, max(lo, elements)))
