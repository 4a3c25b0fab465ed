"""Config and shared setup of the fine-tuning recipe: LoRA on a frozen causal LM under ZeRO-3 (or ZeRO-2).

``finetune.py`` (Lightning) and ``finetune_accelerate.py`` (Accelerate) both import this module, so they train the
same adapter on the same examples with the same DeepSpeed config and write the same run files. What the NLP
recipe already does (threads, out_dir check, DeepSpeed dict, model construction, optimizer groups, summary keys)
is imported from ``recipe_config.py``; this module adds the instruction data, LoRA, and the end-of-run export:
adapter (gathered, then read back and checked), ``merged/``, exact-match accuracy before and after.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from recipe_config import all_reduce, build_model, param_groups, train_loader

from common.config import config_to_dict, dump_yaml, parse_recipe_args
from common.errors import ConfigError, nearest
from common.model_folder import check_weight_files
from common.presets import PRESET_NAMES
from common.strategy import PRECISIONS
from nlp.data import DataError
from nlp.model import ATTENTION_CHOICES, ModelError, resolve_attention
from nlp.task import Example

RECIPE_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = RECIPE_DIR / "configs" / "finetune_tiny_cpu.yaml"
DEFAULT_BASE_MODEL = "runs/nlp/final"
BASE_MODEL_COMMAND = "python recipes/nlp/train.py"  # writes runs/nlp/final (about 4.5 minutes on a 2-core CPU)
BUILTIN_TASK = "arg_count"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LLAMA_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class FinetuneConfig:
    """Every key of the fine-tuning recipe; ``configs/finetune*.yaml`` and ``key=value`` overrides set them."""

    # --- run ---
    out_dir: str = "runs/finetune"
    overwrite: bool = False  # replace an existing out_dir
    resume: bool = False  # continue from out_dir/checkpoints/latest (the adapter and its optimizer state)
    max_steps: int = 300  # optimizer steps
    devices: int = 0  # 0: every GPU, or 2 CPU processes without a GPU (Lightning; Accelerate takes its launcher's)
    num_nodes: int = 1
    seed: int = 0
    # --- DeepSpeed ---
    preset: str = "finetune"  # ZeRO-3 over the frozen base; preset=deepspeed_stage_2 keeps whole weights per rank
    precision: str = "bf16"  # bf16, fp16 or fp32
    ds_overrides: list[str] = field(default_factory=list)  # DeepSpeed key=value, e.g. zero_optimization.stage=2
    activation_checkpointing: str = "none"  # none|full|every_k|selective|save_memory_optimized (frozen base: fine)
    gradient_clipping: float = 1.0  # LoRA without clipping diverged to a constant answer here (DESIGN.md)
    # --- optimisation ---
    micro_batch_size: int = 16  # examples per rank per forward pass: activations grow with it
    grad_accum: int = 1  # micro-batches per optimizer step: a larger batch at no extra memory
    lr: float = 2e-3  # LoRA learned at 1e-3..2e-3 with clipping 1.0 here; 3e-3 diverged
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    warmup_steps: int = 20
    # --- model ---
    model: str = DEFAULT_BASE_MODEL  # a local Hugging Face causal-LM folder (default: the NLP recipe's output)
    attention: str = "auto"  # auto|flash_attention_2|sdpa|eager (auto: FlashAttention-2 on a GPU when installed)
    trust_remote_code: bool = False  # allow model code shipped inside a local model folder to run
    lora_r: int = 16  # adapter rank: trainable parameters grow with it
    lora_alpha: float = 32.0  # scale of the adapter's update (alpha / r)
    lora_dropout: float = 0.05
    lora_targets: list[str] = field(default_factory=lambda: list(LLAMA_LORA_TARGETS))  # Linear layers to adapt
    # --- data ---
    data: str = BUILTIN_TASK  # 'arg_count' (built-in, exact answers) or an instruction .jsonl (Alpaca or messages)
    val_data: str = ""  # a held-out .jsonl; empty: the last val_fraction of data (the built-in task has its own)
    val_fraction: float = 0.1
    n_train: int = 2000  # examples of the built-in task
    n_val: int = 200  # held-out examples of the built-in task (and the cap on a JSONL's held-out set)
    seq_len: int = 128  # longest example in tokens (longer prompts lose their start, never the response)
    max_new_tokens: int = 8  # greedy answer length when scoring exact match
    # --- logging ---
    eval_interval: int = 100  # steps between validation losses (accuracy is measured at the start and the end)
    checkpoint_interval: int = 100
    log_interval: int = 10

    def __post_init__(self) -> None:
        positive = "max_steps num_nodes micro_batch_size grad_accum seq_len lora_r n_train n_val max_new_tokens"
        for name in (positive + " eval_interval checkpoint_interval log_interval").split():
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("devices", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.preset not in PRESET_NAMES:
            raise ConfigError(f"unknown preset {self.preset!r}{nearest(self.preset, PRESET_NAMES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise ConfigError(f"unknown attention {self.attention!r}{nearest(self.attention, ATTENTION_CHOICES)}")
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.weight_decay < 0:
            raise ConfigError("need lr > 0, 0 <= min_lr_ratio <= 1 and weight_decay >= 0")
        if not 0.0 <= self.lora_dropout < 1.0 or self.lora_alpha <= 0:
            raise ConfigError("need 0 <= lora_dropout < 1 and lora_alpha > 0")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.resume and self.overwrite:
            raise ConfigError("resume=true and overwrite=true contradict each other; pick one")

    @property
    def pretrained(self) -> Path:
        """The base model folder (``recipe_config.build_model`` and ``model_config`` read this)."""
        return Path(self.model).expanduser()


def require_base_model(cfg: FinetuneConfig) -> None:
    """One error for a base model that is not there, with the command that makes the default one."""
    if (cfg.pretrained / "config.json").is_file():
        check_weight_files(cfg.pretrained)  # a truncated *.safetensors: one line naming it, not a traceback
        return
    what = "has no config.json" if cfg.pretrained.is_dir() else "not found"
    if cfg.model == DEFAULT_BASE_MODEL:
        raise ConfigError(
            f"base model {cfg.model} {what}: create it with `{BASE_MODEL_COMMAND}` (about 4.5 minutes on a 2-core "
            "CPU), or pass model=<a local Hugging Face causal-LM folder>"
        )
    raise ConfigError(
        f"base model {cfg.model} {what}; model= must be a local Hugging Face causal-LM folder (save_pretrained output)"
    )


def parse_args(argv: list[str] | None = None) -> FinetuneConfig:
    """``--config FILE`` (default ``DEFAULT_CONFIG``), ``key=value`` overrides, ``--print-config``."""
    return parse_recipe_args(FinetuneConfig, DEFAULT_CONFIG, argv)


def resolve_attention_or_exit(cfg: FinetuneConfig, device_type: str) -> str:
    """``resolve_attention`` with its reason (not installed / no GPU / fp32) as a user error."""
    try:
        return resolve_attention(cfg.attention, device_type, DTYPES[cfg.precision])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def write_run_files(cfg: FinetuneConfig, out_dir: Path, ds_config: dict, world_size: int, device: str) -> None:
    """Rank 0: ``config.yaml``, ``ds_config.json`` and ``env.json``."""
    from common.rundir import env_info, write_json_atomic, write_text_atomic

    write_text_atomic(out_dir / "config.yaml", dump_yaml(config_to_dict(cfg)))
    write_json_atomic(out_dir / "ds_config.json", ds_config)
    write_json_atomic(out_dir / "env.json", env_info(device, world_size))


# --- data ----------------------------------------------------------------------------------------


def load_tokenizer(cfg: FinetuneConfig) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(cfg.pretrained), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{cfg.pretrained}: no usable tokenizer in the model folder ({exc})") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of loss and attention anyway
    return tokenizer


def load_examples(cfg: FinetuneConfig) -> tuple[list[Example], list[Example]]:
    """Train and held-out examples: the built-in task, or a JSONL with ``val_data`` or a held-out tail."""
    from nlp.task import load_instruction_jsonl, make_arg_count_task

    if cfg.data == BUILTIN_TASK:
        from nlp.data import stdlib_source_files

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


def sft_loader(
    encoded: list[dict], cfg: FinetuneConfig, pad_id: int, rank: int, world_size: int, start_step: int, full: bool
) -> torch.utils.data.DataLoader:
    """The NLP recipe's (seed, step)-ordered loader over encoded examples, padded per batch by ``collate_sft``."""
    from nlp.task import collate_sft

    if len(encoded) < cfg.micro_batch_size * world_size:
        raise DataError(
            f"{cfg.data}: {len(encoded)} training examples, fewer than one global micro-batch "
            f"({cfg.micro_batch_size} x {world_size} ranks)"
        )
    loader = train_loader(SimpleNamespace(train=encoded), cfg, rank, world_size, start_step, full_length=full)
    loader.collate_fn = functools.partial(collate_sft, pad_token_id=pad_id)  # examples have different lengths
    return loader


