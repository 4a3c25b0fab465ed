"""Checks on a user's Hugging Face model folder, made before anything loads it.

A truncated download or an interrupted copy leaves a ``*.safetensors`` file whose header promises more bytes than
the file holds. ``from_pretrained`` then fails deep inside rank 0 with a ``SafetensorError`` traceback; reading each
file's header first (``safe_open`` maps the file and checks that the header's offsets cover it exactly, without
reading the tensors) turns that into one line naming the file.

A fine-tuning checkpoint leaves the frozen base out (it is ``model=`` again on resume) and keeps a reference to it
instead: the folder and the SHA-256 of each file that defines the weights (:func:`base_reference`). Adapters trained
on one base and resumed on another would train on without an error and mean nothing; :func:`check_base_unchanged`
refuses that resume, naming the files that differ.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from common.errors import ConfigError
from common.rundir import write_json_atomic

INDEX_SUFFIX = ".safetensors.index.json"
BASE_REFERENCE = "base_model.json"  # in a fine-tuning checkpoint: the frozen base its adapters were trained on
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def check_weight_files(folder: str | Path) -> None:
    """Open every ``*.safetensors`` in ``folder`` header-first; check that an index names only present shards.

    Raises:
        ConfigError: a file is corrupt or truncated, or the index names a shard that is missing.
    """
    folder = Path(folder).expanduser()
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ConfigError(
                f"{path} is corrupt or truncated ({exc}); copy or download the model folder again"
            ) from None
    for index in sorted(folder.glob(f"*{INDEX_SUFFIX}")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{index} is corrupt: no readable weight_map ({exc.__class__.__name__})") from None
        missing = sorted(name for name in shards if not (folder / name).is_file())
        if missing:
            raise ConfigError(
                f"{index} names {missing[0]}, which is missing from {folder} ({len(missing)} shard(s) missing); "
                "copy or download the model folder again"
            )


def base_reference(folder: str | Path) -> dict[str, Any]:
    """The folder and the SHA-256 of ``config.json`` and every weight file in it (shards and index included).

    Reads every weight file once (about as long as loading them; the page cache usually holds them already).
    """
    folder = Path(folder).expanduser().resolve()
    names = sorted(
        path.name
        for path in folder.iterdir()
        if path.is_file() and (path.name == "config.json" or path.name.endswith((*WEIGHT_SUFFIXES, INDEX_SUFFIX)))
    )
    digests = {}
    for name in names:
        with open(folder / name, "rb") as handle:
            digests[name] = hashlib.file_digest(handle, "sha256").hexdigest()
    return {"path": str(folder), "sha256": digests}


def write_base_reference(checkpoint_dir: str | Path, reference: dict[str, Any]) -> Path:
    """Rank 0, into the checkpoint folder before it is published."""
    return write_json_atomic(Path(checkpoint_dir) / BASE_REFERENCE, reference)


def check_base_unchanged(checkpoint_dir: str | Path | None, current: dict[str, Any]) -> None:
    """Refuse to resume adapters on a base whose files differ from the ones they were trained on.

    Args:
        checkpoint_dir: the checkpoint to resume from (None: nothing to check).
        current: :func:`base_reference` of the base given now.

    Raises:
        ConfigError: a file changed, went missing or appeared; the message names them.
    """
    if checkpoint_dir is None or not (Path(checkpoint_dir) / BASE_REFERENCE).is_file():
        return  # no checkpoint, or one written before references existed: nothing to compare with
    saved = json.loads((Path(checkpoint_dir) / BASE_REFERENCE).read_text())
    before, now = saved["sha256"], current["sha256"]
    differences = [f"{name} changed" for name in sorted(before.keys() & now.keys()) if before[name] != now[name]]
    differences += [f"{name} missing" for name in sorted(before.keys() - now.keys())]
    differences += [f"{name} new" for name in sorted(now.keys() - before.keys())]
    if differences:
        raise ConfigError(
            f"{checkpoint_dir} holds adapters trained on the base model {saved['path']}, and the base given now "
            f"({current['path']}) differs from it: {', '.join(differences)}; resume with the base the run started "
            "with, or start a new out_dir"
        )
