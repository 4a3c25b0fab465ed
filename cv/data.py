"""Image classification data for the CV recipe: built-in digits, image folders and saved Hugging Face datasets.

Every loader returns an :class:`ImageData` whose datasets yield ``(pixel_values, label)`` pairs:
``pixel_values`` is float32 ``[3, H, W]`` (normalised), ``label`` an int64 scalar. Three channels
everywhere so that a Swin with its default ``num_channels=3`` (and any RGB checkpoint) accepts all
sources alike.

All data problems raise :class:`DataError` with one line that names the file or folder at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

# ImageNet statistics: what pretrained checkpoints expect, so user images and pretrained models agree.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})

# Folder names that mark a pre-split image folder (``train/`` plus one of these).
VAL_SPLIT_NAMES = ("val", "validation", "valid", "test")

IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "labels")


class DataError(ValueError):
    """Raised for any problem with the input data; the message names the file or folder at fault."""


@dataclass
class ImageData:
    """Train and validation splits plus what a model needs to know about them.

    Attributes:
        train: Dataset of ``(pixel_values float32 [3, H, W], label int64)``.
        val: Same layout as ``train``.
        num_classes: Number of classes (labels are ``0 .. num_classes - 1``).
        class_names: Name of each class, indexed by label.
        image_size: Side length ``H == W`` of every image.
        mean: Per-channel mean subtracted from ``[0, 1]`` pixels (save it with the model for inference).
        std: Per-channel standard deviation the pixels were divided by.
    """

    train: Dataset
    val: Dataset
    num_classes: int
    class_names: list[str]
    image_size: int
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD


# --------------------------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------------------------


def _check_split_args(image_size: int, val_fraction: float) -> None:
    if not isinstance(image_size, int) or image_size < 1:
        raise DataError(f"image_size must be a positive integer, got {image_size!r}")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")


def stratified_split(
    labels: Sequence[int],
    val_fraction: float,
    seed: int,
    class_names: Sequence[str],
    source: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into train and validation so that every class keeps its share in both.

    Args:
        labels: Label of each example.
        val_fraction: Share of examples that go to validation.
        seed: Seed for the shuffle; the same seed gives the same split.
        class_names: Names by label, used in error messages.
        source: The file or folder the labels came from, used in error messages.

    Returns:
        Sorted index arrays ``(train_idx, val_idx)``.

    Raises:
        DataError: If a class is too small to appear in both splits or the validation split cannot hold every class.
    """
    from sklearn.model_selection import train_test_split

    labels_arr = np.asarray(labels, dtype=np.int64)
    counts = np.bincount(labels_arr, minlength=len(class_names))
    if counts.min() < 2:
        small = class_names[int(counts.argmin())]
        raise DataError(
            f"{source}: class {small!r} has {int(counts.min())} example(s); a stratified validation split needs at "
            "least 2 per class (add examples or provide a separate validation split)"
        )
    n_val = int(np.ceil(val_fraction * len(labels_arr)))
    n_train = len(labels_arr) - n_val
    if n_val < len(class_names) or n_train < len(class_names):
        raise DataError(
            f"{source}: {len(labels_arr)} examples with val_fraction={val_fraction} give {n_train} train / {n_val} "
            f"validation examples, fewer than the {len(class_names)} classes; change val_fraction or add examples"
        )
    train_idx, val_idx = train_test_split(
        np.arange(len(labels_arr)),
        test_size=n_val,
        random_state=seed,
        shuffle=True,
        stratify=labels_arr,
    )
    return np.sort(train_idx), np.sort(val_idx)


def normalize(pixels: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Normalise ``[..., 3, H, W]`` pixels in ``[0, 1]`` channel by channel."""
    mean_t = torch.tensor(mean, dtype=pixels.dtype).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=pixels.dtype).view(3, 1, 1)
    return (pixels - mean_t) / std_t


def pil_to_tensor(image: Any, image_size: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Turn a PIL image (or an ``H x W [x C]`` array) into normalised float32 ``[3, image_size, image_size]``.

    The image is converted to RGB and resized to a square without keeping its aspect ratio: simple and
    predictable; crop beforehand if the aspect ratio matters for your data.
    """
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image))
    image = image.convert("RGB")
    if image.size != (image_size, image_size):
        image = image.resize((image_size, image_size), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.float32) / 255.0
    pixels = torch.from_numpy(array.copy()).permute(2, 0, 1)
    return normalize(pixels, mean, std)


# --------------------------------------------------------------------------------------------------------------------
# Built-in default: scikit-learn's handwritten digits
# --------------------------------------------------------------------------------------------------------------------


