"""Figures for the science recipe: predicted vs true functions for a few test samples (1-D curves, 2-D fields).

Uses matplotlib's object API with the Agg canvas, never ``pyplot``: no global backend switch, no
display needed, safe in every rank of a distributed run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _to_numpy(values: Any) -> np.ndarray:
    """Tensors (any device or dtype) or arrays -> float64 NumPy, without importing torch here."""
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=np.float64)


def _save(fig: Figure, path: str | os.PathLike[str], title: str | None, dpi: int) -> Path:
    """Title the figure, create the parent folders, write the PNG."""
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def plot_predictions(
    x_grid: Any, u0: Any, truth: Any, pred: Any, path: str | os.PathLike[str], n: int = 3, title: str | None = None
) -> Path:
    """Write a PNG with one column per sample: ``u0`` above, true and predicted ``u(x, T)`` below.

    Args:
        x_grid: ``[grid]`` coordinates.
        u0: ``[N, grid]`` inputs.
        truth: ``[N, grid]`` targets.
        pred: ``[N, grid]`` predictions (``[N, grid, 1]`` is accepted for all three).
        path: Output file; parent folders are created.
        n: Number of samples shown (the first ``n``).
        title: Optional figure title, e.g. the run's relative L2.

    Returns:
        The path written.
    """
    x = _to_numpy(x_grid).reshape(-1)
    u0, truth, pred = (_to_numpy(a) for a in (u0, truth, pred))
    u0, truth, pred = (a.reshape(a.shape[0], -1) for a in (u0, truth, pred))
    n = max(1, min(n, len(truth)))
    # Two rows: at nu = 0.1, u(T) is ~50x smaller than u0, so a shared axis would flatten it.
    fig = Figure(figsize=(4.0 * n, 5.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, n, squeeze=False, sharex=True)
    for i in range(n):
        top, bottom = axes[0, i], axes[1, i]
        error = np.linalg.norm(pred[i] - truth[i]) / max(np.linalg.norm(truth[i]), np.finfo(float).tiny)
        top.plot(x, u0[i], color="0.4", lw=1.0)
        top.set_title(f"sample {i}: input u0", fontsize=9)
        bottom.plot(x, truth[i], color="C0", lw=2.0, label="truth u(T)")
        bottom.plot(x, pred[i], color="C3", lw=1.2, ls="--", label="prediction")
        bottom.set_title(f"output, rel. L2 {error:.2e}", fontsize=9)
        bottom.set_xlabel("x")
    axes[1, 0].legend(fontsize=8, loc="best")
    return _save(fig, path, title, dpi=110)


def plot_fields(
    a: Any, truth: Any, pred: Any, path: str | os.PathLike[str], n: int = 3, title: str | None = None
) -> Path:
    """Write a PNG with one row per sample: input ``a``, true ``u``, predicted ``u`` and the error map.

    Args:
        a: ``[N, nx, ny]`` inputs (Darcy's coefficient).
        truth: ``[N, nx, ny]`` targets.
        pred: ``[N, nx, ny]`` predictions.
        path: Output file; parent folders are created.
        n: Number of samples shown (the first ``n``).
        title: Optional figure title, e.g. the run's relative L2.

    Returns:
        The path written.
    """
    a, truth, pred = (_to_numpy(v) for v in (a, truth, pred))
    n = max(1, min(n, len(truth)))
    fig = Figure(figsize=(13.0, 3.2 * n), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 4, squeeze=False)
    extent = (0.0, 1.0, 0.0, 1.0)
    for i in range(n):
        error = pred[i] - truth[i]
        rel = np.linalg.norm(error) / max(np.linalg.norm(truth[i]), np.finfo(float).tiny)
        # Truth and prediction share one colour scale, so a difference in level shows as a difference in colour.
        low, high = float(min(truth[i].min(), pred[i].min())), float(max(truth[i].max(), pred[i].max()))
        limit = float(np.abs(error).max()) or 1.0
        panels = (
            (a[i], "input a", {"cmap": "gray"}),
            (truth[i], "truth u", {"cmap": "viridis", "vmin": low, "vmax": high}),
            (pred[i], "prediction", {"cmap": "viridis", "vmin": low, "vmax": high}),
            (error, f"error (rel. L2 {rel:.2e})", {"cmap": "RdBu_r", "vmin": -limit, "vmax": limit}),
        )
        for ax, (field, label, style) in zip(axes[i], panels, strict=True):
            image = ax.imshow(field.T, origin="lower", extent=extent, **style)
            ax.set_title(f"sample {i}: {label}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            fig.colorbar(image, ax=ax, shrink=0.8)
    return _save(fig, path, title, dpi=90)
