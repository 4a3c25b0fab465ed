"""What a checkpoint save costs the training loop: synchronous vs asynchronous (``async_save``), and how saves scale.

    flock /tmp/zr-heavy.lock python bench/checkpoint.py        # ~215M-parameter Llama, ZeRO-3, 2 processes (~40 min)
    python bench/checkpoint.py --hidden-size 128 --layers 2 --vocab 512 --processes 1 2 --json /tmp/c.json --no-doc
    python bench/checkpoint.py --render    # rewrite the docs from bench/results/checkpoint.json, measuring nothing

1. **Stall** (the model of bench/export_memory.py: hidden 1024, 12 layers, vocab 32000, fp32, ZeRO-3 with every
   parameter partitioned, torch AdamW, 2 CPU processes over gloo): saves through the recipes' own
   ``common.async_checkpoint`` writers, synchronous and asynchronous interleaved (sync, async, sync, ...), a few
   training steps between saves. Per save, the time the training loop was blocked, the slowest rank's (the next
   collective waits for it). ``stall_ratio`` = median blocked per asynchronous save / median synchronous save.
2. **Throughput**: the same number of steps without saves, with a synchronous save every N steps and with an
   asynchronous one every N steps, interleaved per repetition (the order rotated from one repetition to the next);
   at N = 1 and at the N predicted from step 1's figures to make a synchronous save cost at least 20 % of the run;
   the bar is judged at the largest N whose synchronous save measured that floor. Wall time per step, CPU time of
   the training thread (``time.thread_time``: the background writer's CPU is not in it) and of the whole rank
   (``time.process_time``), and the writer thread's CPU per save: on a machine with fewer free cores than ranks x 2
   the writer competes with training for them, and the wall-clock ratio shows that.
3. **Write cost** of one file, four ways: ``torch.save`` as DeepSpeed calls it, without the CRC-32, past the page
   cache as well (``save_direct`` through its buffer), and from page-aligned memory without a copy (``save_direct``
   of a snapshot's tensor, what the background writer does).
4. **Scaling**: synchronous save time for three model sizes on 2 processes, and for 1, 2 and 4 processes on the
   middle size.
5. Writes bench/results/checkpoint.json (``write_results``: provenance included) and renders the "checkpoint saves"
   section of docs/checkpoints.md from that file alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed

from bench._bench_util import (  # noqa: E402
    MEDIAN_CONFIDENCE,
    REPO,
    add_results_options,
    bench_parser,
    launch_group,
    median_and_range,
    median_interval,
    render_from_file,
    rotated,
    save_and_publish,
    spread,
    work_folder,
)
from common.errors import exit_on_user_error  # noqa: E402

RESULTS = HERE / "results" / "checkpoint.json"
DOCS = {"checkpoint saves": REPO / "docs" / "checkpoints.md"}
SYNC_SHARE_FLOOR = 0.20  # the throughput run saves often enough that a synchronous save costs at least this
STALL_BAR, THROUGHPUT_BAR = 0.15, 0.05  # what asynchronous saves must meet
SCALING_KEYS = ("num_params", "world_size", "checkpoint_bytes", "hidden_size", "layers", "vocab", "wall_s")


# --- one rank (started by torch.distributed.run) --------------------------------------------------------------


def train_step(engine, batch) -> None:
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()


def slowest(value: float) -> float:
    """The largest value over the ranks: the next collective waits for the slowest rank."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from bench.export_memory import zero3_llama_engine
    from common.async_checkpoint import AsyncCheckpointer, Checkpointer
    from common.host_memory import keep_freed_memory

    keep_freed_memory()  # as in the recipes' processes (the factory's adapters call it)
    engine = zero3_llama_engine(args.hidden_size, args.layers, args.vocab)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = torch.randint(0, args.vocab, (1, args.seq_len), generator=torch.Generator().manual_seed(rank))
    out = Path(args.worker)
    torch_engine = engine.checkpoint_engine
    writers = {
        "sync": Checkpointer(out, rank, world, keep_last=1, keep_every=0, barrier=dist.barrier),
        "async": AsyncCheckpointer(out, rank, world, keep_last=1, keep_every=0, barrier=dist.barrier),
    }
    step = 0

    def save(mode: str) -> None:
        nonlocal step
        step += 1  # a folder of its own per save, also for saves with no training between them
        if mode == "async":
            writers["async"].install(engine)
        else:
            engine.checkpoint_engine = torch_engine
        writers[mode].save(step, lambda folder: engine.save_checkpoint(str(folder), tag="checkpoint"))

    def steps(count: int) -> tuple[float, float]:
        nonlocal step
        dist.barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(count):
            train_step(engine, batch)
            step += 1
        return time.perf_counter() - wall, time.thread_time() - cpu

    def throughput_runs(every: int) -> dict[str, list[dict]]:
        """Per mode, per repetition: wall and CPU time per step over a run that saves every ``every`` steps."""
        runs: dict[str, list[dict]] = {"none": [], "sync": [], "async": []}
        for repetition in range(args.repeats):
            for mode in rotated(("none", "sync", "async"), repetition):
                writers["async"].finish()
                dist.barrier()
                wall, cpu, process_cpu = time.perf_counter(), time.thread_time(), time.process_time()
                for _ in range(args.saves_per_run):
                    steps(every)
                    if mode != "none":
                        save(mode)
                steps(every)  # the last write overlaps these steps too, as it would in a longer run
                counted = every * (args.saves_per_run + 1)
                runs[mode].append(
                    {
                        "wall_s_per_step": slowest(time.perf_counter() - wall) / counted,
                        "cpu_s_per_step": slowest(time.thread_time() - cpu) / counted,
                        # every thread of the rank: training, gloo's, the writer's (a write still in flight at the
                        # end is not in it; the wall time is what the run paid)
                        "process_cpu_s_per_step": slowest(time.process_time() - process_cpu) / counted,
                    }
                )
        writers["async"].finish()
        return runs

    steps(1)  # warm-up: the first step allocates the optimizer states
    step_wall = [slowest(steps(1)[0]) for _ in range(2)]
    result: dict = {"num_params": sum(p.ds_numel for p in engine.module.parameters()), "world_size": world}
    result["cpu_cores"] = len(os.sched_getaffinity(0))  # what the ranks and their writers share
    if args.scaling_only:
        for _ in range(args.saves):
            save("sync")
        result["sync_save_s"] = [slowest(seconds) for seconds in writers["sync"].blocked_s]
    else:
        for _ in range(args.saves):
            for mode in ("sync", "async"):
                save(mode)
                steps(args.steps_between)  # the next optimizer step may wait for the copy: part of blocked_s
                writers["async"].finish()  # the next save starts with nothing in flight, whatever the mode
        # Per save, the slowest rank's wait: in the save call, plus (asynchronous) the next step's wait for the copy.
        result["blocked_s"] = {mode: [slowest(seconds) for seconds in writers[mode].blocked_s] for mode in writers}
        result["update_waits"] = len(writers["async"].update_wait_s)
        result["writer_cpu_s"] = [slowest(seconds) for seconds in writers["async"].writer_cpu_s]
        result["snapshot_bytes_per_rank"] = writers["async"].snapshot_bytes
        result["step_s"] = statistics.median(step_wall)
        sync_save = statistics.median(result["blocked_s"]["sync"])
        # A synchronous save every N steps costs save / (N * step + save) of the run: at least SYNC_SHARE_FLOOR, as
        # predicted from the figures above. The prediction can miss the floor either way, so N = 1 (the most a
        # synchronous save can cost) is measured too, and the verdict is that of the largest N that measured it.
        every = max(1, math.floor(sync_save * (1 - SYNC_SHARE_FLOOR) / (SYNC_SHARE_FLOOR * result["step_s"])))
        result["throughput"] = [{"save_every": n, "runs": throughput_runs(n)} for n in sorted({1, every})]
    if rank == 0:
        result["checkpoint_bytes"] = sum(
            p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file() and "step_" in str(p.parent)
        )
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()


