"""What the CV recipe trains and reports: data, the Swin classifier, loss, evaluation, run files and summary.json.

``train.py`` (Lightning) and ``train_accelerate.py`` (Accelerate) both import this module, so they train the same
model on the same data, in the same order, with the same DeepSpeed config, and write the same run files. The
config is in ``cv_config.py``; ``describe(cfg)`` is what ``--describe`` prints for the planning tools.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from cv_config import CVConfig  # next to this script
from transformers import AutoConfig, AutoModelForImageClassification, SwinConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from common.accounting import model_state_bytes
from common.activation import apply_activation_checkpointing
from common.checkpoint import gather_full_state_dict, save_hf_model
from common.comms_log import summary_communication
from common.config import config_to_dict, dump_yaml, parse_overrides
from common.data import StepSampler
from common.describe import RecipeDescription, local_world
from common.lint import lint_at_start
from common.memory_formulas import facts_from_module
from common.metrics import Clock, all_reduce, memory_kind, peak_memory_bytes, throughput
from common.model_folder import check_weight_files
from common.rundir import MetricsLog, env_info, summary_fields, write_json_atomic, write_text_atomic
from common.strategy import RunFacts, cosine_with_warmup, precision_of, resolve_deepspeed_config, zero_stage
from cv.data import DataError, ImageData, load_image_data
from cv.data import describe as describe_data
from cv.model import SWIN_SIZES, ModelError, count_parameters, swin_block_class
from cv.model import build_model as build_classifier
from cv.plots import plot_confusion_matrix

CONFUSION_PNG = "confusion_matrix.png"
# Parameters AdamW does not decay besides norms and biases (the Swin paper's rule).
NO_DECAY = ("relative_position_bias_table", "position_embeddings", "mask_token")


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
    return torch.utils.data.DataLoader(
        data.train, batch_size=cfg.micro_batch_size, sampler=sampler, num_workers=cfg.data_workers
    )


# --- model and optimisation ----------------------------------------------------------------------


def read_model_config(cfg: CVConfig) -> Any:
    """The model's transformers config, from ``config.json`` alone (a named size gets the digits' 10 labels)."""
    if cfg.pretrained is None:
        return SwinConfig(**SWIN_SIZES[cfg.model], num_labels=10)
    if not (cfg.pretrained / "config.json").is_file():
        raise ModelError(f"model folder {cfg.pretrained} has no config.json; expected a folder from save_pretrained")
    try:
        return AutoConfig.from_pretrained(str(cfg.pretrained), trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{cfg.pretrained}: cannot read config.json ({exc})") from exc


def build_model(cfg: CVConfig, data: ImageData) -> torch.nn.Module:
    """The classifier, built from a named Swin size or loaded from ``model=``; the same weights on every rank."""
    if cfg.pretrained is not None:
        check_weight_files(cfg.pretrained)  # a truncated *.safetensors: one line naming it, not a traceback
    torch.manual_seed(cfg.seed)
    model = build_classifier(cfg.model, data.num_classes, data.image_size, data.class_names, cfg.trust_remote_code)
    if cfg.activation_checkpointing != "none":
        swin = getattr(model.config, "model_type", "") == "swin"
        report = apply_activation_checkpointing(
            model, cfg.activation_checkpointing, block_classes=[swin_block_class()] if swin else None
        )
        print(report.summary())
    return model


def deepspeed_config(cfg: CVConfig, world_size: int, hidden_size: int | None) -> dict[str, Any]:
    """The factory's DeepSpeed dict for this run (buckets scaled to the model's width)."""
    facts = RunFacts.from_fields(cfg, world_size, hidden_size)
    return resolve_deepspeed_config(cfg.preset, facts, parse_overrides(cfg.ds_overrides))


def resolve_ds_config(cfg: CVConfig, world_size: int) -> dict[str, Any]:
    """The run's DeepSpeed dict, checked for known pitfalls (lint rules) before any work (errors refuse the run)."""
    hidden = getattr(read_model_config(cfg), "hidden_size", None)
    ds_config = deepspeed_config(cfg, world_size, hidden)
    lint_at_start(ds_config, config_to_dict(cfg), hidden_size=hidden, world_size=world_size)
    return ds_config


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


# --- evaluation ----------------------------------------------------------------------------------


@dataclass
class Evaluation:
    """Validation figures over every rank's share of the validation set."""

    val_accuracy: float
    val_loss: float
    confusion: np.ndarray  # [true class, predicted class] counts


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: ImageData, cfg: CVConfig, rank: int, world_size: int, device: torch.device
) -> Evaluation:
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
    return Evaluation(float(np.trace(counts) / n), float(loss_sum.item() / n), counts)


# --- what --describe prints ----------------------------------------------------------------------


def describe(cfg: CVConfig) -> RecipeDescription:
    """The run as the planning tools see it: reads the model's config only (no data, no weights), writes nothing.

    Parameters are counted on the meta device. Activations are not estimated (the planner's formula is a language
    transformer's): ``zero-recipes probe`` measures them.
    """
    devices, num_nodes = local_world(cfg.devices, cfg.num_nodes)
    config = read_model_config(cfg)
    with torch.device("meta"):
        model = AutoModelForImageClassification.from_config(config, trust_remote_code=cfg.trust_remote_code)
    hidden = getattr(config, "hidden_size", None)
    facts = facts_from_module(model, architecture=config.model_type, hidden_size=hidden, recipe="cv")
    ds_config = deepspeed_config(cfg, devices * num_nodes, hidden)
    return RecipeDescription.of("cv", cfg, ds_config, facts, seq_len=None)