def load_digits_dataset(image_size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> ImageData:
    """Load scikit-learn's 1,797 handwritten digits (8x8, values 0-16) as 3-channel images.

    Images are upscaled bilinearly to ``image_size`` (Swin's patching needs more than 8 pixels),
    scaled to ``[0, 1]``, repeated to 3 channels and normalised with the training split's own mean and
    standard deviation. The split is stratified and fixed by ``seed``.

    Args:
        image_size: Side length of the output images.
        val_fraction: Share of images held out for validation.
        seed: Seed of the split.

    Returns:
        An :class:`ImageData` with in-memory :class:`~torch.utils.data.TensorDataset` splits and class names
        ``"0"`` .. ``"9"``.
    """
    from sklearn.datasets import load_digits

    _check_split_args(image_size, val_fraction)
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N, 1, 8, 8] in [0, 1]
    if image_size != images.shape[-1]:
        images = torch.nn.functional.interpolate(
            images, size=(image_size, image_size), mode="bilinear", align_corners=False
        )
    labels = torch.tensor(digits.target, dtype=torch.int64)
    class_names = [str(name) for name in digits.target_names]
    train_idx, val_idx = stratified_split(labels.tolist(), val_fraction, seed, class_names, "sklearn digits")

    # Statistics from the training split only, so validation stays unseen.
    train_images = images[torch.from_numpy(train_idx)]
    mean, std = float(train_images.mean()), float(train_images.std())
    images = ((images - mean) / std).expand(-1, 3, -1, -1).contiguous()

    return ImageData(
        train=TensorDataset(images[torch.from_numpy(train_idx)], labels[torch.from_numpy(train_idx)]),
        val=TensorDataset(images[torch.from_numpy(val_idx)], labels[torch.from_numpy(val_idx)]),
        num_classes=len(class_names),
        class_names=class_names,
        image_size=image_size,
        mean=(mean,) * 3,
        std=(std,) * 3,
    )


# --------------------------------------------------------------------------------------------------------------------
# Image folder: one subfolder per class
# --------------------------------------------------------------------------------------------------------------------


