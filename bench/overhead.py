"""Framework overhead: the NLP tiny model's training step through Lightning and Accelerate vs raw DeepSpeed.

    python bench/overhead.py [--presets deepspeed_stage_2,nlp] [--reps 3] [--steps 12]

Same model (Llama tiny, 5.3M params), same resolved DeepSpeed config, same data, 2 CPU processes.
Repetitions are interleaved (raw, Lightning, Accelerate, then again in rotated order) so that machine
load drifts affect all three alike. For each repetition the median step time after 2 warm-up steps is
taken; the reported ratio is the median over repetitions of backend / raw. Goal: <= 1.05.
Writes docs/benchmarks.md (section "overhead") and bench/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _bench_util import launch_group, median, write_section  # noqa: E402

BACKENDS = ("raw", "lightning", "accelerate")
WARMUP = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="deepspeed_stage_2,nlp")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    presets = args.presets.split(",")
    medians: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for preset in presets:
                order = BACKENDS[rep % 3 :] + BACKENDS[: rep % 3]
                for backend in order:
                    out = Path(tmp) / f"{backend}-{preset}-{rep}.json"
                    launch_group(
                        HERE / "_step_worker.py",
                        backend,
                        preset,
                        ["--backend", backend, "--preset", preset, "--steps", str(args.steps), "--out", str(out)],
                    )
                    times = json.loads(out.read_text())["step_times"][WARMUP:]
                    medians.setdefault((backend, preset), []).append(median(times))
                    print(
                        f"rep {rep} {preset:>18} {backend:>10}: median step {median(times) * 1e3:8.1f} ms", flush=True
                    )
    rows = []
    for preset in presets:
        raw = medians[("raw", preset)]
        for backend in ("lightning", "accelerate"):
            ratios = [b / r for b, r in zip(medians[(backend, preset)], raw)]
            rows.append(
                {
                    "preset": preset,
                    "backend": backend,
                    "ratio": median(ratios),
                    "ratios": ratios,
                    "raw_ms": median(raw) * 1e3,
                    "backend_ms": median(medians[(backend, preset)]) * 1e3,
                }
            )
    lines = [
        "| preset | backend | step time / raw DeepSpeed (median of reps) | per rep | raw ms | backend ms |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        per_rep = ", ".join(f"{r:.3f}" for r in row["ratios"])
        lines.append(
            f"| {row['preset']} | {row['backend']} | **{row['ratio']:.3f}** | {per_rep} | "
            f"{row['raw_ms']:.0f} | {row['backend_ms']:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "overhead.json").write_text(json.dumps(rows, indent=2))
    write_section(
        "overhead",
        f"python bench/overhead.py --presets {args.presets} --reps {args.reps} --steps {args.steps}",
        time.strftime("%Y-%m-%d"),
        table,
    )


if __name__ == "__main__":
    main()
