"""What a checkpoint holds, in bytes: full training vs fine-tuning (differential) saves, and export-only copies.

    flock /tmp/zr-heavy.lock python bench/checkpoint_bytes.py   # ~3 min: NLP and fine-tuning recipes, 2 saves each
    python bench/checkpoint_bytes.py --render    # rewrite the docs from bench/results/checkpoint_bytes.json

1. **Full training**: the NLP recipe as shipped (its 5M-parameter Llama, preset ``nlp``: ZeRO-3, 2 CPU processes,
   Lightning, bf16) saves at steps 1 and 2. Bytes per save by file kind, and how many elements of the saved state
   did not change between the two saves: the most a differential save ("only the partitions that changed") could
   leave out of a full-training checkpoint.
2. **Fine-tuning**: the fine-tuning recipe as shipped (LoRA, preset ``finetune``: ZeRO-3 over the frozen base) on
   step 1's ``final/`` model, saves at steps 1 and 2. Its checkpoints leave the frozen base out (they hold the
   adapters, their optimizer states and ``base_model.json``, the base's path and file hashes): bytes per save after
   the first / bytes of the full-training save of the same model is the bar (<= 10 %).
3. **Export-only copies** of the full-training checkpoint with ``zero-recipes export`` (fp32 and bf16
   safetensors), and what a lossless compression of each would save: zlib (level 1) of every tensor as it is, and
   of its bytes regrouped into planes (byte k of every element together; the sign-and-exponent bytes of trained
   weights repeat, their mantissa bytes do not). The resume checkpoint stays as it is (lossless: fp32 master
   weights and Adam moments).
4. Writes bench/results/checkpoint_bytes.json (``write_results``: provenance included) and renders the "checkpoint
   bytes" section of docs/checkpoints.md from that file alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed

import torch  # noqa: E402

from bench._bench_util import (  # noqa: E402
    REPO,
    add_results_options,
    bench_env,
    bench_parser,
    render_from_file,
    save_and_publish,
    work_folder,
)
from common.checkpoint import checkpoint_step, latest_checkpoint  # noqa: E402
from common.errors import exit_on_user_error  # noqa: E402

RESULTS = HERE / "results" / "checkpoint_bytes.json"
DOCS = {"checkpoint bytes": REPO / "docs" / "checkpoints.md"}
FINETUNE_BAR = 0.10  # the bar: a fine-tuning save after the first, over a full-training save
ZLIB_LEVEL = 1  # the fastest level: an export-only copy is written often, like a checkpoint
# Two saves a run, with the recipes' own models and presets; only the data is cut to what two steps read.
PRETRAIN_ARGS = [
    "max_steps=2",
    "checkpoint_interval=1",
    "keep_last=2",
    "eval_interval=2",
    "log_interval=1",
    "max_train_tokens=20000",
    "max_val_tokens=2048",
    "sample_tokens=8",
]
FINETUNE_ARGS = [
    "max_steps=2",
    "checkpoint_interval=1",
    "keep_last=2",
    "n_train=64",
    "n_val=8",
    "warmup_steps=1",
    "eval_interval=2",
    "log_interval=1",
    "max_new_tokens=2",
]


# --- pure measurements (tests/unit/test_checkpoint_bytes.py checks them against independent references) ---------


def file_kind(path: Path) -> str:
    """What a checkpoint file holds, by DeepSpeed's naming: model states, optimizer shards, or anything else."""
    if path.name.endswith("optim_states.pt"):
        return "optimizer states"
    if path.name.endswith("model_states.pt"):
        return "model states"
    return "other"


def folder_bytes(folder: Path) -> dict[str, int]:
    """Bytes of every file under ``folder`` by :func:`file_kind`, and their ``total``."""
    sizes = {"model states": 0, "optimizer states": 0, "other": 0}
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            sizes[file_kind(path)] += path.stat().st_size
    return {**sizes, "total": sum(sizes.values())}


def tensors(state, prefix: str = ""):
    """(name, tensor) of every floating-point tensor in a loaded checkpoint file, at any depth."""
    if isinstance(state, torch.Tensor):
        if state.is_floating_point():
            yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from tensors(value, f"{prefix}/{key}")
    elif isinstance(state, list | tuple):
        for index, value in enumerate(state):
            yield from tensors(value, f"{prefix}/{index}")


