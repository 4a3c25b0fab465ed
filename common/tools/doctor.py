"""``zero-recipes doctor``: check the stack and the machine before a run, measure the collectives, explain a hang.

    zero-recipes doctor                                   versions and known-bad pairs, hardware, NCCL settings
    torchrun --nproc_per_node 2 -m common.tools.doctor --collectives      launched like a recipe (any launcher,
                                                          any number of nodes): bus bandwidth, per-rank speed
    zero-recipes doctor --hang runs/nlp                   which rank fell behind, the first collective they disagree on

The first two print one table and write ``doctor.json`` (and, with ``--collectives``, ``doctor_ranks.png``) into
``--out``. The checks are the ones practitioners run by hand before a ZeRO run: the cluster's setup (NCCL >= 2.10,
``NCCL_ALGO=Tree`` across nodes, SHARP off on some topologies, fused Adam needs CUDA >= 11), the hardware (ZeRO-3 on
PCIe 3.0 spends over half its time communicating; ``NCCL_DEBUG=INFO``; the old version pairs), the network (below
25 Gbps between nodes prefer stage 2 to stage 3), a sudden slowdown (congestion or a collective deadlock), and slow
ranks (a few hold back every all-gather, since each collective waits for the last rank). Each finding has a severity,
a fix and its source (the kind of advice, a lint rule or the upstream issue).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from common.communication import BUS_FACTOR
from common.errors import ConfigError, exit_on_user_error, nearest
from common.hang import HANG_FOLDER, analyze, format_diagnosis, rank_line, read_reports
from common.lint import RULES, LintView
from common.memory_formulas import parse_bytes
from common.nvme_storage import async_io_problem
from common.process_setup import end_process_group
from common.tools.options import positive_int, refuse_outside_mode
from common.version_window import OutsideWindow, installed_outside_window

PACKAGES = ("torch", "deepspeed", "lightning", "accelerate", "transformers", "peft")
SEVERITIES = ("error", "warning", "info", "ok")
SLOW_RANK_RATIO = 0.9  # a rank more than 10 % behind the median is named
STAGE3_MIN_GBPS = 25.0  # rule of thumb: below this between nodes, stage 2 rather than 3
MB = 1 << 20


@dataclass(frozen=True)
class Check:
    """One finding: what, how bad, what to do, and where the knowledge comes from."""

    check_id: str
    severity: str
    message: str
    fix: str
    source: str


@dataclass(frozen=True)
class KnownBad:
    """A version range of ``package`` that breaks a ZeRO run when ``needs`` is installed too."""

    check_id: str
    package: str
    versions: str
    needs: str | None
    severity: str
    message: str
    fix: str
    source: str


KNOWN_BAD = (
    KnownBad(
        "deepspeed-8072-zero3-peft-bf16",
        "deepspeed",
        "==0.19.2",
        "peft",
        "error",
        "ZeRO-3 with a PEFT LoRA adapter on a bf16 model fails at the first optimizer step (TypeError: output "
        "tensor must have the same type as input tensor, in _allgather_params_coalesced)",
        "pip install 'deepspeed>=0.19.3' (fixed by DeepSpeed #8073), or get_peft_model(..., "
        "autocast_adapter_dtype=False)",
        "DeepSpeed #8072",
    ),
    KnownBad(
        "deepspeed-8148-frozen-recompute",
        "deepspeed",
        "<0.19.3",
        "peft",
        "warning",
        "ZeRO-3 with frozen parameters (LoRA) and non-reentrant activation checkpointing: the recompute finds frozen "
        "parameters already re-partitioned (CheckpointError, recomputed shape [0])",
        "pip install 'deepspeed>=0.19.3' (DeepSpeed #8148); tests/distributed/test_frozen_partition.py checks that "
        "no frozen parameter stays gathered with it",
        "DeepSpeed #8148",
    ),
)

# The old version pairs practitioners report are lint rules already (docs/troubleshooting.md).
GUIDE_VERSION_RULES = ("torch-zero-memory-leak", "deepspeed-0.6-zero3-sync", "nccl-version")

# Environment variables that cluster set-up advice (and torch's hang tooling) speak of, with what to do about each.
ENV_ADVICE = {
    "NCCL_ALGO": "Tree is better across nodes (NCCL_ALGO=Tree); on one node leave NCCL's choice",
    "NCCL_COLLNET_ENABLE": "SHARP (CollNet) slows some topologies: 0 turns it off if all-reduce is slow",
    "NCCL_SHARP_DISABLE": "SHARP slows some topologies: 1 turns it off if all-reduce is slow",
    "NCCL_DEBUG": "INFO prints each communicator's topology and algorithm; unset it for production runs",
    "NCCL_P2P_DISABLE": "1 sends GPU-to-GPU traffic through host memory: much slower, for debugging only",
    "NCCL_IB_DISABLE": "1 keeps InfiniBand unused (sockets instead): slower than 25 Gbps on most clusters",
    "NCCL_SOCKET_IFNAME": "the interface NCCL uses between nodes; a wrong one hangs the first collective",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "a deadlock must fail, not hang: torch's default (3) does; 0 turns it off",
    "TORCH_DISTRIBUTED_DEBUG": "DETAIL checks every collective's op and shapes across ranks before it runs (names a "
    "desync exactly; its cost per step: docs/benchmarks.md, hang-overhead)",
    "TORCH_FR_BUFFER_SIZE": "torch's flight recorder, which a hang report reads; 0 turns it off",
    "CUDA_LAUNCH_BLOCKING": "1 serialises every kernel: for debugging only",
}


# --- environment: versions and known-bad pairs (pure) -----------------------------------------------------


def installed_versions() -> dict[str, str]:
    """Package versions (metadata, no import), with CUDA and NCCL from torch; absent packages left out."""
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        versions["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    return versions


def lightning_deepspeed_pin() -> str | None:
    """The DeepSpeed versions Lightning's own requirements accept (its ``pytorch-strategies`` extra)."""
    try:
        requires = metadata.requires("lightning") or []
    except metadata.PackageNotFoundError:
        return None
    for text in requires:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.name == "deepspeed":
            return str(requirement.specifier)
    return None


