"""Probe: run each candidate preset for a few steps on the user's own model and machine, then recommend one.

Guide 1 (5.3, and its closing advice) asks for exactly this: before the real run, measure every
stage's throughput and memory on a short run, tabulate, then decide. Each candidate (a preset x an
activation-checkpointing preset) runs as its own subprocess of the recipe - the same command a user
types - so an out-of-memory error in one is a row that says "does not fit", not a crash of the probe::

    zero-recipes probe nlp --candidates ddp,deepspeed_stage_1,deepspeed_stage_2,deepspeed_stage_3 --steps 20

writes ``probe/report.md``, ``probe/report.json``, ``probe/probe.png`` (memory vs throughput, one
point per candidate) and ``probe/recommended.yaml`` (the recipe's config with the chosen preset, which
the recipe accepts as ``--config``). The recommendation follows guide 1's ladder: stage 2 is the
baseline; a stage-2 throughput more than 5 % below stage 1's is a network suspect; stage 3 only when
stage 2 does not fit or cannot grow the batch; offload last.

The first half of this module reads recipes (their config class, world size and model facts); the
estimator and the linter use it too. Recipes are found by path (``recipes/<name>/recipe_config.py``)
at run time: ``common`` has no import-time dependency on any recipe or domain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from common.errors import ConfigError, nearest

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "recipes"

# --- reading recipes ----------------------------------------------------------------------------------


def recipe_names() -> list[str]:
    """Recipes under ``recipes/`` (folders with a ``train.py``)."""
    if not RECIPES_DIR.is_dir():
        return []
    return sorted(p.name for p in RECIPES_DIR.iterdir() if (p / "train.py").is_file())


def recipe_dir(name: str) -> Path:
    """``recipes/<name>``, or a ConfigError naming the nearest recipe (``nlp:finetune`` is in ``recipes/nlp``)."""
    folder = RECIPES_DIR / name.partition(":")[0]
    if not (folder / "recipe_config.py").is_file():
        names = recipe_names()
        raise ConfigError(f"unknown recipe {name!r}{nearest(name, names)}; recipes: {', '.join(names) or 'none'}")
    return folder


_MODULES: dict[str, ModuleType] = {}


def recipe_config_file(name: str) -> Path:
    """The config module of a recipe: ``recipes/nlp/recipe_config.py`` for ``nlp``, and for a second entry
    point that shares the folder, ``recipes/nlp/finetune_config.py`` for ``nlp:finetune``."""
    entry = name.partition(":")[2]
    path = recipe_dir(name) / (f"{entry}_config.py" if entry else "recipe_config.py")
    if not path.is_file():
        raise ConfigError(f"unknown recipe {name!r}: {path} does not exist")
    return path


def load_recipe_module(name: str) -> ModuleType:
    """Import ``recipes/<name>/recipe_config.py`` (its folder goes on ``sys.path``, as the recipe scripts do)."""
    if name in _MODULES:
        return _MODULES[name]
    path = recipe_config_file(name)
    folder = path.parent
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    module_name = "zero_recipes_recipe_" + name.replace(":", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    _MODULES[name] = module
    return module


def recipe_config_class(module: ModuleType) -> type:
    """The recipe's config dataclass: the one defined in ``module`` with ``preset`` and ``max_steps`` fields."""
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and dataclasses.is_dataclass(value)
            and value.__module__ == module.__name__
            and {"preset", "max_steps"} <= {f.name for f in dataclasses.fields(value)}
        ):
            return value
    raise ConfigError(f"{module.__file__}: no config dataclass with 'preset' and 'max_steps' fields")


def default_config_path(name: str) -> Path:
    """The recipe's default YAML: ``DEFAULT_CONFIG`` of its module, else ``configs/tiny_cpu.yaml``."""
    module = load_recipe_module(name)
    default = getattr(module, "DEFAULT_CONFIG", None)
    return Path(default) if default else recipe_dir(name) / "configs" / "tiny_cpu.yaml"


