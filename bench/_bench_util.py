"""Shared by the benchmarks: launching a 2-process group per backend, medians, provenance, docs sections."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psutil

from common.metrics import median  # also imported from here by the benches
from common.rundir import free_port
from common.strategy import RunFacts, resolve_deepspeed_config, write_accelerate_files

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks.md"
HEADINGS = {"benchmarks.md": "Benchmarks", "benchmarks_gpu.md": "GPU benchmarks"}


# Versions that decide a benchmark's numbers; "not installed" rather than an error for optional ones.
PROVENANCE_PACKAGES = ("torch", "deepspeed", "lightning", "accelerate", "transformers", "peft")


# What the benches write themselves (results, docs, plots) is not the measured code.
OUTPUTS = [":(exclude)bench/results", ":(exclude)docs"]


def git_commit() -> str:
    """HEAD's hash, with "-dirty" when tracked code differs from it (the figures then came from uncommitted code)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = code_differs_from("HEAD")
    except (OSError, subprocess.CalledProcessError):
        # A copy of a clean checkout without its .git (a machine the tree was sent to): the sender names the commit.
        sent = os.environ.get("ZR_GIT_COMMIT", "")
        if re.fullmatch(r"[0-9a-f]{40}", sent):
            return sent
        return "unknown (not a git checkout)"
    return head + ("-dirty" if dirty else "")


def code_differs_from(revision: str) -> bool:
    """Whether the working tree's code differs from ``revision``'s, results and docs aside (OSError without git)."""
    return bool(
        subprocess.run(
            ["git", "diff", "--quiet", revision, "--", ".", *OUTPUTS], cwd=REPO, capture_output=True
        ).returncode
    )


def code_changed_since(commit: str) -> bool:
    """Whether the working tree's code differs from ``commit``'s (results and docs aside): a commit of docs alone made
    while a bench ran changes nothing it measured."""
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return False  # "-dirty" or no checkout: said already
    try:
        return code_differs_from(commit)
    except OSError:
        return False


def cpu_model() -> str:
    """The processor's name as the kernel reports it (``/proc/cpuinfo``), else Python's guess."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def _sys_block_text(disk: str, name: str) -> str | None:
    """A file of ``/sys/block/DISK/``, stripped; None where the kernel does not provide it (virtual disks)."""
    try:
        return (Path("/sys/block") / disk / name).read_text().strip() or None
    except OSError:
        return None


def disk_facts(path: Path) -> dict:
    """The storage behind ``path``: filesystem, device, the whole disk's model or driver, size and whether the
    kernel calls it rotational. Figures of an I/O bench mean little without the disk they were measured on."""
    path = Path(path).resolve()
    mounts = [m for m in psutil.disk_partitions(all=True) if path.is_relative_to(m.mountpoint)]
    mount = max(mounts, key=lambda m: len(m.mountpoint), default=None)
    facts = {
        "path": str(path),
        "filesystem": mount.fstype if mount else None,
        "device": mount.device if mount else None,
        "disk": None,
        "model": None,
        "size_bytes": None,
        "rotational": None,
    }
    st_dev = path.stat().st_dev
    block = Path(f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}")
    if not block.exists():  # overlay and RAM filesystems have no block device behind them
        return facts
    node = block.resolve()
    disk = node.parent.name if (node / "partition").exists() else node.name  # a partition's disk is its parent
    driver = Path("/sys/block") / disk / "device" / "driver"
    sectors = _sys_block_text(disk, "size")
    rotational = _sys_block_text(disk, "queue/rotational")
    facts.update(
        disk=disk,
        # A virtual disk names no model: its driver (virtio_blk, nvme, ...) says what kind of device it is.
        model=_sys_block_text(disk, "device/model") or (driver.resolve().name if driver.exists() else None),
        size_bytes=int(sectors) * 512 if sectors else None,  # /sys counts 512-byte sectors whatever the disk's own
        rotational=rotational == "1" if rotational else None,
    )
    return facts


def machine_facts(disks: dict[str, Path] | None = None) -> dict:
    """The machine a results file was measured on: CPU model and count, memory, and the disks the bench used.

    The working directory and the temporary-files folder are always recorded (the benches write there by
    default); ``disks`` adds the folders a bench was pointed at (``--path``, ``--work-dir``).
    """
    folders = {"working directory": Path.cwd(), "temporary files": Path(tempfile.gettempdir()), **(disks or {})}
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "disks": {label: disk_facts(folder) for label, folder in folders.items()},
    }


# The commit a bench measures is the one its process started from: a long run's results are written minutes later,
# when HEAD (or the working tree's code) may have moved on.
COMMIT_AT_START = git_commit()


def provenance(argv: list[str] | None = None, disks: dict[str, Path] | None = None) -> dict:
    """Where a results file came from: the command line, the commit the bench started from (with "-dirty", or
    "-changed-during-run" when the code differs from it at the end), date, library versions and the machine."""
    versions = {}
    for name in PROVENANCE_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    argv = sys.argv if argv is None else argv
    return {
        "command": shlex.join(["python", *[str(a) for a in argv]]),
        "git_commit": COMMIT_AT_START + ("-changed-during-run" if code_changed_since(COMMIT_AT_START) else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "machine": machine_facts(disks),
    }


def machine_text(provenance_: dict) -> str:
    """The machine in a section's "Command:" line: cores, and the CPU model and memory where they were recorded."""
    machine = provenance_.get("machine")
    if not machine:  # results written before the machine was recorded
        return f"this machine: {provenance_['cpu_count']} CPU cores, shared"
    cores, memory_gib = f"{machine['cpu_count']} CPU cores ({machine['cpu_model']})", machine["memory_bytes"] / 2**30
    return f"this machine: {cores}, {memory_gib:.0f} GiB memory, shared"


