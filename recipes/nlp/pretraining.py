"""What the NLP recipe trains and reports: data, the Llama model, loss, evaluation, memory plan, run files, export
and summary.json.

``train.py`` (Lightning), ``train_accelerate.py`` (Accelerate) and ``train_pipeline.py`` (DeepSpeed's pipeline
engine) import this module, so they train the same model on the same data, in the same order, with the same DeepSpeed
config, and write the same run files. The
config is in ``nlp_config.py``; ``describe(cfg)`` is what ``--describe`` prints for the planning tools.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from nlp_config import NLPConfig  # next to this script
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from common import sequence_parallel, tiling
from common.accounting import predicted_model_state_bytes
from common.activation import apply_activation_checkpointing, enable_offloadable_checkpointing
from common.checkpoint import gather_full_state_dict, save_hf_model
from common.config import config_to_dict, dump_yaml, parse_overrides
from common.data import StepSampler
from common.describe import RecipeDescription, local_world, persistent_elements
from common.errors import ConfigError
from common.lint import lint_at_start
from common.memory_formulas import facts_from_model_config, tensor_replicated_numel
from common.metrics import Clock, all_reduce, gpu_peak_flops, memory_kind, mfu, peak_memory_bytes, throughput
from common.model_folder import check_weight_files
from common.resume import ResumePoint, find_resume_point
from common.rundir import env_info, read_metrics, wait_for_rank0_file, write_json_atomic, write_text_atomic
from common.sequence_parallel import SequenceParallel
from common.strategy import RunFacts, cosine_with_warmup, precision_of, resolve_deepspeed_config, zero_stage
from nlp.data import DataError, LMData, build_lm_datasets, load_tokenizer
from nlp.model import (
    LLAMA_SIZES,
    ModelError,
    build_llama_config,
    build_model_from_config,
    flops_per_token,
    generate_sample,
    llama_block_class,
    load_pretrained,
)
from nlp.moe import (
    MOE_SIZES,
    aux_loss,
    build_moe_config,
    build_moe_model,
    expert_numels,
    gather_moe_state_dict,
    split_moe_param_groups,
    to_mixtral_state_dict,
)

TOKENIZER_DIR = "tokenizer"  # where a run keeps the tokenizer it trained (resume and the other ranks load it)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


# --- data ----------------------------------------------------------------------------------------


def tokenizer_source(cfg: NLPConfig, trained_here: bool) -> str | None:
    """Where the run's tokenizer comes from: ``tokenizer=``, the model folder, the run's own, or None (train one).

    Args:
        trained_here: the run directory already holds the tokenizer this run trained (resume, other ranks).
    """
    if cfg.tokenizer:
        return cfg.tokenizer
    if cfg.pretrained is not None and any((cfg.pretrained / name).is_file() for name in TOKENIZER_FILES):
        return str(cfg.pretrained)
    return str(Path(cfg.out_dir) / TOKENIZER_DIR) if trained_here else None


def load_data(cfg: NLPConfig, tokenizer: str | None, world_size: int) -> LMData:
    """Read, split, tokenize and pack the corpus; a tokenizer is trained on the train split when none is given."""
    if tokenizer == str(Path(cfg.out_dir) / TOKENIZER_DIR):  # the run's own: on another node it may not exist yet
        wait_for_rank0_file(Path(cfg.out_dir) / "env.json")  # written after the tokenizer (write_run_files)
    data = build_lm_datasets(
        cfg.data,
        tokenizer,
        cfg.seq_len,
        val_fraction=cfg.val_fraction,
        seed=0,  # the split stays fixed whatever the seed, so val losses of different seeds compare
        max_train_tokens=cfg.max_train_tokens or None,
        max_val_tokens=cfg.max_val_tokens or None,
        vocab_size=cfg.vocab_size,
        text_field=cfg.text_field,
        shifted_labels=True,
    )
    if len(data.train) < cfg.micro_batch_size * world_size:
        raise DataError(
            f"{cfg.data}: the train split gives {len(data.train)} sequences of {cfg.seq_len} tokens, "
            f"fewer than one global micro-batch ({cfg.micro_batch_size} x {world_size} ranks)"
        )
    if len(data.val) < world_size:
        raise DataError(
            f"{cfg.data}: the validation split gives {len(data.val)} sequences of {cfg.seq_len} "
            f"tokens, fewer than the {world_size} ranks; use more text or a shorter seq_len"
        )
    return data


def train_loader(
    data: LMData, cfg: NLPConfig, rank: int, world_size: int, start_step: int, full_length: bool = False
) -> torch.utils.data.DataLoader:
    """Batches in a (seed, step)-determined order: the same on both backends, exact on resume."""
    sampler = StepSampler(
        len(data.train),
        cfg.micro_batch_size,
        cfg.grad_accum,
        rank,
        world_size,
        cfg.seed,
        start_step,
        cfg.max_steps,
        full_length=full_length,
    )
    return torch.utils.data.DataLoader(data.train, batch_size=cfg.micro_batch_size, sampler=sampler)


def eval_batches(data: LMData, cfg: NLPConfig, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's validation blocks ``[b, seq_len + 1]``: every rank gets as many (ZeRO-3 gathers are collective)."""
    blocks = data.val.blocks[: len(data.val) // world_size * world_size]
    mine = blocks[rank::world_size]
    return list(mine.split(cfg.micro_batch_size))


# --- model ---------------------------------------------------------------------------------------


def model_config(cfg: NLPConfig, tokenizer: Any) -> Any:
    """The model's config: a named Llama size sized to the tokenizer, or a local folder's ``config.json``."""
    if cfg.pretrained is None:  # without a tokenizer yet (--describe, hidden_size), the vocabulary is vocab_size
        vocab_size = None if tokenizer is not None else cfg.vocab_size
        if cfg.moe:  # a Mixtral-shaped config whose MoE blocks are DeepSpeed's (nlp/moe.py)
            return build_moe_config(cfg.model, vocab_size=vocab_size, tokenizer=tokenizer, seq_len=cfg.seq_len)
        return build_llama_config(cfg.model, vocab_size=vocab_size, tokenizer=tokenizer, seq_len=cfg.seq_len)
    if not (cfg.pretrained / "config.json").is_file():
        raise ModelError(f"{cfg.pretrained}: no config.json; expected a Hugging Face model folder")
    check_weight_files(cfg.pretrained)  # a truncated *.safetensors: one line naming it, not a traceback on rank 0
    try:
        config = AutoConfig.from_pretrained(
            str(cfg.pretrained), local_files_only=True, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{cfg.pretrained}: cannot read config.json ({exc})") from exc
    if tokenizer is not None and getattr(config, "vocab_size", 0) < len(tokenizer):
        raise ModelError(
            f"{cfg.pretrained}: vocab_size {config.vocab_size} is smaller than the tokenizer's "
            f"{len(tokenizer)} tokens; pass the model's own tokenizer="
        )
    return config


def hidden_size(cfg: NLPConfig) -> int:
    """The model's hidden size (the factory scales buckets to it), read before the tokenizer exists."""
    if cfg.pretrained is None:
        return {**LLAMA_SIZES, **MOE_SIZES}[cfg.model]["hidden_size"]
    return model_config(cfg, tokenizer=None).hidden_size


def deepspeed_config(cfg: NLPConfig, world_size: int, hidden_size: int) -> dict[str, Any]:
    """The factory's DeepSpeed dict for this run (buckets scaled to the hidden size)."""
    facts = RunFacts(
        world_size=world_size,
        micro_batch_size=cfg.micro_batch_size,
        grad_accum=cfg.grad_accum,
        precision=cfg.precision,
        hidden_size=hidden_size,
        gradient_clipping=cfg.gradient_clipping,
        nvme_path=cfg.nvme_path or None,
    )
    ds_config = resolve_deepspeed_config(cfg.preset, facts, parse_overrides(cfg.ds_overrides))
    if cfg.tensor_parallel > 1:
        # AutoTP shards the model inside deepspeed.initialize. train_batch_size stays unset: DeepSpeed derives it
        # as micro x accumulation x world size (not the data-parallel size) and refuses any other value.
        ds_config["tensor_parallel"] = {"autotp_size": cfg.tensor_parallel}
        ds_config.pop("train_batch_size", None)
    if cfg.pipeline_parallel > 1:  # the same: the pipeline engine's batch is micro x accumulation x data parallel
        ds_config.pop("train_batch_size", None)
    return ds_config


def check_tensor_parallel(cfg: NLPConfig, world_size: int, config: Any, ds_config: dict[str, Any]) -> None:
    """Refuse a ``tensor_parallel`` the run cannot use, before any work (one ConfigError naming the fix).

    AutoTP splits attention by heads (query and key/value) and the MLP by its intermediate size, so the degree must
    divide all three; it must divide the ranks too (DeepSpeed builds a data x tensor parallel mesh).
    """
    tp = cfg.tensor_parallel
    if tp == 1:
        return
    if world_size % tp:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ConfigError(
            f"tensor_parallel={tp} does not divide the {world_size} rank(s) (world = tensor_parallel x data "
            f"parallel); use one of {divisors}"
        )
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None) or (config.num_attention_heads if name == "num_key_value_heads" else None)
        if value is not None and value % tp:
            raise ConfigError(f"tensor_parallel={tp} does not divide the model's {name} ({value})")
    if zero_stage(ds_config) == 3:
        raise ConfigError(
            f"tensor_parallel={tp} runs with ZeRO stages 0-2 here (the export gathers tensor-parallel shards, not "
            "ZeRO-3 partitions as well); use preset=deepspeed_stage_1 or deepspeed_stage_2"
        )


def check_pipeline_parallel(
    cfg: NLPConfig, world_size: int, config: Any, ds_config: dict[str, Any], pipeline_engine: bool
) -> None:
    """Refuse a ``pipeline_parallel`` the run cannot use, before any work (one ConfigError naming the fix).

    Args:
        pipeline_engine: the caller is ``train_pipeline.py`` (DeepSpeed's pipeline engine); Lightning and Accelerate
            drive a plain ``DeepSpeedEngine``, which has no pipeline schedule.
    """
    pp = cfg.pipeline_parallel
    if not pipeline_engine:
        if pp > 1:
            raise ConfigError(
                f"pipeline_parallel={pp} runs on recipes/nlp/train_pipeline.py (DeepSpeed's pipeline engine): "
                "Lightning and Accelerate cannot drive engine.train_batch(); launch that script instead"
            )
        return
    if cfg.tensor_parallel > 1:
        raise ConfigError(
            f"tensor_parallel={cfg.tensor_parallel} with the pipeline engine: DeepSpeed's AutoTP shards a plain module "
            "inside deepspeed.initialize and is not wired into PipelineModule; use tensor_parallel on "
            "train_accelerate.py, or pipeline_parallel here, not both"
        )
    if cfg.sequence_parallel > 1:
        raise ConfigError(
            f"sequence_parallel={cfg.sequence_parallel} with the pipeline engine is not supported here (Ulysses "
            "replaces the attention of a transformers model, not of PipelineModule's layers); use sequence_parallel "
            "on train.py or train_accelerate.py"
        )
    if cfg.tiled or cfg.offload_checkpoints:
        raise ConfigError(
            "tiled_mlp_shards / tiled_loss_shards / offload_checkpoints with the pipeline engine are not supported "
            "here (the pipeline's stages run and checkpoint the layers themselves); use them on train.py or "
            "train_accelerate.py"
        )
    if zero_stage(ds_config) >= 2:
        raise ConfigError(
            f"preset={cfg.preset} is ZeRO stage {zero_stage(ds_config)}: DeepSpeed's pipeline engine runs stage 0 or 1 "
            'only ("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"); use preset=deepspeed_stage_1 '
            "(optimizer states sharded over the data-parallel ranks)"
        )
    layers = config.num_hidden_layers
    if pp > layers:
        raise ConfigError(
            f"pipeline_parallel={pp} is more than the model's {layers} decoder layers: every stage needs one at least; "
            f"use at most {layers}"
        )
    if world_size % pp:
        divisors = ", ".join(str(d) for d in range(1, min(world_size, layers) + 1) if world_size % d == 0)
        raise ConfigError(
            f"pipeline_parallel={pp} does not divide the {world_size} rank(s) (world = pipeline_parallel x data "
            f"parallel); use one of {divisors}"
        )
    if getattr(config, "model_type", None) != "llama":
        raise ConfigError(
            f"the pipeline entry point cuts a Llama into layers (embed_tokens, layers, norm, lm_head); the model is "
            f"{getattr(config, 'model_type', None)!r}: use a Llama or train it with train.py / train_accelerate.py"
        )
    if getattr(config, "tie_word_embeddings", False):
        raise ConfigError(
            "the model ties its input embedding to its output layer: the first and last pipeline stages would share "
            "one matrix (TiedLayerSpec), which this recipe does not build; use a model with tie_word_embeddings=false"
        )
    if cfg.activation_checkpointing not in PIPELINE_CHECKPOINT_INTERVAL:
        raise ConfigError(
            f"activation_checkpointing={cfg.activation_checkpointing} is not available on the pipeline engine (it "
            f"checkpoints whole layers); use one of {', '.join(PIPELINE_CHECKPOINT_INTERVAL)}"
        )


# activation_checkpointing -> PipelineModule's activation_checkpoint_interval (layers per checkpointed run; 0: off)
PIPELINE_CHECKPOINT_INTERVAL = {"none": 0, "full": 1, "every_k": 2}


def check_sequence_parallel(cfg: NLPConfig, world_size: int, config: Any) -> None:
    """Refuse a ``sequence_parallel`` the run cannot use, before any work (one ConfigError naming the fix)."""
    if cfg.sequence_parallel == 1:
        return
    if cfg.moe:
        raise ConfigError(
            f"sequence_parallel={cfg.sequence_parallel} with the MoE model {cfg.model!r} is not supported here "
            "(DeepSpeed's MoE layer routes whole sequences); use sequence_parallel=1"
        )
    sequence_parallel.check_sequence_parallel(
        cfg.sequence_parallel,
        world_size,
        cfg.seq_len,
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        cfg.attention,
        cfg.tensor_parallel,
    )


def check_expert_parallel(cfg: NLPConfig, world_size: int, config: Any, ds_config: dict[str, Any]) -> None:
    """Refuse an ``expert_parallel`` or a MoE run the recipe cannot train, before any work (one ConfigError each).

    DeepSpeed places each expert-parallel group inside the data-parallel ranks (``_ensure_divisibility(dp_world_size,
    expert_parallel_size_)``) and gives every rank ``num_experts / expert_parallel`` experts, so the degree must
    divide both; its native MoE layer refuses ZeRO-3 in ``deepspeed.initialize`` (quoted below).
    """
    ep = cfg.expert_parallel
    if ep > 1 and not cfg.moe:
        raise ConfigError(
            f"expert_parallel={ep} needs a DeepSpeed-MoE model: model={' or model='.join(MOE_SIZES)}; {cfg.model!r} "
            "is not one (a dense size, or a local folder, which trains with its own layers and no expert parallelism)"
        )
    if not cfg.moe:
        return
    experts = config.num_local_experts
    if experts % ep:
        divisors = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
        raise ConfigError(f"expert_parallel={ep} does not divide the model's {experts} experts; use one of {divisors}")
    if world_size % ep:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0 and experts % d == 0)
        raise ConfigError(
            f"expert_parallel={ep} does not divide the {world_size} rank(s) (expert-parallel groups lie inside the "
            f"data-parallel ranks); use one of {divisors}"
        )
    if cfg.tensor_parallel > 1:
        raise ConfigError(
            f"tensor_parallel={cfg.tensor_parallel} with the MoE model {cfg.model!r} is not supported here (AutoTP "
            "does not split DeepSpeed's MoE experts); use tensor_parallel=1"
        )
    if zero_stage(ds_config) == 3:
        raise ConfigError(
            f"model={cfg.model} (DeepSpeed MoE) runs with ZeRO stages 1-2: DeepSpeed refuses its MoE layer under "
            'ZeRO-3 ("Native DeepSpeed MoE is not supported with ZeRO Stage 3. Use AutoEP or choose ZeRO stage '
            '1/2."); use preset=deepspeed_stage_1 or deepspeed_stage_2'
        )


