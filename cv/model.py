"""Swin image classifiers for the CV recipe: built from a named size (no download) or loaded from a local folder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageClassification, PreTrainedModel, SwinConfig, SwinForImageClassification

# Named SwinConfig keyword arguments. `image_size` here is the size each one is designed for; build_model replaces
# it with the data's size (after checking that the size fits the architecture).
SWIN_SIZES: dict[str, dict[str, Any]] = {
    # Small enough to train on digits on a laptop CPU in about a minute (docs/cv.md): ~210k parameters.
    "tiny": {
        "image_size": 32,
        "patch_size": 4,
        "embed_dim": 48,
        "depths": [2, 2],
        "num_heads": [2, 4],
        "window_size": 4,
        "mlp_ratio": 2.0,
    },
    # Swin-T of the Swin paper (~28M parameters).
    "swin_tiny": {
        "image_size": 224,
        "patch_size": 4,
        "embed_dim": 96,
        "depths": [2, 2, 6, 2],
        "num_heads": [3, 6, 12, 24],
        "window_size": 7,
    },
    # Swin-B of the Swin paper (~88M parameters).
    "swin_base": {
        "image_size": 224,
        "patch_size": 4,
        "embed_dim": 128,
        "depths": [2, 2, 18, 2],
        "num_heads": [4, 8, 16, 32],
        "window_size": 7,
    },
}


class ModelError(ValueError):
    """Raised when the requested model cannot be built or does not fit the data."""


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ModelError(f"non-square {name} {list(value)} is not supported; use a square {name}")
        value = value[0]
    return int(value)


def swin_size_unit(config: SwinConfig) -> int:
    """The side length every valid image size is a multiple of: ``patch_size * window_size * 2 ** (stages - 1)``."""
    patch = _as_int(config.patch_size, "patch_size")
    return patch * int(config.window_size) * 2 ** (len(config.depths) - 1)


def check_image_size(config: Any, image_size: int) -> None:
    """Check that square images of ``image_size`` pixels fit a Swin configuration exactly.

    Swin cuts the image into ``patch_size`` patches, halves the patch grid between stages (``len(depths)`` stages)
    and attends within ``window_size`` x ``window_size`` windows at every stage. transformers pads rather than
    refuses when a size does not divide, but that is not harmless:

    * a stage whose grid is smaller than the window fails: the window is clamped to the grid while the relative
      position bias keeps ``window_size ** 2`` entries, so the forward raises a shape mismatch (e.g. 24 px with
      patch 4, window 4 and two stages: the second stage's 3x3 grid is smaller than the 4x4 window);
    * a grid that is not a multiple of the window (or an odd grid before a patch merge) is zero-padded, and the
      padded tokens take part in attention unmasked: wasted compute and a border artefact.

    So the valid sizes are exactly the multiples of ``patch_size * window_size * 2 ** (len(depths) - 1)``: then every
    stage's grid is a whole number of windows. A Swin with learned absolute position embeddings
    (``use_absolute_embeddings``) also needs exactly its configured ``image_size``. Configurations that are not
    Swin-like (no ``window_size`` or ``depths``) are accepted as they are.

    Args:
        config: A model configuration (a ``SwinConfig`` or any config with Swin's attributes).
        image_size: Requested side length in pixels.

    Raises:
        ModelError: If the size does not fit; the message lists the nearest valid sizes.
    """
    if not all(hasattr(config, attr) for attr in ("patch_size", "window_size", "depths")):
        return
    configured = _as_int(getattr(config, "image_size", image_size), "image_size")
    if getattr(config, "use_absolute_embeddings", False) and image_size != configured:
        # Learned absolute position embeddings have one entry per patch of the configured size.
        raise ModelError(
            f"this Swin uses absolute position embeddings for {configured} px images; image_size {image_size} "
            f"would not match them: use image_size {configured}"
        )
    unit = swin_size_unit(config)
    if image_size > 0 and image_size % unit == 0:
        return
    lower = (image_size // unit) * unit
    nearest = [size for size in (lower, lower + unit) if size > 0]
    raise ModelError(
        f"image_size {image_size} does not fit this Swin (patch {config.patch_size}, window {config.window_size}, "
        f"{len(config.depths)} stages): it must be a multiple of patch * window * 2**(stages-1) = {unit} so that "
        f"every stage's feature map is a whole number of windows; nearest valid sizes: "
        f"{', '.join(str(s) for s in nearest)}"
    )


def swin_config(size: str, num_classes: int, image_size: int, class_names: Sequence[str] | None = None) -> SwinConfig:
    """A :class:`SwinConfig` for a named size, with the data's image size and labels.

    Raises:
        ModelError: For an unknown size or an image size that does not fit.
    """
    if size not in SWIN_SIZES:
        raise ModelError(f"unknown Swin size {size!r}; choose one of {sorted(SWIN_SIZES)}")
    kwargs = {**SWIN_SIZES[size], "image_size": image_size}
    config = SwinConfig(num_labels=num_classes, **kwargs, **_label_kwargs(num_classes, class_names))
    check_image_size(config, image_size)
    return config


def _label_kwargs(num_classes: int, class_names: Sequence[str] | None) -> dict[str, Any]:
    names = list(class_names) if class_names is not None else [str(i) for i in range(num_classes)]
    if len(names) != num_classes:
        raise ModelError(f"{len(names)} class names given for {num_classes} classes")
    return {"id2label": dict(enumerate(names)), "label2id": {name: i for i, name in enumerate(names)}}


def load_local_model(
    folder: str | Path,
    num_classes: int,
    image_size: int,
    class_names: Sequence[str] | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load an image classifier saved with ``save_pretrained`` from a local folder (no network).

    Weights load in float32 whatever dtype they were saved in, so training keeps fp32 master weights; mixed
    precision is the training strategy's job.

    Raises:
        ModelError: If the folder is missing or unreadable, its classifier has a different number of classes than
            the data, or the image size does not fit it.
    """
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelError(f"model folder {path} has no config.json; expected a folder written by save_pretrained")
    try:
        model = AutoModelForImageClassification.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, local_files_only=True, dtype=torch.float32
        )
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load an image classifier from {path}: {err}") from err
    if model.config.num_labels != num_classes:
        # An error rather than a silent new head: a new random head throws away what the old one learned, so the
        # user should choose it knowingly.
        raise ModelError(
            f"model {path} classifies {model.config.num_labels} classes but the data has {num_classes}; use a model "
            f"with {num_classes} labels, or replace the head once: AutoModelForImageClassification.from_pretrained("
            f"'{path}', num_labels={num_classes}, ignore_mismatched_sizes=True).save_pretrained(<new folder>)"
        )
    check_image_size(model.config, image_size)
    labels = _label_kwargs(num_classes, class_names)
    model.config.id2label, model.config.label2id = labels["id2label"], labels["label2id"]
    return model


def build_model(
    model: str,
    num_classes: int,
    image_size: int,
    class_names: Sequence[str] | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Build an image classifier from a named Swin size, or load one from a local folder.

    Args:
        model: A key of :data:`SWIN_SIZES` (built from its config with random weights, no download) or a local folder
            written by ``save_pretrained``.
        num_classes: Number of classes in the data.
        image_size: Side length of the data's images.
        class_names: Class names by label, stored as ``id2label`` / ``label2id``; default ``"0"``, ``"1"``, ...
        trust_remote_code: Passed to ``from_pretrained`` for folders with custom model code.

    Returns:
        A :class:`~transformers.SwinForImageClassification` for a named size, otherwise whatever
        ``AutoModelForImageClassification`` loads.

    Raises:
        ModelError: (a ``ValueError``) for an unknown name that is not a folder, a class-count mismatch, or an image
            size the model cannot take.
    """
    if num_classes < 2:
        raise ModelError(f"an image classifier needs at least 2 classes, got {num_classes}")
    if model in SWIN_SIZES:
        return SwinForImageClassification(swin_config(model, num_classes, image_size, class_names))
    if Path(model).is_dir():
        return load_local_model(model, num_classes, image_size, class_names, trust_remote_code)
    raise ModelError(
        f"model {model!r} is neither a built-in Swin size ({', '.join(sorted(SWIN_SIZES))}) nor an existing local "
        "folder (hub downloads are not used: save the model with save_pretrained and pass its folder)"
    )


def swin_block_class() -> type[torch.nn.Module]:
    """The Swin transformer block (window attention + MLP), the unit that activation checkpointing wraps."""
    from transformers.models.swin.modeling_swin import SwinLayer

    return SwinLayer


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters of ``model`` (only those with ``requires_grad`` if ``trainable_only``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
