"""Offload tiers: bytes moved per optimizer step to host memory and NVMe, and the time they take at typical
bandwidths."""

from __future__ import annotations

import math

from common.errors import ConfigError, nearest
from common.memory_formulas.activations import FP32
from common.memory_formulas.model_states import WORKING_BYTES
from common.memory_formulas.units import GB

# DeepSpeed swaps a tensor to NVMe only when it has at least this many bytes (MIN_AIO_BYTES, 1 MiB; or
# aio.block_size when larger): smaller partitions stay in host RAM.
MIN_SWAPPED_BYTES = 2**20


def swap_threshold_bytes(block_size: float | None) -> int:
    """The fewest bytes DeepSpeed swaps to NVMe: max(1 MiB, ``aio.block_size``); smaller tensors stay in RAM."""
    return int(max(MIN_SWAPPED_BYTES, block_size or 0))


# Typical bandwidth of each tier in GB/s (1e9 bytes/s), as (low, high): each tier down is about an order of magnitude
# slower (HBM, DRAM, PCIe x16 3.0-4.0, NVMe SSD).
GUIDE_BANDWIDTH_GBPS: dict[str, tuple[float, float]] = {
    "hbm": (1000.0, 2000.0),
    "dram": (50.0, 100.0),
    "pcie": (16.0, 32.0),
    "nvme": (2.0, 4.0),
}
LINKS = tuple(GUIDE_BANDWIDTH_GBPS)
# Links the ranks of a node share, so that their bytes add up: host memory and the node's NVMe drives. Each
# device has a PCIe link (and HBM) of its own.
NODE_SHARED_LINKS = ("dram", "nvme")
FP32_MASTER_AND_MOMENTS = 12  # bytes per parameter: Adam's fp32 master copy, m and v


def nvme_swapped_bytes_per_rank(
    num_params: int, world_size: int, precision: str, params_on_nvme: bool, optimizer_on_nvme: bool
) -> float:
    """Bytes one rank's swap files hold under stage-3 NVMe offload (ZeRO-Infinity), before alignment padding.

    Parameters: the rank's 16-bit (fp32: 4-byte) partition. Optimizer: the fp32 master copy, m and v (12 B) and
    the fp32 gradients DeepSpeed swaps out during the backward pass (4 B), of the rank's partition. Stages 1-2
    never swap (DeepSpeed 0.19 treats their ``device: nvme`` as CPU offload).
    """
    partition = math.ceil(num_params / world_size)
    total = 0.0
    if params_on_nvme:
        total += WORKING_BYTES[precision] * partition
    if optimizer_on_nvme:
        total += (FP32_MASTER_AND_MOMENTS + FP32) * partition
    return total