def expert_parallel_rank(cfg: NLPConfig, rank: int) -> int:
    """This rank's index in its expert-parallel group: DeepSpeed groups consecutive ranks (``ranks r * EP ..
    r * EP + EP - 1``, ``groups._create_expert_and_data_parallel``), which :func:`check_mesh` verifies."""
    return rank % cfg.expert_parallel


def data_parallel(cfg: NLPConfig, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's (data-parallel rank, data-parallel size): the replica whose batches it reads.

    DeepSpeed's AutoTP mesh is (data parallel, tensor parallel), row-major (``groups._init_tp_mesh_device``):
    ranks ``r * tp .. r * tp + tp - 1`` form replica ``r``'s tensor-parallel group and must read the same batch
    (:func:`check_mesh` verifies it on the engine). DeepSpeed's pipeline topology is (pipe, data), row-major
    (``PipeDataParallelTopology``): stage ``s`` is ranks ``s * dp .. s * dp + dp - 1``, and rank ``r`` reads replica
    ``r % dp``'s batches (the first stage its inputs, the last its labels; ``train_pipeline.py`` checks the grid).
    """
    if cfg.pipeline_parallel > 1:
        dp_size = world_size // cfg.pipeline_parallel
        return rank % dp_size, dp_size
    # Ulysses groups are consecutive ranks too (``parallel_state_sp``), never combined with tensor parallel here.
    group = cfg.tensor_parallel * cfg.sequence_parallel
    return rank // group, world_size // group


def resume_point(cfg: NLPConfig, world_size: int) -> ResumePoint | None:
    """``resume=true``: the checkpoint to load (None for a new run), refused with a ConfigError when it cannot be.

    A different model or config (``tensor_parallel`` too) or no complete checkpoint is refused; another data-parallel
    size goes through a universal checkpoint (ZeRO shards are one per data-parallel rank, and per rank of a
    sequence-parallel group), except with tensor parallelism, whose slices the conversion does not handle here, and
    sequence parallelism, whose conversion is not tested.
    """
    if not cfg.resume:
        return None
    # ZeRO partitions over the data-parallel ranks, and over the ranks of a sequence-parallel group as well.
    dp_size = data_parallel(cfg, 0, world_size)[1] * cfg.sequence_parallel
    resume = find_resume_point(Path(cfg.out_dir), config_to_dict(cfg), dp_size)
    if resume.universal and cfg.sequence_parallel > 1:
        raise ConfigError(
            f"resume with sequence_parallel={cfg.sequence_parallel} needs the world size the checkpoint was written "
            f"with ({resume.saved_world_size} rank(s), now {dp_size}): a universal conversion of a sequence-parallel "
            "run is not tested here"
        )
    if resume.universal and cfg.tensor_parallel > 1:
        raise ConfigError(
            f"resume with tensor_parallel={cfg.tensor_parallel} needs the data-parallel size the checkpoint was "
            f"written with ({resume.saved_world_size}, now {dp_size}): a universal conversion of tensor-parallel "
            "shards is not supported here"
        )
    if resume.universal and cfg.moe:
        raise ConfigError(
            f"resume of a MoE model needs the data-parallel size the checkpoint was written with "
            f"({resume.saved_world_size}, now {dp_size}): a universal conversion of DeepSpeed's expert files is not "
            "supported here"
        )
    return resume


def tokens_per_rank_step(cfg: NLPConfig) -> float:
    """Tokens one rank trains on per optimizer step: the ranks of a tensor- or sequence-parallel group or of a pipeline
    share their replica's."""
    sharing = cfg.tensor_parallel * cfg.pipeline_parallel * cfg.sequence_parallel
    return cfg.micro_batch_size * cfg.grad_accum * cfg.seq_len / sharing


def check_replica_batch(cfg: NLPConfig, input_ids: torch.Tensor) -> None:
    """Tensor parallel: fail unless every rank of this replica holds the same ``input_ids`` (a collective).

    Lightning's entry point calls it on its first batch instead of DeepSpeed's own check, which cannot compare the
    (batch dict, batch index) Lightning passes to the engine ("Boolean value of Tensor ... is ambiguous").
    """
    if cfg.tensor_parallel == 1:
        return
    from deepspeed.utils import groups

    group = groups.get_tensor_model_parallel_group()
    first = input_ids.clone()
    torch.distributed.broadcast(first, groups.get_tensor_model_parallel_src_rank(), group=group)
    same = torch.tensor(float(torch.equal(first, input_ids)), device=input_ids.device)
    torch.distributed.all_reduce(same, op=torch.distributed.ReduceOp.MIN, group=group)  # every rank stops
    if not same.item():
        raise RuntimeError("the ranks of a tensor-parallel group read different batches (data_parallel())")


def check_mesh(cfg: NLPConfig, rank: int, world_size: int) -> None:
    """After ``deepspeed.initialize``: DeepSpeed's tensor- and data-parallel groups are those :func:`data_parallel`
    assumed (else every replica would train on the wrong batches)."""
    from deepspeed.utils import groups

    if cfg.moe:
        found_ep = groups._get_expert_parallel_rank(f"ep_size_{cfg.expert_parallel}")
        if found_ep != expert_parallel_rank(cfg, rank):
            raise RuntimeError(
                f"rank {rank}: DeepSpeed made it expert-parallel rank {found_ep}, the experts were initialised for "
                f"{expert_parallel_rank(cfg, rank)}"
            )
    if cfg.tensor_parallel == 1:
        return
    dp_rank, dp_size = data_parallel(cfg, rank, world_size)
    found = (
        groups.get_tensor_model_parallel_rank(),
        groups._get_data_parallel_rank(),
        groups._get_data_parallel_world_size(),
    )
    if found != (rank % cfg.tensor_parallel, dp_rank, dp_size):
        raise RuntimeError(
            f"rank {rank}: DeepSpeed's mesh gives (tp rank, dp rank, dp size) {found}, the data loading assumed "
            f"{(rank % cfg.tensor_parallel, dp_rank, dp_size)}"
        )


def resolve_ds_config(cfg: NLPConfig, world_size: int, hidden_size: int) -> dict[str, Any]:
    """The run's DeepSpeed dict, checked against the guides' pitfalls before any work (errors refuse the run)."""
    ds_config = deepspeed_config(cfg, world_size, hidden_size)
    lint_at_start(ds_config, config_to_dict(cfg), hidden_size=hidden_size, world_size=world_size)
    return ds_config


def build_model(cfg: NLPConfig, config: Any, attention: str, rank: int = 0) -> Any:
    """The causal LM, randomly initialised from ``config`` or loaded from the model folder.

    Under ZeRO-3 the caller keeps DeepSpeed's partitioned construction active (Lightning's ``configure_model``,
    Accelerate's ``zero3_init_flag``): ``from_config`` and ``from_pretrained`` then create every weight already
    sharded.
    """
    torch.manual_seed(cfg.seed)
    if cfg.moe:  # this rank's experts (rank: its place in the expert-parallel group)
        model = build_moe_model(config, cfg.expert_parallel, expert_parallel_rank(cfg, rank), cfg.seed, attention)
    elif cfg.pretrained is None:
        model = build_model_from_config(config, attn_implementation=attention)
    else:
        model = load_pretrained(
            cfg.pretrained,
            torch_dtype=torch.float32,
            attn_implementation=attention,
            trust_remote_code=cfg.trust_remote_code,
        )
    model.config.use_cache = False  # training: no KV cache
    if cfg.offload_checkpoints:  # every layer, the form DeepSpeed's offload recognises (common/activation.py)
        enable_offloadable_checkpointing(model)
        print("activation checkpointing: full, by transformers' gradient checkpointing (offload_checkpoints=true)")
    elif cfg.activation_checkpointing != "none":
        block = llama_block_class() if model.config.model_type == "llama" else None
        report = apply_activation_checkpointing(
            model, cfg.activation_checkpointing, block_classes=[block] if block else None
        )
        print(report.summary())
    tiling.tile_mlp(model, cfg.tiled_mlp_shards)
    if cfg.tiled_loss_shards > 1:
        tiling.tile_loss(model, cfg.tiled_loss_shards)
    return model


def param_sizes(model: torch.nn.Module) -> list[int]:
    """Element count of every parameter (whole sizes, also when ZeRO-3 has partitioned them)."""
    return [getattr(p, "ds_numel", p.numel()) for p in model.parameters()]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: matrices decay, norm weights (1-D) do not. ZeRO-3 shards are empty: read ``ds_shape``.

    A MoE model's experts go to groups of their own (DeepSpeed's ZeRO 1/2 requires them: it reduces expert gradients
    over the expert data-parallel ranks, not over every rank).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    ndim = [len(getattr(p, "ds_shape", p.shape)) for p in params]
    groups = [
        {"params": [p for p, n in zip(params, ndim) if n >= 2], "weight_decay": weight_decay},
        {"params": [p for p, n in zip(params, ndim) if n < 2], "weight_decay": 0.0},
    ]
    if any(not getattr(p, "allreduce", True) for p in params):  # DeepSpeed marks expert parameters so
        return split_moe_param_groups(groups)
    return groups