def deepspeed_clipping_default() -> float | None:
    """DeepSpeed's ``gradient_clipping`` when a config leaves it out (0 before DeepSpeed #8068, 1.0 after)."""
    try:
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT  # imports DeepSpeed: only when asked
    except ImportError:
        return None
    return float(GRADIENT_CLIPPING_DEFAULT)


def _in(version: str | None, specifier: str) -> bool:
    if not version:
        return False
    try:
        return Version(version) in SpecifierSet(specifier)
    except InvalidVersion:
        return False


def version_checks(
    versions: dict[str, str],
    lightning_pin: str | None = None,
    clipping_default: float | None = None,
    tested_lightning: str | None = None,
) -> list[Check]:
    """Findings on a set of installed versions: known-bad pairs, pins, changed defaults, old reported pairs.

    Args:
        versions: package -> version (``torch``, ``deepspeed``, ``lightning``, ``peft``, ``nccl``, ...).
        lightning_pin: the DeepSpeed specifier Lightning's requirements name (:func:`lightning_deepspeed_pin`).
        clipping_default: DeepSpeed's default ``gradient_clipping`` (:func:`deepspeed_clipping_default`).
        tested_lightning: the Lightning range ``common.lightning_cpu`` is tested with.
    """
    checks = []
    for bad in KNOWN_BAD:
        if _in(versions.get(bad.package), bad.versions) and (bad.needs is None or bad.needs in versions):
            found = f"{bad.package} {versions[bad.package]}" + (
                f" with {bad.needs} {versions[bad.needs]}" if bad.needs else ""
            )
            checks.append(Check(bad.check_id, bad.severity, f"{found}: {bad.message}", bad.fix, bad.source))
    deepspeed, lightning = versions.get("deepspeed"), versions.get("lightning")
    if lightning and deepspeed and lightning_pin and not _in(deepspeed, lightning_pin):
        checks.append(
            Check(
                "lightning-deepspeed-pin",
                "warning",
                f"lightning {lightning} pins deepspeed{lightning_pin} for its DeepSpeed strategy; "
                f"deepspeed {deepspeed} is installed",
                "keep it if tests/distributed/test_zero_cpu.py passes (common.lightning_cpu runs ZeRO through "
                f"Lightning with it), else pip install 'deepspeed{lightning_pin}'",
                "Lightning's requirements (extra pytorch-strategies)",
            )
        )
    if lightning and tested_lightning and not _in(lightning, tested_lightning):
        checks.append(
            Check(
                "lightning-untested",
                "warning",
                f"lightning {lightning} is outside the versions common.lightning_cpu is tested with "
                f"({tested_lightning})",
                "run tests/distributed/test_zero_cpu.py, or pip install 'lightning" + tested_lightning + "'",
                "common/lightning_cpu.py",
            )
        )
    if clipping_default:
        checks.append(
            Check(
                "deepspeed-8068-clipping-default",
                "info",
                f"deepspeed {deepspeed}: a config without gradient_clipping is clipped at {clipping_default:g} "
                "(before DeepSpeed #8068 it was not clipped at all)",
                "write gradient_clipping explicitly (the factory always does; 0 turns clipping off)",
                "DeepSpeed #8068",
            )
        )
    guide_view = LintView(ds_config={"zero_optimization": {"stage": 3}}, versions=versions)  # the worst case: ZeRO-3
    for rule_id in GUIDE_VERSION_RULES:
        for finding in RULES[rule_id](guide_view):
            checks.append(Check(finding.rule_id, finding.severity, finding.message, finding.fix, "lint rule"))
    if versions.get("cuda") and _in(versions["cuda"], "<11"):
        checks.append(
            Check(
                "fused-adam-cuda",
                "warning",
                f"CUDA {versions['cuda']}: DeepSpeed's fused Adam needs CUDA 11.0 or newer",
                "a PyTorch build for CUDA >= 11",
                "DeepSpeed's requirements",
            )
        )
    return checks


