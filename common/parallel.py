"""Parallel layouts: how the ranks split a model, the rules a layout must meet, and which rank does what.

One :class:`ParallelLayout` describes a run: world = tensor x pipeline x sequence x data parallel, and MoE experts
split over expert-parallel groups inside the data-parallel ranks. The planner (``zero-recipes estimate``) and the NLP
recipe's entry points build one and pass it to the same :func:`check_layout`; each reads the refusal in its own
vocabulary (:func:`cli_option` writes ``--tensor-parallel 3``, :func:`recipe_option` ``tensor_parallel=3``). The
per-rank arithmetic (:func:`rank_params`, :func:`parallel_model_states`) and the rank map (which replica, stage or
expert group a rank belongs to) are methods and functions of the same layout, so the memory a recipe prints before
training is the planner's and the batches a rank reads are those DeepSpeed's groups expect (:func:`check_mesh`).

Two kinds of rules:

- **shape rules**, true of any framework: the degrees divide the ranks, the pipeline stages the layers, tensor
  parallelism the heads, Ulysses the heads and the sequence, expert parallelism the experts.
- **component rules**, true of DeepSpeed's own components as the NLP recipe runs them (``components="deepspeed"``:
  AutoTP, the native MoE layer, Ulysses on a transformers model, the pipeline engine): which degrees combine, and
  which ZeRO stages each allows. The planner without ``--recipe`` plans any layout (Megatron-DeepSpeed combines
  tensor, pipeline and expert parallelism) with the shape rules and DeepSpeed's pipeline-engine stage limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.errors import ConfigError
from common.memory_formulas import (
    WORKING_BYTES,
    ModelFacts,
    guide_model_states,
    persistent_params,
    place_states,
    predicted_model_state_bytes,
)

COMPONENTS = ("any", "deepspeed")  # what runs each degree: any framework, or DeepSpeed's components (see above)


# --- the vocabulary of the refusals ---------------------------------------------------------------------------


def cli_option(key: str, value: Any = None) -> str:
    """How the planner's command line spells an option (``--seq-len 4096``): the vocabulary of its errors."""
    name = "--" + key.replace("_", "-")
    return name if value is None else f"{name} {value}"


def recipe_option(key: str, value: Any = None) -> str:
    """How a recipe's config spells an option (``seq_len=4096``): the vocabulary of its errors."""
    return key if value is None else f"{key}={value}"


