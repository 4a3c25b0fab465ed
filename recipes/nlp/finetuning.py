"""What the fine-tuning recipe does with its config: data, base model + LoRA, loss, exact match, export, summary.

``finetune.py`` (Lightning) and ``finetune_accelerate.py`` (Accelerate) both import this module, so they train the
same adapter on the same examples with the same DeepSpeed config and write the same run files. It is the recipe's
own copy of what it shares in spirit with the NLP pre-training recipe (the loader, the learning-rate schedule, the
DeepSpeed dict): change one recipe and the other stays as it was. Read top to bottom: base model, data, model,
evaluation, export, summary, ``describe`` (what ``--describe`` prints for the planning tools). The loss, the global
batch's response-token mean, is in ``finetune_loss.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from finetune_config import BUILTIN_TASK, DEFAULT_BASE_MODEL, FinetuneConfig
from finetune_loss import response_tokens  # next to this script: the token-mean loss
from peft import PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from common import sequence_parallel
from common.activation import apply_activation_checkpointing
from common.checkpoint import latest_checkpoint, save_hf_model
from common.comms_log import summary_communication
from common.config import config_to_dict, dump_yaml, parse_overrides
from common.data import StepSampler
from common.describe import RecipeDescription, local_world
from common.errors import ConfigError, InputMissing
from common.memory_formulas import facts_from_model_config
from common.metrics import all_reduce, memory_kind, peak_memory_bytes, throughput
from common.presets import is_fsdp2_name
from common.rundir import env_info, read_metrics, summary_fields, write_json_atomic, write_text_atomic
from common.strategy import (
    RunFacts,
    cosine_with_warmup,
    precision_of,
    resolve_deepspeed_config,
    torch_dtype,
    zero_stage,
)
from nlp.data import DataError, stdlib_source_files
from nlp.lora import check_adapter, check_target_modules, folder_bytes, linear_module_names, lora_config, save_adapter
from nlp.model import ModelError, llama_block_class, load_pretrained, resolve_attention
from nlp.task import (
    IGNORE_INDEX,
    Example,
    collate_sft,
    encode_examples,
    exact_match,
    load_instruction_jsonl,
    majority_baseline,
    make_arg_count_task,
)

BASE_MODEL_COMMAND = "python recipes/nlp/train.py"  # writes runs/nlp/final (about 4.5 minutes on a 2-core CPU)
FIXED_BATCH_EXAMPLES = 4  # held-out examples whose logits the export compares (trained model, adapter, merged)
FULL_CHECKPOINT_BYTES_PER_PARAM = 14  # a full-parameter ZeRO checkpoint: 2 B weights + 12 B fp32 Adam state


# --- base model ----------------------------------------------------------------------------------


def base_model_config(cfg: FinetuneConfig) -> Any:
    """The base model's ``config.json`` (the only file ``--describe`` reads).

    A missing base is one error; for the default one it names the command that makes it.
    """
    if not (cfg.pretrained / "config.json").is_file():
        what = "has no config.json" if cfg.pretrained.is_dir() else "not found"
        if cfg.model == DEFAULT_BASE_MODEL:
            raise InputMissing(
                f"base model {cfg.model} {what}: create it with `{BASE_MODEL_COMMAND}` (about 4.5 minutes on a "
                "2-core CPU), or pass model=<a local Hugging Face causal-LM folder>"
            )
        raise InputMissing(
            f"base model {cfg.model} {what}; model= must be a local Hugging Face causal-LM folder "
            "(save_pretrained output)"
        )
    try:
        return AutoConfig.from_pretrained(
            str(cfg.pretrained), local_files_only=True, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{cfg.pretrained}: cannot read config.json ({exc})") from exc


def load_tokenizer(cfg: FinetuneConfig, config: Any) -> Any:
    """The base model folder's tokenizer, checked against the model's vocabulary."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(cfg.pretrained), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{cfg.pretrained}: no usable tokenizer in the model folder ({exc})") from exc
    if getattr(config, "vocab_size", 0) < len(tokenizer):
        raise ModelError(
            f"{cfg.pretrained}: vocab_size {config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of loss and attention anyway
    return tokenizer


def resolve_attention_or_exit(cfg: FinetuneConfig, device_type: str) -> str:
    """``resolve_attention`` with its reason (not installed / no GPU / fp32) as a user error."""
    try:
        return resolve_attention(cfg.attention, device_type, torch_dtype(cfg.precision))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def resolve_ds_config(cfg: FinetuneConfig, world_size: int, hidden_size: int) -> dict[str, Any]:
    """The factory's DeepSpeed dict for this run (buckets and persistence threshold scaled to the hidden size)."""
    facts = RunFacts.from_fields(cfg, world_size, hidden_size)
    return resolve_deepspeed_config(cfg.preset, facts, parse_overrides(cfg.ds_overrides))


def check_sequence_parallel(cfg: FinetuneConfig, world_size: int, config: Any, attention: str) -> None:
    """Refuse a ``sequence_parallel`` the run cannot use, before any work (one ConfigError naming the fix).

    The length checked is what the batches are padded to: :func:`collate_sft_padded` pads every batch to a multiple
    of ``sequence_parallel``, so no example length is refused.
    """
    size = cfg.sequence_parallel
    if size == 1:
        return
    text = config.get_text_config()
    sequence_parallel.check_sequence_parallel(
        size,
        world_size,
        math.ceil(cfg.seq_len / size) * size,
        text.num_attention_heads,
        getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        attention,
    )


def write_run_files(cfg: FinetuneConfig, out_dir: Path, ds_config: dict, world_size: int, device: str) -> None:
    """Rank 0: ``config.yaml``, ``ds_config.json`` and ``env.json``."""
    write_text_atomic(out_dir / "config.yaml", dump_yaml(config_to_dict(cfg)))
    write_json_atomic(out_dir / "ds_config.json", ds_config)
    write_json_atomic(out_dir / "env.json", env_info(device, world_size))


# --- data ----------------------------------------------------------------------------------------


@dataclass
class SFTData:
    """The run's examples, read and encoded once; every rank holds all of them and takes its share per batch.

    Attributes:
        tokenizer: the base model's tokenizer (its pad id pads the batches).
        train: encoded training examples (prompt tokens labelled ``IGNORE_INDEX``).
        val: held-out examples as text: exact match generates answers from their prompts.
        val_encoded: the same, encoded: the held-out loss.
        fixed_batch: the first held-out examples collated: the export compares logits on it.
        train_tokens: each training example's response tokens (:func:`response_tokens`): the loss's denominator.
    """

    tokenizer: Any
    train: list[dict[str, list[int]]]
    val: list[Example]
    val_encoded: list[dict[str, list[int]]]
    fixed_batch: dict[str, torch.Tensor]
    train_tokens: list[int]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id


def load_examples(cfg: FinetuneConfig) -> tuple[list[Example], list[Example]]:
    """Train and held-out examples: the built-in task, or a JSONL with ``val_data`` or a held-out tail."""
    if cfg.data == BUILTIN_TASK:
        return make_arg_count_task(stdlib_source_files(), n_train=cfg.n_train, n_val=cfg.n_val, seed=0)
    if not cfg.data.endswith(".jsonl"):
        raise ConfigError(f"data must be {BUILTIN_TASK!r} or an instruction .jsonl file, got {cfg.data!r}")
    train = load_instruction_jsonl(cfg.data)
    if cfg.val_data:
        return train, load_instruction_jsonl(cfg.val_data)[: cfg.n_val]
    n_val = min(cfg.n_val, max(1, round(len(train) * cfg.val_fraction)))
    if len(train) - n_val < 1:
        raise DataError(f"{cfg.data}: {len(train)} example(s) leave none to train on after holding out {n_val}")
    return train[:-n_val], train[-n_val:]


def load_sft_data(cfg: FinetuneConfig, tokenizer: Any) -> SFTData:
    """Read the examples and encode them to at most ``seq_len`` tokens (a long prompt loses its start)."""
    train, val = load_examples(cfg)
    val_encoded = encode_examples(val, tokenizer, cfg.seq_len)
    train_encoded = encode_examples(train, tokenizer, cfg.seq_len)
    return SFTData(
        tokenizer=tokenizer,
        train=train_encoded,
        val=val,
        val_encoded=val_encoded,
        fixed_batch=collate_sft(val_encoded[:FIXED_BATCH_EXAMPLES], tokenizer.pad_token_id),
        train_tokens=[response_tokens(example["labels"]) for example in train_encoded],
    )


def data_parallel(cfg: FinetuneConfig, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's (data-parallel rank, data-parallel size): DeepSpeed's Ulysses groups are consecutive ranks
    (``i * N .. i * N + N - 1``), whose ranks read the same examples, each its slice of every sequence."""
    return rank // cfg.sequence_parallel, world_size // cfg.sequence_parallel


def collate_sft_padded(
    features: list[dict[str, list[int]]], pad_token_id: int, multiple: int
) -> dict[str, torch.Tensor]:
    """``collate_sft``'s batch (right-padded, padding labelled ``IGNORE_INDEX``), padded on to a multiple of
    ``multiple`` tokens: sequence parallelism gives each of its N ranks length / N of them."""
    batch = collate_sft(features, pad_token_id)
    extra = -batch["input_ids"].shape[1] % multiple
    if extra:
        fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
        batch = {key: F.pad(value, (0, extra), value=fill[key]) for key, value in batch.items()}
    return batch


class FullRunSampler(StepSampler):
    """A StepSampler that reports the whole run's length even when it starts at ``start_step``: Lightning counts
    the batches of a resumed epoch from the checkpoint's count, so its loader must claim the full length."""

    def __len__(self) -> int:
        return self.max_steps * self.grad_accum * self.micro_batch_size


def sft_loader(
    data: SFTData, cfg: FinetuneConfig, rank: int, world_size: int, start_step: int, full_length: bool
) -> torch.utils.data.DataLoader:
    """Batches in a (seed, step)-determined order, the same on both backends and exact on resume.

    Args:
        rank, world_size: the data-parallel rank and size (:func:`data_parallel`).
        full_length: Lightning's loader (:class:`FullRunSampler`); Accelerate counts from ``start_step``.
    """
    if len(data.train) < cfg.micro_batch_size * world_size:
        raise DataError(
            f"{cfg.data}: {len(data.train)} training examples, fewer than one global micro-batch "
            f"({cfg.micro_batch_size} x {world_size} data-parallel ranks)"
        )
    sampler_class = FullRunSampler if full_length else StepSampler
    sampler = sampler_class(
        len(data.train), cfg.micro_batch_size, cfg.grad_accum, rank, world_size, cfg.seed, start_step, cfg.max_steps
    )
    return torch.utils.data.DataLoader(
        data.train,
        batch_size=cfg.micro_batch_size,
        sampler=sampler,
        # Examples have different lengths; sequence parallel: batches padded to a multiple of its size.
        collate_fn=functools.partial(collate_sft_padded, pad_token_id=data.pad_id, multiple=cfg.sequence_parallel),
    )


def val_batches(data: SFTData, cfg: FinetuneConfig, rank: int, world_size: int) -> list[dict]:
    """This rank's held-out batches; every rank gets as many (ZeRO-3 forwards are collective)."""
    mine = data.val_encoded[: len(data.val_encoded) // world_size * world_size][rank::world_size]
    size = cfg.micro_batch_size
    return [collate_sft(mine[i : i + size], data.pad_id) for i in range(0, len(mine), size)]


# --- model ---------------------------------------------------------------------------------------


def base_module_names(cfg: FinetuneConfig, config: Any) -> list[str]:
    """The Linear layer names LoRA can target, from a weightless (meta-device) copy of the model.

    ``lora_targets`` is checked against them here, so a typo is one error before anything is written.
    """
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = linear_module_names(skeleton)
    check_target_modules(cfg.lora_targets, names)
    return names


def build_lora_model(cfg: FinetuneConfig, attention: str, module_names: list[str]) -> Any:
    """The base model loaded from ``model=``, then LoRA (peft) on the ``lora_targets`` layers; only LoRA trains.

    Under ZeRO-3 both backends call this inside DeepSpeed's partitioned construction (``zero.Init`` with an
    ``HfDeepSpeedConfig`` alive): ``from_pretrained`` then loads every base weight already sharded. The LoRA
    matrices are created outside ``zero.Init``: peft rebuilds them as new parameters after creation, which inside
    it leaves plain, empty ``[0]`` tensors that DeepSpeed no longer knows are partitioned. Created whole, they are
    cast to the training dtype (peft takes the fp32 of the base's empty placeholders), and
    ``deepspeed.initialize`` partitions them. Under an FSDP2 preset the model is built whole on every rank, and the
    caller shards each decoder layer and the root (``common.strategy.shard_model``) before the optimizer sees it.
    """
    # Imported here, not at the top: importing deepspeed prints a line on stdout, which --describe keeps for JSON.
    from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context

    base = load_pretrained(cfg.pretrained, torch.float32, attention, cfg.trust_remote_code)
    base.config.use_cache = False  # training: no KV cache
    if cfg.activation_checkpointing != "none":
        block = llama_block_class() if base.config.model_type == "llama" else None
        report = apply_activation_checkpointing(
            base, cfg.activation_checkpointing, block_classes=[block] if block else None
        )
        print(report.summary())
    shutdown_init_context()  # a no-op outside zero.Init
    # LoRA's A matrices are random: the same on every rank, on both backends and under every preset (seeded here,
    # after the base's load, whose random stream use differs inside and outside zero.Init).
    torch.manual_seed(cfg.seed)
    try:
        model = get_peft_model(
            base, lora_config(cfg.lora_targets, module_names, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
        )
    finally:
        restore_init_context()
    cast_for_engine(model, cfg.precision, fsdp2=is_fsdp2_name(cfg.preset))
    if cfg.activation_checkpointing != "none":
        # Reentrant checkpointing needs an input that requires grad; with the embeddings frozen, make one.
        model.enable_input_require_grads()
    return model


def cast_for_engine(model: torch.nn.Module, precision: str, fsdp2: bool) -> None:
    """Each parameter in the dtype its engine keeps it in.

    ZeRO: the adapters in the training dtype (DeepSpeed's engine holds 16-bit weights and keeps the fp32 master
    copy itself); the frozen base was cast by ``zero.Init`` or is cast by the engine. FSDP2: the adapters stay fp32,
    the master weights the optimizer updates (FSDP2's policy casts them to bf16 as it gathers them), and the frozen
    base, which no optimizer updates, is held in the training dtype as ZeRO holds it: half the bytes of fp32 under
    bf16, and the same compute (FSDP2 gathers it in bf16 either way). FSDP2 allows frozen and trainable parameters,
    of different dtypes, in one sharded block: only the trainable ones must share a dtype.
    """
    dtype = torch_dtype(precision)
    for param in model.parameters():
        cast = not param.requires_grad if fsdp2 else param.requires_grad
        if cast:
            param.data = param.data.to(dtype)


def lora_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: matrices decay, 1-D parameters do not; ZeRO-3 shards are empty, so read ``ds_shape``.

    An empty group is left out: LoRA has only matrices, and DeepSpeed drops an empty group, which would leave
    the LR scheduler with one group more than the optimizer.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    ndim = [len(getattr(p, "ds_shape", p.shape)) for p in params]
    groups = [
        {"params": [p for p, n in zip(params, ndim) if n >= 2], "weight_decay": weight_decay},
        {"params": [p for p, n in zip(params, ndim) if n < 2], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def lr_lambda(cfg: FinetuneConfig) -> Any:
    """LambdaLR multiplier: warmup, then cosine to ``min_lr_ratio``."""
    return lambda step: cosine_with_warmup(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter elements, whole sizes also under ZeRO-3."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return sum(n for n, t in sizes if t), sum(n for n, _ in sizes)


# --- evaluation ----------------------------------------------------------------------------------


@torch.no_grad()
def batch_logits(model: Any, batch: dict, device: torch.device) -> torch.Tensor:
    """fp32 logits of a collated batch (collective under ZeRO-3: every rank calls it on a sharded model)."""
    return model(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device), use_cache=False
    ).logits.float()


def peak_memory_over_ranks(device: torch.device) -> int:
    """The largest peak memory of any rank (collective)."""
    return int(all_reduce(torch.tensor(float(peak_memory_bytes()), device=device), "max").item())


def load_plain(cfg: FinetuneConfig, attention: str, dtype: torch.dtype = torch.float32) -> Any:
    """The base model whole in one process (no ZeRO): for scoring and merging on rank 0."""
    unset_hf_deepspeed_config()  # a plain load, even where a ZeRO-3 run's partitioned construction was set up
    model = load_pretrained(cfg.pretrained, dtype, attention, cfg.trust_remote_code)
    model.config.use_cache = True
    return model.eval()


def score(model: Any, tokenizer: Any, val: list[Example], cfg: FinetuneConfig) -> float:
    """Held-out exact match: greedy answers, first line compared."""
    return exact_match(model, tokenizer, val, max_new_tokens=cfg.max_new_tokens)


# --- export --------------------------------------------------------------------------------------


@dataclass
class ExportResult:
    """What rank 0's export checked and measured on the written ``adapter/`` and ``merged/``."""

    val_accuracy: float  # held-out exact match of merged/
    adapter_check: dict[str, Any]  # nlp.lora.check_adapter: every tensor whole and non-zero
    adapter_logits_check: dict[str, Any]  # base + adapter/ in the training dtype against the trained model
    merged_max_abs_logit_diff: float  # merged/ against base + adapter/, fp32


def final_export(
    cfg: FinetuneConfig,
    peft_model: Any,
    state: dict[str, torch.Tensor],
    expected_shapes: dict[str, tuple[int, ...]],
    data: SFTData,
    trained_logits: torch.Tensor,
    attention: str,
) -> ExportResult:
    """Rank 0: write ``adapter/`` (gathered) and ``merged/``, check both against the trained model, score it.

    The checks are what a user does with the outputs: ``PeftModel.from_pretrained(base, adapter/)`` in the
    training dtype must give the trained (sharded) model's logits on a fixed batch, and ``merged/`` (loaded with
    ``AutoModelForCausalLM``) the adapter model's logits; exact match is then measured on ``merged/``.
    """
    out_dir, cpu = Path(cfg.out_dir), torch.device("cpu")
    adapter_dir = save_adapter(peft_model, state, out_dir / "adapter")
    adapter = check_adapter(adapter_dir, expected_shapes)
    mask = data.fixed_batch["attention_mask"].bool()

    training_dtype = torch_dtype(cfg.precision)
    reloaded = PeftModel.from_pretrained(load_plain(cfg, attention, training_dtype), str(adapter_dir)).eval()
    scale = trained_logits.abs().max().item()
    diff = (batch_logits(reloaded, data.fixed_batch, cpu) - trained_logits)[mask].abs().max().item()
    logits_check = {
        "dtype": str(training_dtype).removeprefix("torch."),
        "max_abs_logit_diff": diff,
        "max_abs_logit": scale,
        "ok": diff <= 2**-6 * max(1.0, scale),  # a few bf16 ulps of the largest logit
    }
    # Merge in fp32 (a bf16 merge would round the base weights a second time) and save in Hugging Face format.
    unmerged = PeftModel.from_pretrained(load_plain(cfg, attention), str(adapter_dir)).eval()
    unmerged_logits = batch_logits(unmerged, data.fixed_batch, cpu)
    merged = unmerged.merge_and_unload()
    merged_dir = save_hf_model(merged, merged.state_dict(), out_dir / "merged", data.tokenizer)
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), local_files_only=True, attn_implementation=attention)
    merged_diff = (batch_logits(merged.eval(), data.fixed_batch, cpu) - unmerged_logits)[mask].abs().max().item()
    return ExportResult(
        val_accuracy=score(merged, data.tokenizer, data.val, cfg),
        adapter_check=adapter,
        adapter_logits_check=logits_check,
        merged_max_abs_logit_diff=merged_diff,
    )


# --- summary -------------------------------------------------------------------------------------


@dataclass
class FinetuneSummary:
    """``summary.json``: the keys every recipe reports, then the fine-tuning figures (same keys on both backends)."""

    val_loss: float  # held-out response-token loss at the last step
    val_perplexity: float
    initial_val_loss: float | None  # at step 0 (read back from metrics.jsonl on resume)
    val_loss_ratio: float | None
    throughput: dict[str, Any]  # samples/s/device
    mfu: float | None  # not computed for LoRA (kept so that every recipe's summary has the key)
    peak_memory_bytes: int  # max over ranks
    memory_kind: str
    model_state_bytes_per_rank: int | None  # measured on rank 0 after its first step
    wall_time_s: float
    preset: str
    zero_stage: int
    stage3_param_persistence_threshold: int | None
    world_size: int
    sequence_parallel: int
    attention: str
    precision: str
    model: str
    backend: str
    steps: int
    trainable_params: int
    total_params: int
    checkpoint_bytes: int  # the last checkpoint: adapters and their optimizer state only
    checkpoint_fraction_of_full: float  # of FULL_CHECKPOINT_BYTES_PER_PARAM x total_params
    base_val_accuracy: float
    majority_baseline_accuracy: float  # always giving the most common answer scores this
    accuracy_gain: float  # val_accuracy over the larger of base and majority
    activation_checkpointing: str
    model_state_bytes_measured: dict[str, int]
    val_accuracy: float
    adapter_check: dict[str, Any]
    adapter_logits_check: dict[str, Any]
    merged_max_abs_logit_diff: float
    communication: dict[str, Any] | None = None  # with comms_logger.enabled: logged bytes per step beside the plan

    def to_json(self) -> dict[str, Any]:
        return summary_fields(self)


def initial_val_loss(out_dir: Path) -> float | None:
    """The step-0 validation loss recorded in ``metrics.jsonl`` (read back on resume)."""
    return next((r["val_loss"] for r in read_metrics(out_dir) if r["step"] == 0 and "val_loss" in r), None)


def make_summary(
    cfg: FinetuneConfig,
    ds_config: dict[str, Any],
    model: torch.nn.Module,
    data: SFTData,
    export: ExportResult,
    *,
    backend: str,
    world_size: int,
    attention: str,
    steps: int,
    val_loss: float,
    median_step_s: float,
    peak_memory: int,
    state_bytes: dict[str, int],
    base_val_accuracy: float,
    wall_time_s: float,
) -> FinetuneSummary:
    """Rank 0, after the export: the run's figures, from what the training loop measured and the run directory."""
    initial = initial_val_loss(Path(cfg.out_dir))
    trainable, total = count_params(model)
    checkpoint_bytes = folder_bytes([latest_checkpoint(cfg.out_dir)])
    majority = majority_baseline(data.val)
    return FinetuneSummary(
        val_loss=val_loss,
        val_perplexity=math.exp(min(val_loss, 700.0)),
        initial_val_loss=initial,
        val_loss_ratio=val_loss / initial if initial else None,
        # The ranks of a sequence-parallel group share their samples.
        throughput=throughput(
            cfg.micro_batch_size * cfg.grad_accum / cfg.sequence_parallel / median_step_s, "samples/s/device"
        ),
        mfu=None,
        peak_memory_bytes=peak_memory,
        memory_kind=memory_kind(),
        model_state_bytes_per_rank=state_bytes.get("model_states"),
        wall_time_s=wall_time_s,
        preset=cfg.preset,
        zero_stage=zero_stage(ds_config),
        stage3_param_persistence_threshold=ds_config.get("zero_optimization", {}).get(  # FSDP2: no such section
            "stage3_param_persistence_threshold"
        ),
        world_size=world_size,
        sequence_parallel=cfg.sequence_parallel,
        attention=attention,
        precision=precision_of(ds_config),
        model=cfg.model,
        backend=backend,
        steps=steps,
        trainable_params=trainable,
        total_params=total,
        checkpoint_bytes=checkpoint_bytes,
        checkpoint_fraction_of_full=checkpoint_bytes / (FULL_CHECKPOINT_BYTES_PER_PARAM * total),
        base_val_accuracy=base_val_accuracy,
        majority_baseline_accuracy=majority,
        accuracy_gain=export.val_accuracy - max(base_val_accuracy, majority),
        activation_checkpointing=cfg.activation_checkpointing,
        model_state_bytes_measured=state_bytes,
        val_accuracy=export.val_accuracy,
        adapter_check=export.adapter_check,
        adapter_logits_check=export.adapter_logits_check,
        merged_max_abs_logit_diff=export.merged_max_abs_logit_diff,
        communication=summary_communication(ds_config, lambda: describe(cfg)),
    )


def write_summary(out_dir: Path, summary: FinetuneSummary) -> None:
    """Rank 0, at the very end: ``summary.json`` and the run's one-line result."""
    write_json_atomic(out_dir / "summary.json", summary.to_json())
    print(
        f"exact match {summary.val_accuracy:.3f} (base {summary.base_val_accuracy:.3f}, majority answer "
        f"{summary.majority_baseline_accuracy:.3f}); val_loss {summary.val_loss:.4f}; "
        f"{summary.trainable_params:,} trainable of {summary.total_params:,}; "
        f"wall {summary.wall_time_s:.0f} s; run directory {out_dir}"
    )


# --- describe ------------------------------------------------------------------------------------


def describe(cfg: FinetuneConfig) -> RecipeDescription:
    """What ``--describe`` prints for the planning tools: the base model counted on the meta device from its
    ``config.json`` alone (no weights, tokenizer or data read, nothing written) and the run's DeepSpeed dict."""
    config = base_model_config(cfg)
    devices, num_nodes = local_world(cfg.devices, cfg.num_nodes)
    world_size = devices * num_nodes
    ds_config = resolve_ds_config(cfg, world_size, config.hidden_size)
    check_sequence_parallel(cfg, world_size, config, cfg.attention)
    facts = facts_from_model_config(config, f"base model {cfg.model}")
    return RecipeDescription.of("nlp:finetune", cfg, ds_config, facts, seq_len=cfg.seq_len)