# --- the driver ---------------------------------------------------------------------------------------------------


WRITE_MODES = {  # how one file is saved: DeepSpeed's own call, then what the writers change, one thing at a time
    "torch_save": "`torch.save` as DeepSpeed calls it",
    "without_crc32": "without the CRC-32 (both writers)",
    "direct": "without it and past the page cache (`DirectFile`, through its buffer)",
    "in_place": "and from page-aligned memory, without a copy (the background writer's snapshot)",
}


def write_cost(work: Path, megabytes: int, repeats: int) -> dict:
    """CPU and wall seconds of saving ``megabytes`` of fp32 to one file and flushing it (``fsync``), in each of
    ``WRITE_MODES``, interleaved, ``repeats`` times each (the training thread's CPU time: the kernel's work on the
    writer's behalf, page-cache pages included, is in it)."""
    import mmap

    import torch

    from common.async_checkpoint import DIRECT_BUFFER_BYTES, page_aligned_empty, save_direct, without_crc32
    from common.rundir import fsync_path

    state = {"t": torch.randn(megabytes * 2**20 // 4, generator=torch.Generator().manual_seed(0))}
    aligned = {"t": page_aligned_empty(state["t"]).copy_(state["t"])}  # torch's own allocation is not page-aligned
    buffer = mmap.mmap(-1, DIRECT_BUFFER_BYTES)
    path = work / "write-cost.pt"

    def save(mode: str) -> None:
        if mode in ("direct", "in_place"):
            save_direct(aligned if mode == "in_place" else state, path, buffer)  # flushes
            return
        with without_crc32() if mode == "without_crc32" else contextlib.nullcontext():
            torch.save(state, path)
        fsync_path(path)

    times: dict[str, list[dict]] = {mode: [] for mode in WRITE_MODES}
    for _ in range(repeats):
        for mode in WRITE_MODES:
            path.unlink(missing_ok=True)
            wall, cpu = time.perf_counter(), time.thread_time()
            save(mode)
            times[mode].append({"wall_s": time.perf_counter() - wall, "cpu_s": time.thread_time() - cpu})
    path.unlink(missing_ok=True)
    return {"megabytes": megabytes, **times}


def run_group(args: argparse.Namespace, work: Path, hidden: int, layers: int, nproc: int, scaling: bool) -> dict:
    folder = work / f"h{hidden}-l{layers}-p{nproc}-{'scaling' if scaling else 'stall'}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    worker_args = ["--hidden-size", str(hidden), "--layers", str(layers), "--vocab", str(args.vocab)]
    worker_args += ["--seq-len", str(args.seq_len), "--saves", str(args.saves), "--repeats", str(args.repeats)]
    worker_args += ["--steps-between", str(args.steps_between), "--saves-per-run", str(args.saves_per_run)]
    worker_args += ["--worker", str(folder), *(["--scaling-only"] if scaling else [])]
    start = time.perf_counter()
    launch_group(Path(__file__), "raw", "checkpoint", worker_args, nproc=nproc, timeout=3600)
    result = json.loads((folder / "result.json").read_text())
    result.update(hidden_size=hidden, layers=layers, vocab=args.vocab, wall_s=round(time.perf_counter() - start, 1))
    shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "throughput"}), flush=True)
    return result