# --- the layout and the rank map ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelLayout:
    """How the ranks split the model: world = tensor x pipeline x sequence x data parallel, experts over EP groups.

    The layout of DeepSpeed and Megatron: the TP x PP ranks of a replica each hold a different slice of the model,
    and ZeRO partitions a slice's model states over the DP = world / (TP x PP x SP) replicas that hold the same
    slice, and over the SP ranks too. MoE experts are split over EP of the DP ranks, and each expert is
    data-parallel over the other DP / EP: DeepSpeed's "expert data parallel" group
    (``deepspeed.utils.groups._create_expert_data_and_model_parallel``), over which ZeRO partitions the experts'
    states. Ulysses sequence parallelism (SP) splits every sequence over SP ranks of a replica, which then see the
    same samples, but ZeRO partitions over them too (DeepSpeed's "sequence data parallel" group,
    ``groups._get_sequence_data_parallel_group``): model states are sharded over world / (TP x PP) ranks.

    Attributes:
        world_size: ranks in total (devices per node x nodes).
        tensor: TP, ranks splitting each matrix (Megatron-style tensor parallelism, DeepSpeed's AutoTP).
        pipeline: PP, pipeline stages (``deepspeed.pipe.PipelineModule``), each holding L / PP blocks.
        expert: EP, ranks splitting the routed experts of each MoE layer.
        sequence: SP, ranks splitting each sequence (DeepSpeed's Ulysses, ``UlyssesSPAttentionHF``).
        zero_stage: the run's ZeRO stage; None when planning every stage (the planner's rows).
        pipeline_engine: DeepSpeed's pipeline engine runs the model even with one stage (a run of the NLP recipe's
            ``train_pipeline.py``); with ``pipeline`` > 1 it does anyway (:attr:`on_pipeline_engine`).
        components: ``deepspeed`` when DeepSpeed's own components run each degree (the component rules apply),
            ``any`` otherwise.
    """

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    sequence: int = 1
    zero_stage: int | None = None
    pipeline_engine: bool = False
    components: str = "any"

    @property
    def on_pipeline_engine(self) -> bool:
        """DeepSpeed's pipeline engine runs the model: ZeRO 0-1 only, no AutoTP, no Ulysses."""
        return self.pipeline > 1 or self.pipeline_engine

    @property
    def ranks_per_replica(self) -> int:
        """TP x PP x SP: the ranks that share one replica's samples."""
        return self.tensor * self.pipeline * self.sequence

    @property
    def data_parallel(self) -> int:
        """DP = world / (TP x PP x SP): the replicas that read different samples (the global batch's factor)."""
        return self.world_size // self.ranks_per_replica

    @property
    def zero_ranks(self) -> int:
        """World / (TP x PP) = DP x SP: the ranks ZeRO partitions the dense states over (SP ranks included)."""
        return self.world_size // (self.tensor * self.pipeline)

    @property
    def expert_data_parallel(self) -> int:
        """DP / EP: the ranks ZeRO partitions an expert's states over."""
        return self.data_parallel // self.expert

    @property
    def trivial(self) -> bool:
        """Every rank holds the whole model: the ZeRO formulas apply to model states as they are, N = world (SP
        ranks hold the whole model and ZeRO shards over them too)."""
        return self.tensor == self.pipeline == self.expert == 1

    def data_parallel_rank(self, rank: int) -> int:
        """The replica whose batches ``rank`` reads.

        DeepSpeed's AutoTP mesh is (data parallel, tensor parallel), row-major (``groups._init_tp_mesh_device``), and
        Ulysses groups are consecutive ranks too (``parallel_state_sp``): ranks ``r * n .. r * n + n - 1`` (n = TP x SP)
        form replica ``r``. The pipeline topology is (pipe, data), row-major (``PipeDataParallelTopology``): stage
        ``s`` is ranks ``s * DP .. s * DP + DP - 1``, and rank ``r`` reads replica ``r % DP``'s batches (the first
        stage its inputs, the last its labels).
        """
        if self.pipeline > 1:
            return rank % self.data_parallel
        return rank // (self.tensor * self.sequence)

    def pipeline_stage(self, rank: int) -> int:
        """The pipeline stage ``rank`` runs (0 without a pipeline)."""
        return rank // self.data_parallel if self.pipeline > 1 else 0

    def tensor_rank(self, rank: int) -> int:
        """``rank``'s index in its tensor-parallel group (consecutive ranks)."""
        return rank % self.tensor

    def sequence_rank(self, rank: int) -> int:
        """``rank``'s index in its sequence-parallel group (consecutive ranks): the slice of each sequence it holds."""
        return rank % self.sequence

    def expert_rank(self, rank: int) -> int:
        """``rank``'s index in its expert-parallel group: DeepSpeed groups consecutive ranks (``ranks r * EP ..
        r * EP + EP - 1``, ``groups._create_expert_and_data_parallel``), so it holds experts ``expert_rank x E / EP``
        on; :func:`check_mesh` verifies it on the engine."""
        return rank % self.expert

    def text(self, option: Callable[..., str] = recipe_option) -> str:
        """The layout in words, e.g. ``tensor_parallel=2 x data parallel 2 (ZeRO over 2 ranks)``."""
        degrees = [
            option(key, value)
            for key, value in (
                ("tensor_parallel", self.tensor),
                ("pipeline_parallel", self.pipeline),
                ("sequence_parallel", self.sequence),
            )
            if value > 1
        ]
        words = " x ".join([*degrees, f"data parallel {self.data_parallel}"])
        if self.expert > 1:
            words += f", {option('expert_parallel', self.expert)} (expert data parallel {self.expert_data_parallel})"
        return f"{words}; ZeRO shards over {self.zero_ranks} rank(s)"


# --- the rules ------------------------------------------------------------------------------------------------


