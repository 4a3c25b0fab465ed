"""What the science recipe trains and reports: Burgers or Darcy pairs, the FNO, evaluation, run files, summary.json.

``train.py`` (Lightning) and ``train_accelerate.py`` (Accelerate) both import this module, so they train the same
model on the same data with the same DeepSpeed config, and write the same run files. The config is in
``science_config.py``; ``describe(cfg)`` is what ``--describe`` prints for the planning tools.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from science_config import GENERATED_DATA, INITIAL_FIELDS, ScienceConfig  # next to this script

from common.accounting import model_state_bytes
from common.activation import apply_activation_checkpointing
from common.checkpoint import gather_full_state_dict
from common.comms_log import summary_communication
from common.config import config_to_dict, dump_yaml, parse_overrides
from common.data import StepSampler
from common.describe import RecipeDescription, local_world
from common.errors import ConfigError, nearest
from common.lint import lint_at_start
from common.memory_formulas import facts_from_module
from common.metrics import Clock, all_reduce, memory_kind, peak_memory_bytes, throughput
from common.rundir import MetricsLog, env_info, summary_fields, write_json_atomic, write_text_atomic
from common.strategy import (
    RunFacts,
    cosine_with_warmup,
    precision_of,
    resolve_deepspeed_config,
    step_decay_with_warmup,
    zero_stage,
)
from science import burgers, darcy
from science.burgers import DataError, load_npz_dataset
from science.fno import FNO1d, FNO2d, FourierNeuralOperator, SpectralConv, count_parameters, min_grid_size, relative_l2
from science.plots import plot_fields, plot_predictions

# --- data ----------------------------------------------------------------------------------------


@dataclass
class Pairs:
    """Input and output functions as float32 tensors ``[N, grid]`` or ``[N, grid, grid]``, and where they come from.

    Plain tensors, kept fp32 on purpose: DeepSpeed bf16 casts the model, not the data (docs/science.md).
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    meta: dict[str, Any]  # the generator's or the file's description, copied into summary.json

    def to(self, device: torch.device) -> Pairs:
        return Pairs(
            self.x_train.to(device), self.y_train.to(device), self.x_test.to(device), self.y_test.to(device), self.meta
        )

    @property
    def n_dims(self) -> int:
        """Spatial dimensions of the functions."""
        return self.x_train.ndim - 1

    def scaling(self) -> dict[str, float]:
        """The training data's mean and spread, for ``standardize=true`` (every rank computes the same numbers).

        Input: its mean and standard deviation. Output: its root mean square, a scale only: the relative L2
        loss is invariant to it, but the layers then see unit-sized targets, as with the paper's normalizer.
        """
        x, y = self.x_train.double(), self.y_train.double()
        return {
            "input_shift": float(x.mean()),
            "input_scale": float(x.std()) or 1.0,
            "output_scale": float(y.square().mean().sqrt()) or 1.0,
        }


def load_data(cfg: ScienceConfig, grid_size: int | None = None, workers: int = 1) -> Pairs:
    """Train/test pairs: generated Burgers or Darcy data, or the user's ``.npz``.

    Generated data are cached in ``cache_dir``; call this on the main process first so that the other
    ranks read the cache instead of racing to write it.
    """
    if cfg.data == "burgers":
        arrays = burgers.generate_dataset(
            cfg.n_train,
            cfg.n_test,
            grid_size or cfg.grid_size,
            viscosity=cfg.viscosity,
            **INITIAL_FIELDS[cfg.initial_field],
            seed=cfg.data_seed,
            cache_dir=cfg.cache_dir,
            workers=workers,
            solve_grid=cfg.solve_grid,
            progress=workers > 1,
        )
    elif cfg.data == "darcy":
        arrays = darcy.generate_dataset(
            cfg.n_train,
            cfg.n_test,
            cfg.grid_size,
            seed=cfg.data_seed,
            cache_dir=cfg.cache_dir,
            workers=workers,
            solve_grid=cfg.solve_grid,
            progress=workers > 1,
        )
    else:
        path = Path(cfg.data).expanduser()
        if path.suffix != ".npz" and not path.is_file():
            hint = nearest(cfg.data, list(GENERATED_DATA))
            raise ConfigError(f"data must be 'burgers', 'darcy' or a path to an .npz file, got {cfg.data!r}{hint}")
        n_dims = 2 if cfg.model == "fno2d" else 1
        arrays = load_npz_dataset(path, val_fraction=cfg.val_fraction, seed=cfg.data_seed, n_dims=n_dims)
        check_user_grid(path, arrays["x_train"].shape[1:], cfg)
    tensors = {key: torch.from_numpy(arrays[key]).float() for key in ("x_train", "y_train", "x_test", "y_test")}
    return Pairs(**tensors, meta=arrays["meta"])