def runs_at(stall: dict, every: int) -> dict[str, list[dict]]:
    """The throughput runs (per mode, per repetition) of the save interval ``every``."""
    return next(t["runs"] for t in stall["throughput"] if t["save_every"] == every)


def slowdowns(runs: dict[str, list[dict]]) -> dict:
    """Wall time per step with saves / without, per repetition: median, spread and the median's confidence interval
    (what the verdict reads), for each writer."""
    figures = {}
    for mode in ("sync", "async"):
        ratios = [
            run["wall_s_per_step"] / base["wall_s_per_step"] for run, base in zip(runs[mode], runs["none"], strict=True)
        ]
        figures[f"slowdown_{mode}"], figures[f"slowdown_{mode}_spread"] = statistics.median(ratios), spread(ratios)
        figures[f"slowdown_{mode}_interval"] = median_interval(ratios)
    return figures


def summarize(stall: dict) -> dict:
    """The figures the doc states, computed from the raw per-save and per-run numbers."""
    # The first asynchronous save also allocates the snapshot's host memory (then reused by every later save): it is
    # reported on its own, and the ratio is that of the saves after it, what a run pays from then on.
    sync, blocked_async = stall["blocked_s"]["sync"][1:], stall["blocked_s"]["async"][1:]
    ratios = [a / s for a, s in zip(blocked_async, sync, strict=True)]
    throughput = [{"save_every": t["save_every"], **slowdowns(t["runs"])} for t in stall["throughput"]]
    # The bar's run: the largest N at which a synchronous save measured at least the floor (else the costliest).
    meets_floor = [t for t in throughput if t["slowdown_sync"] - 1 >= SYNC_SHARE_FLOOR]
    judged = (
        max(meets_floor, key=lambda t: t["save_every"])
        if meets_floor
        else max(throughput, key=lambda t: t["slowdown_sync"])
    )
    return {
        "first_async_blocked_s": stall["blocked_s"]["async"][0],
        "sync_save_s": statistics.median(sync),
        "async_blocked_s": statistics.median(blocked_async),
        "stall_ratio": statistics.median(blocked_async) / statistics.median(sync),
        "stall_ratio_spread": spread(ratios),
        "stall_ratio_interval": median_interval(ratios),
        "throughput": throughput,
        "judged_save_every": judged["save_every"],
    }