def load_weights_only(path: Path):
    """A DeepSpeed checkpoint file, unpickling nothing but tensors and DeepSpeed's allow-listed classes."""
    from common.tools.zero_files import deepspeed_pickle_classes

    with torch.serialization.safe_globals(deepspeed_pickle_classes()):
        return torch.load(path, map_location="cpu", weights_only=True)


def unchanged_elements(before: Path, after: Path) -> dict[str, int]:
    """Floating-point elements of the ``.pt`` files of two saves of one run, and how many are bit-identical.

    Files and tensors are matched by relative path and position; the step folder's name differs between saves.
    """
    total = same = 0
    for old in sorted(before.rglob("*.pt")):
        new = after / old.relative_to(before)
        old_tensors = dict(tensors(load_weights_only(old)))
        for name, tensor in tensors(load_weights_only(new)):
            total += tensor.numel()
            previous = old_tensors.get(name)
            if previous is not None and previous.shape == tensor.shape and previous.dtype == tensor.dtype:
                # Bit patterns, not values: -0.0 == 0.0 and NaN != NaN would both miscount what a diff must store.
                same += _bitwise_equal(previous, tensor)
    return {"elements": total, "unchanged": same}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shaped tensors have identical bytes."""
    width = a.element_size()
    left = a.detach().contiguous().view(-1).view(torch.uint8).view(-1, width)
    right = b.detach().contiguous().view(-1).view(torch.uint8).view(-1, width)
    return int((left == right).all(dim=1).sum())


def byte_planes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes regrouped: byte 0 of every element, then byte 1, ... (a lossless permutation)."""
    width = tensor.element_size()
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).view(-1, width)
    return raw.t().contiguous().numpy().tobytes()


def compressed_sizes(folder: Path) -> dict[str, float]:
    """Bytes of the safetensors data in ``folder``, and of its zlib compression as is and by byte planes."""
    from safetensors import safe_open

    raw = plain = planes = 0
    start = time.perf_counter()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                tensor = shard.get_tensor(name)
                data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                raw += len(data)
                plain += len(zlib.compress(data, ZLIB_LEVEL))
                planes += len(zlib.compress(byte_planes(tensor), ZLIB_LEVEL))
    return {"raw": raw, "zlib": plain, "zlib_planes": planes, "compress_s": time.perf_counter() - start}


# --- the runs --------------------------------------------------------------------------------------------------


def run_recipe(script: str, args: list[str]) -> float:
    """One recipe run (Lightning starts its 2 processes itself); its wall time."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(REPO / script), *args], cwd=REPO, env=bench_env(), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - start


def saves(run_dir: Path) -> list[Path]:
    """The run's published checkpoint folders, oldest first."""
    root = run_dir / "checkpoints"
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")), key=checkpoint_step)


def measure_run(run_dir: Path) -> dict:
    first, second = saves(run_dir)[-2:]
    return {
        "saves": {checkpoint_step(first): folder_bytes(first), checkpoint_step(second): folder_bytes(second)},
        "unchanged": unchanged_elements(first, second),
    }


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def measure(work: Path) -> dict:
    pretrain, finetune = work / "pretrain", work / "finetune"
    pretrain_s = run_recipe("recipes/nlp/train.py", [f"out_dir={pretrain}", *PRETRAIN_ARGS])
    finetune_s = run_recipe(
        "recipes/nlp/finetune.py", [f"model={pretrain / 'final'}", f"out_dir={finetune}", *FINETUNE_ARGS]
    )
    full, lora = measure_run(pretrain), measure_run(finetune)
    summary = _summary(finetune)
    lora.update(trainable_params=summary.get("trainable_params"), total_params=summary.get("total_params"))

    from common.tools.export import export_checkpoint

    exports = {}
    for dtype in ("fp32", "bf16"):
        out = work / f"export_{dtype}"
        start = time.perf_counter()
        written = export_checkpoint(latest_checkpoint(pretrain), out, dtype, progress=False)
        exports[dtype] = {"export_s": time.perf_counter() - start, "files_bytes": folder_bytes(out)["total"]}
        exports[dtype].update(compressed_sizes(out))
        exports[dtype]["tensors"] = written["tensors"]
    return {
        "full": {**full, "run_s": pretrain_s, "command_args": PRETRAIN_ARGS},
        "finetune": {**lora, "run_s": finetune_s, "command_args": FINETUNE_ARGS},
        "export": exports,
    }