def held_param_elements(model: torch.nn.Module) -> int:
    """Parameter elements this rank holds: under ZeRO-3 its partitions (``ds_tensor``), else whole tensors."""
    held = 0
    for param in model.parameters():
        ds_tensor = getattr(param, "ds_tensor", None)
        held += ds_tensor.numel() if ds_tensor is not None else param.numel()
    return held


def lr_lambda(cfg: NLPConfig) -> Any:
    """LambdaLR multiplier: warmup, then cosine to ``min_lr_ratio``."""
    return lambda step: cosine_with_warmup(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)


def train_loss(
    cfg: NLPConfig,
    model: Any,
    module: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    sp: SequenceParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss to back-propagate, LM loss, MoE load-balancing loss or None): the MoE layers' auxiliary loss summed
    over layers, weighted by ``moe_aux_loss_coef`` (``module``: the transformers model the engine wraps).

    Sequence parallel (``sp``): the forward runs on this rank's slice of every sequence; the LM loss returned is the
    whole sequences' (the same on the group's ranks), the loss to back-propagate this rank's share of it.
    """
    tiled = cfg.tiled_loss_shards > 1
    if sp is not None:
        total, loss = sequence_parallel.lm_loss(model, input_ids, labels, sp, tiled)
        return total, loss, None
    loss = lm_loss(model, input_ids, labels, tiled)
    aux = aux_loss(module) if cfg.moe else None
    return (loss if aux is None else loss + cfg.moe_aux_loss_coef * aux), loss, aux


def lm_loss(model: Any, input_ids: torch.Tensor, labels: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """Next-token cross entropy, in fp32 whatever the weights' dtype (labels are already shifted).

    ``tiled``: the model computes it a slice of the sequence at a time and returns the sum (common/tiling.py)."""
    if tiled:  # the mean over the tokens F.cross_entropy averages: those not labelled IGNORE_INDEX
        summed = model(input_ids=input_ids, use_cache=False, token_loss_labels=labels)
        return summed / (labels != tiling.IGNORE_INDEX).sum()
    logits = model(input_ids=input_ids, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


@torch.no_grad()
def evaluate(model: Any, batches: list[torch.Tensor], device: torch.device) -> float:
    """Mean validation loss over every rank's blocks (all ranks must call it: ZeRO-3 forwards are collective)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for block in batches:
        block = block.to(device)
        total[0] += lm_loss(model, block[:, :-1], block[:, 1:]).double() * block.shape[0]
        total[1] += block.shape[0]
    model.train(was_training)
    total = all_reduce(total)
    return float(total[0] / total[1])


