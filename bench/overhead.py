"""Framework overhead: the NLP tiny model's training step through Lightning and Accelerate vs raw DeepSpeed.

    python bench/overhead.py --reps 5 --steps 20 --profile     # stages 2 and 3, allocator, profile (~15 min)
    python bench/overhead.py --allocator-only --allocator-reps 3   # the allocator comparison alone (~8 min)
    python bench/overhead.py --render                          # docs/benchmarks.md from the results files only

Same model (Llama tiny, 5.3M params), same resolved DeepSpeed config, same data, 2 CPU processes
(bench/_step_worker.py). Repetitions are interleaved: each repetition runs every preset under raw, Lightning
and Accelerate, in an order rotated from one repetition to the next, so that load drifts on this shared
machine hit all three alike. A repetition's ratio is backend / raw of the same repetition; the reported
ratio is the median over repetitions, with their min-max as the spread.

Two measures per step, side by side:
- CPU time (the verdict): ``time.process_time`` of every rank, summed over ranks, mean per timed step. It
  counts only the cycles the ranks' own threads ran, so time spent waiting for a core that other work on
  the machine holds (or for the other rank at a collective) is not in it: the extra Python and copies a
  framework adds per step are. Load moves it by a few percent (shared caches), not by the 2x it moves wall
  time here.
- Wall time: rank 0's median step. Shown beside, because it is what a user waits for, and because overhead
  that is waiting rather than work (an extra barrier) would show only there.
The goal (<= 1.05x raw DeepSpeed) holds for a preset and backend only when the upper end of the CPU-time
spread is <= 1.05. Every process, raw DeepSpeed's included, keeps the host memory a step frees
(common/host_memory.py, as the recipes' processes do); beside the table, each backend's minor page faults per
step, and (``--allocator-reps``) stage 2 under raw DeepSpeed and Lightning once more with glibc's default
thresholds, which is where Lightning's stage-2 overhead went before. ``--profile`` then runs one cProfiled group
per backend (the last preset; rank 0, timed by the thread's CPU time) and tabulates where a step's time goes, by
package.

How much the allocator setting saves depends on the torch build (common/host_memory.py): ``--allocator-only``
measures that comparison alone into bench/results/overhead_allocator.json, rendered as the "overhead-allocator"
section beside the overhead table; run it under the build to compare (the README's unpinned install gives the
default CUDA build of torch, the table above it was measured with the CPU build).

bench/results/overhead.json and overhead_allocator.json are written by this script alone
(bench/_bench_util.write_results, with provenance); the "overhead", "overhead-profile" and "overhead-allocator"
sections of docs/benchmarks.md are rendered from them by ``render_sections`` (``--render`` re-renders them without
measuring).
"""

from __future__ import annotations

import argparse
import json
import pstats
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed
from bench._bench_util import (  # noqa: E402
    bench_parser,
    environment,
    launch_group,
    load_document,
    median,
    median_and_range,
    publish_document,
    rotated,
    spread,
    table_head,
    write_results,
)
from common.errors import nearest  # noqa: E402
from common.host_memory import SWITCH_ENV as KEEP_FREED_MEMORY_ENV  # noqa: E402
from common.presets import PRESET_NAMES  # noqa: E402

BACKENDS = ("raw", "lightning", "accelerate")
FRAMEWORKS = ("lightning", "accelerate")
MEASURES = {"cpu_ms": "CPU time", "wall_ms": "wall time"}  # the first is the verdict
WARMUP = 4
GOAL = 1.05
RESULTS = HERE / "results" / "overhead.json"
ALLOCATOR_RESULTS = HERE / "results" / "overhead_allocator.json"  # --allocator-only: the comparison under one build
# Where the stage-2 Lightning overhead went (page faults): one preset, raw DeepSpeed and Lightning, each with glibc's
# default thresholds and with the host memory kept (common/host_memory.py), interleaved.
ALLOCATOR_PRESET = "deepspeed_stage_2"
ALLOCATOR_BACKENDS = ("raw", "lightning")
ALLOCATOR_SETTINGS = {"glibc defaults": "off", "freed memory kept": None}  # ZR_KEEP_FREED_MEMORY
# Where a function's file lives decides whose time it is (first match wins).
AREAS = (
    ("lightning", ("/lightning/", "/lightning_fabric/", "/pytorch_lightning/", "/torchmetrics/")),
    ("accelerate", ("/accelerate/",)),
    ("deepspeed", ("/deepspeed/",)),
    ("transformers (model code)", ("/transformers/",)),
    ("torch", ("/torch/",)),
    ("bench + project", ("/bench/", "/common/", "/nlp/")),
)


