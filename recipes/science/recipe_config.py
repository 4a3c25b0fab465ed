"""Config and shared setup of the science recipe: FNO-1D on Burgers, BF16 + ZeRO-2 with round-robin gradients.

``train.py`` (Lightning) and ``train_accelerate.py`` (Accelerate) both import this module, so they
train the same model on the same data with the same DeepSpeed config, and write the same run files.
Keys of :class:`ScienceConfig` are the keys of ``configs/*.yaml``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.activation import check_preset
from common.config import config_to_dict, dump_yaml, parse_recipe_args
from common.errors import ConfigError, nearest
from common.presets import PRESET_NAMES
from common.rundir import set_cpu_threads
from common.strategy import RunFacts, cosine_with_warmup, resolve_deepspeed_config
from science.burgers import DataError, generate_dataset, load_npz_dataset
from science.fno import FNO1d, min_grid_size, relative_l2

RECIPE_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = RECIPE_DIR / "configs" / "tiny_cpu.yaml"
MODELS = ("fno1d",)
# Guide 2, 7.3: precision matters in science; fp16's 5-bit exponent and 10-bit mantissa are refused.
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
    precision: str = "bf16"  # bf16 or fp32; fp16 is refused (guide 2, 7.3)
    ds_overrides: list[str] = field(default_factory=list)  # DeepSpeed key=value, e.g. zero_optimization.stage=1
    activation_checkpointing: str = "none"  # none|full|every_k|save_memory_optimized: compute traded for memory
    gradient_clipping: float = 0.0  # max gradient norm, 0 = off
    # --- optimisation ---
    micro_batch_size: int = 10  # samples per rank per forward pass: more memory, fewer steps per epoch
    grad_accum: int = 1  # micro-batches per optimizer step: a larger batch at no extra memory
    lr: float = 1e-3
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio (1.0 = constant lr after warmup)
    weight_decay: float = 1e-4
    warmup_steps: int = 0
    # --- model (FNO-1D, Li et al. 2021) ---
    model: str = "fno1d"
    modes: int = 16  # Fourier modes kept per layer
    width: int = 64  # channels: parameters grow with width^2 x modes
    n_layers: int = 4
    proj_width: int = 128
    fp32_head: bool = True  # under bf16 the projection head computes in fp32 (docs/science.md: why)
    # --- data ---
    data: str = "burgers"  # 'burgers' (generated here) or a path to an .npz with arrays x and y [N, grid]
    n_train: int = 1000
    n_test: int = 200
    grid_size: int = 256  # training resolution; must divide solve_grid
    viscosity: float = 0.1  # the paper's text; its public generator uses 0.001 (harder)
    solve_grid: int = 1024
    data_seed: int = 0
    cache_dir: str = "~/.cache/zero-recipes/burgers"
    data_workers: int = 2  # solver processes when the data are not cached yet
    val_fraction: float = 0.2  # held-out share of a user's .npz
    superres_factor: int = 4  # also test at grid_size x this (zero-shot super-resolution); 1 = off
    # --- logging ---
    eval_interval: int = 250
    checkpoint_interval: int = 500
    log_interval: int = 10
    trust_remote_code: bool = False  # no hub models here; kept for the common key set

    def __post_init__(self) -> None:
        for name in POSITIVE_KEYS:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("devices", "n_test", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.precision == "fp16":
            # The science preset refuses it in the factory; the recipe refuses it whatever the preset.
            resolve_deepspeed_config("science", RunFacts(precision="fp16"))
        if self.precision not in PRECISIONS:
            hint = nearest(self.precision, PRECISIONS)
            raise ConfigError(f"precision must be bf16 or fp32, got {self.precision!r}{hint}")
        if self.preset not in PRESET_NAMES:
            raise ConfigError(f"unknown preset {self.preset!r}{nearest(self.preset, PRESET_NAMES)}")
        check_preset(self.activation_checkpointing)
        if self.activation_checkpointing == "selective":
            raise ConfigError("activation_checkpointing=selective needs attention layers; the FNO has none (use full)")
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}{nearest(self.model, MODELS)}; valid: {', '.join(MODELS)}")
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.weight_decay < 0:
            raise ConfigError("need lr > 0, 0 <= min_lr_ratio <= 1 and weight_decay >= 0")
        if self.viscosity <= 0:
            raise ConfigError(f"viscosity must be > 0, got {self.viscosity}")
        if self.data == "burgers":
            if self.grid_size < min_grid_size(self.modes):
                raise ConfigError(
                    f"grid_size {self.grid_size} is too coarse for modes={self.modes} "
                    f"(needs >= {min_grid_size(self.modes)} points)"
                )
            finest = self.grid_size * self.superres_factor
            if self.solve_grid % self.grid_size or self.solve_grid % finest:
                raise ConfigError(f"grid_size x superres_factor ({finest}) must divide solve_grid ({self.solve_grid})")
            if self.n_test < 1:
                raise ConfigError("n_test must be >= 1 to measure the error")
        if self.resume and self.overwrite:
            raise ConfigError("resume=true and overwrite=true contradict each other; pick one")
        if self.trust_remote_code:
            raise ConfigError("trust_remote_code has no use in the science recipe (it loads no hub code)")


def parse_args(argv: list[str] | None = None) -> ScienceConfig:
    """``--config FILE`` (default ``DEFAULT_CONFIG``), ``key=value`` overrides, ``--print-config``."""
    return parse_recipe_args(ScienceConfig, DEFAULT_CONFIG, argv)


def resolve_ds_config(cfg: ScienceConfig, world_size: int) -> dict[str, Any]:
    """The factory's DeepSpeed dict for this run (buckets scaled to the FNO width)."""
    facts = RunFacts(
        world_size=world_size,
        micro_batch_size=cfg.micro_batch_size,
        grad_accum=cfg.grad_accum,
        precision=cfg.precision,
        hidden_size=cfg.width,
        gradient_clipping=cfg.gradient_clipping,
    )
    from common.config import parse_overrides

    ds_config = resolve_deepspeed_config(cfg.preset, facts, parse_overrides(cfg.ds_overrides))
    # The guides' pitfalls, checked before any work (printed on rank 0; errors refuse the run).
    from common.config import config_to_dict
    from common.lint import lint_at_start

    lint_at_start(ds_config, config_to_dict(cfg), hidden_size=cfg.width, world_size=world_size)
    return ds_config


