"""Stage ladder and per-preset table: throughput relative to stage 1, peak RSS and model-state bytes per rank.

    python bench/stages.py                      # every preset of common/presets.py, 3 interleaved reps of 14 steps
    python bench/stages.py --render             # rewrite the docs from bench/results/stages.json, measuring nothing

Each preset trains the NLP tiny model (Llama, hidden 256, 4 layers, 5.3M parameters, vocab 4096, seq 256,
micro batch 8, bf16) through a raw DeepSpeed loop on 2 CPU processes (gloo), with the preset resolved by
the factory exactly as the recipes resolve it. ``deepspeed_stage_1`` is the reference and repetitions are
interleaved (the order rotates), so a throughput ratio always compares runs made side by side. Per preset:
median step time after warm-up, tokens/s per rank, peak RSS (the largest rank), model-state bytes and ZeRO
buffers per rank (rank 0, common.accounting, after the last step).

One run writes bench/results/stages.json (through write_results: provenance included); the docs are rendered
from that file alone: docs/benchmarks.md (section "stages"), docs/presets.md (section "presets") and
docs/img/stage_ladder.png.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed
from bench._bench_util import (  # noqa: E402
    DOC,
    REPO,
    bench_parser,
    launch_group,
    load_document,
    median,
    publish_document,
    spread,
    table_head,
    write_results,
)
from common.errors import ConfigError, exit_on_user_error, nearest  # noqa: E402
from common.presets import PRESET_NAMES, get_preset  # noqa: E402
from common.tools.probe import last_error_line  # noqa: E402  (the probe's: skips the launcher's summary lines)

REFERENCE = "deepspeed_stage_1"
LADDER = ("ddp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload")
# A practitioner's published ladder (not measured here): 7B, 8 x 80 GB GPUs on one node with a fast interconnect.
PUBLISHED_RATIO = {"deepspeed_stage_1": 1.00, "deepspeed_stage_2": 0.97, "deepspeed_stage_3": 0.92}
PUBLISHED_RATIO["deepspeed_stage_3_offload"] = 0.70
WARMUP = 3
RESULTS = HERE / "results" / "stages.json"
PRESETS_DOC = REPO / "docs" / "presets.md"
DOCS = {"stages": DOC, "presets": PRESETS_DOC}
PLOT = REPO / "docs" / "img" / "stage_ladder.png"
TOKENS_PER_STEP = 8 * 256  # micro batch x seq len, per rank (bench/_step_worker.py)
MiB = 2**20
# Repetitions that disagree by more than this fraction of their median do not decide a ratio (another job
# started or stopped between two launches on a shared machine): the table says "not resolved" instead.
RESOLVED_SPREAD = 0.2


def measure(presets: list[str], reps: int, steps: int) -> dict[str, dict]:
    """Interleaved runs of every preset; a preset that fails keeps the last line of its error."""
    runs: dict[str, list[dict]] = {p: [] for p in presets}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            order = presets[rep % len(presets) :] + presets[: rep % len(presets)]
            for preset in order:
                if preset in errors:
                    continue
                out = Path(tmp) / f"{preset}-{rep}.json"
                args = ["--backend", "raw", "--preset", preset, "--steps", str(steps), "--out", str(out)]
                try:
                    launch_group(HERE / "_step_worker.py", "raw", preset, args)
                except RuntimeError as err:
                    errors[preset] = last_error_line(str(err))
                    print(f"rep {rep} {preset:>32}: did not run: {errors[preset]}", flush=True)
                    continue
                run = json.loads(out.read_text())
                run["median_step_s"] = median(run["step_times"][WARMUP:])
                runs[preset].append(run)
                print(f"rep {rep} {preset:>32}: median step {run['median_step_s'] * 1e3:8.1f} ms", flush=True)
    return summarize(runs, errors)


def summarize(runs: dict[str, list[dict]], errors: dict[str, str]) -> dict[str, dict]:
    """Per preset: ratio to stage 1 per repetition (same rep, side by side), median and spread."""
    reference = [r["median_step_s"] for r in runs[REFERENCE]]
    rows = {}
    for preset, reps in runs.items():
        if preset in errors:
            rows[preset] = {"error": errors[preset]}
            continue
        ratios = [ref / r["median_step_s"] for ref, r in zip(reference, reps)]
        last = reps[-1]["ranks"]
        step_s = [r["median_step_s"] for r in reps]
        rows[preset] = {
            "throughput_vs_stage1": median(ratios),
            "ratios": ratios,
            "median_step_s_per_rep": step_s,
            "median_step_s": median(step_s),
            "tokens_per_s_per_rank": TOKENS_PER_STEP / median(step_s),
            "peak_rss_bytes": max(rank["peak_rss_bytes"] for rank in last),
            "model_state_bytes": last[0]["model_states"],
            "buffer_bytes": last[0]["buffers"],
        }
    return rows


def resolved(row: dict) -> bool:
    low, high = spread(row["ratios"])
    return high - low <= RESOLVED_SPREAD * row["throughput_vs_stage1"]


def ratio_text(row: dict) -> str:
    """The median ratio in bold with its min-max, or "not resolved" when the repetitions disagree too much."""
    if len(row["ratios"]) == 1:
        return f"**{row['throughput_vs_stage1']:.2f}** (one repetition)"
    low, high = spread(row["ratios"])
    if not resolved(row):
        return f"not resolved: {row['throughput_vs_stage1']:.2f} ({low:.2f}-{high:.2f})"
    return f"**{row['throughput_vs_stage1']:.2f}** ({low:.2f}-{high:.2f})"


def ladder_table(rows: dict[str, dict]) -> str:
    lines = table_head(
        "preset",
        "throughput vs stage 1, here (median, min-max over reps)",
        "published GPU ladder (7B, 8 GPUs; not measured here)",
        "tokens/s per rank",
        "step ms",
    )
    for preset in LADDER:
        row = rows.get(preset)
        if not row or "error" in row:
            continue
        published = PUBLISHED_RATIO.get(preset)
        lines.append(
            f"| {preset} | {ratio_text(row)} | {'-' if published is None else f'{published:.2f}'} | "
            f"{row['tokens_per_s_per_rank']:.0f} | {row['median_step_s'] * 1e3:.0f} |"
        )
    return "\n".join(lines)


def offload_text(zero: dict) -> str:
    keys = [key for key in ("offload_optimizer", "offload_param") if key in zero]
    return "+".join(f"{key.removeprefix('offload_')} {zero[key]['device']}" for key in keys) or "-"


def presets_table(rows: dict[str, dict]) -> str:
    lines = table_head(
        "preset",
        "ZeRO",
        "offload",
        "throughput vs stage 1",
        "tokens/s per rank",
        "peak RSS per rank",
        "model states per rank",
        "ZeRO buffers per rank",
    )
    for preset in PRESET_NAMES:
        spec = get_preset(preset)
        head = f"| {preset} | {spec['stage']} | {offload_text(spec['zero_optimization'])} |"
        row = rows.get(preset)
        if row is None:
            lines.append(f"{head} not measured in this run | | | | |")
        elif "error" in row:
            lines.append(f"{head} did not run on this CPU: `{row['error']}` | | | | |")
        else:
            lines.append(
                f"{head} {ratio_text(row)} | {row['tokens_per_s_per_rank']:.0f} | "
                f"{row['peak_rss_bytes'] / MiB:.0f} MiB | {row['model_state_bytes'] / MiB:.1f} MiB | "
                f"{row['buffer_bytes'] / MiB:.1f} MiB |"
            )
    return "\n".join(lines)


def within_spread(row: dict, value: float) -> bool:
    low, high = spread(row["ratios"])
    return low <= value <= high


def why_cpu_differs(rows: dict[str, dict]) -> str:
    """Why the CPU ladder differs from the published GPU one; the sentences comparing presets follow this run."""
    text = """Why the CPU figures differ from the published GPU ladder (a practitioner's figures for a 7B model
on one node of 8 x 80 GB GPUs, not measured here): here both "devices" are processes sharing the cores and
"communication" is a gloo copy through shared memory, so it takes CPU time from the compute instead of
overlapping with it on a separate link; the model has 5.3M parameters, so the fixed per-call costs of
stage 3 (a hook, an all-gather and a re-partition per module, per step) weigh far more than at 7B, where
the matrix work hides them; and "offload" moves optimizer states from host RAM to host RAM, so it frees
nothing and adds only the copies and DeepSpeedCPUAdam's step in place of AdamW's."""
    stage2, stage3, offload = (rows.get(p, {}) for p in LADDER[2:])
    if "ratios" in stage2:
        text += (
            " Stages 1 and 2 do the same work on this machine: stage 2's spread between repetitions includes 1.00."
            if within_spread(stage2, 1.0)
            else f" Stage 2 ran at {stage2['throughput_vs_stage1']:.2f}x of stage 1 (its spread between repetitions "
            "excludes 1.00)."
        )
    if "ratios" in stage3 and "ratios" in offload and resolved(stage3) and resolved(offload):
        text += (
            f" Stage 3 + offload ran at {offload['throughput_vs_stage1']:.2f}x, next to stage 3's "
            f"{stage3['throughput_vs_stage1']:.2f}x, against the published "
            f"{PUBLISHED_RATIO['deepspeed_stage_3_offload']:.2f}."
        )
    return (
        text
        + """ The ratios measure DeepSpeed's per-stage bookkeeping on this machine, not what the stages cost on