def verdict(median: float, interval: tuple[float, float, float], bar: float, offset: float = 0.0) -> str:
    """Met only when the upper end of the median's confidence interval is within the bar: noise must not decide it.

    ``interval`` is (low, high, coverage) as ``median_interval`` returns it; ``offset`` is subtracted from its ends
    (a slowdown x1.03 is judged as 0.03 against a 5 % bar). Too few repetitions leave an interval whose coverage is
    below the documented confidence: neither "met" nor "not met" then follows from the rule, and the verdict says so.
    """
    upper, coverage = interval[1] - offset, interval[2]
    if coverage < MEDIAN_CONFIDENCE:
        return (
            f"not resolved: the interval holds the median with {coverage:.2%}, below the {MEDIAN_CONFIDENCE:.2%} "
            "the rule asks (at least 5 ratios)"
        )
    if upper <= bar:
        return f"met (upper end {upper:.3f} <= {bar})"
    if median <= bar:
        return f"median within, upper end {upper:.3f} > {bar}: not met"
    return f"not met (median {median:.3f} > {bar})"


def interval_words(interval: tuple[float, float, float]) -> str:
    low, high, coverage = interval
    return f"{coverage:.2%} interval of the median {low:.3f}-{high:.3f}"


def render_body(results: dict) -> str:
    stall = results["stall"]
    figures = summarize(stall)  # from the raw numbers: a file written before a figure existed renders it as well
    judged = figures["judged_save_every"]
    runs = runs_at(stall, judged)

    def per_step(mode: str, key: str) -> str:
        return f"{statistics.median(run[key] for run in runs[mode]):.3f}"

    lines = [
        f"Model: {stall['num_params'] / 1e6:.0f}M parameters (hidden {stall['hidden_size']}, {stall['layers']} layers, "
        f"vocab {stall['vocab']}), fp32, ZeRO-3, {stall['world_size']} processes; a checkpoint is "
        f"{stall['checkpoint_bytes'] / 1e9:.2f} GB; the asynchronous writer held "
        f"{stall['snapshot_bytes_per_rank'] / 1e9:.2f} GB of snapshot per rank. "
        f"{len(stall['blocked_s']['sync'])} saves per mode, interleaved; medians with (min-max) over the saves after "
        "the first, or over the repetitions. The first asynchronous save also allocates the snapshot memory, which "
        f"every later save reuses: it blocked {figures['first_async_blocked_s']:.2f} s. An asynchronous save's blocked "
        "time is the save call plus the wait of the next optimizer step for the copy to host memory "
        f"({stall['update_waits']} of {len(stall['blocked_s']['async'])} saves waited there). The throughput bar is "
        f"judged at the largest save interval N at which a synchronous save measured at least "
        f"{SYNC_SHARE_FLOOR:.0%} of the run (N = {judged} here; N = 1 is always measured too).",
        "",
        "| | synchronous | asynchronous (`async_save=true`) | ratio | bar |",
        "|---|---|---|---|---|",
        f"| training blocked per save (s) | {figures['sync_save_s']:.2f} | {figures['async_blocked_s']:.2f} | "
        f"stall_ratio {figures['stall_ratio']:.3f} ({figures['stall_ratio_spread'][0]:.3f}-"
        f"{figures['stall_ratio_spread'][1]:.3f}; {interval_words(figures['stall_ratio_interval'])}) | "
        f"<= {STALL_BAR}: {verdict(figures['stall_ratio'], figures['stall_ratio_interval'], STALL_BAR)} |",
    ]
    for row in figures["throughput"]:
        every = row["save_every"]
        these = runs_at(stall, every)

        def wall(mode: str, runs: dict = these) -> str:
            return f"{statistics.median(run['wall_s_per_step'] for run in runs[mode]):.3f}"

        bar = (
            f"async within {THROUGHPUT_BAR:.0%}: "
            f"{verdict(row['slowdown_async'] - 1, row['slowdown_async_interval'], THROUGHPUT_BAR, offset=1)}"
            if every == judged
            else "(not the bar's run)"
        )
        lines.append(
            f"| wall s/step, a save every {every} steps (none: {wall('none')}) | {wall('sync')} | {wall('async')} | "
            f"x{row['slowdown_sync']:.3f} / x{row['slowdown_async']:.3f} of no saves "
            f"(async min-max {row['slowdown_async_spread'][0]:.3f}-{row['slowdown_async_spread'][1]:.3f}; "
            f"{interval_words(row['slowdown_async_interval'])}) | "
            f"{bar}; sync costs {row['slowdown_sync'] - 1:.1%} (floor {SYNC_SHARE_FLOOR:.0%}) |"
        )
    lines += [
        f"| training-thread CPU s/step, a save every {judged} (none: {per_step('none', 'cpu_s_per_step')}) | "
        f"{per_step('sync', 'cpu_s_per_step')} | {per_step('async', 'cpu_s_per_step')} | | |",
        f"| CPU s/step of the whole rank, every thread (none: {per_step('none', 'process_cpu_s_per_step')}) | "
        f"{per_step('sync', 'process_cpu_s_per_step')} | {per_step('async', 'process_cpu_s_per_step')} | | |",
        f"| the writer thread's CPU per save (s): copy, write, fsync | | "
        f"{statistics.median(stall['writer_cpu_s']):.2f} | | |",
        "",
        idle_cpu_sentence(stall, judged),
        "",
        baseline_noise_sentence(stall),
        "",
        write_cost_sentence(results["write_cost"]),
        "",
        "Synchronous save time by model size and process count (the same writer, nothing else running):",
        "",
        "| parameters | processes | checkpoint GB | save s (median, min-max) | GB/s |",
        "|---|---|---|---|---|",
    ]
    for row in results["scaling"]:
        median = statistics.median(row["sync_save_s"])
        lines.append(
            f"| {row['num_params'] / 1e6:.0f}M | {row['world_size']} | {row['checkpoint_bytes'] / 1e9:.2f} | "
            f"{median_and_range(row['sync_save_s'])} | {row['checkpoint_bytes'] / 1e9 / median:.2f} |"
        )
    sentence = scaling_sentence(results["scaling"])
    return "\n".join([*lines, "", sentence] if sentence else lines)


