"""``zero-recipes export``: a ZeRO 1/2/3 checkpoint consolidated into safetensors shards, one tensor at a time.

    zero-recipes export runs/nlp/ exported/                    # a run directory: its checkpoints/latest
    zero-recipes export runs/nlp/checkpoints/step_000100 exported/ --dtype bf16 --max-shard-size 2GB --verify

A DeepSpeed checkpoint keeps the fp32 master weights as flat vectors, one slice per data-parallel rank, inside
the optimizer files (``*_optim_states.pt``), next to the Adam moments (twice as large again). DeepSpeed's own
``zero_to_fp32`` unpickles them (memory-mapped) and keeps every page it touched mapped until the end, so its peak
grows with the model. Here every pickle is opened on the ``meta`` device: nothing but the structure is read, and
each meta tensor tells where its bytes lie in the file. Each output tensor is then read with plain file reads of
exactly its slices, cast, and dropped once its shard is written: the peak is about one output shard plus the
largest tensor (``bench/export_memory.py`` measures it against ``zero_to_fp32``).

Accepted inputs: a run directory (``checkpoints/latest`` names the step), its ``checkpoints/`` folder (the same
pointer), a step directory (DeepSpeed's ``latest`` file names the tag folder: ``checkpoint/`` from Lightning,
``pytorch_model/`` from Accelerate's ``save_state``), or the tag folder itself. When the run's model is a
transformers model (the run directory's ``final/`` holds a ``config.json``) the output is a Hugging Face folder:
config, tokenizer and weights under the model's own parameter names, with tied weights left to the config
(``tie_word_embeddings``) as ``save_pretrained`` does.

A run under an FSDP2 preset (``fsdp2``, ``fsdp2_grad_op``) checkpoints through ``torch.distributed.checkpoint``
(DCP: a ``.metadata`` file and every rank's ``*.distcp`` shards in the step folder): its weights are rebuilt from the
shards by :func:`common.fsdp2.consolidate_checkpoint` (the optimizer's moments are not read) and written the same
way, to the same Hugging Face folder a ZeRO run of the same model gives. ``--verify`` then compares the export with
torch's own reader of the checkpoint (``dcp_to_torch_save``).

Pickles are loaded with ``weights_only=True`` and an allow-list of the four DeepSpeed classes a checkpoint
holds; anything else is refused, not executed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.checkpoint import latest_checkpoint
from common.errors import ConfigError
from common.memory_formulas import parse_bytes
from common.rundir import refuse_existing_out_dir
from common.strategy import torch_dtype
from common.tools.zero_files import (
    JoinedSource,
    Piece,
    TensorSource,
    deepspeed_pickle_classes,
    load_structure,
    span_pieces,
    zero3_layout,
    zero12_layout,
)

EXPORT_DTYPES = ("fp32", "bf16")  # what a consolidated model is written in (common.strategy.torch_dtype)
INDEX_NAME = "model.safetensors.index.json"
WEIGHT_FILES = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")
_TP_SLICE = re.compile(r"mp_rank_(\d+)_(?:model|optim)_states\.pt$")
_OPTIM_FILE = re.compile(r"^(?:\w+_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


# --- the checkpoint -------------------------------------------------------------------------------


@dataclass
class ZeroCheckpoint:
    """A DeepSpeed ZeRO checkpoint opened for export: where each tensor's elements lie, nothing read yet."""

    tag_dir: Path
    run_dir: Path | None
    stage: int
    world_size: int
    ds_version: str
    tensors: dict[str, TensorSource | JoinedSource] = field(default_factory=dict)  # params, frozen params, buffers
    aliases: dict[str, str] = field(default_factory=dict)  # shared (tied) parameter -> the one saved
    params: list[str] = field(default_factory=list)  # trainable and frozen parameter names (no buffers)
    tensor_parallel: int = 1  # mp_rank slices joined (AutoTP), 1 for an unsplit model
    fsdp2_part: str | None = None  # an FSDP2 (DCP) checkpoint: the top-level key its weights were saved under


@dataclass
class LoadedTensor:
    """A tensor already in memory, read as the ZeRO sources are (an FSDP2 checkpoint's weights, rebuilt whole)."""

    tensor: torch.Tensor

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def read(self) -> torch.Tensor:
        return self.tensor