def offload_traffic(
    num_params: int, stage: int, offload: str, world_size: int, precision: str = "bf16", grad_accum: int = 1
) -> dict[str, dict[str, float]]:
    """Bytes one optimizer step moves per rank across each offload link, term by term: ``{link: {what: bytes}}``.

    k = the rank's partition (K/N elements; stage 0 has no offload), P = working bytes, A = micro-batches per
    optimizer step. ``offload``:

    - ``optimizer`` (ZeRO-Offload): PCIe carries the gradient partition to host RAM every micro-batch (A P k)
      and the updated 16-bit parameters back (P k); host RAM serves DeepSpeedCPUAdam, which reads the fp32
      master, m, v and gradient (16 k) and writes master, m, v and the 16-bit copy ((12 + P) k), plus the
      gradients landing in fp32 (4 A k).
    - ``params`` (stage 3): also the parameter partition fetched to the device before each all-gather, in the
      forward and the backward pass (2 A P k over PCIe, read from host RAM).
    - ``nvme`` (stage 3, ZeRO-Infinity, ``max_in_cpu: 0``): PCIe and host RAM as ``params``; the node's NVMe
      reads the parameters for each fetch (2 A P k), the master, m and v (12 k) and the fp32 gradients (4 k),
      and writes the updated parameters (P k), master, m and v (12 k) and the gradients (4 A k).

    An upper estimate of the unavoidable traffic: caching and prefetch can save re-reads, nothing here is
    counted twice. ``none`` moves nothing over these links (HBM traffic is not an offload cost).
    """
    if offload not in ("optimizer", "params", "nvme") or stage == 0:
        return {}
    if offload in ("params", "nvme") and stage != 3:
        raise ConfigError(f"{offload} offload needs ZeRO stage 3, got stage {stage}")
    k = math.ceil(num_params / world_size)
    p, a = WORKING_BYTES[precision], grad_accum
    pcie = {"gradients to host": a * p * k, "updated parameters back": p * k}
    dram = {
        "CPU Adam reads master, m, v, gradients": (FP32_MASTER_AND_MOMENTS + FP32) * k,
        "CPU Adam writes master, m, v, 16-bit copy": (FP32_MASTER_AND_MOMENTS + p) * k,
        "gradients land in fp32": FP32 * a * k,
    }
    traffic: dict[str, dict[str, float]] = {"pcie": pcie, "dram": dram}
    if offload in ("params", "nvme"):
        pcie["parameter fetches, forward and backward"] = 2 * a * p * k
        dram["parameter fetches, forward and backward"] = 2 * a * p * k
    if offload == "nvme":
        traffic["nvme"] = {
            "parameter reads, forward and backward": 2 * a * p * k,
            "updated parameters written": p * k,
            "master, m, v read and written": 2 * FP32_MASTER_AND_MOMENTS * k,
            "fp32 gradients written and read": FP32 * (a + 1) * k,
        }
    return {link: {what: float(n) for what, n in terms.items()} for link, terms in traffic.items()}


def link_seconds(
    traffic: dict[str, dict[str, float]], ranks_per_node: int, bandwidth_gbps: dict[str, float]
) -> dict[str, float]:
    """Seconds each link needs for one optimizer step's bytes: per rank on PCIe, the node's sum on shared links."""
    seconds = {}
    for link, terms in traffic.items():
        sharing = ranks_per_node if link in NODE_SHARED_LINKS else 1
        seconds[link] = sum(terms.values()) * sharing / (bandwidth_gbps[link] * GB)
    return seconds


def link_seconds_range(
    traffic: dict[str, dict[str, float]], ranks_per_node: int, bandwidth_gbps: dict[str, tuple[float, float]]
) -> tuple[dict[str, tuple[float, float]], str]:
    """Each link's seconds at the high and at the low end of its bandwidth range, and the slowest link (the step's
    floor when every transfer overlaps compute and the others): the planner's time column."""
    fast = link_seconds(traffic, ranks_per_node, {k: v[1] for k, v in bandwidth_gbps.items()})
    slow = link_seconds(traffic, ranks_per_node, {k: v[0] for k, v in bandwidth_gbps.items()})
    return {link: (fast[link], slow[link]) for link in traffic}, max(slow, key=slow.__getitem__)


def parse_bandwidths(items: list[str] | None) -> dict[str, tuple[float, float]]:
    """The typical bandwidth table, with ``link=GB/s`` items (``nvme=3.2``) replacing a link's range by one figure."""
    table = dict(GUIDE_BANDWIDTH_GBPS)
    for item in items or []:
        link, sep, value = str(item).partition("=")
        link = link.strip().lower()
        if not sep or link not in table:
            raise ConfigError(
                f"--bandwidth takes LINK=GB/s with LINK one of {', '.join(LINKS)}, got {item!r}{nearest(link, LINKS)}"
            )
        try:
            gbps = float(value)
        except ValueError:
            gbps = -1.0
        if not gbps > 0 or math.isinf(gbps):
            raise ConfigError(f"--bandwidth {link}: GB/s must be a positive number, got {value!r}")
        table[link] = (gbps, gbps)
    return table