def shape_facts(config: Any, source: str, experts: bool = True) -> ModelFacts:
    """The shape facts :func:`check_layout` reads (heads, layers, MLP width, experts) from a transformers config,
    without building the model; ``num_params`` is 0 (not counted).

    Args:
        experts: count the config's experts; False for a model whose experts no expert parallelism can split.
    """
    heads = getattr(config, "num_attention_heads", None)
    count = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return ModelFacts(
        num_params=0,
        architecture="transformer",
        hidden_size=getattr(config, "hidden_size", None),
        num_layers=getattr(config, "num_hidden_layers", None),
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        intermediate_size=getattr(config, "intermediate_size", None),
        num_experts=int(count) if count and experts else None,
        source=source,
    )


def _assumed_hint(facts: ModelFacts) -> str:
    return " (the shape is assumed from --params: pass --model-config for the real one)" if _assumed(facts) else ""


def _assumed(facts: ModelFacts) -> bool:
    return facts.source.startswith("--params")


def _divisors(n: int, also: Callable[[int], bool] = lambda d: True) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and also(d))


def check_layout(
    facts: ModelFacts,
    layout: ParallelLayout,
    option: Callable[..., str] = cli_option,
    seq_len: int | None = None,
    attention: str | None = None,
) -> None:
    """Refuse a layout that cannot run, naming the option to change and a value that works.

    The shape rules: the degrees are >= 1; TP x PP x SP divides the ranks; PP splits the layers into stages of
    equal depth; TP divides the query and key/value heads and the MLP width (AutoTP splits attention by heads and the
    MLP by its width); Ulysses' rules (:func:`check_sequence_parallel`); EP needs experts, divides them and the
    data-parallel degree (DeepSpeed's ``_ensure_divisibility(dp_world_size, expert_parallel_size_)``); expert with
    sequence parallelism is not modelled. Then the component rules (:func:`check_components`) and, with a known
    ZeRO stage, the stage rules (:func:`stage_refusal`).

    Args:
        facts: the model's shape (``shape_facts`` of a config, or the planner's counted facts).
        option: how the caller spells its options (:func:`cli_option` or :func:`recipe_option`).
        seq_len, attention: the run's sequence length and attention implementation (Ulysses' rules), when known.

    Raises:
        ConfigError: one line naming the option and what to choose.
    """
    t, p, e, sp = layout.tensor, layout.pipeline, layout.expert, layout.sequence
    for key, value in (
        ("tensor_parallel", t),
        ("pipeline_parallel", p),
        ("expert_parallel", e),
        ("sequence_parallel", sp),
    ):
        if value < 1:
            raise ConfigError(f"{option(key)} must be >= 1, got {value}")
    _check_world(layout, option)
    _check_pipeline(facts, p, option)
    _check_tensor(facts, t, option)
    check_sequence_parallel(facts, sp, t, seq_len, attention, option)
    _check_experts(facts, layout, option)
    check_components(facts, layout, option)
    _check_stage(facts, layout, option)


def _check_world(layout: ParallelLayout, option: Callable[..., str]) -> None:
    degrees = [
        (key, value)
        for key, value in (
            ("tensor_parallel", layout.tensor),
            ("pipeline_parallel", layout.pipeline),
            ("sequence_parallel", layout.sequence),
        )
        if value > 1
    ]
    world, per_replica = layout.world_size, layout.ranks_per_replica
    if world % per_replica == 0:
        return
    names = " x ".join(key.split("_")[0] for key, _ in degrees)
    if len(degrees) == 1:
        key, value = degrees[0]
        raise ConfigError(
            f"{option(key, value)} does not divide the {world} rank(s) (world = {names} x data parallel); "
            f"use one of {_divisors(world)}"
        )
    asked = " x ".join(option(key, value) for key, value in degrees)
    raise ConfigError(
        f"{asked} = {per_replica} ranks per replica does not divide the {world} rank(s) (world = {names} x data "
        "parallel); change the number of ranks or the parallel sizes"
    )


def _check_pipeline(facts: ModelFacts, p: int, option: Callable[..., str]) -> None:
    if p == 1:
        return
    layers = facts.num_layers
    if not layers:
        raise ConfigError(
            f"{option('pipeline_parallel')} needs the model's layer count: pass --model-config or --params"
        )
    if p > layers:
        raise ConfigError(
            f"{option('pipeline_parallel', p)} is more than the model's {layers} layers: every stage needs one at "
            f"least; use one of {_divisors(layers)}"
        )
    if layers % p:
        raise ConfigError(
            f"{option('pipeline_parallel', p)} does not split the model's {layers} layers into stages of equal "
            f"depth{_assumed_hint(facts)}; use one of {_divisors(layers)}"
        )


