"""Probe: run each candidate preset for a few steps on the user's own model and machine, then recommend one.

The usual advice for choosing a stage is exactly this: before the real run, measure every
stage's throughput and memory on a short run, tabulate, then decide. Each candidate (a preset x an
activation-checkpointing preset) runs as its own subprocess of the recipe - the same command a user
types - so an out-of-memory error in one is a row that says "does not fit", not a crash of the probe::

    zero-recipes probe nlp --candidates ddp,deepspeed_stage_1,deepspeed_stage_2,deepspeed_stage_3 --steps 20

writes ``probe/report.md``, ``probe/report.json``, ``probe/probe.png`` (memory vs throughput, one
point per candidate) and ``probe/recommended.yaml`` (the recipe's config with the chosen preset, which
the recipe accepts as ``--config``). The recommendation walks the ladder, fastest first: stage 2 is the
baseline; a stage-2 throughput more than 5 % below stage 1's is a network suspect; stage 3 only when
stage 2 does not fit or cannot grow the batch; offload last.

``--sequence-parallel N`` (DeepSpeed Ulysses, the NLP recipe's ``sequence_parallel``) runs every candidate with each
sequence split over N of its processes: the key goes into each candidate's config and command and into
``recommended.yaml``, and the report says so. N must divide the processes, the model's heads and ``seq_len`` (checked
before anything runs, as ``zero-recipes estimate --sequence-parallel`` checks them).

The recipe is a name (``nlp``, ``nlp:finetune``) or the folder of a copy made by ``zero-recipes cp``
(:mod:`common.tools.recipes`). Each candidate's config is resolved by the recipe itself (``--describe``) and
written as a YAML the candidate runs with; the report and plot are :mod:`common.tools.probe_report`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.activation import check_preset
from common.comms_log import comms_log_env
from common.describe import RecipeDescription
from common.errors import ConfigError, nearest
from common.machine import local_device_memory
from common.memory_formulas import GUIDE_BANDWIDTH_GBPS, parse_bandwidths
from common.parallel import check_sequence_parallel
from common.presets import ALL_PRESET_NAMES, FSDP2_PRESETS, get_preset, is_fsdp2_name
from common.rundir import free_port
from common.strategy import write_accelerate_files
from common.tools.options import refuse_outside_mode
from common.tools.probe_report import (
    ProbeResult,
    ProbeRow,
    communication_summary,
    fastest,
    fmt_peak,
    fmt_rate,
    offload_timing,
    user_overrides,
    write_config_yaml,
    write_recommended_config,
    write_reports,
    write_reports_partial,
)
from common.tools.recipes import Recipe, describe, describe_runs, find_recipe, recipe_env

# --- candidates and rows ------------------------------------------------------------------------------

DEFAULT_CANDIDATES = ("ddp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload")
NETWORK_SUSPECT_DROP = 0.05  # a rule of thumb: stage 2 more than 5 % slower than stage 1 -> suspect the network
GROW_BATCH_HEADROOM = 0.2  # stage 2 "cannot grow the batch" when its peak leaves less than 20 % of the device
OUT_OF_MEMORY_MARKERS = ("out of memory", "outofmemoryerror", "cannot allocate memory", "killed", "memoryerror")


@dataclass(frozen=True)
class Candidate:
    """One probe run: a preset with an activation-checkpointing preset."""

    preset: str
    activation_checkpointing: str = "none"

    @property
    def name(self) -> str:
        """``deepspeed_stage_2`` or ``deepspeed_stage_3+full``: also the run folder's name."""
        suffix = "" if self.activation_checkpointing == "none" else f"+{self.activation_checkpointing}"
        return self.preset + suffix


def parse_candidates(text: str | None, ac_text: str | None) -> list[Candidate]:
    """``ddp,deepspeed_stage_2`` x ``none,full`` -> candidates, each name checked."""
    presets = [p.strip() for p in (text or ",".join(DEFAULT_CANDIDATES)).split(",") if p.strip()]
    acs = [a.strip() for a in (ac_text or "none").split(",") if a.strip()]
    for preset in presets:
        if preset not in ALL_PRESET_NAMES:  # ZeRO presets and their FSDP2 peers, measured side by side
            known = ", ".join(ALL_PRESET_NAMES)
            raise ConfigError(f"unknown candidate {preset!r}{nearest(preset, ALL_PRESET_NAMES)}; presets: {known}")
    for ac in acs:
        check_preset(ac)
    if not presets or not acs:
        raise ConfigError("--candidates and --activation-checkpointing need at least one name each")
    return [Candidate(p, a) for p in dict.fromkeys(presets) for a in dict.fromkeys(acs)]


