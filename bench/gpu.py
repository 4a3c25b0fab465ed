"""Driver of bench/gpu.sh: the NLP recipe at 1B class on one GPU, or every part on a tiny size on a CPU.

    bash bench/gpu.sh --first-run     # one GPU, < 8 min: doctor, stages 0 and 3, a recipe run with async_save, the
                                      # long sequence with and without tiling, no activation checkpointing
    bash bench/gpu.sh                 # one GPU: every variant, llama_1b.yaml (section "gpu")
    bash bench/gpu.sh --cpu           # no GPU: the same variants on the tiny model (section "cpu-mode")
    python bench/gpu.py --cpu --variants stage2,ac_full --doc /tmp/x.md --json /tmp/x.json   # a subset, elsewhere
    python bench/gpu.py --cpu --render    # rewrite the section from bench/results/gpu_cpu_mode.json, measuring nothing

Variants (one fresh process each, bench/_gpu_worker.py): ZeRO stages 0-3, their FSDP2 peers (``fsdp2_grad_op``
beside stage 2, ``fsdp2`` beside stage 3), stage 3 + CPU offload, ZeRO++ beside
stage 3, NVMe offload and bf16 optimizer states (not ZenFlow: DeepSpeed builds its optimizers from the config's
``optimizer`` section, and the recipes pass their own, tests/distributed/test_zenflow.py), each with the config's
attention (``auto``: FlashAttention-2 when flash-attn is installed on a GPU, else SDPA) and its activation
checkpointing (``selective`` in llama_1b.yaml); SDPA forced, to compare with FlashAttention-2; activation-checkpointing
presets none / full / every_k; a long sequence (``long_seq_len``) with and without the tiled MLP and loss, and with
checkpoint offload. Reports tokens/s, MFU (PaLM's FLOPs count, common/metrics.py) and peak allocated memory (peak
RSS on a CPU). Two more are whole commands: ``recipe_async_save`` runs the NLP recipe (train.py) for a few steps
with ``async_save=true`` (how long each save held training, beside the median step), ``doctor`` runs
``zero-recipes doctor`` (the GPU's link and the findings).

Every variant runs in a session of its own under a time limit (``TIMEOUT_S``, never past the run's ``--budget-s``):
past it, the launcher and every worker are killed (``_bench_util.run_group``), so that a hung variant neither holds
the GPU nor eats the budget of the ones after it, and its row says it timed out. A variant that fails (out of
memory, say) keeps its exception's line. The results file is written after every variant (through
write_results, bench/results/gpu.json, gpu_cpu_mode.json with --cpu), so a run stopped by a signal keeps the rows
before it; the docs section is rendered from that file alone (``render_sections``).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed
from bench._bench_util import (  # noqa: E402
    REPO,
    bench_env,
    bench_parser,
    launch_group,
    load_document,
    publish_sections,
    run_group,
    table_head,
    write_results,
)
from common.errors import ConfigError, exit_on_user_error, nearest  # noqa: E402
from common.rundir import read_metrics  # noqa: E402
from common.tools.doctor import pcie_text  # noqa: E402

GPU_DOC = REPO / "docs" / "benchmarks_gpu.md"
# The recipe run: enough steps that a save happens mid-run (its write overlaps the steps after it) and at the end;
# one checkpoint kept, so that the disk holds at most two (about 15 GB each at 1B under ZeRO-3).
RECIPE_OVERRIDES = ["async_save=true", "keep_last=1", "devices=1", "sample_tokens=8"]
GPU_RUN = {
    "config": "recipes/nlp/configs/llama_1b.yaml",
    "overrides": ["micro_batch_size=4", "grad_accum=1"],
    "steps": 10,
    "warmup": 3,
    "long_seq_len": 16384,
    "recipe_overrides": [
        *RECIPE_OVERRIDES,
        "max_steps=10",
        "checkpoint_interval=5",
        "eval_interval=10",
        "log_interval=5",
        "max_val_tokens=16384",
    ],
}
CPU_RUN = {
    "config": "recipes/nlp/configs/tiny_cpu.yaml",
    "overrides": ["micro_batch_size=2", "seq_len=64", "grad_accum=1", "activation_checkpointing=selective"],
    "steps": 5,
    "warmup": 2,
    "long_seq_len": 256,
    "recipe_overrides": [
        *RECIPE_OVERRIDES,
        "max_steps=4",
        "checkpoint_interval=2",
        "eval_interval=4",
        "log_interval=2",
        "max_val_tokens=2048",
    ],
}
# name: (preset, extra overrides); the baseline is stage 0 (one GPU: nothing to shard, the fastest rung).
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "stage0": ("ddp", []),
    "stage1": ("deepspeed_stage_1", []),
    "stage2": ("deepspeed_stage_2", []),
    "stage3": ("deepspeed_stage_3", []),
    # PyTorch FSDP2, the peer of stages 2 and 3 that shard the same states (docs/presets.md): weights kept
    # whole from a block's forward to its backward (beside stage 2), or freed and gathered again (beside stage 3).
    "fsdp2_grad_op": ("fsdp2_grad_op", []),
    "fsdp2": ("fsdp2", []),
    "stage3_offload": ("deepspeed_stage_3_offload", []),
    # ZeRO++ beside plain stage 3 (qwZ and qgZ use DeepSpeed's CUDA quantizer kernels; on one GPU hpZ has one device
    # per node and is off), NVMe offload (ZeRO-Infinity) into the run's temporary folder, and the bf16 optimizer
    # states.
    "stage3_zeropp": ("deepspeed_stage_3_zeropp", []),
    "stage3_nvme": ("deepspeed_stage_3_offload_nvme", ["nvme_path={tmp}/nvme"]),
    "stage2_bf16_states": (
        "deepspeed_stage_2",
        ["ds_overrides=bf16.bf16_master_weights_and_grads=true,bf16.bf16_optimizer_states=true"],
    ),
    "sdpa": ("ddp", ["attention=sdpa"]),
    "ac_none": ("ddp", ["activation_checkpointing=none"]),
    "ac_full": ("ddp", ["activation_checkpointing=full"]),
    "ac_every_k": ("ddp", ["activation_checkpointing=every_k"]),
    # One device, a long sequence (16K tokens on a GPU) with and without the tiled MLP and loss (common/tiling.py):
    # the peak memory they save, and what the recomputation costs in tokens/s.
    "long": ("deepspeed_stage_2", ["seq_len={long_seq_len}", "micro_batch_size=1"]),
    "long_tiled": (
        "deepspeed_stage_2",
        ["seq_len={long_seq_len}", "micro_batch_size=1", "tiled_mlp_shards=8", "tiled_loss_shards=8"],
    ),
    # ... split over 2 devices by Ulysses sequence parallelism (peak memory per device; needs 2 GPUs) ...
    "long_sp2": ("deepspeed_stage_2", ["seq_len={long_seq_len}", "micro_batch_size=1", "sequence_parallel=2"]),
    # ... and every layer checkpointed with its input offloaded to host memory (DeepSpeed's side-stream offload).
    "long_tiled_offload": (
        "deepspeed_stage_2",
        [
            "seq_len={long_seq_len}",
            "micro_batch_size=1",
            "tiled_mlp_shards=8",
            "tiled_loss_shards=8",
            "activation_checkpointing=full",
            "offload_checkpoints=true",
        ],
    ),
}
COMMANDS = ("recipe_async_save", "doctor")  # whole commands, not bench/_gpu_worker.py
NAMES = (*VARIANTS, *COMMANDS)
# The first run on a GPU: what has never run there, in the order that keeps the most if time runs out.
FIRST_RUN = ("doctor", "stage0", "stage3", "recipe_async_save", "long", "long_tiled", "ac_none")
PROCESSES = {"long_sp2": 2}  # one process (device) unless named here
# Seconds one variant may take, launch to exit, from what it does on one H200 at 1B (estimated before it ever ran:
# imports and DeepSpeed's set-up ~25 s, 10 steps of 8K tokens < 10 s; the recipe trains its tokenizer, evaluates,
# saves twice and exports) with room for a slow machine; 240 s on a CPU, where the tiny model loads a 2-core machine.
TIMEOUT_S = {"gpu": {"step": 100.0, "recipe_async_save": 240.0, "doctor": 60.0}, "cpu": {"step": 240.0}}
# The whole run's limit: 7 minutes on a GPU (8 less bench/gpu.sh's checks before it, and room); every variant on a CPU.
BUDGET_S = {"gpu": 420.0, "cpu": 1800.0}
MIN_START_S = 20.0  # a variant is not started with less than this left of the budget
GiB = 2**30
RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:")  # torchrun's prefix on a rank's output
EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b:?")  # ValueError: ...


class Terminated(BaseException):
    """SIGTERM (``timeout``, the device's own limit): stop the running variant with its processes, keep the rows.

    A ``BaseException``, like ``KeyboardInterrupt``, so that no variant's error handling takes it for a failure."""


def raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def failure_reason(output: str) -> str:
    """The exception a failed launch ended with (``ValueError: ...``), found in its output: the last line that starts
    with an exception's name (after a ``[rank0]:`` prefix), other than torchrun's own ``ChildFailedError`` that
    wraps it; torchrun's other lines (``traceback : To enable traceback see ...``) are not one."""
    lines = [RANK_PREFIX.sub("", line).strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    raised = [line for line in lines if EXCEPTION_LINE.match(line) and "ChildFailedError" not in line]
    return (raised[-1] if raised else lines[-1] if lines else "failed without output")[:200]


def timeout_reason(err: subprocess.TimeoutExpired) -> str:
    """A timed-out variant's row: the limit, and the last line it printed before (where it was: stdout's, else
    stderr's)."""
    last = [line.strip() for text in (err.stderr, err.output) if isinstance(text, str) for line in text.splitlines()]
    last = [line for line in last if line]
    said = f"; last output: {last[-1][:200]}" if last else ""
    return f"timed out after {err.timeout:.0f} s, every process killed{said}"


def run_variant(name: str, base: dict, tmp: Path, timeout: float, threads_per_rank: int | None) -> dict:
    """One bench/_gpu_worker.py launch: its result, or ``{"error": ...}``."""
    preset, extra = VARIANTS[name]
    extra = [item.replace("{tmp}", str(tmp / name)) for item in extra]  # a folder of the variant's own
    extra = [item.replace("{long_seq_len}", str(base["long_seq_len"])) for item in extra]
    for item in extra:
        key, _, value = item.partition("=")
        if key == "nvme_path":  # the recipes refuse a swap folder that does not exist yet
            Path(value).mkdir(parents=True, exist_ok=True)
    worker_base = {key: value for key, value in base.items() if key != "recipe_overrides"}
    variant = {**worker_base, "name": name, "overrides": [*base["overrides"], f"preset={preset}", *extra]}
    out = tmp / f"{name}.json"
    started = time.perf_counter()
    try:
        launch_group(
            HERE / "_gpu_worker.py",
            "raw",
            preset,
            ["--variant", json.dumps(variant), "--out", str(out)],
            nproc=PROCESSES.get(name, 1),
            timeout=timeout,
            threads_per_rank=threads_per_rank,
        )
    except subprocess.TimeoutExpired as err:
        return {**variant, "error": timeout_reason(err)}
    except (RuntimeError, OSError) as err:
        return {**variant, "error": failure_reason(str(err))}
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def run_command(name: str, command: list[str], timeout: float, threads_per_rank: int | None) -> tuple[dict, float]:
    """Run a whole command (its own session, killed past ``timeout``): ``({} or {"error": ...}, wall seconds)``."""
    started = time.perf_counter()
    try:
        proc = run_group(command, timeout, bench_env(threads_per_rank))
    except subprocess.TimeoutExpired as err:
        return {"name": name, "error": timeout_reason(err)}, time.perf_counter() - started
    if proc.returncode != 0:
        return {"name": name, "error": failure_reason(proc.stdout + "\n" + proc.stderr)}, time.perf_counter() - started
    return {}, time.perf_counter() - started


def run_recipe(base: dict, tmp: Path, timeout: float, threads_per_rank: int | None) -> dict:
    """recipes/nlp/train.py with ``async_save=true``: how long each save held training, beside the median step."""
    out_dir = tmp / "recipe"
    overrides = [*base["overrides"], *base["recipe_overrides"]]
    command = [sys.executable, "recipes/nlp/train.py", "--config", base["config"], *overrides, f"out_dir={out_dir}"]
    shown = shlex.join(["python", *command[1:-1], "out_dir=RUN"])
    failed, wall_s = run_command("recipe_async_save", command, timeout, threads_per_rank)
    if failed:
        return {**failed, "kind": "recipe", "command": shown}
    summary = json.loads((out_dir / "summary.json").read_text())
    saves = [
        {"step": r["step"], "blocked_s": r["checkpoint_blocked_s"]}
        for r in read_metrics(out_dir)
        if "checkpoint_blocked_s" in r
    ]
    latest = out_dir / "checkpoints" / "latest"
    return {
        "name": "recipe_async_save",
        "kind": "recipe",
        "command": shown,
        "steps": summary["steps"],
        "zero_stage": summary["zero_stage"],
        "saves": saves,
        "latest": latest.read_text().strip() if latest.exists() else None,
        "median_step_s": summary["median_step_s"],
        "tokens_per_s": summary["throughput"]["value"],
        "mfu": summary["mfu"],
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "memory_kind": summary["memory_kind"],
        "val_loss_ratio": summary["val_loss_ratio"],
        "wall_s": wall_s,
    }


def run_doctor(tmp: Path, timeout: float) -> dict:
    """``zero-recipes doctor`` (its module: the console script may not be installed): the GPU's link, the findings."""
    out = tmp / "doctor"
    command = [sys.executable, "-m", "common.tools.doctor", "--out", str(out), "--checkpoint-path", str(tmp)]
    failed, wall_s = run_command("doctor", command, timeout, threads_per_rank=None)
    if failed:
        return {**failed, "kind": "doctor"}
    report = json.loads((out / "doctor.json").read_text())
    versions = report["versions"]
    return {
        "name": "doctor",
        "kind": "doctor",
        "accelerator": report["hardware"]["accelerator"],
        "gpus": report["hardware"]["gpus"],
        "versions": {key: versions.get(key, "none") for key in ("torch", "cuda", "nccl", "deepspeed")},
        "findings": [{"check_id": c["check_id"], "severity": c["severity"]} for c in report["checks"]],
        "wall_s": wall_s,
    }


def step_table(rows: list[dict]) -> str:
    lines = table_head("variant", "ZeRO", "attention", "activation ckpt", "tokens/s", "MFU", "peak memory", "step ms")
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | did not run: `{r['error']}` | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['stage']} | {r['attention_used']} | {r['activation_checkpointing']} | "
            f"{r['tokens_per_s']:.0f} | {mfu_text(r['mfu'])} | {r['peak_memory_bytes'] / GiB:.2f} GiB "
            f"({r['memory_kind']}) | {r['median_step_s'] * 1e3:.0f} |"
        )
    return "\n".join(lines)