def _check_tensor(facts: ModelFacts, t: int, option: Callable[..., str]) -> None:
    if t == 1:
        return
    if not facts.num_heads:
        raise ConfigError(
            f"{option('tensor_parallel')} needs the model's attention heads: pass --model-config or --params"
        )
    widths = [("attention heads", facts.num_heads), ("key/value heads", facts.num_kv_heads or facts.num_heads)]
    if facts.intermediate_size and not _assumed(facts):  # an assumed MLP width (8/3 h) is no real constraint
        widths.append(("MLP width (intermediate_size)", facts.intermediate_size))
    common = math.gcd(*[size for _, size in widths])
    for what, size in widths:
        if size % t:
            raise ConfigError(
                f"{option('tensor_parallel', t)} does not divide the model's {size} {what}{_assumed_hint(facts)}: "
                f"tensor parallelism gives each rank 1/TP of them; use one of {_divisors(common)}"
            )


def _check_experts(facts: ModelFacts, layout: ParallelLayout, option: Callable[..., str]) -> None:
    e = layout.expert
    if e == 1:
        return
    if not facts.num_experts:
        raise ConfigError(
            f"{option('expert_parallel', e)} needs a model with experts ({facts.source} has none): expert "
            "parallelism splits a Mixture-of-Experts model's experts; use a MoE model or "
            f"{option('expert_parallel', 1)}"
        )
    if facts.num_experts % e:
        raise ConfigError(
            f"{option('expert_parallel', e)} does not divide the model's {facts.num_experts} experts; use one of "
            f"{_divisors(facts.num_experts)}"
        )
    dp = layout.data_parallel
    if dp % e:
        raise ConfigError(
            f"{option('expert_parallel', e)} does not divide the data-parallel degree {dp} (= {layout.world_size} "
            f"rank(s) / {layout.ranks_per_replica} per replica): DeepSpeed places expert-parallel groups inside the "
            f"data-parallel ranks; use one of {_divisors(dp, lambda d: facts.num_experts % d == 0)}"
        )
    if layout.sequence > 1:
        raise ConfigError(
            f"{option('expert_parallel', e)} with {option('sequence_parallel', layout.sequence)} is not modelled: "
            "how DeepSpeed lays expert groups over sequence-parallel ranks is not known here; drop one of them"
        )


def check_components(facts: ModelFacts, layout: ParallelLayout, option: Callable[..., str] = cli_option) -> None:
    """The degrees DeepSpeed's own components cannot combine (``layout.components == "deepspeed"``), one line each.

    AutoTP shards a plain module inside ``deepspeed.initialize`` (not PipelineModule's layers, not the MoE layer's
    experts); Ulysses replaces a transformers model's attention (not PipelineModule's layers) and takes consecutive
    ranks as AutoTP's mesh does; DeepSpeed's MoE layer routes whole sequences.
    """
    if layout.components != "deepspeed":
        return
    t, sp, moe = layout.tensor, layout.sequence, bool(facts.num_experts)
    engine = f"the pipeline engine ({option('pipeline_parallel', layout.pipeline)})"
    pairs = [
        (t > 1 and layout.on_pipeline_engine, option("tensor_parallel", t), engine, "AutoTP shards a plain module "
         "inside deepspeed.initialize and is not wired into PipelineModule"),
        (sp > 1 and layout.on_pipeline_engine, option("sequence_parallel", sp), engine, "Ulysses replaces the "
         "attention of a transformers model, not of PipelineModule's layers"),
        (t > 1 and sp > 1, option("tensor_parallel", t), option("sequence_parallel", sp), "DeepSpeed's Ulysses "
         "groups and AutoTP's mesh both take consecutive ranks"),
    ]  # fmt: skip
    for refused, first, second, why in pairs:
        if refused:
            raise ConfigError(f"{first} with {second} does not run: {why}; use one of them")
    for refused, key, value, why in (
        (moe and t > 1, "tensor_parallel", t, "AutoTP does not split DeepSpeed's MoE experts"),
        (moe and sp > 1, "sequence_parallel", sp, "DeepSpeed's MoE layer routes whole sequences"),
    ):
        if refused:
            raise ConfigError(
                f"{option(key, value)} with a Mixture-of-Experts model does not run: {why}; use {option(key, 1)}"
            )