def preset_offload(preset: str) -> tuple[int | None, str]:
    """(ZeRO stage, ``none`` / ``optimizer`` / ``params`` / ``nvme``) of a preset: the planner's offload rows. An
    FSDP2 preset has no ZeRO stage (None) and offloads nothing."""
    if is_fsdp2_name(preset):
        return None, "none"
    spec = get_preset(preset)
    zero = spec.get("zero_optimization", {})
    param = zero.get("offload_param") or {}
    if param.get("device") == "nvme":
        return int(spec["stage"]), "nvme"
    offload = "params" if param else "optimizer" if zero.get("offload_optimizer") else "none"
    return int(spec["stage"]), offload


_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*|error: .*|Killed\b.*)$")
# The launcher's own summary of a failed child, which repeats nothing of the cause.
_LAUNCHER_NOISE = ("ChildFailedError", "To enable traceback", "error_file:", "elastic/multiprocessing")


def last_error_line(text: str) -> str:
    """The line of a failed run's output that says why.

    The last exception line (``torch.OutOfMemoryError: ...``, ``RuntimeError: ...``, a recipe's one-line
    ``error: ...``; a ``[rankN]:`` prefix removed), skipping the launcher's summary of a failed child;
    else the last line that mentions an error; else the last line.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        match = _EXCEPTION_LINE.match(line)
        if match and not any(noise in line for noise in _LAUNCHER_NOISE):
            return match.group(1)[:300]
    for line in reversed(lines):
        lowered = line.lower()
        if ("error" in lowered or "out of memory" in lowered) and not lowered.startswith(("warning", "[warning")):
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def _child_env() -> dict[str, str]:
    return recipe_env(MASTER_PORT=str(free_port()))


def candidate_config(
    recipe: Recipe, candidate: Candidate, config: Path | None, overrides: list[str] | None, devices: int
) -> RecipeDescription:
    """The recipe's description of one candidate: the base config + the user's overrides + its presets, on
    ``devices`` processes per node (its DeepSpeed dict is then the one its ranks build)."""
    return describe(recipe, config, candidate_overrides(candidate, overrides, devices))


def candidate_overrides(candidate: Candidate, overrides: list[str] | None, devices: int) -> list[str]:
    """The ``key=value`` overrides of one candidate's run: the user's, then the candidate's preset, activation
    checkpointing and process count."""
    probe_keys = [
        f"preset={candidate.preset}",
        f"activation_checkpointing={candidate.activation_checkpointing}",
        f"devices={devices}",
    ]
    return [*user_overrides(overrides), *probe_keys]


def describe_candidates(
    recipe: Recipe, candidates: list[Candidate], config: Path | None, overrides: list[str] | None, devices: int
) -> None:
    """Every candidate described in one recipe process before the first one runs (:func:`describe_runs`): each
    ``--describe`` on its own would import the recipe again, seconds per candidate. The answers wait in
    :func:`describe`'s cache for :func:`candidate_config`; if that one process fails, each candidate is described
    on its own as it comes, and its own error becomes its row."""
    runs = [(config, candidate_overrides(candidate, overrides, devices)) for candidate in candidates]
    # No answer from the shared process (it timed out or printed no JSON list): asked one by one instead.
    with contextlib.suppress(ConfigError, ValueError, IndexError):
        describe_runs(recipe, runs)


def candidate_command(
    recipe: Recipe,
    backend: str,
    steps: int,
    devices: int,
    out_dir: Path,
    config_file: Path,
    launch_config: Path | None = None,
    sequence_parallel: int = 1,
) -> list[str]:
    """The command a user would type to run one candidate (its config file) for ``steps`` optimizer steps.

    ``launch_config`` is the accelerate YAML for the Accelerate backend (see :func:`accelerate_launch_file`).
    ``sequence_parallel`` > 1 is written on the command line too (the config file holds it already), so the report's
    command shows how the candidate split its sequences.
    """
    script = recipe.backend_script(backend)
    keys = ["--config", str(config_file), f"max_steps={steps}", f"out_dir={out_dir}", "overwrite=true"]
    if sequence_parallel > 1:
        keys.append(f"sequence_parallel={sequence_parallel}")
    if backend == "lightning":
        return [sys.executable, str(script), *keys, f"devices={devices}"]
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        str(devices),
        "--main_process_port",
        str(free_port()),
    ]
    launch += ["--config_file", str(launch_config)] if launch_config else ["--use_deepspeed"]
    return [*launch, str(script), *keys]


# Optimizer steps whose communication a candidate logs: the first (it records stage 3's trace, not counted) and two
# more. Then DeepSpeed's logger is off: it synchronises the device after every collective, and the recipes' median
# step (their throughput) skips the first 5 steps of a run longer than 10.
COMMS_LOG_STEPS = 3


def with_comms_log(command: list[str], folder: Path) -> list[str]:
    """``command`` under ``env``, with DeepSpeed's communication log of each rank's first steps going to ``folder``
    (common.comms_log): visible in the report's command."""
    variables = comms_log_env(folder, COMMS_LOG_STEPS)
    return ["env", *(f"{name}={value}" for name, value in variables.items()), *command]