# --- memory plan ---------------------------------------------------------------------------------


@dataclass
class MemoryPlan:
    """What each rank should hold (guide 1, 2.2), with stage-3 persistent parameters kept whole."""

    num_params: int
    persistent_params: int  # elements under stage3_param_persistence_threshold: whole on every rank
    stage: int
    precision: str
    world_size: int
    predicted_bytes_per_rank: dict[str, int]  # params, grads, optimizer, model_states after a step
    grads_during_backward_bytes: int
    tensor_parallel: int = 1
    params_per_tensor_rank: int | None = None  # under tensor parallelism: the slice one rank holds before ZeRO
    expert_parallel: int = 1
    expert_params_per_rank: int = 0  # this rank's experts (num_experts / EP per layer), in num_params
    pipeline_parallel: int = 1  # train_pipeline.py: a rank holds its stage's layers, about 1/PP of the model

    def text(self) -> str:
        """The lines printed before training."""
        p, mb = self.predicted_bytes_per_rank, 1e6
        tp = self.tensor_parallel
        split = (
            f"\n  tensor_parallel={tp}: each rank holds {self.params_per_tensor_rank / 1e6:.2f}M of them (AutoTP "
            f"splits the linear layers over {tp} ranks, the embedding and norms stay whole), and ZeRO shards that "
            f"over the {self.world_size // tp} data-parallel rank(s)"
            if tp > 1
            else ""
        )
        if self.pipeline_parallel > 1:
            split += (
                f"\n  pipeline_parallel={self.pipeline_parallel}: each rank holds its stage's layers, about "
                f"1/{self.pipeline_parallel} of the model, and ZeRO shards that over the "
                f"{self.world_size // self.pipeline_parallel} data-parallel rank(s)"
            )
        if self.expert_params_per_rank:
            split += (
                f"\n  experts: {self.expert_params_per_rank / 1e6:.2f}M of the parameters on this rank "
                f"(1/{self.expert_parallel} of every MoE layer's experts), their states sharded over "
                f"{self.world_size // self.expert_parallel} expert data-parallel rank(s)"
            )
        return (
            f"memory plan: ZeRO-{self.stage} {self.precision}, {self.world_size} rank(s), "
            f"{self.num_params / 1e6:.2f}M parameters ({self.persistent_params / 1e6:.2f}M under the "
            f"persistence threshold stay whole on every rank)\n"
            f"  each rank holds (predicted, after a step): params {p['params'] / mb:.1f} MB + optimizer "
            f"{p['optimizer'] / mb:.1f} MB (fp32 master + Adam m, v) = {p['model_states'] / mb:.1f} MB of model "
            f"states; gradients add {self.grads_during_backward_bytes / mb:.1f} MB during backward; activations "
            "and ZeRO buffers come on top" + split
        )