def check_user_grid(path: Path, grid: tuple[int, ...], cfg: ScienceConfig) -> None:
    """A user's functions need enough points for the model's modes (their dimensions are checked on reading)."""
    padding = cfg.padding if len(grid) == 2 else 0
    need = min_grid_size(cfg.modes, len(grid), padding)
    if min(grid) < need:
        raise DataError(
            f"{path}: grid of {min(grid)} points is too coarse for modes={cfg.modes} "
            f"(needs >= {need}); pass a smaller modes="
        )


def train_loader(n_train: int, cfg: ScienceConfig, rank: int, world_size: int, start_step: int) -> Any:
    """Batches of sample *indices* in a (seed, step)-determined order: exact on resume, same on both backends.

    Indices, not tensors: Lightning's DeepSpeed precision plugin casts every float tensor of a batch to
    bf16, targets included, and a bf16 target alone is ~1e-3 relative error. The model indexes fp32 data.
    """
    sampler = StepSampler(
        n_train, cfg.micro_batch_size, cfg.grad_accum, rank, world_size, cfg.seed, start_step, cfg.max_steps
    )
    return torch.utils.data.DataLoader(range(n_train), batch_size=cfg.micro_batch_size, sampler=sampler)


# --- model and optimisation ----------------------------------------------------------------------


def architecture(cfg: ScienceConfig, scaling: dict[str, float] | None = None) -> dict[str, Any]:
    """The FNO's constructor arguments (``final/config.json`` holds them, with the model's name)."""
    arch: dict[str, Any] = {
        "modes": cfg.modes,
        "width": cfg.width,
        "n_layers": cfg.n_layers,
        "proj_width": cfg.proj_width,
        "fp32_head": cfg.fp32_head,
    }
    if cfg.model == "fno2d":
        arch["padding"] = cfg.padding
    if cfg.standardize and scaling:
        arch.update(scaling)
    return arch


def fno(cfg: ScienceConfig, scaling: dict[str, float] | None = None) -> FourierNeuralOperator:
    """The config's FNO-1D or FNO-2D (weights from the current RNG state); ``scaling`` from :meth:`Pairs.scaling`."""
    model_class = FNO2d if cfg.model == "fno2d" else FNO1d
    return model_class(**architecture(cfg, scaling))


def build_model(cfg: ScienceConfig, scaling: dict[str, float] | None = None) -> FourierNeuralOperator:
    """The FNO the run trains: the same seed gives the same weights on every rank."""
    torch.manual_seed(cfg.seed)
    model = fno(cfg, scaling)
    if cfg.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.activation_checkpointing, block_classes=[SpectralConv])
    return model


def deepspeed_config(cfg: ScienceConfig, world_size: int) -> dict[str, Any]:
    """The factory's DeepSpeed dict for this run (buckets scaled to the FNO width)."""
    facts = RunFacts.from_fields(cfg, world_size, cfg.width)
    return resolve_deepspeed_config(cfg.preset, facts, parse_overrides(cfg.ds_overrides))


def resolve_ds_config(cfg: ScienceConfig, world_size: int) -> dict[str, Any]:
    """The run's DeepSpeed dict, checked for known pitfalls (lint rules) before any work (errors refuse the run)."""
    ds_config = deepspeed_config(cfg, world_size)
    lint_at_start(ds_config, config_to_dict(cfg), hidden_size=cfg.width, world_size=world_size)
    return ds_config


def lr_lambda(cfg: ScienceConfig) -> Any:
    """LambdaLR multiplier: warmup, then cosine to ``min_lr_ratio`` or, with ``lr_decay_every``, the paper's steps."""
    if cfg.lr_decay_every:
        return lambda step: step_decay_with_warmup(step, cfg.warmup_steps, cfg.lr_decay_every, cfg.lr_decay_gamma)
    return lambda step: cosine_with_warmup(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)


