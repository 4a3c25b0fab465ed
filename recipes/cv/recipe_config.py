"""Config and shared setup of the CV recipe: a Swin image classifier under ZeRO-2 (the ``cv`` preset).

``train.py`` (Lightning) and ``train_accelerate.py`` (Accelerate) both import this module, so they train
the same model on the same data, in the same order, with the same DeepSpeed config, and write the same
run files. Keys of :class:`CVConfig` are the keys of ``configs/*.yaml``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from common.config import config_to_dict, dump_yaml, parse_overrides, parse_recipe_args
from common.errors import ConfigError, nearest
from common.model_folder import check_weight_files
from common.presets import PRESET_NAMES
from common.rundir import refuse_existing_out_dir, set_cpu_threads
from common.strategy import PRECISIONS, RunFacts, cosine_with_warmup, resolve_deepspeed_config
from cv.data import DataError, ImageData, describe, load_image_data
from cv.model import SWIN_SIZES, ModelError

RECIPE_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = RECIPE_DIR / "configs" / "tiny_cpu.yaml"
CONFUSION_PNG = "confusion_matrix.png"

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
    precision: str = "bf16"  # bf16, fp16 or fp32 (fp32: exact arithmetic, used by the resume test)
    ds_overrides: list[str] = field(default_factory=list)  # DeepSpeed key=value, e.g. zero_optimization.stage=1
    activation_checkpointing: str = "none"  # none|full|every_k|selective|save_memory_optimized
    gradient_clipping: float = 0.0  # max gradient norm, 0 = off
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
        if self.preset not in PRESET_NAMES:
            raise ConfigError(f"unknown preset {self.preset!r}{nearest(self.preset, PRESET_NAMES)}")
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

    @property
    def pretrained(self) -> Path | None:
        """The local model folder, or None for a named Swin size built from a config."""
        return None if self.model in SWIN_SIZES else Path(self.model).expanduser()


def parse_args(argv: list[str] | None = None) -> CVConfig:
    """``--config FILE`` (default ``DEFAULT_CONFIG``), ``key=value`` overrides, ``--print-config``."""
    return parse_recipe_args(CVConfig, DEFAULT_CONFIG, argv)


def set_threads(local_processes: int) -> None:
    """One intra-op thread per core per process on a CPU (:func:`common.rundir.set_cpu_threads`)."""
    set_cpu_threads(local_processes)


def check_out_dir(cfg: CVConfig) -> None:
    """Refuse an existing run directory before anything is read or written (prepare_run_dir acts later)."""
    refuse_existing_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite)


def resume_point(cfg: CVConfig, world_size: int) -> Any:
    """The :class:`common.resume.ResumePoint` of ``resume=true`` (None for a new run), checked before any work:
    refuses a config that differs from the run's, no complete checkpoint, no steps left."""
    from common.resume import find_resume_point

    return find_resume_point(cfg.out_dir, config_to_dict(cfg), world_size) if cfg.resume else None


# --- data ----------------------------------------------------------------------------------------


def load_data(cfg: CVConfig, world_size: int) -> ImageData:
    """Digits, an image folder or a saved dataset, split and checked against the batch size."""
    data = load_image_data(cfg.data, cfg.image_size, val_fraction=cfg.val_fraction, seed=cfg.data_seed)
    if len(data.train) < cfg.micro_batch_size * world_size:
        raise DataError(
            f"{cfg.data}: {len(data.train)} training images, fewer than one global micro-batch "
            f"({cfg.micro_batch_size} x {world_size} ranks); add images or lower micro_batch_size"
        )
    return data


