"""DeepSpeed ZeRO against its peer, PyTorch FSDP2: the same recipe, side by side, on both front-ends.

    python bench/peer.py             # CV, science and NLP default models, both front-ends, 2 interleaved reps
    python bench/peer.py --quick     # CI: the science recipe's smoke model, Lightning, ZeRO-3 vs fsdp2, 1 rep
    python bench/peer.py --lock /tmp/zr-heavy.lock   # hold a shared machine's lock around each repetition
    python bench/peer.py --render    # rewrite docs/benchmarks.md's "peer" section from bench/results/peer.json
    python bench/peer.py --settings  # the NLP recipe under ZeRO-3 with one DeepSpeed setting changed per run
    python bench/peer.py --model 125m  # the NLP recipe's 125M config (bench/results/peer_125m.json), both front-ends
    python bench/peer.py --model 125m --profile  # where rank 0's CPU time goes there, ZeRO-2 vs fsdp2_grad_op

Each pair compares a ZeRO preset with the FSDP2 preset that shards the same states: ``deepspeed_stage_2`` with
``fsdp2_grad_op`` (weights whole between forward and backward) and ``deepspeed_stage_3`` with ``fsdp2`` (weights
sharded too). Every run is the recipe's own command, as a user types it (``train.py`` for Lightning,
``accelerate launch ... train_accelerate.py`` for Accelerate) on 2 CPU processes with ``preset=`` the only change
between the two sides of a pair; the two sides run one after the other in every repetition, in an order that
rotates, so a ratio compares runs made side by side.

Measured per run: from outside, the CPU time and wall time per optimizer step of every process the command started
(sampled when rank 0 logs a step, warm-up steps and the checkpoint save left out), the largest resident memory of
one process (peak over the run, and right after the last step, before its save); from the run's own files, samples
per second (``summary.json``, median step), model-state bytes per rank (counted from the tensors rank 0 holds, with
their breakdown), the final checkpoint's size on disk and how long its save blocked training (``metrics.jsonl``).
The NLP recipe's samples are sequences of its ``seq_len`` tokens (its summary counts tokens), and its model-state
bytes are counted after its first step. Communication per step: the bytes rank 0 sends with ring algorithms, the
median over the measured steps, from DeepSpeed's own communication log under ZeRO and from a count of the
``torch.distributed`` collectives under FSDP2 (bench/_collective_counter.py; both sides run with both switched on).

Writes bench/results/peer.json (provenance included) and renders the "peer" section of docs/benchmarks.md from it.

``--model 125m`` measures the NLP recipe alone on its shipped 125M config (``configs/llama_125m.yaml``: a GPT-3
Small shape, 134M parameters with its 32,000-token vocabulary) at a size two CPU processes step through in seconds
(:data:`NLP_125M`), both pairs on both front-ends; it writes bench/results/peer_125m.json and renders the
"peer-125m" section.

``--settings`` asks why ZeRO-3 costs more CPU time a step than ZeRO-2 on the NLP recipe when FSDP2's ``fsdp2`` costs
about what ``fsdp2_grad_op`` does: the recipe under ``deepspeed_stage_3`` with one of DeepSpeed's stage-3 settings
changed (``ds_overrides=``) per run, beside ``deepspeed_stage_2`` and ``fsdp2``, interleaved the same way. It writes
bench/results/peer_settings.json and renders the "zero3-settings" section of docs/presets.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed
from bench._bench_util import (  # noqa: E402
    DOC,
    REPO,
    add_results_options,
    bench_env,
    bench_parser,
    holding,
    kill_tree,
    median,
    render_from_file,
    rotated,
    save_and_publish,
    spread,
    table_head,
    work_folder,
)
from bench._collective_counter import read_rank_steps, steady_sent_bytes  # noqa: E402
from bench._step_phases import CLOCKS, PHASES, phase_ms_per_step  # noqa: E402
from bench.overhead import breakdown, call_row  # noqa: E402
from common.errors import exit_on_user_error  # noqa: E402
from common.rundir import free_port, read_metrics  # noqa: E402
from common.tools.probe import last_error_line  # noqa: E402
from nlp.data import train_stdlib_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes" / "science"))
from science_config import SMOKE_OVERRIDES as SCIENCE_SMOKE_OVERRIDES  # noqa: E402

RESULTS = REPO / "bench" / "results" / "peer.json"
SETTINGS_RESULTS = REPO / "bench" / "results" / "peer_settings.json"
RESULTS_125M = REPO / "bench" / "results" / "peer_125m.json"
PROFILE_RESULTS = REPO / "bench" / "results" / "peer_125m_profile.json"
DOCS = {"peer": DOC, "peer-125m": DOC, "peer-125m-profile": DOC, "zero3-settings": REPO / "docs" / "presets.md"}
# --model 125m: the shipped config with what a 2-core CPU can step through (its own 16 x 1024 tokens a micro-batch
# and accumulation 2 would take minutes a step here), the model and its vocabulary as shipped; the training text
# capped (the steps measured need a few thousand tokens, not the whole corpus tokenized by every run).
CONFIG_125M = REPO / "recipes" / "nlp" / "configs" / "llama_125m.yaml"
NLP_125M = (
    "--config",
    str(CONFIG_125M),
    "seq_len=256",
    "micro_batch_size=1",
    "grad_accum=1",
    "max_train_tokens=200000",
    "max_val_tokens=4096",
    "sample_tokens=0",
)
MODEL_LABEL = {
    "default": "default model",
    "125m": "Llama 125M config (configs/llama_125m.yaml at seq_len 256, micro-batch 1, accumulation 1)",
}
# (ZeRO preset, the FSDP2 preset sharding the same model states)
PAIRS = (("deepspeed_stage_2", "fsdp2_grad_op"), ("deepspeed_stage_3", "fsdp2"))
FRONT_ENDS = ("lightning", "accelerate")
# --settings: (label, preset, DeepSpeed override) on the NLP recipe; the first two and the last are the references.
STAGE_2, STAGE_3 = "deepspeed_stage_2", "deepspeed_stage_3"
SETTINGS = (
    (STAGE_2, STAGE_2, None),
    (STAGE_3, STAGE_3, None),
    ("prefetch off", STAGE_3, "zero_optimization.stage3_prefetch_bucket_size=0"),
    ("persistence threshold 1e6", STAGE_3, "zero_optimization.stage3_param_persistence_threshold=1000000"),
    ("max reuse distance 0", STAGE_3, "zero_optimization.stage3_max_reuse_distance=0"),
    ("max live parameters 1048576", STAGE_3, "zero_optimization.stage3_max_live_parameters=1048576"),
    ("overlap_comm off", STAGE_3, "zero_optimization.overlap_comm=false"),
    # zero.Init replaces torch.nn.functional.linear by DeepSpeed's own autograd function (process-wide), which is
    # where py-spy finds most of a ZeRO-3 step's samples on this recipe.
    ("memory-efficient linear off", STAGE_3, "zero_optimization.memory_efficient_linear=false"),
    ("fsdp2", "fsdp2", None),
)
# --profile: (label, preset, DeepSpeed override) profiled side by side on the NLP recipe; the FSDP2 side is the
# reference each ZeRO side is compared with. Steps: phases timed after step 3 up to step 8, cProfile up to 11.
PROFILE_REFERENCE = "fsdp2_grad_op"
PROFILE_SIDES = (
    (STAGE_2, STAGE_2, None),
    (PROFILE_REFERENCE, PROFILE_REFERENCE, None),
    # ZeRO-2 with one setting changed, where it bears on the phases ZeRO spends more in (Accelerate only: the
    # settings are the engine's, the same under either front-end).
    ("contiguous_gradients off", STAGE_2, "zero_optimization.contiguous_gradients=false"),
    ("overlap_comm off", STAGE_2, "zero_optimization.overlap_comm=false"),
    # Under bf16, DeepSpeed 0.19 still looks for inf/NaN in every gradient before the step (amax and amin of each):
    # FSDP2 has no such check.
    ("overflow check off", STAGE_2, "bf16.check_grad_overflow=false"),
)
PROFILE_SETTING_FRONT_ENDS = ("accelerate",)
PROFILE_STEPS = (3, 8, 11)
RECIPES = ("cv", "science", "nlp")
LOSS_KEY = {"cv": "train_loss", "science": "train_rel_l2", "nlp": "train_loss"}
WARMUP = 3  # optimizer steps left out of the per-step figures (first calls, allocator growth)
POLL_S = 0.05
MiB = 2**20
MB = 1e6
PROCESSES = 2
COMMS_SITE = REPO / "bench" / "_peer_comms_site"  # its sitecustomize counts every process's collectives
# The science recipe's smoke model (its SMOKE_OVERRIDES without the step counts, which the bench sets): what
# --quick trains in CI.
STEP_COUNT_KEYS = ("max_steps", "eval_interval", "checkpoint_interval")
SCIENCE_SMOKE = [o for o in SCIENCE_SMOKE_OVERRIDES if o.split("=", 1)[0] not in STEP_COUNT_KEYS]


@dataclass
class Run:
    """One recipe run's figures. Per step: between rank 0's log of the last warm-up step and of the last step."""

    cpu_s_per_step: float
    wall_s_per_step: float
    samples_per_s: float
    model_state_bytes: int
    model_state_breakdown: dict
    peak_rss_bytes: int
    post_step_rss_bytes: int
    checkpoint_bytes: int
    checkpoint_blocked_s: float
    final_loss: float
    comm_bytes_per_step: float  # sent by rank 0, ring algorithms
    comm_by_collective: dict  # the same, per collective


def command(recipe: str, front_end: str, args: list[str]) -> list[str]:
    """The recipe's command on 2 processes, through the front-end's own launcher; ``args`` may start with
    ``--config FILE`` (the recipes read options before their ``key=value`` overrides)."""
    folder = REPO / "recipes" / recipe
    if front_end == "lightning":
        return [sys.executable, str(folder / "train.py"), *args, f"devices={PROCESSES}"]  # --config first
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(folder / "accelerate.yaml")]
    launch += ["--num_processes", str(PROCESSES), "--main_process_port", str(free_port())]
    return [*launch, str(folder / "train_accelerate.py"), *args]


def shared_tokenizer(folder: Path, config: Path = CONFIG_125M) -> Path:
    """The byte-level BPE tokenizer every run of ``config`` trains on the standard library's train split (its
    ``vocab_size``, ``val_fraction`` and ``seed``, the recipe's own function: the same tokens), trained once into
    ``folder`` and given to each run (``tokenizer=``) rather than trained again by every one of them."""
    if not (folder / "tokenizer.json").is_file():
        keys = yaml.safe_load(config.read_text())
        train_stdlib_tokenizer(keys["vocab_size"], keys["val_fraction"], keys["seed"], out_dir=folder)
    return folder


def logged_steps(out_dir: Path, key: str) -> set[int]:
    """The optimizer steps rank 0 has logged so far (metrics.jsonl is appended line by line)."""
    with contextlib.suppress(OSError, ValueError):
        return {r["step"] for r in read_metrics(out_dir) if key in r}
    return set()


def tree_sample(root: psutil.Process) -> tuple[float, int]:
    """(CPU seconds of the command and every process it started, largest resident memory of one of them)."""
    cpu, rss = 0.0, 0
    with contextlib.suppress(psutil.Error):
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                cpu += times.user + times.system + times.children_user + times.children_system
                rss = max(rss, process.memory_info().rss)
    return cpu, rss


def directory_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def comms_env(folder: Path) -> dict[str, str]:
    """A run's environment with its collectives counted into ``folder`` (bench/_collective_counter.py)."""
    env = bench_env()
    env["ZR_PEER_COMMS"] = str(folder)
    env["PYTHONPATH"] = os.pathsep.join([str(COMMS_SITE), env["PYTHONPATH"]])
    return env


