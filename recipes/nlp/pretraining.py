"""What the NLP recipe trains and reports: data, the model, the run's layout, loss, evaluation, memory plan, run files,
export and summary.json.

``train.py`` (Lightning), ``train_accelerate.py`` (Accelerate) and ``train_pipeline.py`` (DeepSpeed's pipeline
engine) import this module, so they train the same model on the same data, in the same order, with the same DeepSpeed
config, and write the same run files. The config is in ``nlp_config.py``; what differs between the dense Llama and
the Mixture-of-Experts model is ``cfg.family`` (nlp/family.py); how the ranks split the run is one
``common.parallel.ParallelLayout`` (:func:`run_layout`), which every loop reads the same way. ``describe(cfg)`` is
what ``--describe`` prints for the planning tools.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from nlp_config import NLPConfig  # next to this script
from nlp_layout import MemoryPlan, run_layout, tokens_per_rank_step  # next to this script: the run's layout
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from common import sequence_parallel, tiling
from common.activation import apply_activation_checkpointing, enable_offloadable_checkpointing
from common.checkpoint import gather_full_state_dict, save_hf_model
from common.comms_log import summary_communication
from common.config import config_to_dict, dump_yaml, parse_overrides
from common.data import StepSampler
from common.describe import RecipeDescription, local_world
from common.lint import lint_at_start
from common.memory_formulas import facts_from_model_config
from common.metrics import Clock, all_reduce, gpu_peak_flops, memory_kind, mfu, peak_memory_bytes, throughput
from common.model_folder import check_weight_files
from common.parallel import (
    ParallelLayout,
    gather_tensor_parallel_state_dict,
)
from common.rundir import (
    env_info,
    read_metrics,
    summary_fields,
    wait_for_rank0_file,
    write_json_atomic,
    write_text_atomic,
)
from common.sequence_parallel import SequenceParallel
from common.strategy import RunFacts, cosine_with_warmup, precision_of, resolve_deepspeed_config, zero_stage
from nlp.data import DataError, LMData, build_lm_datasets, load_tokenizer
from nlp.model import ModelError, generate_sample, llama_block_class, load_pretrained

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
    """Batches in a (seed, step)-determined order: the same on both backends, exact on resume.

    ``rank`` and ``world_size`` are the replica's (``layout.data_parallel_rank(rank)``, ``layout.data_parallel``).
    """
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
    """This replica's validation blocks ``[b, seq_len + 1]``: every replica gets as many (ZeRO-3 gathers are
    collective). The same blocks at every evaluation: step 0's val loss and the last one's are the loss on one fixed
    set of batches before and after training."""
    blocks = data.val.blocks[: len(data.val) // world_size * world_size]
    mine = blocks[rank::world_size]
    return list(mine.split(cfg.micro_batch_size))


# --- model ---------------------------------------------------------------------------------------


def model_config(cfg: NLPConfig, tokenizer: Any) -> Any:
    """The model's config: a named size sized to the tokenizer (width and depth keys on top), or a local folder's
    ``config.json``."""
    if cfg.pretrained is None:  # without a tokenizer yet (--describe, hidden_size), the vocabulary is vocab_size
        vocab_size = None if tokenizer is not None else cfg.vocab_size
        return cfg.family.config(cfg.model, vocab_size, tokenizer, cfg.seq_len, **cfg.shape_overrides)
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
    return model_config(cfg, tokenizer=None).hidden_size


def deepspeed_config(cfg: NLPConfig, world_size: int, hidden_size: int) -> dict[str, Any]:
    """The factory's DeepSpeed dict for this run (buckets scaled to the hidden size)."""
    facts = RunFacts.from_fields(cfg, world_size, hidden_size)
    ds_config = resolve_deepspeed_config(cfg.preset, facts, parse_overrides(cfg.ds_overrides))
    if cfg.tensor_parallel > 1:  # AutoTP shards the model inside deepspeed.initialize
        ds_config["tensor_parallel"] = {"autotp_size": cfg.tensor_parallel}
    if cfg.tensor_parallel > 1 or cfg.pipeline_parallel > 1:
        # DeepSpeed derives train_batch_size itself (micro x accumulation x the world size under AutoTP, x the
        # data-parallel size under the pipeline engine) and refuses any other value.
        ds_config.pop("train_batch_size", None)
    return ds_config


