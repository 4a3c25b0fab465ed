"""ZeRO-1 with data, tensor, pipeline and expert parallelism, side by side on 2 processes (docs/parallelism.md).

    python bench/parallelism.py             # five 2-process runs of the NLP recipe (about a minute in all here)
    python bench/parallelism.py --render    # rewrite docs/parallelism.md's table from bench/results/parallelism.json

Each layout is the NLP recipe's own entry point as a user launches it, on the tiny Llama (or its MoE variant),
fp32, ZeRO-1, the same global batch of 4 sequences per step and the same steps:

- ``DP 2``: ``accelerate launch ... train_accelerate.py`` (2 replicas, micro-batch 2);
- ``TP 2``: the same with ``tensor_parallel=2 micro_batch_size=4`` (AutoTP, one replica);
- ``PP 2``: ``torchrun --nproc_per_node 2 train_pipeline.py pipeline_parallel=2 pipeline_micro_batches=2`` (one
  replica, 2 micro-batches in flight);
- ``MoE, DP 2`` and ``MoE, EP 2``: ``model=moe_tiny`` with ``expert_parallel=1`` and ``2``.

What each run's own summary.json says (rank 0's parameter bytes as the engine counts them, each stage's for the
pipeline, the plan the recipe printed before training, the median step, the final validation loss) beside the
wall and CPU time of the whole command. Writes bench/results/parallelism.json (provenance included) and renders
the "Parallelism on this machine" section of docs/parallelism.md from it.
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
    free_port,
    holding,
    render_from_file,
    run_and_count_cpu,
    save_and_publish,
    table_head,
    torchrun_command,
    work_folder,
)
from common.errors import exit_on_user_error  # noqa: E402

RESULTS = REPO / "bench" / "results" / "parallelism.json"
DOCS = {"Parallelism on this machine": REPO / "docs" / "parallelism.md"}
STEPS = 30
COMMON = [
    "data=stdlib",
    "max_train_tokens=60000",
    "preset=deepspeed_stage_1",
    "precision=fp32",
    f"max_steps={STEPS}",
    "seq_len=64",
    "max_val_tokens=1024",
    f"eval_interval={STEPS}",
    f"checkpoint_interval={STEPS}",
    "log_interval=1",
    "sample_tokens=4",
    "warmup_steps=2",
]
ACCELERATE = "accelerate launch --config_file recipes/nlp/accelerate.yaml recipes/nlp/train_accelerate.py"
TORCHRUN = "torchrun --nproc_per_node 2 recipes/nlp/train_pipeline.py"
# (layout, launcher as typed, its arguments): every layout 2 processes, a global batch of 4 sequences.
LAYOUTS = [
    ("DP 2", ACCELERATE, ["micro_batch_size=2"]),
    ("TP 2", ACCELERATE, ["tensor_parallel=2", "micro_batch_size=4"]),
    ("PP 2", TORCHRUN, ["pipeline_parallel=2", "micro_batch_size=2", "pipeline_micro_batches=2"]),
    ("MoE, DP 2", ACCELERATE, ["model=moe_tiny", "expert_parallel=1", "micro_batch_size=2"]),
    ("MoE, EP 2", ACCELERATE, ["model=moe_tiny", "expert_parallel=2", "micro_batch_size=2"]),
]


def command_line(launcher: str) -> list[str]:
    """The launcher as run here: this interpreter, a free port."""
    if launcher == ACCELERATE:
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            "recipes/nlp/accelerate.yaml",
            "--main_process_port",
            str(free_port()),
            "recipes/nlp/train_accelerate.py",
        ]
    return [*torchrun_command(2), "recipes/nlp/train_pipeline.py"]


def run_layout(launcher: str, args: list[str], out_dir: Path, lock: Path | None) -> dict:
    with holding(lock):
        proc, wall, cpu = run_and_count_cpu([*command_line(launcher), f"out_dir={out_dir}", *COMMON, *args])
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    pipeline = summary.get("pipeline") or {}
    rank0_params = [summary["model_state_bytes_measured"]["params"]]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        # Every rank holds the same parameters except under the pipeline, whose summary counts each stage's.
        "params_bytes_per_rank": pipeline.get("params_bytes_per_rank") or rank0_params,
        "planned_params_bytes": summary["memory_plan"]["predicted_bytes_per_rank"]["params"],
        "model_state_bytes_per_rank": summary["model_state_bytes_per_rank"],
        "median_step_s": summary["median_step_s"],
        "val_loss": summary["val_loss"],
        "initial_val_loss": summary["initial_val_loss"],
        "world_size": summary["world_size"],
        "tokens_per_step": summary["tokens_per_step"],
    }


def measure(work: Path, lock: Path | None) -> dict:
    runs = {}
    for layout, launcher, args in LAYOUTS:
        print(f"{layout}: {launcher} {' '.join(args)}", flush=True)
        result = run_layout(launcher, args, work / layout.replace(", ", "_").replace(" ", ""), lock)
        runs[layout] = {"typed": f"{launcher} {' '.join(args)}", **result}
        print(f"  {result['wall_s']:.0f} s, median step {result['median_step_s']:.3f} s", flush=True)
    return {"steps": STEPS, "common_args": COMMON, "runs": runs}


def render_table(results: dict) -> str:
    runs = results["runs"]
    mb = 1e6
    lines = table_head(
        "layout (2 processes)",
        "parameters / rank, measured",
        "planner",
        "model states / rank",
        "median step",
        "command wall (CPU)",
        f"val loss after {results['steps']} steps",
    )
    for layout, run in runs.items():
        held = run["params_bytes_per_rank"]
        measured = " / ".join(f"{b / mb:.2f}" for b in held) + " MB" + (" (per stage)" if len(held) > 1 else "")
        worst = max(abs(b - run["planned_params_bytes"]) / run["planned_params_bytes"] for b in held)
        lines.append(
            f"| {layout} | {measured} | {run['planned_params_bytes'] / mb:.2f} MB ({worst:.1%} off) | "
            f"{run['model_state_bytes_per_rank'] / mb:.2f} MB | {run['median_step_s']:.3f} s | "
            f"{run['wall_s']:.0f} s ({run['cpu_s']:.0f} s) | {run['val_loss']:.4f} |"
        )
    dense, tp, pp = runs["DP 2"], runs["TP 2"], runs["PP 2"]
    moe_dp, moe_ep = runs["MoE, DP 2"], runs["MoE, EP 2"]

    def ratio(run: dict, base: dict, key: str) -> str:
        value = max(run[key]) if isinstance(run[key], list) else run[key]
        reference = max(base[key]) if isinstance(base[key], list) else base[key]
        return f"{value / reference:.2f}"

    lines += [
        "",
        f"Against DP 2, parameters per rank: TP 2 x{ratio(tp, dense, 'params_bytes_per_rank')}, PP 2 "
        f"x{ratio(pp, dense, 'params_bytes_per_rank')} (largest stage); median step: TP 2 "
        f"x{ratio(tp, dense, 'median_step_s')}, PP 2 x{ratio(pp, dense, 'median_step_s')}. MoE, EP 2 against "
        f"MoE, DP 2: parameters per rank x{ratio(moe_ep, moe_dp, 'params_bytes_per_rank')}, median step "
        f"x{ratio(moe_ep, moe_dp, 'median_step_s')}.",
        "",
        "Every command: `" + " ".join(results["common_args"]) + "` after the layout's own arguments.",
    ]
    return "\n".join(lines)


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from a parallelism.json document alone."""
    return {"Parallelism on this machine": render_table(document["results"])}


@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--work-dir", default=None, help="where the runs are written (default: a temp folder)")
    parser.add_argument("--lock", type=Path, default=None, help="hold an exclusive flock on this file during each run")
    add_results_options(parser, RESULTS)
    args = parser.parse_args()
    if args.render:
        render_from_file(args.json, render_sections, DOCS)
        return
    with work_folder(args.work_dir, "zr-parallelism-") as work:
        results = measure(work, args.lock)
        print(render_sections({"results": results})["Parallelism on this machine"])
        save_and_publish(args, results, render_sections, DOCS)


if __name__ == "__main__":
    main()