def locate(path: str | Path) -> tuple[Path, Path | None]:
    """(tag folder holding the ``*_states.pt`` files, run directory or None) for any accepted input path."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist")
    run_dir = None
    if (path / "checkpoints" / "latest").is_file():
        run_dir, path = path, latest_checkpoint(path)
    # Follow ``latest`` pointers down to the tag folder: checkpoints/latest names the step, the step's own latest
    # (DeepSpeed's) names the tag. Two levels at most, so a pointer loop is an error, not a hang.
    for _ in range(2):
        if list(path.glob("*_model_states.pt")) or is_dcp_checkpoint(path) or not (path / "latest").is_file():
            break
        tag = (path / "latest").read_text().strip()
        if not tag or not (path / tag).is_dir():
            raise ConfigError(f"{path / 'latest'} names {tag!r}, but {path / tag} is not a folder")
        path = path / tag
    if not list(path.glob("*_model_states.pt")) and not is_dcp_checkpoint(path):
        raise ConfigError(
            f"{path} is not a DeepSpeed ZeRO checkpoint: expected a run directory (with checkpoints/latest), "
            "a checkpoint folder (with a 'latest' file naming its tag folder) or a folder of "
            "*_model_states.pt and *_optim_states.pt files (or, from an FSDP2 run, a folder with DCP's .metadata)"
        )
    if run_dir is None:  # .../run/checkpoints/step_000100/<tag>: the run's files help name the weights
        for parent in path.parents:
            if (parent / "config.yaml").is_file() and (parent / "checkpoints").is_dir():
                run_dir = parent
                break
    return path, run_dir


def _check_version(saved: str | None, file: Path) -> str:
    """Refuse a checkpoint written by a newer major DeepSpeed version than the installed one."""
    import deepspeed
    from packaging.version import InvalidVersion, Version

    if saved is None:
        raise ConfigError(f"{file} has no ds_version: not a checkpoint written by DeepSpeed's save_checkpoint")
    try:
        newer = Version(str(saved)).major > Version(deepspeed.__version__).major
    except InvalidVersion:
        raise ConfigError(f"{file}: unreadable ds_version {saved!r}") from None
    if newer:
        raise ConfigError(
            f"{file} was written by DeepSpeed {saved}, a newer major version than the installed "
            f"{deepspeed.__version__}: its format may differ; upgrade DeepSpeed to export it"
        )
    return str(saved)


def _optimizer_files(tag_dir: Path, world_size: int, mp_rank: int = 0) -> list[Path]:
    """The ``*_optim_states.pt`` file of every data-parallel rank of one ``mp_rank`` slice, in rank order; a
    missing rank is named."""
    found = {
        int(m.group(1)): p for p in tag_dir.iterdir() if (m := _OPTIM_FILE.match(p.name)) and int(m.group(2)) == mp_rank
    }
    if not found:
        raise ConfigError(f"missing checkpoint shards: {tag_dir} has no *mp_rank_{mp_rank:02d}_optim_states.pt file")
    prefix = next(iter(found.values())).name.split("zero_pp_rank_")[0]
    for rank in range(world_size):
        if rank not in found:
            name = f"{prefix}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
            raise ConfigError(f"missing checkpoint shard: {tag_dir / name}")
    return [found[rank] for rank in range(world_size)]


def is_dcp_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is a ``torch.distributed.checkpoint`` checkpoint (an FSDP2 run's step folder)."""
    return (folder / ".metadata").is_file()


def dcp_weights_part(folder: Path) -> str:
    """The top-level key an FSDP2 checkpoint holds its weights under: ``model`` (the Accelerate loop's
    :func:`common.fsdp2.dcp_write`) or ``state_dict`` (Lightning's ``ModelParallelStrategy``)."""
    from common.fsdp2 import checkpoint_parts

    parts = checkpoint_parts(folder)
    for part in ("model", "state_dict"):
        if part in parts:
            return part
    raise ConfigError(f"{folder} holds no model weights (a 'model' or 'state_dict' part); saved parts: {parts}")


def open_dcp_checkpoint(step_dir: Path, run_dir: Path | None) -> ZeroCheckpoint:
    """An FSDP2 run's DCP checkpoint, its weights rebuilt whole from every rank's shards (not its optimizer state)."""
    from common.fsdp2 import consolidate_checkpoint

    part = dcp_weights_part(step_dir)
    weights = consolidate_checkpoint(step_dir, part)
    ranks = {name.split("_")[2] for name in (f.name for f in step_dir.glob("__*_*.distcp"))}
    ckpt = ZeroCheckpoint(step_dir, run_dir, stage=0, world_size=len(ranks), ds_version="", fsdp2_part=part)
    ckpt.tensors = {name: LoadedTensor(tensor) for name, tensor in weights.items()}
    ckpt.params = list(weights)  # buffers included: their names carry the same prefix
    return ckpt