def stage_refusal(facts: ModelFacts, layout: ParallelLayout, stage: int) -> str | None:
    """Why ZeRO ``stage`` cannot run with ``layout`` (a short reason quoting DeepSpeed), or None when it can.

    DeepSpeed's pipeline engine runs ZeRO 0-1, whatever the components. With DeepSpeed's components: its native MoE
    layer refuses ZeRO-3 in ``deepspeed.initialize``, and the recipes' tensor-parallel export gathers AutoTP's shards,
    not ZeRO-3's partitions as well. The planner marks such rows; :func:`check_layout` refuses a run.
    """
    if layout.on_pipeline_engine and stage >= 2:
        return (
            "DeepSpeed's pipeline engine runs ZeRO 0-1 only (\"ZeRO-2 and ZeRO-3 are incompatible with pipeline "
            'parallelism")'
        )
    if layout.components != "deepspeed" or stage != 3:
        return None
    if facts.num_experts:
        return (
            "DeepSpeed's MoE layer runs ZeRO 0-2 only (\"Native DeepSpeed MoE is not supported with ZeRO Stage 3. Use "
            'AutoEP or choose ZeRO stage 1/2.")'
        )
    if layout.tensor > 1:
        return "the tensor-parallel export gathers AutoTP's shards, not ZeRO-3's partitions as well: ZeRO 0-2 only"
    return None


def _check_stage(facts: ModelFacts, layout: ParallelLayout, option: Callable[..., str]) -> None:
    stage = layout.zero_stage
    reason = None if stage is None else stage_refusal(facts, layout, stage)
    if reason is None:
        return
    if layout.on_pipeline_engine:
        what = f"the pipeline engine ({option('pipeline_parallel', layout.pipeline)})"
    else:
        what = option("tensor_parallel", layout.tensor) if layout.tensor > 1 else "a Mixture-of-Experts model"
    best = "deepspeed_stage_1" if layout.on_pipeline_engine else "deepspeed_stage_1 or deepspeed_stage_2"
    raise ConfigError(f"ZeRO stage {stage} with {what}: {reason}; use {option('preset', best)}")


def check_sequence_parallel(
    facts: ModelFacts,
    sequence_parallel: int,
    tensor_parallel: int = 1,
    seq_len: int | None = None,
    attention: str | None = None,
    option: Callable[..., str] = cli_option,
) -> None:
    """Refuse a Ulysses sequence-parallel size that ``UlyssesSPAttentionHF`` cannot run, naming the value.

    SP must divide the query heads (each rank attends with heads / SP of them over the whole sequence), and the
    key/value heads must split over SP ranks or SP ranks over them (then each rank holds one replicated KV head);
    ``seq_len`` must split into SP equal slices; eager attention is refused (it needs an s x s mask). The planner,
    the probe and the recipes run these same rules (:func:`check_layout` among them).

    Raises:
        ConfigError: naming the sequence-parallel option and the value that does not split.
    """
    sp = sequence_parallel
    if sp < 1:
        raise ConfigError(f"{option('sequence_parallel')} must be >= 1, got {sp}")
    if sp == 1:
        return
    hint = _assumed_hint(facts)
    if not facts.num_heads:
        raise ConfigError(
            f"{option('sequence_parallel')} needs the model's attention heads: pass --model-config or --params"
        )
    heads = facts.num_heads // max(1, tensor_parallel)
    if facts.num_heads % max(1, tensor_parallel) or heads % sp:
        per = f" ({facts.num_heads} / tensor {tensor_parallel})" if tensor_parallel > 1 else ""
        raise ConfigError(
            f"{option('sequence_parallel', sp)} does not divide the {heads} attention heads{per}{hint}: Ulysses "
            f"gives each sequence-parallel rank heads / SP of them; choose a {option('sequence_parallel')} dividing "
            f"{heads}"
        )
    kv = (facts.num_kv_heads or facts.num_heads) // max(1, tensor_parallel)
    if kv % sp and sp % kv:
        raise ConfigError(
            f"{option('sequence_parallel', sp)} and the {kv} key/value heads{hint} do not divide one another: Ulysses "
            "splits the key/value heads over the SP ranks (or replicates one per rank when SP is larger); choose a "
            f"{option('sequence_parallel')} dividing {kv} or a multiple of it"
        )
    if seq_len is not None and seq_len % sp:
        raise ConfigError(
            f"{option('seq_len', seq_len)} is not divisible by {option('sequence_parallel', sp)}: each rank holds "
            f"seq_len / SP tokens; choose a length that is a multiple of {sp} (e.g. "
            f"{option('seq_len', seq_len - seq_len % sp or sp)})"
        )
    if attention == "eager":
        raise ConfigError(
            f"{option('sequence_parallel', sp)} needs {option('attention', 'sdpa')} or flash_attention_2: eager "
            "attention builds the whole sequence's s x s score matrix, which Ulysses exists to avoid (DeepSpeed "
            "refuses eager)"
        )