def window_checks(outside: list[OutsideWindow]) -> list[Check]:
    """A warning per package outside the window this project is tested with (:mod:`common.version_window`), or one
    ``ok`` line when every package is inside it."""
    if not outside:
        return [
            Check(
                "tested-window",
                "ok",
                "every package of the tested window is inside it",
                "none",
                "pyproject.toml: the requirements with two bounds",
            )
        ]
    return [
        Check(
            "tested-window",
            "warning",
            f"{item.package} {item.version or 'is not installed'}"
            + (f" is outside the versions this project is tested with ({item.specifier})" if item.version else ""),
            f"pip install '{item.package}{item.specifier}' (CI runs the suite at the newest versions inside the "
            "window and a compatibility subset at its lower bounds)",
            "pyproject.toml: the requirements with two bounds",
        )
        for item in outside
    ]


# --- hardware (never fails: "not found" where a fact is not available) -----------------------------------


def _run(args: list[str]) -> str | None:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _meminfo() -> dict[str, int]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        name, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            values[name] = int(rest.split()[0]) * 1024
    return values


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "not found"


def _free_disk(path: Path) -> int | None:
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


# nvidia-smi's fields, in the order parse_pcie_query reads them. The link's maximum generation is what decides the
# advice: an idle GPU trains its link down (an H200 at rest reports gen 1), so the current one says how busy the
# GPU is, not what it can move.
PCIE_QUERY = ("index", "pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max")
PCIE_KEYS = ("pcie_gen_current", "pcie_gen_max", "pcie_width_current", "pcie_width_max")


def parse_pcie_query(text: str, gpu_count: int) -> dict[int, dict[str, str]]:
    """GPU index -> its PCIe fields (:data:`PCIE_KEYS`), from ``nvidia-smi --query-gpu`` of :data:`PCIE_QUERY` in
    ``csv,noheader,nounits`` form; rows of an unknown index or another shape are left out, cells kept as text
    (``[N/A]`` where a virtual machine hides the link)."""
    links = {}
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == len(PCIE_QUERY) and cells[0].isdigit() and int(cells[0]) < gpu_count:
            links[int(cells[0])] = dict(zip(PCIE_KEYS, cells[1:]))
    return links


def pcie_text(gpu: dict[str, Any]) -> str:
    """``gen 5 x16 (now gen 1 x16)``: the link's maximum, and what it runs at while the doctor looks."""
    best = f"gen {gpu.get('pcie_gen_max', '?')} x{gpu.get('pcie_width_max', '?')}"
    now = f"gen {gpu.get('pcie_gen_current', '?')} x{gpu.get('pcie_width_current', '?')}"
    return best if now == best else f"{best} (now {now})"


def gpu_facts() -> list[dict[str, Any]]:
    """Per GPU: name, memory, PCIe generation and width, maximum and current (nvidia-smi where present)."""
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "memory_bytes": props.total_memory})
    query = _run(["nvidia-smi", f"--query-gpu={','.join(PCIE_QUERY)}", "--format=csv,noheader,nounits"])
    for index, link in parse_pcie_query(query or "", len(gpus)).items():
        gpus[index].update(link)
    return gpus


def nvlink_state() -> str:
    status = _run(["nvidia-smi", "nvlink", "--status"])
    if status is None:
        return "not found (no nvidia-smi)"
    links = re.findall(r"Link \d+: ([\d.]+ GB/s)", status)
    return f"{len(links)} active link(s), {links[0]} each" if links else "not found"


def infiniband_state() -> str:
    root = Path("/sys/class/infiniband")
    if not root.is_dir():
        return "not found"
    rates = []
    for rate in sorted(root.glob("*/ports/*/rate")):
        try:
            rates.append(f"{rate.parts[-4]}: {rate.read_text().strip()}")
        except OSError:
            continue
    return "; ".join(rates) or "not found"


def hardware_facts(checkpoint_path: Path) -> dict[str, Any]:
    """Devices, links, host RAM and free disk at the checkpoint path."""
    memory = _meminfo()
    gpus = gpu_facts()
    return {
        "accelerator": f"{len(gpus)} GPU(s)" if gpus else "no GPU",
        "gpus": gpus,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "host_ram_bytes": memory.get("MemTotal"),
        "host_ram_available_bytes": memory.get("MemAvailable"),
        "checkpoint_path": str(checkpoint_path),
        "checkpoint_free_bytes": _free_disk(checkpoint_path),
        "nvlink": nvlink_state() if gpus else "not found (no GPU)",
        "infiniband": infiniband_state(),
        "hostname": socket.gethostname(),
    }


def hardware_checks(hardware: dict[str, Any]) -> list[Check]:
    checks = []
    for gpu in hardware["gpus"]:
        gen = gpu.get("pcie_gen_max")  # not the current one, which an idle GPU drops to gen 1
        if gen and gen.isdigit() and int(gen) < 4:
            checks.append(
                Check(
                    "pcie-3-zero3",
                    "warning",
                    f"GPU {gpu['index']}'s link reaches PCIe {pcie_text(gpu)} at most: ZeRO-3 on PCIe 3.0 "
                    "spends over half its time communicating",
                    "prefer ZeRO-2 (preset=deepspeed_stage_2) or a PCIe 4.0+ / NVLink machine",
                    "practitioners' reports",
                )
            )
    return checks