def open_checkpoint(path: str | Path, trust_remote_code: bool = False) -> ZeroCheckpoint:
    """Resolve ``path``, read the structure of every shard, and place every tensor (no tensor data is read; an FSDP2
    checkpoint's weights are read whole)."""
    tag_dir, run_dir = locate(path)
    if is_dcp_checkpoint(tag_dir):
        return open_dcp_checkpoint(tag_dir, run_dir)
    if any(tag_dir.glob("layer_*-model_states.pt")):
        # The NLP recipe's train_pipeline.py: DeepSpeed's pipeline engine writes one file per layer, under its own
        # layer names, and one mp_rank file per stage; none of them is a ZeRO model-states file with param_shapes.
        raise ConfigError(
            f"{tag_dir} was written by DeepSpeed's pipeline engine (layer_XX-model_states.pt files): export reads "
            "ZeRO checkpoints of a whole model only; use the run's final/ folder (train_pipeline.py gathers the "
            "stages into it at the end)"
        )
    experts = list(tag_dir.glob("layer_*_expert_*_model_states.pt"))
    if experts:
        # DeepSpeed MoE (the NLP recipe's MoE models) saves each expert in a file of its own, outside the ZeRO shards.
        raise ConfigError(
            f"{tag_dir} was written with DeepSpeed MoE ({len(experts)} layer_*_expert_* files): export reads dense "
            "ZeRO checkpoints only; use the run's final/ folder (the recipe gathers the experts into a Hugging Face "
            "Mixtral model at the end)"
        )
    slices = sorted({int(match.group(1)) for f in tag_dir.glob("*.pt") if (match := _TP_SLICE.search(f.name))})
    if len(slices) <= 1:
        return _open_slice(tag_dir, run_dir, 0)
    # AutoTP (the NLP recipe's tensor_parallel=N): each mp_rank_XX slice is a ZeRO checkpoint of a model whose split
    # matrices hold 1/N of their rows (column-parallel) or columns (row-parallel); the rest is replicated.
    if slices != list(range(len(slices))):
        raise ConfigError(f"missing checkpoint shards: {tag_dir} has tensor-parallel slices {slices}, not 0..N-1")
    hf = find_hf_model(run_dir, trust_remote_code)
    if hf is None:
        raise ConfigError(
            f"{tag_dir} was written with tensor parallelism ({len(slices)} mp_rank slices): joining the slices needs "
            "the model's whole shapes, from the run directory's final/config.json, which is missing; export the "
            "checkpoint from inside its run directory, after a run that reached the end"
        )
    parts = [_open_slice(tag_dir, run_dir, mp) for mp in slices]
    ckpt = parts[0]
    ckpt.tensor_parallel = len(parts)
    prefix = strip_prefix(ckpt.params, set(hf.shapes))
    for name in list(ckpt.tensors):
        whole = hf.shapes.get(name[len(prefix) :]) if name.startswith(prefix) else None
        ckpt.tensors[name] = join_slices(name, [part.tensors[name] for part in parts], whole)
    return ckpt


def join_slices(name: str, slices: list[TensorSource], whole: torch.Size | None) -> TensorSource | JoinedSource:
    """One tensor from its tensor-parallel slices: a replicated one is slice 0; a split one is joined along the
    one dimension in which the slices' sizes add up to the whole shape's (the model's own, from ``final/``)."""
    shapes = [s.shape for s in slices]
    if whole is None or all(shape == whole for shape in shapes):
        return slices[0]  # replicated (embeddings, norms), or a buffer the model does not save
    split = [d for d in range(len(whole)) if any(shape[d] != whole[d] for shape in shapes)]
    if (
        len(split) == 1
        and all(len(shape) == len(whole) for shape in shapes)
        and sum(shape[split[0]] for shape in shapes) == whole[split[0]]
    ):
        return JoinedSource(whole, tuple(slices), split[0])
    raise ConfigError(
        f"{name}: the tensor-parallel slices have shapes {[tuple(s) for s in shapes]}, which do not join into the "
        f"model's {tuple(whole)}: was the checkpoint written by this run?"
    )


