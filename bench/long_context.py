"""Long context: the longest sequence the planner fits with Ulysses sequence parallelism, and the activation bytes
it is built on, measured.

    python bench/long_context.py             # plan Llama-3-8B on 8 x 80 GB, measure the 2-rank activation cases
    python bench/long_context.py --render    # rewrite docs/long_context.md from bench/results/long_context.json

Two sections of docs/long_context.md, both rendered from bench/results/long_context.json alone:

- "Longest sequence, planned": ``zero-recipes estimate``'s search (common.tools.memory.longest_sequence) for the
  recipe's ``8b`` size (Llama-3-8B) on 8 devices of 80 GB, micro batch 1, bf16, SDPA/FlashAttention, per SP size and
  checkpointing preset: the longest multiple of 1,024 tokens whose planner total (model states + buffers + the
  bytes saved for backward) fits 90 % of a device. Predictions, not measurements: nothing runs on a GPU.
- "Ulysses activations, measured": tests/distributed/sequence_parallel_activation_worker.py on 2 gloo processes
  (the worker tests/unit/test_sequence_parallel_activations.py runs): bytes saved for backward per rank at SP 2 and
  at SP 1 for the same sequence, beside the planner's figures for both.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed
from bench._bench_util import (  # noqa: E402
    REPO,
    bench_env,
    bench_parser,
    render_from_file,
    table_head,
    torchrun_command,
    write_results,
)
from common.errors import exit_on_user_error  # noqa: E402
from common.memory_formulas import facts_from_model_config, transformer_activations  # noqa: E402
from common.tools import memory  # noqa: E402
from common.tools.memory import PlanInputs  # noqa: E402
from nlp.model import build_llama_config  # noqa: E402

RESULTS = HERE / "results" / "long_context.json"
DOC = REPO / "docs" / "long_context.md"
WORKER = REPO / "tests" / "distributed" / "sequence_parallel_activation_worker.py"
GPUS, GPU_MEMORY = 8, 80e9
SEQUENCE_PARALLEL = (1, 2, 4, 8)
PRESETS = ("none", "save_memory_optimized", "full")
SECTIONS = ("Longest sequence, planned", "Ulysses activations, measured")


def plan_longest() -> list[dict]:
    """For each SP size and checkpointing preset, the planner's longest sequence on the device alone and with
    offload (the row that reaches it named)."""
    facts = facts_from_model_config(build_llama_config("8b"), "the recipe's 8b size (Llama-3-8B)")
    rows = []
    for preset in PRESETS:
        for sp in SEQUENCE_PARALLEL:
            inputs = PlanInputs(
                gpus_per_node=GPUS,
                seq_len=8192,  # any multiple of SP: the search does not depend on it
                activation_checkpointing=preset,
                device_memory_bytes=GPU_MEMORY,
                device_memory_label="--gpu-memory 80GB",
                sequence_parallel=sp,
            )
            summary = memory.longest_summary(memory.plan(facts, inputs))
            rows.append(
                {
                    "model": "8b",
                    "num_params": facts.num_params,
                    "gpus": GPUS,
                    "gpu_memory_bytes": GPU_MEMORY,
                    "activation_checkpointing": preset,
                    "sequence_parallel": sp,
                    "on_device": summary["with_sp"]["on_device"],
                    "with_offload": summary["with_sp"]["any"],
                    "command": f"zero-recipes estimate --model-config CONFIG --gpus {GPUS} --gpu-memory 80GB "
                    f"--activation-checkpointing {preset}" + (f" --sequence-parallel {sp}" if sp > 1 else ""),
                }
            )
    return rows


def measure_activations() -> list[dict]:
    """The worker's cases on 2 gloo processes, with the planner's figures at SP 1 and SP 2."""
    with tempfile.TemporaryDirectory() as out:
        command = [*torchrun_command(2), str(WORKER), "--out", out]
        proc = subprocess.run(command, cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"the worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        cases = json.loads((Path(out) / "rank0.json").read_text())["cases"]
    for case in cases:
        config = build_llama_config("tiny", vocab_size=case["vocab_size"], seq_len=case["seq_len"], **case["config"])
        facts = facts_from_model_config(config, case["shape"])
        run = (case["seq_len"], case["micro_batch_size"], case["checkpointing"], case["precision"], case["attention"])
        case["sp1_planned"] = transformer_activations(facts, *run)
        case["sp2_planned"] = transformer_activations(facts, *run, sequence_parallel=2)
    return cases


def _tokens(entry: dict | None) -> str:
    return "none" if entry is None else f"{entry['seq_len']:,}"


def render_longest(rows: list[dict]) -> str:
    lines = [
        "Llama-3-8B (the recipe's `8b`, 8.03B parameters) on 8 devices of 80 GB, micro batch 1, bf16, SDPA or "
        "FlashAttention-2: the longest sequence, in multiples of 1,024 tokens, whose planner total fits 90 % of a "
        'device. **Predictions of the planner, not measurements.** "On the device" is ZeRO-3 without offload; '
        '"with offload" the best row of any (the ZeRO stage and what it offloads named). Each row is the command in '
        "its last column.",
        "",
        *table_head("checkpointing", "SP", "on the device (ZeRO-3)", "with offload", "vs SP 1", "command"),
    ]
    base = {r["activation_checkpointing"]: r for r in rows if r["sequence_parallel"] == 1}
    for r in rows:
        one = base[r["activation_checkpointing"]]["on_device"]
        gain = f"{r['on_device']['seq_len'] / one['seq_len']:.1f}x" if r["on_device"] and one else "-"
        offload = r["with_offload"]
        offload_text = (
            f"{_tokens(offload)} (stage {offload['stage']}, {offload['offload']} offload)" if offload else "none"
        )
        lines.append(
            f"| {r['activation_checkpointing']} | {r['sequence_parallel']} | {_tokens(r['on_device'])} | "
            f"{offload_text} | {gain} | `{r['command']}` |"
        )
    return "\n".join(lines)


def render_measured(cases: list[dict]) -> str:
    ratios = [c["sp2_peak"] / c["sp1_peak"] for c in cases]
    errors = [abs(c[f"sp{n}_planned"] / c[f"sp{n}_peak"] - 1) for c in cases for n in (1, 2)]
    lines = [
        f"{len(cases)} cases, tiny Llamas (hidden 64, 4 heads), fp32, SDPA, 2 gloo processes. Per rank, SP 2 saved "
        f"{min(ratios):.1%} to {max(ratios):.1%} of what SP 1 saves for the same sequence (the bar: at most "
        f"55 %); the planner was within {max(errors):.2%} of every measurement (bar: 10 %).",
        "",
        *table_head(
            "shape (KV heads)",
            "seq x batch",
            "checkpointing",
            "SP 1 measured kB",
            "SP 1 planner error",
            "SP 2 measured kB",
            "SP 2 planner error",
            "SP 2 / SP 1",
        ),  # fmt: skip
    ]
    for c in cases:
        kv = c["config"]["num_key_value_heads"]
        lines.append(
            f"| {c['shape']} ({kv}) | {c['seq_len']} x {c['micro_batch_size']} | {c['checkpointing']} | "
            f"{c['sp1_peak'] / 1e3:,.1f} | {c['sp1_planned'] / c['sp1_peak'] - 1:+.2%} | {c['sp2_peak'] / 1e3:,.1f} | "
            f"{c['sp2_planned'] / c['sp2_peak'] - 1:+.2%} | {c['sp2_peak'] / c['sp1_peak']:.3f} |"
        )
    return "\n".join(lines)


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from a long_context.json document alone (no clock, no measurement)."""
    results = document["results"]
    return {
        SECTIONS[0]: render_longest(results["longest"]),
        SECTIONS[1]: render_measured(results["measured"]),
    }


@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = bench_parser(__doc__)
    args = parser.parse_args()
    if not args.render:
        write_results(RESULTS, {"longest": plan_longest(), "measured": measure_activations()})
    render_from_file(RESULTS, render_sections, {name: DOC for name in SECTIONS})


if __name__ == "__main__":
    main()