def train_loader(
    data: ImageData, cfg: CVConfig, rank: int, world_size: int, start_step: int, full_length: bool = False
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
    return torch.utils.data.DataLoader(
        data.train, batch_size=cfg.micro_batch_size, sampler=sampler, num_workers=cfg.data_workers
    )


# --- model and optimisation ----------------------------------------------------------------------


def read_model_config(cfg: CVConfig) -> Any:
    """The model's transformers config without building the model (a named size gets the digits' 10 labels)."""
    from transformers import AutoConfig, SwinConfig

    if cfg.pretrained is None:
        return SwinConfig(**SWIN_SIZES[cfg.model], num_labels=10)
    if not (cfg.pretrained / "config.json").is_file():
        raise ModelError(f"model folder {cfg.pretrained} has no config.json; expected a folder from save_pretrained")
    check_weight_files(cfg.pretrained)  # a truncated *.safetensors: one line naming it, not a traceback on rank 0
    try:
        return AutoConfig.from_pretrained(str(cfg.pretrained), trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{cfg.pretrained}: cannot read config.json ({exc})") from exc


def model_facts(cfg: CVConfig) -> dict[str, Any]:
    """Parameter counts for ``zero-recipes estimate/probe --recipe cv``, the model built on the meta device.

    Activations are not estimated (the planner's formula is a language transformer's): ``probe`` measures them.
    """
    from transformers import AutoModelForImageClassification

    from common.memory_formulas import count_module

    config = read_model_config(cfg)
    with torch.device("meta"):
        model = AutoModelForImageClassification.from_config(config, trust_remote_code=cfg.trust_remote_code)
    total, largest = count_module(model)
    source = f"recipe cv ({type(model).__name__}, counted on the meta device)"
    hidden = getattr(config, "hidden_size", None)
    return {
        "num_params": total,
        "largest_layer_params": largest,
        "architecture": config.model_type,
        "hidden_size": hidden,
        "source": source,
    }


def resolve_ds_config(cfg: CVConfig, world_size: int) -> dict[str, Any]:
    """The factory's DeepSpeed dict for this run (buckets scaled to the model's width), checked by the linter."""
    from common.lint import lint_at_start

    hidden = getattr(read_model_config(cfg), "hidden_size", None)
    facts = RunFacts(
        world_size=world_size,
        micro_batch_size=cfg.micro_batch_size,
        grad_accum=cfg.grad_accum,
        precision=cfg.precision,
        hidden_size=hidden,
        gradient_clipping=cfg.gradient_clipping,
    )
    ds_config = resolve_deepspeed_config(cfg.preset, facts, parse_overrides(cfg.ds_overrides))
    # The guides' pitfalls, checked before any work (printed on rank 0; errors refuse the run).
    lint_at_start(ds_config, config_to_dict(cfg), hidden_size=hidden, world_size=world_size)
    return ds_config


def build_model(cfg: CVConfig, data: ImageData) -> torch.nn.Module:
    """The classifier, built from a named Swin size or loaded from ``model=``; the same weights on every rank."""
    from cv.model import build_model as build
    from cv.model import swin_block_class

    torch.manual_seed(cfg.seed)
    model = build(cfg.model, data.num_classes, data.image_size, data.class_names, cfg.trust_remote_code)
    if cfg.activation_checkpointing != "none":
        from common.activation import apply_activation_checkpointing

        swin = getattr(model.config, "model_type", "") == "swin"
        report = apply_activation_checkpointing(
            model, cfg.activation_checkpointing, block_classes=[swin_block_class()] if swin else None
        )
        print(report.summary())
    return model


NO_DECAY = ("relative_position_bias_table", "position_embeddings", "mask_token")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight matrices decay; norms, biases and position tables do not (the Swin paper's rule)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 partitions are empty: read the whole shape
        (no_decay if len(shape) < 2 or any(key in name for key in NO_DECAY) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(cfg: CVConfig) -> Any:
    """LambdaLR multiplier: warmup, then cosine to ``min_lr_ratio``."""
    return lambda step: cosine_with_warmup(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)


def step_lr(cfg: CVConfig, step: int) -> float:
    """The learning rate optimizer step ``step`` (1-based) used."""
    return cfg.lr * lr_lambda(cfg)(step - 1)


def seed_micro_batch(cfg: CVConfig, micro_batch: int, rank: int) -> None:
    """Reseed before each micro-batch: stochastic depth then depends on (seed, micro-batch, rank) only,
    so a resumed run and the other backend drop the same blocks as the uninterrupted run."""
    torch.manual_seed((cfg.seed * 1_000_003 + micro_batch) * 1009 + rank)


def param_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def classification_loss(
    model: torch.nn.Module, pixels: torch.Tensor, labels: torch.Tensor, label_smoothing: float
) -> torch.Tensor:
    """Cross entropy in fp32. DeepSpeed bf16 holds bf16 weights, so the pixels are cast to the weights' dtype."""
    logits = model(pixel_values=pixels.to(param_dtype(model))).logits
    return F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum or max over ranks (a no-op in one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: ImageData, cfg: CVConfig, rank: int, world_size: int, device: torch.device
) -> dict[str, Any]:
    """Validation loss, accuracy and confusion matrix over every rank's share of the validation set.

    Rank r takes every world_size-th image; every rank runs the same number of batches (the short ones are
    padded with image 0 and masked out), so the forward passes stay collective-safe under ZeRO-3.
    """
    was_training = model.training
    model.eval()
    n, k = len(data.val), data.num_classes
    per_rank = math.ceil(n / world_size)
    mine = [i if i < n else -1 for i in range(rank, per_rank * world_size, world_size)]
    matrix = torch.zeros(k * k, dtype=torch.float64, device=device)
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    batch = 2 * cfg.micro_batch_size
    for start in range(0, per_rank, batch):
        ids = mine[start : start + batch]
        items = [data.val[max(i, 0)] for i in ids]
        pixels = torch.stack([pixels for pixels, _ in items]).to(device)
        labels = torch.stack([label for _, label in items]).to(device)
        keep = torch.tensor([i >= 0 for i in ids], device=device)
        logits = model(pixel_values=pixels.to(param_dtype(model))).logits.float()
        losses = F.cross_entropy(logits, labels, reduction="none")
        loss_sum += losses[keep].double().sum()
        flat = labels[keep] * k + logits[keep].argmax(dim=-1)
        matrix += torch.bincount(flat, minlength=k * k).double()
    model.train(was_training)
    all_reduce(matrix)
    all_reduce(loss_sum)
    counts = matrix.round().long().cpu().numpy().reshape(k, k)
    return {"val_accuracy": float(np.trace(counts) / n), "val_loss": float(loss_sum.item() / n), "confusion": counts}


# --- run files -----------------------------------------------------------------------------------


def write_run_files(
    cfg: CVConfig, out_dir: Path, ds_config: dict[str, Any], data: ImageData, world_size: int, device: str
) -> None:
    """Rank 0, before training: ``config.yaml`` (resolved), ``ds_config.json``, ``env.json``."""
    from common.rundir import env_info, write_json_atomic, write_text_atomic

    write_text_atomic(out_dir / "config.yaml", dump_yaml(config_to_dict(cfg)))
    write_json_atomic(out_dir / "ds_config.json", ds_config)
    write_json_atomic(out_dir / "env.json", {**env_info(device, world_size), "data": describe(data)})


def export_logits(model: torch.nn.Module, data: ImageData, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed validation batch and the trained model's logits on it (every rank: collective under ZeRO-3)."""
    count = min(8, len(data.val))
    pixels = torch.stack([data.val[i][0] for i in range(count)])
    model.eval()
    with torch.no_grad():
        logits = model(pixel_values=pixels.to(device, param_dtype(model))).logits.float().cpu()
    return pixels, logits


def final_export(
    model: Any,
    state_dict: dict[str, torch.Tensor],
    out_dir: Path,
    pixels: torch.Tensor,
    trained_logits: torch.Tensor,
    cfg: CVConfig,
    device: torch.device,
) -> dict[str, Any]:
    """Rank 0: write ``final/`` (Hugging Face format, safetensors), reload it as a user would, compare logits.

    The weights are saved in the training dtype (bf16 under the ``cv`` preset), and ``from_pretrained`` loads
    them in that dtype, so the reloaded model must give exactly the trained model's logits.
    """
    from transformers import AutoModelForImageClassification
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from common.checkpoint import save_hf_model

    unset_hf_deepspeed_config()  # under ZeRO-3 Accelerate sets one: from_pretrained on rank 0 alone would partition
    keys = set(model.state_dict())
    final = save_hf_model(model, {k: v for k, v in state_dict.items() if k in keys}, out_dir / "final")
    reloaded = (
        AutoModelForImageClassification.from_pretrained(
            str(final), local_files_only=True, trust_remote_code=cfg.trust_remote_code
        )
        .to(device)
        .eval()
    )  # the training device: the same kernels as the trained logits
    with torch.no_grad():
        logits = reloaded(pixel_values=pixels.to(device, param_dtype(reloaded))).logits.float().cpu()
    diff = (logits - trained_logits).abs().max().item()
    return {
        "export_check": {
            "batch": list(pixels.shape),
            "dtype": str(param_dtype(reloaded)).removeprefix("torch."),
            "max_abs_logit_diff": diff,
            "identical": bool(torch.equal(logits, trained_logits)),
        }
    }


def finish(
    cfg: CVConfig,
    ds_config: dict[str, Any],
    engine: Any,
    model: torch.nn.Module,
    data: ImageData,
    rank: int,
    world_size: int,
    device: torch.device,
    clock: Clock,
    metrics: Any,
    **facts: Any,
) -> None:
    """After training, on every rank: final evaluation, memory figures, whole weights (collective); then rank 0
    writes ``final/``, ``confusion_matrix.png`` and ``summary.json``."""
    from common.accounting import model_state_bytes
    from common.checkpoint import gather_full_state_dict
    from common.metrics import peak_memory_bytes, throughput
    from common.rundir import write_json_atomic
    from cv.model import count_parameters
    from cv.plots import plot_confusion_matrix

    out_dir, steps = Path(cfg.out_dir), facts["steps"]
    result = evaluate(model, data, cfg, rank, world_size, device)
    metrics.log(steps, val_loss=result["val_loss"], val_accuracy=result["val_accuracy"], elapsed_s=clock.wall())
    state_bytes = model_state_bytes(engine)  # after the last step: ZeRO has released the gradients
    pixels, logits = export_logits(model, data, device)
    weights = gather_full_state_dict(model, rank)  # collective (a gather per parameter under ZeRO-3)
    peak = int(all_reduce(torch.tensor(float(peak_memory_bytes()), device=device), "max").item())
    if rank != 0:
        return
    exported = final_export(model, weights, out_dir, pixels, logits, cfg, device)
    plot_confusion_matrix(
        result["confusion"],
        data.class_names,
        out_dir / CONFUSION_PNG,
        title=f"{cfg.model} on {Path(cfg.data).name}, step {steps}",
    )
    samples_per_s = cfg.micro_batch_size * cfg.grad_accum / clock.median_step()
    report = summary(
        cfg,
        ds_config,
        data,
        **result,
        throughput=throughput(samples_per_s, "samples/s/device"),
        peak_memory_bytes=peak,
        model_state_bytes_per_rank=state_bytes["model_states"],
        model_state_breakdown=state_bytes,
        wall_time_s=round(clock.wall(), 1),
        world_size=world_size,
        num_params=count_parameters(model),
        median_step_s=round(clock.median_step(), 4),
        **facts,
        **exported,
    )
    write_json_atomic(out_dir / "summary.json", report)
    metrics.close()
    print(
        f"val_accuracy {report['val_accuracy']:.4f} (majority class {report['majority_baseline_accuracy']:.3f}); "
        f"{samples_per_s:.0f} samples/s/device; wall {report['wall_time_s']:.0f} s; run directory {out_dir}",
        flush=True,
    )


def summary(cfg: CVConfig, ds_config: dict[str, Any], data: ImageData, **facts: Any) -> dict[str, Any]:
    """``summary.json``: the keys every recipe reports, plus the CV figures (same keys on both backends)."""
    from common.metrics import memory_kind
    from common.strategy import precision_of, zero_stage

    confusion = facts.pop("confusion")
    val_counts = confusion.sum(axis=1)
    return {
        "val_accuracy": facts.pop("val_accuracy"),
        "val_loss": facts.pop("val_loss"),
        "majority_baseline_accuracy": float(val_counts.max() / val_counts.sum()),
        "throughput": facts.pop("throughput"),
        "peak_memory_bytes": facts.pop("peak_memory_bytes"),
        "memory_kind": memory_kind(),
        "model_state_bytes_per_rank": facts.pop("model_state_bytes_per_rank"),
        "wall_time_s": facts.pop("wall_time_s"),
        "preset": cfg.preset,
        "zero_stage": zero_stage(ds_config),
        "world_size": facts.pop("world_size"),
        "precision": precision_of(ds_config),
        "model": cfg.model,
        "data": {"source": cfg.data, **describe(data)},
        "confusion_matrix": confusion.tolist(),
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
