"""bench/gpu.py under its limits, in CPU mode: a hung variant is killed with every process of its launch, and the
rows written before it survive, whether the variant runs out of time or the whole bench is terminated.

The hang is real: the worker of the variant named in ``ZERO_RECIPES_TEST_GPU_BENCH_HANG`` starts a child process
and sleeps, after it has joined its process group, under torchrun, which starts each worker in a session of its own
(so killing torchrun alone leaves both running). Every process the bench starts inherits a marker in its
environment; the tests look for live ones in /proc, watch the results file while the hung variant is still running,
and read the rows when the bench is done.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _marked_processes import kill_left_after, marked_processes
from _util import PYTHON, REPO, subprocess_env

sys.path.insert(0, str(REPO / "bench"))
from _bench_util import read_results  # noqa: E402

MARKER = "ZR_GPU_BENCH_TEST_RUN"
HANG_ENV = "ZERO_RECIPES_TEST_GPU_BENCH_HANG"  # bench/_gpu_worker.py's (importing it would import the recipe)
START_UP_S = 240  # a variant's imports and DeepSpeed set-up on a loaded 2-core machine
# The limit of the variant that runs out of time: the test waits all of it. Its worker hangs once its process group
# is up, which took 8 s here (the terminated-bench test's whole run), so 30 s still kills it hanging, not starting.
LIMIT_S = 30
GONE_WITHIN_S = 30  # after the bench returns, no process of it may be left


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone since /proc was read
        return None


def hung_worker(run_id: str, variant: str) -> int | None:
    """The pid of the variant's worker once it hangs (torchrun's child, in a session of its own, with its own child
    started), else None."""
    processes = marked_processes(MARKER, run_id)
    children = {session_of(child) for child, command in processes.items() if command.startswith("sleep 3600")}
    for pid, cmdline in processes.items():
        worker = "_gpu_worker.py" in cmdline and f'"name": "{variant}"' in cmdline and session_of(pid) == pid
        if worker and pid in children:
            return pid
    return None


@contextmanager
def bench(tmp_path: Path, variants: str, timeout_s: float, hang: str) -> Iterator[tuple[subprocess.Popen, Path]]:
    """bench/gpu.py in CPU mode with ``hang``'s worker hanging, until the block has waited for the hung worker and
    for the bench; then no process of it may be left (those left are killed, then the test fails)."""
    run_id, results = uuid.uuid4().hex, tmp_path / "gpu.json"
    args = ["--cpu", "--variants", variants, "--variant-timeout-s", str(timeout_s)]
    args += ["--json", str(results), "--doc", str(tmp_path / "benchmarks_gpu.md")]
    env = subprocess_env(**{MARKER: run_id, HANG_ENV: hang})
    proc = subprocess.Popen(
        [PYTHON, "bench/gpu.py", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + START_UP_S
        while hung_worker(run_id, hang) is None:
            assert proc.poll() is None, f"the bench ended before {hang} ran:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, f"{hang}'s worker never started"
            time.sleep(0.5)
        yield proc, results
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        left = kill_left_after(MARKER, run_id, GONE_WITHIN_S)  # a failed test leaves none to the rest of the suite
    assert not left, f"processes left running: {left}"


@pytest.mark.slow
def test_a_variant_past_its_limit_is_killed_with_its_workers_and_the_rows_before_it_stay(tmp_path):
    # The row before the hang is FSDP2's peer of stage 3: the same worker trains it without DeepSpeed's engine.
    with bench(tmp_path, "fsdp2,stage3", timeout_s=LIMIT_S, hang="stage3") as (proc, results):
        # stage3 hangs: fsdp2's row is already in the results file, with its provenance
        _, written = read_results(results)
        assert [r["name"] for r in written["variants"]] == ["fsdp2"] and "error" not in written["variants"][0]
        output = proc.communicate(timeout=START_UP_S)[0]
    assert proc.returncode == 0, output[-3000:]
    fsdp2, stage3 = read_results(results)[1]["variants"]
    assert fsdp2["tokens_per_s"] > 0 and fsdp2["stage"] == "fsdp2" and fsdp2["peak_memory_bytes"] > 0, fsdp2
    assert stage3["error"].startswith(f"timed out after {LIMIT_S} s, every process killed; last output:"), stage3
    assert f"hanging ({HANG_ENV})" in stage3["error"]
    assert f"| stage3 | did not run: `timed out after {LIMIT_S} s" in (tmp_path / "benchmarks_gpu.md").read_text()


@pytest.mark.slow
def test_a_terminated_bench_kills_the_running_variant_and_keeps_the_rows(tmp_path):
    with bench(tmp_path, "stage3,stage0", timeout_s=START_UP_S, hang="stage3") as (proc, results):
        proc.send_signal(signal.SIGTERM)  # as `timeout` or the device's own limit would
        output = proc.communicate(timeout=GONE_WITHIN_S)[0]
    assert proc.returncode == 143, output[-3000:]
    provenance, written = read_results(results)
    assert provenance["command"].startswith("python bench/gpu.py --cpu --variants stage3,stage0")
    assert written["planned"] == ["stage3", "stage0"]
    assert written["variants"] == [{"name": "stage3", "error": "stopped: the bench was terminated (SIGTERM) during it"}]
    text = (tmp_path / "benchmarks_gpu.md").read_text()
    assert "Never reported (the run stopped before them): stage0." in text


def test_the_doc_renders_a_partial_run_with_the_recipe_and_doctor_rows():
    """render_sections on a results file a first run might leave: a step row, the recipe's and the doctor's rows,
    a variant that never reported."""
    from gpu import render_sections

    step = {
        "name": "stage0",
        "stage": 0,
        "attention_used": "sdpa",
        "activation_checkpointing": "selective",
        "tokens_per_s": 9000.0,
        "mfu": 0.41,
        "peak_memory_bytes": 40 * 2**30,
        "memory_kind": "gpu_max_allocated",
        "median_step_s": 0.9,
        "device": "NVIDIA H200",
    }
    recipe = {
        "name": "recipe_async_save",
        "kind": "recipe",
        "command": "python recipes/nlp/train.py ...",
        "steps": 10,
        "zero_stage": 3,
        "saves": [{"step": 5, "blocked_s": 1.8}, {"step": 10, "blocked_s": 0.45}],
        "latest": "step_000010",
        "median_step_s": 0.9,
        "tokens_per_s": 9100.0,
        "mfu": 0.4,
        "peak_memory_bytes": 30 * 2**30,
        "memory_kind": "gpu_max_allocated",
        "val_loss_ratio": 0.99,
        "wall_s": 120.0,
    }
    gpu = {"index": 0, "name": "NVIDIA H200", "pcie_gen_max": "5", "pcie_width_max": "16"}
    gpu |= {"pcie_gen_current": "1", "pcie_width_current": "16"}
    doctor = {
        "name": "doctor",
        "kind": "doctor",
        "accelerator": "1 GPU(s)",
        "gpus": [gpu],
        "versions": {"torch": "2.11.0", "cuda": "13.0", "nccl": "2.27", "deepspeed": "0.19.8"},
        "findings": [{"check_id": "nccl-timeout", "severity": "info"}],
    }
    run = {"config": "recipes/nlp/configs/llama_1b.yaml", "overrides": ["micro_batch_size=4"], "steps": 10, "warmup": 3}
    results = {"mode": "gpu", "run": run, "planned": ["doctor", "stage0", "recipe_async_save", "long"]}
    results["variants"] = [doctor, step, recipe]
    body = render_sections({"results": results})["gpu"]
    assert "| stage0 | 0 | sdpa | selective | 9000 | 41.0 % | 40.00 GiB (gpu_max_allocated) | 900 |" in body
    assert "Training waited, per save: step 5: 1.80 s (2.0 steps), step 10: 0.45 s (0.5 steps)" in body
    assert "GPU 0 NVIDIA H200, PCIe gen 5 x16 (now gen 1 x16)" in body and "info `nccl-timeout`" in body
    assert "Never reported (the run stopped before them): long." in body
    assert "recipe_async_save |" not in body and "doctor |" not in body  # not rows of the step table


def test_the_script_finds_python3_and_says_how_to_install_a_deepspeed_that_does_not_import(tmp_path):
    """A machine with a ``python`` that has no torch, a ``python3`` that has, and DeepSpeed missing a dependency."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'hjson'\")\n")
    bin_dir.mkdir()
    (bin_dir / "python").write_text("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
    (bin_dir / "python").chmod(0o755)
    # A wrapper, not a symlink: a link to a virtual environment's python runs the base interpreter, without the
    # environment's packages (Python finds pyvenv.cfg beside the path it was started by).
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{PYTHON}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**subprocess_env(), "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": f"{site}:{REPO}"}
    proc = subprocess.run(["bash", "bench/gpu.sh", "--cpu"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    first, hint = proc.stderr.strip().splitlines()
    assert first == "error: DeepSpeed does not import with python3: ModuleNotFoundError: No module named 'hjson'"
    assert hint.startswith("  install it: python3 -m pip install 'deepspeed>=0.16,<0.20'")
