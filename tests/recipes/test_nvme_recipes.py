"""The NLP and science recipes with ZeRO-Infinity, as a user runs them: ``preset=deepspeed_stage_3_offload_nvme
nvme_path=DIR`` on 2 CPU processes.

tests/distributed/test_nvme_offload.py proves the NVMe tier's math (fp32 losses equal to stage 0) on a model of its
own; this file proves that the shipped entry points take the preset with nothing else changed: the run finishes,
writes its run directory and checkpoint, reports stage 3 with NVMe offload, and really swapped to the folder it was
given (each rank's optimizer states are files there of at least DeepSpeed's 1 MiB swap minimum). One backend per
recipe (both backends are covered by the equivalence test): the NLP recipe through Lightning, the science recipe
through Accelerate. The science model is widened (64 channels, 32 modes, 4 layers: about 1M parameters) so that
a rank's optimizer partition passes the swap minimum; its complex spectral weights are partitioned by stage 3
here, not by the ZeRO-2 of its own preset.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from _util import PYTHON, REPO, accelerate_launch, read_json, run

from common.memory_formulas import MIN_SWAPPED_BYTES
from nlp.data import stdlib_source_files

pytestmark = pytest.mark.slow

PRESET = "deepspeed_stage_3_offload_nvme"
NLP_TINY = [
    "seq_len=64",
    "micro_batch_size=2",
    "max_val_tokens=1024",
    "eval_interval=3",
    "checkpoint_interval=3",
    "log_interval=1",
    "sample_tokens=8",
    "max_steps=3",
]
SCIENCE_TINY = [
    "n_train=40",
    "n_test=8",
    "grid_size=64",
    "solve_grid=256",
    "modes=32",
    "width=64",
    "n_layers=4",
    "proj_width=32",
    "micro_batch_size=4",
    "data_workers=1",
    "log_interval=1",
    "eval_interval=3",
    "checkpoint_interval=3",
    "max_steps=3",
]


def swapped_files(folder: Path, rank: int) -> dict[str, int]:
    """The optimizer-state swap files DeepSpeed left for ``rank`` under the NVMe folder, by path: size."""
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in folder.rglob("*")
        if p.is_file() and f"optimizer/rank{rank}/" in str(p.relative_to(folder)) + "/"
    }


def check_run(out_dir: Path, swap: Path) -> dict:
    summary = read_json(out_dir / "summary.json")
    assert summary["preset"] == PRESET and summary["zero_stage"] == 3, summary
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert (out_dir / "checkpoints" / "latest").exists() or any((out_dir / "checkpoints").iterdir())
    for rank in range(2):
        files = swapped_files(swap, rank)
        assert files, f"rank {rank} swapped nothing to {swap}: {sorted(str(p) for p in swap.rglob('*'))[:20]}"
        assert all(size >= MIN_SWAPPED_BYTES for size in files.values()), files
    return summary


def test_nlp_recipe_trains_with_nvme_offload(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, f in enumerate([f for f in stdlib_source_files() if 8_000 < f.stat().st_size < 40_000][:12]):
        shutil.copy(f, corpus / f"{i:02d}_{f.name}")
    out_dir, swap = tmp_path / "run", tmp_path / "nvme"
    swap.mkdir()
    args = [f"out_dir={out_dir}", f"data={corpus}", f"preset={PRESET}", f"nvme_path={swap}", *NLP_TINY]
    run([PYTHON, REPO / "recipes" / "nlp" / "train.py", *args], timeout=900)
    summary = check_run(out_dir, swap)
    assert math.isfinite(summary["val_loss"]) and summary["backend"] == "lightning"


def test_science_recipe_trains_with_nvme_offload(tmp_path):
    recipe = REPO / "recipes" / "science"
    out_dir, swap = tmp_path / "run", tmp_path / "nvme"
    swap.mkdir()
    args = [
        f"out_dir={out_dir}",
        f"cache_dir={tmp_path / 'cache'}",
        f"preset={PRESET}",
        f"nvme_path={swap}",
        *SCIENCE_TINY,
    ]
    accelerate_launch(recipe / "train_accelerate.py", args, recipe / "accelerate.yaml", timeout=900)
    summary = check_run(out_dir, swap)
    assert math.isfinite(summary["val_rel_l2"]) and summary["backend"] == "accelerate"
