"""Keeping freed host memory on a CPU-offload run: host peak, resident memory between steps, CPU time, with and without.

    python bench/allocator_offload.py --reps 3 --steps 12     # ~10 min on 2 cores
    python bench/allocator_offload.py --render                # docs/benchmarks.md from the results file only

``common.host_memory.keep_freed_memory`` fixes glibc's trim and mmap thresholds so that the memory a step frees stays
with the process for the next step (fewer page faults, less CPU per step: the "overhead-allocator" section). The
price is that resident memory no longer falls back after the peak: whatever the peak step allocated stays mapped.
Under CPU offload the host holds the optimizer state (and, with ``offload_param``, the parameters) as well as the
step's activations, so host memory is what such a run is short of first. This bench runs the NLP tiny model's step
(bench/_step_worker.py, the overhead bench's worker) under an offload preset, raw DeepSpeed and Lightning, each with
``ZR_KEEP_FREED_MEMORY=on`` and ``=off``, interleaved in rotated order, a fresh 2-process group each, and reports per
setting, summed over both ranks: peak RSS, resident bytes at the ends of the timed steps (median: what the process
holds between steps, after the peak), CPU time and page faults per step. Its verdict decides whether the offload
presets keep freed memory by default (``common.host_memory.keeps_freed_memory_by_default``).

bench/results/allocator_offload.json is written by this script alone (with provenance); the "allocator-offload"
section of docs/benchmarks.md is rendered from it by ``render_sections``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository, when not installed
from bench._bench_util import (  # noqa: E402
    bench_parser,
    median,
    median_and_range,
    publish_document,
    render_from_file,
    table_head,
    write_results,
)
from bench.overhead import WARMUP, allocator_groups  # noqa: E402

RESULTS = HERE / "results" / "allocator_offload.json"
PRESET = "deepspeed_stage_2_offload"  # optimizer state in host memory: the offload rung a user climbs to first
BACKENDS = ("raw", "lightning")
SETTINGS = {"freed memory kept": "on", "glibc defaults": "off"}  # ZR_KEEP_FREED_MEMORY
MIB = 2**20


def figures(run: dict, warmup: int) -> dict[str, float]:
    """One group's figures, both ranks summed: peak RSS, resident bytes between timed steps, CPU ms and faults."""
    ranks = run["ranks"]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return {
        "peak_rss_bytes": sum(r["peak_rss_bytes"] for r in ranks),
        # every timed step's end, median: what stays resident after the peak step, between steps
        "rss_after_step_bytes": sum(median(r["rss_after_step_bytes"][warmup:]) for r in ranks),
        "cpu_ms": sum(mean(r["cpu_step_times"][warmup:]) for r in ranks) * 1e3,
        "page_faults": sum(mean(r["page_faults_per_step"][warmup:]) for r in ranks),
    }


def measure(reps: int, steps: int) -> dict[str, dict[str, list[dict]]]:
    """runs[setting][backend]: one figures dict per repetition, groups in rotated order."""
    runs: dict[str, dict[str, list[dict]]] = {s: {b: [] for b in BACKENDS} for s in SETTINGS}
    for rep, setting, backend, run in allocator_groups(PRESET, SETTINGS, BACKENDS, reps, steps):
        found = figures(run, WARMUP)
        runs[setting][backend].append(found)
        print(
            f"rep {rep} {setting:>17} {backend:>9}: peak {found['peak_rss_bytes'] / MIB:6.0f} MiB, "
            f"between steps {found['rss_after_step_bytes'] / MIB:6.0f} MiB, CPU {found['cpu_ms']:6.0f} "
            f"ms/step, {found['page_faults']:7.0f} faults/step (both ranks)",
            flush=True,
        )
    return runs


# --- summarising and rendering (pure: results in, Markdown out) ----------------------------------------------


