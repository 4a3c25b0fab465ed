"""Driver of bench/gpu.sh: the NLP recipe at 1B class on one GPU, or every part on a tiny size on a CPU.

    bash bench/gpu.sh                 # one GPU: llama_1b.yaml, writes docs/benchmarks_gpu.md (section "gpu")
    bash bench/gpu.sh --cpu           # no GPU: the same variants on the tiny model (section "cpu-mode")
    python bench/gpu.py --cpu --variants stage2,ac_full --doc /tmp/x.md --json /tmp/x.json   # a subset, elsewhere
    python bench/gpu.py --cpu --render    # rewrite the section from bench/results/gpu_cpu_mode.json, measuring nothing

Variants (one fresh process each, bench/_gpu_worker.py): ZeRO stages 0-3, stage 3 + CPU offload, ZeRO++ beside
stage 3, NVMe offload and bf16 optimizer states (not ZenFlow: DeepSpeed builds its optimizers from the
config's ``optimizer`` section, and the recipes pass their own, tests/distributed/test_zenflow.py), each with the
config's attention (``auto``: FlashAttention-2 when flash-attn is installed on a GPU, else SDPA) and its
activation checkpointing (``selective`` in llama_1b.yaml); SDPA forced, to compare with FlashAttention-2;
activation-checkpointing presets none / full / every_k; a long sequence (``long_seq_len``) with and without
the tiled MLP and loss, and with checkpoint offload. Reports tokens/s, MFU (PaLM's FLOPs count,
common/metrics.py) and peak allocated memory (peak RSS on a CPU). A variant that fails (out of memory,
say) keeps its last error line; the whole run stops starting variants after --budget-s seconds so it
finishes within 8 minutes. Results go to bench/results/gpu.json (gpu_cpu_mode.json with --cpu) through
write_results, and the docs section is rendered from that file alone (``render_sections``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench helpers, and the repository when not installed
from _bench_util import REPO, launch_group, load_document, publish_sections, table_head, write_results  # noqa: E402

from common.errors import ConfigError, exit_on_user_error, nearest  # noqa: E402

GPU_DOC = REPO / "docs" / "benchmarks_gpu.md"
GPU_RUN = {
    "config": "recipes/nlp/configs/llama_1b.yaml",
    "overrides": ["micro_batch_size=4", "grad_accum=1"],
    "steps": 10,
    "warmup": 3,
    "long_seq_len": 16384,
}
CPU_RUN = {
    "config": "recipes/nlp/configs/tiny_cpu.yaml",
    "overrides": ["micro_batch_size=2", "seq_len=64", "grad_accum=1", "activation_checkpointing=selective"],
    "steps": 5,
    "warmup": 2,
    "long_seq_len": 256,
}
# name: (preset, extra overrides); the baseline is stage 0 (one GPU: nothing to shard, the fastest rung).
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "stage0": ("ddp", []),
    "stage1": ("deepspeed_stage_1", []),
    "stage2": ("deepspeed_stage_2", []),
    "stage3": ("deepspeed_stage_3", []),
    "stage3_offload": ("deepspeed_stage_3_offload", []),
    # ZeRO++ beside plain stage 3 (qwZ and qgZ use DeepSpeed's CUDA quantizer kernels; on one GPU hpZ
    # has one device per node and is off), NVMe offload (ZeRO-Infinity) into the run's temporary folder, and the
    # bf16 optimizer states.
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
    # Long context, one device: a long sequence (16K tokens on a GPU) with and without the tiled MLP and loss
    # (common/tiling.py): the peak memory they save, and what the recomputation costs in tokens/s.
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
PROCESSES = {"long_sp2": 2}  # one process (device) unless named here
GiB = 2**30
RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:")  # torchrun's prefix on a rank's output
EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b:?")  # ValueError: ...


def failure_reason(output: str) -> str:
    """The exception a failed launch ended with (``ValueError: ...``), found in its output: the last line that starts
    with an exception's name (after a ``[rank0]:`` prefix), other than torchrun's own ``ChildFailedError`` that
    wraps it; torchrun's other lines (``traceback : To enable traceback see ...``) are not one."""
    lines = [RANK_PREFIX.sub("", line).strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    raised = [line for line in lines if EXCEPTION_LINE.match(line) and "ChildFailedError" not in line]
    return (raised[-1] if raised else lines[-1] if lines else "failed without output")[:200]


def run_variant(name: str, base: dict, tmp: Path) -> dict:
    preset, extra = VARIANTS[name]
    extra = [item.replace("{tmp}", str(tmp / name)) for item in extra]  # a folder of the variant's own
    extra = [item.replace("{long_seq_len}", str(base["long_seq_len"])) for item in extra]
    for item in extra:
        key, _, value = item.partition("=")
        if key == "nvme_path":  # the recipes refuse a swap folder that does not exist yet
            Path(value).mkdir(parents=True, exist_ok=True)
    variant = {**base, "name": name, "overrides": [*base["overrides"], f"preset={preset}", *extra]}
    out = tmp / f"{name}.json"
    started = time.perf_counter()
    try:
        launch_group(
            HERE / "_gpu_worker.py",
            "raw",
            preset,
            ["--variant", json.dumps(variant), "--out", str(out)],
            nproc=PROCESSES.get(name, 1),
            timeout=240,
        )
    except (RuntimeError, OSError) as err:
        return {**variant, "error": failure_reason(str(err))}
    except Exception as err:  # subprocess.TimeoutExpired: the variant took too long
        return {**variant, "error": f"{type(err).__name__}: {err}"[:200]}
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def table(results: list[dict]) -> str:
    lines = table_head("variant", "ZeRO", "attention", "activation ckpt", "tokens/s", "MFU", "peak memory", "step ms")
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | did not run: `{r['error']}` | | | | | | |")
            continue
        mfu = "-" if r["mfu"] is None else f"{r['mfu'] * 100:.1f} %"
        lines.append(
            f"| {r['name']} | {r['stage']} | {r['attention_used']} | {r['activation_checkpointing']} | "
            f"{r['tokens_per_s']:.0f} | {mfu} | {r['peak_memory_bytes'] / GiB:.2f} GiB ({r['memory_kind']}) | "
            f"{r['median_step_s'] * 1e3:.0f} |"
        )
    return "\n".join(lines)


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from a gpu*.json document alone (no clock, no measurement)."""
    results = document["results"]
    base, variants = results["run"], results["variants"]
    device = next((r["device"] for r in variants if "device" in r), "none")
    body = (
        f"{base['config']} with {' '.join(base['overrides'])}, one process, {base['steps']} steps per variant "
        f"({base['warmup']} warm-up), random tokens; device: {device}. MFU: PaLM's 6N + 12LHQT FLOPs per token "
        "over the GPU's dense bf16 peak (recomputation not counted).\n\n" + table(variants)
    )
    return {section_name(results): body}


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


# --render: a results file that is missing or was not written by write_results is one line, not a traceback.
@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny size on a CPU: checks every part runs")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no variant after this many seconds")
    parser.add_argument("--doc", type=Path, default=GPU_DOC)
    parser.add_argument("--json", type=Path, default=None, help="results file (default bench/results/gpu*.json)")
    parser.add_argument("--render", action="store_true", help="rewrite the doc from the results file; measure nothing")
    args = parser.parse_args()
    results_file = args.json or HERE / "results" / ("gpu_cpu_mode.json" if args.cpu else "gpu.json")
    if args.render:
        publish(load_document(results_file), args.doc)
        return
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ConfigError(
            f"unknown variant {unknown[0]!r}{nearest(unknown[0], VARIANTS)}; valid: {', '.join(VARIANTS)}"
        )
    base = CPU_RUN if args.cpu else GPU_RUN
    started = time.perf_counter()
    variants = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if time.perf_counter() - started > args.budget_s:
                variants.append({"name": name, "error": f"not started: past the {args.budget_s:.0f} s budget"})
                continue
            devices = PROCESSES.get(name, 1)
            if not args.cpu and torch.cuda.device_count() < devices:
                variants.append({"name": name, "error": f"not run: needs {devices} GPUs, this machine has fewer"})
                continue
            variants.append(run_variant(name, base, Path(tmp)))
            r = variants[-1]
            print(
                f"{name:>15}: "
                + (
                    r["error"]
                    if "error" in r
                    else f"{r['tokens_per_s']:.0f} tokens/s, "
                    f"MFU {r['mfu']}, peak {r['peak_memory_bytes'] / GiB:.2f} GiB"
                ),
                flush=True,
            )
    results = {"mode": "cpu" if args.cpu else "gpu", "run": base, "variants": variants}
    publish(write_results(results_file, results), args.doc)
    print(f"wrote {results_file} and {args.doc} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
