"""Per-rank memory of a real DeepSpeed step vs what ``zero-recipes estimate`` prints for the same run.

    python bench/memory.py [--world-sizes 1,2,4]
    python bench/memory.py --render             # rewrite the docs from bench/results/memory.json

Stages 0-3 (presets ddp, deepspeed_stage_1/2/3, bf16), 1, 2 and 4 CPU processes (gloo), two Llama shapes
(bench/_memory_worker.py). The planner is asked exactly what a user asks it: the model's ``config.json`` as
``--model-config``, ``--gpus N``, bf16, the worker's sequence length and micro batch, and its own functions
answer (common.tools.memory.plan and guide_model_states). Measured, on the worst rank (common.accounting counts
every live tensor storage once): model states after one optimizer step, and what is resident at the peak of
the backward pass (a snapshot after every parameter's gradient: gradients alive, buckets in use, stage-3
parameters gathered).

Goals: model states after the step within 5 % of the planner's function with gradients released (the
accounting is exact: 0 bytes expected); the planner's buffer column is labelled an upper bound in the
output, and the measured resident buffers at the backward peak are published beside it as a ratio.
Writes bench/results/memory.json (through write_results) and docs/benchmarks.md, section "memory",
rendered from that file alone.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed
from bench._bench_util import DOC, REPO, bench_parser, launch_group, render_from_file, table_head, write_results  # noqa: E402
from common.errors import exit_on_user_error  # noqa: E402
from common.memory_formulas import facts_from_hf_config  # noqa: E402
from common.tools.memory import PlanInputs, plan  # noqa: E402

GOAL = 0.05
RESULTS = HERE / "results" / "memory.json"
BUFFER_SECTION = "estimate buffer column, measured"  # in docs/tools.md, beside the column's description
DOCS = {"memory": DOC, BUFFER_SECTION: REPO / "docs" / "tools.md"}
MiB = 2**20
SEQ, MICRO_BATCH = 32, 1  # bench/_memory_worker.py's step


@functools.cache
def model_facts(model_config_json: str):
    """The facts ``zero-recipes estimate --model-config config.json`` reads from the model's config file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(model_config_json)
        return facts_from_hf_config(path)


def planner_answer(model_config: dict, stage: int, world_size: int) -> dict:
    """What ``zero-recipes estimate --model-config config.json --gpus N --precision bf16`` says for this stage."""
    facts = model_facts(json.dumps(model_config, sort_keys=True))
    inputs = PlanInputs(gpus_per_node=world_size, seq_len=SEQ, micro_batch_size=MICRO_BATCH, precision="bf16")
    row = next(r for r in plan(facts, inputs).rows if (r.stage, r.offload) == (stage, "none"))
    return {
        "states_with_grads": row.model_states_bytes,  # the model-states column (gradients alive)
        "states_after_step": row.model_states_after_step_bytes,  # the same function, gradients released
        "buffers": row.buffers_bytes,  # the "buffers" column
        "persistent_params": row.persistent_params,
    }


def cell(row: dict, world_size: int) -> dict:
    """What one (shape, stage, world size) measured: every rank after the step and at its backward peak."""
    keys = ("params", "grads", "optimizer", "buffers", "model_states")
    peak_keys = (*keys, "gathered", "resident")
    return {
        "shape": row["shape"],
        "stage": row["stage"],
        "world_size": world_size,
        "num_params": row["num_params"],
        "persistent_params": row["persistent_params"],  # DeepSpeed's ds_persist count
        "model_config": row["model_config"],
        "ranks_after_step": [{k: r[k] for k in keys} for r in row["ranks"]],
        "ranks_backward_peak": [{k: r["backward_peak"][k] for k in peak_keys} for r in row["ranks"]],
    }


def compare(measured: dict) -> dict:
    """A measured cell beside the planner's answer for the same inputs: the worst rank of each measurement."""
    planner = planner_answer(measured["model_config"], measured["stage"], measured["world_size"])
    want = planner["states_after_step"]
    after = max(measured["ranks_after_step"], key=lambda r: abs(r["model_states"] - want))
    peak = max(measured["ranks_backward_peak"], key=lambda r: r["resident"])
    return {
        **measured,
        "planner": planner,
        "after_step": after,
        "backward_peak": peak,
        "rel_error": abs(after["model_states"] - want) / want,
    }