# --- measuring ---------------------------------------------------------------------------------------


def run_step_worker(backend: str, preset: str, steps: int, out: Path, profile: Path | None = None) -> dict:
    """One 2-process group of bench/_step_worker.py under ``backend``: what its rank 0 wrote to ``out``."""
    args = ["--backend", backend, "--preset", preset, "--steps", str(steps), "--out", str(out)]
    if profile is not None:
        args += ["--profile", str(profile)]
    try:
        launch_group(HERE / "_step_worker.py", backend, preset, args)
    except RuntimeError as err:
        # Seen here once in ~30 groups: a rank aborts at exit ("terminate called without an active exception",
        # a C++ thread torn down at interpreter shutdown). One failed launch must not throw away the other
        # repetitions: run the group again, once, and say so; a second failure is real.
        last = str(err).strip().splitlines()[-1] if str(err).strip() else "?"
        print(f"  {backend} {preset} failed ({last}); running it again once", flush=True)
        launch_group(HERE / "_step_worker.py", backend, preset, args)
    return json.loads(out.read_text())


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def step_figures(run: dict, warmup: int) -> dict[str, float]:
    """One group's per-step figures (ms) over the steps after warm-up.

    CPU times are means (every bit of work counts, also work that comes every few steps), summed over ranks
    (the work of the whole step); wall time is rank 0's median (a step slowed by other work does not count).
    """
    ranks = run["ranks"]
    return {
        "wall_ms": median(run["step_times"][warmup:]) * 1e3,
        "cpu_ms": sum(mean(r["cpu_step_times"][warmup:]) for r in ranks) * 1e3,
        "thread_cpu_ms": sum(mean(r["thread_cpu_step_times"][warmup:]) for r in ranks) * 1e3,
        # minor page faults (both ranks): memory glibc gave back and the step maps again (common/host_memory.py)
        "page_faults": sum(mean(r["page_faults_per_step"][warmup:]) for r in ranks),
    }


def measure(presets: list[str], reps: int, steps: int) -> dict[str, dict[str, list[dict]]]:
    """Per preset and backend, one figures dict per repetition (in repetition order)."""
    runs: dict[str, dict[str, list[dict]]] = {p: {b: [] for b in BACKENDS} for p in presets}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for preset in presets:
                for backend in rotated(BACKENDS, rep):
                    run = run_step_worker(backend, preset, steps, Path(tmp) / f"{backend}-{preset}-{rep}.json")
                    figures = step_figures(run, WARMUP)
                    runs[preset][backend].append(figures)
                    print(
                        f"rep {rep} {preset:>18} {backend:>10}: CPU {figures['cpu_ms']:7.1f} ms/step (both ranks), "
                        f"wall {figures['wall_ms']:7.1f} ms/step",
                        flush=True,
                    )
    return runs


def allocator_groups(
    preset: str, settings: dict[str, str | None], backends: tuple[str, ...], reps: int, steps: int
) -> Iterator[tuple[int, str, str, dict]]:
    """(repetition, setting, backend, the worker's result) of every group: each repetition runs every backend under
    every ``ZR_KEEP_FREED_MEMORY`` value of ``settings`` (setting name -> value, None: unset), in an order rotated
    from one repetition to the next, a fresh group each."""
    groups = tuple((setting, backend) for setting in settings for backend in backends)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for setting, backend in rotated(groups, rep):
                with environment({KEEP_FREED_MEMORY_ENV: settings[setting]}):
                    run = run_step_worker(backend, preset, steps, Path(tmp) / f"{backend}.json")
                yield rep, setting, backend, run


def measure_allocator(reps: int, steps: int) -> dict[str, dict[str, list[dict]]]:
    """runs[setting][backend]: one figures dict per repetition, settings and backends in rotated order."""
    runs: dict[str, dict[str, list[dict]]] = {s: {b: [] for b in ALLOCATOR_BACKENDS} for s in ALLOCATOR_SETTINGS}
    for rep, setting, backend, run in allocator_groups(
        ALLOCATOR_PRESET, ALLOCATOR_SETTINGS, ALLOCATOR_BACKENDS, reps, steps
    ):
        figures = step_figures(run, WARMUP)
        runs[setting][backend].append(figures)
        print(
            f"rep {rep} {setting:>17} {backend:>10}: CPU {figures['cpu_ms']:7.1f} ms/step (both ranks), "
            f"{figures['page_faults']:8.0f} page faults/step",
            flush=True,
        )
    return runs


