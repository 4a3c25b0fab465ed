"""Tests for cv.data: built-in digits, image folders, saved Hugging Face datasets and their error messages."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cv.data import (
    DataError,
    ImageData,
    load_digits_dataset,
    load_hf_disk_dataset,
    load_image_data,
    load_image_folder,
)

CLASSES = ["cat", "dog", "fox"]


def _write_png(path: Path, color: tuple[int, int, int], size: tuple[int, int] = (10, 6)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def _image_folder(root: Path, per_class: int = 4) -> Path:
    """Three classes of tiny solid-colour PNGs (different sizes, so resizing is exercised)."""
    for c, name in enumerate(CLASSES):
        for i in range(per_class):
            color = (60 * c + 10 * i, 40, 200 - 50 * c)
            _write_png(root / name / f"img_{i}.png", color, size=(8 + i, 5 + c))
    return root


def _labels(dataset: torch.utils.data.Dataset) -> list[int]:
    return [int(dataset[i][1]) for i in range(len(dataset))]


def _check_item(data: ImageData) -> None:
    pixels, label = data.train[0]
    assert pixels.dtype == torch.float32
    assert pixels.shape == (3, data.image_size, data.image_size)
    assert label.dtype == torch.int64
    assert 0 <= int(label) < data.num_classes


# --------------------------------------------------------------------------------------------------------------------
# digits
# --------------------------------------------------------------------------------------------------------------------


def test_digits_shapes_and_classes() -> None:
    data = load_digits_dataset(image_size=32, val_fraction=0.2, seed=0)
    assert data.num_classes == 10
    assert data.class_names == [str(i) for i in range(10)]
    assert len(data.train) + len(data.val) == 1797
    assert len(data.val) == 360  # ceil(0.2 * 1797)
    _check_item(data)
    # Normalised with the training split's statistics.
    train_pixels = data.train.tensors[0]
    assert abs(float(train_pixels.mean())) < 1e-3
    assert abs(float(train_pixels.std()) - 1.0) < 1e-2


def test_digits_split_is_stratified() -> None:
    data = load_digits_dataset(image_size=16, val_fraction=0.2, seed=0)
    train_counts = Counter(data.train.tensors[1].tolist())
    val_counts = Counter(data.val.tensors[1].tolist())
    for label in range(10):
        total = train_counts[label] + val_counts[label]
        # Each class keeps its 20 % share in validation, up to rounding.
        assert abs(val_counts[label] - 0.2 * total) <= 1.0


def test_digits_split_is_deterministic_and_seeded() -> None:
    a = load_digits_dataset(image_size=16, seed=0)
    b = load_digits_dataset(image_size=16, seed=0)
    c = load_digits_dataset(image_size=16, seed=1)
    assert torch.equal(a.val.tensors[0], b.val.tensors[0])
    assert torch.equal(a.val.tensors[1], b.val.tensors[1])
    assert not torch.equal(a.val.tensors[0], c.val.tensors[0])


@pytest.mark.parametrize("kwargs", [{"image_size": 0}, {"val_fraction": 0.0}, {"val_fraction": 1.0}])
def test_digits_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(DataError):
        load_digits_dataset(**kwargs)


# --------------------------------------------------------------------------------------------------------------------
# image folder
# --------------------------------------------------------------------------------------------------------------------


def test_image_folder_loads_classes_and_splits(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "pets")
    (root / "notes.txt").write_text("not an image, ignored")
    data = load_image_folder(root, image_size=16, val_fraction=0.25, seed=0)
    assert data.class_names == CLASSES
    assert data.num_classes == 3
    assert len(data.train) == 9 and len(data.val) == 3
    assert sorted(_labels(data.val)) == [0, 1, 2]  # stratified: one of each class
    _check_item(data)


def test_image_folder_pixels_are_normalised_rgb(tmp_path: Path) -> None:
    root = tmp_path / "grey"
    for name in ("a", "b"):
        for i in range(2):
            path = root / name / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("L", (5, 5), 255).save(path)  # greyscale input must come out with 3 channels
    data = load_image_folder(root, image_size=8, val_fraction=0.5, seed=0)
    pixels, _ = data.train[0]
    expected = (1.0 - torch.tensor(data.mean)) / torch.tensor(data.std)
    assert torch.allclose(pixels[:, 0, 0], expected, atol=1e-5)


def test_image_folder_train_val_layout(tmp_path: Path) -> None:
    _image_folder(tmp_path / "split" / "train", per_class=2)
    _image_folder(tmp_path / "split" / "val", per_class=1)
    data = load_image_folder(tmp_path / "split", image_size=8, val_fraction=0.2, seed=0)
    assert data.class_names == CLASSES
    assert len(data.train) == 6 and len(data.val) == 3


def test_dispatch_digits_and_image_folder(tmp_path: Path) -> None:
    assert load_image_data("digits", 16).num_classes == 10
    root = _image_folder(tmp_path / "pets")
    assert load_image_data(str(root), 8, 0.25, 0).class_names == CLASSES


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="nowhere"):
        load_image_folder(missing, 16)
    with pytest.raises(DataError, match="neither 'digits' nor an existing folder"):
        load_image_data(str(missing), 16)


def test_dispatch_rejects_a_file(tmp_path: Path) -> None:
    file = tmp_path / "data.csv"
    file.write_text("a,b\n")
    with pytest.raises(DataError, match="data.csv"):
        load_image_data(str(file), 16)


def test_empty_folder_has_no_class_subfolders(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no class subfolders"):
        load_image_folder(empty, 16)


def test_loose_images_get_a_hint(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    _write_png(root / "a.png", (1, 2, 3))
    with pytest.raises(DataError, match="one subfolder per class"):
        load_image_folder(root, 16)


def test_class_without_images_is_named(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "pets")
    (root / "zebra").mkdir()
    with pytest.raises(DataError, match="zebra"):
        load_image_folder(root, 16, 0.25)


def test_corrupt_image_names_the_file(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "pets")
    (root / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    with pytest.raises(DataError, match=r"broken\.png"):
        load_image_folder(root, 16, 0.25)


def test_class_too_small_for_a_split(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "pets", per_class=2)
    _write_png(root / "owl" / "only.png", (5, 5, 5))
    with pytest.raises(DataError, match="'owl' has 1 example"):
        load_image_folder(root, 16, 0.5)


# --------------------------------------------------------------------------------------------------------------------
# datasets.load_from_disk
# --------------------------------------------------------------------------------------------------------------------


def _hf_dataset(n_per_class: int = 4, image_column: str = "image", label_column: str = "label"):
    import datasets

    images, labels = [], []
    for c in range(3):
        for i in range(n_per_class):
            images.append(Image.new("RGB", (6, 6), (80 * c, 10 * i, 0)))
            labels.append(c)
    features = datasets.Features({image_column: datasets.Image(), label_column: datasets.ClassLabel(names=CLASSES)})
    return datasets.Dataset.from_dict({image_column: images, label_column: labels}, features=features)


def test_load_from_disk_single_dataset(tmp_path: Path) -> None:
    path = tmp_path / "hf"
    _hf_dataset().save_to_disk(str(path))
    data = load_image_data(str(path), 8, val_fraction=0.25, seed=0)  # dispatch sees dataset_info.json
    assert data.class_names == CLASSES
    assert len(data.train) == 9 and len(data.val) == 3
    assert sorted(_labels(data.val)) == [0, 1, 2]
    _check_item(data)


def test_load_from_disk_dataset_dict_with_alternative_names(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "hf_dict"
    dataset = _hf_dataset(image_column="img", label_column="labels")
    datasets.DatasetDict({"train": dataset, "test": _hf_dataset(1, "img", "labels")}).save_to_disk(str(path))
    data = load_image_data(str(path), 8)  # dispatch sees dataset_dict.json
    assert data.class_names == CLASSES
    assert len(data.train) == 12 and len(data.val) == 3
    _check_item(data)


def test_load_from_disk_integer_labels(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "hf_int"
    images = [np.full((4, 4, 3), 30 * i, dtype=np.uint8) for i in range(6)]
    datasets.Dataset.from_dict(
        {"image": images, "label": [0, 1, 0, 1, 0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    ).save_to_disk(str(path))
    data = load_hf_disk_dataset(path, 8, val_fraction=0.34, seed=0)
    assert data.class_names == ["0", "1"]
    _check_item(data)


def test_load_from_disk_missing_columns(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "hf_bad"
    datasets.Dataset.from_dict({"picture": [1, 2], "label": [0, 1]}).save_to_disk(str(path))
    with pytest.raises(DataError, match=r"no image column; expected one of \['image', 'img'\]"):
        load_image_data(str(path), 8)


def test_load_from_disk_missing_label_column(tmp_path: Path) -> None:
    path = tmp_path / "hf_nolabel"
    _hf_dataset().remove_columns("label").save_to_disk(str(path))
    with pytest.raises(DataError, match="no label column"):
        load_hf_disk_dataset(path, 8)


def test_load_from_disk_unreadable_folder(tmp_path: Path) -> None:
    path = tmp_path / "fake"
    path.mkdir()
    (path / "dataset_info.json").write_text("{}")
    with pytest.raises(DataError, match="fake"):
        load_image_data(str(path), 8)
