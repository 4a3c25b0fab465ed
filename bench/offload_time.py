"""What each offload tier adds to a step, measured, beside the planner's time column.

    python bench/offload_time.py                 # 3 interleaved reps of stage 3, + CPU offload, + NVMe (~5 min)
    python bench/offload_time.py --render        # docs/benchmarks.md from the results file only

The planner (``zero-recipes estimate``, common/memory_formulas.offload_traffic and link_seconds) divides the bytes
one optimizer step moves over each link by the link's bandwidth. This bench trains the same model three ways in
one run, interleaved (bench/_offload_worker.py: 2 CPU processes, fp32, bias-free square layers wide enough that
every partition is swapped): ZeRO-3, ZeRO-3 with optimizer and parameters offloaded to host RAM
(``deepspeed_stage_3_offload``), and ZeRO-3 with both on disk (``deepspeed_stage_3_offload_nvme``), and compares
for the NVMe tier, each against a measurement that does not use the planner:

- the bytes per step per rank: the planner's ``nvme`` terms against the kernel's block-layer counters of each
  rank (``/proc/self/io`` read_bytes + write_bytes: DeepSpeed's O_DIRECT swap I/O, not the page cache);
- the seconds the disk is busy per step: the planner's ``nvme`` link seconds (both ranks' bytes over this disk's
  bandwidth, measured in the same run before every repetition's trainings, with bench/nvme_io.py's node
  measurement: ``ds_io`` at the preset's ``aio`` settings, 2 processes at once, in a folder beside the swap
  folders) against the device's own busy time (/proc/diskstats io_ticks). A shared or virtual disk's bandwidth
  drifts from day to day, so a figure measured on another day would judge the planner against another disk;
- beside them, the step time NVMe adds over CPU offload (same CPU Adam, same copies).

The CPU tier (CPU offload minus ZeRO-3) is shown too, with the planner's ``pcie`` terms priced at this machine's
single-thread memory-copy bandwidth: on a CPU the "device" is host memory, so there is no PCIe transfer to time.

Goal: the planner within 30 % of the measurement. bench/results/offload_time.json is written by this
script alone (with provenance); the "offload-time" section of docs/benchmarks.md is rendered from it.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed
import torch  # noqa: E402
from nvme_io import measure_node  # noqa: E402

from bench._bench_util import (  # noqa: E402
    bench_parser,
    launch_group,
    median,
    publish_document,
    render_from_file,
    spread,
    table_head,
    write_results,
)
from common.errors import exit_on_user_error  # noqa: E402
from common.memory_formulas import link_seconds, offload_traffic  # noqa: E402
from common.presets import get_preset  # noqa: E402

RESULTS = HERE / "results" / "offload_time.json"
DISK_FILE_BYTES = 256 * 2**20  # per ds_io process and loop: nvme_io.py's default size
DISK_LOOPS = 3  # timed loops per direction, per repetition
VARIANTS = {
    "stage3": "deepspeed_stage_3",
    "cpu": "deepspeed_stage_3_offload",
    "nvme": "deepspeed_stage_3_offload_nvme",
}
# tier -> (the variant with it, the variant without it, the offload the planner prices, the link that is the tier)
TIERS = {
    "CPU offload (host RAM)": ("cpu", "stage3", "params", "pcie"),
    "NVMe offload (disk)": ("nvme", "cpu", "nvme", "nvme"),
}
WARMUP = 2
GOAL = 0.30
GB = 1e9


def copy_gbps(threads: int, size_bytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Memory-copy bandwidth: bytes read plus bytes written per second by ``Tensor.copy_`` (best of ``reps``)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = torch.ones(size_bytes, dtype=torch.uint8)
        target = torch.empty_like(source)
        target.copy_(source)  # first touch of the pages
        best = float("inf")
        for _ in range(reps):
            started = time.perf_counter()
            target.copy_(source)
            best = min(best, time.perf_counter() - started)
        return 2 * size_bytes / best / GB
    finally:
        torch.set_num_threads(previous)


def measure_disk(ranks: int) -> dict:
    """This disk's NVMe-tier bandwidth now: ``ranks`` ``ds_io`` processes at once at the preset's aio settings (the
    node's figure, which the planner's shared link divides by), in a folder under the current directory, where the
    NVMe variant's swap folder goes."""
    aio = get_preset("deepspeed_stage_3_offload_nvme")["aio"]
    with tempfile.TemporaryDirectory(prefix="zr-offload-disk-", dir=Path.cwd()) as folder:
        return measure_node(Path(folder), DISK_FILE_BYTES, DISK_LOOPS, aio, ranks)