def env_settings(environ: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The NCCL- and hang-related variables: each one's value (or unset) and the advice on it."""
    environ = dict(os.environ) if environ is None else environ
    names = sorted(set(ENV_ADVICE) | {k for k in environ if k.startswith("NCCL_")})
    return [
        {"name": name, "value": environ.get(name, "unset"), "advice": ENV_ADVICE.get(name, "NCCL setting")}
        for name in names
    ]


# --- measured across ranks (--collectives) ----------------------------------------------------------------

# The collectives --collectives times: ZeRO's three (nccl-tests' bus factors from the communication account).
MEASURED_OPS = ("all_reduce", "all_gather", "reduce_scatter")
# The buffers --collectives times, by the dtype names the planner gives its transfers (common.communication): a
# backend may move one dtype slower than another per byte (gloo reduces bf16 on a CPU slower than fp32).
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bus_bandwidth(op: str, message_bytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in bytes/s of one collective over ``message_bytes`` (the whole buffer), as nccl-tests report it."""
    return message_bytes / seconds * BUS_FACTOR[op](world_size)


def slow_ranks(speeds: list[float], ratio: float = SLOW_RANK_RATIO) -> list[int]:
    """Ranks whose speed is below ``ratio`` x the median (a few slow ranks hold back all of them)."""
    median = statistics.median(speeds)
    return [rank for rank, speed in enumerate(speeds) if speed < ratio * median]


def stage_advice(inter_node_gbps: float | None) -> Check:
    if inter_node_gbps is None:
        return Check(
            "inter-node-bandwidth",
            "info",
            "one node: the inter-node rule of thumb (below 25 Gbps prefer ZeRO-2) does not apply",
            "measure again on the nodes of the real run",
            "rule of thumb",
        )
    if inter_node_gbps < STAGE3_MIN_GBPS:
        return Check(
            "inter-node-bandwidth",
            "warning",
            f"measured {inter_node_gbps:.1f} Gbps between nodes, below the 25 Gbps ZeRO-3 needs",
            "ZeRO-2 rather than ZeRO-3 (preset=deepspeed_stage_2), or a faster interconnect",
            "rule of thumb",
        )
    return Check(
        "inter-node-bandwidth",
        "ok",
        f"measured {inter_node_gbps:.1f} Gbps between nodes: at or above the 25 Gbps ZeRO-3 needs",
        "none",
        "rule of thumb",
    )


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def buffer_elements(message_bytes: int, world: int, dtype: str) -> int:
    """Elements of ``dtype`` in a collective's buffer of about ``message_bytes``, divisible by the world size."""
    element = torch.tensor([], dtype=TORCH_DTYPES[dtype]).element_size()
    return max(world, message_bytes // element // world * world)


# Each timed call takes its buffers from a pool larger than a CPU's last-level cache, a different slot each call, so
# that its data comes from memory as a training step's does (gradients and parameters last written a layer's compute
# earlier). One buffer timed back to back runs from cache: on a CPU (gloo) that was measurably faster than the same
# collective's calls inside a training step, which priced communication too low.
BUFFER_POOL_BYTES = 64 * 2**20


# The timed calls run in rounds, each timed whole, and a collective's figure is the median round's time per call: on a
# shared machine one burst of other work inflates a mean of all the calls (a training step is judged by its median).
TIMING_ROUNDS = 5


def buffer_slots(buffer_bytes: int, pool_bytes: int = BUFFER_POOL_BYTES) -> int:
    """How many buffers of ``buffer_bytes`` the rotation cycles through: enough to fill ``pool_bytes``."""
    return max(1, -(-pool_bytes // max(1, buffer_bytes)))


def _time_collective(
    op: str, message_bytes: int, iters: int, device: torch.device, group: Any = None, dtype: str = "fp32"
) -> float:
    """Seconds per call on a buffer of ``message_bytes`` holding ``dtype``, the slowest rank's (a collective ends when
    its last rank does), the median of :data:`TIMING_ROUNDS` rounds of ``iters`` calls in all; each call on buffers
    not touched since the pool was filled (:data:`BUFFER_POOL_BYTES`)."""
    world = dist.get_world_size(group)
    count = buffer_elements(message_bytes, world, dtype)
    element = torch.tensor([], dtype=TORCH_DTYPES[dtype]).element_size()
    slots = min(buffer_slots(count * element), iters + 1)  # no more slots than calls: each call a fresh one
    fulls = torch.ones(slots, count, device=device, dtype=TORCH_DTYPES[dtype])
    shards = torch.ones(slots, count // world, device=device, dtype=TORCH_DTYPES[dtype])

    def once(call: int) -> None:
        full, shard = fulls[call % slots], shards[call % slots]
        if op == "all_reduce":
            dist.all_reduce(full, group=group)
        elif op == "all_gather":
            dist.all_gather_into_tensor(full, shard, group=group)
        else:
            dist.reduce_scatter_tensor(shard, full, group=group)

    once(slots - 1)  # warm-up: the slot the timed calls reach last (or never)
    _sync(device)
    rounds = min(TIMING_ROUNDS, iters)
    per_round = iters // rounds
    seconds = []
    for first in range(0, rounds * per_round, per_round):
        dist.barrier(group=group)
        start = time.perf_counter()
        for call in range(first, first + per_round):
            once(call)
        _sync(device)
        seconds.append((time.perf_counter() - start) / per_round)
    elapsed = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # each round ends when its slowest rank does
    return float(elapsed.median())  # torch's lower median: a round a neighbour's burst slowed does not count


def _matmul_speed(device: torch.device, reps: int = 3) -> float:
    """This rank's speed on a fixed matmul, GFLOP/s, the best of ``reps`` (others' load on a shared machine)."""
    size, iters = (4096, 20) if device.type == "cuda" else (512, 20)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = 0.0
    for _ in range(reps):
        dist.barrier()  # all ranks compute at once, as in training
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b)
        _sync(device)
        best = max(best, 2 * size**3 * iters / (time.perf_counter() - start) / 1e9)
    return best


def _node_of_each_rank() -> list[str]:
    """A node name per rank: host plus the launcher's node index (several "nodes" may share one host in tests)."""
    node_index = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK") or os.environ.get("SLURM_NODEID") or "0"
    mine = f"{socket.gethostname()}#{node_index}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def measure_collectives(sizes_bytes: list[int], iters: int, dtypes: tuple[str, ...] = ("fp32",)) -> dict[str, Any]:
    """Every rank calls this inside a process group: bandwidths (per dtype of the buffer, each row naming its
    ``dtype``), per-rank speed, the slow ranks, the stage advice."""
    device = _device()
    world = dist.get_world_size()
    nodes = _node_of_each_rank()
    rows = []
    for dtype in dtypes:
        for op in MEASURED_OPS:
            for size in sizes_bytes:
                seconds = _time_collective(op, size, iters, device, dtype=dtype)
                busbw = bus_bandwidth(op, size, seconds, world)
                rows.append(
                    {
                        "op": op,
                        "dtype": dtype,
                        "elements": buffer_elements(size, world, dtype),
                        "bytes": size,
                        "seconds": seconds,
                        "busbw_GBps": busbw / 1e9,
                        "busbw_Gbps": busbw * 8 / 1e9,
                    }
                )
    leaders = sorted({nodes.index(node) for node in nodes})  # the first rank of each node
    inter_node_gbps = None
    if len(leaders) > 1:
        group = dist.new_group(leaders)
        if dist.get_rank() in leaders:
            size = max(sizes_bytes)
            seconds = _time_collective("all_reduce", size, iters, device, group)
            inter_node_gbps = bus_bandwidth("all_reduce", size, seconds, len(leaders)) * 8 / 1e9
        carried: list[Any] = [None] * world
        dist.all_gather_object(carried, inter_node_gbps)
        inter_node_gbps = carried[0]
    speed = _matmul_speed(device)
    speeds: list[Any] = [None] * world
    dist.all_gather_object(speeds, speed)
    return {
        "world_size": world,
        "backend": dist.get_backend(),
        "nodes": nodes,
        "collectives": rows,
        "buffer_pool_bytes": BUFFER_POOL_BYTES,  # each timed call on buffers from a pool this large
        "inter_node_Gbps": inter_node_gbps,
        "matmul_gflops": speeds,
        "slow_ranks": slow_ranks(speeds),
        "median_gflops": statistics.median(speeds),
    }


def collective_checks(measured: dict[str, Any]) -> list[Check]:
    checks = [stage_advice(measured["inter_node_Gbps"])]
    median = measured["median_gflops"]
    for rank in measured["slow_ranks"]:
        speed = measured["matmul_gflops"][rank]
        checks.append(
            Check(
                "slow-rank",
                "warning",
                f"rank {rank} ({measured['nodes'][rank]}) computes {speed:.1f} GFLOP/s, {1 - speed / median:.0%} "
                f"behind the median {median:.1f}: every collective waits for it",
                "look at that device (clocks, temperature, other processes on it) or leave its node out",
                "synchronous collectives",
            )
        )
    if not measured["slow_ranks"]:
        checks.append(
            Check(
                "slow-rank", "ok", "no rank more than 10 % behind the median speed", "none", "synchronous collectives"
            )
        )
    return checks


def plot_rank_speeds(measured: dict[str, Any], path: Path) -> Path | None:
    """A bar per rank (GFLOP/s on the fixed matmul), the slow ones in red, the median and the 10 % line."""
    try:
        import matplotlib  # optional: only the picture needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    speeds, slow = measured["matmul_gflops"], set(measured["slow_ranks"])
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(speeds) + 2), 3))
    ax.bar(range(len(speeds)), speeds, color=["tab:red" if r in slow else "tab:blue" for r in range(len(speeds))])
    ax.axhline(measured["median_gflops"], color="black", lw=1, label="median")
    ax.axhline(SLOW_RANK_RATIO * measured["median_gflops"], color="gray", ls="--", lw=1, label="10 % behind")
    ax.set_xlabel("rank")
    ax.set_ylabel("GFLOP/s (fixed matmul)")
    ax.set_xticks(range(len(speeds)))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --- printing ---------------------------------------------------------------------------------------------


# --- DeepSpeed's compiled ops -------------------------------------------------------------------------------

# The ops DeepSpeed compiles with this machine's compiler the first time a run needs one (then cached under
# ~/.cache/torch_extensions): class name on DeepSpeed's accelerator -> what needs it. A run that meets one unbuilt
# spends the build inside its first step: about 40 s each for the first two on a 2-core machine, several minutes
# for the async I/O op.
DEEPSPEED_OPS = {
    "ShareMemCommBuilder": "DeepSpeed's collectives between processes of one CPU machine (every run on a CPU)",
    "CPUAdamBuilder": "optimizer offload to the CPU (the *_offload presets)",
    "AsyncIOBuilder": "NVMe offload (deepspeed_stage_3_offload_nvme)",
}


@dataclass(frozen=True)
class OpBuild:
    """What ``doctor --build-ops`` did with one of DeepSpeed's compiled ops.

    Attributes:
        name: the op's name (DeepSpeed's, also its folder in the extensions cache).
        needed_for: what needs the op.
        status: ``ready`` (built or found built, and loaded), ``unavailable`` (this machine cannot build it: see
            ``detail``) or ``failed`` (the build or the load raised).
        seconds: time to build (or find) and load it.
        detail: why it is unavailable or failed; empty when ready.
    """

    name: str
    needed_for: str
    status: str
    seconds: float
    detail: str = ""


def build_deepspeed_op(class_name: str, needed_for: str) -> OpBuild | None:
    """Build (or find built) and load one of DeepSpeed's ops for this machine's accelerator.

    Returns:
        What happened, or None when this accelerator has no such op (the shared-memory collectives exist on a CPU
        alone).
    """
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; the report owns it
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder(class_name)
        if builder is None:
            return None
        start = time.perf_counter()
        if not builder.is_compatible(verbose=False):
            why = async_io_problem() if class_name == "AsyncIOBuilder" else None
            return OpBuild(builder.NAME, needed_for, "unavailable", 0.0, why or "DeepSpeed finds it incompatible here")
        try:
            builder.load(verbose=False)
        except Exception as exc:  # a compiler's failure: one line of it, the build log is DeepSpeed's to print
            lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
            return OpBuild(builder.NAME, needed_for, "failed", time.perf_counter() - start, lines[-1].strip())
    return OpBuild(builder.NAME, needed_for, "ready", time.perf_counter() - start)


def render_op_builds(builds: list[OpBuild]) -> str:
    """One line per op: name, status, seconds, what needs it, and why it is not ready."""
    # Imported here, not at the top: on a CUDA build of torch without a CUDA runtime, importing cpp_extension logs a
    # warning to stderr, and every tool that imports doctor (bench/gpu.py's one-line errors) would print it.
    from torch.utils.cpp_extension import get_default_build_root

    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # where torch builds them
    lines = [f"DeepSpeed's compiled ops (built once per machine, cached under {cache}):"]
    for build in builds:
        line = f"  {build.name:<20} {build.status:<11} {build.seconds:7.1f} s  {build.needed_for}"
        lines.append(line + (f"\n      {build.detail}" if build.detail else ""))
    return "\n".join(lines)


def cmd_build_ops() -> int:
    """``doctor --build-ops``: build and load every op a preset can need here; exit 1 if one failed to build."""
    builds = [b for name, use in DEEPSPEED_OPS.items() if (b := build_deepspeed_op(name, use)) is not None]
    print(render_op_builds(builds))
    return 1 if any(b.status == "failed" for b in builds) else 0


def _gb(value: float | None) -> str:
    return "not found" if value is None else f"{value / 2**30:.1f} GiB"


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def render_report(report: dict[str, Any]) -> str:
    """The one table ``zero-recipes doctor`` prints, from the ``doctor.json`` document."""
    hw = report["hardware"]
    versions = report["versions"]
    rows = [(name, versions.get(name, "not installed")) for name in PACKAGES]
    rows += [("cuda", versions.get("cuda", "none (a CPU build of torch)"))]
    rows += [("nccl", versions.get("nccl", "not used (no GPU)"))]
    rows += [
        ("accelerator", hw["accelerator"]),
        *[
            (
                f"gpu {g['index']}",
                f"{g['name']}, {_gb(g['memory_bytes'])}, PCIe {pcie_text(g)}",
            )
            for g in hw["gpus"]
        ],
        ("cpu", f"{hw['cpu_model']} ({hw['cpus_usable']} of {hw['cpu_count']} cores usable)"),
        ("host RAM", f"{_gb(hw['host_ram_bytes'])} ({_gb(hw['host_ram_available_bytes'])} available)"),
        ("free disk", f"{_gb(hw['checkpoint_free_bytes'])} at {hw['checkpoint_path']}"),
        ("NVLink", hw["nvlink"]),
        ("InfiniBand", hw["infiniband"]),
    ]
    lines = ["environment and hardware:", table(rows), "", "NCCL and hang-related settings:"]
    lines += [f"  {s['name']}={s['value']}  ({s['advice']})" for s in report["env"]]
    measured = report.get("measured")
    if measured:
        lines += [
            "",
            f"measured ({measured['world_size']} ranks, {measured['backend']}, nodes: {len(set(measured['nodes']))}):",
        ]
        lines.append("  op             dtype       bytes   time/call     bus bandwidth")
        for row in measured["collectives"]:
            lines.append(
                f"  {row['op']:<14} {row.get('dtype', 'fp32'):<5} {row['bytes']:>11,}  {row['seconds'] * 1e3:9.3f} ms  "
                f"{row['busbw_GBps']:8.3f} GB/s ({row['busbw_Gbps']:.2f} Gbps)"
            )
        speeds = ", ".join(f"rank {r}: {s:.1f}" for r, s in enumerate(measured["matmul_gflops"]))
        lines.append(f"  fixed matmul GFLOP/s: {speeds} (median {measured['median_gflops']:.1f})")
        if measured.get("inter_node_Gbps") is not None:
            lines.append(f"  between nodes (all-reduce, one rank per node): {measured['inter_node_Gbps']:.2f} Gbps")
    lines += ["", "findings:"]
    ordered = sorted(report["checks"], key=lambda c: SEVERITIES.index(c["severity"]))
    for check in ordered:
        lines.append(f"  {check['severity']:<7} [{check['check_id']}] {check['message']} ({check['source']})")
        if check["severity"] != "ok":
            lines.append(f"          fix: {check['fix']}")
    if not ordered:
        lines.append("  none")
    return "\n".join(lines)


# --- the command ----------------------------------------------------------------------------------------


def local_report(checkpoint_path: Path) -> dict[str, Any]:
    """What one process can find out: versions, findings on them, hardware, settings."""
    from common.lightning_cpu import TESTED_LIGHTNING  # imports Lightning and transformers: only for the doctor

    versions = installed_versions()
    hardware = hardware_facts(checkpoint_path)
    checks = version_checks(versions, lightning_deepspeed_pin(), deepspeed_clipping_default(), TESTED_LIGHTNING)
    checks += window_checks(installed_outside_window())
    checks += hardware_checks(hardware)
    return {"versions": versions, "hardware": hardware, "env": env_settings(), "checks": [asdict(c) for c in checks]}


def parse_sizes(text: str) -> list[int]:
    """``64KiB,1MiB,16MiB`` -> bytes (:func:`common.memory_formulas.parse_bytes`: KB/MB powers of 10, KiB/MiB of 2)."""
    sizes = []
    for item in text.split(","):
        try:
            sizes.append(int(parse_bytes(item)))
        except ConfigError:
            raise ConfigError(f"--sizes: {item.strip()!r} is not a size such as 64KiB, 1MiB or 16MiB") from None
    return sizes


def parse_dtypes(text: str) -> tuple[str, ...]:
    """``fp32,bf16`` -> ("fp32", "bf16"): the buffers ``--collectives`` times, each once.

    Raises:
        ConfigError: an unknown dtype (naming the nearest) or none at all.
    """
    names = [item.strip().lower() for item in text.split(",") if item.strip()]
    for name in names:
        if name not in TORCH_DTYPES:
            raise ConfigError(
                f"--dtypes: unknown dtype {name!r}{nearest(name, TORCH_DTYPES)}; use {', '.join(TORCH_DTYPES)}"
            )
    if not names:
        raise ConfigError(f"--dtypes: name at least one of {', '.join(TORCH_DTYPES)}")
    return tuple(dict.fromkeys(names))


# Options that one mode reads and the others do not (common/tools/options.py refuses them there).
COLLECTIVES_OPTIONS = {"sizes": "--sizes", "iters": "--iters", "dtypes": "--dtypes"}
REPORT_OPTIONS = {"out": "--out", "checkpoint_path": "--checkpoint-path"}  # the modes that write doctor.json
# fp32 and bf16 buffers: what the planner prices a bf16 run's gradients and parameters at, beside the fp32 figure.
DEFAULT_SIZES, DEFAULT_ITERS, DEFAULT_DTYPES = "64KiB,1MiB,16MiB", 10, "fp32,bf16"


def cmd_doctor(args: Any) -> int:
    if args.hang:
        refuse_outside_mode(args, COLLECTIVES_OPTIONS, "doctor --collectives", "doctor --hang")
        refuse_outside_mode(args, REPORT_OPTIONS, "doctor and doctor --collectives (the report)", "doctor --hang")
        return cmd_hang(Path(args.hang))
    if args.collectives:
        return cmd_collectives(args)
    refuse_outside_mode(args, COLLECTIVES_OPTIONS, "doctor --collectives", "doctor without --collectives")
    if args.build_ops:
        refuse_outside_mode(args, REPORT_OPTIONS, "doctor and doctor --collectives (the report)", "doctor --build-ops")
        return cmd_build_ops()
    out = Path(args.out or ".")
    report = local_report(Path(args.checkpoint_path or "."))
    print(render_report(report))
    out.mkdir(parents=True, exist_ok=True)
    (out / "doctor.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out / 'doctor.json'}")
    return 0


def cmd_collectives(args: Any) -> int:
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            "doctor --collectives measures across ranks: launch it like a recipe, e.g. "
            "torchrun --nproc_per_node 2 -m common.tools.doctor --collectives"
        )
    sizes = parse_sizes(args.sizes or DEFAULT_SIZES)
    dtypes = parse_dtypes(args.dtypes or DEFAULT_DTYPES)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        measured = measure_collectives(sizes, args.iters or DEFAULT_ITERS, dtypes)
        if dist.get_rank() != 0:
            return 0
        report = local_report(Path(args.checkpoint_path or "."))
        report["measured"] = measured
        report["checks"] += [asdict(c) for c in collective_checks(measured)]
        out = Path(args.out or ".")
        out.mkdir(parents=True, exist_ok=True)
        picture = plot_rank_speeds(measured, out / "doctor_ranks.png")
        print(render_report(report))
        (out / "doctor.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {out / 'doctor.json'}" + (f" and {picture}" if picture else ""))
        return 0
    finally:
        end_process_group()


def cmd_hang(run_dir: Path) -> int:
    """Read a hung run's reports again: the same diagnosis the run printed, and every rank's line."""
    hang_dir = run_dir / HANG_FOLDER if (run_dir / HANG_FOLDER).is_dir() else run_dir
    if not list(hang_dir.glob("rank*.json")) and not list(hang_dir.glob("rank*.crash.txt")):
        raise ConfigError(
            f"no hang reports in {hang_dir} (a run writes rankN.json there only when a collective fails; on NCCL "
            "torch also dumps its flight recorder to $TORCH_FR_DUMP_TEMP_FILE, by default ~/.cache/fr_trace/)"
        )
    try:
        reports, crashes = read_reports(hang_dir)
    except (ValueError, OSError) as err:
        raise ConfigError(f"cannot read the hang reports in {hang_dir}: {err}") from None
    print(format_diagnosis(analyze(reports, crashes), hang_dir))
    print("\nper rank (reason it stopped; where; last collective; step):")
    for rank, report in sorted(reports.items()):
        if report is None:
            print(f"  rank {rank}: no report" + (" (crash stacks in rank{rank}.crash.txt)" if rank in crashes else ""))
        else:
            print(f"  rank {rank}: {report.get('reason', '?')}\n          {rank_line(report)}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--collectives", action="store_true", help="measure across the launched ranks")
    mode.add_argument("--hang", metavar="RUN_DIR", default=None, help="diagnose a run that hung (its hang/ reports)")
    mode.add_argument(
        "--build-ops",
        action="store_true",
        help="build DeepSpeed's compiled ops now (once per machine; a run would otherwise build one in its first "
        "step): shows that the compiler works",
    )
    # Defaults are None so that an option given in a mode that does not read it is refused (cmd_doctor).
    p.add_argument("--out", default=None, help="folder for doctor.json (and doctor_ranks.png); default: .")
    p.add_argument(
        "--checkpoint-path", default=None, help="where checkpoints will go (free disk is checked there); default: ."
    )
    p.add_argument("--sizes", default=None, help=f"--collectives: message sizes (default {DEFAULT_SIZES})")
    p.add_argument(
        "--iters",
        type=positive_int,
        default=None,
        help=f"--collectives: timed calls per collective and size (default {DEFAULT_ITERS})",
    )
    p.add_argument(
        "--dtypes",
        default=None,
        help=f"--collectives: the buffers' dtypes, each measured ({', '.join(TORCH_DTYPES)}; default "
        f"{DEFAULT_DTYPES}): the planner prices each transfer at its own dtype's bandwidth",
    )
    p.set_defaults(func=cmd_doctor)


DESCRIPTION = (
    "Without options: versions against known-bad pairs, hardware, NCCL settings (one process). "
    "--collectives, launched like a recipe (torchrun/accelerate/deepspeed/srun): bus bandwidth of all-reduce, "
    "all-gather and reduce-scatter, per-rank compute speed, the slowest rank. --hang RUN_DIR: which rank fell "
    "behind and the first collective the ranks disagree on."
)


def register(sub: Any) -> None:
    """Add ``zero-recipes doctor`` to the CLI's subparsers."""
    add_arguments(
        sub.add_parser(
            "doctor",
            help="check versions, hardware and NCCL settings; measure collectives; explain a hung run",
            description=DESCRIPTION,
        )
    )


@exit_on_user_error()
def main(argv: list[str] | None = None) -> int:
    """``python -m common.tools.doctor``: the same command under a launcher (``torchrun -m ...``)."""
    parser = argparse.ArgumentParser(prog="python -m common.tools.doctor", description=DESCRIPTION)
    add_arguments(parser)
    return cmd_doctor(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