def communication(folder: Path, zero: bool, steps: int) -> dict[str, float]:
    """Rank 0's bytes sent per measured step, per collective: DeepSpeed's log for a ZeRO run, the torch count for
    an FSDP2 run; RuntimeError when the run wrote none."""
    source = "deepspeed" if zero else "torch"
    logged = read_rank_steps(folder / source)
    if not logged or len(logged) < steps:
        raise RuntimeError(f"no {source} communication log of {steps} steps in {folder / source}")
    return steady_sent_bytes(logged, WARMUP + 1, steps, PROCESSES)


def run_recipe(
    recipe: str, front_end: str, preset: str, args: list[str], out_dir: Path, steps: int, env: dict | None = None
) -> Run:
    """Launch one run and sample it from outside until it ends; RuntimeError with its last error line if it fails.
    ``env``: variables added to the run's environment (``--profile``: bench/_step_phases.py's)."""
    key = LOSS_KEY[recipe]
    argv = command(recipe, front_end, [*args, f"preset={preset}", f"out_dir={out_dir}", f"max_steps={steps}"])
    at_step: dict[int, tuple[float, float, int]] = {}  # step -> (wall, CPU, largest RSS) when rank 0 logged it
    peak_rss = 0
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        env = comms_env(out_dir.with_name(out_dir.name + "-comms")) | (env or {})
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        root = psutil.Process(proc.pid)
        try:
            while proc.poll() is None:
                cpu, rss = tree_sample(root)
                peak_rss = max(peak_rss, rss)
                for step in logged_steps(out_dir, key) - set(at_step):
                    at_step[step] = (time.perf_counter() - start, cpu, rss)
                time.sleep(POLL_S)
        except BaseException:
            kill_tree(proc.pid)
            raise
        out.seek(0)
        printed = out.read()
    if proc.returncode != 0:
        raise RuntimeError(last_error_line(printed))
    if WARMUP not in at_step or steps not in at_step:
        raise RuntimeError(f"steps {WARMUP} and {steps} were not seen in {out_dir}/metrics.jsonl while it ran")
    summary = json.loads((out_dir / "summary.json").read_text())
    samples_per_s = summary["throughput"]["value"]
    if summary["throughput"]["unit"].startswith("tokens"):  # the NLP recipe: a sample is one sequence
        samples_per_s /= yaml.safe_load((out_dir / "config.yaml").read_text())["seq_len"]
    records = read_metrics(out_dir)
    (wall0, cpu0, _), (wall1, cpu1, post_rss) = at_step[WARMUP], at_step[steps]
    blocked = [r["checkpoint_blocked_s"] for r in records if "checkpoint_blocked_s" in r and r["step"] == steps]
    final = [r[key] for r in records if key in r and r["step"] == steps]
    sent = communication(out_dir.with_name(out_dir.name + "-comms"), preset.startswith("deepspeed"), steps)
    return Run(
        cpu_s_per_step=(cpu1 - cpu0) / (steps - WARMUP),
        wall_s_per_step=(wall1 - wall0) / (steps - WARMUP),
        samples_per_s=samples_per_s,
        model_state_bytes=summary["model_state_bytes_per_rank"],
        # CV and science count after the last step; the NLP recipe after its first (model_state_bytes_measured).
        model_state_breakdown=summary.get("model_state_breakdown") or summary.get("model_state_bytes_measured", {}),
        peak_rss_bytes=peak_rss,
        post_step_rss_bytes=post_rss,
        checkpoint_bytes=directory_bytes(out_dir / "checkpoints" / f"step_{steps:06d}"),
        checkpoint_blocked_s=blocked[0] if blocked else float("nan"),
        final_loss=final[0],
        comm_bytes_per_step=sum(sent.values()),
        comm_by_collective=sent,
    )


