"""Read and write bandwidth of DeepSpeed's async I/O on a folder: the NVMe tier, to tune its preset to the disk.

    python bench/nvme_io.py                                   # a temporary folder under the current directory
    python bench/nvme_io.py --path /local_nvme --size 1GiB    # the folder your nvme_path will point at
    python bench/nvme_io.py --processes 8                     # the node figure with 8 ranks swapping at once
    python bench/nvme_io.py --render                          # docs/benchmarks.md from the results file only

The first run builds DeepSpeed's async I/O op (libaio; 3-4 minutes, cached in ~/.cache/torch_extensions).

DeepSpeed ships the benchmark, and it runs here, so this script drives it: ``ds_io`` (deepspeed/nvme/test_ds_aio.py,
the DeepNVMe tutorial's tool) writes or reads a file of ``--size`` bytes through ``aio_handle``, the libaio handle
ZeRO-Infinity swaps parameters and optimizer states with. One ``ds_io`` process per (block size, queue depth,
direction): ``--engine aio_handle --loops REPS --warmup_loops 1 --different_file_each_iteration``, with the other
``aio`` keys (single_submit, overlap_events, intra_op_parallelism) as the preset ``deepspeed_stage_3_offload_nvme``
sets them. Each repetition is DeepSpeed's own timing of one whole file (``task_latency_sec`` in its log: the
``pwrite``/``pread`` call and its ``wait()``), turned into GB/s (1e9 bytes/s, the unit of
``zero-recipes estimate --bandwidth``). DeepSpeed's sweep driver (``ds_nvme_tune``, perf_run_sweep.py) is not used:
its 32-setting grid of 400 MB files takes far longer than the small grid here, and it only flushes the page cache
with sudo, which O_DIRECT makes unnecessary.

The ranks of a node share its disk, and the planner's NVMe link is the node's: its ranks' bytes add up over the
node's bandwidth. So the preset's setting is also measured with ``--processes`` I/O processes at once (``ds_io
--multi_process``, each process its own file; default 2, the ranks of the tests here), and that figure is the one to
give ``zero-recipes estimate --bandwidth nvme=``.

Page cache: the aio op opens every file with O_DIRECT (``open_file`` in
deepspeed/ops/csrc/aio/common/deepspeed_aio_common.cpp), so its reads and writes bypass the kernel's page cache: a
file just written is read back from the device, not from RAM. The script checks that the folder accepts O_DIRECT
before measuring (tmpfs and some network filesystems refuse it) and records the folder's filesystem and device. What
it cannot see: the host of a virtual disk may cache it, and a drive's own DRAM or SLC cache absorbs short bursts, so
a file much larger than those caches (``--size``) gives the sustained figure.

bench/results/nvme_io.json is written by this script alone (bench/_bench_util.write_results, with provenance); the
"nvme-io" section of docs/benchmarks.md is rendered from it by ``render_sections``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed
from bench._bench_util import (  # noqa: E402
    bench_env,
    bench_parser,
    median,
    median_and_range,
    publish_document,
    render_from_file,
    table_head,
    write_results,
)
from common.errors import ConfigError, exit_on_user_error  # noqa: E402
from common.memory_formulas import parse_bytes  # noqa: E402
from common.presets import get_preset  # noqa: E402

RESULTS = HERE / "results" / "nvme_io.json"
PRESET = "deepspeed_stage_3_offload_nvme"
GB = 1e9  # zero-recipes estimate's --bandwidth unit
WARMUP_LOOPS = 1  # ds_io's first loop opens and allocates what the timed ones reuse
O_DIRECT_ALIGNMENT = 4096  # a multiple of every device's logical block: what O_DIRECT transfers must be sized in
DS_IO_TIMEOUT_S = 600
# The preset's aio keys this bench holds fixed (as the preset sets them); it varies block_size and queue_depth.
FIXED_AIO_KEYS = ("single_submit", "overlap_events", "intra_op_parallelism")
# Filesystems that live in RAM: O_DIRECT is accepted (Linux 6.6+ for tmpfs) but there is no disk behind it.
RAM_FILESYSTEMS = ("tmpfs", "ramfs")
# ds_io's tid-0 log line with the seconds of every loop, warm-up first.
LATENCY_RE = re.compile(r"task_latency_sec = \[([^\]]*)\]")


# --- measuring ---------------------------------------------------------------------------------------------


def parse_sizes(text: str) -> list[int]:
    """``"256KiB,1MiB"`` -> [262144, 1048576]: comma-separated sizes, each a whole multiple of 4096 bytes."""
    sizes = [int(parse_bytes(item.strip())) for item in text.split(",") if item.strip()]
    bad = [s for s in sizes if s <= 0 or s % O_DIRECT_ALIGNMENT]
    if not sizes or bad:
        raise ConfigError(
            f"--block-sizes: each a positive multiple of {O_DIRECT_ALIGNMENT} bytes (O_DIRECT), got {text!r}"
        )
    return sizes


def parse_depths(text: str) -> list[int]:
    try:
        depths = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1:
        raise ConfigError(f"--queue-depths takes comma-separated positive integers, got {text!r}")
    return depths


def mount_of(path: str, mounts_text: str) -> dict[str, str]:
    """The filesystem holding ``path`` (an absolute, resolved path), from the text of /proc/mounts: the longest
    mount point that is a prefix of it."""
    best = {"device": "unknown", "mount_point": "", "filesystem": "unknown"}
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        device, mount_point, filesystem = fields[0], fields[1].replace("\\040", " "), fields[2]
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best["mount_point"]):
            best = {"device": device, "mount_point": mount_point, "filesystem": filesystem}
    return best


def check_folder(path: Path, needed_bytes: int) -> dict[str, str]:
    """Refuse, in one line, a folder the benchmark cannot use; else where it lives (filesystem, device)."""
    if not path.is_dir():
        raise ConfigError(f"--path {path}: no such folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--path {path}: not writable by this user")
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise ConfigError(
            f"--path {path}: {free / 2**30:.1f} GiB free, the files need {needed_bytes / 2**30:.1f} GiB; lower --size"
        )
    probe = path / f".zr-nvme-io-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as err:
        raise ConfigError(
            f"--path {path}: refuses O_DIRECT ({err.strerror}), which DeepSpeed's aio op opens its files with: "
            "point it at a folder on a local disk"
        ) from None
    finally:
        probe.unlink(missing_ok=True)
    mounts = Path("/proc/mounts").read_text() if Path("/proc/mounts").exists() else ""
    return mount_of(str(path.resolve()), mounts)


def ds_io_command(
    folder: Path, size: int, block_size: int, queue_depth: int, reps: int, aio: dict, read: bool, processes: int = 1
):
    """The ``ds_io`` command line (as this interpreter's module) for one setting and direction; ``processes`` > 1
    runs that many I/O processes at once, each on its own file, as the ranks of a node swap at once."""
    cmd = [sys.executable, "-m", "deepspeed.nvme.test_ds_aio", "--folder", str(folder), "--io_size", str(size)]
    cmd += ["--multi_process", str(processes)] if processes > 1 else []
    cmd += ["--block_size", str(block_size), "--queue_depth", str(queue_depth), "--engine", "aio_handle"]
    cmd += ["--loops", str(reps), "--warmup_loops", str(WARMUP_LOOPS), "--different_file_each_iteration"]
    cmd += ["--io_parallel", str(aio["intra_op_parallelism"])]
    cmd += ["--single_submit"] if aio["single_submit"] else []
    cmd += [] if aio["overlap_events"] else ["--sequential_requests"]
    return cmd + (["--read"] if read else [])


def loop_seconds(log: str, warmup_loops: int = WARMUP_LOOPS) -> list[float]:
    """The timed loops' seconds from a ``ds_io`` log (its ``task_latency_sec`` list, warm-up loops dropped)."""
    match = LATENCY_RE.search(log)
    if not match:
        return []
    seconds = [float(item) for item in match.group(1).split(",") if item.strip()]
    return seconds[warmup_loops:]


def gbps(size_bytes: int, seconds: list[float]) -> list[float]:
    """GB/s (1e9 bytes per second) of each repetition that moved ``size_bytes`` in ``seconds``."""
    return [size_bytes / s / GB for s in seconds]


def run_ds_io(cmd: list[str], reps: int) -> list[float]:
    proc = subprocess.run(cmd, env=bench_env(), capture_output=True, text=True, timeout=DS_IO_TIMEOUT_S)
    seconds = loop_seconds(proc.stdout)
    if proc.returncode != 0 or len(seconds) != reps or min(seconds, default=0) <= 0:
        raise RuntimeError(f"ds_io failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return seconds


def prepare_read_files(folder: Path, size: int, loops: int, processes: int = 1) -> None:
    """Write the files ds_io reads, under its own names, and flush them to the device before any timed read.

    ds_io would create them itself (dd from /dev/urandom) just before the first read setting, whose reads would
    then wait for the kernel to write those dirty pages back first.
    """
    from deepspeed.nvme.test_ds_aio_utils import create_file, create_filename

    for process in range(processes):
        for loop in range(loops):
            name = create_filename(str(folder), True, size, f"{process}_{loop}")  # ds_io's name for it
            if os.path.exists(name):
                continue
            create_file(name, size)
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def measure(folder: Path, size: int, block_sizes: list[int], depths: list[int], reps: int, aio: dict) -> list[dict]:
    """One row per (block size, queue depth): the GB/s of each write and read repetition."""
    prepare_read_files(folder, size, reps + WARMUP_LOOPS)
    runs = []
    for block_size in block_sizes:
        for depth in depths:
            row = {"block_size": block_size, "queue_depth": depth}
            for direction in ("write", "read"):
                cmd = ds_io_command(folder, size, block_size, depth, reps, aio, read=direction == "read")
                row[f"{direction}_gbps"] = gbps(size, run_ds_io(cmd, reps))
            runs.append(row)
            print(
                f"block {human_bytes(block_size):>7} depth {depth:>3}: write {median_and_range(row['write_gbps'])} "
                f"GB/s, read {median_and_range(row['read_gbps'])} GB/s",
                flush=True,
            )
    return runs


def measure_node(folder: Path, size: int, reps: int, aio: dict, processes: int) -> dict:
    """The preset's setting with ``processes`` I/O processes at once: the bandwidth a node's ranks share.

    ds_io starts every loop of every process together (a barrier) and logs process 0's seconds per loop; the
    node's GB/s of a loop is ``processes`` files over that time.
    """
    prepare_read_files(folder, size, reps + WARMUP_LOOPS, processes)
    row = {"processes": processes, "block_size": aio["block_size"], "queue_depth": aio["queue_depth"]}
    for direction in ("write", "read"):
        cmd = ds_io_command(
            folder, size, aio["block_size"], aio["queue_depth"], reps, aio, direction == "read", processes
        )
        row[f"{direction}_gbps"] = gbps(processes * size, run_ds_io(cmd, reps))
    print(
        f"{processes} processes at once, the preset's setting: write {median_and_range(row['write_gbps'])} GB/s, "
        f"read {median_and_range(row['read_gbps'])} GB/s (the node's)",
        flush=True,
    )
    return row


# --- summarising and rendering (pure: results in, Markdown out) ---------------------------------------------


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def best_setting(runs: list[dict]) -> dict:
    """The setting that writes then reads the file the soonest (medians): a swap both writes and reads."""

    def seconds_per_byte(row: dict) -> float:
        return 1 / median(row["write_gbps"]) + 1 / median(row["read_gbps"])

    row = min(runs, key=seconds_per_byte)
    return {
        "block_size": row["block_size"],
        "queue_depth": row["queue_depth"],
        "write_gbps": round(median(row["write_gbps"]), 3),
        "read_gbps": round(median(row["read_gbps"]), 3),
    }


def render_nvme_io(results: dict) -> str:
    settings, storage, runs = results["settings"], results["storage"], results["runs"]
    best = best_setting(runs)
    lines = table_head("block size", "queue depth", "write GB/s: median (min-max)", "read GB/s: median (min-max)")
    for row in runs:
        mark = "**" if (row["block_size"], row["queue_depth"]) == (best["block_size"], best["queue_depth"]) else ""
        lines.append(
            f"| {mark}{human_bytes(row['block_size'])}{mark} | {mark}{row['queue_depth']}{mark} | "
            f"{median_and_range(row['write_gbps'])} | {median_and_range(row['read_gbps'])} |"
        )
    preset = settings["preset_aio"]
    in_ram = storage["filesystem"] in RAM_FILESYSTEMS
    warning = [
        f"**The folder is in RAM ({storage['filesystem']}): these are memory figures, not a disk's.** Rerun with "
        "`--path` on the disk your `nvme_path` points at.",
        "",
    ]
    fixed = ", ".join(f"`{k}: {settings['aio'][k]}`" for k in FIXED_AIO_KEYS)
    node = results.get("node")
    node_lines = (
        [
            "",
            f"**{node['processes']} processes at once** (the preset's setting, block "
            f"{human_bytes(node['block_size'])}, queue depth {node['queue_depth']}; each its own file, as the ranks of "
            f"a node swap at once): **write {median_and_range(node['write_gbps'])}, read "
            f"{median_and_range(node['read_gbps'])} GB/s for the node**. The planner's NVMe link is the node's (its "
            "ranks' bytes add up), so this is the figure to give "
            f"it: `--bandwidth nvme={(median(node['write_gbps']) + median(node['read_gbps'])) / 2:.2f}` (the mean of "
            "the two; bench/offload_time.py measures this figure again in its own run and checks the planner's "
            "disk time at it against the disk's busy time).",
        ]
        if node
        else []
    )
    return "\n".join(
        [
            *(warning if in_ram else []),
            f"**Best here: `block_size` {best['block_size']} ({human_bytes(best['block_size'])}), `queue_depth` "
            f"{best['queue_depth']}: write {best['write_gbps']:.2f} GB/s, read {best['read_gbps']:.2f} GB/s** "
            "(medians; the setting that writes then reads the file the soonest, in bold below).",
            "",
            *lines,
            *node_lines,
            "",
            f"Use it: `zero-recipes estimate --params 7e9 --gpus 8 --bandwidth nvme={best['read_gbps']:.2f}` (this "
            "disk's read figure in place of the planner's default NVMe range, 2-4 GB/s; `--params` or `--recipe` as "
            "for any plan), and `aio` "
            f"`block_size: {best['block_size']}`, `queue_depth: {best['queue_depth']}` in the preset `{PRESET}` "
            f"(common/presets.py ships {preset['block_size']} and {preset['queue_depth']}). A larger `block_size` "
            "also raises the smallest partition DeepSpeed swaps (max(1 MiB, block_size)): smaller ones stay in host "
            "RAM.",
            "",
            f"DeepSpeed's `ds_io` (`--engine aio_handle`, the libaio handle ZeRO-Infinity swaps with) writing, then "
            f"reading, a {human_bytes(settings['size_bytes'])} file from a pinned CPU tensor, {settings['reps']} "
            f"repetitions (a fresh file each) after {settings['warmup_loops']} warm-up per setting; the other `aio` "
            f"keys as the preset sets them ({fixed}). GB/s is 1e9 bytes/s. The folder: {storage['filesystem']} on "
            f"{storage['device']}. The aio op opens its files with O_DIRECT, so the kernel's page cache serves none "
            "of these reads (a file just written is read from the device); the host of a virtual disk, or the "
            "drive's own cache, may still absorb part of a file this small: measure the folder your `nvme_path` "
            "points at with a `--size` beyond those caches.",
        ]
    )


def render_sections(document: dict) -> dict[str, str]:
    """The docs/benchmarks.md section this bench owns, from ``{"provenance": ..., "results": ...}``."""
    return {"nvme-io": render_nvme_io(document["results"])}


# --- command line ------------------------------------------------------------------------------------------


# --render: a results file that is missing or was not written by write_results is one line, not a traceback.
@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--path", default=None, help="folder to measure (default: a temporary one under .)")
    parser.add_argument("--size", default="256MiB", help="bytes per file, e.g. 256MiB, 4GiB (default 256MiB)")
    parser.add_argument("--block-sizes", default="256KiB,1MiB,4MiB", help="aio block_size values to try")
    parser.add_argument("--queue-depths", default="4,8,32", help="aio queue_depth values to try")
    parser.add_argument("--reps", type=int, default=3, help="timed files per setting and direction")
    parser.add_argument(
        "--processes",
        type=int,
        default=2,
        help="also measure the preset's setting with this many processes at once: the ranks of one node (default 2; "
        "1: skip)",
    )
    args = parser.parse_args()
    if args.render:
        render_from_file(RESULTS, render_sections)
        return
    size = int(parse_bytes(args.size))
    block_sizes, depths = parse_sizes(args.block_sizes), parse_depths(args.queue_depths)
    if args.reps < 1:
        raise ConfigError(f"--reps must be at least 1, got {args.reps}")
    if args.processes < 1:
        raise ConfigError(f"--processes must be at least 1, got {args.processes}")
    uneven = [b for b in block_sizes if size < b or size % b]
    if uneven:
        raise ConfigError(f"--size {args.size} must be a whole multiple of every block size ({human_bytes(uneven[0])})")
    base = Path(args.path) if args.path else Path.cwd()
    # Each direction keeps one file per loop: the write files and the read files side by side.
    storage = check_folder(base, 2 * (args.reps + WARMUP_LOOPS) * size * args.processes)
    aio = get_preset(PRESET)["aio"]
    with tempfile.TemporaryDirectory(dir=base, prefix="zr-nvme-io-") as folder:
        runs = measure(Path(folder), size, block_sizes, depths, args.reps, aio)
        node = measure_node(Path(folder), size, args.reps, aio, args.processes) if args.processes > 1 else None
    results = {
        "settings": {
            "path": args.path or "a temporary folder under the current directory",
            "size_bytes": size,
            "reps": args.reps,
            "warmup_loops": WARMUP_LOOPS,
            "aio": {k: aio[k] for k in FIXED_AIO_KEYS},
            "preset_aio": {k: aio[k] for k in ("block_size", "queue_depth")},
            "tool": "ds_io (deepspeed.nvme.test_ds_aio) --engine aio_handle",
        },
        "storage": {**storage, "o_direct": True},
        "runs": runs,
        "best": best_setting(runs),
        "node": node,
    }
    document = write_results(RESULTS, results)
    publish_document(document, render_sections)
    print(render_sections(document)["nvme-io"])


if __name__ == "__main__":
    main()