def results_json(value: Any, indent: int = 0) -> str:
    """JSON indented two spaces a level, as ``json.dumps(indent=2)`` writes it, except that a list of plain values (a
    call record, a row of timings) stays on one line: a results file with thousands of them reads line by line and
    stays a fraction of the size."""
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(value, dict) and value:
        # A key that is not a string is written as json writes it (True -> "true"), then quoted.
        keys = [k if isinstance(k, str) else json.dumps(k) for k in value]
        items = [f"{inner}{json.dumps(k)}: {results_json(v, indent + 2)}" for k, v in zip(keys, value.values())]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, (dict, list, tuple)) for v in value):
        return "[\n" + ",\n".join(f"{inner}{results_json(v, indent + 2)}" for v in value) + f"\n{pad}]"
    return json.dumps(value)


def write_results(
    path: Path, results: dict | list, argv: list[str] | None = None, disks: dict[str, Path] | None = None
) -> dict:
    """Write a bench's results file: ``{"provenance": ..., "results": ...}``. The only writer of bench/results/.

    ``disks``: folders the bench measured besides the working directory and the temporary-files folder.
    """
    document = {"provenance": provenance(argv, disks), "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(results_json(document) + "\n")
    tmp.replace(path)  # a crash mid-write leaves the previous results file whole
    return document


def read_results(path: Path) -> tuple[dict, dict | list]:
    """(provenance, results) of a file written by :func:`write_results`; an error names a file without provenance."""
    document = json.loads(path.read_text())
    if not isinstance(document, dict) or "provenance" not in document or "results" not in document:
        raise ValueError(f"{path} was not written by write_results (no provenance): rerun its bench")
    return document["provenance"], document["results"]


def bench_env(threads_per_rank: int | None = 1) -> dict[str, str]:
    """One intra-op thread per rank (on a GPU, ``None``: the launcher's and the libraries' own choice, so that
    DeepSpeedCPUAdam and the data loading use the host's cores), a fresh master port, and the repository importable
    from bench/ scripts."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "MASTER_PORT": str(free_port())}
    if threads_per_rank is not None:
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    return env


KILL_GRACE_S = 10.0  # after SIGTERM, how long a launcher may take to stop its workers before everything is killed


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and every live descendant (torchrun starts each worker in a session of its own, so the
    launcher's process group does not hold them)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def kill_tree(pid: int, grace_s: float = KILL_GRACE_S) -> None:
    """Stop ``pid`` and everything it started: SIGTERM to the process group of each of them (a launcher then stops
    its workers, a worker its own children), then SIGKILL to whatever is left after ``grace_s``.

    The tree is listed before the first signal: a worker whose launcher dies first is re-parented and would no
    longer be found under it.
    """
    tree = process_tree(pid)
    groups = set()
    for process in tree:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(process.pid))
    groups.discard(os.getpgrp())  # never this script's own group (a launch without a session of its own)
    for signal_number in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            with contextlib.suppress(OSError):
                os.killpg(group, signal_number)
        for process in tree:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal_number)
        _, alive = psutil.wait_procs(tree, timeout=grace_s if signal_number == signal.SIGTERM else 5.0)
        if not alive:
            return
        tree = alive


def torchrun_command(nproc: int, port: str | None = None) -> list[str]:
    """torch's own launcher for ``nproc`` ranks on this machine (on ``port``, a free one when None): the script, or
    ``-m`` and a module, and its arguments follow."""
    port = port or str(free_port())
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port]


def launch_command(script: Path, backend: str, preset: str, script_args: list[str], nproc: int, port: str) -> list[str]:
    """The command line that starts ``script`` as ``nproc`` ranks through the backend's own launcher."""
    if backend == "raw":
        return [*torchrun_command(nproc, port), str(script), *script_args]
    if backend == "accelerate":
        cfg_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"zr-bench-acc-{os.getpid()}-{preset}"
        ds = resolve_deepspeed_config(
            preset, RunFacts(world_size=nproc, micro_batch_size=8, precision="bf16", hidden_size=256)
        )
        cfg = write_accelerate_files(ds, cfg_dir, num_processes=nproc)
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(cfg),
            "--main_process_port",
            port,
            str(script),
            *script_args,
        ]
    return [sys.executable, str(script), *script_args]