def measure(
    cases: list[tuple[str, str]],
    pairs: tuple,
    reps: int,
    steps: int,
    work: Path,
    quick: bool,
    lock: Path | None,
    model_args: tuple[str, ...] = (),
) -> list[dict]:
    """Interleaved repetitions of every (recipe, front-end, pair): the two sides of a pair run back to back, each
    repetition holding ``lock`` (other heavy work on a shared machine waits between repetitions, not during one).
    ``model_args`` start every run's arguments (``--model 125m``: :data:`NLP_125M`)."""
    rows = {
        (recipe, front_end, zero, fsdp2): {"runs": {zero: [], fsdp2: []}, "error": None}
        for recipe, front_end in cases
        for zero, fsdp2 in pairs
    }
    for rep in range(reps):
        with holding(lock):
            for (recipe, front_end, zero, fsdp2), row in rows.items():
                if not row["error"]:
                    measure_pair(recipe, front_end, (zero, fsdp2), row, rep, steps, work, quick, model_args)
    return [
        {"recipe": recipe, "front_end": front_end, "zero": zero, "fsdp2": fsdp2, **row}
        for (recipe, front_end, zero, fsdp2), row in rows.items()
    ]


def measure_pair(
    recipe: str,
    front_end: str,
    pair: tuple[str, str],
    row: dict,
    rep: int,
    steps: int,
    work: Path,
    quick: bool,
    model_args: tuple[str, ...] = (),
) -> None:
    """Both sides of a pair, in the repetition's order; a failure is kept in ``row["error"]``."""
    for preset in rotated(pair, rep):
        out_dir = work / f"{recipe}-{front_end}-{preset}-{rep}"
        args = [*model_args, f"checkpoint_interval={steps}", "log_interval=1", "eval_interval=100000"]
        if recipe == "science":
            args += [f"cache_dir={work / 'burgers-cache'}", *(SCIENCE_SMOKE if quick else [])]
        try:
            run = run_recipe(recipe, front_end, preset, args, out_dir, steps)
        except RuntimeError as err:
            row["error"] = f"{preset}: {err}"
            print(f"rep {rep} {recipe} {front_end} {preset}: did not run: {err}", flush=True)
            break
        row["runs"][preset].append(asdict(run))
        print(
            f"rep {rep} {recipe:>7} {front_end:>10} {preset:>17}: CPU {run.cpu_s_per_step * 1e3:7.1f} ms/step, "
            f"wall {run.wall_s_per_step * 1e3:7.1f} ms/step, states {run.model_state_bytes / MiB:.2f} MiB, "
            f"sent {run.comm_bytes_per_step / MB:.2f} MB/step",
            flush=True,
        )


def measure_settings(front_ends: list[str], reps: int, steps: int, work: Path, lock: Path | None) -> list[dict]:
    """--settings: every entry of :data:`SETTINGS` on the NLP recipe, per front-end, in an order that rotates with
    the repetition; each repetition holds ``lock``."""
    rows = {(front_end, label): {"runs": [], "error": None} for front_end in front_ends for label, _, _ in SETTINGS}
    args = [f"checkpoint_interval={steps}", "log_interval=1", "eval_interval=100000"]
    for rep in range(reps):
        with holding(lock):
            for front_end in front_ends:
                for label, preset, override in rotated(SETTINGS, rep):
                    row = rows[(front_end, label)]
                    if row["error"]:
                        continue
                    out_dir = work / f"nlp-{front_end}-{label.replace(' ', '_')}-{rep}"
                    extra = [f"ds_overrides={override}"] if override else []
                    try:
                        run = run_recipe("nlp", front_end, preset, [*args, *extra], out_dir, steps)
                    except RuntimeError as err:
                        row["error"] = str(err)
                        print(f"rep {rep} {front_end} {label}: did not run: {err}", flush=True)
                        continue
                    row["runs"].append(asdict(run))
                    print(
                        f"rep {rep} {front_end:>10} {label:>28}: CPU {run.cpu_s_per_step * 1e3:7.1f} ms/step, "
                        f"states {run.model_state_bytes / MiB:.2f} MiB, sent {run.comm_bytes_per_step / MB:.2f} MB",
                        flush=True,
                    )
    return [{"front_end": front_end, "label": label, **row} for (front_end, label), row in rows.items()]