TORCH_OPS = "torch C++ ops (forward, backward, Adam)"


def area_of(filename: str, func: str = "") -> str:
    if filename == "~":  # a C function: name it by what it belongs to
        if "c10d" in func or "wait" in func:
            return "collectives (gloo)"
        if "torch" in func or "run_backward" in func:
            return TORCH_OPS
        return "python builtins"
    for area, needles in AREAS:
        if any(n in filename for n in needles):
            return area
    return "other python (stdlib, site-packages)"


def call_row(key: tuple[str, int, str], ncalls: int, tottime: float, steps: int) -> list:
    """One function of a cProfile dump: ``[where(function), own ms a step, calls a step]``."""
    filename, line, func = key
    return [f"{filename.split('site-packages/')[-1]}:{line}({func})", tottime * 1e3 / steps, round(ncalls / steps)]


def breakdown(profile: Path, timed_steps: int, top: int = 8) -> dict:
    """CPU ms per step by area (own time), and the top framework functions by own time (ms/step, calls/step)."""
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    areas: dict[str, float] = {}
    framework = []
    for (filename, line, func), (_, ncalls, tottime, _, _) in stats.items():
        area = area_of(filename, func)
        areas[area] = areas.get(area, 0.0) + tottime * 1e3 / timed_steps
        if area in ("lightning", "accelerate", "deepspeed") or "{method 'item'" in func or "all_reduce" in func:
            framework.append(call_row((filename, line, func), ncalls, tottime, timed_steps))
    framework.sort(key=lambda item: -item[1])
    return {"areas": areas, "framework_calls": framework[:top]}


def profile(preset: str, steps: int) -> dict:
    """One cProfiled group per backend: rank 0's CPU time per step by area, and its costliest framework calls."""
    backends = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in BACKENDS:
            prof = Path(tmp) / f"{backend}.prof"
            run = run_step_worker(backend, preset, steps, Path(tmp) / f"{backend}.json", prof)
            after = run["profile_after"]  # the worker profiles the steps after this many
            rank0_cpu = run["ranks"][0]["thread_cpu_step_times"][after:]
            backends[backend] = {"thread_cpu_ms": mean(rank0_cpu) * 1e3, **breakdown(prof, steps - after)}
            print(f"profile {preset} {backend}: {backends[backend]['thread_cpu_ms']:.1f} ms CPU/step", flush=True)
    return {"preset": preset, "steps": steps, "after": after, "backends": backends}


# --- summarising and rendering (pure: results in, numbers and Markdown out) ---------------------------


def ratios(runs: dict[str, list[dict]], backend: str, key: str) -> list[float]:
    """backend / raw per repetition, each against the raw run of the same repetition."""
    return [mine[key] / raw[key] for mine, raw in zip(runs[backend], runs["raw"])]


def summarize(runs: dict[str, list[dict]], backend: str) -> dict[str, dict[str, float]]:
    """Median and min-max of the per-repetition ratios, for each measure."""
    summary = {}
    for key in (*MEASURES, "thread_cpu_ms"):
        values = ratios(runs, backend, key)
        low, high = spread(values)
        summary[key] = {"median": median(values), "min": low, "max": high}
    return summary


def goal_met(summary: dict[str, dict[str, float]]) -> bool:
    """The goal holds when even the worst repetition's CPU-time ratio is within it."""
    return summary["cpu_ms"]["max"] <= GOAL