def every_loop(rows: list[dict], key: str) -> list[float]:
    """The GB/s of every timed ds_io loop of every repetition, in one direction (``read_gbps`` or ``write_gbps``)."""
    return [gbps for row in rows for gbps in row[key]]


def disk_bandwidth(rows: list[dict]) -> dict:
    """The repetitions' disk measurements as the planner's one NVMe bandwidth: the mean of the median read and the
    median write GB/s (a step swaps both ways), every loop of every repetition counted."""
    read, write = median(every_loop(rows, "read_gbps")), median(every_loop(rows, "write_gbps"))
    first = rows[0]
    return {
        "gbps": (read + write) / 2,
        "read_gbps": read,
        "write_gbps": write,
        "processes": first["processes"],
        "block_size": first["block_size"],
        "queue_depth": first["queue_depth"],
        "per_rep": rows,
    }


def run_variant(variant: str, width: int, depth: int, steps: int, tmp: Path) -> dict:
    out = tmp / f"{variant}.json"
    args = ["--preset", VARIANTS[variant], "--width", str(width), "--depth", str(depth), "--steps", str(steps)]
    # The swap folder on the disk measure_disk measured (under the current directory), removed even when a run fails.
    with tempfile.TemporaryDirectory(prefix="zr-offload-time-", dir=Path.cwd()) as swap:
        args += ["--nvme-path", swap] if variant == "nvme" else []
        launch_group(HERE / "_offload_worker.py", "raw", VARIANTS[variant], [*args, "--out", str(out)], timeout=1200)
    return json.loads(out.read_text())


def measure(width: int, depth: int, steps: int, reps: int) -> tuple[dict, list[dict]]:
    """Per variant, per repetition, the run's record; and per repetition, the disk's bandwidth measured before it."""
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    disk_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            disk_rows.append(measure_disk(ranks=2))  # the worker's 2 processes
            order = list(VARIANTS)[rep % len(VARIANTS) :] + list(VARIANTS)[: rep % len(VARIANTS)]
            for variant in order:
                record = run_variant(variant, width, depth, steps, Path(tmp))
                record["median_step_s"] = median(record["step_s"][WARMUP:])
                runs[variant].append(record)
                print(f"rep {rep} {variant:>6}: median step {record['median_step_s'] * 1e3:8.1f} ms", flush=True)
    return runs, disk_rows


def predicted_seconds(num_params: int, world_size: int, offload: str, link: str, bandwidth_gbps: float) -> dict:
    """The planner's figure: bytes per step over ``link`` (its own formula, fp32, per rank x the node's ranks on a
    shared link) over the bandwidth; the terms are kept for the table."""
    traffic = offload_traffic(num_params, 3, offload, world_size, "fp32")
    seconds = link_seconds({link: traffic[link]}, world_size, {link: bandwidth_gbps})[link]
    return {"seconds": seconds, "bytes_per_rank": sum(traffic[link].values()), "terms": traffic[link]}


def disk_figures(record: dict) -> dict:
    """One NVMe run's disk traffic per step after warm-up: bytes each rank moved (the kernel's counters, mean over
    ranks and steps) and the seconds the device was busy (median step)."""
    per_rank = [mean([sum(step) for step in steps[WARMUP:]]) for steps in record["disk_bytes_per_step"]]
    busy = record.get("device_per_step")
    return {
        "bytes_per_rank": mean(per_rank),
        "device_busy_s": median([step[0] for step in busy[WARMUP:]]) if busy else None,
    }