def resolve_ds_config(cfg: NLPConfig, world_size: int, hidden_size: int) -> dict[str, Any]:
    """The run's DeepSpeed dict (an FSDP2 preset's run config), checked for known pitfalls (lint rules) before any
    work (errors refuse the run)."""
    ds_config = deepspeed_config(cfg, world_size, hidden_size)
    lint_at_start(ds_config, config_to_dict(cfg), hidden_size=hidden_size, world_size=world_size)
    return ds_config


def build_model(cfg: NLPConfig, config: Any, attention: str, expert_rank: int = 0) -> Any:
    """The causal LM, randomly initialised from ``config`` or loaded from the model folder.

    Under ZeRO-3 the caller keeps DeepSpeed's partitioned construction active (Lightning's ``configure_model``,
    Accelerate's ``zero3_init_flag``): ``from_config`` and ``from_pretrained`` then create every weight already
    sharded. A MoE model holds the experts of ``expert_rank`` (``layout.expert_rank(rank)``).
    """
    torch.manual_seed(cfg.seed)
    if cfg.pretrained is None:
        model = cfg.family.build(config, attention, cfg.seed, expert_rank)
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


def param_groups(model: torch.nn.Module, cfg: NLPConfig) -> list[dict[str, Any]]:
    """AdamW groups: matrices decay, norm weights (1-D) do not (ZeRO-3 shards are empty: read ``ds_shape``); the
    model family splits them further if it must (a MoE model's experts)."""
    params = [p for p in model.parameters() if p.requires_grad]
    ndim = [len(getattr(p, "ds_shape", p.shape)) for p in params]
    groups = [
        {"params": [p for p, n in zip(params, ndim) if n >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p, n in zip(params, ndim) if n < 2], "weight_decay": 0.0},
    ]
    return cfg.family.param_groups(groups)


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


# --- loss and evaluation -------------------------------------------------------------------------