# --- what a rank holds ----------------------------------------------------------------------------------------


def rank_params(facts: ModelFacts, layout: ParallelLayout) -> tuple[float, float]:
    """(dense, expert) parameters one rank holds: (split / TP + replicated) / PP and experts / (EP x PP).

    The dense part's linear layers are divided by TP and the rest (:attr:`ModelFacts.tensor_replicated_params`:
    embedding, norms) is whole on every TP rank, as AutoTP does; Megatron's vocabulary-parallel embedding would
    split the embedding too, so for Megatron this is an upper bound. PP divides evenly (:func:`check_layout` asks for
    stages of equal depth; the first and last stages also hold the embedding and the output layer). Experts are
    divided by EP and by PP, since a stage holds only its own layers' experts; TP does not divide them (DeepSpeed
    MoE's default; Megatron-DeepSpeed's ``--enable-expert-tensor-parallelism`` would).
    """
    dense = facts.num_params - facts.expert_params
    replicated = min(facts.tensor_replicated_params, dense)
    per_stage = (dense - replicated) / layout.tensor + replicated
    return per_stage / layout.pipeline, facts.expert_params / (layout.expert * layout.pipeline)


def rank_partition(facts: ModelFacts, layout: ParallelLayout) -> int:
    """Elements of one rank's ZeRO partition: its dense parameters over DP x SP plus its experts over DP / EP."""
    dense, experts = rank_params(facts, layout)
    return math.ceil(dense / layout.zero_ranks) + math.ceil(experts / layout.expert_data_parallel)


def parallel_model_state_parts(
    facts: ModelFacts,
    stage: int,
    layout: ParallelLayout,
    precision: str = "bf16",
    persistence_threshold: int = 0,
    grads_alive: bool = True,
) -> tuple[dict[str, float], float]:
    """(the ZeRO formula's per-rank terms on the rank's slice, the bytes of stage 3's whole persistent copies).

    The ZeRO formula with K = the rank's dense parameters (:func:`rank_params`) and N = DP x SP, plus the same
    formula for its experts with N = DP / EP (DeepSpeed's expert data-parallel group). Stage-3 persistent parameters
    (norm weights: replicated over TP, split over PP) are kept whole besides their partition: their copies divided
    by PP.
    """
    dense, experts = rank_params(facts, layout)
    parts = predicted_model_state_bytes(dense, stage, layout.zero_ranks, precision, grads_alive=grads_alive)
    if experts:
        moe = predicted_model_state_bytes(
            experts, stage, layout.expert_data_parallel, precision, grads_alive=grads_alive
        )
        parts = {key: parts[key] + moe[key] for key in parts}
    sharded = stage == 3 and layout.zero_ranks > 1
    persistent = persistent_params(facts, persistence_threshold) / layout.pipeline
    return parts, WORKING_BYTES[precision] * persistent if sharded else 0.0


def parallel_model_states(
    facts: ModelFacts,
    stage: int,
    offload: str,
    layout: ParallelLayout,
    precision: str = "bf16",
    lora_rank: int | None = None,
    persistence_threshold: int = 0,
    grads_alive: bool = True,
) -> tuple[float, float]:
    """(device bytes, host bytes) of model states per rank: :func:`parallel_model_state_parts` placed on the device
    or the host by ``offload``. Pure data parallelism is :func:`~common.memory_formulas.guide_model_states` itself."""
    if layout.trivial:
        return guide_model_states(
            facts, stage, offload, layout.world_size, precision, lora_rank, persistence_threshold, grads_alive
        )
    if lora_rank:
        raise ConfigError("--lora-rank with tensor, pipeline or expert parallelism is not estimated: drop one of them")
    parts, whole = parallel_model_state_parts(facts, stage, layout, precision, persistence_threshold, grads_alive)
    return place_states(parts, whole, offload)


