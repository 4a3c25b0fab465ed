"""Figures for the science recipe: predicted vs true ``u(x, T)`` for a few test samples.

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
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