def memory_plan(
    model: torch.nn.Module,
    ds_config: dict[str, Any],
    world_size: int,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> MemoryPlan:
    """The plan for ``model`` (built, not yet sharded by AutoTP) under ``ds_config`` on ``world_size`` ranks.

    Under tensor parallelism a rank holds the split linear layers' 1/TP and the rest whole
    (:func:`~common.memory_formulas.tensor_replicated_numel`), and ZeRO shards that slice over world / TP ranks. A MoE
    model's experts on this rank (1/``expert_parallel`` of each layer's) have their states sharded by ZeRO over the
    expert data-parallel ranks, world / ``expert_parallel``. Under the pipeline engine a rank holds its stage's layers,
    planned as the planner does (:func:`~common.memory_formulas.rank_params`: parameters / PP, the embedding and the
    output layer counted as any layer's), sharded by ZeRO over world / PP ranks.
    """
    sizes = param_sizes(model)
    stage, precision = zero_stage(ds_config), precision_of(ds_config)
    persistent = persistent_elements(sizes, ds_config)
    expert_elements = expert_numels(model)[1]
    held, shards, per_tensor_rank = sum(sizes) - expert_elements, world_size, None
    if tensor_parallel > 1:
        replicated = tensor_replicated_numel(model)
        held = per_tensor_rank = (held - replicated) // tensor_parallel + replicated
        shards = world_size // tensor_parallel
    if pipeline_parallel > 1:
        held, shards = held // pipeline_parallel, world_size // pipeline_parallel
    predicted = predicted_model_state_bytes(held, stage, shards, precision, persistent_params=persistent)
    during = predicted_model_state_bytes(held, stage, shards, precision, True, persistent)
    if expert_elements:
        edp = world_size // expert_parallel
        moe = predicted_model_state_bytes(expert_elements, stage, edp, precision)
        moe_during = predicted_model_state_bytes(expert_elements, stage, edp, precision, True)
        predicted = {k: predicted[k] + moe[k] for k in predicted}
        during = {k: during[k] + moe_during[k] for k in during}
    return MemoryPlan(
        num_params=sum(sizes),
        persistent_params=persistent,
        stage=stage,
        precision=precision,
        world_size=world_size,
        predicted_bytes_per_rank={k: int(v) for k, v in predicted.items()},
        grads_during_backward_bytes=int(during["grads"]),
        tensor_parallel=tensor_parallel,
        params_per_tensor_rank=per_tensor_rank,
        expert_parallel=expert_parallel,
        expert_params_per_rank=expert_elements,
        pipeline_parallel=pipeline_parallel,
    )


def measured_text(measured: dict[str, int]) -> str:
    """The line printed after the first step: what the DeepSpeed engine really holds on rank 0."""
    mb = 1e6
    return (
        f"memory measured on rank 0 after its first step: params {measured['params'] / mb:.1f} MB, optimizer "
        f"{measured['optimizer'] / mb:.1f} MB, grads {measured['grads'] / mb:.1f} MB = model states "
        f"{measured['model_states'] / mb:.1f} MB; ZeRO buffers {measured['buffers'] / mb:.1f} MB"
    )


# --- what --describe prints ----------------------------------------------------------------------


def check_tiling(cfg: NLPConfig, config: Any) -> None:
    """Refuse a tiled MLP or loss, or a checkpoint offload, the run cannot use, before any work (common/tiling.py,
    common/activation.py)."""
    if cfg.moe and (cfg.tiled or cfg.offload_checkpoints):
        raise ConfigError(
            f"tiled_mlp_shards / tiled_loss_shards / offload_checkpoints with the MoE model {cfg.model!r} are not "
            "supported here (DeepSpeed's MoE layer routes whole sequences); leave them off"
        )
    if cfg.tensor_parallel > 1 and cfg.tiled:
        raise ConfigError(
            f"tiled_mlp_shards / tiled_loss_shards with tensor_parallel={cfg.tensor_parallel} are not supported here "
            "(AutoTP replaces the layers they slice; untested together); use sequence_parallel for long sequences"
        )
    if cfg.offload_checkpoints and cfg.activation_checkpointing != "full":
        raise ConfigError(
            f"offload_checkpoints moves the inputs of checkpointed layers to host memory; with "
            f"activation_checkpointing={cfg.activation_checkpointing} it needs activation_checkpointing=full"
        )
    tiling.check_tiling(cfg.tiled_mlp_shards, cfg.tiled_loss_shards, getattr(config, "tie_word_embeddings", False))


def check_combinations(
    cfg: NLPConfig, world_size: int, config: Any, ds_config: dict[str, Any], pipeline_engine: bool = False
) -> None:
    """Every refusal of a parallelism or memory option the run cannot use, before any work (``--describe`` and the
    Lightning and Accelerate entry points)."""
    check_pipeline_parallel(cfg, world_size, config, ds_config, pipeline_engine)
    check_tensor_parallel(cfg, world_size, config, ds_config)
    check_expert_parallel(cfg, world_size, config, ds_config)
    check_sequence_parallel(cfg, world_size, config)
    check_tiling(cfg, config)


def describe(cfg: NLPConfig, pipeline_engine: bool = False) -> RecipeDescription:
    """The run as the planning tools see it: reads the model's config only (no corpus, no weights), writes nothing.

    Parameters are counted on the meta device. A named size's vocabulary is the tokenizer's when one exists already
    (``tokenizer=``, the model folder's, or the run's own on resume), else ``vocab_size`` (the BPE the run would
    train has that many tokens). ``pipeline_engine``: asked by ``train_pipeline.py`` (:func:`check_pipeline_parallel`).
    """
    devices, num_nodes = local_world(cfg.devices, cfg.num_nodes)
    world_size = devices * num_nodes
    own_tokenizer = cfg.resume and (Path(cfg.out_dir) / TOKENIZER_DIR).is_dir()
    source = tokenizer_source(cfg, trained_here=own_tokenizer)
    config = model_config(cfg, load_tokenizer(source) if source else None)
    facts = facts_from_model_config(config, source=f"recipe nlp (model={cfg.model})")
    ds_config = deepspeed_config(cfg, world_size, config.hidden_size)
    check_combinations(cfg, world_size, config, ds_config, pipeline_engine)
    return RecipeDescription(
        recipe="nlp",
        config=config_to_dict(cfg),
        world_size=world_size,
        devices_per_node=devices,
        num_nodes=num_nodes,
        ds_config=ds_config,
        model=facts,
        seq_len=cfg.seq_len,
        micro_batch_size=cfg.micro_batch_size,
        persistent_params=persistent_elements(facts.param_numels, ds_config),
    )


# --- run files -----------------------------------------------------------------------------------


def write_run_files(
    cfg: NLPConfig,
    out_dir: Path,
    ds_config: dict[str, Any],
    data: LMData,
    world_size: int,
    device: str,
    trained_tokenizer: bool,
) -> None:
    """Rank 0: ``config.yaml``, ``ds_config.json``, ``env.json`` and the trained tokenizer."""
    write_text_atomic(out_dir / "config.yaml", dump_yaml(config_to_dict(cfg)))
    write_json_atomic(out_dir / "ds_config.json", ds_config)
    if trained_tokenizer:
        data.tokenizer.save_pretrained(str(out_dir / TOKENIZER_DIR))
    # Last: ranks on other nodes wait for env.json before they load the tokenizer (load_data).
    write_json_atomic(out_dir / "env.json", {**env_info(device, world_size), "data": data.info()})


def initial_val_loss(out_dir: Path) -> float | None:
    """The step-0 validation loss recorded in ``metrics.jsonl`` (read back on resume)."""
    return next((r["val_loss"] for r in read_metrics(out_dir) if r["step"] == 0 and "val_loss" in r), None)


def final_export(
    model: Any,
    state_dict: dict[str, torch.Tensor],
    tokenizer: Any,
    out_dir: Path,
    fixed_batch: torch.Tensor,
    trained_logits: torch.Tensor,
    cfg: NLPConfig,
    attention: str,
    device: torch.device,
) -> tuple[dict[str, Any], str]:
    """Rank 0: write ``final/`` (Hugging Face format), reload it, compare logits, and generate the sample.

    The reload is what a user does with the export (``AutoModelForCausalLM.from_pretrained``), so the check
    proves the consolidated weights are the trained ones; the sample comes from the reloaded copy too (on
    rank 0's device: a 7B model would take minutes to generate on a CPU).

    Returns:
        ``summary.json``'s ``export_check`` and ``sample`` (the prompt and its continuation).
    """
    unset_hf_deepspeed_config()  # training is over: what follows is plain single-process transformers code
    if not cfg.moe:  # drop non-persistent buffers (rotary inv_freq): not part of a checkpoint
        keys = set(model.state_dict())
        state_dict = {k: v for k, v in state_dict.items() if k in keys}
    final = save_hf_model(model, state_dict, out_dir / "final", tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(
        str(final), local_files_only=True, attn_implementation=attention, trust_remote_code=cfg.trust_remote_code
    )
    reloaded.to(device).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=fixed_batch[:, :-1].to(device), use_cache=False).logits.float().cpu()
    scale = trained_logits.abs().max().item()
    check = {
        "batch": list(fixed_batch[:, :-1].shape),
        "dtype": str(next(reloaded.parameters()).dtype).removeprefix("torch."),
        "max_abs_logit_diff": (logits - trained_logits).abs().max().item(),
        "max_abs_logit": scale,
        "loss_trained": F.cross_entropy(trained_logits.flatten(0, 1), fixed_batch[:, 1:].flatten()).item(),
        "loss_reloaded": F.cross_entropy(logits.flatten(0, 1), fixed_batch[:, 1:].flatten()).item(),
    }
    check["ok"] = check["max_abs_logit_diff"] <= 2**-6 * max(1.0, scale)  # a few bf16 ulps of the largest logit
    continuation = ""
    if cfg.sample_tokens:
        # Greedy, so a rerun gives the same text; the penalty keeps a small model out of one-token loops.
        continuation = generate_sample(
            reloaded,
            AutoTokenizer.from_pretrained(str(final)),
            cfg.sample_prompt,
            cfg.sample_tokens,
            repetition_penalty=1.3,
        )
    return check, cfg.sample_prompt + continuation


# --- summary.json --------------------------------------------------------------------------------


@dataclass
class NLPSummary:
    """``summary.json``: the keys every recipe reports, plus the NLP figures (the same keys on every entry point;
    ``pipeline`` is None but on ``train_pipeline.py``)."""

    val_loss: float  # the last evaluation's, over every rank's validation blocks
    val_perplexity: float
    initial_val_loss: float | None  # step 0's (read back from metrics.jsonl on resume)
    val_loss_ratio: float | None
    throughput: dict[str, Any]  # tokens/s/device over the median step
    mfu: float | None  # None on a CPU or an unknown GPU
    peak_memory_bytes: int  # the largest over ranks
    memory_kind: str
    model_state_bytes_per_rank: int | None  # counted on the DeepSpeed engine after the first step
    wall_time_s: float  # rank 0, from the start of main()
    preset: str
    zero_stage: int
    stage3_param_persistence_threshold: int | None
    world_size: int
    attention: str
    precision: str
    model: str
    backend: str
    steps: int
    tokens_per_step: int  # over all ranks
    median_step_s: float
    model_state_bytes_measured: dict[str, int]
    memory_plan: MemoryPlan
    params_at_construction: dict[str, int]  # elements rank 0 held right after construction, of num_params
    data: dict[str, Any]
    export_check: dict[str, Any]
    sample: str
    pipeline: dict[str, Any] | None = None  # train_pipeline.py: stages, micro-batches, parameter bytes of each rank
    moe: dict[str, Any] | None = None  # MoE runs: experts, top_k, expert_parallel, the last logged aux_loss

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def headline(self, out_dir: Path) -> str:
        """The lines printed when the run ends."""
        initial = f"{self.initial_val_loss:.4f}" if self.initial_val_loss is not None else "n/a"
        ratio = f"{self.val_loss_ratio:.3f}" if self.val_loss_ratio is not None else "n/a"
        return (
            f"sample: {self.sample!r}\n"
            f"val_loss {self.val_loss:.4f} (step 0: {initial}, ratio {ratio}); "
            f"{self.throughput['value']:.0f} tokens/s/device; wall {self.wall_time_s:.0f} s; run directory {out_dir}"
        )


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


def finish(
    cfg: NLPConfig,
    ds_config: dict[str, Any],
    model: Any,
    data: LMData,
    config: Any,
    attention: str,
    device: torch.device,
    rank: int,
    world_size: int,
    clock: Clock,
    backend: str,
    steps: int,
    val_loss: float,
    model_states: dict[str, int],
    plan: MemoryPlan,
    held_at_construction: int,
) -> NLPSummary | None:
    """After training, on every rank: logits on a fixed batch, whole weights and peak memory (collective); then rank 0
    writes ``final/``, checks and samples it, and returns the summary (None on the other ranks).

    Args:
        model: the transformers model (its ZeRO-3 parameters are gathered one at a time).
        config: the model's config (FLOPs per token for the MFU).
        val_loss: the last evaluation's.
        model_states: ``common.accounting.model_state_bytes`` after the first step ({} when no step ran).
        held_at_construction: parameter elements rank 0 held right after construction.
    """
    out_dir = Path(cfg.out_dir)
    fixed = data.val.blocks[:2]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=fixed[:, :-1].to(device), use_cache=False).logits.float().cpu()
    if cfg.moe:  # every expert from its expert-parallel rank, then under transformers' Mixtral names
        state = gather_moe_state_dict(model, cfg.expert_parallel, rank)
        state = to_mixtral_state_dict(state, config) if state is not None else None
    else:
        gather = gather_tensor_parallel_state_dict if cfg.tensor_parallel > 1 else gather_full_state_dict
        state = gather(model, rank)
    peak = int(all_reduce(torch.tensor(float(peak_memory_bytes()), device=device), "max").item())
    if rank != 0:
        return None
    export_check, sample = final_export(model, state, data.tokenizer, out_dir, fixed, logits, cfg, attention, device)
    return summarize(
        cfg,
        ds_config,
        data,
        config,
        attention,
        world_size,
        clock,
        backend,
        steps,
        val_loss,
        model_states,
        plan,
        held_at_construction,
        peak,
        export_check,
        sample,
    )