def mfu_text(mfu: float | None) -> str:
    return "-" if mfu is None else f"{mfu * 100:.1f} %"


def recipe_text(r: dict) -> str:
    """The recipe run's paragraph: each save's hold on training against the median step."""
    if "error" in r:
        return f"Recipe run with `async_save=true` did not finish: `{r['error']}`."
    saves = ", ".join(
        f"step {s['step']}: {s['blocked_s']:.2f} s ({s['blocked_s'] / r['median_step_s']:.1f} steps)"
        for s in r["saves"]
    )
    return (
        f"Recipe run with `async_save=true` (`{r['command']}`): ZeRO-{r['zero_stage']}, {r['steps']} steps, "
        f"median step {r['median_step_s'] * 1e3:.0f} ms, {r['tokens_per_s']:.0f} tokens/s, MFU {mfu_text(r['mfu'])}, "
        f"peak {r['peak_memory_bytes'] / GiB:.2f} GiB ({r['memory_kind']}), {r['wall_s']:.0f} s in all. Training "
        f"waited, per save: {saves or 'no save logged'}; checkpoints/latest names `{r['latest']}`."
    )


def doctor_text(r: dict) -> str:
    """The doctor's line: the GPUs and their links, and the findings by check id."""
    if "error" in r:
        return f"`zero-recipes doctor` did not finish: `{r['error']}`."
    gpus = "; ".join(f"GPU {g['index']} {g['name']}, PCIe {pcie_text(g)}" for g in r["gpus"]) or r["accelerator"]
    findings = ", ".join(f"{f['severity']} `{f['check_id']}`" for f in r["findings"]) or "none"
    versions = ", ".join(f"{key} {value}" for key, value in r["versions"].items())
    return f"`zero-recipes doctor`: {gpus} ({versions}); findings: {findings}."


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from a gpu*.json document alone (no clock, no measurement)."""
    results = document["results"]
    base, rows = results["run"], results["variants"]
    by_kind = {kind: [r for r in rows if r.get("kind", "step") == kind] for kind in ("step", "recipe", "doctor")}
    reported = {r["name"] for r in rows}
    missing = [name for name in results.get("planned", []) if name not in reported]
    device = next((r["device"] for r in rows if "device" in r), "none")
    parts = [
        f"{base['config']} with {' '.join(base['overrides'])}, one process, {base['steps']} steps per variant "
        f"({base['warmup']} warm-up), random tokens; device: {device}. MFU: PaLM's 6N + 12LHQT FLOPs per token "
        "over the GPU's dense bf16 peak (recomputation not counted).",
        *([step_table(by_kind["step"])] if by_kind["step"] else []),
        *[recipe_text(r) for r in by_kind["recipe"]],
        *[doctor_text(r) for r in by_kind["doctor"]],
    ]
    if missing:
        parts.append(f"Never reported (the run stopped before them): {', '.join(missing)}.")
    return {section_name(results): "\n\n".join(parts)}


def section_name(results: dict) -> str:
    return "cpu-mode" if results["mode"] == "cpu" else "gpu"


def machine_text(results: dict) -> str:
    """What the section's "Command:" line says about the machine: the GPU's name, or that CPU mode checks only."""
    if results["mode"] == "cpu":
        return "CPU mode: tiny size, checks the pipeline, not a performance figure"
    return next((r["device"] for r in results["variants"] if "device" in r), "no device ran")


def publish(document: dict, doc: Path) -> None:
    results = document["results"]
    publish_sections(
        render_sections(document), document["provenance"], {section_name(results): doc}, machine_text(results)
    )


def chosen_names(args: argparse.Namespace) -> list[str]:
    """The variants to run, in order; an unknown name is one line naming the nearest."""
    if args.first_run:
        return list(FIRST_RUN)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ConfigError(f"unknown variant {unknown[0]!r}{nearest(unknown[0], NAMES)}; valid: {', '.join(NAMES)}")
    return names


def run_within(name: str, base: dict, tmp: Path, args: argparse.Namespace, left_s: float, budget_s: float) -> dict:
    """One variant's row, its time limit cut to what is left of the run's budget (not started with too little)."""
    mode = "cpu" if args.cpu else "gpu"
    devices = PROCESSES.get(name, 1)
    if left_s < MIN_START_S:
        return {"name": name, "error": f"not started: past the {budget_s:.0f} s budget"}
    if not args.cpu and torch.cuda.device_count() < devices:
        return {"name": name, "error": f"not run: needs {devices} GPUs, this machine has fewer"}
    limit = min(args.variant_timeout_s or TIMEOUT_S[mode].get(name, TIMEOUT_S[mode]["step"]), left_s)
    threads = 1 if args.cpu else None  # on a GPU the launcher's and the libraries' own thread counts
    if name == "doctor":
        return run_doctor(tmp, limit)
    if name == "recipe_async_save":
        return run_recipe(base, tmp, limit, threads)
    return run_variant(name, base, tmp, limit, threads)


def headline(row: dict) -> str:
    if "error" in row:
        return row["error"]
    if row.get("kind") == "recipe":
        return recipe_text(row)
    if row.get("kind") == "doctor":
        return doctor_text(row)
    return f"{row['tokens_per_s']:.0f} tokens/s, MFU {row['mfu']}, peak {row['peak_memory_bytes'] / GiB:.2f} GiB"


# --render: a results file that is missing or was not written by write_results is one line, not a traceback.
@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--cpu", action="store_true", help="tiny size on a CPU: checks every part runs")
    parser.add_argument("--variants", default=",".join(NAMES))
    parser.add_argument("--first-run", action="store_true", help=f"only {', '.join(FIRST_RUN)}, within 8 minutes")
    parser.add_argument("--budget-s", type=float, default=None, help="the run's limit (default: GPU 420, CPU 1800)")
    parser.add_argument("--variant-timeout-s", type=float, default=None, help="one limit for every variant")
    parser.add_argument("--doc", type=Path, default=GPU_DOC)
    parser.add_argument("--json", type=Path, default=None, help="results file (default bench/results/gpu*.json)")
    args = parser.parse_args()
    results_file = args.json or HERE / "results" / ("gpu_cpu_mode.json" if args.cpu else "gpu.json")
    if args.render:
        publish(load_document(results_file), args.doc)
        return
    names = chosen_names(args)
    mode = "cpu" if args.cpu else "gpu"
    budget_s = args.budget_s or BUDGET_S[mode]
    base = CPU_RUN if args.cpu else GPU_RUN
    results = {"mode": mode, "run": base, "planned": names, "variants": []}
    rows = results["variants"]
    deadline = time.perf_counter() + budget_s
    signal.signal(signal.SIGTERM, raise_terminated)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name in names:
                rows.append(run_within(name, base, Path(tmp), args, deadline - time.perf_counter(), budget_s))
                print(f"{name:>17}: {headline(rows[-1])}", flush=True)
                document = write_results(results_file, results)  # after every variant: a killed run keeps its rows
                publish(document, args.doc)
        except Terminated:  # the running variant's processes are gone (run_group): keep the rows, say where it stopped
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the results file short
            stopped = names[len(rows)] if len(rows) < len(names) else "(between variants)"
            rows.append({"name": stopped, "error": "stopped: the bench was terminated (SIGTERM) during it"})
            publish(write_results(results_file, results), args.doc)
            print(f"stopped by SIGTERM during {stopped}; the rows so far are in {results_file}", flush=True)
            sys.exit(143)
    print(f"wrote {results_file} and {args.doc} in {budget_s - (deadline - time.perf_counter()):.0f} s")


if __name__ == "__main__":
    main()
