"""Helpers for tests that run the project the way a user does: as subprocesses."""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from common.rundir import free_port  # noqa: F401  (the tests import it from here)

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def recipe_module(folder: Path, name: str):
    """A module of the recipe in ``folder`` (``nlp_config``, ``pretraining``), imported as its scripts import it:
    from the recipe's folder."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a launched run: one thread per process, a fresh master port."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", MASTER_PORT=str(free_port()))
    env.pop("LOCAL_RANK", None)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(extra)
    return env


def run(args: list[str], timeout: float = 600, cwd: Path | None = None, check: bool = True, **env: str):
    """Run a command, return the CompletedProcess; on failure show the tail of its output."""
    # A session of its own, so that a timeout kills the launcher *and* the ranks it spawned: a rank left
    # waiting in a collective would otherwise hold its port and cores for the rest of the suite.
    with subprocess.Popen(
        [str(a) for a in args],
        cwd=cwd or REPO,
        env=subprocess_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            command = " ".join(map(str, args))
            raise AssertionError(
                f"command timed out after {timeout:.0f} s: {command}\n{stdout[-3000:]}\n{stderr[-6000:]}"
            ) from None
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        tail = (proc.stdout[-3000:] + "\n---- stderr ----\n" + proc.stderr[-6000:]).strip()
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(map(str, args))}\n{tail}")
    return proc


def accelerate_launch(
    script: Path | str,
    script_args: list[str],
    config_file: Path,
    num_processes: int = 2,
    timeout: float = 600,
    check: bool = True,
):
    """``accelerate launch --config_file ... script args`` with a free port."""
    args = [
        PYTHON,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config_file),
        "--num_processes",
        str(num_processes),
        "--main_process_port",
        str(free_port()),
        str(script),
        *script_args,
    ]
    return run(args, timeout=timeout, check=check)


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def check_async_saves(out_dir: Path, saved_steps: list[int], world_size: int = 2) -> Path:
    """A run with ``async_save=true``: ``latest`` names the last save and holds every rank's ``.written-rank``
    marker (the background writers wrote and flushed it before rank 0 published), nothing is left in flight, and
    each save logged ``checkpoint_blocked_s``. Returns the published folder."""
    from common.async_checkpoint import MARKER
    from common.checkpoint import latest_checkpoint
    from common.rundir import read_metrics

    latest = latest_checkpoint(out_dir)
    assert latest is not None and latest.name == f"step_{saved_steps[-1]:06d}", latest
    markers = sorted(p.name for p in latest.glob(f"{MARKER}*"))
    assert markers == [f"{MARKER}{rank:05d}" for rank in range(world_size)], markers
    assert not list((Path(out_dir) / "checkpoints").glob(".tmp-*"))  # every write finished before the run ended
    blocked = [(r["step"], r["checkpoint_blocked_s"]) for r in read_metrics(out_dir) if "checkpoint_blocked_s" in r]
    assert [step for step, _ in blocked] == saved_steps and all(s >= 0 for _, s in blocked), blocked
    return latest


@functools.cache
def stdlib_tokenizer() -> Path:
    """The byte-level BPE tokenizer (vocabulary 4096) the NLP recipe trains on the standard library's train split when
    given none, trained once per test session as the recipe trains it (2-3 s, on rank 0 of every run otherwise), in a
    folder removed at exit. Runs given it with ``tokenizer=`` get the same tokens, so the same losses."""
    from nlp.data import train_stdlib_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="zero-recipes-tokenizer-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    train_stdlib_tokenizer(vocab_size=4096, val_fraction=0.05, seed=0, out_dir=folder)
    return folder


def tiny_fp32_run(steps: int, own_tokenizer: bool = False) -> list[str]:
    """NLP recipe arguments for an equivalence run: the tiny model, fp32 (losses equal to rounding across layouts),
    ``steps`` optimizer steps, each logged, one evaluation and one checkpoint at the end, a short sample. The
    learning rate is constant after warmup, so a run resumed with a larger ``max_steps`` keeps the schedule.

    The runs load the session's :func:`stdlib_tokenizer` rather than each training its own, unless ``own_tokenizer``
    (a test of the run directory's ``tokenizer/`` folder)."""
    shared = [] if own_tokenizer else [f"tokenizer={stdlib_tokenizer()}"]
    return [
        *shared,
        "data=stdlib",
        "max_train_tokens=60000",
        "precision=fp32",
        f"max_steps={steps}",
        "seq_len=64",
        "micro_batch_size=2",
        "max_val_tokens=1024",
        f"eval_interval={steps}",
        f"checkpoint_interval={steps}",
        "log_interval=1",
        "sample_tokens=4",
        "warmup_steps=2",
        "min_lr_ratio=1.0",
    ]


def train_metric(out_dir: Path, key: str) -> dict[int, float]:
    """``{step: value}`` of one training metric in a run's metrics.jsonl (e.g. ``train_loss``, ``grad_norm``)."""
    records = (json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line)
    return {r["step"]: r[key] for r in records if key in r}


def describe(script: Path, *args: str) -> dict:
    """What ``python script --describe args`` prints: one JSON object, and nothing else on stdout."""
    proc = run([PYTHON, script, "--describe", *args], timeout=300)
    return json.loads(proc.stdout)


def one_error(proc) -> str:
    """The single ``error:`` line of a refused run (exit code 2, no traceback)."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


NLP_RECIPE = REPO / "recipes" / "nlp"
NLP_ENTRY_POINTS = {
    "lightning": NLP_RECIPE / "train.py",
    "accelerate": NLP_RECIPE / "train_accelerate.py",
    "pipeline": NLP_RECIPE / "train_pipeline.py",
}


def launch_nlp(entry: str, out_dir: Path, processes: int, *args: str, timeout: float = 600):
    """One run of the NLP recipe as a user launches it: ``python train.py devices=N`` (Lightning), ``accelerate
    launch`` (Accelerate) or torchrun (the pipeline engine; one process: a bare ``python``), with ``out_dir`` and
    ``args``; stdout is kept in ``out_dir/stdout.txt``. Returns the CompletedProcess."""
    script, args = NLP_ENTRY_POINTS[entry], [f"out_dir={out_dir}", *args]
    if entry == "accelerate":
        proc = accelerate_launch(script, args, NLP_RECIPE / "accelerate.yaml", num_processes=processes, timeout=timeout)
    elif entry == "lightning":
        proc = run([PYTHON, script, f"devices={processes}", *args], timeout=timeout)
    elif processes == 1:
        proc = run([PYTHON, script, *args], timeout=timeout)
    else:
        torchrun = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
        proc = run([*torchrun, "--master_port", str(free_port()), script, *args], timeout=timeout)
    (Path(out_dir) / "stdout.txt").write_text(proc.stdout)
    return proc


FINETUNE = NLP_RECIPE / "finetune.py"
FINETUNE_ACCELERATE = NLP_RECIPE / "finetune_accelerate.py"


def launch_finetune(entry: str, processes: int, args: list[str], timeout: float = 600):
    """One run of the fine-tuning recipe as a user launches it: ``accelerate launch`` of finetune_accelerate.py with
    the shipped accelerate_finetune.yaml (``entry="accelerate"``) or ``python finetune.py devices=N`` (Lightning)."""
    if entry == "accelerate":
        config = NLP_RECIPE / "accelerate_finetune.yaml"
        return accelerate_launch(FINETUNE_ACCELERATE, args, config, num_processes=processes, timeout=timeout)
    return run([PYTHON, FINETUNE, f"devices={processes}", *args], timeout=timeout)


def tiny_fp32_finetune(steps: int) -> list[str]:
    """Fine-tuning recipe arguments for an equivalence run: fp32, ``steps`` optimizer steps, each logged, one
    evaluation and one checkpoint at the end, LoRA r 4, one generated token for the exact match. The learning rate is
    constant after one warmup step."""
    return [
        "precision=fp32",
        f"max_steps={steps}",
        "warmup_steps=1",
        "min_lr_ratio=1.0",
        f"eval_interval={steps}",
        f"checkpoint_interval={steps}",
        "log_interval=1",
        "lora_r=4",
        "lora_alpha=8",
        # A dropout mask follows the micro-batch (and a rank's slice of the sequence): a run that cuts the same batch
        # another way would draw other masks than its reference.
        "lora_dropout=0.0",
        "max_new_tokens=1",
    ]


def save_tiny_llama(folder: Path, source_files: int = 4) -> Path:
    """A base model for the fine-tuning recipe, saved as a Hugging Face folder: a BPE tokenizer (512 tokens) trained
    on ``source_files`` standard-library files and a 2-layer Llama (64 wide, 4 heads, about 150k parameters) with
    random weights drawn from seed 0. Returns ``folder``."""
    # Imported here: most tests that use this module never load torch or transformers in the pytest process.
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nlp.data import read_files, stdlib_source_files, train_bpe_tokenizer

    files = [f for f in stdlib_source_files() if 8_000 < f.stat().st_size < 40_000][:source_files]
    tokenizer = train_bpe_tokenizer(read_files(files), vocab_size=512, out_dir=folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def tied_llama(hidden_size: int, vocab_size: int, max_positions: int):
    """A 2-layer Llama (2 heads, MLP twice as wide) whose output matrix is its input embedding
    (``tie_word_embeddings=True``), with random weights drawn from seed 0."""
    import torch  # imported here, as in save_tiny_llama
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def assert_same_metric(out_dir: Path, reference: Path, key: str, steps: int) -> None:
    """Training metric ``key`` (``train_loss``, ``grad_norm``) of the runs in ``out_dir`` and ``reference`` is logged
    at steps 1 to ``steps`` in both, and each step's value in ``out_dir`` is within 1e-5 relative of the reference's."""
    found, expected = train_metric(out_dir, key), train_metric(reference, key)
    what = f"{key} of {out_dir}"
    assert sorted(found) == sorted(expected) == list(range(1, steps + 1)), f"{what}: {found} vs {expected}"
    for step, value in found.items():
        assert math.isclose(value, expected[step], rel_tol=1e-5), f"{what}, step {step}: {found} vs {expected}"


# "It trained": the loss on the same fixed batches (the validation blocks every evaluation reads) dropped by at least
# this fraction from step 0 to the end. Measured on the parallel tests' tiny fp32 runs (5-7 steps, lr 3e-3): drops of
# 6.6 % (Lightning, MoE, 5 steps) to 10.4 % (TP 2 x DP 2); the same run as the tensor-parallel test's at lr=1e-9 (no
# update to speak of, one process) dropped 1.5e-8 and fails it.
MIN_TRAINED_DROP = 0.02


def assert_trained(out_dir: Path) -> None:
    """The run's validation loss after training is at least :data:`MIN_TRAINED_DROP` below step 0's, on the same
    fixed validation blocks (``summary.json``'s ``initial_val_loss`` and ``val_loss``): not step 1's loss against
    step N's, which are different batches and differ with no update at all."""
    summary = read_json(Path(out_dir) / "summary.json")
    before, after = summary["initial_val_loss"], summary["val_loss"]
    assert before is not None and after <= (1 - MIN_TRAINED_DROP) * before, (out_dir, before, after)