def scaling_sentence(scaling: list[dict]) -> str:
    """The scaling the table shows, in words: the exponent of save time in checkpoint bytes (2 processes, smallest
    to largest model), and the time at each process count for the model measured with several."""

    def seconds(row: dict) -> float:
        return statistics.median(row["sync_save_s"])

    by_size = sorted((r for r in scaling if r["world_size"] == 2), key=lambda r: r["checkpoint_bytes"])
    parts = []
    if len(by_size) >= 2 and by_size[-1]["checkpoint_bytes"] > by_size[0]["checkpoint_bytes"]:
        small, large = by_size[0], by_size[-1]
        exponent = math.log(seconds(large) / seconds(small)) / math.log(
            large["checkpoint_bytes"] / small["checkpoint_bytes"]
        )
        shape = "about linear" if 0.8 <= exponent <= 1.2 else ("sublinear" if exponent < 0.8 else "superlinear")
        parts.append(
            f"By size (2 processes): x{large['checkpoint_bytes'] / small['checkpoint_bytes']:.1f} the bytes took "
            f"x{seconds(large) / seconds(small):.1f} the time, save time ~ bytes^{exponent:.2f} ({shape})."
        )
    counts: dict[int, list[dict]] = {}
    for row in scaling:
        counts.setdefault(row["num_params"], []).append(row)
    several = [rows for rows in counts.values() if len(rows) > 1]
    if several:
        rows = sorted(several[0], key=lambda r: r["world_size"])
        times = ", ".join(f"{r['world_size']}: {seconds(r):.2f} s" for r in rows)
        ratio = seconds(rows[-1]) / seconds(rows[0])
        parallel = rows[0]["world_size"] / rows[-1]["world_size"]  # the ratio of a perfectly parallel write
        parts.append(
            f"By process count ({rows[0]['num_params'] / 1e6:.0f}M, the same bytes split over more ranks): {times}; "
            f"x{ratio:.2f} from {rows[0]['world_size']} to {rows[-1]['world_size']} processes"
            + (
                f", close to the x{parallel:.2f} of a perfectly parallel write: each rank writes its own shards."
                if ratio <= 1.25 * parallel
                else f", far from the x{parallel:.2f} of a perfectly parallel write: the ranks write their shards at "
                "once but share one disk and its page cache."
            )
        )
    return " ".join(parts)


