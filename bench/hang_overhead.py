"""What hang detection costs a healthy run: the same training steps with it off, on, and on with torch's checks.

    python bench/hang_overhead.py --reps 3 --steps 14      # stages 2 and 3, Lightning and Accelerate (~15 min)
    python bench/hang_overhead.py --render                 # docs/benchmarks.md from the results file only

The run is bench/_step_worker.py (the NLP tiny model, 5.3M parameters, bf16, 2 CPU processes), which builds its
Trainer / Accelerator through the factory (``lightning_trainer_kwargs`` / ``accelerator_kwargs``): hang
detection (common/hang.py: a watchdog thread per rank polling the store once a second, faulthandler, torch's
flight recorder as torch ships it) is on there unless ``ZR_HANG_DETECTION=off``. Three variants per preset and
backend, interleaved and rotated from one repetition to the next so that load drifts on this shared machine hit
all alike:
- ``off``: ``ZR_HANG_DETECTION=off`` (the baseline);
- ``on``: the default every recipe runs with;
- ``on + DETAIL``: also ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, torch's cross-rank check before every collective
  (opt-in: it names a desync exactly, docs/troubleshooting.md).
A repetition's ratio is variant / off of the same repetition; the table shows the median over repetitions and
their min-max, in CPU time per step (both ranks' ``time.process_time``, summed; the verdict, as in
bench/overhead.py) beside rank 0's median wall time per step. Goal: ``on`` within 2 % of ``off``.

bench/results/hang_overhead.json is written by this script alone (bench/_bench_util.write_results, with
provenance); the "hang-overhead" section of docs/benchmarks.md is rendered from it by ``render_sections``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed
from bench._bench_util import (  # noqa: E402
    bench_parser,
    environment,
    load_document,
    median,
    publish_document,
    rotated,
    spread,
    table_head,
    write_results,
)
from bench.overhead import WARMUP, parse_presets, run_step_worker, step_figures  # noqa: E402
from common.hang import POLL_S, SWITCH_ENV  # noqa: E402

RESULTS = HERE / "results" / "hang_overhead.json"
BACKENDS = ("lightning", "accelerate")
# variant -> the environment it runs with (None: the variable is removed)
VARIANTS = {
    "off": {SWITCH_ENV: "off", "TORCH_DISTRIBUTED_DEBUG": None},
    "on": {SWITCH_ENV: None, "TORCH_DISTRIBUTED_DEBUG": None},
    "on + DETAIL": {SWITCH_ENV: None, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
}
MEASURES = {"cpu_ms": "CPU time", "wall_ms": "wall time"}  # the first is the verdict
GOAL = 1.02


def run_variant(backend: str, preset: str, variant: str, steps: int, out: Path) -> dict[str, float]:
    """One group of the step worker under ``variant``'s environment: its per-step figures and the watchdog's share."""
    with environment(VARIANTS[variant]):
        run = run_step_worker(backend, preset, steps, out)
    figures = step_figures(run, WARMUP)
    figures["watchdog_cpu_ms"] = watchdog_cpu_per_step_ms(run["ranks"], figures["wall_ms"])
    return figures


def watchdog_cpu_per_step_ms(ranks: list[dict], step_wall_ms: float) -> float:
    """The watchdog threads' own CPU time per training step, both ranks summed: measured directly, so that noise
    from other work cannot hide or invent it. Each rank's watchdog wakes every ``POLL_S`` seconds whatever the
    step does; its CPU per wake-up (its thread's ``time.thread_time`` over its wake-ups, start-up included, so an
    upper figure) times the wake-ups that fall in one step. 0 when hang detection is off."""
    total = 0.0
    for rank in ranks:
        watchdog = rank.get("hang_watchdog")
        if watchdog and watchdog["polls"]:
            total += watchdog["cpu_s"] / watchdog["polls"] * 1e3 * step_wall_ms / (POLL_S * 1e3)
    return total


def measure(presets: list[str], reps: int, steps: int) -> dict[str, dict[str, dict[str, list[dict]]]]:
    """runs[preset][backend][variant] = one figures dict per repetition, in repetition order."""
    runs = {p: {b: {v: [] for v in VARIANTS} for b in BACKENDS} for p in presets}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for preset in presets:
                for backend in BACKENDS:
                    for variant in rotated(tuple(VARIANTS), rep):
                        figures = run_variant(backend, preset, variant, steps, Path(tmp) / "run.json")
                        runs[preset][backend][variant].append(figures)
                        print(
                            f"rep {rep} {preset:>18} {backend:>10} {variant:>12}: CPU {figures['cpu_ms']:7.1f} ms/step "
                            f"(both ranks), wall {figures['wall_ms']:7.1f} ms/step",
                            flush=True,
                        )
    return runs


# --- summarising and rendering (pure: results in, Markdown out) ---------------------------------------------


def ratios(by_variant: dict[str, list[dict]], variant: str, key: str) -> list[float]:
    return [mine[key] / base[key] for mine, base in zip(by_variant[variant], by_variant["off"])]


def ratio_cell(values: list[float]) -> str:
    low, high = spread(values)
    return f"**{median(values):.3f}** ({low:.3f}-{high:.3f})"


def watchdog_shares(by_variant: dict[str, list[dict]]) -> list[float]:
    """Per repetition of ``on``: the watchdog threads' CPU time as a share of the step's CPU time."""
    return [run.get("watchdog_cpu_ms", float("nan")) / run["cpu_ms"] for run in by_variant["on"]]


def summary(results: dict) -> dict[str, float]:
    """The headline: the median CPU-time ratio of ``on`` over all presets and backends, the worst one, and the
    worst directly measured watchdog share."""
    cells = [by_variant for by_backend in results["runs"].values() for by_variant in by_backend.values()]
    medians = [median(ratios(by_variant, "on", "cpu_ms")) for by_variant in cells]
    return {
        "worst_median_cpu_ratio": max(medians),
        "best_median_cpu_ratio": min(medians),
        "worst_watchdog_share": max(max(watchdog_shares(by_variant)) for by_variant in cells),
    }


def render_hang_overhead(results: dict) -> str:
    settings, runs = results["settings"], results["runs"]
    lines = table_head(
        "preset",
        "backend",
        "variant",
        "CPU-time ratio: median (min-max)",
        "wall-time ratio: median (min-max)",
        "watchdog's own CPU / step CPU: median (max)",
        "off: CPU ms/step",
        "off: wall ms/step",
    )
    for preset, by_backend in runs.items():
        for backend, by_variant in by_backend.items():
            base = by_variant["off"]
            for variant in VARIANTS:
                if variant == "off":
                    continue
                shares = watchdog_shares(by_variant) if variant == "on" else []
                direct = f"{median(shares):.3%} ({max(shares):.3%})" if shares else "as `on`"
                lines.append(
                    f"| {preset} | {backend} | {variant} | {ratio_cell(ratios(by_variant, variant, 'cpu_ms'))} | "
                    f"{ratio_cell(ratios(by_variant, variant, 'wall_ms'))} | {direct} | "
                    f"{median([r['cpu_ms'] for r in base]):.0f} | {median([r['wall_ms'] for r in base]):.0f} |"
                )
    headline = summary(results)
    worst, share = headline["worst_median_cpu_ratio"], headline["worst_watchdog_share"]
    direct = (
        f"Measured directly, the watchdog threads' own CPU time is at most {share:.3%} of a step's CPU time "
        "(the only work hang detection adds to a healthy step: nothing runs in the training thread)."
    )
    verdict = (
        f"**Hang detection as the recipes run it (`on`) costs {worst - 1:+.1%} of CPU time per step at worst** "
        f"(the highest median ratio over presets and backends; goal: within {GOAL - 1:.0%}). {direct}"
        if worst <= GOAL
        else f"**The goal does not hold side by side**: the highest median CPU-time ratio of `on` is {worst:.3f} "
        f"(goal: within {GOAL - 1:.0%}). {direct}"
    )
    timed = settings["steps"] - settings["warmup"]
    return "\n".join(
        [
            verdict,
            "",
            *lines,
            "",
            f"{settings['reps']} interleaved repetitions (variant order rotated each time) x {timed} timed steps after "
            f"{settings['warmup']} warm-up, each a fresh 2-process group (bench/_step_worker.py: the NLP tiny model "
            "through the factory). A ratio is variant / `off` of the same repetition. CPU time (both ranks' "
            "`time.process_time`, summed, mean per step) is the verdict: waiting for a core held by other work "
            "on this shared machine is not in it; rank 0's median wall time per step is shown beside. `on` is what "
            "every recipe runs with (a watchdog thread per rank that looks at the store once a second, "
            "faulthandler, and torch's flight recorder, which torch 2.13 keeps on by default); `on + DETAIL` adds "
            "`TORCH_DISTRIBUTED_DEBUG=DETAIL`, torch's check of every collective across ranks, which the "
            'recipes leave to the user (docs/troubleshooting.md, "When a run hangs").',
        ]
    )


def render_sections(document: dict) -> dict[str, str]:
    """The docs/benchmarks.md section this bench owns, from ``{"provenance": ..., "results": ...}``."""
    return {"hang-overhead": render_hang_overhead(document["results"])}


# --- command line ------------------------------------------------------------------------------------------


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--presets", default="deepspeed_stage_2,deepspeed_stage_3")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=14, help=f"optimizer steps per run, the first {WARMUP} warm-up")
    args = parser.parse_args()
    if args.render:
        try:
            document = load_document(RESULTS)
        except (OSError, ValueError) as err:
            parser.error(f"cannot render: {err}")
        publish_document(document, render_sections)
        return
    presets = parse_presets(parser, args.presets)
    if args.reps < 1 or args.steps <= WARMUP:
        parser.error(f"need --reps >= 1 and --steps > {WARMUP} (the warm-up steps)")
    results = {
        "settings": {"presets": presets, "reps": args.reps, "steps": args.steps, "warmup": WARMUP, "goal": GOAL},
        "runs": measure(presets, args.reps, args.steps),
    }
    document = write_results(RESULTS, results)
    publish_document(document, render_sections)
    print(render_sections(document)["hang-overhead"])


if __name__ == "__main__":
    main()