def _open_slice(tag_dir: Path, run_dir: Path | None, mp_rank: int) -> ZeroCheckpoint:
    """The ZeRO checkpoint of one ``mp_rank`` slice (the whole model when there is no tensor parallelism)."""
    mp = f"mp_rank_{mp_rank:02d}"
    model_files = sorted(tag_dir.glob(f"*{mp}_model_states.pt"))
    if not model_files:
        raise ConfigError(f"missing checkpoint shard: {tag_dir} has no *{mp}_model_states.pt file")
    model_file = model_files[0]  # rank 0's under ZeRO-3, the only one under 1/2
    first = load_structure(model_file)
    if "param_shapes" not in first or "buffer_names" not in first:
        raise ConfigError(f"{model_file} is not a ZeRO model-states file (no param_shapes / buffer_names)")
    version = _check_version(first.get("ds_version"), model_file)
    world_size = int(first.get("dp_world_size") or 0)
    if world_size < 1:
        raise ConfigError(f"{model_file} does not say how many data-parallel ranks wrote it (dp_world_size)")
    optim_files = _optimizer_files(tag_dir, world_size, mp_rank)
    optim = [load_structure(f)["optimizer_state_dict"] for f in optim_files]
    stage = int(optim[0]["zero_stage"])
    ckpt = ZeroCheckpoint(tag_dir, run_dir, stage, world_size, version)
    if stage == 3:
        ckpt.tensors = _zero3_sources(first["param_shapes"], optim_files, [o["fp32_flat_groups"] for o in optim])
        ranks = [tag_dir / f"zero_pp_rank_{r}_{mp}_model_states.pt" for r in range(world_size)]
        fragments = [load_structure(f).get("frozen_param_fragments") or {} for f in ranks]
    elif stage in (1, 2):
        flats = [o["single_partition_of_fp32_groups"] for o in optim]
        paddings = optim[0].get("param_alignment_paddings")
        ckpt.tensors = _zero12_sources(first["param_shapes"], paddings, optim_files, flats)
        ranks, fragments = [model_file], [first.get("frozen_param_fragments") or {}]  # saved whole
    else:
        raise ConfigError(f"{optim_files[0]}: ZeRO stage {stage}; export reads stages 1, 2 and 3")
    for name, shape in (first.get("frozen_param_shapes") or {}).items():  # requires_grad=False: in the model files
        pieces = [Piece(f, frag[name].reshape(-1), 0, frag[name].numel()) for f, frag in zip(ranks, fragments)]
        ckpt.tensors[name] = TensorSource(shape, tuple(pieces))
    ckpt.params = list(ckpt.tensors)
    module = first.get("module") or {}
    for name in first["buffer_names"]:
        if name in module:
            buffer = module[name].reshape(-1)
            ckpt.tensors[name] = TensorSource(module[name].shape, (Piece(model_file, buffer, 0, buffer.numel()),))
    shared = first.get("shared_params") or {}
    ckpt.aliases = {alias: source for alias, source in shared.items() if source in ckpt.tensors}
    return ckpt


def _zero3_sources(
    group_shapes: list[dict[str, torch.Size]], files: list[Path], flats: list[list[torch.Tensor]]
) -> dict[str, TensorSource]:
    """ZeRO-3: each parameter is one piece per rank (a piece may cross from one flat sub-group to the next)."""
    lengths = [t.numel() for t in flats[0]]
    layout = zero3_layout(group_shapes, len(files))
    _check_filled(files[0].parent, [sum(p for _, p in layout.values())], [sum(lengths)])
    sources = {}
    for shapes in group_shapes:
        for name, shape in shapes.items():
            offset, partition = layout[name]
            pieces = [
                Piece(file, flat[g], start, n)
                for file, flat in zip(files, flats, strict=True)
                for g, start, n in span_pieces(lengths, offset, partition)
            ]
            sources[name] = TensorSource(shape, tuple(pieces))
    return sources


def _zero12_sources(
    group_shapes: list[dict[str, torch.Size]],
    alignment_paddings: list[list[int]] | None,
    files: list[Path],
    flats: list[list[torch.Tensor]],
) -> dict[str, TensorSource]:
    """ZeRO-1/2: each parameter is a run of its group's vector, which the ranks' partitions cut into pieces."""
    layout, ends = zero12_layout(group_shapes, alignment_paddings)
    align = 2 * len(files)  # DeepSpeed pads each group to a multiple of 2 x world size: compare as zero_to_fp32 does
    held = [sum(flat[g].numel() for flat in flats) for g in range(len(group_shapes))]
    _check_filled(files[0].parent, [_round_up(e, align) for e in ends], [_round_up(h, align) for h in held])
    sources = {}
    for name, (group, start) in layout.items():
        shape = group_shapes[group][name]
        runs = span_pieces([flat[group].numel() for flat in flats], start, math.prod(shape))
        sources[name] = TensorSource(shape, tuple(Piece(files[r], flats[r][group], s, n) for r, s, n in runs))
    return sources


def _check_filled(tag_dir: Path, needed: list[int], held: list[int]) -> None:
    """The saved shapes must account for exactly the elements the shards hold."""
    if needed != held:
        raise ConfigError(
            f"{tag_dir}: the saved shapes need {needed} elements per flat group but the shards hold {held}; "
            "the shards do not belong to this checkpoint"
        )


def _round_up(value: int, multiple: int) -> int:
    return multiple * math.ceil(value / multiple)


# --- naming: the run's transformers model, if any ------------------------------------------------


@dataclass
class HFModel:
    """A transformers model to export for: its folder (config, tokenizer files) and its parameter names."""

    folder: Path
    state_keys: list[str]  # the model's own state_dict keys, persistent buffers included
    tied: dict[str, str]  # name -> the parameter it shares storage with (``tie_word_embeddings``)
    shapes: dict[str, torch.Size] = field(default_factory=dict)  # state_dict key -> whole shape


