"""A recipe's default run, as a user types it, on both backends (the NLP recipe also with tensor parallelism 2).

    python bench/default_runs.py              # NLP: three runs, about 4-5 minutes each, one after the other
    python bench/default_runs.py --recipe cv  # CV: two runs, about 2 minutes each
    python bench/default_runs.py --render     # rewrite docs/nlp.md's tables from bench/results/default_runs.json
    python bench/default_runs.py --recipe cv --render   # docs/cv.md's from bench/results/default_runs_cv.json

1. ``python recipes/nlp/train.py`` (Lightning) and ``accelerate launch --config_file recipes/nlp/accelerate.yaml
   recipes/nlp/train_accelerate.py`` (Accelerate), with no arguments but ``out_dir``: the commands at the top of
   docs/nlp.md.
2. The Accelerate command with ``tensor_parallel=2 preset=deepspeed_stage_1 micro_batch_size=8``: AutoTP on the
   2 processes (one data-parallel replica; ZeRO-3 is refused with TP), the micro-batch doubled so that the global
   batch and the samples of each step are the default run's. The tensor-parallel bar: its final / step-0 validation
   loss ratio within 0.05 of the default Accelerate run's.
3. Each run's wall time around the whole command (start-up, tokenizer, packing, DeepSpeed initialisation and the
   export included) and the CPU time of its processes beside it (the machine is shared); the rest comes from the
   run's own summary.json and metrics.jsonl. Writes bench/results/default_runs.json (``write_results``: provenance
   included) and renders the "NLP default run" section of docs/nlp.md from it. ``--recipe cv``: the two commands
   at the top of docs/cv.md, into bench/results/default_runs_cv.json and the "CV default run" section of docs/cv.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed

from bench._bench_util import (  # noqa: E402
    REPO,
    add_results_options,
    bench_parser,
    holding,
    render_from_file,
    run_and_count_cpu,
    save_and_publish,
    table_head,
    work_folder,
)
from common.errors import exit_on_user_error  # noqa: E402

RESULTS = {
    "nlp": REPO / "bench" / "results" / "default_runs.json",
    "cv": REPO / "bench" / "results" / "default_runs_cv.json",
}
DOCS = {
    "NLP default run": REPO / "docs" / "nlp.md",
    "NLP default run memory": REPO / "docs" / "nlp.md",
    "CV default run": REPO / "docs" / "cv.md",
}
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/nlp/accelerate.yaml"]
ACCELERATE_CV = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/cv/accelerate.yaml"]
# (name, what a user types, the command as run here, its extra arguments)
RUNS = [
    ("Lightning", "python recipes/nlp/train.py", [sys.executable, "recipes/nlp/train.py"], []),
    (
        "Accelerate",
        "accelerate launch --config_file recipes/nlp/accelerate.yaml recipes/nlp/train_accelerate.py",
        [*ACCELERATE, "recipes/nlp/train_accelerate.py"],
        [],
    ),
    (
        "Accelerate, TP 2",
        "accelerate launch --config_file recipes/nlp/accelerate.yaml recipes/nlp/train_accelerate.py "
        "tensor_parallel=2 preset=deepspeed_stage_1 micro_batch_size=8",
        [*ACCELERATE, "recipes/nlp/train_accelerate.py"],
        ["tensor_parallel=2", "preset=deepspeed_stage_1", "micro_batch_size=8"],
    ),
]
CV_RUNS = [
    ("Lightning", "python recipes/cv/train.py", [sys.executable, "recipes/cv/train.py"], []),
    (
        "Accelerate",
        "accelerate launch --config_file recipes/cv/accelerate.yaml recipes/cv/train_accelerate.py",
        [*ACCELERATE_CV, "recipes/cv/train_accelerate.py"],
        [],
    ),
]
NLP_KEYS = (
    "val_loss",
    "val_perplexity",
    "initial_val_loss",
    "val_loss_ratio",
    "throughput",
    "median_step_s",
    "peak_memory_bytes",
    "model_state_bytes_per_rank",
    "model_state_bytes_measured",
    "memory_plan",
    "steps",
    "tokens_per_step",
    "preset",
    "zero_stage",
    "precision",
    "world_size",
    "export_check",
    "sample",
)
CV_KEYS = (
    "val_accuracy",
    "val_loss",
    "majority_baseline_accuracy",
    "throughput",
    "peak_memory_bytes",
    "model_state_bytes_per_rank",
    "wall_time_s",
    "steps",
    "preset",
    "zero_stage",
    "precision",
    "world_size",
)
TP_RATIO_BAR = 0.05  # the default quality bar holds under tensor_parallel=2 within this
DEFAULT_RATIO_BAR = 0.6  # docs/nlp.md: the default run's final / step-0 validation loss ratio stays under this


def run_one(command: list[str], args: list[str], out_dir: Path, lock: Path | None, keys: tuple = NLP_KEYS) -> dict:
    """One run: the command, its wall and CPU time, and what its run directory says."""
    with holding(lock):
        proc, wall, cpu = run_and_count_cpu([*command, f"out_dir={out_dir}", *args])
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first_step = next((m.get("elapsed_s") for m in metrics if "train_loss" in m), None)  # the CV loop logs no time
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "first_step_elapsed_s": first_step,
        "val_losses": {str(m["step"]): m["val_loss"] for m in metrics if "val_loss" in m},
        "val_accuracies": {str(m["step"]): m["val_accuracy"] for m in metrics if "val_accuracy" in m},
        "summary": {key: summary[key] for key in keys},
    }


def measure(work: Path, lock: Path | None) -> dict:
    runs = {}
    for name, typed, command, args in RUNS:
        print(f"{name}: {typed}", flush=True)
        runs[name] = {"typed": typed, **run_one(command, args, work / name.replace(" ", "_").replace(",", ""), lock)}
        print(f"  {runs[name]['wall_s']:.0f} s, ratio {runs[name]['summary']['val_loss_ratio']:.3f}", flush=True)
    default, tp = runs["Accelerate"]["summary"]["val_loss_ratio"], runs["Accelerate, TP 2"]["summary"]["val_loss_ratio"]
    return {
        "recipe": "nlp",
        "runs": runs,
        "tp_quality": {"default_ratio": default, "tp2_ratio": tp, "difference": tp - default, "bar": TP_RATIO_BAR},
    }


def render_body(results: dict) -> str:
    runs = results["runs"]
    names = list(runs)
    cells = {name: runs[name]["summary"] for name in names}
    eval_steps = [s for s in runs[names[0]]["val_losses"] if s != "0"]

    def row(label: str, value) -> str:
        return "| " + label + " | " + " | ".join(value(name) for name in names) + " |"

    lines = [
        *table_head("", *[f"{name}: `{runs[name]['typed']}`" for name in names]),
        row("wall time (whole command)", lambda n: f"**{runs[n]['wall_s']:.0f} s** (CPU {runs[n]['cpu_s']:.0f} s)"),
        row("first optimizer step after", lambda n: f"{runs[n]['first_step_elapsed_s']:.0f} s (of `main()`)"),
        row(
            "preset, processes",
            lambda n: f"{cells[n]['preset']} (ZeRO-{cells[n]['zero_stage']}), {cells[n]['world_size']}",
        ),
        row("optimizer steps x tokens per step", lambda n: f"{cells[n]['steps']} x {cells[n]['tokens_per_step']:,}"),
        row("val loss at step 0", lambda n: f"{cells[n]['initial_val_loss']:.3f}"),
        row(
            "val loss at step " + " / ".join(eval_steps[:-1]),
            lambda n: " / ".join(f"{runs[n]['val_losses'][s]:.3f}" for s in eval_steps[:-1]),
        ),
        row(
            f"final val loss (step {eval_steps[-1]})",
            lambda n: f"**{cells[n]['val_loss']:.3f}** (perplexity {cells[n]['val_perplexity']:.0f})",
        ),
        row("final / step-0 ratio", lambda n: f"**{cells[n]['val_loss_ratio']:.3f}**"),
        row(
            "throughput (median step)",
            lambda n: (
                f"{cells[n]['throughput']['value']:,.0f} {cells[n]['throughput']['unit']} "
                f"({cells[n]['median_step_s']:.3f} s)"
            ),
        ),
        row("peak memory (max RSS over ranks)", lambda n: f"{cells[n]['peak_memory_bytes'] / 1e9:.2f} GB"),
        row("model states per rank (measured)", lambda n: f"{cells[n]['model_state_bytes_per_rank'] / 1e6:.1f} MB"),
        row(
            "export check (`final/` reloaded vs trained)",
            lambda n: (
                f"max logit diff {cells[n]['export_check']['max_abs_logit_diff']:.1e} "
                f"({'within' if cells[n]['export_check']['ok'] else 'OUTSIDE'} {cells[n]['export_check']['dtype']} "
                "tolerance)"
            ),
        ),
    ]
    quality = results["tp_quality"]
    met = abs(quality["difference"]) <= quality["bar"]
    default_ok = all(cells[n]["val_loss_ratio"] < DEFAULT_RATIO_BAR for n in names)
    lines += [
        "",
        f"The default quality bar (final / step-0 ratio under {DEFAULT_RATIO_BAR}): "
        f"**{'met' if default_ok else 'not met'}** by every run. Tensor parallelism 2 (its bar: the ratio "
        f"within {quality['bar']} of the default Accelerate run's): {quality['tp2_ratio']:.3f} vs "
        f"{quality['default_ratio']:.3f}, a difference of {quality['difference']:+.3f}, "
        f"**{'met' if met else 'not met'}**.",
        "",
        f"Sample (greedy, from the reloaded `final/` of the {names[0]} run):",
        "",
        "```",
        cells[names[0]]["sample"].rstrip(),
        "```",
    ]
    return "\n".join(lines)


def render_memory(results: dict) -> str:
    """Predicted (the plan printed before training) against measured (the engine's count after the first step)."""
    names = [name for name in results["runs"] if name != "Accelerate, TP 2"]
    lines = table_head("default run, per rank", *[f"{n}: predicted" for n in names], *[f"{n}: measured" for n in names])
    mb = 1e6

    def cell(nbytes: float) -> str:
        return f"{nbytes / mb:.1f} MB" if nbytes else "0"

    rows = [
        ("parameters", "params"),
        ("optimizer (fp32 master + Adam m, v)", "optimizer"),
        ("gradients (after the step)", "grads"),
        ("model states", "model_states"),
    ]
    for label, key in rows:
        predicted = [cell(results["runs"][n]["summary"]["memory_plan"]["predicted_bytes_per_rank"][key]) for n in names]
        measured = [cell(results["runs"][n]["summary"]["model_state_bytes_measured"][key]) for n in names]
        lines.append("| " + " | ".join([label, *predicted, *measured]) + " |")
    buffers = [cell(results["runs"][n]["summary"]["model_state_bytes_measured"]["buffers"]) for n in names]
    lines.append("| " + " | ".join(["ZeRO buffers (reduce bucket, flat groups)", *["-"] * len(names), *buffers]) + " |")
    return "\n".join(lines)


def measure_cv(work: Path, lock: Path | None) -> dict:
    runs = {}
    for name, typed, command, args in CV_RUNS:
        print(f"{name}: {typed}", flush=True)
        runs[name] = {"typed": typed, **run_one(command, args, work / f"cv_{name}", lock, CV_KEYS)}
        print(f"  {runs[name]['wall_s']:.0f} s, accuracy {runs[name]['summary']['val_accuracy']:.4f}", flush=True)
    return {"recipe": "cv", "runs": runs}


def render_cv(results: dict) -> str:
    runs = results["runs"]
    lines = table_head(
        "command",
        "val accuracy (majority class)",
        "command wall (CPU)",
        "`wall_time_s`",
        "throughput",
        "peak RSS / process",
        "model states / rank",
    )
    for run in runs.values():
        s = run["summary"]
        lines.append(
            f"| `{run['typed']}` | {s['val_accuracy']:.4f} ({s['majority_baseline_accuracy']:.3f}) | "
            f"{run['wall_s']:.1f} s ({run['cpu_s']:.0f} s) | {s['wall_time_s']:.0f} s | "
            f"{s['throughput']['value']:.0f} {s['throughput']['unit']} | {s['peak_memory_bytes'] / 1e9:.2f} GB | "
            f"{s['model_state_bytes_per_rank'] / 1e6:.2f} MB |"
        )
    first = next(iter(runs.values()))
    steps = list(first["val_accuracies"])
    same = all(run["val_accuracies"] == first["val_accuracies"] for run in runs.values())
    shown = ", ".join(f"{first['val_accuracies'][step]:.4f} at step {step}" for step in steps)
    lines += [
        "",
        f"Validation accuracy at each evaluation ({first['typed']}): {shown}. "
        + ("The other backend's run evaluated to exactly the same values." if same else "The backends' values differ."),
    ]
    return "\n".join(lines)


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from a default_runs(_cv).json document alone."""
    results = document["results"]
    if results.get("recipe", "nlp") == "cv":
        return {"CV default run": render_cv(results)}
    return {"NLP default run": render_body(results), "NLP default run memory": render_memory(results)}


@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--work-dir", default=None, help="where the runs are written (default: a temp folder)")
    parser.add_argument("--recipe", choices=sorted(RESULTS), default="nlp", help="whose default run (default nlp)")
    parser.add_argument("--lock", type=Path, default=None, help="hold an exclusive flock on this file during each run")
    add_results_options(parser, None)
    args = parser.parse_args()
    args.json = args.json or RESULTS[args.recipe]
    if args.render:
        render_from_file(args.json, render_sections, DOCS)
        return
    with work_folder(args.work_dir, "zr-default-runs-") as work:
        results = (measure_cv if args.recipe == "cv" else measure)(work, args.lock)
        for body in render_sections({"results": results}).values():
            print(body)
        save_and_publish(args, results, render_sections, DOCS)


if __name__ == "__main__":
    main()