def states_table(cells: list[dict]) -> str:
    lines = table_head(
        "shape (params)",
        "stage",
        "ranks",
        "planner, after step MiB",
        "measured after step MiB (params / grads / optimizer)",
        "error",
        "persistent params (planner)",
        "planner's model states MiB (gradients alive)",
    )
    for c in cells:
        after, plan_ = c["after_step"], c["planner"]
        lines.append(
            f"| {c['shape']} ({c['num_params'] / 1e6:.2f}M) | {c['stage']} | {c['world_size']} | "
            f"{plan_['states_after_step'] / MiB:.3f} | {after['model_states'] / MiB:.3f} "
            f"({after['params'] / MiB:.3f} / {after['grads'] / MiB:.3f} / {after['optimizer'] / MiB:.3f}) | "
            f"{c['rel_error'] * 100:.3f} % | "
            f"{c['persistent_params']:,} ({plan_['persistent_params']:,}) | {plan_['states_with_grads'] / MiB:.3f} |"
        )
    return "\n".join(lines)


def beyond_states(c: dict) -> float:
    """Bytes resident at the backward peak beyond the formulas' model states with gradients alive.

    Parameters and optimizer states as measured, and one gradient of the formulas' size (2K below stage 2,
    2K/N from stage 2) wherever DeepSpeed keeps it (``param.grad``, a bucket or a flat partition): everything
    else, ZeRO's buckets and flat groups and stage 3's gathered parameters, is what the buffer column covers.
    """
    peak, planner = c["backward_peak"], c["planner"]
    formula_gradients = planner["states_with_grads"] - planner["states_after_step"]
    return peak["resident"] - peak["params"] - peak["optimizer"] - formula_gradients


def buffer_ratio(c: dict) -> float | None:
    """Planner's buffer column / what is resident beyond model states (None below 1 MiB: nothing to compare)."""
    beyond = beyond_states(c)
    return c["planner"]["buffers"] / beyond if beyond >= MiB else None


def buffers_table(cells: list[dict]) -> str:
    lines = table_head(
        "shape",
        "stage",
        "ranks",
        "resident at the backward peak MiB",
        "params / grads / optimizer / ZeRO's tensors / gathered params MiB",
        "beyond the model states MiB",
        "planner's buffers MiB",
        "planner / beyond",
    )
    for c in cells:
        peak, ratio = c["backward_peak"], buffer_ratio(c)
        parts = " / ".join(f"{peak[k] / MiB:.2f}" for k in ("params", "grads", "optimizer", "buffers", "gathered"))
        lines.append(
            f"| {c['shape']} | {c['stage']} | {c['world_size']} | {peak['resident'] / MiB:.2f} | {parts} | "
            f"{beyond_states(c) / MiB:.2f} | {c['planner']['buffers'] / MiB:.2f} | "
            + (f"{ratio:.1f}x" if ratio else "n/a (under 1 MiB)")
            + " |"
        )
    return "\n".join(lines)


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from a memory.json document alone (no clock, no measurement)."""
    cells = [compare(c) for c in document["results"]["cells"]]
    worst = max(cells, key=lambda c: c["rel_error"])
    verdict = "met" if worst["rel_error"] <= GOAL else "NOT met"
    ratios = [r for r in map(buffer_ratio, cells) if r]
    summary = (
        f"Model states after the step: max relative error {worst['rel_error'] * 100:.3f} % against the planner's "
        f"own function ({worst['shape']}, stage {worst['stage']}, {worst['world_size']} ranks): goal <= "
        f"{GOAL * 100:.0f} % {verdict}. Buffer column: {min(ratios):.1f}x to {max(ratios):.1f}x what is resident "
        "at the peak of the backward pass, so `estimate` labels it an upper bound."
    )
    return {
        "memory": f"{summary}\n\n{states_table(cells)}\n\n{STATES_TEXT}\n\n{buffers_table(cells)}\n\n{BUFFERS_TEXT}",
        BUFFER_SECTION: buffer_summary(cells),
    }


def buffer_summary(cells: list[dict]) -> str:
    """One paragraph for docs/tools.md: the buffer column's measured ratio per stage."""
    parts = []
    for stage in sorted({c["stage"] for c in cells}):
        ratios = [r for c in cells if c["stage"] == stage and (r := buffer_ratio(c))]
        if ratios:
            parts.append(f"stage {stage}: {min(ratios):.1f}x to {max(ratios):.1f}x")
    shapes = ", ".join(sorted({f"{c['shape']} ({c['num_params'] / 1e6:.1f}M)" for c in cells}))
    ranks = ", ".join(str(n) for n in sorted({c["world_size"] for c in cells}))
    return (
        "The `buffers <=` column divided by the ZeRO buffers and gathered parameters resident at the peak of a real "
        f"backward pass ({shapes}; bf16; {ranks} CPU ranks; buckets scaled to the model as the presets scale "
        f"them): {'; '.join(parts)}. An upper bound by that much; every case is in "
        "[benchmarks.md](benchmarks.md), section memory."
    )