def model_class(folder: Path, trust_remote_code: bool = False) -> tuple[Any, Any] | None:
    """(config, model class) of a Hugging Face folder, or None when its ``config.json`` is not a transformers one.

    The class is the one ``config.json`` names under ``architectures`` (``LlamaForCausalLM``,
    ``SwinForImageClassification``...), looked up in transformers itself: no code from the folder is run unless
    ``trust_remote_code``.
    """
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError):
        return None  # e.g. a domain model's own config.json (no model_type)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, architecture, None) if architecture else None
    return (config, cls) if cls is not None else None


def find_hf_model(run_dir: Path | None, trust_remote_code: bool = False) -> HFModel | None:
    """The run's transformers model, read from ``final/config.json`` and built on the ``meta`` device.

    ``final/`` is what the recipe itself exported at the end of the run: the only place that holds the model's
    exact config (a config built again from ``config.yaml`` would need the recipe's code). A run without a
    transformers model, or one that crashed before ``final/``, is exported as plain safetensors.
    """
    folder = run_dir / "final" if run_dir else None
    found = model_class(folder, trust_remote_code) if folder and (folder / "config.json").is_file() else None
    if found is None:
        return None
    config, cls = found
    with torch.device("meta"):
        model = cls(config)
    seen: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied[name] = seen[id(param)]
        else:
            seen[id(param)] = name
    state = model.state_dict()
    return HFModel(folder, list(state), tied, {name: tensor.shape for name, tensor in state.items()})


def strip_prefix(names: list[str], wanted: set[str]) -> str:
    """The leading dotted prefix that turns every checkpoint name into one of ``wanted`` ('' when none is needed).

    Lightning saves the LightningModule, so a transformers model kept as ``self.model`` has names
    ``model.model.layers...``; Accelerate saves the model itself (``model.layers...``).
    """
    parts = names[0].split(".")
    for depth in range(len(parts)):
        prefix = ".".join(parts[:depth]) + ("." if depth else "")
        if all(n.startswith(prefix) and n[len(prefix) :] in wanted for n in names):
            return prefix
    missing = sorted(n for n in names if n not in wanted)[:3]
    raise ConfigError(
        f"the checkpoint's parameter names ({', '.join(missing)} ...) do not match the run's model in final/: "
        "was the checkpoint written by this run?"
    )


def output_names(ckpt: ZeroCheckpoint, hf: HFModel | None) -> dict[str, str]:
    """``{name in the export: name in the checkpoint}``, in the checkpoint's order.

    Without a transformers model every tensor keeps its name and a shared (tied) parameter is written under
    each of its names. With one, names lose the wrapper's prefix, keys the model does not save (non-persistent
    buffers) are dropped, and tied parameters are written once: the config ties them again on load.
    """
    if hf is None:
        names = {name: name for name in ckpt.tensors}
        names.update(ckpt.aliases)
        return names
    wanted = set(hf.state_keys)
    prefix = strip_prefix(ckpt.params, wanted)
    names = {n[len(prefix) :]: n for n in ckpt.tensors if n.startswith(prefix) and n[len(prefix) :] in wanted}
    missing = [k for k in hf.state_keys if k not in names and k not in hf.tied]
    if missing:
        raise ConfigError(f"the checkpoint lacks {len(missing)} tensors of the model in final/, e.g. {missing[:3]}")
    return {k: v for k, v in names.items() if k not in hf.tied}