def measure_profile(
    front_ends: list[str], reps: int, work: Path, lock: Path | None, model_args: tuple[str, ...]
) -> list[dict]:
    """--profile: every side of :data:`PROFILE_SIDES` on the NLP recipe, per front-end, in an order that rotates
    with the repetition, rank 0 profiled by bench/_step_phases.py (phases over steps ``PROFILE_STEPS[0] + 1`` to
    ``PROFILE_STEPS[1]``, cProfile after); each repetition holds ``lock``."""
    start, switch, stop = PROFILE_STEPS
    sides = [
        (front_end, side)
        for front_end in front_ends
        for side in PROFILE_SIDES
        if side[2] is None or front_end in PROFILE_SETTING_FRONT_ENDS
    ]
    rows = {(front_end, label): {"runs": [], "error": None} for front_end, (label, _, _) in sides}
    args = [*model_args, f"checkpoint_interval={stop + 1}", "log_interval=1", "eval_interval=100000"]
    for rep in range(reps):
        with holding(lock):
            for front_end, (label, preset, override) in rotated(tuple(sides), rep):
                row = rows[(front_end, label)]
                if row["error"]:
                    continue
                out_dir = work / f"profile-{front_end}-{label.replace(' ', '_')}-{rep}"
                folder = out_dir.with_name(out_dir.name + "-profile")
                env = {"ZR_PEER_PROFILE": str(folder), "ZR_PEER_PROFILE_STEPS": f"{start},{switch},{stop}"}
                extra = [f"ds_overrides={override}"] if override else []
                try:
                    run = run_recipe("nlp", front_end, preset, [*args, *extra], out_dir, stop + 1, env)
                    profiled = json.loads((folder / "rank0.json").read_text())
                except (RuntimeError, OSError) as err:
                    row["error"] = str(err)
                    print(f"rep {rep} {front_end} {label}: did not run: {err}", flush=True)
                    continue
                for written in ("checkpoints", "final"):  # gigabytes a run at 125M, not what is profiled here
                    shutil.rmtree(out_dir / written, ignore_errors=True)
                cprofile = breakdown(folder / "rank0.prof", stop - switch)
                cprofile["top_calls"] = top_calls(folder / "rank0.prof", stop - switch)
                row["runs"].append({**asdict(run), "profile": profiled, "cprofile": cprofile})
                ms = phase_ms_per_step(profiled["phases"], switch - start)
                print(
                    f"rep {rep} {front_end:>10} {label:>20}: CPU {sum(ms.values()):7.1f} ms/step on rank 0: "
                    + ", ".join(f"{phase} {value:.0f}" for phase, value in ms.items()),
                    flush=True,
                )
    return [
        {"front_end": front_end, "label": label, "preset": preset, "ds_override": override, **rows[(front_end, label)]}
        for front_end, (label, preset, override) in sides
    ]


def top_calls(profile: Path, steps: int, top: int = 10) -> list[list]:
    """The functions with the most own time in a cProfile dump: ``[where(function), ms a step, calls a step]``."""
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    calls = [call_row(key, ncalls, tottime, steps) for key, (_, ncalls, tottime, _, _) in stats.items()]
    return sorted(calls, key=lambda call: -call[1])[:top]


# --- rendering: a pure function of the results document -------------------------------------------------------------

# (figure, Run field, lower is better): ratio ZeRO / FSDP2 per repetition, side by side
RATIOS = (
    ("CPU time per step", "cpu_s_per_step"),
    ("wall time per step", "wall_s_per_step"),
    ("model states per rank", "model_state_bytes"),
    ("peak RSS", "peak_rss_bytes"),
    ("post-step RSS", "post_step_rss_bytes"),
    ("checkpoint size", "checkpoint_bytes"),
    ("save stall", "checkpoint_blocked_s"),
    ("communication per step", "comm_bytes_per_step"),
)


def ratios(row: dict, field: str) -> list[float]:
    """ZeRO / FSDP2 of ``field`` in each repetition (both sides of a repetition ran back to back)."""
    zero, fsdp2 = row["runs"][row["zero"]], row["runs"][row["fsdp2"]]
    return [z[field] / f[field] for z, f in zip(zero, fsdp2) if f.get(field) and field in z]


