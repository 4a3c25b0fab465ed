"""Config and shared setup of the NLP recipe: a Llama causal LM under ZeRO-3 with parameter persistence.

``train.py`` (Lightning) and ``train_accelerate.py`` (Accelerate) both import this module, so they train the
same model on the same data with the same DeepSpeed config and write the same run files. Keys of
:class:`NLPConfig` are the keys of ``configs/*.yaml``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from common.config import config_to_dict, dump_yaml, parse_overrides, parse_recipe_args
from common.errors import ConfigError, nearest
from common.model_folder import check_weight_files
from common.presets import PRESET_NAMES
from common.rundir import refuse_existing_out_dir, set_cpu_threads
from common.strategy import PRECISIONS, RunFacts, cosine_with_warmup, resolve_deepspeed_config
from nlp.data import STDLIB, DataError, LMData, build_lm_datasets
from nlp.model import ATTENTION_CHOICES, LLAMA_SIZES, ModelError

RECIPE_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = RECIPE_DIR / "configs" / "tiny_cpu.yaml"
TOKENIZER_DIR = "tokenizer"  # where a run keeps the tokenizer it trained (resume and the other ranks load it)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


# A tiny few-step run a user can type too; `zero-recipes cp`'s generated smoke test uses it.
SMOKE_OVERRIDES: list[str] = [
    "max_steps=4",
    "seq_len=64",
    "micro_batch_size=2",
    "max_train_tokens=20000",
    "max_val_tokens=2048",
    "eval_interval=2",
    "checkpoint_interval=4",
    "log_interval=1",
    "sample_tokens=8",
]


@dataclass
class NLPConfig:
    """Every key of the NLP recipe; ``configs/*.yaml`` and ``key=value`` overrides set them."""

    # --- run ---
    out_dir: str = "runs/nlp"
    overwrite: bool = False  # replace an existing out_dir
    resume: bool = False  # continue from out_dir/checkpoints/latest
    max_steps: int = 500  # optimizer steps
    devices: int = 0  # 0: every GPU, or 2 CPU processes without a GPU (Lightning; Accelerate takes its launcher's)
    num_nodes: int = 1
    seed: int = 0
    collective_timeout_s: int = 900  # a rank waiting this long in a collective fails: a dead rank stops the others
    # --- DeepSpeed ---
    preset: str = "nlp"  # ZeRO-3, stage3_param_persistence_threshold 1e6 (zero-recipes ls)
    precision: str = "bf16"  # bf16, fp16 or fp32 (fp32: exact arithmetic, used by the resume test)
    ds_overrides: list[str] = field(default_factory=list)  # DeepSpeed key=value, e.g. zero_optimization.stage=2
    activation_checkpointing: str = "none"  # none|full|every_k|selective|save_memory_optimized
    gradient_clipping: float = 1.0  # max gradient norm, 0 = off
    # --- optimisation ---
    micro_batch_size: int = 4  # sequences per rank per forward pass: activations grow with it
    grad_accum: int = 1  # micro-batches per optimizer step: a larger batch at no extra memory
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio (1.0 = constant after warmup)
    weight_decay: float = 0.1
    warmup_steps: int = 30
    # --- model ---
    model: str = "tiny"  # tiny|125m|1b|7b (built from a config) or a local Hugging Face model folder
    attention: str = "auto"  # auto|flash_attention_2|sdpa|eager (auto: FlashAttention-2 on a GPU when installed)
    seq_len: int = 256  # tokens per sequence: activations grow with it (attention scores with its square)
    trust_remote_code: bool = False  # allow model code shipped inside a local model folder to run
    # --- data ---
    data: str = STDLIB  # 'stdlib', a .txt/.jsonl file, a folder of text files, or a datasets.save_to_disk folder
    text_field: str = "text"  # field of .jsonl records / column of a saved dataset
    tokenizer: str = ""  # a local tokenizer folder; empty: the model folder's, else train a byte-level BPE
    vocab_size: int = 4096  # of a newly trained tokenizer
    val_fraction: float = 0.05  # held-out share of files / documents
    max_train_tokens: int = 0  # cap on training tokens (0 = all)
    max_val_tokens: int = 32768  # tokens of the validation set that each evaluation reads (0 = all)
    # --- logging ---
    eval_interval: int = 100
    checkpoint_interval: int = 250
    log_interval: int = 10
    sample_prompt: str = "    def __init__(self"  # the end-of-run sample continues this prompt
    sample_tokens: int = 48

    def __post_init__(self) -> None:
        positive = "max_steps num_nodes micro_batch_size grad_accum seq_len vocab_size eval_interval log_interval"
        positive += " checkpoint_interval collective_timeout_s"
        for name in positive.split():
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("devices", "warmup_steps", "max_train_tokens", "max_val_tokens", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.preset not in PRESET_NAMES:
            raise ConfigError(f"unknown preset {self.preset!r}{nearest(self.preset, PRESET_NAMES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
                f"{nearest(self.precision, PRECISIONS)}"
            )
        if self.attention not in ATTENTION_CHOICES:
            raise ConfigError(f"unknown attention {self.attention!r}{nearest(self.attention, ATTENTION_CHOICES)}")
        if self.model not in LLAMA_SIZES and not Path(self.model).expanduser().is_dir():
            raise ConfigError(
                f"model must be one of {', '.join(LLAMA_SIZES)} or a local Hugging Face model folder; "
                f"{self.model!r} is neither{nearest(self.model, LLAMA_SIZES)}"
            )
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.weight_decay < 0:
            raise ConfigError("need lr > 0, 0 <= min_lr_ratio <= 1 and weight_decay >= 0")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.resume and self.overwrite:
            raise ConfigError("resume=true and overwrite=true contradict each other; pick one")

    @property
    def pretrained(self) -> Path | None:
        """The local model folder, or None for a named size built from a config."""
        return None if self.model in LLAMA_SIZES else Path(self.model).expanduser()


def parse_args(argv: list[str] | None = None) -> NLPConfig:
    """``--config FILE`` (default ``DEFAULT_CONFIG``), ``key=value`` overrides, ``--print-config``."""
    return parse_recipe_args(NLPConfig, DEFAULT_CONFIG, argv)


def set_threads(local_processes: int) -> None:
    """One intra-op thread per core per process on a CPU (:func:`common.rundir.set_cpu_threads`)."""
    set_cpu_threads(local_processes)


def check_out_dir(cfg: NLPConfig) -> None:
    """Refuse an existing run directory before anything is read or written (prepare_run_dir acts later)."""
    refuse_existing_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite)


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
        from common.rundir import wait_for_rank0_file

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

    Args:
        full_length: report the whole run's length even when starting at ``start_step``. Lightning counts the
            batches of a resumed epoch from the checkpoint's count, so its loader must claim the full length.
    """
    from common.data import StepSampler

    class Sampler(StepSampler):
        def __len__(self) -> int:
            steps = self.max_steps if full_length else self.max_steps - self.start_step
            return steps * self.grad_accum * self.micro_batch_size

    sampler = Sampler(
        len(data.train), cfg.micro_batch_size, cfg.grad_accum, rank, world_size, cfg.seed, start_step, cfg.max_steps
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
    from nlp.model import build_llama_config

    if cfg.pretrained is None:  # without a tokenizer yet (planning tools), the vocabulary is vocab_size
        vocab_size = None if tokenizer is not None else cfg.vocab_size
        return build_llama_config(cfg.model, vocab_size=vocab_size, tokenizer=tokenizer, seq_len=cfg.seq_len)
    from transformers import AutoConfig

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
        return LLAMA_SIZES[cfg.model]["hidden_size"]
    return model_config(cfg, tokenizer=None).hidden_size


def resolve_ds_config(cfg: NLPConfig, world_size: int, hidden_size: int) -> dict[str, Any]:
    """The factory's DeepSpeed dict for this run (buckets scaled to the hidden size)."""
    facts = RunFacts(
        world_size=world_size,
        micro_batch_size=cfg.micro_batch_size,
        grad_accum=cfg.grad_accum,
        precision=cfg.precision,
        hidden_size=hidden_size,
        gradient_clipping=cfg.gradient_clipping,
    )
    ds_config = resolve_deepspeed_config(cfg.preset, facts, parse_overrides(cfg.ds_overrides))
    # The guides' pitfalls, checked before any work (printed on rank 0; errors refuse the run).
    from common.config import config_to_dict
    from common.lint import lint_at_start

    lint_at_start(ds_config, config_to_dict(cfg), hidden_size=hidden_size, world_size=world_size)
    return ds_config


def build_model(cfg: NLPConfig, config: Any, attention: str) -> Any:
    """The causal LM, randomly initialised from ``config`` or loaded from the model folder.

    Under ZeRO-3 the caller keeps DeepSpeed's partitioned construction active (``HfDeepSpeedConfig`` /
    ``zero.Init``): ``from_config`` and ``from_pretrained`` then create every weight already sharded.
    """
    from nlp.model import build_model_from_config, llama_block_class, load_pretrained

    torch.manual_seed(cfg.seed)
    if cfg.pretrained is None:
        model = build_model_from_config(config, attn_implementation=attention)
    else:
        model = load_pretrained(
            cfg.pretrained,
            torch_dtype=torch.float32,
            attn_implementation=attention,
            trust_remote_code=cfg.trust_remote_code,
        )
    model.config.use_cache = False  # training: no KV cache
    if cfg.activation_checkpointing != "none":
        from common.activation import apply_activation_checkpointing

        block = llama_block_class() if model.config.model_type == "llama" else None
        print(
            apply_activation_checkpointing(
                model, cfg.activation_checkpointing, block_classes=[block] if block else None
            ).summary()
        )
    return model


def param_sizes(model: torch.nn.Module) -> list[int]:
    """Element count of every parameter (whole sizes, also when ZeRO-3 has partitioned them)."""
    return [getattr(p, "ds_numel", p.numel()) for p in model.parameters()]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: matrices decay, norm weights (1-D) do not. ZeRO-3 shards are empty: read ``ds_shape``."""
    params = [p for p in model.parameters() if p.requires_grad]
    ndim = [len(getattr(p, "ds_shape", p.shape)) for p in params]
    return [
        {"params": [p for p, n in zip(params, ndim) if n >= 2], "weight_decay": weight_decay},
        {"params": [p for p, n in zip(params, ndim) if n < 2], "weight_decay": 0.0},
    ]


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


def lm_loss(model: Any, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, in fp32 whatever the weights' dtype (labels are already shifted)."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum or max over ranks (a no-op in one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor


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


def memory_plan(sizes: list[int], ds_config: dict[str, Any], world_size: int) -> dict[str, Any]:
    """What each rank should hold (guide 1, 2.2), with stage-3 persistent parameters kept whole."""
    from common.accounting import predicted_model_state_bytes
    from common.strategy import precision_of, zero_stage

    stage, precision = zero_stage(ds_config), precision_of(ds_config)
    threshold = ds_config["zero_optimization"].get("stage3_param_persistence_threshold", 0) if stage == 3 else -1
    persistent = sum(n for n in sizes if n <= threshold)
    predicted = predicted_model_state_bytes(sum(sizes), stage, world_size, precision, persistent_params=persistent)
    during = predicted_model_state_bytes(sum(sizes), stage, world_size, precision, True, persistent)
    return {
        "num_params": sum(sizes),
        "persistent_params": persistent,
        "stage": stage,
        "precision": precision,
        "world_size": world_size,
        "predicted_bytes_per_rank": {k: int(v) for k, v in predicted.items()},
        "grads_during_backward_bytes": int(during["grads"]),
    }


def plan_text(plan: dict[str, Any]) -> str:
    """The memory plan as the lines printed before training."""
    p = plan["predicted_bytes_per_rank"]
    mb = 1e6
    lines = [
        f"memory plan: ZeRO-{plan['stage']} {plan['precision']}, {plan['world_size']} rank(s), "
        f"{plan['num_params'] / 1e6:.2f}M parameters ({plan['persistent_params'] / 1e6:.2f}M under the "
        f"persistence threshold stay whole on every rank)",
        f"  each rank holds (predicted, after a step): params {p['params'] / mb:.1f} MB + optimizer "
        f"{p['optimizer'] / mb:.1f} MB (fp32 master + Adam m, v) = {p['model_states'] / mb:.1f} MB of model "
        f"states; gradients add {plan['grads_during_backward_bytes'] / mb:.1f} MB during backward; activations "
        "and ZeRO buffers come on top",
    ]
    return "\n".join(lines)


def measured_text(measured: dict[str, int]) -> str:
    mb = 1e6
    return (
        f"memory measured on rank 0 after its first step: params {measured['params'] / mb:.1f} MB, optimizer "
        f"{measured['optimizer'] / mb:.1f} MB, grads {measured['grads'] / mb:.1f} MB = model states "
        f"{measured['model_states'] / mb:.1f} MB; ZeRO buffers {measured['buffers'] / mb:.1f} MB"
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
    from common.rundir import env_info, write_json_atomic, write_text_atomic

    write_text_atomic(out_dir / "config.yaml", dump_yaml(config_to_dict(cfg)))
    write_json_atomic(out_dir / "ds_config.json", ds_config)
    if trained_tokenizer:
        data.tokenizer.save_pretrained(str(out_dir / TOKENIZER_DIR))
    # Last: ranks on other nodes wait for env.json before they load the tokenizer (load_data).
    write_json_atomic(out_dir / "env.json", {**env_info(device, world_size), "data": data.info()})


def initial_val_loss(out_dir: Path) -> float | None:
    """The step-0 validation loss recorded in ``metrics.jsonl`` (read back on resume)."""
    from common.rundir import read_metrics

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
) -> dict[str, Any]:
    """Rank 0: write ``final/`` (Hugging Face format), reload it, compare logits, and generate the sample.

    The reload is what a user does with the export (``AutoModelForCausalLM.from_pretrained``), so the check
    proves the consolidated weights are the trained ones; the sample comes from the reloaded copy too (on
    rank 0's device: a 7B model would take minutes to generate on a CPU).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from common.checkpoint import save_hf_model
    from nlp.model import generate_sample

    unset_hf_deepspeed_config()  # training is over: what follows is plain single-process transformers code
    keys = set(model.state_dict())  # drop non-persistent buffers (rotary inv_freq): not part of a checkpoint
    final = save_hf_model(model, {k: v for k, v in state_dict.items() if k in keys}, out_dir / "final", tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(
        str(final), local_files_only=True, attn_implementation=attention, trust_remote_code=cfg.trust_remote_code
    )
    reloaded.to(device).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=fixed_batch[:, :-1].to(device), use_cache=False).logits.float().cpu()
    scale = trained_logits.abs().max().item()
    check = {
        "batch": list(fixed_batch[:, :-1].shape),
        "dtype": str(next(reloaded.parameters()).dtype)[6:],
        "max_abs_logit_diff": (logits - trained_logits).abs().max().item(),
        "max_abs_logit": scale,
        "loss_trained": F.cross_entropy(trained_logits.flatten(0, 1), fixed_batch[:, 1:].flatten()).item(),
        "loss_reloaded": F.cross_entropy(logits.flatten(0, 1), fixed_batch[:, 1:].flatten()).item(),
    }
    check["ok"] = check["max_abs_logit_diff"] <= 2**-6 * max(1.0, scale)  # a few bf16 ulps of the largest logit
    sample = ""
    if cfg.sample_tokens:
        # Greedy, so a rerun gives the same text; the penalty keeps a small model out of one-token loops.
        sample = generate_sample(
            reloaded,
            AutoTokenizer.from_pretrained(str(final)),
            cfg.sample_prompt,
            cfg.sample_tokens,
            repetition_penalty=1.3,
        )
    return {"export_check": check, "sample": cfg.sample_prompt + sample}


def summary(cfg: NLPConfig, ds_config: dict[str, Any], **facts: Any) -> dict[str, Any]:
    """``summary.json``: the keys every recipe reports, plus the NLP figures (same keys on both backends)."""
    from common.metrics import memory_kind
    from common.strategy import precision_of, zero_stage

    val_loss, initial = facts.pop("val_loss"), facts.pop("initial_val_loss")
    return {
        "val_loss": val_loss,
        "val_perplexity": math.exp(min(val_loss, 700.0)),
        "initial_val_loss": initial,
        "val_loss_ratio": val_loss / initial if initial else None,
        "throughput": facts.pop("throughput"),
        "mfu": facts.pop("mfu"),
        "peak_memory_bytes": facts.pop("peak_memory_bytes"),
        "memory_kind": memory_kind(),
        "model_state_bytes_per_rank": facts.pop("model_state_bytes_per_rank"),
        "wall_time_s": facts.pop("wall_time_s"),
        "preset": cfg.preset,
        "zero_stage": zero_stage(ds_config),
        "stage3_param_persistence_threshold": ds_config["zero_optimization"].get("stage3_param_persistence_threshold"),
        "world_size": facts.pop("world_size"),
        "attention": facts.pop("attention"),
        "precision": precision_of(ds_config),
        "model": cfg.model,
        **facts,
    }


class Clock:
    """Wall time since start and per-step durations that exclude evaluation and checkpoint time."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last = self.start
        self.step_seconds: list[float] = []

    def step_done(self) -> None:
        now = time.perf_counter()
        self.step_seconds.append(now - self.last)
        self.last = now

    def skip(self) -> None:
        """Do not count the time since the last step (evaluation, checkpoint) as step time."""
        self.last = time.perf_counter()

    def wall(self) -> float:
        return time.perf_counter() - self.start

    def median_step(self) -> float:
        """Median step time, leaving out the first steps (start-up) when there are enough."""
        from common.metrics import median

        kept = self.step_seconds[5:] if len(self.step_seconds) > 10 else self.step_seconds
        return median(kept) if kept else math.nan
