"""The science recipe's config: every key of ``configs/*.yaml``, checked when it is built.

``train.py`` and ``train_accelerate.py`` read it with ``common.config.parse_recipe_args``; what the run does with
it (data, model, evaluation, run files) is in ``operator_learning.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.activation import check_preset
from common.checkpoint import check_retention
from common.errors import ConfigError, nearest
from common.presets import check_preset_name, is_fsdp2_name, refuse_zero_only_features
from common.strategy import RunFacts, resolve_deepspeed_config
from science.burgers import PAPER_TEXT, PUBLIC_GENERATOR
from science.fno import min_grid_size

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny_cpu.yaml"
MODELS = ("fno1d", "fno2d")
# Generated problems, and the model each one needs: Burgers is 1-D, Darcy flow 2-D (a user's .npz: by its arrays).
GENERATED_DATA = {"burgers": "fno1d", "darcy": "fno2d"}
# Burgers' initial-condition fields (the GRF's alpha, tau, sigma): the paper's text, or its public generator,
# which pairs a rougher field with viscosity 1e-3.
INITIAL_FIELDS = {
    name: {key: value for key, value in field.items() if key != "viscosity"}
    for name, field in (("paper_text", PAPER_TEXT), ("public_generator", PUBLIC_GENERATOR))
}
# Precision matters in science: fp16, whose 5-bit exponent overflows and underflows where bf16's does not, is refused.
PRECISIONS = ("bf16", "fp32")
# fmt: off
POSITIVE_KEYS = ("max_steps", "num_nodes", "micro_batch_size", "grad_accum", "modes", "width", "n_layers", "proj_width",
                 "n_train", "grid_size", "solve_grid", "data_workers", "superres_factor", "eval_interval",
                 "checkpoint_interval", "log_interval", "collective_timeout_s")
# fmt: on

# A tiny few-step run a user can type too; `zero-recipes cp`'s generated smoke test uses it.
SMOKE_OVERRIDES: list[str] = [
    "max_steps=8",
    "n_train=40",
    "n_test=8",
    "grid_size=64",
    "solve_grid=256",
    "modes=8",
    "width=16",
    "n_layers=2",
    "proj_width=32",
    "micro_batch_size=4",
    "data_workers=1",
    "eval_interval=4",
    "checkpoint_interval=8",
]


@dataclass
class ScienceConfig:
    """Every key of the science recipe; ``configs/*.yaml`` and ``key=value`` overrides set them."""

    # --- run ---
    out_dir: str = "runs/science"
    overwrite: bool = False  # replace an existing out_dir
    resume: bool = False  # continue from out_dir/checkpoints/latest
    max_steps: int = 1500  # optimizer steps
    devices: int = 0  # 0: every GPU, or 2 CPU processes without a GPU (Lightning; Accelerate takes its launcher's)
    num_nodes: int = 1
    seed: int = 0
    collective_timeout_s: int = 900  # a rank waiting this long in a collective fails: a dead rank stops the others
    # --- DeepSpeed ---
    preset: str = "science"  # ZeRO-2, bf16, round_robin_gradients (zero-recipes ls)
    network: str = ""  # link between nodes (100gbps, ib_hdr...): lint warns of stage 3 or buckets it does not suit
    precision: str = "bf16"  # bf16 or fp32; fp16 is refused (its range is too narrow)
    ds_overrides: list[str] = field(default_factory=list)  # DeepSpeed key=value, e.g. zero_optimization.stage=1
    activation_checkpointing: str = "none"  # none|full|every_k|save_memory_optimized: compute traded for memory
    gradient_clipping: float = 0.0  # max gradient norm, 0 = off
    nvme_path: str = ""  # local NVMe folder the *_offload_nvme presets swap to ("": none)
    # --- optimisation ---
    micro_batch_size: int = 10  # samples per rank per forward pass: more memory, fewer steps per epoch
    grad_accum: int = 1  # micro-batches per optimizer step: a larger batch at no extra memory
    lr: float = 1e-3
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio (1.0 = constant lr after warmup)
    weight_decay: float = 1e-4
    warmup_steps: int = 0
    lr_decay_every: int = 0  # 0: cosine to lr * min_lr_ratio; N: lr x lr_decay_gamma every N steps (the paper's StepLR)
    lr_decay_gamma: float = 0.5  # the paper halves the lr every 100 epochs
    # --- model (FNO, Li et al. 2021) ---
    model: str = "fno1d"  # fno1d (Burgers, 1-D data) or fno2d (Darcy flow, 2-D data)
    modes: int = 16  # Fourier modes kept per layer
    width: int = 64  # channels: parameters grow with width^2 x modes
    n_layers: int = 4
    proj_width: int = 128
    fp32_head: bool = True  # under bf16 the projection head computes in fp32 (docs/science.md: why)
    padding: int = 9  # fno2d: zero points appended around the Fourier layers (Darcy is not periodic; the paper: 9)
    standardize: bool = False  # scale input and output by the training data's statistics (the paper's Darcy normalizer)
    # --- data ---
    data: str = "burgers"  # 'burgers' or 'darcy' (generated here) or a path to an .npz: x and y [N, grid(, grid)]
    n_train: int = 1000
    n_test: int = 200
    grid_size: int = 256  # training points (darcy: nodes per side); divides solve_grid (darcy: minus 1 each)
    initial_field: str = "paper_text"  # burgers: GRF of the paper's text, or public_generator (gen_burgers1.m)
    viscosity: float = 0.1  # burgers: the paper's text; its public generator uses 0.001 (shocks: burgers_nu1e-3.yaml)
    solve_grid: int = 1024  # the solver's grid, sub-sampled to grid_size (darcy: the paper solves on 421 nodes)
    data_seed: int = 0
    cache_dir: str = "~/.cache/zero-recipes/science"
    data_workers: int = 2  # solver processes when the data are not cached yet
    val_fraction: float = 0.2  # held-out share of a user's .npz
    superres_factor: int = 4  # burgers: also test at grid_size x this (zero-shot super-resolution); 1 = off
    # --- logging ---
    eval_interval: int = 250
    checkpoint_interval: int = 500
    keep_last: int = 2  # newest complete checkpoints kept; older ones are deleted once a newer one is published
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this, for good (0 = off)
    async_save: bool = False  # training waits only for a host-memory snapshot; the disk write runs behind it
    log_interval: int = 10
    trust_remote_code: bool = False  # no hub models here; kept for the common key set

    def __post_init__(self) -> None:
        for name in POSITIVE_KEYS:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("devices", "n_test", "warmup_steps", "lr_decay_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.precision == "fp16":
            # The science preset refuses it in the factory; the recipe refuses it whatever the preset.
            resolve_deepspeed_config("science", RunFacts(precision="fp16"))
        if self.precision not in PRECISIONS:
            hint = nearest(self.precision, PRECISIONS)
            raise ConfigError(f"precision must be bf16 or fp32, got {self.precision!r}{hint}")
        check_preset_name(self.preset)  # a ZeRO or an FSDP2 preset; the nearest named
        if is_fsdp2_name(self.preset):  # what only DeepSpeed runs: refused before any work, naming its ZeRO preset
            refuse_zero_only_features(self.preset, vars(self))
        check_preset(self.activation_checkpointing)
        if self.activation_checkpointing == "selective":
            raise ConfigError("activation_checkpointing=selective needs attention layers; the FNO has none (use full)")
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}{nearest(self.model, MODELS)}; valid: {', '.join(MODELS)}")
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.weight_decay < 0:
            raise ConfigError("need lr > 0, 0 <= min_lr_ratio <= 1 and weight_decay >= 0")
        if not 0.0 < self.lr_decay_gamma <= 1.0:
            raise ConfigError(f"lr_decay_gamma must be in (0, 1], got {self.lr_decay_gamma}")
        if self.initial_field not in INITIAL_FIELDS:
            hint = nearest(self.initial_field, list(INITIAL_FIELDS))
            raise ConfigError(f"unknown initial_field {self.initial_field!r}{hint}; valid: {', '.join(INITIAL_FIELDS)}")
        if self.viscosity <= 0:
            raise ConfigError(f"viscosity must be > 0, got {self.viscosity}")
        if self.padding < 0:
            raise ConfigError(f"padding must be >= 0, got {self.padding}")
        if self.data in GENERATED_DATA:
            self._check_generated_data()
        if self.resume and self.overwrite:
            raise ConfigError("resume=true and overwrite=true contradict each other; pick one")
        check_retention(self.keep_last, self.keep_every, self.checkpoint_interval)
        if self.trust_remote_code:
            raise ConfigError("trust_remote_code has no use in the science recipe (it loads no hub code)")

    def _check_generated_data(self) -> None:
        """The generated problems' grids, model and test set (a user's .npz is checked when it is read)."""
        needed = GENERATED_DATA[self.data]
        if self.model != needed:
            raise ConfigError(f"data={self.data} needs model={needed}, got model={self.model}")
        if self.n_test < 1:
            raise ConfigError("n_test must be >= 1 to measure the error")
        if self.data == "darcy":
            need = min_grid_size(self.modes, 2, self.padding)
            if self.grid_size < need:
                raise ConfigError(
                    f"grid_size {self.grid_size} is too coarse for modes={self.modes} with padding={self.padding} "
                    f"(needs >= {need} nodes per side)"
                )
            if self.grid_size < 3 or self.solve_grid < self.grid_size or (self.solve_grid - 1) % (self.grid_size - 1):
                raise ConfigError(
                    f"grid_size - 1 ({self.grid_size - 1}) must divide solve_grid - 1 ({self.solve_grid - 1}): "
                    "e.g. grid_size=85 solve_grid=421 (the paper's s = 85)"
                )
            if self.superres_factor != 1:
                raise ConfigError("superres_factor is for burgers; darcy is tested at its own grid (superres_factor=1)")
            return
        if self.grid_size < min_grid_size(self.modes):
            raise ConfigError(
                f"grid_size {self.grid_size} is too coarse for modes={self.modes} "
                f"(needs >= {min_grid_size(self.modes)} points)"
            )
        finest = self.grid_size * self.superres_factor
        if self.solve_grid % self.grid_size or self.solve_grid % finest:
            raise ConfigError(f"grid_size x superres_factor ({finest}) must divide solve_grid ({self.solve_grid})")