STATES_TEXT = """Planner: `zero-recipes estimate --model-config config.json --gpus 4` (and 1, 2: the ranks
column) for the model's own config (common.tools.memory.plan, the row of the stage's preset), and the same function,
`guide_model_states`, with gradients released, which is the state after `step()`: 2K params + 12K optimizer
(stage 0), 2K + 12K/N (stages 1 and 2), 2K/N + 2K_p + 12K/N (stage 3). K_p are the parameters at or under the
persistence threshold (10 x hidden, DeepSpeed's rule `numel <= threshold`: the RMSNorm weights): DeepSpeed keeps each
whole on every rank *as well as* its partition, so they cost 2 B x K_p on top of 16K/N, which the planner
now adds (the `persistent params` column: DeepSpeed's count, then the planner's). The planner's printed
model-states column counts gradients alive (2K below stage 2, 2K/N from stage 2), the peak of the
backward pass."""

BUFFERS_TEXT = """At the peak of the backward pass of the second step (Adam's moments exist from the first; a
snapshot after every parameter's gradient, the worst rank), everything the rank holds: parameters, gradients
in `param.grad`, optimizer states, the ZeRO optimizer's own tensors (flat groups, buckets, gradient
partitions) and, under stage 3, the parameters gathered at that moment. "Beyond the model states" takes
away the parameters, the optimizer states and one gradient of the formulas' size (2K below stage 2, 2K/N from
stage 2) wherever DeepSpeed keeps it: the rest is what the buffer column stands for. The planner's buffer column is what
DeepSpeed documents for its buckets for stages 0-2 (4.5 x (reduce + all-gather bucket) with `overlap_comm`):
the most the buckets may take, not what a model smaller than a bucket fills, so `estimate` prints it as an
upper bound and this table gives the ratio. Stage 3: the reduce bucket (the gradients in `param.grad` waiting
for it) + the gathered parameters, which DeepSpeed keeps whole while it will reuse them, up to
`stage3_max_live_parameters` (1e9): here the whole sharded model, in one flat buffer. On one rank a
partition is the whole parameter and nothing is gathered on top."""


def measure(world_sizes: list[int]) -> list[dict]:
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for world_size in world_sizes:
            out = Path(tmp) / f"memory-{world_size}.json"
            launch_group(HERE / "_memory_worker.py", "raw", "", ["--out", str(out)], nproc=world_size)
            for row in json.loads(out.read_text()):
                cells.append(cell(row, world_size))
                c = compare(cells[-1])
                print(
                    f"{c['shape']:>10} stage {c['stage']} ranks {world_size}: planner "
                    f"{c['planner']['states_after_step'] / MiB:9.3f} MiB measured "
                    f"{c['after_step']['model_states'] / MiB:9.3f} MiB  error {c['rel_error'] * 100:.3f} %",
                    flush=True,
                )
    return sorted(cells, key=lambda c: (c["shape"], c["stage"], c["world_size"]))


# --render: a results file that is missing or was not written by write_results is one line, not a traceback.
@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--world-sizes", default="1,2,4")
    args = parser.parse_args()
    if not args.render:
        write_results(RESULTS, {"cells": measure([int(n) for n in args.world_sizes.split(",")])})
    render_from_file(RESULTS, render_sections, DOCS)


if __name__ == "__main__":
    main()
