"""Reading DeepSpeed's ZeRO checkpoint files without reading their tensors, and where each parameter's elements
lie in them: the low layer of ``zero-recipes export`` (:mod:`common.tools.export`).

Every pickle is opened on the ``meta`` device (:func:`load_structure`): nothing but the structure is read, and each
meta tensor tells where its bytes lie in the file, so a tensor is later read with plain file reads of exactly its
slices (:class:`TensorSource`). Pickles are loaded with ``weights_only=True`` and an allow-list of the DeepSpeed
classes a checkpoint holds (:func:`deepspeed_pickle_classes`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.errors import ConfigError

_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def deepspeed_pickle_classes() -> list[Any]:
    """The non-tensor classes DeepSpeed pickles into a checkpoint: the only globals ``torch.load`` may build."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def load_structure(path: Path) -> dict[str, Any]:
    """A checkpoint file's contents with every tensor on the ``meta`` device (no tensor data is read).

    Raises:
        ConfigError: the file is missing, truncated, not a torch file, or pickles a class outside the allow-list.
    """
    if not path.is_file():
        raise ConfigError(f"missing checkpoint shard: {path}")
    try:
        with torch.serialization.safe_globals(deepspeed_pickle_classes()):
            return torch.load(path, map_location="meta", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, UnpicklingError, EOFError... for a damaged file
        text = str(exc)
        if blocked := _UNSUPPORTED_GLOBAL.search(text):
            raise ConfigError(
                f"{path} pickles {blocked.group(1)}, which export does not load: only tensors, plain data and "
                "DeepSpeed's own checkpoint classes are allowed (torch.load weights_only=True)"
            ) from None
        reason = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
        raise ConfigError(f"corrupt or unreadable checkpoint shard: {path} ({reason})") from None


def read_into(path: Path, flat: torch.Tensor, start: int, out: torch.Tensor) -> None:
    """Fill ``out`` with elements ``start:start+out.numel()`` of the meta tensor ``flat`` (1-D), read from ``path``.

    torch writes each storage uncompressed into its zip file; a meta tensor loaded from it keeps the storage's
    byte offset (``_checkpoint_offset``), so the slice is one ``readinto`` of exactly its bytes, straight into
    the output tensor's memory.
    """
    itemsize = flat.element_size()
    offset = flat.untyped_storage()._checkpoint_offset + (flat.storage_offset() + start) * itemsize
    target = out.view(torch.uint8).numpy()
    with open(path, "rb") as handle:
        handle.seek(offset)
        if handle.readinto(target) != target.nbytes:
            raise ConfigError(f"corrupt checkpoint shard: {path} ends before the tensor data it lists")


@dataclass(frozen=True)
class Piece:
    """A run of elements of one flat tensor in one file."""

    file: Path
    flat: torch.Tensor  # meta tensor: dtype and where its bytes lie
    start: int
    length: int


@dataclass(frozen=True)
class TensorSource:
    """One whole tensor of the model: its shape and the pieces that, concatenated, hold its elements first."""

    shape: torch.Size
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].flat.dtype

    def read(self) -> torch.Tensor:
        """The tensor, read from disk in its saved dtype: one allocation, each piece read into its place."""
        whole = torch.empty(sum(p.length for p in self.pieces), dtype=self.pieces[0].flat.dtype)
        position = 0
        for piece in self.pieces:
            read_into(piece.file, piece.flat, piece.start, whole[position : position + piece.length])
            position += piece.length
        return whole[: self.numel].view(self.shape)


@dataclass(frozen=True)
class JoinedSource:
    """A tensor that tensor parallelism split: its slices, one per ``mp_rank``, joined along ``dim`` when read.

    A slice split along dim 0 would be contiguous pieces, but AutoTP's row-parallel layers are split along dim 1:
    reading joins whole slices, so the peak holds the tensor twice (once in slices), never the model.
    """

    shape: torch.Size
    parts: tuple[TensorSource, ...]
    dim: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def read(self) -> torch.Tensor:
        return torch.cat([part.read() for part in self.parts], dim=self.dim)


# --- where the elements of each parameter lie (pure functions of the saved shapes) ----------------


def zero3_layout(group_shapes: list[dict[str, torch.Size]], world_size: int) -> dict[str, tuple[int, int]]:
    """ZeRO-3: ``{name: (offset, partition_numel)}`` in each rank's flat groups laid end to end.

    Each parameter is padded to a multiple of the world size and split evenly; every rank holds
    ``partition_numel`` elements of it at the same offset (DeepSpeed's ``zero_to_fp32``:
    ``zero3_partitioned_param_info``). The offset runs across groups: the saved flat groups are sub-groups
    (``sub_group_size``) that need not match the parameter groups.
    """
    layout, offset = {}, 0
    for shapes in group_shapes:
        for name, shape in shapes.items():
            partition = math.ceil(math.prod(shape) / world_size)
            layout[name] = (offset, partition)
            offset += partition
    return layout


def zero12_layout(
    group_shapes: list[dict[str, torch.Size]], alignment_paddings: list[list[int]] | None
) -> tuple[dict[str, tuple[int, int]], list[int]]:
    """ZeRO-1/2: ``{name: (group, start)}`` in each group's vector (the ranks' partitions laid end to end), and
    where each group's parameters end.

    Parameters follow each other in the group, each possibly followed by an alignment padding (saved by
    DeepSpeed >= 0.16 as ``param_alignment_paddings``).
    """
    layout, ends = {}, []
    for group, shapes in enumerate(group_shapes):
        start = 0
        paddings = alignment_paddings[group] if alignment_paddings else [0] * len(shapes)
        for (name, shape), padding in zip(shapes.items(), paddings, strict=True):
            layout[name] = (group, start)
            start += math.prod(shape) + padding
        ends.append(start)
    return layout, ends


def span_pieces(lengths: list[int], start: int, length: int) -> list[tuple[int, int, int]]:
    """``(index, start, length)`` runs covering ``start:start+length`` of vectors of ``lengths`` laid end to end."""
    runs, base = [], 0
    for index, size in enumerate(lengths):
        lo, hi = max(start, base), min(start + length, base + size)
        if lo < hi:
            runs.append((index, lo - base, hi - lo))
        base += size
    return runs