def set_threads(local_processes: int) -> None:
    """One intra-op thread per core per process on a CPU (:func:`common.rundir.set_cpu_threads`)."""
    set_cpu_threads(local_processes)


# --- data ----------------------------------------------------------------------------------------


def load_data(cfg: ScienceConfig, grid_size: int | None = None, workers: int = 1) -> dict[str, Any]:
    """Train/test pairs as float32 tensors ``[N, grid]``: generated Burgers data or the user's ``.npz``.

    Generated data are cached in ``cache_dir``; call this on the main process first so that the other
    ranks read the cache instead of racing to write it.
    """
    if cfg.data == "burgers":
        arrays = generate_dataset(
            cfg.n_train,
            cfg.n_test,
            grid_size or cfg.grid_size,
            viscosity=cfg.viscosity,
            seed=cfg.data_seed,
            cache_dir=cfg.cache_dir,
            workers=workers,
            solve_grid=cfg.solve_grid,
            progress=workers > 1,
        )
    else:
        path = Path(cfg.data).expanduser()
        if path.suffix != ".npz" and not path.is_file():
            raise ConfigError(
                f"data must be 'burgers' or a path to an .npz file, got {cfg.data!r}{nearest(cfg.data, ['burgers'])}"
            )
        arrays = load_npz_dataset(path, val_fraction=cfg.val_fraction, seed=cfg.data_seed)
        grid = arrays["meta"]["grid_size"]
        if grid < min_grid_size(cfg.modes):
            raise DataError(
                f"{path}: grid of {grid} points is too coarse for modes={cfg.modes} "
                f"(needs >= {min_grid_size(cfg.modes)}); pass a smaller modes="
            )
    data = {key: torch.from_numpy(arrays[key]).float() for key in ("x_train", "y_train", "x_test", "y_test")}
    data["meta"] = arrays["meta"]
    return data


def train_loader(n_train: int, cfg: ScienceConfig, rank: int, world_size: int, start_step: int) -> Any:
    """Batches of sample *indices* in a (seed, step)-determined order: exact on resume, same on both backends.

    Indices, not tensors: Lightning's DeepSpeed precision plugin casts every float tensor of a batch to
    bf16, targets included, and a bf16 target alone is ~1e-3 relative error. The model indexes fp32 data.
    """
    from common.data import StepSampler

    sampler = StepSampler(
        n_train, cfg.micro_batch_size, cfg.grad_accum, rank, world_size, cfg.seed, start_step, cfg.max_steps
    )
    return torch.utils.data.DataLoader(range(n_train), batch_size=cfg.micro_batch_size, sampler=sampler)


