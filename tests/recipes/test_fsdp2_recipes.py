"""The CV and science recipes under the FSDP2 presets, run as a user runs them: fp32 on 2 processes, gradient
accumulation 2, clipping 1.0, 6 optimizer steps, through ``train.py`` (Lightning) and ``train_accelerate.py``
(Accelerate, launched with the recipe's own ``accelerate.yaml``).

Each FSDP2 run is compared with a run of the ZeRO preset it is measured against (real DeepSpeed sharding, same seed,
so the same initial weights and batches): losses and logged gradient norms (before clipping) within 1e-5 relative at
every step. The ZeRO run's norm must exceed the clipping threshold at every step, so clipping acts in both (1.0 for
science; the tiny Swin's norms stay under 1.0, so CV clips at 0.25). Each FSDP2 run's model-state bytes count half
of the fp32 weights on rank 0: its shards, although the final evaluation's forward leaves weights gathered. To keep
the suite's time, each pair runs on one recipe, both front-ends: ``fsdp2`` vs ``deepspeed_stage_3`` on the science
recipe, ``fsdp2_grad_op`` vs ``deepspeed_stage_2`` on the CV recipe (6 launches of 2 processes). Fp32 ZeRO-2 and
ZeRO-3 give the same losses (tests/distributed/test_fsdp2_equivalence.py compares all four on one model).

Resume: each science ``fsdp2`` run saves DCP checkpoints in the background (``async_save=true``) at steps 3 and 6; a
copy of the step-3 one resumes on 1 process (both front-ends) and on 4 (Accelerate), the global batch kept, and must
log the uninterrupted 2-process run's losses for steps 4-6 within 1e-6.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from _util import PYTHON, REPO, accelerate_launch, describe, one_error, run
from test_resume import alive, args, kill_rank_one_at, losses, losses_logged_since, metrics_lines
from test_resume import launch as launch_cv  # the CV recipe, as the ZeRO kill test launches it

from common.async_checkpoint import WRITE_DELAY_ENV
from common.checkpoint import latest_checkpoint
from common.fsdp2 import consolidate_checkpoint
from common.rundir import read_metrics

STEPS = 6
SAVED_STEP = 3
FP32_RTOL = 1e-5
RESUME_RTOL = 1e-6
CLIP = 1.0
RUN = {
    "precision": "fp32",
    "max_steps": STEPS,
    "grad_accum": 2,
    "gradient_clipping": CLIP,
    "warmup_steps": 1,
    "min_lr_ratio": 1.0,
    "log_interval": 1,
    "checkpoint_interval": SAVED_STEP,
}
RECIPES = {
    # 1,437 digits; 8 images per rank per micro-batch. The tiny Swin's gradient norms stay under 1.0 here, so the
    # clipping that must act is lower.
    "cv": ({"micro_batch_size": 8, "eval_interval": 1000, "gradient_clipping": 0.25}, "train_loss"),
    # 40 pairs, 5 per rank per micro-batch: an epoch is 2 optimizer steps on 2 processes and on 1 (10 per
    # micro-batch there), so both world sizes see the same samples per step.
    "science": (
        {
            "n_train": 40,
            "n_test": 8,
            "grid_size": 64,
            "solve_grid": 256,
            "modes": 8,
            "width": 16,
            "n_layers": 2,
            "proj_width": 32,
            "micro_batch_size": 5,
            "data_workers": 1,
            "eval_interval": 1000,
            "superres_factor": 1,
        },
        "train_rel_l2",
    ),
}
FRONT_ENDS = ("lightning", "accelerate")
# (recipe, FSDP2 preset, its ZeRO counterpart, the front-end the ZeRO run uses)
PAIRS = [
    ("science", "fsdp2", "deepspeed_stage_3", "lightning"),
    ("cv", "fsdp2_grad_op", "deepspeed_stage_2", "accelerate"),
]


def launch(recipe: str, front_end: str, out_dir: Path, processes: int = 2, **values) -> None:
    extra, _ = RECIPES[recipe]
    args = [f"{key}={value}" for key, value in {**RUN, **extra, "out_dir": out_dir, **values}.items()]
    folder = REPO / "recipes" / recipe
    if front_end == "lightning":
        run([PYTHON, folder / "train.py", f"devices={processes}", *args], timeout=600)
    else:
        accelerate_launch(folder / "train_accelerate.py", args, folder / "accelerate.yaml", processes, timeout=600)


def logged(out_dir: Path, key: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out_dir) if key in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str, str], Path]:
    """(recipe, preset, front-end) -> run directory, for every run the tests compare."""
    root = tmp_path_factory.mktemp("fsdp2-recipes")
    cache = root / "burgers-cache"
    done = {}
    for recipe, fsdp2, zero, zero_front_end in PAIRS:
        for preset, front_ends in ((zero, (zero_front_end,)), (fsdp2, FRONT_ENDS)):
            for front_end in front_ends:
                out_dir = root / f"{recipe}-{preset}-{front_end}"
                # The science FSDP2 runs save in the background (DcpAsyncCheckpointer): their step-3 checkpoint is
                # the one the resume test loads.
                extra = {"cache_dir": cache, "async_save": preset == fsdp2} if recipe == "science" else {}
                launch(recipe, front_end, out_dir, preset=preset, **extra)
                done[recipe, preset, front_end] = out_dir
    return done


@pytest.mark.slow
@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize(("recipe", "fsdp2", "zero", "zero_front_end"), PAIRS)
def test_fsdp2_losses_match_the_zero_counterpart(runs, recipe, fsdp2, zero, zero_front_end, front_end):
    _, key = RECIPES[recipe]
    reference = logged(runs[recipe, zero, zero_front_end], key)
    actual = logged(runs[recipe, fsdp2, front_end], key)
    assert sorted(reference) == sorted(actual) == list(range(1, STEPS + 1))
    norms = [reference[step]["grad_norm"] for step in reference]
    clip = RECIPES[recipe][0].get("gradient_clipping", CLIP)
    assert min(norms) > clip, f"clipping must act at every step for the comparison to cover it: {norms}"
    for step in reference:
        expected, loss = reference[step][key], actual[step][key]
        assert abs(loss - expected) <= FP32_RTOL * abs(expected), (recipe, fsdp2, front_end, step, loss, expected)
        # The logged norm before clipping: the front-end's clipping measures it under FSDP2, DeepSpeed's engine under
        # ZeRO; the same gradients give the same norm.
        expected, norm = reference[step]["grad_norm"], actual[step]["grad_norm"]
        assert math.isfinite(norm) and abs(norm - expected) <= FP32_RTOL * expected, (fsdp2, front_end, step, norm)
    # Counted from the shards rank 0 holds: a half of the fp32 weights (with padding), not all of them, under both
    # presets, although the count follows the final evaluation's forward, which leaves the root's weights gathered
    # (and, under fsdp2_grad_op, every block's: no backward reshards them).
    summary = json.loads((runs[recipe, fsdp2, front_end] / "summary.json").read_text())
    assert summary["preset"] == fsdp2
    assert 0.5 <= summary["model_state_breakdown"]["params"] / (4 * summary["num_params"]) < 0.6, summary


# (front-end, processes, micro_batch_size, grad_accum) of a resume: the global batch of 20 samples kept. Lightning's
# loop counts the resumed epoch's batches from the checkpoint, so its grad_accum stays; on 4 processes 5 samples per
# rank make one micro-batch (Accelerate's loop takes a changed grad_accum).
RESUMES = [("lightning", 1, 10, 2), ("accelerate", 1, 10, 2), ("accelerate", 4, 5, 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("front_end", "processes", "micro_batch_size", "grad_accum"), RESUMES)
def test_a_two_process_fsdp2_checkpoint_resumes_on_another_process_count(
    runs, tmp_path, front_end, processes, micro_batch_size, grad_accum
):
    """The checkpoint is DCP's: every rank's shards, re-sharded on load for 1 process or 4."""
    whole = runs["science", "fsdp2", front_end]
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy2(whole / "config.yaml", resumed / "config.yaml")
    name = f"step_{SAVED_STEP:06d}"
    shutil.copytree(whole / "checkpoints" / name, resumed / "checkpoints" / name)
    (resumed / "checkpoints" / "latest").write_text(name + "\n")

    # Both saves were written in the background and published in order; nothing was left half-written.
    blocked = [r["step"] for r in read_metrics(whole) if "checkpoint_blocked_s" in r]
    assert (
        blocked == [SAVED_STEP, STEPS] and (whole / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:06d}"
    )
    assert not list((whole / "checkpoints").glob(".tmp-*"))
    launch(
        "science",
        front_end,
        resumed,
        processes=processes,
        preset="fsdp2",
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        resume="true",
        cache_dir=whole.parent / "burgers-cache",
    )
    _, key = RECIPES["science"]
    expected, actual = logged(whole, key), logged(resumed, key)
    assert sorted(actual) == list(range(SAVED_STEP + 1, STEPS + 1)), actual  # the resumed process logged them
    for step in actual:
        assert abs(actual[step][key] - expected[step][key]) <= RESUME_RTOL * abs(expected[step][key]), step


@pytest.mark.parametrize("recipe", ["cv", "science", "nlp"])
def test_describe_reports_an_fsdp2_run_with_its_run_config(recipe):
    printed = describe(REPO / "recipes" / recipe / "train.py", "preset=fsdp2_grad_op", "devices=2")
    assert printed["ds_config"]["fsdp2"]["reshard_after_forward"] is False
    assert "zero_optimization" not in printed["ds_config"]


# (script, setting, the end of its one-line refusal) of what the NLP recipe runs only on DeepSpeed
NLP_DEEPSPEED_ONLY = [
    ("train.py", "model=moe_tiny", "use preset=deepspeed_stage_2, or a dense size (tiny, 125m, 1b, 7b, 8b)"),
    ("train_pipeline.py", "max_steps=1", "use preset=deepspeed_stage_1, or recipes/nlp/train.py for FSDP2"),
]


@pytest.mark.parametrize(("script", "setting", "remedy"), NLP_DEEPSPEED_ONLY)
def test_the_nlp_recipe_refuses_deepspeed_only_parts_under_fsdp2_in_one_line_before_any_work(
    tmp_path, script, setting, remedy
):
    """The MoE sizes (the config's refusal, tests/unit/test_fsdp2_presets.py) and the pipeline engine's script."""
    out_dir = tmp_path / "run"
    argv = [PYTHON, REPO / "recipes" / "nlp" / script, "preset=fsdp2", setting, f"out_dir={out_dir}"]
    assert one_error(run(argv, check=False)).endswith(remedy)
    assert not out_dir.exists()


# --- a kill during an asynchronous DCP write ----------------------------------------------------------------------

KILL_LAST = 8  # the resumed run's last step
# The top-level key each front-end's DCP checkpoint holds the weights under (common.fsdp2.consolidate_checkpoint).
WEIGHTS_PART = {"lightning": "state_dict", "accelerate": "model"}


def step_8_dcp_write_in_flight(out_dir: Path) -> bool:
    """Step 8's background write has begun and is not published (rank 0 renames the folder once all have written)."""
    return (out_dir / "checkpoints" / ".tmp-step_000008").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_sigkill_during_an_asynchronous_fsdp2_write_keeps_the_last_checkpoint_and_resume_reproduces_the_losses(
    tmp_path, front_end
):
    """CV under ``fsdp2``, ``async_save=true``, each rank's file write slowed to 3 s (the delay reaches both kinds of
    DCP write: the Accelerate loop's, through common.fsdp2's writer, and Lightning's strategy's own save, deferred to
    the background by common.async_checkpoint): rank 1 is killed while step 8's write is in flight and the loop has
    gone past it. ``latest`` must still name step 4, a complete DCP checkpoint, and the run resumed from it must log
    the killed run's own losses for steps 5-8 (the killed run trained through step 9 uninterrupted: its losses are
    the reference)."""
    out_dir = tmp_path / "killed"
    code, processes = kill_rank_one_at(
        front_end,
        out_dir,
        step=9,
        timeout_s=60,
        ready=step_8_dcp_write_in_flight,
        env={WRITE_DELAY_ENV: "3"},
        preset="fsdp2",
        async_save="true",
    )
    assert code != 0
    assert not [p.pid for p in processes if alive(p)]
    latest = latest_checkpoint(out_dir)
    assert latest is not None and latest.name == "step_000004", latest
    assert consolidate_checkpoint(latest, WEIGHTS_PART[front_end])  # every rank's shards and DCP's metadata
    partial = out_dir / "checkpoints" / ".tmp-step_000008"  # rank 0 writes DCP's metadata only once all have written
    assert partial.is_dir() and not (partial / ".metadata").exists()
    expected = losses(out_dir)
    assert max(expected) >= 9, sorted(expected)

    logged_before = metrics_lines(out_dir)
    resume = args(out_dir, max_steps=KILL_LAST, checkpoint_interval=4, resume="true", preset="fsdp2", async_save="true")
    proc = launch_cv(front_end, resume)
    assert f"resuming from {latest} (step 4)" in proc.stdout + proc.stderr
    assert not partial.exists()
    assert latest_checkpoint(out_dir).name == f"step_{KILL_LAST:06d}"
    resumed = losses_logged_since(out_dir, logged_before)  # only what the resumed process logged
    assert sorted(resumed) == list(range(5, KILL_LAST + 1)), sorted(resumed)
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], rel=RESUME_RTOL), step