def train_loss(
    cfg: NLPConfig,
    model: Any,
    module: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    sp: SequenceParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss to back-propagate, LM loss, the model's auxiliary loss or None): ``cfg.family.loss`` adds what the model
    adds to the LM loss (a MoE router's load-balancing loss; ``module``: the transformers model the engine wraps).

    Sequence parallel (``sp``): the forward runs on this rank's slice of every sequence; the LM loss returned is the
    whole sequences' (the same on the group's ranks), the loss to back-propagate this rank's share of it.
    """
    tiled = cfg.tiled_loss_shards > 1
    if sp is not None:
        total, loss = sequence_parallel.lm_loss(model, input_ids, labels, sp, tiled)
        return total, loss, None
    loss = lm_loss(model, input_ids, labels, tiled)
    total, aux = cfg.family.loss(loss, module)
    return total, loss, aux


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


# --- what --describe prints ----------------------------------------------------------------------


def describe(cfg: NLPConfig, pipeline_engine: bool = False) -> RecipeDescription:
    """The run as the planning tools see it: reads the model's config only (no corpus, no weights), writes nothing.

    Parameters are counted on the meta device. A named size's vocabulary is the tokenizer's when one exists already
    (``tokenizer=``, the model folder's, or the run's own on resume), else ``vocab_size`` (the BPE the run would
    train has that many tokens). ``pipeline_engine``: asked by ``train_pipeline.py`` (:func:`run_layout`).
    """
    devices, num_nodes = local_world(cfg.devices, cfg.num_nodes)
    world_size = devices * num_nodes
    own_tokenizer = cfg.resume and (Path(cfg.out_dir) / TOKENIZER_DIR).is_dir()
    source = tokenizer_source(cfg, trained_here=own_tokenizer)
    config = model_config(cfg, load_tokenizer(source) if source else None)
    facts = facts_from_model_config(config, source=f"recipe nlp (model={cfg.model})")
    ds_config = deepspeed_config(cfg, world_size, config.hidden_size)
    run_layout(cfg, world_size, config, ds_config, pipeline_engine)
    return RecipeDescription.of("nlp", cfg, ds_config, facts, seq_len=cfg.seq_len, parallel_components="deepspeed")


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


# --- the end of a run: export, check, summary ----------------------------------------------------


@dataclass
class RunRecord:
    """What a training loop hands to the end of the run: the setup it ran and what it measured on the way.

    The loops fill ``plan`` and ``held_at_construction`` once the model is built, ``model_states`` after the first
    step, ``steps`` and ``val_loss`` as they go; :func:`finish` and :func:`summarize` read nothing else.
    """

    cfg: NLPConfig
    ds_config: dict[str, Any]
    layout: ParallelLayout
    model_config: Any  # the transformers config (FLOPs per token, the export's names)
    attention: str
    backend: str  # lightning | accelerate | deepspeed_pipeline
    clock: Clock
    plan: MemoryPlan | None = None
    held_at_construction: int = 0  # parameter elements rank 0 held right after construction
    model_states: dict[str, int] = field(default_factory=dict)  # common.accounting.model_state_bytes after step 1
    steps: int = 0
    val_loss: float = math.nan  # the last evaluation's


def final_export(
    run: RunRecord,
    skeleton: Any,
    state_dict: dict[str, torch.Tensor],
    tokenizer: Any,
    fixed_batch: torch.Tensor,
    trained_logits: torch.Tensor,
    device: torch.device,
) -> tuple[dict[str, Any], str]:
    """Rank 0: write ``final/`` (Hugging Face format), reload it, compare logits, and generate the sample.

    The reload is what a user does with the export (``AutoModelForCausalLM.from_pretrained``), so the check
    proves the consolidated weights are the trained ones; the sample comes from the reloaded copy too (on
    rank 0's device: a 7B model would take minutes to generate on a CPU).

    Returns:
        ``summary.json``'s ``export_check`` and ``sample`` (the prompt and its continuation).
    """
    cfg = run.cfg
    unset_hf_deepspeed_config()  # training is over: what follows is plain single-process transformers code
    state_dict = cfg.family.export_state_dict(state_dict, skeleton, run.model_config)  # transformers' names
    final = save_hf_model(skeleton, state_dict, Path(cfg.out_dir) / "final", tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(
        str(final), local_files_only=True, attn_implementation=run.attention, trust_remote_code=cfg.trust_remote_code
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


@dataclass
class NLPSummary:
    """``summary.json``: the keys every recipe reports, plus the NLP figures (the same keys on every entry point;
    ``pipeline`` is None but on ``train_pipeline.py``)."""

    val_loss: float  # the last evaluation's, over every rank's validation blocks
    val_perplexity: float
    initial_val_loss: float | None  # step 0's on the same blocks (read back from metrics.jsonl on resume)
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
    communication: dict[str, Any] | None = None  # with comms_logger.enabled: logged bytes per step beside the plan

    def to_json(self) -> dict[str, Any]:
        return summary_fields(self)

    def headline(self, out_dir: Path) -> str:
        """The lines printed when the run ends."""
        initial = f"{self.initial_val_loss:.4f}" if self.initial_val_loss is not None else "n/a"
        ratio = f"{self.val_loss_ratio:.3f}" if self.val_loss_ratio is not None else "n/a"
        return (
            f"sample: {self.sample!r}\n"
            f"val_loss {self.val_loss:.4f} (step 0: {initial}, ratio {ratio}); "
            f"{self.throughput['value']:.0f} tokens/s/device; wall {self.wall_time_s:.0f} s; run directory {out_dir}"
        )


def finish(run: RunRecord, model: Any, data: LMData, device: torch.device, rank: int) -> NLPSummary | None:
    """After training, on every rank: logits on a fixed batch, whole weights and peak memory (collective); then rank 0
    writes ``final/``, checks and samples it, and returns the summary (None on the other ranks).

    Args:
        model: the transformers model (its ZeRO-3 parameters are gathered one at a time, its tensor-parallel shards
            a layer at a time, a MoE model's experts from their expert-parallel ranks).
    """
    fixed = data.val.blocks[:2]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=fixed[:, :-1].to(device), use_cache=False).logits.float().cpu()
    gather = gather_tensor_parallel_state_dict if run.layout.tensor > 1 else gather_full_state_dict
    state = run.cfg.family.gather_state_dict(model, rank, gather)
    peak = int(all_reduce(torch.tensor(float(peak_memory_bytes()), device=device), "max").item())
    if rank != 0:
        return None
    export_check, sample = final_export(run, model, state, data.tokenizer, fixed, logits, device)
    return summarize(run, data, peak, export_check, sample)


def summarize(
    run: RunRecord,
    data: LMData,
    peak: int,
    export_check: dict[str, Any],
    sample: str,
    pipeline: dict[str, Any] | None = None,
) -> NLPSummary:
    """Rank 0, once ``final/`` is written and checked: the run's ``summary.json`` (the peak memory over ranks, the
    export check, the sample and the pipeline's layout when there is one, besides the run's record)."""
    cfg, ds_config, clock = run.cfg, run.ds_config, run.clock
    out_dir = Path(cfg.out_dir)
    tokens_per_step = tokens_per_rank_step(cfg, run.layout)
    tokens_per_s = tokens_per_step / clock.median_step()
    initial = next((r["val_loss"] for r in read_metrics(out_dir) if r["step"] == 0 and "val_loss" in r), None)
    aux_losses = [r["aux_loss"] for r in read_metrics(out_dir) if "aux_loss" in r]
    return NLPSummary(
        val_loss=run.val_loss,
        val_perplexity=math.exp(min(run.val_loss, 700.0)),
        initial_val_loss=initial,
        val_loss_ratio=run.val_loss / initial if initial else None,
        throughput=throughput(tokens_per_s, "tokens/s/device"),
        mfu=mfu(tokens_per_s, cfg.family.flops_per_token(run.model_config, cfg.seq_len), gpu_peak_flops()),
        peak_memory_bytes=peak,
        memory_kind=memory_kind(),
        model_state_bytes_per_rank=run.model_states.get("model_states"),
        wall_time_s=round(clock.wall(), 1),
        preset=cfg.preset,
        zero_stage=zero_stage(ds_config),
        stage3_param_persistence_threshold=ds_config.get("zero_optimization", {}).get(  # FSDP2: no such section
            "stage3_param_persistence_threshold"
        ),
        world_size=run.layout.world_size,
        attention=run.attention,
        precision=precision_of(ds_config),
        model=cfg.model,
        backend=run.backend,
        steps=run.steps,
        tokens_per_step=round(tokens_per_step * run.layout.world_size),
        median_step_s=round(clock.median_step(), 4),
        model_state_bytes_measured=run.model_states,
        memory_plan=run.plan,
        params_at_construction={"elements_on_rank0": run.held_at_construction, "num_params": run.plan.num_params},
        data=data.info(),
        export_check=export_check,
        sample=sample,
        pipeline=pipeline,
        moe=cfg.family.summary(run.model_config, aux_losses),
        communication=summary_communication(
            ds_config, lambda: describe(cfg, pipeline_engine=run.backend == "deepspeed_pipeline")
        ),
    )
