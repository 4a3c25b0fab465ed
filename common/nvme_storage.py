"""What the strategy factory checks on this machine before an NVMe-offload run (ZeRO-Infinity): every swap folder
exists, is writable and has room for what this node's ranks swap, and DeepSpeed's async I/O op can be built.

Reads only: nothing is created or written, so a run refused here leaves no file behind. The factory
(:func:`common.strategy.resolve_deepspeed_config`) calls :func:`check_nvme_storage` unless
``RunFacts.check_storage`` is off.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from typing import Any

from common.errors import ConfigError
from common.memory_formulas import MIN_SWAPPED_BYTES, nvme_swapped_bytes_per_rank


def async_io_problem() -> str | None:
    """Why DeepSpeed's async I/O op (NVMe offload) cannot be built here, or None when it can.

    DeepSpeed compiles the op on first use and links it against libaio; ``AsyncIOBuilder.is_compatible``
    compiles and links a test program calling ``io_submit`` (honouring ``CC``, ``CFLAGS`` and ``LDFLAGS``).
    Without this check a missing libaio surfaces as a compiler error deep inside ``deepspeed.initialize``.
    """
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time log must not reach a JSON stdout
        from deepspeed.ops.op_builder import AsyncIOBuilder

        compatible = AsyncIOBuilder().is_compatible(verbose=False)
    if compatible:
        return None
    return (
        "DeepSpeed's async I/O op cannot be built: libaio's header and library were not found (or no C compiler "
        "works); install them with `apt-get install libaio-dev` (Debian/Ubuntu) or `yum install libaio-devel`, "
        "or set CFLAGS/LDFLAGS to where libaio is"
    )


def nvme_sections(zero: dict[str, Any]) -> list[str]:
    """The offload sections of ``zero_optimization`` whose device is ``nvme``."""
    return [s for s in ("offload_optimizer", "offload_param") if (zero.get(s) or {}).get("device") == "nvme"]


def check_nvme_folder(
    path: str, zero: dict[str, Any], precision: str, num_params: int | None, world_size: int, ranks_on_node: int
) -> None:
    """The folder exists, is a writable directory and has room for what this node's ranks swap; reads only.

    Args:
        path: the ``nvme_path`` of an offload section.
        zero: the resolved ``zero_optimization`` section (which states go to NVMe).
        precision: ``bf16``, ``fp16`` or ``fp32`` (the swapped parameters' element size).
        num_params: the model's parameter count; None: room for one swapped tensor per rank is checked.
        world_size: ranks of the run (each swaps its partition).
        ranks_on_node: ranks of this node, whose swap files share the folder.

    Raises:
        ConfigError: the folder is missing, not a directory, not writable or too small.
    """
    where = f"nvme_path {path!r}"
    if not os.path.exists(path):
        raise ConfigError(
            f"{where} does not exist: create it on the local NVMe drive first (DeepSpeed would create a missing "
            "folder wherever the path points, e.g. on the root disk after a typo)"
        )
    if not os.path.isdir(path):
        raise ConfigError(f"{where} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable by this user: DeepSpeed writes its swap files there")
    ranks_here = ranks_on_node
    if num_params:
        per_rank = nvme_swapped_bytes_per_rank(
            num_params,
            world_size,
            precision,
            params_on_nvme="offload_param" in nvme_sections(zero),
            optimizer_on_nvme="offload_optimizer" in nvme_sections(zero) and zero.get("stage") == 3,
        )
        needed, what = ranks_here * per_rank, f"the swapped states of {num_params:,} parameters"
    else:
        needed, what = ranks_here * MIN_SWAPPED_BYTES, "one swapped tensor per rank"
    free = shutil.disk_usage(path).free
    if free < needed:
        raise ConfigError(
            f"{where} has {free / 1e9:.3g} GB free, less than {needed / 1e9:.3g} GB for {what} on {ranks_here} "
            "rank(s) of this node: free space there or point nvme_path at a larger drive"
        )


def check_nvme_storage(
    zero: dict[str, Any], precision: str, num_params: int | None, world_size: int, ranks_on_node: int
) -> None:
    """On this machine: every NVMe folder usable (:func:`check_nvme_folder`) and DeepSpeed's async I/O op buildable.

    Nothing is created or written: a run refused here leaves no file behind. Arguments as for
    :func:`check_nvme_folder`; without an NVMe section there is nothing to check.

    Raises:
        ConfigError: a folder refused by :func:`check_nvme_folder`, or libaio missing.
    """
    if not nvme_sections(zero):
        return
    for path in dict.fromkeys(str(zero[s]["nvme_path"]) for s in nvme_sections(zero)):
        check_nvme_folder(path, zero, precision, num_params, world_size, ranks_on_node)
    problem = async_io_problem()
    if problem:
        raise ConfigError(f"NVMe offload: {problem}")