def load_recipe_config(
    name: str, config_path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> tuple[ModuleType, Any]:
    """(recipe module, config instance) for ``recipes/<name>`` with its YAML and ``key=value`` overrides."""
    from common.config import load_config

    module = load_recipe_module(name)
    path = Path(config_path) if config_path else default_config_path(name)
    return module, load_config(recipe_config_class(module), path if path.is_file() else None, overrides)


def local_devices() -> int:
    """What ``devices: 0`` means here: every GPU, or 2 processes on a CPU (recipe contract)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def recipe_world(cfg: Any) -> tuple[int, int]:
    """(devices per node, nodes) of a recipe config; ``devices: 0`` is resolved on this machine."""
    devices = int(getattr(cfg, "devices", 1) or 0)
    return (devices or local_devices()), int(getattr(cfg, "num_nodes", 1) or 1)


def _positional_arity(fn: Callable[..., Any]) -> int:
    params = inspect.signature(fn).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def recipe_model_facts(module: ModuleType, cfg: Any) -> Any:
    """:class:`common.memory_formulas.ModelFacts` of the recipe's model, without data and without memory.

    In order: the recipe's ``model_facts(cfg) -> dict`` (keys of ModelFacts) when it defines one; its
    ``model_config(cfg, tokenizer=None)`` (a transformers config, built on the ``meta`` device); its
    ``build_model(cfg)`` called on the ``meta`` device. A transformers config supplies the shape for the
    activation estimate; other models get parameter counts only.
    """
    import torch

    from common.memory_formulas import ModelFacts, count_module, facts_from_model_config

    name = module.__name__.removeprefix("zero_recipes_recipe_")
    hook = getattr(module, "model_facts", None)
    if callable(hook):
        facts = hook(cfg)
        return facts if isinstance(facts, ModelFacts) else ModelFacts(**facts)
    model_config = getattr(module, "model_config", None)
    if callable(model_config):
        return facts_from_model_config(model_config(cfg, None), f"recipe {name}")
    build = getattr(module, "build_model", None)
    if not callable(build) or _positional_arity(build) != 1:
        raise ConfigError(
            f"{module.__file__}: defines none of model_facts(cfg), model_config(cfg, tokenizer), build_model(cfg)"
        )
    with torch.device("meta"):
        model = build(cfg)
    total, largest = count_module(model)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "width", None)
    return ModelFacts(
        num_params=total,
        largest_layer_params=largest,
        architecture=type(model).__name__,
        hidden_size=hidden if isinstance(hidden, int) else None,
        source=f"recipe {name} ({type(model).__name__}, counted on the meta device)",
    )


def recipe_ds_config(module: ModuleType, cfg: Any, world_size: int, hidden_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed dict the recipe will run: its ``resolve_ds_config``, else the factory's from the config.

    A recipe's ``resolve_ds_config`` takes ``(cfg, world_size)`` or ``(cfg, world_size, hidden_size)``.
    """
    resolve = getattr(module, "resolve_ds_config", None)
    if callable(resolve):
        if _positional_arity(resolve) >= 3:
            if hidden_size is None and callable(getattr(module, "hidden_size", None)):
                hidden_size = module.hidden_size(cfg)
            return resolve(cfg, world_size, hidden_size)
        return resolve(cfg, world_size)
    from common.config import parse_overrides
    from common.strategy import RunFacts, resolve_deepspeed_config

    facts = RunFacts(
        world_size=world_size,
        micro_batch_size=getattr(cfg, "micro_batch_size", 1),
        grad_accum=getattr(cfg, "grad_accum", 1),
        precision=getattr(cfg, "precision", None),
        hidden_size=hidden_size,
        gradient_clipping=getattr(cfg, "gradient_clipping", 1.0),
    )
    return resolve_deepspeed_config(cfg.preset, facts, parse_overrides(getattr(cfg, "ds_overrides", [])))


# --- candidates and rows ------------------------------------------------------------------------------

DEFAULT_CANDIDATES = ("ddp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload")
NETWORK_SUSPECT_DROP = 0.05  # guide 1, 5.3: stage 2 more than 5 % slower than stage 1 -> suspect the network
GROW_BATCH_HEADROOM = 0.2  # stage 2 "cannot grow the batch" when its peak leaves less than 20 % of the device
OUT_OF_MEMORY_MARKERS = ("out of memory", "outofmemoryerror", "cannot allocate memory", "killed", "memoryerror")
# Keys the probe sets on every candidate; the recommended config takes them from the base config instead.
PROBE_KEYS = ("preset", "activation_checkpointing", "max_steps", "out_dir", "overwrite", "resume", "devices")


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


@dataclass
class ProbeRow:
    """What one candidate measured (per rank, rank 0's process), or why it did not run."""

    candidate: str
    preset: str
    activation_checkpointing: str
    zero_stage: int | None
    offload: str
    status: str  # "ok", "failed: <last error line>", "interrupted"
    out_of_memory: bool = False
    peak_memory_bytes: int | None = None
    model_state_bytes_per_rank: int | None = None
    throughput: float | None = None
    throughput_unit: str | None = None
    step_time_s: float | None = None
    wall_time_s: float | None = None
    world_size: int | None = None
    memory_kind: str | None = None
    out_dir: str = ""
    log: str = ""
    command: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the candidate ran to the end."""
        return self.status == "ok"


def parse_candidates(text: str | None, ac_text: str | None) -> list[Candidate]:
    """``ddp,deepspeed_stage_2`` x ``none,full`` -> candidates, each name checked."""
    from common.activation import check_preset
    from common.presets import PRESET_NAMES

    presets = [p.strip() for p in (text or ",".join(DEFAULT_CANDIDATES)).split(",") if p.strip()]
    acs = [a.strip() for a in (ac_text or "none").split(",") if a.strip()]
    for preset in presets:
        if preset not in PRESET_NAMES:
            raise ConfigError(
                f"unknown candidate {preset!r}{nearest(preset, PRESET_NAMES)}; presets: {', '.join(PRESET_NAMES)}"
            )
    for ac in acs:
        check_preset(ac)
    if not presets or not acs:
        raise ConfigError("--candidates and --activation-checkpointing need at least one name each")
    return [Candidate(p, a) for p in dict.fromkeys(presets) for a in dict.fromkeys(acs)]


def preset_offload(preset: str) -> tuple[int, str]:
    """(ZeRO stage, ``none`` / ``optimizer`` / ``params``) of a preset."""
    from common.presets import get_preset

    spec = get_preset(preset)
    zero = spec.get("zero_optimization", {})
    offload = "params" if zero.get("offload_param") else "optimizer" if zero.get("offload_optimizer") else "none"
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        env.pop(key, None)
    env["MASTER_PORT"] = str(_free_port())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def user_overrides(overrides: list[str] | None) -> list[str]:
    """The user's ``key=value`` overrides without the keys the probe sets on each candidate."""
    return [o for o in overrides or [] if o.partition("=")[0].strip() not in PROBE_KEYS]


def candidate_config(
    recipe: str, candidate: Candidate, config: Path | None, overrides: list[str] | None
) -> tuple[ModuleType, Any]:
    """(recipe module, config) of one candidate: the base config + the user's overrides + its presets."""
    from common.config import parse_overrides

    values = parse_overrides(user_overrides(overrides))
    values.update(preset=candidate.preset, activation_checkpointing=candidate.activation_checkpointing)
    return load_recipe_config(recipe, config, values)


def write_candidate_config(cfg: Any, path: Path, header: str) -> Path:
    """The candidate's full config as YAML: the recipe reads it with ``--config``.

    A file, not ``key=value`` overrides: on the command line ``activation_checkpointing=none`` would be
    read as null (``common.config.parse_value``), while YAML keeps ``none`` a string.
    """
    from common.config import dump_yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {header}\n" + dump_yaml(config_values(cfg)))
    return path


def config_values(cfg: Any) -> dict[str, Any]:
    """A recipe config's init fields as a plain dict: what its YAML may hold."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def candidate_command(
    recipe: str,
    backend: str,
    steps: int,
    devices: int,
    out_dir: Path,
    config_file: Path,
    launch_config: Path | None = None,
) -> list[str]:
    """The command a user would type to run one candidate (its config file) for ``steps`` optimizer steps.

    ``launch_config`` is the accelerate YAML for the Accelerate backend (see :func:`accelerate_launch_file`).
    """
    folder = recipe_dir(recipe)
    keys = ["--config", str(config_file), f"max_steps={steps}", f"out_dir={out_dir}", "overwrite=true"]
    if backend == "lightning":
        return [sys.executable, str(folder / "train.py"), *keys, f"devices={devices}"]
    if backend == "accelerate":
        launch = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--num_processes",
            str(devices),
            "--main_process_port",
            str(_free_port()),
        ]
        yaml_file = launch_config or folder / "accelerate.yaml"
        launch += ["--config_file", str(yaml_file)] if yaml_file.is_file() else ["--use_deepspeed"]
        return [*launch, str(folder / "train_accelerate.py"), *keys]
    raise ConfigError(
        f"backend must be lightning or accelerate, got {backend!r}{nearest(backend, ['lightning', 'accelerate'])}"
    )


def accelerate_launch_file(module: ModuleType, cfg: Any, devices: int, folder: Path) -> Path:
    """``accelerate.yaml`` + ``ds_config.json`` for one candidate: the factory's files for its preset.

    The recipe's shipped accelerate.yaml is its default preset's (``zero3_init_flag`` follows the stage, and
    its JSON path is relative to the repository root); each candidate gets its own, as
    ``zero-recipes config PRESET --format accelerate`` would write it.
    """
    from common.strategy import write_accelerate_files

    world = devices * recipe_world(cfg)[1]
    facts = None
    with contextlib.suppress(Exception):  # hidden size unknown: the recipe's own resolver may still know it
        facts = recipe_model_facts(module, cfg)
    ds_config = recipe_ds_config(module, cfg, world, facts.hidden_size if facts else None)
    folder.mkdir(parents=True, exist_ok=True)
    return write_accelerate_files(ds_config, folder.resolve(), num_processes=devices)


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
    row.zero_stage = summary.get("zero_stage", stage)
    row.step_time_s = summary.get("median_step_s")
    return row


# --- recommendation -----------------------------------------------------------------------------------


def _fastest(rows: list[ProbeRow]) -> ProbeRow:
    return max(rows, key=lambda r: r.throughput or 0.0)


def recommend(rows: list[ProbeRow], device_memory_bytes: float | None) -> dict[str, Any]:
    """Guide 1's ladder (5.3) over measured rows: stage 2 is the baseline, stage 3 only when needed, offload last.

    - Stage 2 ran: it is the answer, unless its throughput is more than 5 % below the fastest stage 0/1
      row (then the network is the suspect: the faster lower stage is recommended until it is checked),
      or its peak memory leaves under 20 % of the device (it cannot grow the batch) and stage 3 ran.
    - Stage 2 failed: the fastest stage 3 row; failing that the offload rows, optimizer offload first.
    - Stage 2 not measured: the lowest stage that ran (the ladder is climbed from the bottom).
    Among rows of one rung (several presets or checkpointing presets) the fastest wins.
    """
    ok = [r for r in rows if r.ok]
    if not ok:
        return {
            "candidate": None,
            "network_suspect": False,
            "reason": "no candidate ran: see each row's error; try activation checkpointing (--activation-"
            "checkpointing full), a smaller micro batch, or the offload presets",
        }
    on_device = [r for r in ok if r.offload == "none"]
    by_stage = {s: [r for r in on_device if r.zero_stage == s] for s in range(4)}
    lower = by_stage[0] + by_stage[1]
    stage2_rows = [r for r in rows if r.zero_stage == 2 and r.offload == "none"]
    network_suspect = False
    if by_stage[2]:
        chosen = _fastest(by_stage[2])
        reason = f"stage 2 is the guide's baseline and it fits ({_mem(chosen)} peak per rank)"
        if lower:
            ref = _fastest(lower)
            drop = 1 - (chosen.throughput or 0) / ref.throughput if ref.throughput else 0.0
            if drop > NETWORK_SUSPECT_DROP:
                network_suspect = True
                reason = (
                    f"stage 2 runs {drop:.0%} slower than {ref.candidate} (more than the guide's 5 %): suspect "
                    f"the network first (interconnect, bucket sizes); {ref.candidate} fits and is faster until "
                    "then"
                )
                chosen = ref
            elif drop > 0:
                reason += f", {drop:.0%} below {ref.candidate}'s throughput (the guide allows up to 5 %)"
            else:
                reason += f", and as fast as {ref.candidate} or faster ({1 - drop:.2f}x)"
        tight = (
            device_memory_bytes
            and chosen.peak_memory_bytes
            and (chosen.peak_memory_bytes > (1 - GROW_BATCH_HEADROOM) * device_memory_bytes)
        )
        if tight and by_stage[3] and not network_suspect:
            stage3 = _fastest(by_stage[3])
            reason = (
                f"stage 2 fits but leaves under {GROW_BATCH_HEADROOM:.0%} of the device "
                f"({_mem(chosen)} of {device_memory_bytes / 1e9:.1f} GB): it cannot grow the batch, so stage 3 "
                f"({_mem(stage3)} peak)"
            )
            chosen = stage3
    elif stage2_rows:  # measured, and none ran
        why = stage2_rows[0].status.removeprefix("failed: ")
        if by_stage[3]:
            chosen = _fastest(by_stage[3])
            reason = f"stage 2 does not fit ({why}); stage 3 shards the parameters too and fits ({_mem(chosen)} peak)"
        elif lower:
            chosen = _fastest(lower)
            reason = f"stage 2 failed ({why}) while {chosen.candidate} ran: look at stage 2's log"
        else:
            chosen = _offload_choice(ok)
            reason = f"nothing fits on the device alone (stage 2: {why}); offload is the last rung: {chosen.candidate}"
    elif on_device:
        chosen = min(on_device, key=lambda r: (r.zero_stage or 0, -(r.throughput or 0)))
        reason = (
            f"the lowest stage that ran is {chosen.candidate}; stage 2, the guide's baseline, was not measured "
            "(add deepspeed_stage_2 to --candidates)"
        )
    else:
        chosen = _offload_choice(ok)
        reason = f"only offload candidates ran: {chosen.candidate} (offload is the guide's last rung)"
    if chosen.activation_checkpointing != "none":
        reason += f"; with {chosen.activation_checkpointing!r} activation checkpointing"
    return {
        "candidate": chosen.candidate,
        "preset": chosen.preset,
        "activation_checkpointing": chosen.activation_checkpointing,
        "zero_stage": chosen.zero_stage,
        "offload": chosen.offload,
        "network_suspect": network_suspect,
        "reason": reason,
    }


def _offload_choice(ok: list[ProbeRow]) -> ProbeRow:
    order = {"optimizer": 0, "params": 1}
    return min(ok, key=lambda r: (order.get(r.offload, 2), r.zero_stage or 0, -(r.throughput or 0)))


def _mem(row: ProbeRow) -> str:
    return f"{row.peak_memory_bytes / 1e9:.2f} GB" if row.peak_memory_bytes else "n/a"


# --- reports ------------------------------------------------------------------------------------------


@dataclass
class ProbeResult:
    """Everything the probe writes."""

    recipe: str
    backend: str
    devices: int
    steps: int
    config: str
    rows: list[ProbeRow] = field(default_factory=list)
    recommendation: dict[str, Any] = field(default_factory=dict)
    device_memory_bytes: float | None = None
    device_memory_label: str = ""
    interrupted: bool = False
    recommended_config: str | None = None

    def to_json(self) -> dict[str, Any]:
        """``report.json``."""
        data = asdict(self)
        data["rows"] = [asdict(r) for r in self.rows]
        return data


def _fmt_rate(row: ProbeRow) -> str:
    if row.throughput is None:
        return "-"
    unit = (row.throughput_unit or "").replace("/device", "")
    return f"{row.throughput:,.0f} {unit}".strip()


def format_report_md(result: ProbeResult) -> str:
    """``report.md``: the recommendation first, then one table row per candidate."""
    rec = result.recommendation
    run = "train.py" if result.backend == "lightning" else "train_accelerate.py"
    lines = [
        f"# zero-recipes probe: {result.recipe}",
        "",
        f"{result.backend}, {result.devices} processes, {result.steps} steps per candidate, config "
        f"`{result.config}`" + (" — **interrupted**: rows measured so far" if result.interrupted else ""),
        "",
    ]
    if rec.get("candidate"):
        lines += [
            f"**Recommended: `{rec['preset']}`** with activation_checkpointing `{rec['activation_checkpointing']}`"
            f" — {rec['reason']}.",
            "",
        ]
        if result.recommended_config:
            lines += [
                f"Config: `{result.recommended_config}` — run it with "
                f"`python recipes/{result.recipe}/{run} --config {result.recommended_config}`.",
                "",
            ]
    else:
        lines += [f"**No recommendation** — {rec.get('reason', 'nothing measured')}.", ""]
    base_rows = [r for r in result.rows if r.ok and r.zero_stage == 2 and r.offload == "none" and r.throughput]
    base = _fastest(base_rows) if base_rows else None
    lines += [
        "| candidate | stage | offload | status | peak memory / rank | model states / rank | throughput / device "
        f"| vs {base.candidate if base else 'stage 2'} | step time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.rows:
        relative = f"{r.throughput / base.throughput:.2f}x" if base and r.throughput else "-"
        status = r.status if r.ok else ("**does not fit** — " if r.out_of_memory else "") + r.status
        peak = f"{r.peak_memory_bytes / 1e6:,.0f} MB" if r.peak_memory_bytes else "-"
        states = f"{r.model_state_bytes_per_rank / 1e6:,.1f} MB" if r.model_state_bytes_per_rank else "-"
        step = f"{r.step_time_s:.3f} s" if r.step_time_s else "-"
        lines.append(
            f"| {r.candidate} | {r.zero_stage} | {r.offload} | {status.replace('|', '/')} | {peak} | "
            f"{states} | {_fmt_rate(r)} | {relative} | {step} |"
        )
    kind = next((r.memory_kind for r in result.rows if r.memory_kind), None)
    lines += [
        "",
        "![peak memory vs throughput](probe.png)",
        "",
        f"Peak memory is {kind or 'the recipe’s peak_memory_bytes'} of rank 0 (on a CPU the process's peak RSS, "
        "interpreter and libraries included); model states are the bytes the DeepSpeed engine holds per rank; "
        "throughput is the recipe's median step after warm-up. Device memory: "
        + (
            f"{result.device_memory_bytes / 1e9:.1f} GB ({result.device_memory_label})."
            if result.device_memory_bytes
            else "unknown."
        ),
        "",
        "Ladder (guide 1, 5.3): stage 2 is the baseline; more than 5 % slower than stage 1 -> suspect the network; "
        "stage 3 only when stage 2 does not fit or cannot grow the batch (under 20 % of the device left); offload "
        "last. Each candidate's output is in its log (`logs/` next to this report).",
    ]
    return "\n".join(lines) + "\n"


def plot_probe(result: ProbeResult, path: Path) -> None:
    """``probe.png``: peak memory per rank (x) against throughput per device (y), one point per candidate.

    Failed candidates sit on the right edge as red crosses ("does not fit"); the recommended one is a
    star; the device's memory, when known and in range, is a dashed line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    ok = [r for r in result.rows if r.ok and r.peak_memory_bytes and r.throughput is not None]
    failed = [r for r in result.rows if not r.ok]
    chosen = result.recommendation.get("candidate")
    xs = [r.peak_memory_bytes / 1e9 for r in ok]
    x_max = max(xs) * 1.25 if xs else 1.0
    colours = {0: "tab:gray", 1: "tab:blue", 2: "tab:green", 3: "tab:purple"}
    for i, r in enumerate(sorted(ok, key=lambda r: (r.peak_memory_bytes, r.throughput))):
        x, y = r.peak_memory_bytes / 1e9, r.throughput
        star = r.candidate == chosen
        offset = (8, 6) if i % 2 == 0 else (8, -13)  # alternate above/below so neighbours do not overlap
        ax.scatter(
            [x],
            [y],
            s=260 if star else 70,
            marker="*" if star else "o",
            color=colours.get(r.zero_stage or 0, "tab:orange") if r.offload == "none" else "tab:orange",
            edgecolor="black" if star else "none",
            zorder=3,
        )
        ax.annotate(
            r.candidate + ("  (recommended)" if star else ""),
            (x, y),
            textcoords="offset points",
            xytext=offset,
            fontsize=8,
            fontweight="bold" if star else "normal",
        )
    y_vals = [r.throughput for r in ok] or [1.0]
    for i, r in enumerate(failed):
        y = min(y_vals) + (max(y_vals) - min(y_vals)) * (i + 1) / (len(failed) + 1) if len(ok) > 1 else y_vals[0]
        ax.scatter([x_max], [y], marker="x", s=80, color="tab:red", zorder=3)
        label = "does not fit" if r.out_of_memory else ("interrupted" if r.status == "interrupted" else "failed")
        ax.annotate(
            f"{r.candidate}: {label}",
            (x_max, y),
            textcoords="offset points",
            xytext=(-8, 6),
            ha="right",
            fontsize=8,
            color="tab:red",
        )
    if result.device_memory_bytes and result.device_memory_bytes / 1e9 <= x_max * 1.5:
        ax.axvline(result.device_memory_bytes / 1e9, linestyle="--", color="tab:red", alpha=0.5)
    from matplotlib.lines import Line2D

    legend = [Line2D([], [], marker="o", linestyle="", color=c, label=f"stage {s}") for s, c in colours.items()]
    legend += [
        Line2D([], [], marker="o", linestyle="", color="tab:orange", label="offload"),
        Line2D([], [], marker="x", linestyle="", color="tab:red", label="failed / does not fit"),
    ]
    ax.legend(handles=legend, loc="lower right", fontsize=8, framealpha=0.8)
    unit = next((r.throughput_unit for r in ok if r.throughput_unit), "per device")
    ax.set_xlabel("peak memory per rank (GB) - left is smaller")
    ax.set_ylabel(f"throughput ({unit}) - up is faster")
    ax.set_xlim(left=0, right=x_max * 1.05)
    ax.set_ylim(bottom=0, top=max(y_vals) * 1.2)
    ax.grid(alpha=0.3)
    title = f"zero-recipes probe: {result.recipe} ({result.backend}, {result.devices} processes)"
    if chosen:
        title += f"\nrecommended: {chosen}"
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_recommended_config(
    result: ProbeResult, base_config: Path | None, overrides: list[str], path: Path
) -> Path | None:
    """The base config + the user's overrides + the chosen preset, as a YAML the recipe loads with ``--config``."""
    from common.config import dump_yaml, parse_overrides

    rec = result.recommendation
    if not rec.get("candidate"):
        return None
    kept = parse_overrides(user_overrides(overrides))
    kept.update(preset=rec["preset"], activation_checkpointing=rec["activation_checkpointing"])
    _, cfg = load_recipe_config(result.recipe, base_config, kept)
    run = "train.py" if result.backend == "lightning" else "train_accelerate.py"
    header = [
        f"# Written by zero-recipes probe: {rec['preset']} with activation_checkpointing "
        f"{rec['activation_checkpointing']}.",
        f"#   python recipes/{result.recipe}/{run} --config {path}",
        "# Why: " + rec["reason"].replace("\n", " "),
        f"# Base config: {base_config or 'the recipe default'}; probe-only keys (max_steps, out_dir) are the base's.",
    ]
    path.write_text("\n".join(header) + "\n" + dump_yaml(config_values(cfg)))
    return path


def write_reports(result: ProbeResult, out: Path) -> None:
    """``report.json``, ``report.md`` and ``probe.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    (out / "report.md").write_text(format_report_md(result))
    plot_probe(result, out / "probe.png")


# --- orchestration ------------------------------------------------------------------------------------


def run_probe(
    recipe: str,
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
) -> ProbeResult:
    """Run each candidate, measure it, recommend one, and write the reports.

    Args:
        recipe: a recipe name (``zero-recipes ls``).
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

    Returns:
        The result; on Ctrl-C the rows measured so far, with ``interrupted`` set (reports are written either way).
    """
    from tqdm import tqdm

    from common.memory_formulas import local_device_memory

    overrides = list(overrides or [])
    config = Path(config).resolve() if config else None  # candidates run with absolute paths
    _, cfg = load_recipe_config(recipe, config, user_overrides(overrides))
    if devices is None:
        devices = recipe_world(cfg)[0]
    if devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {devices}")
    script = recipe_dir(recipe) / ("train.py" if backend == "lightning" else "train_accelerate.py")
    if not script.is_file():
        raise ConfigError(f"recipe {recipe!r} has no {script.name} for the {backend} backend")
    out = Path(out)
    device_memory, label = local_device_memory(devices)
    result = ProbeResult(
        recipe=recipe,
        backend=backend,
        devices=devices,
        steps=steps,
        config=str(config or default_config_path(recipe)),
        device_memory_bytes=device_memory,
        device_memory_label=label,
    )
    bar = tqdm(candidates, desc="probe", unit="candidate", disable=not progress, file=sys.stderr)
    try:
        for candidate in bar:
            bar.set_postfix_str(candidate.name)
            run_dir = (out / "runs" / candidate.name).resolve()
            log = (out / "logs" / f"{candidate.name}.log").resolve()
            command: list[str] = []
            try:
                module, cand_cfg = candidate_config(recipe, candidate, config, overrides)
                cand_file = write_candidate_config(
                    cand_cfg,
                    (out / "configs" / f"{candidate.name}.yaml").resolve(),
                    f"zero-recipes probe: {candidate.name}",
                )
                launch_file = None
                if backend == "accelerate":
                    launch_file = accelerate_launch_file(module, cand_cfg, devices, out / "launch" / candidate.name)
            except ConfigError as exc:  # the candidate does not resolve for this recipe: a failed row
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(f"error: {exc}\n")
                code, text = 2, log.read_text()
            else:
                command = candidate_command(recipe, backend, steps, devices, run_dir, cand_file, launch_file)
                code, text = runner(command, log, timeout_s)
            row = measure(candidate, run_dir, code, text, command, log)
            result.rows.append(row)
            bar.write(
                f"  {row.candidate}: {row.status if not row.ok else _fmt_rate(row) + ', ' + _mem(row)}", file=sys.stderr
            )
            write_reports_partial(result, out)
    except KeyboardInterrupt:
        result.interrupted = True
        bar.write("probe: interrupted; keeping the rows measured so far", file=sys.stderr)
    finally:
        bar.close()
    result.recommendation = recommend(result.rows, device_memory)
    config_path = write_recommended_config(result, config, overrides, out / "recommended.yaml")
    result.recommended_config = str(config_path) if config_path else None
    write_reports(result, out)
    return result


def write_reports_partial(result: ProbeResult, out: Path) -> None:
    """``report.json`` after each candidate, so that a crash of the probe itself keeps the rows measured."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({**result.to_json(), "partial": True}, indent=2) + "\n")


# --- the `zero-recipes probe` command -----------------------------------------------------------------


def register(sub: Any) -> None:
    """Add ``zero-recipes probe`` to the CLI's subparsers."""
    p = sub.add_parser(
        "probe",
        help="run each ZeRO preset a few steps on your model and machine, then recommend one",
        description="Runs each candidate preset as a subprocess of the recipe, measures peak memory, model-state "
        "bytes and throughput per rank, writes probe/report.md, report.json, probe.png and recommended.yaml.",
    )
    p.add_argument("recipe", help="recipe name (zero-recipes ls)")
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
    p.set_defaults(func=cmd_probe)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_probe(args: Any) -> int:
    """``zero-recipes probe``: run, report, recommend; exit 130 when interrupted."""
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    candidates = parse_candidates(args.candidates, args.activation_checkpointing)
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
    )
    rec = result.recommendation
    out = Path(args.out)
    print(f"recommended: {rec.get('candidate') or 'none'} — {rec['reason']}")
    if result.recommended_config:
        print(f"config: {result.recommended_config}")
    print(f"report: {out / 'report.md'}, {out / 'report.json'}, {out / 'probe.png'}")
    return 130 if result.interrupted else 0