def render_overhead(results: dict) -> str:
    settings, runs = results["settings"], results["runs"]
    lines = table_head(
        "preset",
        "backend",
        "CPU-time ratio: median (min-max)",
        "wall-time ratio: median (min-max)",
        "raw CPU ms/step",
        "raw wall ms/step",
        f"goal <= {GOAL} (CPU, worst rep)",
    )
    verdicts = []
    for preset, by_backend in runs.items():
        for backend in FRAMEWORKS:
            summary = summarize(by_backend, backend)
            cells = [ratio_cell(summary[key]) for key in MEASURES]
            met = goal_met(summary)
            verdicts.append(met)
            raw = by_backend["raw"]
            lines.append(
                f"| {preset} | {backend} | {cells[0]} | {cells[1]} | "
                f"{median([r['cpu_ms'] for r in raw]):.0f} | {median([r['wall_ms'] for r in raw]):.0f} | "
                f"{'met' if met else 'not met'} |"
            )
    timed = settings["steps"] - settings["warmup"]
    outcome = (
        f"**The goal holds for every preset and backend**: the highest CPU-time ratio of any repetition is "
        f"{max_ratio(runs, 'cpu_ms'):.3f}."
        if all(verdicts)
        else f"**The goal does not hold everywhere**: the highest CPU-time ratio of any repetition is "
        f"{max_ratio(runs, 'cpu_ms'):.3f}."
    )
    summaries = [summarize(by_backend, b) for by_backend in runs.values() for b in FRAMEWORKS]
    cpus, walls = [s["cpu_ms"] for s in summaries], [s["wall_ms"] for s in summaries]
    raw_walls = [r["wall_ms"] for by_backend in runs.values() for r in by_backend["raw"]]
    raw_cpus = [r["cpu_ms"] for by_backend in runs.values() for r in by_backend["raw"]]
    return "\n".join(
        [
            outcome,
            "",
            *lines,
            "",
            f"{settings['reps']} interleaved repetitions (backend order rotated each time) x {timed} timed steps after "
            f"{settings['warmup']} warm-up; each repetition launches a fresh 2-process group per backend. A ratio is "
            "backend / raw DeepSpeed of the same repetition. **CPU time is the verdict**: the ranks' "
            "`time.process_time` summed over both ranks, mean per step. It counts only work the ranks' own "
            "threads did, so waiting for a core held by other work on this shared machine, or for the other rank "
            "at a collective, is not in it; the Python and copies a framework adds are. Wall time (rank 0's "
            "median step) is shown beside: it is what a user waits for, and overhead that is waiting rather than "
            "work would show only there. Across all repetitions the raw runs' wall time per step ranged "
            f"{min(raw_walls):.0f}-{max(raw_walls):.0f} ms and their CPU time "
            f"{min(raw_cpus):.0f}-{max(raw_cpus):.0f} ms "
            f"(both ranks); the backends' CPU-time ratios spread over {min(c['min'] for c in cpus):.3f}-"
            f"{max(c['max'] for c in cpus):.3f}, their wall-time ratios over {min(w['min'] for w in walls):.3f}-"
            f"{max(w['max'] for w in walls):.3f}.",
            *(["", sentence] if (sentence := page_fault_sentence(runs)) else []),
        ]
    )


def page_fault_sentence(runs: dict[str, dict[str, list[dict]]]) -> str:
    """Minor page faults per step, median over repetitions, per preset and backend (CPU time the allocator costs)."""
    parts = [
        f"{preset}: " + ", ".join(f"{b} {median([r['page_faults'] for r in by_backend[b]]):,.0f}" for b in BACKENDS)
        for preset, by_backend in runs.items()
        if all("page_faults" in r for b in BACKENDS for r in by_backend[b])
    ]
    if not parts:
        return ""
    return (
        "Minor page faults per step (both ranks, median over the repetitions): " + "; ".join(parts) + ". Every "
        "process, raw DeepSpeed's included, keeps the host memory a step frees for the next "
        "(`common.host_memory.keep_freed_memory`, which the factory's adapters call)."
    )