def accelerate_launch_file(run: RecipeDescription, devices: int, folder: Path) -> Path:
    """``accelerate.yaml`` + ``ds_config.json`` for one candidate: the DeepSpeed dict its recipe described.

    The recipe's shipped accelerate.yaml is its default preset's (``zero3_init_flag`` follows the stage, and
    its JSON path is relative to the repository root); each candidate gets its own, as
    ``zero-recipes config PRESET --format accelerate`` would write it.
    """
    folder.mkdir(parents=True, exist_ok=True)
    return write_accelerate_files(run.ds_config, folder.resolve(), num_processes=devices)


Runner = Callable[[list[str], Path, float], tuple[int, str]]


def run_subprocess(command: list[str], log_path: Path, timeout_s: float) -> tuple[int, str]:
    """Run ``command`` in its own process group (its ranks die with it), output to ``log_path``.

    It runs in the current directory, so relative paths in ``--set`` values mean what the user typed.

    Returns (exit code, log text). A timeout kills the group and returns code 124. Ctrl-C in the probe
    kills the group and re-raises, so a stopped probe leaves no rank behind.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=_child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            log.write(f"\nzero-recipes probe: timed out after {timeout_s:.0f} s\n")
            code = 124
        except BaseException:  # KeyboardInterrupt: stop the candidate's ranks, then let the probe stop
            _kill_group(proc)
            raise
    return code, log_path.read_text(errors="replace")


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def measure(candidate: Candidate, out_dir: Path, code: int, log_text: str, command: list[str], log: Path) -> ProbeRow:
    """A row from a finished candidate: its ``summary.json``, or the reason it failed."""
    stage, offload = preset_offload(candidate.preset)
    row = ProbeRow(
        candidate=candidate.name,
        preset=candidate.preset,
        activation_checkpointing=candidate.activation_checkpointing,
        zero_stage=stage,
        offload=offload,
        status="ok",
        out_dir=str(out_dir),
        log=str(log),
        command=command,
    )
    summary_path = out_dir / "summary.json"
    if code != 0 or not summary_path.is_file():
        reason = last_error_line(log_text) if code != 0 else "finished without summary.json"
        if code in (-9, 137):
            reason = f"killed (signal 9: the host ran out of memory?) {reason}"
        row.status = f"failed: {reason}"
        row.out_of_memory = any(m in log_text.lower()[-20000:] for m in OUT_OF_MEMORY_MARKERS) or code in (-9, 137)
        return row
    summary = json.loads(summary_path.read_text())
    rate = summary.get("throughput") or {}
    row.throughput = rate.get("value") if isinstance(rate, dict) else rate
    row.throughput_unit = rate.get("unit") if isinstance(rate, dict) else None
    row.peak_memory_bytes = summary.get("peak_memory_bytes")
    row.model_state_bytes_per_rank = summary.get("model_state_bytes_per_rank")
    row.wall_time_s = summary.get("wall_time_s")
    row.world_size = summary.get("world_size")
    row.memory_kind = summary.get("memory_kind")
    row.zero_stage = None if is_fsdp2_name(candidate.preset) else summary.get("zero_stage", stage)
    row.step_time_s = summary.get("median_step_s")
    return row


# --- recommendation -----------------------------------------------------------------------------------


def recommend(rows: list[ProbeRow], device_memory_bytes: float | None) -> dict[str, Any]:
    """The ladder over measured rows: stage 2 is the baseline, stage 3 only when needed, offload last.

    - Stage 2 ran: it is the answer, unless its throughput is more than 5 % below the fastest stage 0/1
      row (then the network is the suspect: the faster lower stage is recommended until it is checked),
      or its peak memory leaves under 20 % of the device (it cannot grow the batch) and stage 3 ran.
    - Stage 2 failed: the fastest stage 3 row; failing that the offload rows, optimizer offload first.
    - Stage 2 not measured: the lowest stage that ran (the ladder is climbed from the bottom).
    Among rows of one rung (several presets or checkpointing presets) the fastest wins.

    FSDP2 candidates are not on the ladder: each is compared with its ZeRO counterpart when both ran (``peers``);
    one is chosen only when no ZeRO candidate ran.
    """
    peers = peer_comparisons(rows)
    peer_text = "".join(f"; {p['text']}" for p in peers)
    fsdp2_ok = [r for r in rows if r.ok and is_fsdp2_name(r.preset)]
    rows = [r for r in rows if not is_fsdp2_name(r.preset)]
    ok = [r for r in rows if r.ok]
    if not ok and fsdp2_ok:
        chosen = fastest(fsdp2_ok)
        return {
            "candidate": chosen.candidate,
            "preset": chosen.preset,
            "activation_checkpointing": chosen.activation_checkpointing,
            "zero_stage": None,
            "offload": "none",
            "network_suspect": False,
            "reason": f"no ZeRO candidate ran; {chosen.candidate} is the fastest FSDP2 one ({fmt_peak(chosen)} peak)",
            "peers": peers,
        }
    if not ok:
        return {
            "candidate": None,
            "network_suspect": False,
            "reason": "no candidate ran: see each row's error; try activation checkpointing (--activation-"
            "checkpointing full), a smaller micro batch, or the offload presets",
            "peers": peers,
        }
    on_device = [r for r in ok if r.offload == "none"]
    by_stage = {s: [r for r in on_device if r.zero_stage == s] for s in range(4)}
    lower = by_stage[0] + by_stage[1]
    stage2_rows = [r for r in rows if r.zero_stage == 2 and r.offload == "none"]
    network_suspect = False
    if by_stage[2]:
        chosen = fastest(by_stage[2])
        reason = f"stage 2 is the usual baseline and it fits ({fmt_peak(chosen)} peak per rank)"
        if lower:
            ref = fastest(lower)
            drop = 1 - (chosen.throughput or 0) / ref.throughput if ref.throughput else 0.0
            if drop > NETWORK_SUSPECT_DROP:
                network_suspect = True
                reason = (
                    f"stage 2 runs {drop:.0%} slower than {ref.candidate} (more than 5 %): suspect "
                    f"the network first (interconnect, bucket sizes); {ref.candidate} fits and is faster until "
                    "then"
                )
                chosen = ref
            elif drop > 0:
                reason += f", {drop:.0%} below {ref.candidate}'s throughput (up to 5 % is expected)"
            else:
                reason += f", and as fast as {ref.candidate} or faster ({1 - drop:.2f}x)"
        tight = (
            device_memory_bytes
            and chosen.peak_memory_bytes
            and (chosen.peak_memory_bytes > (1 - GROW_BATCH_HEADROOM) * device_memory_bytes)
        )
        if tight and by_stage[3] and not network_suspect:
            stage3 = fastest(by_stage[3])
            reason = (
                f"stage 2 fits but leaves under {GROW_BATCH_HEADROOM:.0%} of the device "
                f"({fmt_peak(chosen)} of {device_memory_bytes / 1e9:.1f} GB): it cannot grow the batch, so stage 3 "
                f"({fmt_peak(stage3)} peak)"
            )
            chosen = stage3
    elif stage2_rows:  # measured, and none ran
        why = stage2_rows[0].status.removeprefix("failed: ")
        if by_stage[3]:
            chosen = fastest(by_stage[3])
            reason = (
                f"stage 2 does not fit ({why}); stage 3 shards the parameters too and fits ({fmt_peak(chosen)} peak)"
            )
        elif lower:
            chosen = fastest(lower)
            reason = f"stage 2 failed ({why}) while {chosen.candidate} ran: look at stage 2's log"
        else:
            chosen = _offload_choice(ok)
            reason = f"nothing fits on the device alone (stage 2: {why}); offload is the last rung: {chosen.candidate}"
    elif on_device:
        chosen = min(on_device, key=lambda r: (r.zero_stage or 0, -(r.throughput or 0)))
        reason = (
            f"the lowest stage that ran is {chosen.candidate}; stage 2, the usual baseline, was not measured "
            "(add deepspeed_stage_2 to --candidates)"
        )
    else:
        chosen = _offload_choice(ok)
        reason = f"only offload candidates ran: {chosen.candidate} (offload is the last rung)"
    if chosen.activation_checkpointing != "none":
        reason += f"; with {chosen.activation_checkpointing!r} activation checkpointing"
    return {
        "candidate": chosen.candidate,
        "preset": chosen.preset,
        "activation_checkpointing": chosen.activation_checkpointing,
        "zero_stage": chosen.zero_stage,
        "offload": chosen.offload,
        "network_suspect": network_suspect,
        "reason": reason + peer_text,
        "peers": peers,
    }


def peer_comparisons(rows: list[ProbeRow]) -> list[dict[str, Any]]:
    """Each FSDP2 candidate that ran beside its ZeRO counterpart (same checkpointing) when that ran too: throughput
    and peak memory as ZeRO / FSDP2, measured in this probe."""
    ran = {(r.preset, r.activation_checkpointing): r for r in rows if r.ok}
    peers = []
    for (preset, ac), fsdp2 in ran.items():
        if not is_fsdp2_name(preset):
            continue
        zero = ran.get((FSDP2_PRESETS[preset]["counterpart"], ac))
        if zero is None or not (fsdp2.throughput and fsdp2.peak_memory_bytes and zero.peak_memory_bytes):
            continue
        speed = (zero.throughput or 0.0) / fsdp2.throughput
        memory = zero.peak_memory_bytes / fsdp2.peak_memory_bytes
        peers.append(
            {
                "fsdp2": fsdp2.candidate,
                "zero": zero.candidate,
                "throughput_ratio": speed,
                "peak_memory_ratio": memory,
                "text": f"{zero.candidate} ran at {speed:.2f}x {fsdp2.candidate}'s throughput with {memory:.2f}x its "
                "peak memory (measured here)",
            }
        )
    return peers


def _offload_choice(ok: list[ProbeRow]) -> ProbeRow:
    order = {"optimizer": 0, "params": 1}
    return min(ok, key=lambda r: (order.get(r.offload, 2), r.zero_stage or 0, -(r.throughput or 0)))


# --- orchestration ------------------------------------------------------------------------------------


def run_probe(
    recipe: str | Recipe,
    candidates: list[Candidate],
    steps: int = 20,
    devices: int | None = None,
    backend: str = "lightning",
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    out: str | Path = "probe",
    timeout_s: float = 1800.0,
    runner: Runner = run_subprocess,
    progress: bool = True,
    bandwidth_gbps: dict[str, tuple[float, float]] | None = None,
    sequence_parallel: int | None = None,
) -> ProbeResult:
    """Run each candidate, measure it, recommend one, and write the reports.

    Args:
        recipe: a recipe name (``zero-recipes ls``) or the folder of a copy.
        candidates: the presets x checkpointing presets to run.
        steps: optimizer steps per candidate (the recipe's throughput skips the first 5 when it has more than 10).
        devices: processes per candidate (default: the recipe config's, ``0`` meaning every GPU or 2 on a CPU).
        backend: ``lightning`` (``train.py``) or ``accelerate`` (``accelerate launch train_accelerate.py``).
        config: the recipe YAML the candidates start from (default: the recipe's).
        overrides: extra ``key=value`` for every candidate (a smaller corpus, another model).
        out: the report folder; runs go to ``out/runs/<candidate>``, logs to ``out/logs/``.
        timeout_s: per candidate; a candidate past it is a failed row.
        runner: runs one command (tests pass a fake).
        progress: show a progress bar over candidates on stderr.
        bandwidth_gbps: each offload link's GB/s as (low, high) for the planner's time column beside the measured
            offload cost (default: typical ranges; ``--bandwidth`` gives this machine's).
        sequence_parallel: Ulysses ranks per sequence for every candidate (``sequence_parallel=N`` in its config and
            command); None keeps the config's own.

    Returns:
        The result; on Ctrl-C the rows measured so far, with ``interrupted`` set (reports are written either way).
    """
    recipe = find_recipe(recipe) if isinstance(recipe, str) else recipe
    overrides = list(overrides or [])
    config = Path(config).resolve() if config else None  # candidates run with absolute paths
    base = describe(recipe, config, user_overrides(overrides))  # the user's config and overrides, checked first
    if devices is None:
        devices = base.devices_per_node
    if devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {devices}")
    if sequence_parallel is not None:
        if sequence_parallel < 1:
            raise ConfigError(f"--sequence-parallel must be >= 1, got {sequence_parallel}")
        if "sequence_parallel" not in base.config:
            raise ConfigError(
                f"--sequence-parallel: recipe {recipe.name} has no sequence_parallel key (the NLP one has)"
            )
        overrides.append(f"sequence_parallel={sequence_parallel}")  # every candidate and recommended.yaml
    sp = int(base.config.get("sequence_parallel") or 1) if sequence_parallel is None else sequence_parallel
    if sp > 1:
        check_sequence_parallel(base.model, sp, seq_len=base.seq_len, attention=base.config.get("attention"))
        if devices % sp:
            raise ConfigError(
                f"--sequence-parallel {sp} does not divide the {devices} processes per candidate: each sequence is "
                f"split over {sp} of them; choose --devices a multiple of {sp}"
            )
    script = recipe.backend_script(backend)
    if not script.is_file():
        raise ConfigError(f"recipe {recipe.name} has no {script.name} for the {backend} backend")
    out = Path(out)
    device_memory, label = local_device_memory(devices)
    result = ProbeResult(
        recipe=recipe.name,
        backend=backend,
        devices=devices,
        steps=steps,
        config=str(config or "the recipe's default"),
        device_memory_bytes=device_memory,
        device_memory_label=label,
        script=recipe.shown_script(backend),
        sequence_parallel=sp,
    )
    bar = tqdm(candidates, desc="probe", unit="candidate", disable=not progress, file=sys.stderr)
    try:
        describe_candidates(recipe, candidates, config, overrides, devices)
        for candidate in bar:
            bar.set_postfix_str(candidate.name)
            run_dir = (out / "runs" / candidate.name).resolve()
            log = (out / "logs" / f"{candidate.name}.log").resolve()
            command: list[str] = []
            try:
                run = candidate_config(recipe, candidate, config, overrides, devices)
                cand_file = write_config_yaml(
                    run.config,
                    (out / "configs" / f"{candidate.name}.yaml").resolve(),
                    [f"zero-recipes probe: {candidate.name}"],
                )
                launch_file = None
                if backend == "accelerate":
                    launch_file = accelerate_launch_file(run, devices, out / "launch" / candidate.name)
            except ConfigError as exc:  # the candidate does not resolve for this recipe: a failed row
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(f"error: {exc}\n")
                code, text = 2, log.read_text()
            else:
                comms = (out / "comms" / candidate.name).resolve()
                shutil.rmtree(comms, ignore_errors=True)  # a rerun's log, not the last one's
                command = candidate_command(recipe, backend, steps, devices, run_dir, cand_file, launch_file, sp)
                command = with_comms_log(command, comms)
                code, text = runner(command, log, timeout_s)
            row = measure(candidate, run_dir, code, text, command, log)
            if command and row.ok:
                row.communication = communication_summary(comms, run)
            result.rows.append(row)
            bar.write(
                f"  {row.candidate}: {row.status if not row.ok else fmt_rate(row) + ', ' + fmt_peak(row)}",
                file=sys.stderr,
            )
            write_reports_partial(result, out)
    except KeyboardInterrupt:
        result.interrupted = True
        bar.write("probe: interrupted; keeping the rows measured so far", file=sys.stderr)
    finally:
        bar.close()
    result.offload_timing = offload_timing(
        result.rows,
        base.model.num_params,
        world_size=devices,
        ranks_per_node=devices,
        precision=str(base.config.get("precision", "bf16")),
        bandwidth_gbps=bandwidth_gbps or dict(GUIDE_BANDWIDTH_GBPS),
    )
    result.recommendation = recommend(result.rows, device_memory)
    config_path = write_recommended_config(result, config, overrides, out / "recommended.yaml")
    result.recommended_config = str(config_path) if config_path else None
    write_reports(result, out)
    return result


# --- the `zero-recipes probe` command -----------------------------------------------------------------


def register(sub: Any) -> None:
    """Add ``zero-recipes probe`` to the CLI's subparsers."""
    p = sub.add_parser(
        "probe",
        help="run each ZeRO preset a few steps on your model and machine, then recommend one",
        description="Runs each candidate preset as a subprocess of the recipe, measures peak memory, model-state "
        "bytes and throughput per rank, writes probe/report.md, report.json, probe.png and recommended.yaml.",
    )
    p.add_argument("recipe", help="recipe name (zero-recipes ls) or the folder of a copy")
    p.add_argument("--config", default=None, help="the recipe YAML to start from (default: the recipe's)")
    p.add_argument(
        "--candidates", default=None, help=f"comma-separated presets (default: {','.join(DEFAULT_CANDIDATES)})"
    )
    p.add_argument(
        "--activation-checkpointing",
        default="none",
        help="comma-separated checkpointing presets, each crossed with every candidate (default: none)",
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per candidate (default 20)")
    p.add_argument("--devices", type=int, default=None, help="processes per candidate (default: the config's)")
    p.add_argument("--backend", choices=("lightning", "accelerate"), default="lightning")
    p.add_argument("--out", default="probe", help="report folder (default: probe/)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per candidate (default 1800)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe config override for every candidate, e.g. --set max_train_tokens=200000",
    )
    p.add_argument(
        "--bandwidth",
        action="append",
        default=[],
        metavar="LINK=GB/s",
        help="a measured bandwidth for the planner's offload time beside the measured one, e.g. nvme=1.5 "
        "(bench/nvme_io.py measures a disk; default: typical ranges)",
    )
    p.add_argument(
        "--sequence-parallel",
        type=int,
        default=None,
        help="Ulysses: processes splitting each sequence, for every candidate (the recipe's sequence_parallel; "
        "must divide --devices, the heads and seq_len; default: the config's)",
    )
    p.set_defaults(func=cmd_probe)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_probe(args: Any) -> int:
    """``zero-recipes probe``: run, report, recommend; exit 130 when interrupted."""
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    candidates = parse_candidates(args.candidates, args.activation_checkpointing)
    if all(preset_offload(c.preset)[1] == "none" for c in candidates):  # only offload rows get the planner's time
        refuse_outside_mode(args, {"bandwidth": "--bandwidth"}, "offload candidates", "candidates without offload")
    signal.signal(signal.SIGTERM, _interrupt)  # a terminated probe stops its candidate's ranks too
    result = run_probe(
        args.recipe,
        candidates,
        steps=args.steps,
        devices=args.devices,
        backend=args.backend,
        config=args.config,
        overrides=args.set,
        out=args.out,
        timeout_s=args.timeout,
        bandwidth_gbps=parse_bandwidths(args.bandwidth),
        sequence_parallel=args.sequence_parallel,
    )
    rec = result.recommendation
    out = Path(args.out)
    print(f"recommended: {rec.get('candidate') or 'none'} — {rec['reason']}")
    if result.recommended_config:
        print(f"config: {result.recommended_config}")
    print(f"report: {out / 'report.md'}, {out / 'report.json'}, {out / 'probe.png'}")
    return 130 if result.interrupted else 0