# --- evaluation ----------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int, batch_size: int = 50
) -> float:
    """Mean relative L2 error over ``(x, y)``: each rank takes every world_size-th sample, then a sum over ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=x.device)
    mine = torch.arange(rank, len(x), world_size, device=x.device)
    for start in range(0, len(mine), batch_size):
        idx = mine[start : start + batch_size]
        total[0] += relative_l2(model(x[idx]), y[idx], reduction="sum").double()
        total[1] += len(idx)
    model.train(was_training)
    all_reduce(total)
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
def precision_report(model: torch.nn.Module, x: torch.Tensor) -> tuple[str, list[str]]:
    """Parameter dtype as trained, and the dtypes that reached ``torch.fft`` in one forward pass."""
    with _RecordFFT() as record:
        model(x)
    return str(next(model.parameters()).dtype).removeprefix("torch."), sorted(record.dtypes)


# --- what --describe prints ----------------------------------------------------------------------


def describe(cfg: ScienceConfig) -> RecipeDescription:
    """The run as the planning tools see it: the FNO counted on the meta device; no data read, nothing written.

    Activations are not estimated (the planner's formula is a language transformer's): ``zero-recipes probe``
    measures them.
    """
    devices, num_nodes = local_world(cfg.devices, cfg.num_nodes)
    with torch.device("meta"):
        model = fno(cfg)
    facts = facts_from_module(model, architecture=type(model).__name__, hidden_size=cfg.width, recipe="science")
    ds_config = deepspeed_config(cfg, devices * num_nodes)
    return RecipeDescription.of("science", cfg, ds_config, facts, seq_len=None)


# --- run files -----------------------------------------------------------------------------------


def write_run_files(out_dir: Path, cfg: ScienceConfig, ds_config: dict[str, Any], world_size: int) -> None:
    """``config.yaml`` (resolved), ``ds_config.json``, ``env.json``: rank 0, before training."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    write_text_atomic(out_dir / "config.yaml", dump_yaml(config_to_dict(cfg)))
    write_json_atomic(out_dir / "ds_config.json", ds_config)
    write_json_atomic(out_dir / "env.json", env_info(device, world_size))


