"""The generated datasets' cache: one ``.npz`` per parameter set, written atomically, checked when read.

Shared by ``burgers`` and ``darcy``: a file is named by its readable parameters plus a hash of all of
them, records the parameters as JSON, and is regenerated (with a warning) when it is unreadable, made
with other parameters, of the wrong shapes, or holds NaN/inf.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

ProgressFn = Callable[[int, int], None]


class DataError(ValueError):
    """Bad user data or dataset parameters; the message says what is wrong and how to fix it."""


def params_digest(params: dict[str, Any]) -> str:
    """12 hex digits of the SHA-256 of the parameters' canonical JSON: part of the cache file's name."""
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]


def read_cached_arrays(
    path: Path, params: dict[str, Any], shapes: dict[str, tuple[int, ...]], logger: logging.Logger
) -> dict[str, Any] | None:
    """The arrays named in ``shapes`` and ``"meta"``, or ``None`` (logged) when the file cannot be used.

    Args:
        path: The cache file.
        params: What the caller wants; the file's recorded ``params`` must equal it.
        shapes: Array name -> expected shape.
        logger: The data module's logger (its name tells the user which dataset regenerates).
    """
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            meta = json.loads(str(npz["meta"]))
            if meta.get("params") != params:
                logger.warning("cache %s was made with other parameters; regenerating", path)
                return None
            arrays = {key: np.array(npz[key]) for key in shapes}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        logger.warning("cache %s is unreadable (%s); regenerating", path, exc)
        return None
    shapes_ok = all(arrays[key].shape == tuple(shape) for key, shape in shapes.items())
    if not shapes_ok or not all(np.all(np.isfinite(a)) for a in arrays.values()):
        logger.warning("cache %s has wrong shapes or non-finite values; regenerating", path)
        return None
    return {**arrays, "meta": meta}


def write_npz_atomic(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write ``.npz`` to a temporary file in the same folder, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def progress_bar(total: int, desc: str) -> tuple[ProgressFn, Callable[[], None]]:
    """A ``callback(done, total)`` drawing a tqdm bar, and the function that closes the bar."""
    bar = tqdm(total=total, desc=desc, unit="sample")

    def update(done: int, _total: int) -> None:
        bar.update(done - bar.n)

    return update, bar.close