def render_allocator(allocator: dict) -> str:
    """Page faults and CPU time per step with glibc's defaults and with freed memory kept, and Lightning / raw."""
    runs, preset = allocator["runs"], allocator["preset"]
    lines = table_head(
        "host memory",
        "raw: page faults / step",
        "lightning: page faults / step",
        "raw: CPU ms / step",
        "lightning / raw, CPU time: median (min-max)",
    )
    figures = {}
    for setting, by_backend in runs.items():
        faults = {b: median([r["page_faults"] for r in by_backend[b]]) for b in ALLOCATOR_BACKENDS}
        cpu = summarize(by_backend, "lightning")["cpu_ms"]
        figures[setting] = (faults, cpu)
        lines.append(
            f"| {setting} | {faults['raw']:,.0f} | {faults['lightning']:,.0f} | "
            f"{median([r['cpu_ms'] for r in by_backend['raw']]):.0f} | {ratio_cell(cpu)} |"
        )
    (default_faults, default_cpu), (kept_faults, kept_cpu) = (figures[s] for s in ALLOCATOR_SETTINGS)
    reps = len(next(iter(runs.values()))["raw"])
    return "\n".join(
        [
            f"Where the time went ({preset}): a minor page fault is a page of memory the kernel maps and zeroes "
            "because the process gave it back to the kernel and asks for it again. glibc gives back memory that is "
            "free at the top of its heap and serves large requests with fresh mappings, both under thresholds that "
            "move with what the program freed before, so how often a training step faults depends on the order in "
            "which a loop frees its tensors, not on the arithmetic. With glibc's defaults Lightning's loop faulted "
            f"{default_faults['lightning']:,.0f} times per step against raw DeepSpeed's "
            f"{default_faults['raw']:,.0f}, and its CPU time per step was {default_cpu['median']:.3f}x raw's "
            f"({default_cpu['min']:.3f}-{default_cpu['max']:.3f}); with the freed memory kept "
            f"(`common.host_memory.keep_freed_memory`: fixed thresholds) the two faulted "
            f"{kept_faults['lightning']:,.0f} and {kept_faults['raw']:,.0f} times, and the ratio was "
            f"{kept_cpu['median']:.3f} ({kept_cpu['min']:.3f}-{kept_cpu['max']:.3f}).",
            "",
            *lines,
            "",
            f"{reps} interleaved repetitions (order rotated), each a fresh 2-process group "
            "(`ZR_KEEP_FREED_MEMORY=off` for glibc's defaults), page faults and CPU time summed over both ranks.",
        ]
    )


def kept_over_defaults(runs: dict[str, dict[str, list[dict]]], backend: str) -> list[float]:
    """CPU time per step with freed memory kept / with glibc's defaults, per repetition (the same repetition's)."""
    kept, default = (runs[setting][backend] for setting in ("freed memory kept", "glibc defaults"))
    return [k["cpu_ms"] / d["cpu_ms"] for k, d in zip(kept, default)]


def effect_words(ratios_: list[float]) -> str:
    """What a backend's kept / defaults CPU-time ratios say, in words, with median and min-max."""
    low, high = spread(ratios_)
    figures = f"x{median_and_range(ratios_, digits=3)}"
    if high < 1:
        return f"helps: CPU time per step {figures}, lower in every repetition"
    if low > 1:
        return f"costs CPU time: {figures}, higher in every repetition"
    return f"no effect beyond the noise: {figures}, on both sides of 1"


def build_words(torch_build: str, cuda: str | None) -> str:
    """``2.14.1+cu130`` and CUDA ``13.0`` -> what kind of torch build ran, in words ("" when the results do not say)."""
    if cuda:
        return (
            f' (a CUDA {cuda} build, run on this CPU: the build the README\'s unpinned `pip install -e ".[dev]"` '
            "installs where pip finds no other)"
        )
    return " (a CPU build)" if torch_build.endswith("+cpu") else ""


def render_allocator_build(allocator: dict, torch_version: str) -> str:
    """The allocator comparison under one torch build: page faults, CPU time, and whether keeping still helps."""
    runs, preset = allocator["runs"], allocator["preset"]
    torch_version = allocator.get("torch_build", torch_version)
    build = build_words(torch_version, allocator.get("torch_cuda"))
    lines = table_head(
        "host memory",
        "raw: page faults / step",
        "lightning: page faults / step",
        "raw: CPU ms / step",
        "lightning: CPU ms / step",
        "lightning / raw, CPU time: median (min-max)",
    )
    for setting, by_backend in runs.items():
        faults = {b: median([r["page_faults"] for r in by_backend[b]]) for b in ALLOCATOR_BACKENDS}
        cpu = {b: median([r["cpu_ms"] for r in by_backend[b]]) for b in ALLOCATOR_BACKENDS}
        lines.append(
            f"| {setting} | {faults['raw']:,.0f} | {faults['lightning']:,.0f} | {cpu['raw']:.0f} | "
            f"{cpu['lightning']:.0f} | {ratio_cell(summarize(by_backend, 'lightning')['cpu_ms'])} |"
        )
    reps = len(next(iter(runs.values()))["raw"])
    verdicts = "; ".join(f"{b}: {effect_words(kept_over_defaults(runs, b))}" for b in ALLOCATOR_BACKENDS)
    return "\n".join(
        [
            f"The allocator comparison above, rerun under torch {torch_version}{build}. How much memory glibc gives "
            "back under its defaults depends on what the process allocated before, so on the build "
            f"(`common/host_memory.py`). Keeping the freed memory, {preset}, kept / glibc's defaults per "
            f"repetition: {verdicts}.",
            "",
            *lines,
            "",
            f"{reps} interleaved repetitions (order rotated), each a fresh 2-process group "
            "(`ZR_KEEP_FREED_MEMORY=off` for glibc's defaults), page faults and CPU time summed over both ranks.",
        ]
    )