def val_batches(encoded: list[dict], cfg: FinetuneConfig, pad_id: int, rank: int, world_size: int) -> list[dict]:
    """This rank's held-out batches; every rank gets as many (ZeRO-3 forwards are collective)."""
    from nlp.task import collate_sft

    mine = encoded[: len(encoded) // world_size * world_size][rank::world_size]
    return [collate_sft(mine[i : i + cfg.micro_batch_size], pad_id) for i in range(0, len(mine), cfg.micro_batch_size)]


def sft_loss_sums(model: Any, batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response-token cross entropy (fp32) and the number of response tokens of a batch."""
    from nlp.task import IGNORE_INDEX

    logits = model(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device), use_cache=False
    ).logits
    labels = batch["labels"][:, 1:].to(device)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (labels != IGNORE_INDEX).sum()


def sft_loss(model: Any, batch: dict, device: torch.device) -> torch.Tensor:
    """Mean cross entropy over the batch's response tokens: the training loss."""
    total, count = sft_loss_sums(model, batch, device)
    return total / count.clamp(min=1)


@torch.no_grad()
def evaluate(model: Any, batches: list[dict], device: torch.device) -> float:
    """Mean response-token loss over every rank's held-out batches (all ranks must call it)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        loss, count = sft_loss_sums(model, batch, device)
        total += torch.stack([loss.double(), count.double()])
    model.train(was_training)
    total = all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))


# --- model ---------------------------------------------------------------------------------------


def base_module_names(cfg: FinetuneConfig, config: Any) -> list[str]:
    """The Linear layer names LoRA can target, from a weightless (meta-device) copy of the model.

    ``lora_targets`` is checked against them here, so a typo is one error before anything is written.
    """
    from transformers import AutoModelForCausalLM

    from nlp.lora import check_target_modules, linear_module_names

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = linear_module_names(skeleton)
    check_target_modules(cfg.lora_targets, names)
    return names


def build_lora_model(cfg: FinetuneConfig, config: Any, attention: str, module_names: list[str]) -> Any:
    """The base model (built by the NLP recipe's ``build_model``, so sharded under ZeRO-3) with LoRA on it.

    The LoRA matrices are created outside ``zero.Init`` (Lightning runs ``configure_model`` inside it): peft
    rebuilds them as new parameters after creation, which inside ``zero.Init`` leaves plain, empty ``[0]`` tensors
    that DeepSpeed no longer knows are partitioned. Created whole, they are cast to the training dtype (peft takes
    the fp32 of the base's empty placeholders), and ``deepspeed.initialize`` partitions them.
    """
    from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context
    from peft import get_peft_model

    from nlp.lora import lora_config

    model = build_model(cfg, config, attention)
    shutdown_init_context()  # a no-op outside zero.Init
    try:
        model = get_peft_model(
            model, lora_config(cfg.lora_targets, module_names, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
        )
    finally:
        restore_init_context()
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(DTYPES[cfg.precision])
    if cfg.activation_checkpointing != "none":
        # Reentrant checkpointing needs an input that requires grad; with the embeddings frozen, make one.
        model.enable_input_require_grads()
    return model


def lora_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The NLP recipe's AdamW groups less the empty ones: LoRA has only matrices, and DeepSpeed drops an empty
    group, which would leave the LR scheduler with one group more than the optimizer."""
    return [group for group in param_groups(model, weight_decay) if group["params"]]


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter elements, whole sizes also under ZeRO-3."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return sum(n for n, t in sizes if t), sum(n for n, _ in sizes)


# --- accuracy before and after -------------------------------------------------------------------


def load_plain(cfg: FinetuneConfig, attention: str, dtype: torch.dtype = torch.float32) -> Any:
    """The base model whole in one process (no ZeRO): for scoring and merging on rank 0."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from nlp.model import load_pretrained

    unset_hf_deepspeed_config()  # a plain load, even where a ZeRO-3 run's partitioned construction was set up
    model = load_pretrained(cfg.pretrained, dtype, attention, cfg.trust_remote_code)
    model.config.use_cache = True
    return model.eval()


def score(model: Any, tokenizer: Any, val: list[Example], cfg: FinetuneConfig) -> float:
    from nlp.task import exact_match

    return exact_match(model, tokenizer, val, max_new_tokens=cfg.max_new_tokens)


# --- export --------------------------------------------------------------------------------------


def final_export(
    peft_model: Any,
    state: dict[str, torch.Tensor],
    expected_shapes: dict[str, tuple[int, ...]],
    tokenizer: Any,
    out_dir: Path,
    fixed: dict,
    trained_logits: torch.Tensor,
    val: list[Example],
    cfg: FinetuneConfig,
    attention: str,
    training_dtype: torch.dtype,
) -> dict[str, Any]:
    """Rank 0: write ``adapter/`` (gathered) and ``merged/``, check both against the trained model, score it.

    The checks are what a user does with the outputs: ``PeftModel.from_pretrained(base, adapter/)`` in the
    training dtype must give the trained (sharded) model's logits on a fixed batch, and ``merged/`` (loaded with
    ``AutoModelForCausalLM``) the adapter model's logits; exact match is then measured on ``merged/``.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from common.checkpoint import save_hf_model
    from nlp.lora import check_adapter, save_adapter

    adapter_dir = save_adapter(peft_model, state, out_dir / "adapter")
    adapter = check_adapter(adapter_dir, expected_shapes)
    ids, mask = fixed["input_ids"], fixed["attention_mask"]

    def logits_of(model: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()

    reloaded = PeftModel.from_pretrained(load_plain(cfg, attention, training_dtype), str(adapter_dir)).eval()
    adapter_logits = logits_of(reloaded)
    scale = trained_logits.abs().max().item()
    diff = (adapter_logits - trained_logits)[mask.bool()].abs().max().item()
    logits_check = {
        "dtype": str(training_dtype).removeprefix("torch."),
        "max_abs_logit_diff": diff,
        "max_abs_logit": scale,
        "ok": diff <= 2**-6 * max(1.0, scale),  # a few bf16 ulps of the largest logit
    }
    # Merge in fp32 (a bf16 merge would round the base weights a second time) and save in Hugging Face format.
    unmerged = PeftModel.from_pretrained(load_plain(cfg, attention), str(adapter_dir)).eval()
    unmerged_logits = logits_of(unmerged)
    merged = unmerged.merge_and_unload()
    merged_dir = save_hf_model(merged, merged.state_dict(), out_dir / "merged", tokenizer)
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), local_files_only=True, attn_implementation=attention)
    merged_check = (logits_of(merged.eval()) - unmerged_logits)[mask.bool()].abs().max().item()
    return {
        "val_accuracy": score(merged, tokenizer, val, cfg),
        "adapter_check": adapter,
        "adapter_logits_check": logits_check,
        "merged_max_abs_logit_diff": merged_check,
    }
