"""Checks on a user's Hugging Face model folder, made before anything loads it.

A truncated download or an interrupted copy leaves a ``*.safetensors`` file whose header promises more bytes than
the file holds. ``from_pretrained`` then fails deep inside rank 0 with a ``SafetensorError`` traceback; reading each
file's header first (``safe_open`` maps the file and checks that the header's offsets cover it exactly, without
reading the tensors) turns that into one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from common.errors import ConfigError

INDEX_SUFFIX = ".safetensors.index.json"


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
