"""Tests for cv.model (Swin sizes, local folders, image-size check) and cv.plots (confusion matrix)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import SwinConfig, SwinForImageClassification

from cv.model import (
    SWIN_SIZES,
    ModelError,
    build_model,
    check_image_size,
    count_parameters,
    swin_block_class,
    swin_size_unit,
)
from cv.plots import confusion_matrix, plot_confusion_matrix


def test_tiny_param_count_and_forward() -> None:
    model = build_model("tiny", num_classes=10, image_size=32, class_names=[f"c{i}" for i in range(10)])
    assert isinstance(model, SwinForImageClassification)
    assert 200_000 <= count_parameters(model) <= 220_000  # the `tiny` size of docs/cv.md: 210,502
    assert model.config.id2label[3] == "c3" and model.config.label2id["c3"] == 3
    out = model(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([0, 9]))
    assert out.logits.shape == (2, 10)
    assert torch.isfinite(out.loss)


def test_named_sizes_match_the_swin_paper() -> None:
    assert SWIN_SIZES["swin_tiny"]["depths"] == [2, 2, 6, 2]
    assert SWIN_SIZES["swin_base"]["embed_dim"] == 128
    # Each size's own image size fits it.
    for kwargs in SWIN_SIZES.values():
        check_image_size(SwinConfig(**kwargs), kwargs["image_size"])


def test_swin_block_class_is_in_the_model() -> None:
    model = build_model("tiny", 3, 32)
    blocks = [m for m in model.modules() if isinstance(m, swin_block_class())]
    assert len(blocks) == sum(SWIN_SIZES["tiny"]["depths"])


@pytest.mark.parametrize("size", [32, 64, 96])
def test_valid_image_sizes_run(size: int) -> None:
    model = build_model("tiny", 2, size).eval()
    with torch.no_grad():
        assert model(pixel_values=torch.randn(1, 3, size, size)).logits.shape == (1, 2)


@pytest.mark.parametrize(("size", "nearest"), [(24, "32"), (28, "32"), (40, "32, 64")])
def test_invalid_image_size_lists_nearest(size: int, nearest: str) -> None:
    with pytest.raises(ModelError, match=f"multiple of .* = 32.*nearest valid sizes: {nearest}$"):
        build_model("tiny", 10, size)


def test_size_unit_of_swin_t() -> None:
    assert swin_size_unit(SwinConfig(**SWIN_SIZES["swin_tiny"])) == 224  # 4 * 7 * 2**3
    with pytest.raises(ModelError, match="nearest valid sizes: 224"):
        check_image_size(SwinConfig(**SWIN_SIZES["swin_tiny"]), 256)


def test_absolute_position_embeddings_need_their_size() -> None:
    config = SwinConfig(**{**SWIN_SIZES["tiny"], "use_absolute_embeddings": True})
    check_image_size(config, 32)
    with pytest.raises(ModelError, match="absolute position embeddings"):
        check_image_size(config, 64)


def test_non_swin_config_is_not_checked() -> None:
    check_image_size(object(), 17)


def test_unknown_model_name() -> None:
    with pytest.raises(ValueError, match="neither a built-in Swin size"):
        build_model("swin_huge", 10, 32)


def test_local_folder_roundtrip(tmp_path: Path) -> None:
    saved = build_model("tiny", 3, 32, ["a", "b", "c"])
    saved.save_pretrained(tmp_path / "m")
    loaded = build_model(str(tmp_path / "m"), 3, 32, ["x", "y", "z"])
    assert loaded.config.id2label == {0: "x", 1: "y", 2: "z"}
    assert next(loaded.parameters()).dtype == torch.float32
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_local_folder_with_mismatched_classes(tmp_path: Path) -> None:
    build_model("tiny", 3, 32).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"classifies 3 classes but the data has 10.*num_labels=10"):
        build_model(str(tmp_path / "m"), 10, 32)


def test_local_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        build_model(str(tmp_path / "empty"), 10, 32)


def test_confusion_matrix_counts() -> None:
    matrix = confusion_matrix([0, 0, 1, 2, 2, 2], [0, 1, 1, 2, 0, 2], num_classes=4)
    expected = np.array([[1, 1, 0, 0], [0, 1, 0, 0], [1, 0, 2, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(matrix, expected)
    assert matrix.sum() == 6


def test_confusion_matrix_rejects_bad_labels() -> None:
    with pytest.raises(ValueError, match="outside"):
        confusion_matrix([0, 3], [0, 1], num_classes=3)
    with pytest.raises(ValueError, match="2 labels but y_pred has 1"):
        confusion_matrix([0, 1], [0], num_classes=3)


def test_plot_confusion_matrix_writes_png(tmp_path: Path) -> None:
    matrix = confusion_matrix([0, 1, 2, 2], [0, 2, 2, 2], 3)
    path = plot_confusion_matrix(matrix, ["a", "b", "c"], tmp_path / "plots" / "cm.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