# --- writing --------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``--max-shard-size``: ``"5GB"`` -> 5_000_000_000 bytes, read by :func:`common.memory_formulas.parse_bytes`
    (KB/MB/GB/TB are powers of 10, KiB/MiB/GiB/TiB of 2)."""
    try:
        size = int(parse_bytes(text))
    except ConfigError:
        raise ConfigError(f"--max-shard-size {text!r}: expected a size such as 500MB, 5GB or 2GiB") from None
    if size < 1:
        raise ConfigError(f"--max-shard-size {text!r}: must be positive")
    return size


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names grouped into shards of at most ``max_shard_bytes`` each, in order (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes.items():
        if shards[-1] and filled + nbytes > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += nbytes
    return shards


def shard_file_name(index: int, count: int) -> str:
    """Hugging Face's shard names: ``model-00001-of-00003.safetensors``."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _copy_model_files(hf: HFModel, run_dir: Path, dest: Path, dtype: torch.dtype) -> None:
    """Config, generation config and tokenizer next to the weights; the config names the export's dtype."""
    for path in hf.folder.iterdir():
        if path.is_file() and not WEIGHT_FILES.match(path.name):
            shutil.copy2(path, dest / path.name)
    tokenizer = run_dir / "tokenizer"
    if not (dest / "tokenizer.json").exists() and tokenizer.is_dir():
        for path in tokenizer.iterdir():
            if path.is_file():
                shutil.copy2(path, dest / path.name)
    config = json.loads((dest / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_checkpoint(
    source: str | Path,
    out_dir: str | Path,
    dtype: str = "fp32",
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Consolidate the ZeRO checkpoint at ``source`` into ``out_dir`` (safetensors shards + index).

    The shards are written into ``.tmp-<name>`` next to ``out_dir`` and renamed into place at the end, so a
    failure leaves no half export and an existing ``out_dir`` (with ``overwrite``) is replaced only then.

    Returns:
        what was written: ``out_dir``, stage, world size, tensor and shard counts, bytes, whether it is a
        Hugging Face folder, the checkpoint's tag folder.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    out_dir = Path(out_dir)
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
    max_bytes = parse_size(max_shard_size)
    refuse_existing_out_dir(
        out_dir, resume=False, overwrite=overwrite, name="OUT_DIR", remedy="pass --overwrite to replace it"
    )
    ckpt = open_checkpoint(source, trust_remote_code)
    hf = find_hf_model(ckpt.run_dir, trust_remote_code)
    names = output_names(ckpt, hf)
    out_dtype = torch_dtype(dtype)

    def out_bytes(name: str) -> int:
        source = ckpt.tensors[names[name]]
        return source.numel * (out_dtype if source.dtype.is_floating_point else source.dtype).itemsize

    sizes = {name: out_bytes(name) for name in names}
    shards = plan_shards(sizes, max_bytes)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if tmp.exists():
        shutil.rmtree(tmp)  # our own leftover from an interrupted export
    tmp.mkdir(parents=True)
    try:
        weight_map = {}
        bar = tqdm(total=len(names), desc="export", unit="tensor", disable=not progress, file=sys.stderr)
        for index, shard in enumerate(shards):
            file_name = shard_file_name(index, len(shards))
            tensors = {}
            for name in shard:
                tensor = ckpt.tensors[names[name]].read()
                tensors[name] = tensor.to(out_dtype) if tensor.is_floating_point() else tensor.clone()
                weight_map[name] = file_name
                bar.update()
            save_file(tensors, str(tmp / file_name), metadata={"format": "pt"})
            del tensors  # the shard is on disk: its memory goes before the next one is read
        bar.close()
        index_doc = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index_doc, indent=2, sort_keys=True) + "\n")
        if hf is not None:
            _copy_model_files(hf, ckpt.run_dir, tmp, out_dtype)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return {
        "out_dir": str(out_dir),
        "checkpoint": str(ckpt.tag_dir),
        "fsdp2": ckpt.fsdp2_part is not None,
        "zero_stage": ckpt.stage,
        "world_size": ckpt.world_size,
        "tensor_parallel": ckpt.tensor_parallel,
        "ds_version": ckpt.ds_version,
        "tensors": len(names),
        "shards": len(shards),
        "total_bytes": sum(sizes.values()),
        "dtype": dtype,
        "hugging_face": hf is not None,
    }


# --- verifying: against DeepSpeed's own reader, not the code that wrote the export ---------------


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Make every ``torch.load`` inside the block ``weights_only=True`` with the DeepSpeed allow-list.

    DeepSpeed's ``zero_to_fp32`` loads with ``weights_only=False``; torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
    overrides that, so its reader unpickles nothing that :func:`load_structure` would refuse.
    """
    saved = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(deepspeed_pickle_classes()):
            yield
    finally:
        if saved is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = saved


def deepspeed_reference(tag_dir: Path) -> dict[str, Any]:
    """DeepSpeed's own consolidation of the checkpoint in ``tag_dir``, lazily: ``.contiguous()`` gathers a tensor.

    ``get_fp32_state_dict_from_zero_checkpoint`` reads the shards with DeepSpeed's own layout code, so it is an
    independent reference for the export, which uses this module's. Its chatter goes nowhere.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    quiet = io.StringIO()
    try:
        with _weights_only_loads(), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name, lazy_mode=True)
    except Exception as exc:  # any failure of DeepSpeed's reader means: cannot verify
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"--verify: DeepSpeed's zero_to_fp32 could not read {tag_dir} ({reason})") from None