def write_cost_sentence(cost: dict) -> str:
    """What each of the writers' changes to a file's save is worth, from ``write_cost``'s figures."""

    def median_of(mode: str, key: str) -> float:
        return statistics.median(run[key] for run in cost[mode])

    parts = [  # the modes the file measured (one from before `in_place` existed has three)
        f"{label}: {median_of(mode, 'cpu_s'):.2f} CPU-s ({median_of(mode, 'wall_s'):.2f} s wall)"
        for mode, label in WRITE_MODES.items()
        if mode in cost
    ]
    return (
        f"What one file's save costs, {cost['megabytes']} MB of fp32 with its fsync, median of "
        f"{len(cost['torch_save'])} interleaved: " + "; ".join(parts) + ". `torch.load` never reads the CRC-32, so "
        "leaving it out loses nothing."
    )


def baseline_noise_sentence(stall: dict) -> str:
    """How much the runs without saves differ among themselves: the same work, so the machine's own variation, which
    the per-repetition ratios (and the upper end the verdict reads) carry as well."""
    parts = []
    for row in stall["throughput"]:
        walls = [run["wall_s_per_step"] for run in row["runs"]["none"]]
        cpus = [run["cpu_s_per_step"] for run in row["runs"]["none"]]
        parts.append(
            f"a save every {row['save_every']}: slowest / fastest x{max(walls) / min(walls):.3f} in wall time, "
            f"x{max(cpus) / min(cpus):.3f} in the training thread's CPU time"
        )
    return (
        f"The machine's own variation: the {len(walls)} runs without saves (the same steps each time) differ by "
        + "; ".join(parts)
        + ". A slowdown smaller than that cannot be told from noise by any one repetition."
    )


