"""Peak host memory of ``zero-recipes export`` vs DeepSpeed's ``zero_to_fp32`` on the same ZeRO-3 checkpoint.

    flock /tmp/zr-heavy.lock python bench/export_memory.py                # ~215M-parameter Llama, ~5 min
    python bench/export_memory.py --hidden-size 256 --layers 2 --vocab 4096 --json /tmp/x.json --no-doc  # a quick try
    python bench/export_memory.py --render   # rewrite the docs from bench/results/export_memory.json, measuring nothing

1. A Llama built from a config (default: hidden 1024, 12 layers, vocab 32000, untied: 218M parameters) is wrapped
   by ``deepspeed.initialize`` under ZeRO-3 on 2 CPU processes (gloo), takes one AdamW step in fp32 and is saved
   with ``save_checkpoint``: 2 ranks x (fp32 master + 2 Adam moments) = 2.6 GB of optimizer shards.
2. Each converter runs as a separate process on that checkpoint, started from a small spawner, and its peak
   resident memory (``ru_maxrss`` from ``os.wait4``: what the kernel accounted to that process alone) is
   recorded: ``zero-recipes export`` and DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict(...,
   safe_serialization=True)``, both fp32, both at the same ``max_shard_size``: 5GB (DeepSpeed's default: the
   whole model in one shard), 1GB and 200MB. Both outputs are compared tensor by tensor (they must be equal).
3. The peak of a process that only imports torch, DeepSpeed and safetensors is measured the same way: what
   either converter needs above its imports.
4. Writes bench/results/export_memory.json (write_results: provenance included) and renders from that file
   alone the "export memory" section of docs/benchmarks.md and the "export memory, measured" table of
   docs/export.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed

from bench._bench_util import (  # noqa: E402
    DOC,
    REPO,
    add_results_options,
    bench_parser,
    launch_group,
    render_from_file,
    save_and_publish,
    work_folder,
)
from common.errors import exit_on_user_error  # noqa: E402

SHARD_SIZES = ("5GB", "1GB", "200MB")
RESULTS = HERE / "results" / "export_memory.json"
DOCS = {"export memory": DOC, "export memory, measured": REPO / "docs" / "export.md"}
IMPORTS_ONLY = "import torch, deepspeed, safetensors.torch"  # what both converters load before any tensor
DEEPSPEED_CONVERT = (
    "import sys; from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as convert; "
    "convert(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3], safe_serialization=True)"
)


def zero3_llama_engine(hidden_size: int, layers: int, vocab: int):
    """One rank's fp32 Llama from a config under ZeRO-3 (every parameter partitioned), with torch's AdamW.

    Used by this bench and bench/checkpoint.py (started by torch.distributed.run: one call per rank).
    """
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    torch.set_num_threads(1)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # Every parameter partitioned; buckets of 5e7 elements, not DeepSpeed's 5e8 (2 GB per rank in fp32).
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 50_000_000,
            "stage3_prefetch_bucket_size": 50_000_000,
        },
        "zero_allow_untested_optimizer": True,
    }
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (alive while the model is built: it is built sharded)
    config = LlamaConfig(
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=hidden_size // 64,
        intermediate_size=int(hidden_size * 8 / 3) // 64 * 64,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def make_checkpoint(args: argparse.Namespace) -> None:
    """One rank of the 2-process ZeRO-3 run that writes the checkpoint (started by torch.distributed.run)."""
    import torch

    engine = zero3_llama_engine(args.hidden_size, args.layers, args.vocab)
    batch = torch.randint(0, args.vocab, (1, 16))
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.make_checkpoint, tag="global_step1")
    if engine.global_rank == 0:
        params = sum(p.ds_numel for p in engine.module.parameters())
        (Path(args.make_checkpoint) / "num_params.json").write_text(json.dumps({"num_params": params}))


# Linux keeps a process's peak RSS across fork and exec, so a child started by this (large) process would start
# its count at our size. A small spawner starts each converter and reports that grandchild's own peak.
SPAWN_AND_MEASURE = (
    "import os, subprocess, sys; child = subprocess.Popen(sys.argv[1:]); _, status, usage = os.wait4(child.pid, 0); "
    "print(usage.ru_maxrss * 1024); sys.exit(os.waitstatus_to_exitcode(status))"
)


def peak_rss(cmd: list[str]) -> tuple[int, float]:
    """(peak resident bytes, seconds) of a converter process alone (``ru_maxrss`` from ``os.wait4``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-S", "-c", SPAWN_AND_MEASURE, *cmd], cwd=REPO, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return int(proc.stdout.strip().splitlines()[-1]), seconds


def read_all(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def same_tensors(ours: Path, theirs: Path) -> bool:
    import torch

    a, b = read_all(ours), read_all(theirs)
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def measure_converters(checkpoint: Path, work: Path) -> list[dict]:
    """Both converters at each shard size: peak RSS, seconds, shards written, and whether the outputs agree."""
    rows = []
    for max_shard in SHARD_SIZES:
        ours_dir, theirs_dir = work / f"ours-{max_shard}", work / f"deepspeed-{max_shard}"
        for folder in (ours_dir, theirs_dir):
            shutil.rmtree(folder, ignore_errors=True)
        export_cmd = [sys.executable, "-m", "common.tools.cli", "export", str(checkpoint), str(ours_dir)]
        ours = peak_rss([*export_cmd, "--max-shard-size", max_shard, "--quiet"])
        theirs = peak_rss([sys.executable, "-c", DEEPSPEED_CONVERT, str(checkpoint), str(theirs_dir), max_shard])
        rows.append(
            {
                "max_shard_size": max_shard,
                "export": {"peak_rss_bytes": ours[0], "seconds": ours[1]},
                "zero_to_fp32": {"peak_rss_bytes": theirs[0], "seconds": theirs[1]},
                "export_shards": len(list(ours_dir.glob("*.safetensors"))),
                "same_tensors": same_tensors(ours_dir, theirs_dir),
            }
        )
        print(
            f"max_shard_size {max_shard}: zero-recipes export {ours[0] / 1e9:.2f} GB ({ours[1]:.0f} s), "
            f"zero_to_fp32 {theirs[0] / 1e9:.2f} GB ({theirs[1]:.0f} s), same tensors: {rows[-1]['same_tensors']}",
            flush=True,
        )
        for folder in (ours_dir, theirs_dir):
            shutil.rmtree(folder, ignore_errors=True)
    return rows


def model_text(model: dict) -> str:
    return (
        f"A Llama of {model['num_params'] / 1e6:.0f}M parameters (hidden {model['hidden_size']}, "
        f"{model['layers']} layers, vocab {model['vocab']}, untied), ZeRO-3 on 2 CPU processes, one AdamW step in "
        f"fp32, `save_checkpoint`: {model['shard_bytes'] / 1e9:.2f} GB of shards; the fp32 model is "
        f"{model['num_params'] * 4 / 1e9:.2f} GB."
    )


def gb(row: dict, converter: str) -> str:
    return f"{row[converter]['peak_rss_bytes'] / 1e9:.2f} GB"


def ratio(row: dict) -> str:
    return f"{row['zero_to_fp32']['peak_rss_bytes'] / row['export']['peak_rss_bytes']:.2f}x"


def benchmarks_body(results: dict) -> str:
    """The full table: peaks against the model's size, seconds, and the tensor-by-tensor comparison."""
    model_bytes = results["model"]["num_params"] * 4
    lines = [
        model_text(results["model"])
        + " Each converter ran as its own process; peak resident memory is that process's `ru_maxrss` "
        "(`os.wait4`, reported by a small spawner so that the count does not start at the benchmark's own "
        "size). Both write fp32 safetensors at the same `max_shard_size`, and their outputs were compared tensor "
        "by tensor.",
        "",
        "| max_shard_size | zero-recipes export | DeepSpeed zero_to_fp32 | ratio | same tensors |",
        "|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        ours, theirs = row["export"], row["zero_to_fp32"]
        lines.append(
            f"| {row['max_shard_size']} | {gb(row, 'export')} ({ours['peak_rss_bytes'] / model_bytes:.2f}x model, "
            f"{ours['seconds']:.0f} s) | {gb(row, 'zero_to_fp32')} ({theirs['peak_rss_bytes'] / model_bytes:.2f}x "
            f"model, {theirs['seconds']:.0f} s) | {ratio(row)} | {'yes' if row['same_tensors'] else 'NO'} |"
        )
    return "\n".join(lines)


def export_doc_body(results: dict) -> str:
    """docs/export.md's summary: the peaks, and what each converter needs above the imports they share."""
    model, rows, imports = results["model"], results["rows"], results["imports_peak_rss_bytes"]
    largest, smallest = rows[0], rows[-1]
    embedding_bytes = model["vocab"] * model["hidden_size"] * 4
    same = all(row["same_tensors"] for row in rows)
    lines = [
        model_text(model)
        + " Both converters write fp32 safetensors at the same `max_shard_size`; their outputs are "
        + ("equal tensor for tensor." if same else "**not** equal at every size (see benchmarks.md).")
        + " Peak RSS of each converter process (`ru_maxrss`), full table in "
        "[benchmarks.md](benchmarks.md#export-memory):",
        "",
        "| max_shard_size | shards written by the export | zero-recipes export | DeepSpeed zero_to_fp32 | ratio |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['max_shard_size']} | {row['export_shards']} | {gb(row, 'export')} | {gb(row, 'zero_to_fp32')} "
            f"| {ratio(row)} |"
        )

    def above(row: dict, converter: str) -> str:
        return f"{(row[converter]['peak_rss_bytes'] - imports) / 1e9:.2f} GB"

    lines += [
        "",
        f"A process that only imports torch, DeepSpeed and safetensors peaks at {imports / 1e9:.2f} GB (measured the "
        f"same way). Above that, the export needs {above(largest, 'export')} at {largest['max_shard_size']} "
        f"and {above(smallest, 'export')} at {smallest['max_shard_size']} (the fp32 model is "
        f"{model['num_params'] * 4 / 1e9:.2f} GB, its largest tensor, the embedding, {embedding_bytes / 1e9:.2f} GB); "
        f"`zero_to_fp32` needs {above(largest, 'zero_to_fp32')} and {above(smallest, 'zero_to_fp32')}.",
    ]
    return "\n".join(lines)


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from an export_memory.json document alone (no clock, no measurement)."""
    results = document["results"]
    return {"export memory": benchmarks_body(results), "export memory, measured": export_doc_body(results)}


# --render: a results file that is missing or was not written by write_results is one line, not a traceback.
@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--work-dir", default=None, help="where the checkpoint is written (default: a temp folder)")
    add_results_options(parser, RESULTS)
    parser.add_argument("--make-checkpoint", default=None, help=argparse.SUPPRESS)  # the rank worker's mode
    args = parser.parse_args()
    if args.make_checkpoint:
        make_checkpoint(args)
        return
    if args.render:
        render_from_file(args.json, render_sections, DOCS)
        return

    with work_folder(args.work_dir, "zr-export-bench-") as work:
        checkpoint = work / "checkpoint"
        shutil.rmtree(checkpoint, ignore_errors=True)
        size_args = ["--hidden-size", str(args.hidden_size), "--layers", str(args.layers), "--vocab", str(args.vocab)]
        start = time.perf_counter()
        launch_group(Path(__file__), "raw", "export", [*size_args, "--make-checkpoint", str(checkpoint)], timeout=900)
        num_params = json.loads((checkpoint / "num_params.json").read_text())["num_params"]
        shard_bytes = sum(p.stat().st_size for p in (checkpoint / "global_step1").iterdir())
        print(
            f"checkpoint: {num_params / 1e6:.0f}M parameters, {shard_bytes / 1e9:.2f} GB of shards, "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )
        results = {
            "model": {
                "hidden_size": args.hidden_size,
                "layers": args.layers,
                "vocab": args.vocab,
                "num_params": num_params,
                "shard_bytes": shard_bytes,
            },
            "imports_peak_rss_bytes": peak_rss([sys.executable, "-c", IMPORTS_ONLY])[0],
            "rows": measure_converters(checkpoint, work),
        }
        print(benchmarks_body(results))
        save_and_publish(args, results, render_sections, DOCS)


if __name__ == "__main__":
    main()