def summarize(runs: dict, bandwidths: dict) -> dict:
    world = runs["stage3"][0]["world_size"]
    num_params = runs["stage3"][0]["num_params"]
    tiers = {}
    for tier, (with_it, without, offload, link) in TIERS.items():
        added = [a["median_step_s"] - b["median_step_s"] for a, b in zip(runs[with_it], runs[without])]
        predicted = predicted_seconds(num_params, world, offload, link, bandwidths[link])
        tiers[tier] = {
            "link": link,
            "bandwidth_gbps": bandwidths[link],
            "predicted_s": predicted["seconds"],
            "bytes_per_rank": predicted["bytes_per_rank"],
            "terms": predicted["terms"],
            "added_s": median(added),
            "added_s_per_rep": added,
        }
    disk = [disk_figures(record) for record in runs["nvme"]]
    busy = [d["device_busy_s"] for d in disk if d["device_busy_s"] is not None]
    tiers["NVMe offload (disk)"]["measured_bytes_per_rank"] = median([d["bytes_per_rank"] for d in disk])
    tiers["NVMe offload (disk)"]["device_busy_s"] = median(busy) if busy else None
    tiers["NVMe offload (disk)"]["device_busy_s_per_rep"] = busy
    return {"num_params": num_params, "world_size": world, "tiers": tiers}


# --- rendering (pure: results in, Markdown out) ---------------------------------------------------------------


def relative(predicted: float, measured: float | None) -> str:
    if not measured or measured <= 0:
        return "-"
    error = predicted / measured - 1
    return f"{error:+.0%}" + ("" if abs(error) <= GOAL else f" (outside {GOAL:.0%})")


