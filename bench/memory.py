"""Model-state bytes per rank: measured after a real DeepSpeed step vs the planner's prediction.

    python bench/memory.py [--world-sizes 1,2,4]

Stages 0-3 (presets ddp, deepspeed_stage_1/2/3, bf16), 1, 2 and 4 CPU processes (gloo), two Llama shapes
(bench/_memory_worker.py). Measured: common.accounting.model_state_bytes on every rank after one optimizer
step (parameters + live gradients + optimizer states; ZeRO has released the gradients by then). Predicted:
the planner's model-state formula (common.accounting.predicted_model_state_bytes, which
``zero-recipes estimate`` adds gradients to for its peak) with gradients released and the stage-3
parameters under the persistence threshold kept whole. The error of a cell is the worst rank's
|measured - predicted| / predicted. Goal: max relative error <= 5 %. ZeRO buffers (flat groups, buckets)
are not model states; they are shown beside the planner's buffer term for orientation.
Writes docs/benchmarks.md (section "memory") and bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench helpers, and the repository when not installed
from _bench_util import launch_group, table_head, write_section  # noqa: E402

from common.accounting import predicted_model_state_bytes  # noqa: E402
from common.memory import buffer_bytes  # noqa: E402

GOAL = 0.05
RESULTS = HERE / "results" / "memory.json"
MiB = 2**20


def predicted(row: dict, world_size: int) -> float:
    persistent = row["persistent_params"] if row["stage"] == 3 else 0
    parts = predicted_model_state_bytes(row["num_params"], row["stage"], world_size, "bf16", False, persistent)
    return parts["model_states"]


def cell(row: dict, world_size: int) -> dict:
    """Worst rank's relative error, plus what the bytes are made of on that rank."""
    want = predicted(row, world_size)
    worst = max(row["ranks"], key=lambda r: abs(r["model_states"] - want))
    zero = row["zero_optimization"]
    bucket = int(zero.get("reduce_bucket_size", 0))
    return {
        "shape": row["shape"],
        "stage": row["stage"],
        "world_size": world_size,
        "num_params": row["num_params"],
        "persistent_params": row["persistent_params"],
        "predicted": want,
        "measured": worst["model_states"],
        "measured_parts": {k: worst[k] for k in ("params", "grads", "optimizer")},
        "rel_error": abs(worst["model_states"] - want) / want,
        "buffers": worst["buffers"],
        "planner_buffers": buffer_bytes(row["stage"], zero, "bf16", row["largest_layer_params"], bucket),
    }


def table(cells: list[dict]) -> str:
    lines = table_head(
        "shape (params)",
        "stage",
        "ranks",
        "predicted MiB",
        "measured MiB (params / grads / optimizer)",
        "error",
        "ZeRO buffers MiB (planner's buffer term)",
    )
    for c in cells:
        parts = c["measured_parts"]
        lines.append(
            f"| {c['shape']} ({c['num_params'] / 1e6:.2f}M) | {c['stage']} | {c['world_size']} | "
            f"{c['predicted'] / MiB:.3f} | {c['measured'] / MiB:.3f} ({parts['params'] / MiB:.2f} / "
            f"{parts['grads'] / MiB:.2f} / {parts['optimizer'] / MiB:.2f}) | {c['rel_error'] * 100:.3f} % | "
            f"{c['buffers'] / MiB:.1f} ({c['planner_buffers'] / MiB:.1f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--render", action="store_true", help="rewrite the docs section from the last results")
    args = parser.parse_args()
    cells = json.loads(RESULTS.read_text()) if args.render else []
    with tempfile.TemporaryDirectory() as tmp:
        for world_size in [] if args.render else (int(n) for n in args.world_sizes.split(",")):
            out = Path(tmp) / f"memory-{world_size}.json"
            launch_group(HERE / "_memory_worker.py", "raw", "", ["--out", str(out)], nproc=world_size)
            for row in json.loads(out.read_text()):
                cells.append(cell(row, world_size))
                c = cells[-1]
                print(
                    f"{c['shape']:>10} stage {c['stage']} ranks {world_size}: "
                    f"predicted {c['predicted'] / MiB:9.3f} MiB "
                    f"measured {c['measured'] / MiB:9.3f} MiB  error {c['rel_error'] * 100:.3f} %",
                    flush=True,
                )
    cells.sort(key=lambda c: (c["shape"], c["stage"], c["world_size"]))
    worst = max(cells, key=lambda c: c["rel_error"])
    verdict = "met" if worst["rel_error"] <= GOAL else "NOT met"
    summary = (
        f"Max relative error {worst['rel_error'] * 100:.3f} % ({worst['shape']}, stage {worst['stage']}, "
        f"{worst['world_size']} ranks): goal <= {GOAL * 100:.0f} % {verdict}."
    )
    print(summary)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(cells, indent=2))
    body = f"{summary}\n\n{table(cells)}\n\n{EXPLANATION}"
    write_section("memory", f"python bench/memory.py --world-sizes {args.world_sizes}", time.strftime("%Y-%m-%d"), body)


EXPLANATION = """Measured: bytes rank by rank after one bf16 step (common/accounting.py counts every live tensor
storage once), the worst rank shown. Predicted: 2K params + 12K optimizer (stage 0), 2K + 12K/N (stages 1
and 2), 2K_s/N + 2K_p + 12K/N (stage 3, K_p = parameters under the persistence threshold, kept whole on
every rank: the norms, 2.3k of 5.3M here). Gradients are released by `step()`; the guide's gradient
term (2K, 2K/N) is what the planner's peak adds for the backward pass. The error left (at most a few KiB,
stage 3 only) is DeepSpeed's alignment padding of each rank's flat partition.

Where the other bytes are (ZeRO buffers, not model states): stage 3 keeps its preallocated reduce bucket
(`reduce_bucket_size` = 32 x hidden^2 bf16 elements: 4.0 MiB for the tiny model) plus the bf16 gradient
partition, 2K/N (10.0 / 5.0 / 2.5 MiB for N = 1 / 2 / 4: exactly the measured 14.0 / 9.0 / 6.5 MiB), which
the planner counts as its gradient term; its buffer column (reduce bucket + prefetch bucket or largest
layer, 7.6 MiB) covers the gathered parameters in flight during forward and backward, gone after the step.
Stages 1-2 keep 2.5 MiB (tiny) of flat-group bookkeeping after the step; the planner's buffer column (8 and
36 MiB) is DeepSpeed's documented in-flight bucket cost (4.5 x buckets with overlap_comm), an upper bound
for the backward pass, not a resident cost."""


if __name__ == "__main__":
    main()