# --- model and optimisation ----------------------------------------------------------------------


def build_model(cfg: ScienceConfig) -> FNO1d:
    """FNO-1D with the config's sizes; the same seed gives the same weights on every rank."""
    torch.manual_seed(cfg.seed)
    model = FNO1d(
        modes=cfg.modes, width=cfg.width, n_layers=cfg.n_layers, proj_width=cfg.proj_width, fp32_head=cfg.fp32_head
    )
    if cfg.activation_checkpointing != "none":
        from common.activation import apply_activation_checkpointing
        from science.fno import SpectralConv1d

        apply_activation_checkpointing(model, cfg.activation_checkpointing, block_classes=[SpectralConv1d])
    return model


def lr_lambda(cfg: ScienceConfig) -> Any:
    """LambdaLR multiplier: warmup, then cosine to ``min_lr_ratio``."""
    return lambda step: cosine_with_warmup(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    rank: int,
    world_size: int,
    reduce_sum: Any,
    batch_size: int = 50,
) -> float:
    """Mean relative L2 error over ``(x, y)``: each rank takes every world_size-th sample, then a sum-reduce."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=x.device)
    mine = torch.arange(rank, len(x), world_size, device=x.device)
    for start in range(0, len(mine), batch_size):
        idx = mine[start : start + batch_size]
        total[0] += relative_l2(model(x[idx]), y[idx], reduction="sum").double()
        total[1] += len(idx)
    model.train(was_training)
    total = reduce_sum(total)
    return float(total[0] / total[1])


@torch.no_grad()
def predict(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Predictions in float32 (for the figure)."""
    was_training = model.training
    model.eval()
    out = model(x).float()
    model.train(was_training)
    return out


class _RecordFFT(torch.overrides.TorchFunctionMode):
    """Records the dtypes handed to ``torch.fft`` (the recipe's check that the spectral path stays fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__module__", "") == "torch._C._fft" or func in (torch.fft.rfft, torch.fft.irfft):
            self.dtypes.add(str(args[0].dtype).removeprefix("torch."))
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def precision_report(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Parameter dtype as trained, and the dtypes that reached ``torch.fft`` in one forward pass."""
    with _RecordFFT() as record:
        model(x)
    return {
        "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "fft_input_dtypes": sorted(record.dtypes),
    }


# --- run files -----------------------------------------------------------------------------------