class ImageFileDataset(Dataset):
    """Images read from files on demand, so a large folder does not have to fit in memory."""

    def __init__(
        self,
        files: Sequence[Path],
        labels: Sequence[int],
        image_size: int,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        self.files = list(files)
        self.labels = list(labels)
        self.image_size = image_size
        self.mean = tuple(mean)
        self.std = tuple(std)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        path = self.files[index]
        try:
            with Image.open(path) as image:
                pixels = pil_to_tensor(image, self.image_size, self.mean, self.std)
        except (OSError, ValueError) as err:
            raise DataError(f"cannot read image {path}: {err}") from err
        return pixels, torch.tensor(self.labels[index], dtype=torch.int64)


def _verify_image(path: Path) -> None:
    """Fail early, naming the file, if ``path`` is not a readable image (instead of mid-training)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.verify()
    except Exception as err:  # PIL raises many types (UnidentifiedImageError, SyntaxError, struct.error, ...)
        # PIL's messages often repeat the path; keep the line short by dropping the repeat.
        detail = str(err).replace(f"'{path}'", "").replace(str(path), "").strip(" :")
        raise DataError(f"corrupt or unreadable image file {path} ({type(err).__name__}: {detail})") from err


def _list_images(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
    )


def _class_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def scan_class_folders(root: Path, class_names: Sequence[str] | None = None) -> tuple[list[Path], list[int], list[str]]:
    """List the images of a class-per-subfolder folder and check each of them.

    Args:
        root: Folder holding one subfolder per class.
        class_names: Classes to expect (a validation folder must use the training classes); ``None`` takes the
            sorted subfolder names.

    Returns:
        ``(files, labels, class_names)``.

    Raises:
        DataError: If there are no class subfolders, no images, a class without images, an unknown class or an
            unreadable image.
    """
    folders = _class_folders(root)
    if not folders:
        loose = _list_images(root)
        hint = f" ({len(loose)} images lie directly in it; put them in one subfolder per class)" if loose else ""
        raise DataError(f"{root}: no class subfolders found; expected {root}/<class name>/<image files>{hint}")
    found = [p.name for p in folders]
    if class_names is None:
        class_names = found
    else:
        unknown = sorted(set(found) - set(class_names))
        if unknown:
            raise DataError(f"{root}: classes {unknown} do not appear in the training folder")
    index = {name: i for i, name in enumerate(class_names)}

    files: list[Path] = []
    labels: list[int] = []
    for folder in folders:
        images = _list_images(folder)
        if not images:
            raise DataError(
                f"{folder}: class {folder.name!r} has no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})"
            )
        for image in images:
            _verify_image(image)
        files.extend(images)
        labels.extend([index[folder.name]] * len(images))
    return files, labels, list(class_names)


def _split_layout(root: Path) -> tuple[Path, Path] | None:
    """Return ``(train_dir, val_dir)`` if ``root`` holds exactly a ``train/`` and a validation folder."""
    names = {p.name: p for p in _class_folders(root)}
    val_names = [n for n in VAL_SPLIT_NAMES if n in names]
    if "train" in names and len(val_names) == 1 and len(names) == 2:
        return names["train"], names[val_names[0]]
    return None


def load_image_folder(path: str | Path, image_size: int, val_fraction: float = 0.2, seed: int = 0) -> ImageData:
    """Load an image-classification folder: ``path/<class>/<image>``, or ``path/{train,val}/<class>/<image>``.

    Images are read with PIL, converted to RGB, resized to ``image_size`` squares, scaled to ``[0, 1]`` and
    normalised with ImageNet statistics (what pretrained checkpoints expect). Class names are the sorted
    subfolder names. Without ``train/`` + ``val/`` (or ``validation/``, ``valid/``, ``test/``) subfolders the
    images are split stratified by ``val_fraction`` and ``seed``. Every image is checked when loading, so a
    corrupt file fails here rather than mid-training; pixels are decoded lazily.

    Args:
        path: Root folder.
        image_size: Side length of the output images.
        val_fraction: Share of images held out when the folder is not pre-split.
        seed: Seed of that split.

    Returns:
        An :class:`ImageData` with :class:`ImageFileDataset` splits.

    Raises:
        DataError: For a missing path, a file instead of a folder, no class subfolders, an empty class or a corrupt
            image (each message names the folder or file).
    """
    root = Path(path)
    _check_split_args(image_size, val_fraction)
    if not root.exists():
        raise DataError(f"image folder {root} does not exist")
    if not root.is_dir():
        raise DataError(f"{root} is not a folder; expected a folder with one subfolder of images per class")

    split = _split_layout(root)
    if split is not None:
        train_files, train_labels, class_names = scan_class_folders(split[0])
        val_files, val_labels, _ = scan_class_folders(split[1], class_names)
    else:
        files, labels, class_names = scan_class_folders(root)
        train_idx, val_idx = stratified_split(labels, val_fraction, seed, class_names, str(root))
        train_files, train_labels = (
            [files[i] for i in train_idx],
            [labels[i] for i in train_idx],
        )
        val_files, val_labels = (
            [files[i] for i in val_idx],
            [labels[i] for i in val_idx],
        )

    return ImageData(
        train=ImageFileDataset(train_files, train_labels, image_size),
        val=ImageFileDataset(val_files, val_labels, image_size),
        num_classes=len(class_names),
        class_names=class_names,
        image_size=image_size,
    )


# --------------------------------------------------------------------------------------------------------------------
# Saved Hugging Face dataset (datasets.save_to_disk)
# --------------------------------------------------------------------------------------------------------------------


class HFImageDataset(Dataset):
    """Wraps a ``datasets.Dataset`` with an image and an integer label column; decodes images on demand."""

    def __init__(
        self,
        dataset: Any,
        image_column: str,
        label_column: str,
        image_size: int,
        label_map: dict[Any, int] | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        self.dataset = dataset
        self.image_column = image_column
        self.label_column = label_column
        self.image_size = image_size
        self.label_map = label_map
        self.mean = tuple(mean)
        self.std = tuple(std)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.dataset[int(index)]
        label = row[self.label_column]
        if self.label_map is not None:
            label = self.label_map[label]
        pixels = pil_to_tensor(row[self.image_column], self.image_size, self.mean, self.std)
        return pixels, torch.tensor(int(label), dtype=torch.int64)


def _pick_column(columns: Sequence[str], candidates: Sequence[str], what: str, source: str) -> str:
    for name in candidates:
        if name in columns:
            return name
    raise DataError(f"{source}: no {what} column; expected one of {list(candidates)}, found columns {list(columns)}")


def _label_info(split: Any, label_column: str, source: str) -> tuple[list[str], dict[Any, int] | None]:
    """Class names of a split and, for string labels, the map from label to index."""
    from datasets import ClassLabel

    feature = split.features[label_column]
    if isinstance(feature, ClassLabel):
        return list(feature.names), None
    values = split.unique(label_column)
    if all(isinstance(v, str) for v in values):
        names = sorted(values)
        return names, {name: i for i, name in enumerate(names)}
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise DataError(f"{source}: label column {label_column!r} has negative labels")
        return [str(i) for i in range(max(values) + 1)], None
    raise DataError(f"{source}: label column {label_column!r} must hold integers, strings or a ClassLabel")


def load_hf_disk_dataset(path: str | Path, image_size: int, val_fraction: float = 0.2, seed: int = 0) -> ImageData:
    """Load a dataset saved with ``datasets``' ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``).

    The image column may be called ``image`` or ``img``, the label column ``label`` or ``labels`` (a ``ClassLabel``
    gives the class names; plain integers become ``"0"``, ``"1"``, ...; strings are sorted). A ``DatasetDict`` uses
    its ``train`` split and its ``validation`` (or ``val``, ``valid``, ``test``) split; a single ``Dataset``, or a
    ``DatasetDict`` with only ``train``, is split stratified by ``val_fraction`` and ``seed``. Images are normalised
    with ImageNet statistics and decoded lazily.

    Args:
        path: Folder written by ``save_to_disk``.
        image_size: Side length of the output images.
        val_fraction: Share of examples held out when there is no validation split.
        seed: Seed of that split.

    Returns:
        An :class:`ImageData` with :class:`HFImageDataset` splits.

    Raises:
        DataError: For a missing folder, a folder ``load_from_disk`` cannot read, missing columns or splits, or an
            empty split.
    """
    import datasets

    root = Path(path)
    _check_split_args(image_size, val_fraction)
    if not root.is_dir():
        raise DataError(f"dataset folder {root} does not exist")
    try:
        loaded = datasets.load_from_disk(str(root))
    except Exception as err:  # datasets raises FileNotFoundError, ValueError, ArrowInvalid, ... for broken folders
        raise DataError(f"cannot load dataset from {root} with datasets.load_from_disk: {err}") from err

    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{root}: DatasetDict has splits {list(loaded)}, but no 'train' split")
        train = loaded["train"]
        val_name = next((n for n in ("validation", "val", "valid", "test") if n in loaded), None)
        val = loaded[val_name] if val_name else None
    else:
        train, val = loaded, None

    source = str(root)
    image_column = _pick_column(train.column_names, IMAGE_COLUMNS, "image", source)
    label_column = _pick_column(train.column_names, LABEL_COLUMNS, "label", source)
    if len(train) == 0:
        raise DataError(f"{root}: the train split is empty")
    class_names, label_map = _label_info(train, label_column, source)

    if val is None:
        raw_labels = train[label_column]
        labels = [label_map[v] for v in raw_labels] if label_map else list(raw_labels)
        train_idx, val_idx = stratified_split(labels, val_fraction, seed, class_names, source)
        train, val = train.select(train_idx.tolist()), train.select(val_idx.tolist())
    else:
        for column in (image_column, label_column):
            if column not in val.column_names:
                raise DataError(f"{root}: split {val_name!r} has no {column!r} column (found {val.column_names})")
        if len(val) == 0:
            raise DataError(f"{root}: the {val_name!r} split is empty")
        if label_map is not None:
            unknown = sorted(set(val.unique(label_column)) - set(label_map))
            if unknown:
                raise DataError(f"{root}: split {val_name!r} has labels {unknown} that the train split lacks")

    return ImageData(
        train=HFImageDataset(train, image_column, label_column, image_size, label_map),
        val=HFImageDataset(val, image_column, label_column, image_size, label_map),
        num_classes=len(class_names),
        class_names=class_names,
        image_size=image_size,
    )


# --------------------------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------------------------


def is_hf_disk_dataset(path: Path) -> bool:
    """True if ``path`` looks like a ``save_to_disk`` folder (a ``Dataset`` or a ``DatasetDict``)."""
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def load_image_data(data: str | Path, image_size: int, val_fraction: float = 0.2, seed: int = 0) -> ImageData:
    """Load image-classification data from a config's ``data`` value.

    Args:
        data: ``"digits"`` for the built-in default, a ``save_to_disk`` folder (it holds ``dataset_info.json`` or
            ``dataset_dict.json``), or an image folder with one subfolder per class.
        image_size: Side length of the output images.
        val_fraction: Share held out for validation when the data is not pre-split.
        seed: Seed of the split.

    Returns:
        The loaded :class:`ImageData`.

    Raises:
        DataError: If ``data`` is none of the above, or the data itself is faulty.
    """
    if str(data) == "digits":
        return load_digits_dataset(image_size, val_fraction, seed)
    path = Path(data)
    if not path.exists():
        raise DataError(
            f"data {str(data)!r} is neither 'digits' nor an existing folder (an image folder with one subfolder per "
            "class, or a datasets.save_to_disk folder)"
        )
    if not path.is_dir():
        raise DataError(f"data {path} is a file; expected 'digits', an image folder or a datasets.save_to_disk folder")
    if is_hf_disk_dataset(path):
        return load_hf_disk_dataset(path, image_size, val_fraction, seed)
    return load_image_folder(path, image_size, val_fraction, seed)


def describe(data: ImageData) -> dict[str, Any]:
    """A JSON-ready summary of the data for logs and run reports."""
    return {
        "num_classes": data.num_classes,
        "class_names": data.class_names,
        "image_size": data.image_size,
        "train_size": len(data.train),
        "val_size": len(data.val),
        "mean": list(data.mean),
        "std": list(data.std),
    }
