"""The NLP recipe's config: every key of ``configs/*.yaml``, checked when it is built.

``train.py``, ``train_accelerate.py`` and ``train_pipeline.py`` read it with ``common.config.parse_recipe_args``; what
the run does with it (data, model, loss, evaluation, run files, summary) is in ``pretraining.py``, how its ranks
split the model in ``nlp_layout.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.checkpoint import check_retention
from common.errors import ConfigError, nearest
from common.presets import FSDP2_PRESETS, check_preset_name, is_fsdp2_name, refuse_zero_only_features
from common.strategy import PRECISIONS
from nlp.data import STDLIB
from nlp.family import MODEL_SIZES, SHAPE_KEYS, ModelFamily, model_family, shape_overrides
from nlp.model import ATTENTION_CHOICES, LLAMA_SIZES
from nlp.moe import MOE_SIZES

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny_cpu.yaml"

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
    network: str = ""  # link between nodes (100gbps, ib_hdr...): lint warns of stage 3 or buckets it does not suit
    precision: str = "bf16"  # bf16, fp16 or fp32 (fp32: exact arithmetic, used by the resume test)
    ds_overrides: list[str] = field(default_factory=list)  # DeepSpeed key=value, e.g. zero_optimization.stage=2
    tensor_parallel: int = 1  # AutoTP: ranks that split every layer's matrices (Lightning, Accelerate; ZeRO 0-2)
    pipeline_parallel: int = 1  # pipeline stages, each holding a slice of the layers (train_pipeline.py; ZeRO 0-1)
    pipeline_micro_batches: int = 0  # micro-batches in flight per step (train_pipeline.py; 0: grad_accum's)
    expert_parallel: int = 1  # MoE models: ranks that split each MoE layer's experts (ZeRO 1-2); all-to-all per layer
    sequence_parallel: int = 1  # Ulysses: ranks that split every sequence (ZeRO 1-3; not eager); DP = world / it
    tiled_mlp_shards: int = 1  # MLP computed this many slices of the sequence at a time, recomputed in backward
    tiled_loss_shards: int = 1  # logits + loss computed this many slices at a time: never all logits at once
    offload_checkpoints: bool = False  # activation_checkpointing=full: each layer's input kept in host memory (GPU)
    activation_checkpointing: str = "none"  # none|full|every_k|selective|save_memory_optimized
    gradient_clipping: float = 1.0  # max gradient norm, 0 = off
    nvme_path: str = ""  # local NVMe folder the *_offload_nvme presets swap to ("": none)
    # --- optimisation ---
    micro_batch_size: int = 4  # sequences per rank per forward pass: activations grow with it
    grad_accum: int = 1  # micro-batches per optimizer step: a larger batch at no extra memory
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio (1.0 = constant after warmup)
    weight_decay: float = 0.1
    warmup_steps: int = 30
    # --- model ---
    model: str = "tiny"  # tiny|125m|1b|7b|8b|moe_tiny|mixtral_8x7b (built from a config) or a local HF model folder
    hidden_size: int = 0  # width on top of the named size (0: the size's own); parameters grow with its square
    intermediate_size: int = 0  # MLP width (0: the size's own)
    num_layers: int = 0  # depth (0: the size's own); parameters and activations grow with it
    num_heads: int = 0  # attention heads (0: the size's own); must divide hidden_size
    moe_aux_loss_coef: float = 0.01  # MoE models: weight of the router's load-balancing loss added to the LM loss
    moe_drop_tokens: bool = False  # MoE: fixed expert slots (DeepSpeed's capacity), tokens beyond them dropped
    moe_min_capacity: int = 4  # MoE with moe_drop_tokens: the smallest expert slot, in tokens
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
    keep_last: int = 2  # newest complete checkpoints kept; older ones are deleted once a newer one is published
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this, for good (0 = off)
    async_save: bool = False  # training waits only for a host-memory snapshot; the disk write runs behind it
    log_interval: int = 10
    sample_prompt: str = "    def __init__(self"  # the end-of-run sample continues this prompt
    sample_tokens: int = 48

    def __post_init__(self) -> None:
        positive = "max_steps num_nodes micro_batch_size grad_accum seq_len vocab_size eval_interval log_interval"
        positive += " checkpoint_interval collective_timeout_s tensor_parallel pipeline_parallel expert_parallel"
        positive += " sequence_parallel tiled_mlp_shards tiled_loss_shards"
        for name in positive.split():
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "devices",
            "warmup_steps",
            "max_train_tokens",
            "max_val_tokens",
            "sample_tokens",
            "pipeline_micro_batches",
            *SHAPE_KEYS,
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_preset_name(self.preset)  # a ZeRO or an FSDP2 preset; the nearest named
        if is_fsdp2_name(self.preset):  # what only DeepSpeed runs: refused before any work, naming its ZeRO preset
            refuse_zero_only_features(self.preset, vars(self))
            self.refuse_deepspeed_layers()
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
                f"{nearest(self.precision, PRECISIONS)}"
            )
        if self.attention not in ATTENTION_CHOICES:
            raise ConfigError(f"unknown attention {self.attention!r}{nearest(self.attention, ATTENTION_CHOICES)}")
        if self.model not in MODEL_SIZES and not Path(self.model).expanduser().is_dir():
            raise ConfigError(
                f"model must be one of {', '.join(MODEL_SIZES)} or a local Hugging Face model folder; "
                f"{self.model!r} is neither{nearest(self.model, MODEL_SIZES)}"
            )
        self.check_shape()
        if self.moe_aux_loss_coef < 0:
            raise ConfigError(f"moe_aux_loss_coef must be >= 0, got {self.moe_aux_loss_coef}")
        if self.moe_min_capacity < 0:
            raise ConfigError(f"moe_min_capacity must be >= 0, got {self.moe_min_capacity}")
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.weight_decay < 0:
            raise ConfigError("need lr > 0, 0 <= min_lr_ratio <= 1 and weight_decay >= 0")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.resume and self.overwrite:
            raise ConfigError("resume=true and overwrite=true contradict each other; pick one")
        check_retention(self.keep_last, self.keep_every, self.checkpoint_interval)
        if self.pipeline_micro_batches and self.grad_accum not in (1, self.pipeline_micro_batches):
            raise ConfigError(
                f"pipeline_micro_batches={self.pipeline_micro_batches} and grad_accum={self.grad_accum} both set the "
                "micro-batches per step; set one of them"
            )
        if self.pipeline_micro_batches:  # the pipeline's name for gradient accumulation: one value from here on
            self.grad_accum = self.pipeline_micro_batches

    def refuse_deepspeed_layers(self) -> None:
        """Under an FSDP2 preset, the model options built from DeepSpeed's own layers: its MoE layer (whose groups
        ``deepspeed.initialize`` creates) and its activation-checkpoint offload."""
        if self.model in MOE_SIZES:
            raise ConfigError(
                f"model={self.model} is built with DeepSpeed's MoE layer, which runs only on DeepSpeed, not under "
                f"preset={self.preset}: use preset=deepspeed_stage_2, or a dense size ({', '.join(LLAMA_SIZES)})"
            )
        if self.offload_checkpoints:
            raise ConfigError(
                f"offload_checkpoints=true (DeepSpeed's activation-checkpoint offload) runs only on DeepSpeed, not "
                f"under preset={self.preset}: use preset={FSDP2_PRESETS[self.preset]['counterpart']}, or "
                "activation_checkpointing=full without the offload"
            )

    def check_shape(self) -> None:
        """Width and depth keys apply to a named size (a folder has its own config.json), and the hidden size must
        split into the heads."""
        given = [key for key in SHAPE_KEYS if getattr(self, key)]
        if given and self.model not in MODEL_SIZES:
            raise ConfigError(
                f"{given[0]}={getattr(self, given[0])} sets the width or depth of a named size; model={self.model} is "
                "a folder with its own config.json: set it to 0 or use a named size"
            )
        if self.model not in MODEL_SIZES:
            return
        shape = {**MODEL_SIZES[self.model], **self.shape_overrides}
        hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
        if hidden % heads or heads % shape["num_key_value_heads"]:
            fit = max(heads, hidden // heads * heads)
            raise ConfigError(
                f"hidden_size={hidden} does not split into the {heads} attention heads (and their "
                f"{shape['num_key_value_heads']} key/value heads); use hidden_size={fit} or num_heads dividing {hidden}"
            )

    @property
    def shape_overrides(self) -> dict[str, int]:
        """The transformers config fields the width and depth keys set on top of the named size."""
        return shape_overrides(self.model, **{key: getattr(self, key) for key in SHAPE_KEYS})

    @property
    def pretrained(self) -> Path | None:
        """The local model folder, or None for a named size built from a config."""
        return None if self.model in MODEL_SIZES else Path(self.model).expanduser()

    @property
    def family(self) -> ModelFamily:
        """What the loops call for the model (nlp/family.py): a dense Llama, or DeepSpeed-MoE with its aux loss."""
        return model_family(
            self.model, self.moe_aux_loss_coef, self.expert_parallel, self.moe_drop_tokens, self.moe_min_capacity
        )

    @property
    def tiled(self) -> bool:
        """The MLP or the loss computed a slice of the sequence at a time (common/tiling.py)."""
        return self.tiled_mlp_shards > 1 or self.tiled_loss_shards > 1

    @property
    def moe(self) -> bool:
        """A Mixture-of-Experts size (nlp/moe.py: DeepSpeed's MoE layer in every decoder layer)."""
        return self.model in MOE_SIZES