def kept_over_defaults(runs: dict[str, dict[str, list[dict]]], backend: str, key: str) -> list[float]:
    """Kept / glibc's defaults per repetition (the same repetition's), for one figure."""
    kept, default = runs["freed memory kept"][backend], runs["glibc defaults"][backend]
    return [k[key] / d[key] for k, d in zip(kept, default)]


def raises_host_memory(runs: dict[str, dict[str, list[dict]]]) -> bool:
    """The verdict: keeping raised resident memory between steps in every repetition of some backend."""
    return any(min(kept_over_defaults(runs, b, "rss_after_step_bytes")) > 1 for b in BACKENDS)


def ratio_words(values: list[float]) -> str:
    return f"x{median_and_range(values)}"


def render_sections(document: dict) -> dict[str, str]:
    """The "allocator-offload" section of docs/benchmarks.md from a read results document."""
    results = document["results"]
    runs, preset, reps = results["runs"], results["preset"], results["reps"]
    lines = table_head(
        "backend",
        "host memory",
        "peak RSS MiB",
        "resident between steps MiB",
        "CPU ms / step",
        "page faults / step",
    )
    for backend in BACKENDS:
        for setting in SETTINGS:
            rows = runs[setting][backend]
            lines.append(
                f"| {backend} | {setting} | {median([r['peak_rss_bytes'] for r in rows]) / MIB:,.0f} | "
                f"{median([r['rss_after_step_bytes'] for r in rows]) / MIB:,.0f} | "
                f"{median([r['cpu_ms'] for r in rows]):.0f} | {median([r['page_faults'] for r in rows]):,.0f} |"
            )
    effects = "; ".join(
        f"{b}: resident between steps {ratio_words(kept_over_defaults(runs, b, 'rss_after_step_bytes'))}, peak "
        f"{ratio_words(kept_over_defaults(runs, b, 'peak_rss_bytes'))}, CPU time per step "
        f"{ratio_words(kept_over_defaults(runs, b, 'cpu_ms'))}"
        for b in BACKENDS
    )
    if raises_host_memory(runs):
        verdict = (
            "**Keeping the freed memory raises host memory on an offload run, so the offload presets do not keep it "
            "by default** (`common.host_memory.keeps_freed_memory_by_default`: off when the DeepSpeed config offloads "
            "the optimizer or the parameters); `ZR_KEEP_FREED_MEMORY=on` keeps it there too."
        )
    else:
        verdict = (
            "Keeping the freed memory did not raise resident memory here in every repetition, so the offload presets "
            "keep it by default like the others; `ZR_KEEP_FREED_MEMORY=off` gives it back."
        )
    return {
        "allocator-offload": "\n".join(
            [
                f"The allocator setting of the section above on a CPU-offload run ({preset}: the optimizer state in "
                "host memory), the NLP tiny model's step. Kept / glibc's defaults, median (min-max) over the "
                f"repetitions: {effects}. {verdict}",
                "",
                *lines,
                "",
                f"{reps} interleaved repetitions (order rotated), {results['steps']} steps each, the first "
                f"{results['warmup']} not counted; each a fresh 2-process group (`ZR_KEEP_FREED_MEMORY=on` / `off`). "
                "Both ranks summed: peak RSS is the kernel's high-water mark; resident between steps is the median "
                "of the resident memory at the end of each counted step, after the peak.",
            ]
        )
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help=f"optimizer steps per group, the first {WARMUP} warm-up")
    args = parser.parse_args()
    if args.render:
        render_from_file(RESULTS, render_sections)
        return
    if args.reps < 1 or args.steps <= WARMUP:
        parser.error(f"need --reps >= 1 and --steps > {WARMUP} (the warm-up steps)")
    results = {"preset": PRESET, "reps": args.reps, "steps": args.steps, "warmup": WARMUP}
    results["runs"] = measure(args.reps, args.steps)
    document = write_results(RESULTS, results)
    publish_document(document, render_sections)
    print(render_sections(document)["allocator-offload"])


if __name__ == "__main__":
    main()