def export_model(state_dict: dict[str, torch.Tensor], cfg: ScienceConfig, out_dir: Path) -> Path:
    """``final/model.safetensors`` (fp32) + ``final/config.json``: rebuild with ``FNO1d(**config)``."""
    import json
    import shutil

    from safetensors.torch import save_file

    final, tmp = out_dir / "final", out_dir / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.float().contiguous() for k, v in state_dict.items()}, tmp / "model.safetensors")
    arch = {
        "modes": cfg.modes,
        "width": cfg.width,
        "n_layers": cfg.n_layers,
        "proj_width": cfg.proj_width,
        "fp32_head": cfg.fp32_head,
    }
    (tmp / "config.json").write_text(json.dumps({"model": "fno1d", **arch}, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def write_run_files(out_dir: Path, cfg: ScienceConfig, ds_config: dict[str, Any], world_size: int) -> None:
    """``config.yaml`` (resolved), ``ds_config.json``, ``env.json``: rank 0, before training."""
    from common.rundir import env_info, write_json_atomic, write_text_atomic

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    write_text_atomic(out_dir / "config.yaml", dump_yaml(config_to_dict(cfg)))
    write_json_atomic(out_dir / "ds_config.json", ds_config)
    write_json_atomic(out_dir / "env.json", env_info(device, world_size))


def write_figures(
    out_dir: Path,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    preds: torch.Tensor,
    error: float,
    superres: dict[str, Any] | None,
) -> None:
    """``predictions.png`` (three test samples) and, with super-resolution, ``predictions_superres.png``."""
    from science.plots import plot_predictions

    grid = x_test.shape[-1]
    plot_predictions(
        torch.arange(grid) / grid,
        x_test[:3],
        y_test[:3],
        preds,
        out_dir / "predictions.png",
        title=f"FNO-1D, grid {grid}: test relative L2 {error:.4f}",
    )
    if superres:
        fine = superres["x_test"].shape[-1]
        plot_predictions(
            torch.arange(fine) / fine,
            superres["x_test"][:3],
            superres["y_test"][:3],
            superres["preds"],
            out_dir / "predictions_superres.png",
            title=f"trained at {grid}, tested at {fine} (zero-shot): relative L2 {superres['error']:.4f}",
        )


def finish(
    cfg: ScienceConfig,
    ds_config: dict[str, Any],
    engine: Any,
    net: torch.nn.Module,
    data: dict[str, Any],
    superres: dict[str, Any] | None,
    rank: int,
    world_size: int,
    reduce_sum: Any,
    clock: Clock,
    metrics: Any,
    out_dir: Path,
    **facts: Any,
) -> dict[str, Any] | None:
    """After training, on every rank: the final error (also at 4x resolution); then on rank 0 the figures,
    ``final/`` weights and ``summary.json``. Returns the summary on rank 0, None elsewhere."""
    from common.accounting import model_state_bytes
    from common.checkpoint import gather_full_state_dict
    from common.metrics import median, memory_kind, peak_memory_bytes, throughput
    from common.rundir import write_json_atomic
    from common.strategy import precision_of, zero_stage
    from science.fno import count_parameters

    x_test, y_test = data["x_test"], data["y_test"]
    error = evaluate(net, x_test, y_test, rank, world_size, reduce_sum)
    metrics.log(facts["steps"], val_rel_l2=error)
    fine = None
    if superres is not None:
        fine = {k: superres[k].to(x_test.device) for k in ("x_test", "y_test")}
        fine["error"] = evaluate(net, fine["x_test"], fine["y_test"], rank, world_size, reduce_sum)
        metrics.log(facts["steps"], val_rel_l2_superres=fine["error"])
        facts.update(val_rel_l2_superres=fine["error"], superres_grid_size=fine["x_test"].shape[-1])
    state_bytes = model_state_bytes(engine)  # after the last step: ZeRO has released the gradients
    weights = gather_full_state_dict(net, rank)  # collective (a gather per parameter under ZeRO-3)
    # Every forward below runs on every rank, even though only rank 0 writes the results: under ZeRO-3 a
    # forward all-gathers each layer's weights, a collective that hangs or fails if rank 0 runs it alone.
    preds = predict(net, x_test[:3]).cpu()
    fine_preds = predict(net, fine["x_test"][:3]).cpu() if fine is not None else None
    precision = precision_report(net, x_test[:2])
    if rank != 0:
        return None
    export_model(weights, cfg, out_dir)
    if fine is not None:
        fine = {"x_test": fine["x_test"].cpu(), "y_test": fine["y_test"].cpu(), "error": fine["error"]}
        fine["preds"] = fine_preds
    write_figures(out_dir, x_test.cpu(), y_test.cpu(), preds, error, fine)
    seconds = clock.step_seconds[5:] if len(clock.step_seconds) > 10 else clock.step_seconds  # skip start-up
    per_device = cfg.micro_batch_size * cfg.grad_accum / median(seconds) if seconds else None
    report = {
        "val_rel_l2": error,
        "throughput": throughput(per_device, "samples/s/device") if per_device else None,
        "peak_memory_bytes": peak_memory_bytes(),
        "memory_kind": memory_kind(),
        "model_state_bytes_per_rank": state_bytes["model_states"],
        "wall_time_s": round(clock.wall(), 2),
        "preset": cfg.preset,
        "zero_stage": zero_stage(ds_config),
        "round_robin_gradients": bool(ds_config["zero_optimization"].get("round_robin_gradients", False)),
        "world_size": world_size,
        "precision": precision_of(ds_config),
        **precision,
        "data": cfg.data,
        "viscosity": cfg.viscosity if cfg.data == "burgers" else None,
        "grid_size": x_test.shape[-1],
        "n_train": len(data["x_train"]),
        "n_test": len(x_test),
        "num_params": count_parameters(net),
        "model_state_breakdown": state_bytes,
        **facts,
        "data_meta": data["meta"],
    }
    write_json_atomic(out_dir / "summary.json", report)
    metrics.close()
    superres_text = f", zero-shot at {fine['x_test'].shape[-1]} points {fine['error']:.5f}" if fine else ""
    print(f"test relative L2 {error:.5f}{superres_text}; wall {report['wall_time_s']:.0f} s; {out_dir}/summary.json")
    return report


class Clock:
    """Wall time since start, and per-step durations that leave out evaluation and checkpoint time."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
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