GPUs: run `zero-recipes probe` on the real hardware for that."""
    )


def run_text(results: dict) -> str:
    return (
        f"{results['reps']} interleaved repetitions of {results['steps']} steps per preset ({results['warmup']} "
        f"warm-up steps left out of each median); `{results['reference']}` runs in every repetition. A ratio whose "
        f"repetitions spread by more than {RESOLVED_SPREAD:.0%} of its median is marked not resolved: other work "
        "on the machine changed between two launches."
    )


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from a stages.json document alone (no clock, no measurement)."""
    results = document["results"]
    rows = results["presets"]
    why = why_cpu_differs(rows)
    return {
        "stages": f"{run_text(results)}\n\n{ladder_table(rows)}\n\n![stage ladder](img/stage_ladder.png)\n\n{why}",
        "presets": f"{run_text(results)}\n\n{presets_table(rows)}\n\n{why}\n\n![stage ladder](img/stage_ladder.png)",
    }


def plot_ladder(rows: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p for p in LADDER if p in rows and "error" not in rows[p]]
    here = [rows[p]["throughput_vs_stage1"] for p in names]
    low = [h - spread(rows[p]["ratios"])[0] for p, h in zip(names, here)]
    high = [spread(rows[p]["ratios"])[1] - h for p, h in zip(names, here)]
    published = [PUBLISHED_RATIO.get(p, float("nan")) for p in names]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], here, 0.4, yerr=[low, high], capsize=3, label="here: 2 CPU processes, gloo, 5.3M")
    ax.bar([i + 0.2 for i in x], published, 0.4, label="published: 8 GPUs, 7B")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(list(x), [n.replace("deepspeed_", "") for n in names])
    ax.set_ylabel("throughput / stage 1")
    ax.set_title("ZeRO stage ladder (NLP tiny model, bench/stages.py)")
    ax.legend(loc="lower left")
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100, metadata={"Software": None})  # no version stamp: same data, same bytes
    plt.close(fig)


