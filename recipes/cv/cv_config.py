"""The CV recipe's config: every key of ``configs/*.yaml``, checked when it is built.

``train.py`` and ``train_accelerate.py`` read it with ``common.config.parse_recipe_args``; what the run does with
it (data, model, loss, evaluation, run files) is in ``classification.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.checkpoint import check_retention
from common.errors import ConfigError, nearest
from common.presets import check_preset_name, is_fsdp2_name, refuse_zero_only_features
from common.strategy import PRECISIONS
from cv.model import SWIN_SIZES

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny_cpu.yaml"

# A tiny, few-step run (digits, 4 optimizer steps): `zero-recipes cp cv DEST` puts it in DEST/test_smoke.py.
SMOKE_OVERRIDES: list[str] = [
    "max_steps=4",
    "micro_batch_size=8",
    "warmup_steps=1",
    "eval_interval=2",
    "checkpoint_interval=4",
    "log_interval=1",
]


@dataclass
class CVConfig:
    """Every key of the CV recipe; ``configs/*.yaml`` and ``key=value`` overrides set them."""

    # --- run ---
    out_dir: str = "runs/cv"
    overwrite: bool = False  # replace an existing out_dir
    resume: bool = False  # continue from out_dir/checkpoints/latest
    max_steps: int = 1400  # optimizer steps
    devices: int = 0  # 0: every GPU, or 2 CPU processes without a GPU (Lightning; Accelerate takes its launcher's)
    num_nodes: int = 1
    seed: int = 0  # weights, data order and stochastic depth
    collective_timeout_s: int = 900  # a rank waiting this long in a collective fails: a dead rank stops the others
    # --- DeepSpeed ---
    preset: str = "cv"  # ZeRO-2, overlap_comm, contiguous gradients, buckets scaled to the model (zero-recipes ls)
    network: str = ""  # link between nodes (100gbps, ib_hdr...): lint warns of stage 3 or buckets it does not suit
    precision: str = "bf16"  # bf16, fp16 or fp32 (fp32: exact arithmetic, used by the resume test)
    ds_overrides: list[str] = field(default_factory=list)  # DeepSpeed key=value, e.g. zero_optimization.stage=1
    activation_checkpointing: str = "none"  # none|full|every_k|selective|save_memory_optimized
    gradient_clipping: float = 0.0  # max gradient norm, 0 = off
    nvme_path: str = ""  # local NVMe folder the *_offload_nvme presets swap to ("": none)
    # --- optimisation ---
    micro_batch_size: int = 16  # images per rank per forward pass: activations grow with it
    grad_accum: int = 1  # micro-batches per optimizer step: a larger batch at no extra activation memory
    lr: float = 3e-3
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio (1.0 = constant after warmup)
    weight_decay: float = 0.05  # on weight matrices; norms, biases and position-bias tables are not decayed
    warmup_steps: int = 70
    label_smoothing: float = 0.1
    # --- model ---
    model: str = "tiny"  # tiny|swin_tiny|swin_base (built from a config) or a local image-classification folder
    trust_remote_code: bool = False  # allow model code shipped inside a local model folder to run
    # --- data ---
    data: str = "digits"  # 'digits', an image folder (one subfolder per class) or a datasets.save_to_disk folder
    image_size: int = 32  # side in pixels; a Swin needs a multiple of patch x window x 2^(stages-1)
    val_fraction: float = 0.2  # held-out share when the data has no validation split
    data_seed: int = 0  # seed of the stratified train/val split
    data_workers: int = 0  # DataLoader processes decoding images (0: in the training process)
    # --- logging ---
    eval_interval: int = 200
    checkpoint_interval: int = 500
    keep_last: int = 2  # newest complete checkpoints kept; older ones are deleted once a newer one is published
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this, for good (0 = off)
    async_save: bool = False  # training waits only for a host-memory snapshot; the disk write runs behind it
    log_interval: int = 10

    def __post_init__(self) -> None:
        positive = (
            "max_steps",
            "num_nodes",
            "micro_batch_size",
            "grad_accum",
            "image_size",
            "eval_interval",
            "checkpoint_interval",
            "log_interval",
            "collective_timeout_s",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("devices", "warmup_steps", "data_workers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_preset_name(self.preset)  # a ZeRO or an FSDP2 preset; the nearest named
        if is_fsdp2_name(self.preset):  # what only DeepSpeed runs: refused before any work, naming its ZeRO preset
            refuse_zero_only_features(self.preset, vars(self))
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
                f"{nearest(self.precision, PRECISIONS)}"
            )
        if self.model not in SWIN_SIZES and not Path(self.model).expanduser().is_dir():
            raise ConfigError(
                f"model must be one of {', '.join(SWIN_SIZES)} or a local Hugging Face model folder; "
                f"{self.model!r} is neither{nearest(self.model, SWIN_SIZES)}"
            )
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.weight_decay < 0:
            raise ConfigError("need lr > 0, 0 <= min_lr_ratio <= 1 and weight_decay >= 0")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.resume and self.overwrite:
            raise ConfigError("resume=true and overwrite=true contradict each other; pick one")
        check_retention(self.keep_last, self.keep_every, self.checkpoint_interval)

    @property
    def pretrained(self) -> Path | None:
        """The local model folder, or None for a named Swin size built from a config."""
        return None if self.model in SWIN_SIZES else Path(self.model).expanduser()