def render_offload_time(results: dict) -> str:
    settings, summary, runs = results["settings"], results["summary"], results["runs"]
    nvme, cpu = summary["tiers"]["NVMe offload (disk)"], summary["tiers"]["CPU offload (host RAM)"]
    busy_low, busy_high = spread(nvme["device_busy_s_per_rep"]) if nvme["device_busy_s_per_rep"] else (0.0, 0.0)
    lines = table_head("NVMe tier, per optimizer step", "planner", "measured here", "planner vs measured")
    lines += [
        f"| bytes to and from the disk, per rank | {nvme['bytes_per_rank'] / GB:.3f} GB | "
        f"{nvme['measured_bytes_per_rank'] / GB:.3f} GB (the kernel's read_bytes + write_bytes) | "
        f"{relative(nvme['bytes_per_rank'], nvme['measured_bytes_per_rank'])} |",
        f"| seconds the disk is busy (both ranks) | {nvme['predicted_s']:.3f} s at {nvme['bandwidth_gbps']:.2f} "
        f"GB/s | **{nvme['device_busy_s'] or float('nan'):.3f} s** ({busy_low:.3f}-{busy_high:.3f}; "
        f"/proc/diskstats io_ticks) | {relative(nvme['predicted_s'], nvme['device_busy_s'])} |",
        f"| step time the tier adds (NVMe - CPU offload) | >= 0 (a floor: I/O can overlap compute) | "
        f"{nvme['added_s']:.3f} s ({spread(nvme['added_s_per_rep'])[0]:.3f}-{spread(nvme['added_s_per_rep'])[1]:.3f})"
        " | - |",
    ]
    bytes_ok = abs(nvme["bytes_per_rank"] / nvme["measured_bytes_per_rank"] - 1) <= GOAL
    busy = nvme["device_busy_s"]
    time_ok = busy is not None and abs(nvme["predicted_s"] / busy - 1) <= GOAL
    effective = 2 * nvme["measured_bytes_per_rank"] / busy / GB if busy else float("nan")
    verdict = (
        f"**NVMe tier: the planner's bytes are {relative(nvme['bytes_per_rank'], nvme['measured_bytes_per_rank'])} "
        f"of what the disk moved, and its disk time {relative(nvme['predicted_s'], busy)} of the time the disk was "
        f"busy**"
        + (
            f" — both within {GOAL:.0%}."
            if bytes_ok and time_ok
            else f": the goal (within {GOAL:.0%}) does not hold for the time. With both ranks' reads and writes in "
            f"flight the disk moved {effective:.2f} GB/s, against the {nvme['bandwidth_gbps']:.2f} GB/s that ds_io "
            "measured in the same run; the planner is as good as the bandwidth it is given "
            "(`--bandwidth nvme=GB/s`)."
        )
    )
    steps = table_head("variant", "preset", "median step s per rep")
    for variant, records in runs.items():
        per_rep = ", ".join(f"{r['median_step_s']:.3f}" for r in records)
        steps.append(f"| {variant} | {VARIANTS[variant]} | {per_rep} |")
    disk = results["bandwidths"]["disk"]
    return "\n".join(
        [
            verdict,
            "",
            *lines,
            "",
            f"**CPU tier**: the planner's `pcie` terms ({cpu['bytes_per_rank'] / GB:.3f} GB per rank) at this "
            f"machine's memory-copy speed ({cpu['bandwidth_gbps']:.2f} GB/s, one thread) are {cpu['predicted_s']:.3f} "
            f"s per step; the step time CPU offload added over ZeRO-3 was {cpu['added_s']:+.3f} s "
            f"({spread(cpu['added_s_per_rep'])[0]:+.3f} to {spread(cpu['added_s_per_rep'])[1]:+.3f}): on a CPU the "
            '"device" is host memory, so there is no PCIe transfer to time, and DeepSpeedCPUAdam is faster than '
            "torch's AdamW on the same states. The CPU row of the time column can only be checked on a GPU "
            "(`zero-recipes probe` reports it there).",
            "",
            f"Model: {settings['depth']} bias-free {settings['width']} x {settings['width']} layers "
            f"({summary['num_params']:,} parameters, fp32), {summary['world_size']} CPU processes, micro batch 8, "
            f"{settings['reps']} interleaved repetitions of {settings['steps']} steps ({WARMUP} warm-up). The "
            "disk's bandwidth was measured in the same run, before each repetition's trainings: ds_io "
            f"(bench/nvme_io.py's node measurement) at the preset's aio settings (block "
            f"{disk['block_size'] // 2**20} MiB, queue depth {disk['queue_depth']}), {disk['processes']} processes at "
            f"once: read {disk['read_gbps']:.2f} GB/s ({disk_spread(disk, 'read_gbps')}), write "
            f"{disk['write_gbps']:.2f} GB/s ({disk_spread(disk, 'write_gbps')}), medians over every loop, their mean "
            "used. "
            "The planner's bytes count each "
            "parameter partition read twice (forward and backward); DeepSpeed read it once here, because its "
            "parameter buffers (`buffer_count` x `buffer_size`) held every partition between the two passes.",
            "",
            *steps,
        ]
    )


def disk_spread(disk: dict, key: str) -> str:
    low, high = spread(every_loop(disk["per_rep"], key))
    return f"{low:.2f}-{high:.2f}"


def render_sections(document: dict) -> dict[str, str]:
    return {"offload-time": render_offload_time(document["results"])}


@exit_on_user_error(ValueError, FileNotFoundError)
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.render:
        render_from_file(RESULTS, render_sections)
        return
    if args.steps <= WARMUP or args.reps < 1:
        parser.error(f"need --steps > {WARMUP} (the warm-up) and --reps >= 1")
    runs, disk_rows = measure(args.width, args.depth, args.steps, args.reps)
    disk = disk_bandwidth(disk_rows)
    bandwidths = {"pcie": copy_gbps(threads=1), "nvme": disk["gbps"], "disk": disk}
    results = {
        "settings": {"width": args.width, "depth": args.depth, "steps": args.steps, "reps": args.reps},
        "bandwidths": bandwidths,
        "runs": runs,
        "summary": summarize(runs, bandwidths),
    }
    document = write_results(RESULTS, results)
    publish_document(document, render_sections)
    print(render_sections(document)["offload-time"])


if __name__ == "__main__":
    main()