# --- the docs --------------------------------------------------------------------------------------------------


def summarize(results: dict) -> dict:
    """The headline ratios, from the measured bytes alone."""
    full_saves, lora_saves = list(results["full"]["saves"].values()), list(results["finetune"]["saves"].values())
    full_bytes = full_saves[-1]["total"]
    unchanged = results["full"]["unchanged"]
    return {
        "finetune_ratio": lora_saves[-1]["total"] / full_bytes,
        "full_unchanged_fraction": unchanged["unchanged"] / unchanged["elements"],
        "export_ratio": {d: e["files_bytes"] / full_bytes for d, e in results["export"].items()},
    }


def render_body(results: dict) -> str:
    figures = summarize(results)
    full, lora = results["full"], results["finetune"]
    verdict = "met" if figures["finetune_ratio"] <= FINETUNE_BAR else "not met"

    def mb(value: float) -> str:
        return f"{value / 1e6:.2f}"

    lines = [
        "Bytes per save of the shipped NLP recipe (full training) and of the fine-tuning recipe on its model "
        "(LoRA), both ZeRO-3 on 2 processes, each saving at steps 1 and 2; and the export-only copies of the "
        "full-training checkpoint.",
        "",
        "| save | model states MB | optimizer states MB | other MB | total MB | elements unchanged since the "
        "previous save |",
        "|---|---|---|---|---|---|",
    ]
    for label, run in (("full training", full), ("fine-tuning (LoRA)", lora)):
        for index, (step, sizes) in enumerate(run["saves"].items()):
            unchanged = run["unchanged"]
            changed = f"{unchanged['unchanged']:,} of {unchanged['elements']:,}" if index else "(first save)"
            lines.append(
                f"| {label}, step {step} | {mb(sizes['model states'])} | {mb(sizes['optimizer states'])} | "
                f"{mb(sizes['other'])} | {mb(sizes['total'])} | {changed} |"
            )
    lines += [
        "",
        f"A fine-tuning save after the first is {figures['finetune_ratio']:.1%} of a full-training save of the same "
        f"model (bar <= {FINETUNE_BAR:.0%}: {verdict}); {lora['trainable_params']:,} trainable parameters of "
        f"{lora['total_params']:,}. In full training {figures['full_unchanged_fraction']:.2%} of the saved elements "
        "were bit-identical between two saves one step apart: a differential save would leave out that share.",
        "",
        "Export-only copies of the full-training checkpoint (`zero-recipes export`), and lossless zlib (level "
        f"{ZLIB_LEVEL}) of their tensors:",
        "",
        "| copy | MB | of the resume checkpoint | zlib MB | zlib by byte planes MB | planes saving | compress s |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype, export in results["export"].items():
        lines.append(
            f"| {dtype} safetensors | {mb(export['files_bytes'])} | {figures['export_ratio'][dtype]:.1%} | "
            f"{mb(export['zlib'])} | {mb(export['zlib_planes'])} | {1 - export['zlib_planes'] / export['raw']:.1%} | "
            f"{export['compress_s']:.2f} |"
        )
    return "\n".join(lines)


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from a checkpoint_bytes.json document alone."""
    return {"checkpoint bytes": render_body(document["results"])}


@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--work-dir", default=None, help="where the runs are written (default: a temp folder)")
    add_results_options(parser, RESULTS)
    args = parser.parse_args()
    if args.render:
        render_from_file(args.json, render_sections, DOCS)
        return
    with work_folder(args.work_dir, "zr-checkpoint-bytes-") as work:
        results = measure(work)
        results["summary"] = summarize(results)
        print(render_body(results))
        save_and_publish(args, results, render_sections, DOCS)


if __name__ == "__main__":
    main()