def publish(document: dict) -> None:
    """Write the docs sections and the plot from a results document."""
    publish_document(document, render_sections, DOCS)
    plot_ladder(document["results"]["presets"])


@exit_on_user_error(ValueError, FileNotFoundError)  # --render: a results file missing or without provenance
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--presets", default=",".join(PRESET_NAMES), help="comma-separated (default: every preset)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=14)
    args = parser.parse_args()
    if args.render:
        publish(load_document(RESULTS))
        return
    presets = args.presets.split(",")
    for name in presets:
        if name not in PRESET_NAMES:
            raise ConfigError(f"unknown preset {name!r}{nearest(name, PRESET_NAMES)}; valid: {', '.join(PRESET_NAMES)}")
    if args.steps <= WARMUP or args.reps < 1:
        raise ConfigError(f"--steps must exceed the {WARMUP} warm-up steps and --reps be at least 1")
    if REFERENCE not in presets:
        presets.insert(0, REFERENCE)  # every ratio needs its side-by-side reference
    rows = measure(presets, args.reps, args.steps)
    for preset, row in rows.items():
        if "error" not in row:
            print(
                f"{preset:>32}: throughput vs stage 1 {row['throughput_vs_stage1']:.3f} "
                f"(reps {', '.join(f'{r:.3f}' for r in row['ratios'])}), peak RSS {row['peak_rss_bytes'] / MiB:.0f} MiB"
            )
    results = {"reps": args.reps, "steps": args.steps, "warmup": WARMUP, "reference": REFERENCE, "presets": rows}
    publish(write_results(RESULTS, results))


if __name__ == "__main__":
    main()
