"""The fine-tuning recipe's config: every key of ``configs/finetune*.yaml``, checked when it is built.

``finetune.py`` and ``finetune_accelerate.py`` read it with ``common.config.parse_recipe_args``; what the run does
with it (data, base model + LoRA, exact match, run files, export, summary) is in ``finetuning.py``, the loss in
``finetune_loss.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.checkpoint import check_retention
from common.errors import ConfigError, nearest
from common.presets import check_preset_name, is_fsdp2_name, refuse_zero_only_features
from common.strategy import PRECISIONS
from nlp.model import ATTENTION_CHOICES

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "finetune_tiny_cpu.yaml"
DEFAULT_BASE_MODEL = "runs/nlp/final"  # what `python recipes/nlp/train.py` writes
BUILTIN_TASK = "arg_count"
LLAMA_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# A tiny few-step run a user can type too (on any base model= folder); `zero-recipes cp`'s smoke test uses it.
SMOKE_OVERRIDES: list[str] = [
    "max_steps=4",
    "n_train=64",
    "n_val=8",
    "micro_batch_size=2",
    "warmup_steps=1",
    "eval_interval=2",
    "checkpoint_interval=4",
    "log_interval=1",
    "lora_r=4",
    "lora_alpha=8",
    "max_new_tokens=2",
]


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
    collective_timeout_s: int = 900  # a rank waiting this long in a collective fails: a dead rank stops the others
    # --- DeepSpeed ---
    preset: str = "finetune"  # ZeRO-3 over the frozen base; preset=deepspeed_stage_2 keeps whole weights per rank
    network: str = ""  # link between nodes (100gbps, ib_hdr...): lint warns of stage 3 or buckets it does not suit
    precision: str = "bf16"  # bf16, fp16 or fp32
    ds_overrides: list[str] = field(default_factory=list)  # DeepSpeed key=value, e.g. zero_optimization.stage=2
    activation_checkpointing: str = "none"  # none|full|every_k|selective|save_memory_optimized (frozen base: fine)
    gradient_clipping: float = 1.0  # LoRA without clipping diverged to a constant answer here (docs/design.md)
    nvme_path: str = ""  # local NVMe folder the *_offload_nvme presets swap to ("": none)
    sequence_parallel: int = 1  # Ulysses: N ranks split each sequence; activations / N, world = N x data parallel
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
    keep_last: int = 2  # newest complete checkpoints kept; older ones are deleted once a newer one is published
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this, for good (0 = off)
    async_save: bool = False  # training waits only for a host-memory snapshot; the disk write runs behind it
    log_interval: int = 10

    def __post_init__(self) -> None:
        positive = "max_steps num_nodes micro_batch_size grad_accum seq_len lora_r n_train n_val max_new_tokens"
        positive += " sequence_parallel"
        for name in (positive + " eval_interval checkpoint_interval log_interval collective_timeout_s").split():
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("devices", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_preset_name(self.preset)  # a ZeRO or an FSDP2 preset; the nearest named
        if is_fsdp2_name(self.preset):  # what only DeepSpeed runs: refused before any work, naming its ZeRO preset
            refuse_zero_only_features(self.preset, vars(self))
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
        check_retention(self.keep_last, self.keep_every, self.checkpoint_interval)

    @property
    def pretrained(self) -> Path:
        """The base model folder."""
        return Path(self.model).expanduser()