def dcp_reference(step_dir: Path, part: str) -> dict[str, Any]:
    """torch's own reader of an FSDP2 (DCP) checkpoint: ``dcp_to_torch_save`` into a temporary file, loaded with
    ``weights_only=True``; the ``part`` holding the weights. It reads the whole checkpoint (optimizer moments too)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(step_dir), str(file))
        return torch.load(file, weights_only=True, map_location="cpu")[part]


def reference_name(ckpt: ZeroCheckpoint) -> str:
    """What ``--verify`` compares the export with, as its line names it."""
    return "torch's dcp_to_torch_save" if ckpt.fsdp2_part else "DeepSpeed's zero_to_fp32"


def reference_prefix(names: list[str], reference_keys: set[str]) -> str:
    """The prefix ``p`` such that ``p + name`` is a key of DeepSpeed's consolidation for every exported name.

    Lightning saves the LightningModule (a transformers model under ``model.``), Accelerate the model itself.
    """
    first = names[0]
    candidates = {key[: len(key) - len(first)] for key in reference_keys if key.endswith(first)}
    for prefix in sorted(candidates, key=len):
        whole_names = prefix == "" or prefix.endswith(".")
        if whole_names and all(prefix + name in reference_keys for name in names):
            return prefix
    raise ConfigError(
        f"--verify: the exported names (e.g. {first!r}) are not the names in DeepSpeed's consolidation of the "
        "checkpoint: the export does not match it"
    )


def tensor_difference(exported: torch.Tensor, expected: torch.Tensor) -> float:
    """Max absolute difference (inf for another shape or unequal non-float tensors)."""
    if exported.shape != expected.shape:
        return math.inf
    if not exported.is_floating_point():
        return 0.0 if torch.equal(exported, expected) else math.inf
    if not exported.numel():
        return 0.0
    return (exported.double() - expected.double()).abs().max().item()


def verify_export(source: str | Path, out_dir: str | Path, progress: bool = True) -> dict[str, Any]:
    """Compare the export in ``out_dir`` with DeepSpeed's own consolidation of the checkpoint ``source``.

    Every exported tensor is read back (one at a time) and compared with DeepSpeed's tensor of the same name,
    cast to the export's dtype; every tensor DeepSpeed finds must have been exported (a transformers export may
    leave out only tied and non-persistent names). For a transformers model, ``from_pretrained`` loads the folder
    and its logits on a fixed batch are compared with those of the config's model given DeepSpeed's tensors.
    Nothing here uses the reader or the layout code that wrote the export.

    Returns:
        ``tensors_checked``, ``max_abs_param_diff``, ``differing`` (names whose values differ), ``missing`` (names
        DeepSpeed has that the export lacks) and, for a transformers model, ``max_abs_logit_diff``.
    """
    from safetensors import safe_open
    from tqdm import tqdm

    out_dir = Path(out_dir)
    ckpt = open_checkpoint(source)  # refuses a damaged or unsafe checkpoint before DeepSpeed's reader opens it
    if ckpt.tensor_parallel > 1:
        raise ConfigError(
            f"--verify compares with DeepSpeed's zero_to_fp32, which reads unsplit checkpoints, not the "
            f"{ckpt.tensor_parallel} tensor-parallel slices of {ckpt.tag_dir}; compare the export with the run's "
            "final/ instead (the recipe gathers the slices there with DeepSpeed's own gather)"
        )
    weight_map = json.loads((out_dir / INDEX_NAME).read_text())["weight_map"]
    if ckpt.fsdp2_part:
        reference = dcp_reference(ckpt.tag_dir, ckpt.fsdp2_part)
    else:
        reference = deepspeed_reference(ckpt.tag_dir)
    prefix = reference_prefix(sorted(weight_map), set(reference))
    hf = find_hf_model(ckpt.run_dir)
    may_lack = set(hf.tied) if hf else set()
    missing = [
        key
        for key in reference
        if key.startswith(prefix)
        and key[len(prefix) :] not in weight_map
        and key[len(prefix) :] not in may_lack
        and (hf is None or key[len(prefix) :] in hf.state_keys)
    ]
    worst, differing = 0.0, []
    for name in tqdm(sorted(weight_map), desc="verify", unit="tensor", disable=not progress, file=sys.stderr):
        with safe_open(str(out_dir / weight_map[name]), framework="pt") as handle:
            exported = handle.get_tensor(name)
        expected = reference[prefix + name].contiguous()
        if expected.is_floating_point():
            expected = expected.to(exported.dtype)
        difference = tensor_difference(exported, expected)
        if difference > 0:
            differing.append(name)
        worst = max(worst, difference)
    result: dict[str, Any] = {
        "reference": reference_name(ckpt),
        "tensors_checked": len(weight_map),
        "max_abs_param_diff": worst,
        "differing": differing,
        "missing": missing,
    }
    if hf is not None and (logit_diff := _compare_logits(reference, prefix, out_dir)) is not None:
        result["max_abs_logit_diff"] = logit_diff
    return result


def verify_failures(check: dict[str, Any]) -> list[str]:
    """What makes a verification fail: any differing or missing tensor, any logit difference. Empty when it passes.

    Exact equality is the bar: export and reference cast the same fp32 master weights with the same ``.to()``.
    """
    failures = []
    if check["differing"]:
        failures.append(
            f"{len(check['differing'])} tensors differ (e.g. {check['differing'][0]}, "
            f"max abs difference {check['max_abs_param_diff']:.3g})"
        )
    if check["missing"]:
        failures.append(f"{len(check['missing'])} tensors are missing (e.g. {check['missing'][0]})")
    if check.get("max_abs_logit_diff", 0.0) != 0.0:
        failures.append(f"logits differ by up to {check['max_abs_logit_diff']:.3g}")
    return failures


def example_inputs(config: Any) -> dict[str, torch.Tensor] | None:
    """A fixed batch the model accepts: token ids for a language model, pixels for a vision model, else None."""
    generator = torch.Generator().manual_seed(0)
    if getattr(config, "vocab_size", None):
        return {"input_ids": torch.randint(0, config.vocab_size, (2, 16), generator=generator)}
    if getattr(config, "image_size", None) and getattr(config, "num_channels", None):
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        return {"pixel_values": torch.randn(2, config.num_channels, size, size, generator=generator)}
    return None


def _compare_logits(reference: dict[str, Any], prefix: str, out_dir: Path) -> float | None:
    """Max |logits| difference: ``from_pretrained(out_dir)`` vs the config's model given DeepSpeed's tensors."""
    config, cls = model_class(out_dir)
    inputs = example_inputs(config)
    if inputs is None:
        return None
    loaded = cls.from_pretrained(str(out_dir), local_files_only=True).eval()
    dtype = next(loaded.parameters()).dtype
    # Built as from_pretrained builds it: parameters in ``dtype``, computed buffers (RoPE frequencies) in fp32.
    model = cls._from_config(config, dtype=dtype).eval()
    wanted = set(model.state_dict())
    state = {
        key[len(prefix) :]: value.contiguous().to(dtype) if value.dtype.is_floating_point else value.contiguous()
        for key, value in reference.items()
        if key.startswith(prefix) and key[len(prefix) :] in wanted
    }
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        diff = loaded(**inputs).logits.float() - model(**inputs).logits.float()
    return diff.abs().max().item()


# --- the command ----------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    """``zero-recipes export``: consolidate, print what was written, optionally verify."""
    result = export_checkpoint(
        args.checkpoint, args.out_dir, args.dtype, args.max_shard_size, args.overwrite, progress=not args.quiet
    )
    kind = "Hugging Face folder" if result["hugging_face"] else "safetensors shards + index"
    if result["fsdp2"]:
        written_by = f"FSDP2 (DCP) checkpoint {result['checkpoint']} (world size {result['world_size']})"
    else:
        written_by = (
            f"ZeRO-{result['zero_stage']} checkpoint {result['checkpoint']} (world size {result['world_size']}, "
            f"DeepSpeed {result['ds_version']})"
        )
    print(
        f"exported {written_by}: {result['tensors']} tensors, {result['total_bytes'] / 1e6:.1f} MB "
        f"{result['dtype']} in {result['shards']} shard(s) -> {result['out_dir']} ({kind})"
    )
    if args.verify:
        check = verify_export(args.checkpoint, args.out_dir, progress=not args.quiet)
        line = (
            f"verify against {check['reference']}: {check['tensors_checked']} tensors, "
            f"max abs difference {check['max_abs_param_diff']:.3g}"
        )
        if "max_abs_logit_diff" in check:
            logits = check["max_abs_logit_diff"]
            owner = "torch's reader" if result["fsdp2"] else "DeepSpeed"
            line += f"; logits of from_pretrained vs {owner}'s tensors: max abs difference {logits:.3g}"
        print(line)
        if failures := verify_failures(check):
            raise ConfigError(f"--verify failed for {args.out_dir}: {'; '.join(failures)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``export`` to the ``zero-recipes`` command."""
    export = subparsers.add_parser("export", help="consolidate a ZeRO 1/2/3 checkpoint into safetensors shards")
    export.add_argument("checkpoint", help="run directory, checkpoints/step_XXXXXX folder, or DeepSpeed tag folder")
    export.add_argument("out_dir", help="output folder (must be empty or absent unless --overwrite)")
    export.add_argument("--dtype", choices=EXPORT_DTYPES, default="fp32", help="floating-point dtype written")
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 500MB, 5GB)")
    export.add_argument(
        "--verify", action="store_true", help="compare the export with DeepSpeed's own consolidation (zero_to_fp32)"
    )
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir (after success)")
    export.add_argument("--quiet", action="store_true", help="no progress bars")
    export.set_defaults(func=cmd_export)