def export_model(state_dict: dict[str, torch.Tensor], arch: dict[str, Any], model: str, out_dir: Path) -> Path:
    """``final/model.safetensors`` (fp32) + ``final/config.json``: rebuild with ``FNO1d(**config)`` or ``FNO2d``."""
    final, tmp = out_dir / "final", out_dir / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.float().contiguous() for k, v in state_dict.items()}, tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps({"model": model, **arch}, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def write_prediction_figure(path: Path, x: torch.Tensor, y: torch.Tensor, preds: torch.Tensor, title: str) -> None:
    """Three test samples: input, truth and prediction on the samples' own grid (2-D: fields and error map)."""
    if x.ndim == 3:
        plot_fields(x[:3], y[:3], preds, path, title=title)
        return
    grid = x.shape[-1]
    plot_predictions(torch.arange(grid) / grid, x[:3], y[:3], preds, path, title=title)


@dataclass
class ScienceSummary:
    """``summary.json``: the keys every recipe reports, plus the science figures (the same keys on both backends)."""

    val_rel_l2: float  # mean relative L2 error on the test pairs
    throughput: dict[str, Any] | None  # samples/s/device over the median step
    peak_memory_bytes: int  # rank 0
    memory_kind: str
    model_state_bytes_per_rank: int  # counted on the DeepSpeed engine after the last step
    wall_time_s: float  # rank 0, from the start of main()
    preset: str
    zero_stage: int
    round_robin_gradients: bool
    world_size: int
    precision: str
    param_dtype: str  # the trained parameters' dtype
    fft_input_dtypes: list[str]  # what reached torch.fft in one forward pass
    data: str
    model: str  # fno1d or fno2d
    viscosity: float | None  # generated Burgers data only
    grid_size: int
    n_train: int
    n_test: int
    num_params: int
    model_state_breakdown: dict[str, int]
    backend: str
    steps: int
    resumed_from_step: int | None
    val_rel_l2_superres: float | None  # zero-shot at superres_grid_size; both absent from the file when not tested
    superres_grid_size: int | None
    data_meta: dict[str, Any]
    communication: dict[str, Any] | None = None  # with comms_logger.enabled: logged bytes per step beside the plan

    def to_json(self) -> dict[str, Any]:
        data = summary_fields(self)
        if self.val_rel_l2_superres is None:
            del data["val_rel_l2_superres"], data["superres_grid_size"]
        return data

    def headline(self, out_dir: Path) -> str:
        """The line printed when the run ends."""
        superres = ""
        if self.val_rel_l2_superres is not None:
            superres = f", zero-shot at {self.superres_grid_size} points {self.val_rel_l2_superres:.5f}"
        wall = f"wall {self.wall_time_s:.0f} s"
        return f"test relative L2 {self.val_rel_l2:.5f}{superres}; {wall}; {out_dir}/summary.json"


def finish(
    cfg: ScienceConfig,
    ds_config: dict[str, Any],
    engine: Any,
    net: torch.nn.Module,
    data: Pairs,
    superres: Pairs | None,
    rank: int,
    world_size: int,
    clock: Clock,
    metrics: MetricsLog,
    backend: str,
    steps: int,
    start_step: int,
    optimizer: Any = None,
) -> ScienceSummary | None:
    """After training, on every rank: the final error (also at the finer grid), whole weights (collective); then
    rank 0 writes the figures and ``final/`` and returns the summary (None on the other ranks)."""
    out_dir = Path(cfg.out_dir)
    x_test, y_test = data.x_test, data.y_test
    error = evaluate(net, x_test, y_test, rank, world_size)
    metrics.log(steps, val_rel_l2=error)
    fine_x = fine_y = fine_error = None
    if superres is not None:
        fine_x, fine_y = superres.x_test.to(x_test.device), superres.y_test.to(x_test.device)
        fine_error = evaluate(net, fine_x, fine_y, rank, world_size)
        metrics.log(steps, val_rel_l2_superres=fine_error)
    state_bytes = model_state_bytes(engine, optimizer)  # after the last step: ZeRO has released the gradients
    weights = gather_full_state_dict(net, rank)  # collective (a gather per parameter under ZeRO-3)
    # Every forward below runs on every rank, even though only rank 0 writes the results: under ZeRO-3 a
    # forward all-gathers each layer's weights, a collective that hangs or fails if rank 0 runs it alone.
    preds = predict(net, x_test[:3]).cpu()
    fine_preds = predict(net, fine_x[:3]).cpu() if fine_x is not None else None
    param_dtype, fft_input_dtypes = precision_report(net, x_test[:2])
    if rank != 0:
        return None
    export_model(weights, architecture(cfg, data.scaling()), cfg.model, out_dir)
    grid = x_test.shape[-1]
    shape = " x ".join([str(grid)] * data.n_dims)
    title = f"FNO-{data.n_dims}D, grid {shape}: test relative L2 {error:.4f}"
    write_prediction_figure(out_dir / "predictions.png", x_test.cpu(), y_test.cpu(), preds, title)
    if fine_x is not None:
        fine = fine_x.shape[-1]
        title = f"trained at {grid}, tested at {fine} (zero-shot): relative L2 {fine_error:.4f}"
        write_prediction_figure(out_dir / "predictions_superres.png", fine_x.cpu(), fine_y.cpu(), fine_preds, title)
    metrics.close()
    samples_per_s = cfg.micro_batch_size * cfg.grad_accum / clock.median_step() if clock.step_seconds else None
    return ScienceSummary(
        val_rel_l2=error,
        throughput=throughput(samples_per_s, "samples/s/device") if samples_per_s else None,
        peak_memory_bytes=peak_memory_bytes(),
        memory_kind=memory_kind(),
        model_state_bytes_per_rank=state_bytes["model_states"],
        wall_time_s=round(clock.wall(), 2),
        preset=cfg.preset,
        zero_stage=zero_stage(ds_config),
        round_robin_gradients=bool(ds_config.get("zero_optimization", {}).get("round_robin_gradients", False)),
        world_size=world_size,
        precision=precision_of(ds_config),
        param_dtype=param_dtype,
        fft_input_dtypes=fft_input_dtypes,
        data=cfg.data,
        model=cfg.model,
        viscosity=cfg.viscosity if cfg.data == "burgers" else None,
        grid_size=grid,
        n_train=len(data.x_train),
        n_test=len(x_test),
        num_params=count_parameters(net),
        model_state_breakdown=state_bytes,
        backend=backend,
        steps=steps,
        resumed_from_step=start_step or None,
        val_rel_l2_superres=fine_error,
        superres_grid_size=fine_x.shape[-1] if fine_x is not None else None,
        data_meta=data.meta,
        communication=summary_communication(ds_config, lambda: describe(cfg)),
    )