def ratio_text(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    low, high = spread(values)
    return f"{median(values):.2f} ({low:.2f}-{high:.2f})"


def side(runs: list[dict], field: str, scale: float = 1.0, digits: int = 1) -> str:
    if any(field not in r for r in runs):  # a results file from before the figure was measured
        return "-"
    return f"{median([r[field] for r in runs]) * scale:.{digits}f}"


def figures_table(rows: list[dict]) -> str:
    lines = table_head(
        "recipe",
        "front-end",
        "preset",
        "CPU ms / step",
        "wall ms / step",
        "samples/s",
        "model states / rank (MiB)",
        "peak RSS (MiB)",
        "post-step RSS (MiB)",
        "checkpoint (MiB)",
        "save stall (ms)",
        "sent / step (MB)",
    )
    for row in rows:
        for preset in (row["zero"], row["fsdp2"]):
            runs = row["runs"][preset]
            if not runs:
                continue
            lines.append(
                f"| {row['recipe']} | {row['front_end']} | {preset} | {side(runs, 'cpu_s_per_step', 1e3)} | "
                f"{side(runs, 'wall_s_per_step', 1e3)} | {side(runs, 'samples_per_s')} | "
                f"{side(runs, 'model_state_bytes', 1 / MiB, 2)} | {side(runs, 'peak_rss_bytes', 1 / MiB, 0)} | "
                f"{side(runs, 'post_step_rss_bytes', 1 / MiB, 0)} | {side(runs, 'checkpoint_bytes', 1 / MiB, 2)} | "
                f"{side(runs, 'checkpoint_blocked_s', 1e3, 0)} | {side(runs, 'comm_bytes_per_step', 1 / MB, 2)} |"
            )
    return "\n".join(lines)


def ratios_table(rows: list[dict]) -> str:
    lines = table_head("recipe", "front-end", "ZeRO / FSDP2", *[name for name, _ in RATIOS])
    for row in rows:
        if row["runs"][row["fsdp2"]] and row["runs"][row["zero"]]:
            cells = " | ".join(ratio_text(ratios(row, field)) for _, field in RATIOS)
            lines.append(f"| {row['recipe']} | {row['front_end']} | {row['zero']} / {row['fsdp2']} | {cells} |")
    return "\n".join(lines)


def breakdown_text(row: dict) -> str:
    """Where the model-state bytes differ: rank 0's categories on each side (last repetition)."""
    parts = []
    for preset in (row["zero"], row["fsdp2"]):
        breakdown = row["runs"][preset][-1]["model_state_breakdown"]
        cells = ", ".join(f"{name} {value / MiB:.2f}" for name, value in breakdown.items() if value)
        parts.append(f"{preset}: {cells or 'no breakdown'} MiB")
    return "; ".join(parts)


def where_zero_loses(rows: list[dict]) -> str:
    """Each figure where the ZeRO side's median is above FSDP2's by more than its repetitions' spread allows."""
    lines = []
    for row in rows:
        if not (row["runs"][row["zero"]] and row["runs"][row["fsdp2"]]):
            continue
        for name, field in RATIOS:
            values = ratios(row, field)
            # ZeRO above FSDP2 in every repetition, to the two decimals printed (a few bytes more is not "above")
            if values and round(min(values), 2) > 1.0:
                lines.append(
                    f"- {row['recipe']}, {row['front_end']}, {row['zero']} vs {row['fsdp2']}: {name} "
                    f"{median(values):.2f}x FSDP2's (every repetition above 1.00)."
                )
        lines.append(f"  Model states per rank, by kind: {breakdown_text(row)}.")
    return "\n".join(lines) if lines else "No figure where ZeRO is above FSDP2 in every repetition."


def sharding_cost_text(rows: list[dict]) -> str:
    """Why, from the same table: what sharding the parameters too adds to a step on each side (stage 3 over stage 2
    for ZeRO, ``fsdp2`` over ``fsdp2_grad_op`` for FSDP2), beside what the two sides cost at stage 2."""
    by_case: dict[tuple[str, str], dict[str, dict]] = {}
    for row in rows:
        if row["runs"][row["zero"]] and row["runs"][row["fsdp2"]]:
            by_case.setdefault((row["recipe"], row["front_end"]), {})[row["zero"]] = row
    lines = []
    for (recipe, front_end), pairs in by_case.items():
        if set(pairs) != {"deepspeed_stage_2", "deepspeed_stage_3"}:
            continue
        ms = {
            preset: median([r["cpu_s_per_step"] for r in row["runs"][preset]]) * 1e3
            for row in pairs.values()
            for preset in (row["zero"], row["fsdp2"])
        }
        zero_added = ms["deepspeed_stage_3"] - ms["deepspeed_stage_2"]
        fsdp2_added = ms["fsdp2"] - ms["fsdp2_grad_op"]
        lines.append(
            f"- {recipe}, {front_end}: sharding the parameters too adds {zero_added:+.0f} ms of CPU time a step "
            f"under ZeRO (stage 3 over stage 2) and {fsdp2_added:+.0f} ms under FSDP2 (fsdp2 over fsdp2_grad_op); "
            f"at stage 2 the sides stand at {ms['deepspeed_stage_2']:.0f} and {ms['fsdp2_grad_op']:.0f} ms."
        )
    if not lines:
        return ""
    return (
        "Where the CPU time goes (medians of the table above): the part of a step that parameter sharding adds on "
        "each side, against the stage-2 step both share.\n\n"
        + "\n".join(lines)
        + "\n\nWhether one of DeepSpeed's stage-3 settings removes ZeRO's part on the NLP recipe: docs/presets.md, "
        '"zero3-settings" (`python bench/peer.py --settings`).'
    )


def front_end_traffic_text(rows: list[dict], tolerance: float = 0.01) -> str:
    """Where one ZeRO preset sends different bytes per step on the two front-ends of the same recipe (same model,
    same DeepSpeed config): the front-end's loop, not the preset, decides that part of the step."""
    sent: dict[tuple[str, str], dict[str, float]] = {}
    for row in rows:
        runs = row["runs"][row["zero"]]
        if runs and all(r.get("comm_bytes_per_step") for r in runs):
            sent.setdefault((row["recipe"], row["zero"]), {})[row["front_end"]] = median(
                [r["comm_bytes_per_step"] for r in runs]
            )
    lines = []
    for (recipe, preset), by_front_end in sent.items():
        if len(by_front_end) == 2 and max(by_front_end.values()) > (1 + tolerance) * min(by_front_end.values()):
            more, less = sorted(by_front_end, key=by_front_end.get, reverse=True)
            lines.append(
                f"- {recipe}, {preset}: the {more} run sends {by_front_end[more] / MB:.2f} MB a step, the {less} run "
                f"{by_front_end[less] / MB:.2f} MB, with the same DeepSpeed config: the front-end's loop, not the "
                f"preset, makes the difference."
            )
    if not lines:
        return ""
    return (
        "The same ZeRO preset moving different bytes on the two front-ends (medians of the table above):\n\n"
        + "\n".join(lines)
        + "\n\nThe front-end that sends more does work the other skips: under ZeRO-3, look first for an evaluation "
        'before the first training step (docs/troubleshooting.md, "ZeRO-3 gathers every parameter twice a step").'
    )


NLP_GOAL = {"cpu_s_per_step": 1.00, "model_state_bytes": 1.10}  # ZeRO / FSDP2 at most, on the NLP recipe


def nlp_goal_text(rows: list[dict]) -> str:
    """The goal on the NLP recipe, judged on each pair's medians: ZeRO at most 1.00x FSDP2's CPU time per step and
    1.10x its model-state bytes per rank."""
    verdicts = []
    for row in rows:
        if row["recipe"] != "nlp" or not (row["runs"][row["zero"]] and row["runs"][row["fsdp2"]]):
            continue
        cpu, states = (median(ratios(row, field)) for field in NLP_GOAL)
        met = cpu <= NLP_GOAL["cpu_s_per_step"] and states <= NLP_GOAL["model_state_bytes"]
        verdicts.append(
            f"- {row['front_end']}, {row['zero']} / {row['fsdp2']}: CPU time {cpu:.2f}x, model states "
            f"{states:.2f}x: {'met' if met else 'not met'}."
        )
    if not verdicts:
        return ""
    return (
        f"The goal on the NLP recipe (ZeRO at most {NLP_GOAL['cpu_s_per_step']:.2f}x FSDP2's CPU time per step and "
        f"{NLP_GOAL['model_state_bytes']:.2f}x its model-state bytes per rank; medians of the table above):\n\n"
        + "\n".join(verdicts)
    )


def paired(runs: list[dict], other: list[dict], field: str) -> str:
    """``field`` of ``runs`` over ``other``'s, run by run (both made side by side in each repetition)."""
    return ratio_text([a[field] / b[field] for a, b in zip(runs, other) if b[field]])


def settings_table(rows: list[dict]) -> str:
    """--settings: each setting's medians, and its CPU time per step beside the ZeRO-3 preset's and FSDP2's (the
    ratio of the runs made side by side in each repetition, median)."""
    by_key = {(r["front_end"], r["label"]): r["runs"] for r in rows}
    lines = table_head(
        "front-end",
        "setting",
        "CPU ms / step",
        "wall ms / step",
        "CPU over ZeRO-2 (ms)",
        "CPU / ZeRO-3 preset",
        "CPU / fsdp2",
        "model states / rank (MiB)",
        "states / fsdp2",
        "sent / step (MB)",
    )
    for row in rows:
        runs = row["runs"]
        if not runs:
            continue
        stage_2, stage_3, fsdp2 = (by_key.get((row["front_end"], k)) or [] for k in (STAGE_2, STAGE_3, "fsdp2"))
        cpu_ms = median([r["cpu_s_per_step"] for r in runs]) * 1e3
        over_2 = f"{cpu_ms - median([r['cpu_s_per_step'] for r in stage_2]) * 1e3:+.0f}" if stage_2 else "-"

        lines.append(
            f"| {row['front_end']} | {row['label']} | {cpu_ms:.1f} | {side(runs, 'wall_s_per_step', 1e3)} | {over_2} | "
            f"{paired(runs, stage_3, 'cpu_s_per_step')} | {paired(runs, fsdp2, 'cpu_s_per_step')} | "
            f"{side(runs, 'model_state_bytes', 1 / MiB, 2)} | {paired(runs, fsdp2, 'model_state_bytes')} | "
            f"{side(runs, 'comm_bytes_per_step', 1 / MB, 2)} |"
        )
    return "\n".join(lines)


def settings_verdict(rows: list[dict]) -> str:
    """Per front-end, the ZeRO-3 setting with the lowest median CPU time, and whether it meets the NLP goal against
    ``fsdp2`` (:data:`NLP_GOAL`, on the medians of the paired ratios)."""
    lines = []
    for front_end in dict.fromkeys(r["front_end"] for r in rows):
        mine = {r["label"]: r["runs"] for r in rows if r["front_end"] == front_end and r["runs"]}
        fsdp2 = mine.get("fsdp2")
        tried = {label: runs for label, runs in mine.items() if label not in (STAGE_2, "fsdp2")}
        if not (fsdp2 and tried):
            continue
        best = min(tried, key=lambda label: median([r["cpu_s_per_step"] for r in tried[label]]))
        cpu, states = (
            median([a[f] / b[f] for a, b in zip(tried[best], fsdp2) if b[f]])
            for f in ("cpu_s_per_step", "model_state_bytes")
        )
        met = cpu <= NLP_GOAL["cpu_s_per_step"] and states <= NLP_GOAL["model_state_bytes"]
        lines.append(
            f"- {front_end}: the lowest CPU time a step among the ZeRO-3 runs is `{best}`'s: {cpu:.2f}x fsdp2's, "
            f"model states {states:.2f}x: the NLP goal is {'met' if met else 'not met'}."
        )
    return "\n".join(lines)


def render_settings(results: dict) -> str:
    rows = results["rows"]
    head = (
        f"The NLP recipe's {results['model']} on {results['reps']} interleaved repetitions of {results['steps']} "
        f"optimizer steps, 2 CPU processes (gloo), bf16, measured as in the peer benchmark (docs/benchmarks.md, "
        f'"peer"; steps {results["warmup"] + 1}-{results["steps"]}): `preset=deepspeed_stage_3` with one DeepSpeed '
        'setting changed per row (`ds_overrides=`), beside `deepspeed_stage_2` and `fsdp2`. "CPU over ZeRO-2" is '
        "the part of a step that sharding the parameters adds; the ratios are those of the runs made side by side "
        "in each repetition, median (min-max)."
    )
    failed = [f"- {r['front_end']}, {r['label']}: did not run: `{r['error']}`" for r in rows if r["error"]]
    overrides = [
        f"- {label}: `ds_overrides={s['ds_override']}`" for label, s in results["settings"].items() if s["ds_override"]
    ]
    body = [head, "", settings_table(rows), "", settings_verdict(rows), "", "The settings:", "", *overrides]
    return "\n".join([*body, *([""] + failed if failed else [])])


def window_steps(run: dict, window: str) -> int:
    """Steps in a profiled run's ``phase_steps`` or ``profile_steps`` window ([first, last])."""
    first, last = run["profile"][window]
    return last - first + 1


def phase_medians(runs: list[dict], clock: str = "cpu_s") -> dict[str, float]:
    """Per phase, the median over repetitions of rank 0's ms a step on ``clock`` (bench/_step_phases.py)."""
    per_run = [phase_ms_per_step(r["profile"]["phases"], window_steps(r, "phase_steps"), clock) for r in runs]
    return {phase: median([ms[phase] for ms in per_run]) for phase in per_run[0]}


def profile_columns(rows: list[dict], clock: str = "cpu_s") -> list[tuple[str, str, dict]]:
    """(front-end, side label, its phase medians on ``clock``) of every row that ran, in the rows' order."""
    return [(r["front_end"], r["label"], phase_medians(r["runs"], clock)) for r in rows if r["runs"]]


def profile_phase_table(rows: list[dict], clock: str = "cpu_s") -> str:
    """Phases down, sides across (per front-end), with each ZeRO side's difference to the FSDP2 side beside it:
    CPU ms a step, or (``minor_faults``) thousands of minor page faults a step."""
    columns = profile_columns(rows, clock)
    if not columns:
        return ""
    heads, cells = [], []
    if clock == "minor_faults":  # thousands a step (phase_ms_per_step scaled the count by 1e3)
        columns = [(f, label, {phase: v / 1e6 for phase, v in ms.items()}) for f, label, ms in columns]
    for front_end, label, ms in columns:
        heads.append(f"{front_end}: {label}")
        cells.append(ms)
        reference = next((m for f, lab, m in columns if f == front_end and lab == PROFILE_REFERENCE), None)
        if label != PROFILE_REFERENCE and reference is not None:
            heads.append(f"{front_end}: {label} - {PROFILE_REFERENCE}")
            cells.append({phase: ms[phase] - reference[phase] for phase in ms})
    unit = "CPU ms / step" if clock == "cpu_s" else "thousand minor page faults / step"
    lines = table_head(f"phase (rank 0, {unit})", *heads)
    differences = {i for i, head in enumerate(heads) if " - " in head}
    for phase in [*cells[0], "total"]:
        values = [sum(c.values()) if phase == "total" else c[phase] for c in cells]
        shown = [f"{v:+.0f}" if i in differences else f"{v:.0f}" for i, v in enumerate(values)]
        lines.append(f"| {'**total**' if phase == 'total' else phase} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def profile_clock_table(rows: list[dict]) -> str:
    """Each side's whole window on the three clocks: the process's CPU time, the main thread's, wall time."""
    heads = ("process CPU ms / step", "main thread CPU ms / step", "wall ms / step", "minor page faults / step")
    lines = table_head("front-end", "side", *heads)
    for row in rows:
        if row["runs"]:
            totals = [
                f"{sum(phase_medians(row['runs'], clock).values()) / (1e3 if clock == 'minor_faults' else 1):.0f}"
                if clock in row_clocks(row)
                else "-"
                for clock in CLOCKS
            ]
            lines.append(f"| {row['front_end']} | {row['label']} | " + " | ".join(totals) + " |")
    return "\n".join(lines)


def row_clocks(row: dict) -> tuple[str, ...]:
    """The clocks a row's runs recorded (page faults from the commit that added them on)."""
    recorded = next(iter(row["runs"][0]["profile"]["phases"].values()))
    return tuple(clock for clock in CLOCKS if clock in recorded)


def profile_gap_text(rows: list[dict]) -> str:
    """Per front-end, each ZeRO side's CPU time a step over the FSDP2 side's, split by phase, largest first."""
    columns = profile_columns(rows)
    lines = []
    for front_end, label, ms in columns:
        reference = next((m for f, lab, m in columns if f == front_end and lab == PROFILE_REFERENCE), None)
        if label == PROFILE_REFERENCE or reference is None:
            continue
        gap = {phase: ms[phase] - reference[phase] for phase in ms}
        ranked = sorted(gap, key=lambda phase: -gap[phase])
        parts = "; ".join(f"{phase} {gap[phase]:+.0f}" for phase in ranked)
        preset = next((m for f, lab, m in columns if f == front_end and lab == STAGE_2), None)
        beside = f" ({sum(ms.values()) - sum(preset.values()):+.0f} against {STAGE_2}'s)" if label != STAGE_2 else ""
        lines.append(
            f"- {front_end}, {label} over {PROFILE_REFERENCE}: {sum(gap.values()):+.0f} ms of rank 0's CPU time a "
            f"step{beside if preset else ''}; by phase, largest first: {parts}."
        )
    return "\n".join(lines)


def profile_area_table(rows: list[dict]) -> str:
    """cProfile's own time by package (bench/overhead.py's areas), medians over repetitions, sides across."""
    ran = [r for r in rows if r["runs"]]
    areas = sorted({a for r in ran for run in r["runs"] for a in run["cprofile"]["areas"]})
    sides = [f"{r['front_end']}: {r['label']}" for r in ran]
    lines = table_head("package (rank 0, thread CPU ms / step, cProfile)", *sides)
    for area in areas:
        values = [median([run["cprofile"]["areas"].get(area, 0.0) for run in r["runs"]]) for r in ran]
        lines.append(f"| {area} | " + " | ".join(f"{v:.0f}" for v in values) + " |")
    return "\n".join(lines)


def profile_top_text(rows: list[dict], top: int = 6) -> str:
    """Each side's functions with the most own time under cProfile (the last repetition)."""
    lines = []
    for row in rows:
        if row["runs"]:
            calls = row["runs"][-1]["cprofile"]["top_calls"][:top]
            shown = "; ".join(f"`{where.replace(f'{REPO}/', '')}` {ms:.0f} ms ({n} calls)" for where, ms, n in calls)
            lines.append(f"- {row['front_end']}, {row['label']}: {shown}.")
    return "\n".join(lines)


def render_profile(results: dict) -> str:
    rows = results["rows"]
    first, switch, stop = results["profile_steps"]
    head = (
        f"Where rank 0's CPU time goes in a training step of the NLP recipe's {results['model']}, 2 CPU processes "
        f'(gloo), the recipe\'s own command as in "peer-125m" with `preset=` the only change within a pair, '
        f"{results['reps']} interleaved repetition{'s' if results['reps'] != 1 else ''} (bench/peer.py --profile, "
        "bench/_step_phases.py). Phases: steps "
        f"{first + 1}-{switch}; the functions of each phase are wrapped in the running process, and the time between "
        "two of their calls or returns goes to the innermost phase open, the time with none open to `other` (the "
        "front-end's loop, logging, data loading); the process's CPU time (every thread: gloo's threads count in "
        "the phase that waits for them). Medians over repetitions. Then cProfile (own time by package, the main "
        f"thread's CPU time) on steps {switch + 1}-{stop}, which slows the Python-heavy parts: read it for where, "
        "not for how much (the time a collective's `Work.wait` blocks is charged to the bench's wrapper that calls "
        "it, under bench + project)."
    )
    covered = results.get("phases", PHASES)  # what the run wrapped, as it recorded it
    phases = "\n".join(f"- {phase}: {', '.join(f'`{t}`' for t in targets)}" for phase, targets in covered.items())
    failed = [f"- {r['front_end']}, {r['label']}: did not run: `{r['error']}`" for r in rows if r["error"]]
    overrides = [f"- {r['label']}: `ds_overrides={r['ds_override']}`" for r in rows if r["ds_override"]]
    faults = all("minor_faults" in row_clocks(r) for r in rows if r["runs"])
    body = [head, "", profile_phase_table(rows), "", profile_clock_table(rows), ""]
    if faults:
        body += [
            "Minor page faults by phase: memory the process maps afresh (glibc serves an allocation above its mmap "
            "threshold, at most 32 MiB, with new pages each time, which the first write faults in):",
            "",
            profile_phase_table(rows, "minor_faults"),
            "",
        ]
    body += ["Where a ZeRO side's CPU time a step differs from FSDP2's (rank 0, medians):", "", profile_gap_text(rows)]
    body += ["", profile_area_table(rows), "", "Most own time under cProfile (ms a step):", "", profile_top_text(rows)]
    body += ["", "The functions each phase covers (both sides' where they do the same job):", "", phases]
    body += [*(["", "The settings:", "", *overrides] if overrides else []), *([""] + failed if failed else [])]
    return "\n".join(body)


def render_sections(document: dict) -> dict[str, str]:
    """The "peer" section of docs/benchmarks.md from a peer.json document alone, or the "zero3-settings" section of
    docs/presets.md from a peer_settings.json one."""
    results = document["results"]
    if results.get("mode") == "profile":
        return {"peer-125m-profile": render_profile(results)}
    if results.get("mode") == "settings":
        return {"zero3-settings": render_settings(results)}
    section = "peer-125m" if results.get("mode") == "125m" else "peer"
    rows = results["rows"]
    failed = [f"- {r['recipe']}, {r['front_end']}: did not run: `{r['error']}`" for r in rows if r["error"]]
    skipped = [f"- {name}: skipped: `{why}`" for name, why in results["skipped"].items()]
    if "nlp" in results["skipped"]:  # a results file from before the NLP recipe ran the FSDP2 presets
        skipped.append(
            "\nThe goal on the NLP recipe (ZeRO at most 1.00x FSDP2's CPU time per step and 1.10x its model-state "
            "bytes per rank) is not judged here until that recipe runs the FSDP2 presets; the rows above are the CV "
            "and science recipes'."
        )
    head = (
        f"{results['reps']} interleaved repetitions of {results['steps']} optimizer steps per run, 2 CPU processes "
        f"(gloo), each recipe's {results['model']} at its default precision, the recipe's own command with "
        f"`preset=` the only change within a pair. Per step: CPU time of every process of the run (the two ranks and "
        f"the launcher) and wall time, steps {results['warmup'] + 1}-{results['steps']}, sampled from outside; "
        "samples/s from the run's summary.json (median step); model states counted from the tensors rank 0 holds "
        "after the last step (the recipes count after their final evaluation's forward: weights an FSDP2 preset "
        "keeps gathered for a backward, every unit's under `fsdp2_grad_op`, count as their working copies in place "
        "of their fp32 shards); "
        "RSS the largest of one process; checkpoint: the final one on disk and how long its "
        "save blocked training; communication: the bytes rank 0 sends per step with ring algorithms (the buffer "
        "times (n-1)/n for an all-gather or a reduce-scatter, twice that for an all-reduce), from DeepSpeed's own "
        "log under ZeRO and from a count of the `torch.distributed` collectives under FSDP2, steps "
        f"{results['warmup'] + 1}-{results['steps']}. "
        "Figures are medians over repetitions; ratios are ZeRO / FSDP2 per repetition, "
        "median (min-max): below 1.00 ZeRO is cheaper."
    )
    goal = nlp_goal_text(rows)
    body = [head, "", ratios_table(rows), "", figures_table(rows), *(["", goal] if goal else [])]
    body += ["", "Where ZeRO costs more (measured):", ""]
    body += [where_zero_loses(rows)]
    why = sharding_cost_text(rows)
    traffic = front_end_traffic_text(rows)
    body += [
        *(["", why] if why else []),
        *(["", traffic] if traffic else []),
        *([""] + failed if failed else []),
        *([""] + skipped if skipped else []),
    ]
    return {section: "\n".join(body)}


@exit_on_user_error(ValueError, FileNotFoundError)  # --render: a results file missing or without provenance
def main() -> None:
    parser = bench_parser(__doc__)
    add_results_options(parser, RESULTS)
    parser.add_argument("--quick", action="store_true", help="CI: science smoke model, Lightning, ZeRO-3 vs fsdp2")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help=f"optimizer steps per run (more than {WARMUP + 1})")
    parser.add_argument("--work-dir", help="keep the runs' folders here (default: a temporary folder)")
    parser.add_argument("--lock", type=Path, help="a file to flock around each repetition (a shared machine's lock)")
    parser.add_argument(
        "--settings", action="store_true", help=f"NLP recipe, ZeRO-3 settings (default --json {SETTINGS_RESULTS.name})"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help=f"where rank 0's CPU time goes, ZeRO-2 vs fsdp2_grad_op (default --json {PROFILE_RESULTS.name})",
    )
    parser.add_argument(
        "--front-ends", nargs="+", choices=FRONT_ENDS, default=list(FRONT_ENDS), help="with --settings or --profile"
    )
    parser.add_argument(
        "--model",
        choices=list(MODEL_LABEL),
        default="default",
        help=f"125m: the NLP recipe's 125M config alone (default --json {RESULTS_125M.name})",
    )
    args = parser.parse_args()
    if args.model != "default" and (args.quick or args.settings):
        parser.error("--model 125m measures the NLP recipe's pairs: not with --quick or --settings")
    if args.profile and (args.quick or args.settings):
        parser.error("--profile measures the NLP recipe's stage-2 pair: not with --quick or --settings")
    if args.profile and args.model != "125m" and not args.render:
        # Its results file and section are the 125M config's: a default-model profile would be published as one.
        parser.error("--profile measures the NLP recipe's 125M config: add --model 125m")
    if args.settings and args.json == RESULTS:
        args.json = SETTINGS_RESULTS
    if args.profile and args.json == RESULTS:
        args.json = PROFILE_RESULTS
    if args.model == "125m" and args.json == RESULTS:  # (not with --profile: set above)
        args.json = RESULTS_125M
    if args.render:
        render_from_file(args.json, render_sections, DOCS)
        return
    if args.steps <= WARMUP + 1 or args.reps < 1:
        parser.error(f"--steps must exceed {WARMUP + 1} (the warm-up steps and one measured step), --reps be >= 1")
    if args.settings:
        with work_folder(args.work_dir, "zr-peer-settings-") as work:
            rows = measure_settings(args.front_ends, args.reps, args.steps, work, args.lock)
        settings = {label: {"preset": preset, "ds_override": override} for label, preset, override in SETTINGS}
        results = {"mode": "settings", "reps": args.reps, "steps": args.steps, "warmup": WARMUP}
        results |= {"model": "default model", "settings": settings, "rows": rows}
        save_and_publish(args, results, render_sections, DOCS)
        print(render_settings(results))
        return
    if args.profile:
        with work_folder(args.work_dir, "zr-peer-profile-") as work:
            model_args = (*NLP_125M, f"tokenizer={shared_tokenizer(work / 'tokenizer-125m')}")
            rows = measure_profile(args.front_ends, args.reps, work, args.lock, model_args)
        results = {"mode": "profile", "reps": args.reps, "model": MODEL_LABEL[args.model], "rows": rows}
        results |= {"profile_steps": list(PROFILE_STEPS), "phases": {phase: list(t) for phase, t in PHASES.items()}}
        save_and_publish(args, results, render_sections, DOCS)
        print(render_profile(results))
        return
    model_args: tuple[str, ...] = ()
    if args.quick:
        cases, pairs, reps, model = [("science", "lightning")], PAIRS[1:], 1, "smoke model"
    elif args.model == "125m":
        cases = [("nlp", front_end) for front_end in FRONT_ENDS]
        pairs, reps, model, model_args = PAIRS, args.reps, MODEL_LABEL["125m"], NLP_125M
    else:
        cases = [(recipe, front_end) for recipe in RECIPES for front_end in FRONT_ENDS]
        pairs, reps, model = PAIRS, args.reps, MODEL_LABEL["default"]
    with work_folder(args.work_dir, "zr-peer-") as work:
        if args.model == "125m":
            model_args += (f"tokenizer={shared_tokenizer(work / 'tokenizer-125m')}",)
        skipped: dict[str, str] = {}  # recipe -> why it did not run (none now: every recipe here runs both)
        rows = measure(cases, pairs, reps, args.steps, work, args.quick, args.lock, model_args)
    results = {"reps": reps, "steps": args.steps, "warmup": WARMUP, "model": model, "rows": rows, "skipped": skipped}
    if args.model == "125m":
        results["mode"] = "125m"
    save_and_publish(args, results, render_sections, DOCS)
    print(next(iter(render_sections({"results": results}).values())))


if __name__ == "__main__":
    main()