# --- DeepSpeed's groups: the layout checked on the engine, and what crosses them --------------------------------


def check_mesh(layout: ParallelLayout, rank: int, engine: Any = None) -> None:
    """After ``deepspeed.initialize``: DeepSpeed's tensor-, expert- and data-parallel groups (and a pipeline engine's
    grid) are those the layout's rank map assumed, else every replica would train on the wrong batches."""
    from deepspeed.utils import groups

    if layout.expert > 1:
        found_ep = groups._get_expert_parallel_rank(f"ep_size_{layout.expert}")
        if found_ep != layout.expert_rank(rank):
            raise RuntimeError(
                f"rank {rank}: DeepSpeed made it expert-parallel rank {found_ep}, the experts were initialised for "
                f"{layout.expert_rank(rank)}"
            )
    assumed = (layout.pipeline_stage(rank), layout.data_parallel_rank(rank), layout.data_parallel)
    grid = getattr(engine, "grid", None)
    if grid is not None:
        found = (grid.get_stage_id(), grid.get_data_parallel_rank(), grid.get_data_parallel_world_size())
        if found != assumed:
            raise RuntimeError(f"rank {rank}: the pipeline grid gives (stage, dp rank, dp size) {found}, not {assumed}")
    if layout.tensor == 1:
        return
    found = (
        groups.get_tensor_model_parallel_rank(),
        groups._get_data_parallel_rank(),
        groups._get_data_parallel_world_size(),
    )
    assumed = (layout.tensor_rank(rank), layout.data_parallel_rank(rank), layout.data_parallel)
    if found != assumed:
        raise RuntimeError(
            f"rank {rank}: DeepSpeed's mesh gives (tp rank, dp rank, dp size) {found}, the data loading assumed "
            f"{assumed}"
        )


def check_replica_batch(layout: ParallelLayout, input_ids: torch.Tensor) -> None:
    """Tensor parallel: fail unless every rank of this replica holds the same ``input_ids`` (a collective).

    Lightning's entry point calls it on its first batch instead of DeepSpeed's own check, which cannot compare the
    (batch dict, batch index) Lightning passes to the engine ("Boolean value of Tensor ... is ambiguous").
    """
    if layout.tensor == 1:
        return
    from deepspeed.utils import groups

    group = groups.get_tensor_model_parallel_group()
    first = input_ids.clone()
    torch.distributed.broadcast(first, groups.get_tensor_model_parallel_src_rank(), group=group)
    same = torch.tensor(float(torch.equal(first, input_ids)), device=input_ids.device)
    torch.distributed.all_reduce(same, op=torch.distributed.ReduceOp.MIN, group=group)  # every rank stops
    if not same.item():
        raise RuntimeError("the ranks of a tensor-parallel group read different batches (data_parallel_rank())")


def gather_tensor_parallel_state_dict(module: torch.nn.Module, rank: int) -> dict[str, Any] | None:
    """Whole weights of an AutoTP-sharded module (ZeRO 0-2) on rank 0, one layer at a time; None elsewhere.

    Every rank must call it: ``GatherReplacedLayerParams`` all-gathers a replaced layer's shards over its
    tensor-parallel group and re-shards them on exit (DeepSpeed's ``engine._replaced_tp_state_dict`` does the same).
    """
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    state: dict[str, Any] = {}
    for prefix, layer in module.named_modules():
        params = list(layer.named_parameters(recurse=False))
        with GatherReplacedLayerParams([p for _, p in params], layer, enabled=bool(params)):
            if rank == 0:
                for name, param in params:
                    state[f"{prefix}.{name}" if prefix else name] = param.detach().to("cpu", copy=True)
    if rank != 0:
        return None
    for name, buffer in module.named_buffers():
        state[name] = buffer.detach().to("cpu", copy=True)
    return state