def run_group(command: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` in a session of its own; past ``timeout`` seconds (or when this script is interrupted) stop it
    with every process it started (:func:`kill_tree`) and raise ``subprocess.TimeoutExpired`` with what it had
    printed by then.

    A launcher killed alone leaves its workers running, holding the GPU for the next run.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env or bench_env(), stdout=out, stderr=err, text=True, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            out.seek(0)
            err.seek(0)
            printed = out.read(), err.read()  # what it printed by its limit (not the launcher's reaction to the kill)
            kill_tree(proc.pid)
            proc.wait()
            raise subprocess.TimeoutExpired(command, timeout, *printed) from None
        except BaseException:  # SIGTERM or Ctrl-C of this script: its launch must not outlive it
            kill_tree(proc.pid)
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read())


def launch_group(
    script: Path,
    backend: str,
    preset: str,
    script_args: list[str],
    nproc: int = 2,
    timeout: float = 900,
    threads_per_rank: int | None = 1,
) -> None:
    """Run ``script`` as a process group of ``nproc`` ranks through the backend's own launcher.

    Past ``timeout`` seconds every process of the launch is killed (:func:`run_group`) and
    ``subprocess.TimeoutExpired`` is raised; a failed launch raises ``RuntimeError`` with the end of its output.
    ``threads_per_rank`` sets ``OMP_NUM_THREADS`` (None: left to the launcher, as on a GPU).
    """
    env = bench_env(threads_per_rank)
    command = launch_command(script, backend, preset, script_args, nproc, env["MASTER_PORT"])
    proc = run_group(command, timeout, env)
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} {preset} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


@contextlib.contextmanager
def work_folder(chosen: str | Path | None, prefix: str) -> Iterator[Path]:
    """The folder a bench's runs write to: ``chosen`` (``--work-dir``: kept afterwards for a look), else a new
    temporary folder named ``prefix...``, removed at the end."""
    if chosen:
        yield Path(chosen)
        return
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as folder:
        yield Path(folder)


def table_head(*columns: str) -> list[str]:
    """The header and rule lines of a Markdown table."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


T = TypeVar("T")


@contextlib.contextmanager
def environment(settings: dict[str, str | None]) -> Iterator[None]:
    """The launched group inherits this process's environment (bench_env copies it): set, then restore."""

    def apply(values: dict[str, str | None]) -> None:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    saved = {name: os.environ.get(name) for name in settings}
    try:
        apply(settings)
        yield
    finally:
        apply(saved)


def rotated(items: tuple[T, ...], by: int) -> tuple[T, ...]:
    """``items`` started at position ``by``: interleaved repetitions rotate the order of what they compare, so that
    neither a load drift on this shared machine nor the position in a repetition favours one of them."""
    by %= len(items)
    return items[by:] + items[:by]


def spread(values: list[float]) -> tuple[float, float]:
    """(min, max) of the repetitions: how far apart interleaved runs landed."""
    return min(values), max(values)


def median_and_range(values: list[float], digits: int = 2) -> str:
    """``median (min-max)`` of the repetitions, as the bench tables print them: ``1.03 (0.98-1.07)``."""
    low, high = spread(values)
    return f"{median(values):.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


MEDIAN_CONFIDENCE = 1 - 2 / 2**5  # what (min, max) of 5 repetitions gives: 93.75 %


def median_interval(values: list[float], confidence: float = MEDIAN_CONFIDENCE) -> tuple[float, float, float]:
    """(low, high, coverage): a distribution-free confidence interval of the median of what ``values`` sample.

    The k-th smallest and k-th largest value hold the median between them unless fewer than k values fall on one
    side of it, which has probability 2 P(Binomial(n, 1/2) < k) for any continuous distribution. The largest k whose
    coverage is still at least ``confidence``: (min, max) over 5 repetitions, the 2nd smallest to the 2nd largest
    over 9 (96.1 %). Below 5 values no k reaches 93.75 %; (min, max) is returned with the coverage it has.
    """
    ordered, n = sorted(values), len(values)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, below) for below in range(k)) / 2**n

    k = 1
    while k + 1 <= n // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def write_section(
    name: str,
    command: str,
    date: str,
    body: str,
    doc: Path = DOC,
    machine: str = "this machine: 2 CPU cores, shared",
) -> None:
    """Replace (or append) section ``name`` of ``doc`` (docs/benchmarks.md by default), keeping the others."""
    doc.parent.mkdir(exist_ok=True)
    heading = HEADINGS.get(doc.name, "Benchmarks")
    header = f"# {heading} (measured here)\n\nEach section says the command that produced it and when.\n"
    text = doc.read_text() if doc.exists() else header
    block = (
        f"<!-- {name}:start -->\n## {name}\n\nCommand: `{command}` ({date}, {machine}).\n\n{body}\n<!-- {name}:end -->"
    )
    pattern = re.compile(rf"<!-- {name}:start -->.*?<!-- {name}:end -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


# Rendering the docs from results files. Every bench with results follows one contract:
#   render_sections(document) -> {section name: Markdown body}, a pure function of
#   document = {"provenance": ..., "results": ...} (load_document), and a --render flag (bench_parser) that
#   rewrites its sections from the results file without measuring (render_from_file). A run publishes what it
#   wrote the same way (publish_document). The "Command: ... (date, ...)" line above each body comes from the
#   document's provenance (section_stamp), never from the clock at render time.
# tests/unit/test_bench_docs.py re-renders every section and compares it with the docs.


def load_document(path: Path) -> dict:
    """``{"provenance": ..., "results": ...}`` of a results file, as ``render_sections`` takes it."""
    provenance_, results = read_results(path)
    return {"provenance": provenance_, "results": results}


def section_stamp(provenance_: dict) -> tuple[str, str]:
    """(command, date) of a section's "Command:" line: from the results file's provenance, the day of the run."""
    return provenance_["command"], provenance_["date"][:10]


def publish_sections(
    sections: dict[str, str], provenance_: dict, docs: dict[str, Path], machine: str | None = None
) -> None:
    """Write each rendered section into its doc (``docs[name]``, docs/benchmarks.md by default)."""
    command, date = section_stamp(provenance_)
    machine = machine or machine_text(provenance_)
    for name, body in sections.items():
        write_section(name, command, date, body, doc=docs.get(name, DOC), machine=machine)


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A bench's command line: the first line of its docstring ``doc`` as the description, and ``--render``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="rewrite the docs from the results file; measure nothing")
    return parser


def add_results_options(parser: argparse.ArgumentParser, results: Path | None) -> None:
    """``--json`` and ``--no-doc``: where the results go, and whether the docs follow them."""
    parser.add_argument("--json", type=Path, default=results, help="results file (default %(default)s)")
    parser.add_argument("--no-doc", action="store_true", help="do not write the docs")


def publish_document(
    document: dict, render_sections: Callable[[dict], dict[str, str]], docs: dict[str, Path] | None = None
) -> None:
    """Render a results document's sections and write each into its doc (``docs[name]``, docs/benchmarks.md by
    default), under the "Command:" line of the run that measured it (the document's provenance)."""
    publish_sections(render_sections(document), document["provenance"], docs or {})


def render_from_file(
    path: Path, render_sections: Callable[[dict], dict[str, str]], docs: dict[str, Path] | None = None
) -> None:
    """``--render``: the docs rewritten from a results file alone."""
    publish_document(load_document(path), render_sections, docs)


def save_and_publish(
    args: argparse.Namespace,
    results: dict,
    render_sections: Callable[[dict], dict[str, str]],
    docs: dict[str, Path],
    disks: dict[str, Path] | None = None,
) -> dict:
    """Write ``results`` to ``args.json`` (with provenance) and, unless ``--no-doc``, render the docs from it."""
    document = write_results(args.json, results, disks=disks)
    if not args.no_doc:
        publish_document(document, render_sections, docs)
    return document


# --- a whole command, timed: wall and the CPU time of every process it starts ------------------------


CPU_POLL_S = 0.2


def run_and_count_cpu(command: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``command``; (the finished process, wall seconds, CPU seconds of it and every process it started).

    The CPU time is sampled from the live process tree every ``CPU_POLL_S`` (the last sample of each process
    counts): ``RUSAGE_CHILDREN`` would miss ranks that their parent never waits for, such as the second rank
    Lightning starts itself. A process's last ``CPU_POLL_S`` may be missed.
    """
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        popen = subprocess.Popen(command, cwd=REPO, env=bench_env(), stdout=out, stderr=err, text=True)
        root, cpu_by_pid = psutil.Process(popen.pid), {}
        while popen.poll() is None:
            with contextlib.suppress(psutil.Error):
                for process in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        times = process.cpu_times()
                        cpu_by_pid[process.pid] = times.user + times.system
            time.sleep(CPU_POLL_S)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        finished = subprocess.CompletedProcess(command, popen.returncode, out.read(), err.read())
    return finished, wall, sum(cpu_by_pid.values())


@contextlib.contextmanager
def holding(lock: Path | None):
    """An exclusive ``flock`` on ``lock`` for the duration (none when None): other heavy work on the machine waits
    between the runs, not during one."""
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