def ratio_cell(summary: dict[str, float]) -> str:
    return f"**{summary['median']:.3f}** ({summary['min']:.3f}-{summary['max']:.3f})"


def max_ratio(runs: dict[str, dict[str, list[dict]]], key: str) -> float:
    return max(max(ratios(by_backend, b, key)) for by_backend in runs.values() for b in FRAMEWORKS)


def render_profile(prof: dict) -> str:
    backends = prof["backends"]
    timed = prof["steps"] - prof["after"]
    raw_areas = backends["raw"]["areas"]
    # Ties broken by name: a set's order changes from one process to the next (hash randomisation).
    names = sorted({a for b in backends.values() for a in b["areas"]}, key=lambda a: (-raw_areas.get(a, 0.0), a))
    lines = [
        f"cProfile on rank 0, {prof['preset']}, {timed} steps after {prof['after']}, timed by the training thread's "
        "CPU time: own CPU ms per step by the package whose code ran it (profiling slows every call; compare "
        "columns, not with the table above). Waiting is not CPU time, so collectives show only their own work.",
        "",
        *table_head("area", *BACKENDS),
        "| thread CPU ms per step (profiled) | "
        + " | ".join(f"{backends[b]['thread_cpu_ms']:.0f}" for b in BACKENDS)
        + " |",
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{backends[b]['areas'].get(name, 0.0):.1f}" for b in BACKENDS) + " |")
    for backend in (*FRAMEWORKS, "raw"):
        own = backends[backend]["areas"].get(backend, 0.0) if backend != "raw" else 0.0
        share = f" ({own:.1f} ms per step in {backend}'s own code)" if backend != "raw" else ""
        lines += ["", f"Costliest framework calls under {backend}{share} (own CPU ms per step, calls per step):", ""]
        calls = backends[backend]["framework_calls"]
        lines += [f"- `{where}`: {ms:.2f} ms, {n} calls" for where, ms, n in calls]
    return "\n".join(lines)


def render_sections(document: dict) -> dict[str, str]:
    """The docs/benchmarks.md sections this bench owns, as Markdown bodies, from a read results document.

    ``document`` is ``{"provenance": ..., "results": ...}`` as bench/_bench_util.read_results returns it;
    the "Command:" line above each body comes from the provenance (bench/_bench_util.publish_sections).
    """
    results = document["results"]
    if "allocator_only" in results:  # overhead_allocator.json
        torch_version = document["provenance"]["versions"]["torch"]
        return {"overhead-allocator": render_allocator_build(results["allocator_only"], torch_version)}
    sections = {"overhead": render_overhead(results)}
    if results.get("allocator"):
        sections["overhead"] += "\n\n" + render_allocator(results["allocator"])
    if results.get("profile"):
        sections["overhead-profile"] = render_profile(results["profile"]) + "\n\n" + reading(results)
    return sections


def reading(results: dict) -> str:
    """What the profile says about the table: each framework's own CPU per step against the spread of its ratios."""
    prof, runs = results["profile"], results["runs"]
    raw_ms = prof["backends"]["raw"]["thread_cpu_ms"]
    lines = ["What the two sections say together:", ""]
    for backend in FRAMEWORKS:
        own = prof["backends"][backend]["areas"].get(backend, 0.0)
        cpu = [summarize(by_backend, backend)["cpu_ms"] for by_backend in runs.values()]
        lines.append(
            f"- {backend}: its own code costs {own:.1f} ms of CPU per step on rank 0 ({own / raw_ms:.1%} of raw "
            f"DeepSpeed's profiled {raw_ms:.0f} ms), while its per-repetition CPU-time ratios spread over "
            f"{min(c['min'] for c in cpu):.3f}-{max(c['max'] for c in cpu):.3f} (all presets)."
        )
    torch_ops = [b["areas"].get(TORCH_OPS, 0.0) for b in prof["backends"].values()]
    lines += [
        "",
        f"The {TORCH_OPS} row, the same operations under every backend, spans {min(torch_ops):.0f}-"
        f"{max(torch_ops):.0f} ms per step across the columns ({max(torch_ops) / min(torch_ops) - 1:.1%}): other "
        "work on this shared machine slows the same instructions (cache and memory traffic), so a CPU-time ratio "
        "of one repetition carries noise of that size. A spread on both sides of 1 is that noise; a spread wholly "
        "above 1 by more than the framework's own code is work the framework causes in DeepSpeed or torch.",
    ]
    return "\n".join(lines)


# --- command line ------------------------------------------------------------------------------------


def parse_presets(parser: argparse.ArgumentParser, text: str) -> list[str]:
    presets = [p.strip() for p in text.split(",") if p.strip()]
    for preset in presets:
        if preset not in PRESET_NAMES:
            parser.error(f"unknown preset {preset!r}{nearest(preset, PRESET_NAMES)}; valid: {', '.join(PRESET_NAMES)}")
    if not presets:
        parser.error("--presets is empty; e.g. --presets deepspeed_stage_2,deepspeed_stage_3")
    return presets


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--presets", default=None, help="default: deepspeed_stage_2,deepspeed_stage_3")
    parser.add_argument("--reps", type=int, default=None, help="default: 5")
    parser.add_argument("--steps", type=int, default=20, help=f"optimizer steps per run, the first {WARMUP} warm-up")
    parser.add_argument("--profile", action="store_true", help="after measuring, profile the last preset per backend")
    parser.add_argument("--profile-steps", type=int, default=12)
    parser.add_argument(
        "--allocator-reps",
        type=int,
        default=3,
        help=f"repetitions of {ALLOCATOR_PRESET} (raw, Lightning) with glibc's default thresholds and with freed "
        "host memory kept (0: skip)",
    )
    parser.add_argument(
        "--allocator-only",
        action="store_true",
        help=f"measure only the allocator comparison (--allocator-reps, --steps) into {ALLOCATOR_RESULTS.name}",
    )
    args = parser.parse_args()
    if args.render:
        for path in (RESULTS, ALLOCATOR_RESULTS):
            try:
                document = load_document(path)
            except (OSError, ValueError) as err:
                parser.error(f"cannot render: {err}")
            publish_document(document, render_sections)
        return
    if args.allocator_only:
        for value, option in ((args.presets, "--presets"), (args.reps, "--reps"), (args.profile, "--profile")):
            if value:
                parser.error(f"{option} applies to the overhead table, not to --allocator-only")
        if args.allocator_reps < 1 or args.steps <= WARMUP:
            parser.error(f"--allocator-only needs --allocator-reps >= 1 and --steps > {WARMUP} (the warm-up steps)")
        import torch  # the build the groups ran with (the same interpreter): its local label and CUDA version

        allocator = {
            "preset": ALLOCATOR_PRESET,
            "torch_build": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "runs": measure_allocator(args.allocator_reps, args.steps),
        }
        document = write_results(
            ALLOCATOR_RESULTS, {"steps": args.steps, "warmup": WARMUP, "allocator_only": allocator}
        )
        publish_document(document, render_sections)
        print(render_sections(document)["overhead-allocator"])
        return
    presets = parse_presets(parser, args.presets or "deepspeed_stage_2,deepspeed_stage_3")
    args.reps = 5 if args.reps is None else args.reps
    if args.reps < 1 or args.allocator_reps < 0 or args.steps <= WARMUP or args.profile_steps <= WARMUP:
        parser.error(
            f"need --reps >= 1, --allocator-reps >= 0, and --steps and --profile-steps > {WARMUP} (the warm-up steps)"
        )
    results = {
        "settings": {"presets": presets, "reps": args.reps, "steps": args.steps, "warmup": WARMUP, "goal": GOAL},
        "runs": measure(presets, args.reps, args.steps),
        "allocator": None,
        "profile": None,
    }
    document = write_results(RESULTS, results)  # kept should the allocator runs or the profile fail
    if args.allocator_reps > 0:
        results["allocator"] = {"preset": ALLOCATOR_PRESET, "runs": measure_allocator(args.allocator_reps, args.steps)}
        document = write_results(RESULTS, results)
    if args.profile:
        results["profile"] = profile(presets[-1], args.profile_steps)
        document = write_results(RESULTS, results)
    publish_document(document, render_sections)
    for body in render_sections(document).values():
        print(body + "\n")


if __name__ == "__main__":
    main()