def idle_cpu_sentence(stall: dict, every: int) -> str:
    """Whether the background write can hide in the CPU time training leaves idle: the cores' seconds per step
    minus what the ranks use without saves, against what the writer uses per save."""
    runs = runs_at(stall, every)
    wall = statistics.median(run["wall_s_per_step"] for run in runs["none"])
    used = stall["world_size"] * statistics.median(run["process_cpu_s_per_step"] for run in runs["none"])
    idle = max(0.0, stall["cpu_cores"] * wall - used)
    writer = stall["world_size"] * statistics.median(stall["writer_cpu_s"])
    return (
        f"Where the time goes: without saves the {stall['world_size']} ranks use {used:.2f} of the "
        f"{stall['cpu_cores']} cores x {wall:.3f} s = {stall['cpu_cores'] * wall:.2f} CPU-seconds per step, leaving "
        f"{idle:.2f} idle; the writers need {writer:.2f} CPU-seconds per save (all ranks: the copy to host memory, "
        f"the write, fsync). A save every {every} step(s) fits in idle CPU only if {writer:.2f} <= {every} x "
        f"{idle:.2f}; otherwise the writer takes cycles from training and the wall time per step grows, however "
        "little of the save the loop waits for."
    )


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from a checkpoint.json document alone (no clock, no measurement)."""
    return {"checkpoint saves": render_body(document["results"])}


@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=16)
    # 10 saves: 9 ratios after the first, whose 2nd smallest to 2nd largest hold the median with 96.09 %; below 6
    # saves (5 ratios) no interval reaches the verdicts' confidence and the stall verdict reads "not resolved".
    parser.add_argument("--saves", type=int, default=10, help="saves per mode in the stall measurement (>= 2)")
    parser.add_argument("--steps-between", type=int, default=3, help="training steps after each stall save")
    parser.add_argument("--repeats", type=int, default=9, help="repetitions of the throughput runs")
    parser.add_argument("--saves-per-run", type=int, default=2, help="saves in each throughput run")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="process counts for scaling")
    parser.add_argument("--smaller-sizes", type=int, choices=(0, 1, 2), default=2, help="smaller models for scaling")
    parser.add_argument("--write-megabytes", type=int, default=1024, help="file size of the write-cost measurement")
    parser.add_argument("--work-dir", default=None, help="where checkpoints are written (default: a temp folder)")
    add_results_options(parser, RESULTS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one rank
    parser.add_argument("--scaling-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.saves < 2:
        parser.error("--saves must be at least 2: the first asynchronous save is reported apart from the others")
    if args.worker:
        worker(args)
        return
    if args.render:
        render_from_file(args.json, render_sections, DOCS)
        return

    with work_folder(args.work_dir, "zr-checkpoint-bench-") as work:
        hidden, layers = args.hidden_size, args.layers
        stall = run_group(args, work, hidden, layers, 2, scaling=False)
        # The stall model's synchronous saves are its own scaling row; smaller ones have a quarter and half the width.
        smaller = [(max(64, hidden // 4), max(1, layers // 3)), (max(64, hidden // 2), max(1, layers // 2))]
        smaller = smaller[2 - args.smaller_sizes :]
        scaling = [run_group(args, work, h, n, 2, scaling=True) for h, n in smaller]
        scaling.append(
            {**{k: v for k, v in stall.items() if k in SCALING_KEYS}, "sync_save_s": stall["blocked_s"]["sync"]}
        )
        middle = smaller[-1] if smaller else (hidden, layers)
        scaling += [run_group(args, work, *middle, p, scaling=True) for p in args.processes if p != 2]
        results = {"stall": stall, "summary": summarize(stall), "scaling": scaling}
        results["write_cost"] = write_cost(work, args.write_megabytes, repeats=3)
        print(render_body(results))
        save_and_publish(args, results, render_sections, DOCS, disks={"checkpoints": work})


if __name__ == "__main__":
    main()
