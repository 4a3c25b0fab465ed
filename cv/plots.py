"""Confusion matrix for the CV recipe's report: computed with numpy, drawn with matplotlib's Agg canvas."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def confusion_matrix(
    y_true: Sequence[int] | np.ndarray, y_pred: Sequence[int] | np.ndarray, num_classes: int
) -> np.ndarray:
    """Count predictions per (true class, predicted class).

    Args:
        y_true: True labels in ``0 .. num_classes - 1``.
        y_pred: Predicted labels, same length.
        num_classes: Number of classes (the matrix is square of this size even if some classes never occur).

    Returns:
        int64 array ``[num_classes, num_classes]``; row = true class, column = predicted class.

    Raises:
        ValueError: If the lengths differ or a label is out of range.
    """
    true = np.asarray(y_true, dtype=np.int64).ravel()
    pred = np.asarray(y_pred, dtype=np.int64).ravel()
    if true.shape != pred.shape:
        raise ValueError(f"y_true has {true.size} labels but y_pred has {pred.size}")
    for name, values in (("y_true", true), ("y_pred", pred)):
        if values.size and (values.min() < 0 or values.max() >= num_classes):
            raise ValueError(f"{name} has labels outside 0..{num_classes - 1}")
    # bincount of a flat (row, column) index counts every pair in one pass.
    flat = np.bincount(true * num_classes + pred, minlength=num_classes * num_classes)
    return flat.reshape(num_classes, num_classes)


def plot_confusion_matrix(
    matrix: np.ndarray, class_names: Sequence[str], path: str | Path, title: str = "Confusion matrix"
) -> Path:
    """Draw a confusion matrix as a PNG.

    Cells are coloured by the share of their true class (row-normalised) so that rare classes stay visible;
    the counts are written in the cells when there are at most 30 classes.

    Args:
        matrix: Square count matrix from :func:`confusion_matrix`.
        class_names: Name of each class, by label.
        path: Output PNG file; its folder is created if missing.
        title: Figure title.

    Returns:
        The path written.
    """
    # Figure + Agg canvas instead of pyplot: no global backend switch, no figure registry to leak from.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    matrix = np.asarray(matrix)
    n = matrix.shape[0]
    if matrix.shape != (n, n) or len(class_names) != n:
        raise ValueError(f"matrix of shape {matrix.shape} does not match {len(class_names)} class names")
    row_sums = matrix.sum(axis=1, keepdims=True)
    shares = np.divide(matrix, row_sums, out=np.zeros(matrix.shape, dtype=float), where=row_sums > 0)

    side = min(max(4.0, 0.5 * n + 2.0), 30.0)
    figure = Figure(figsize=(side, side))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0)
    figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04, label="share of true class")
    axes.set_xticks(range(n), labels=list(class_names), rotation=90 if n > 10 else 0)
    axes.set_yticks(range(n), labels=list(class_names))
    axes.set_xlabel("predicted")
    axes.set_ylabel("true")
    total = int(matrix.sum())
    correct = int(np.trace(matrix))
    accuracy = correct / total if total else float("nan")
    axes.set_title(f"{title} (accuracy {accuracy:.3f}, n={total})")
    if n <= 30:
        for i in range(n):
            for j in range(n):
                if matrix[i, j]:
                    color = "white" if shares[i, j] > 0.5 else "black"
                    axes.text(j, i, str(int(matrix[i, j])), ha="center", va="center", color=color, fontsize=8)
    figure.tight_layout()

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=100)
    return out