def summarize(
    cfg: NLPConfig,
    ds_config: dict[str, Any],
    data: LMData,
    config: Any,
    attention: str,
    world_size: int,
    clock: Clock,
    backend: str,
    steps: int,
    val_loss: float,
    model_states: dict[str, int],
    plan: MemoryPlan,
    held_at_construction: int,
    peak: int,
    export_check: dict[str, Any],
    sample: str,
    pipeline: dict[str, Any] | None = None,
) -> NLPSummary:
    """Rank 0, once ``final/`` is written and checked: the run's ``summary.json`` (:func:`finish`'s arguments, plus the
    peak memory over ranks, the export check, the sample and the pipeline's layout when there is one)."""
    out_dir = Path(cfg.out_dir)
    tokens_per_step = tokens_per_rank_step(cfg)
    tokens_per_s = tokens_per_step / clock.median_step()
    initial = initial_val_loss(out_dir)
    return NLPSummary(
        val_loss=val_loss,
        val_perplexity=math.exp(min(val_loss, 700.0)),
        initial_val_loss=initial,
        val_loss_ratio=val_loss / initial if initial else None,
        throughput=throughput(tokens_per_s, "tokens/s/device"),
        mfu=mfu(tokens_per_s, flops_per_token(config, cfg.seq_len), gpu_peak_flops()),
        peak_memory_bytes=peak,
        memory_kind=memory_kind(),
        model_state_bytes_per_rank=model_states.get("model_states"),
        wall_time_s=round(clock.wall(), 1),
        preset=cfg.preset,
        zero_stage=zero_stage(ds_config),
        stage3_param_persistence_threshold=ds_config["zero_optimization"].get("stage3_param_persistence_threshold"),
        world_size=world_size,
        attention=attention,
        precision=precision_of(ds_config),
        model=cfg.model,
        backend=backend,
        steps=steps,
        tokens_per_step=round(tokens_per_step * world_size),
        median_step_s=round(clock.median_step(), 4),
        model_state_bytes_measured=model_states,
        memory_plan=plan,
        params_at_construction={"elements_on_rank0": held_at_construction, "num_params": plan.num_params},
        data=data.info(),
        export_check=export_check,
        sample=sample,
        pipeline=pipeline,
        moe=moe_summary(cfg, config, out_dir) if cfg.moe else None,
    )


def moe_summary(cfg: NLPConfig, config: Any, out_dir: Path) -> dict[str, Any]:
    """``summary.json``'s ``moe``: the routing setup and the last logged load-balancing loss."""
    aux = [r["aux_loss"] for r in read_metrics(out_dir) if "aux_loss" in r]
    return {
        "num_experts": config.num_local_experts,
        "top_k": config.num_experts_per_tok,
        "expert_parallel": cfg.expert_parallel,
        "aux_loss_coef": cfg.moe_aux_loss_coef,
        "aux_loss": aux[-1] if aux else None,
        "drop_tokens": False,
    }