# --- run files -----------------------------------------------------------------------------------


def write_run_files(
    cfg: CVConfig, out_dir: Path, ds_config: dict[str, Any], data: ImageData, world_size: int, device: str
) -> None:
    """Rank 0, before training: ``config.yaml`` (resolved), ``ds_config.json``, ``env.json``."""
    write_text_atomic(out_dir / "config.yaml", dump_yaml(config_to_dict(cfg)))
    write_json_atomic(out_dir / "ds_config.json", ds_config)
    write_json_atomic(out_dir / "env.json", {**env_info(device, world_size), "data": describe_data(data)})


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

    Returns:
        ``summary.json``'s ``export_check``.
    """
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
    return {
        "batch": list(pixels.shape),
        "dtype": str(param_dtype(reloaded)).removeprefix("torch."),
        "max_abs_logit_diff": (logits - trained_logits).abs().max().item(),
        "identical": bool(torch.equal(logits, trained_logits)),
    }


@dataclass
class CVSummary:
    """``summary.json``: the keys every recipe reports, plus the CV figures (the same keys on both backends)."""

    val_accuracy: float
    val_loss: float
    majority_baseline_accuracy: float  # the accuracy of always answering the most frequent validation class
    throughput: dict[str, Any]  # samples/s/device over the median step
    peak_memory_bytes: int  # the largest over ranks
    memory_kind: str
    model_state_bytes_per_rank: int  # counted on the DeepSpeed engine after the last step
    wall_time_s: float  # rank 0, from the start of main()
    preset: str
    zero_stage: int
    world_size: int
    precision: str
    model: str
    data: dict[str, Any]
    confusion_matrix: list[list[int]]
    model_state_breakdown: dict[str, int]
    num_params: int
    median_step_s: float
    backend: str
    steps: int
    resumed_from_step: int | None
    export_check: dict[str, Any]
    communication: dict[str, Any] | None = None  # with comms_logger.enabled: logged bytes per step beside the plan

    def to_json(self) -> dict[str, Any]:
        return summary_fields(self)

    def headline(self, out_dir: Path) -> str:
        """The line printed when the run ends."""
        return (
            f"val_accuracy {self.val_accuracy:.4f} (majority class {self.majority_baseline_accuracy:.3f}); "
            f"{self.throughput['value']:.0f} samples/s/device; wall {self.wall_time_s:.0f} s; run directory {out_dir}"
        )


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
    metrics: MetricsLog,
    backend: str,
    steps: int,
    start_step: int,
    optimizer: Any = None,
) -> CVSummary | None:
    """After training, on every rank: final evaluation, memory figures, whole weights (collective); then rank 0
    writes ``final/`` and ``confusion_matrix.png`` and returns the summary (None on the other ranks)."""
    out_dir = Path(cfg.out_dir)
    result = evaluate(model, data, cfg, rank, world_size, device)
    metrics.log(steps, val_loss=result.val_loss, val_accuracy=result.val_accuracy, elapsed_s=clock.wall())
    state_bytes = model_state_bytes(engine, optimizer)  # after the last step: ZeRO has released the gradients
    pixels, logits = export_logits(model, data, device)
    weights = gather_full_state_dict(model, rank)  # collective (a gather per parameter under ZeRO-3)
    peak = int(all_reduce(torch.tensor(float(peak_memory_bytes()), device=device), "max").item())
    if rank != 0:
        return None
    export_check = final_export(model, weights, out_dir, pixels, logits, cfg, device)
    plot_confusion_matrix(
        result.confusion,
        data.class_names,
        out_dir / CONFUSION_PNG,
        title=f"{cfg.model} on {Path(cfg.data).name}, step {steps}",
    )
    metrics.close()
    val_counts = result.confusion.sum(axis=1)
    return CVSummary(
        val_accuracy=result.val_accuracy,
        val_loss=result.val_loss,
        majority_baseline_accuracy=float(val_counts.max() / val_counts.sum()),
        throughput=throughput(cfg.micro_batch_size * cfg.grad_accum / clock.median_step(), "samples/s/device"),
        peak_memory_bytes=peak,
        memory_kind=memory_kind(),
        model_state_bytes_per_rank=state_bytes["model_states"],
        wall_time_s=round(clock.wall(), 1),
        preset=cfg.preset,
        zero_stage=zero_stage(ds_config),
        world_size=world_size,
        precision=precision_of(ds_config),
        model=cfg.model,
        data={"source": cfg.data, **describe_data(data)},
        confusion_matrix=result.confusion.tolist(),
        model_state_breakdown=state_bytes,
        num_params=count_parameters(model),
        median_step_s=round(clock.median_step(), 4),
        backend=backend,
        steps=steps,
        resumed_from_step=start_step or None,
        export_check=export_check,
        communication=summary_communication(ds_config, lambda: describe(cfg)),
    )
