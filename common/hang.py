"""A run whose collectives stall explains itself: every rank writes what it was doing, one rank names the culprit.

A ZeRO run hangs when the ranks stop issuing the same collectives in the same order: one rank died, skipped a
collective, issued one with another shape, or is stuck outside any collective while the others wait. Torch
already records and checks most of what is needed; this module arms it, collects it from every rank before the
processes exit, and compares it. What covers what (docs/troubleshooting.md, "When a run hangs"):

- torch's flight recorder (on by default in torch 2.13; ``TORCH_FR_BUFFER_SIZE``): every collective a rank
  issued, with its sequence number, op, shapes and dtypes, on gloo and NCCL. NCCL's process groups record into a
  recorder of their own, so a report reads the one that matches the backend (:func:`flight_recorder_dumps`). On
  NCCL torch also dumps it itself when a collective times out (``TORCH_FR_DUMP_TEMP_FILE``).
- the process group's own timeout (``collective_timeout_s``, passed by the factory): on gloo a stalled collective
  raises on the waiting ranks; on NCCL torch's watchdog aborts the process.
- ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (opt-in: extra collectives before each one, measured by bench/hang_overhead.py):
  torch checks before every collective that all ranks issue the same op with the same shapes (so a mismatch
  raises on every rank instead of crashing gloo or corrupting data), and its monitored barrier names a rank that
  does not arrive.
- this module, on both backends: a watchdog thread per rank. The first rank whose collective fails writes its
  report and raises a flag in the process group's store; every other rank's watchdog sees the flag within a
  second, writes its own report (stacks of all threads, the last collectives from the flight recorder, the
  optimizer step) and exits, so that no rank is left sleeping. The first rank then compares the reports and
  prints which rank fell behind and the first collective the ranks disagree on. ``faulthandler`` writes the
  stacks of a rank that crashes outright.

Nothing is written in a healthy run. After a hang, ``RUN_DIR/hang/`` holds ``rankN.json`` and ``rankN.stacks.txt``
per rank, ``flight_recorder_rankN.json`` (the rank's whole flight-recorder ring) and ``diagnosis.txt``;
``zero-recipes doctor --hang RUN_DIR`` reads them again.

Recipes arm it through ``common.process_setup.setup_process`` (called in every entry point's ``main()`` and again by
the factory's adapters, which prints it once among the process-wide settings); ``ZR_HANG_DETECTION=off`` turns it off
(bench/hang_overhead.py's baseline).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SWITCH_ENV = "ZR_HANG_DETECTION"  # "off" turns hang detection off
HANG_DIR_ENV = "ZR_HANG_DIR"  # where reports go when the factory is given no run directory
HANG_FOLDER = "hang"
DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group timeout
POLL_S = 1.0  # how often a watchdog looks at the store: one round trip per second
REPORT_WAIT_S = 20.0  # how long the first rank waits for the others' reports
DONE_WAIT_S = 30.0  # how long the other ranks wait for the first rank's diagnosis before exiting
EXIT_GRACE_S = 20.0  # after its report a process exits on its own within this, or its watchdog ends it
HANG_EXIT_CODE = 3
COLLECTIVES_KEPT = 32  # per process group, in each report
SAME_EVENT_NS = 2 * 10**9  # disagreements created this close together are one event seen from two ranks
STORE_PREFIX = "zr_hang/"
ABORT_KEY = STORE_PREFIX + "abort"
DONE_KEY = STORE_PREFIX + "done"

# A frame in one of these belongs to the libraries, not to the training code that called them.
LIBRARY_PATHS = ("/torch/", "/deepspeed/", "/lightning/", "/lightning_fabric/", "/pytorch_lightning/", "/accelerate/")
COLLECTIVE_MODULE = "torch/distributed/"


@dataclass(frozen=True)
class HangSettings:
    """How long a collective may take and where the reports go."""

    timeout_s: float
    hang_dir: Path


def settings_for(timeout: datetime.timedelta | None, run_dir: str | Path | None) -> HangSettings:
    """Settings from the factory's arguments: ``run_dir/hang``, else ``$ZR_HANG_DIR``, else ``./hang``."""
    if run_dir is not None:
        hang_dir = Path(run_dir) / HANG_FOLDER
    elif os.environ.get(HANG_DIR_ENV):
        hang_dir = Path(os.environ[HANG_DIR_ENV])
    else:
        hang_dir = Path.cwd() / HANG_FOLDER
    timeout_s = timeout.total_seconds() if timeout is not None else DEFAULT_TIMEOUT_S
    return HangSettings(timeout_s=timeout_s, hang_dir=hang_dir.absolute())


def detection_enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def enable_hang_detection(timeout: datetime.timedelta | None = None, run_dir: str | Path | None = None) -> None:
    """Arm hang detection for this process (idempotent; later calls update the settings).

    Called by ``common.process_setup.setup_process`` before the process group exists. The watchdog thread starts
    now and attaches itself once ``torch.distributed`` is initialised (by Lightning's strategy or by
    ``Accelerator()``), so that the same call works for both backends and for every launcher.
    """
    global _MONITOR
    if not detection_enabled():
        return
    settings = settings_for(timeout, run_dir)
    if _MONITOR is None:
        _MONITOR = HangMonitor(settings)
        _MONITOR.start()
    else:
        _MONITOR.settings = settings


def watchdog_cost() -> dict[str, float] | None:
    """This process's watchdog so far: ``{"cpu_s": its thread's CPU seconds, "polls": how often it woke}``."""
    if _MONITOR is None:
        return None
    return {"cpu_s": _MONITOR.cpu_s, "polls": float(_MONITOR.polls)}


def report_failure(exception: BaseException) -> None:
    """Called where a backend sees a training exception (Lightning's ``on_exception``, the excepthook)."""
    if _MONITOR is not None and is_reportable(exception) and _MONITOR.ensure_attached():
        _MONITOR.report(reason=f"{type(exception).__name__}: {first_line(exception)}", exception=exception)


def is_reportable(exception: BaseException) -> bool:
    """Whether ``exception`` leaves the other ranks waiting: anything but a stop asked by the user or bad input."""
    if isinstance(exception, KeyboardInterrupt | SystemExit):
        return False
    return type(exception).__name__ not in ("ConfigError", "SIGTERMException")


def first_line(exception: BaseException) -> str:
    text = str(exception).strip()
    return text.splitlines()[0][:500] if text else type(exception).__name__


# --- what a rank knows about itself --------------------------------------------------------------------------


# Torch keeps two flight recorders: NCCL process groups record into NCCL's own (dumped by ``_dump_nccl_trace_json``,
# compiled into CUDA builds only), every other backend (gloo) into the generic one (``_dump_fr_trace_json``).
NCCL_DUMP = "_dump_nccl_trace_json"
GENERIC_DUMP = "_dump_fr_trace_json"


def flight_recorder_dumps(backend: str) -> tuple[str, ...]:
    """The dump functions that hold the collectives of a run whose default process group has ``backend``.

    Args:
        backend: ``dist.get_backend()``: ``"nccl"``, ``"gloo"``, or one backend per device (``"cpu:gloo,cuda:nccl"``).

    Returns:
        NCCL's recorder first when the backend is NCCL, then the generic one, which also holds the gloo groups a
        NCCL run creates beside it (DeepSpeed's and the checkpoint writer's CPU groups); the generic one alone
        otherwise.
    """
    return (NCCL_DUMP, GENERIC_DUMP) if "nccl" in backend.lower() else (GENERIC_DUMP,)


def default_backend() -> str:
    """The default process group's backend; ``"gloo"`` before one exists (a report written that early)."""
    try:
        return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "gloo"
    except (RuntimeError, ValueError):
        return "gloo"


def flight_recorder_entries(
    backend: str | None = None, c10d: Any = None
) -> tuple[list[dict[str, Any]], dict[str, Any], str | None]:
    """(entries, per-group status, why not) from torch's flight recorder(s) of this process for ``backend``.

    Args:
        backend: the default process group's backend (:func:`default_backend` when None).
        c10d: where the dump functions are (``torch._C._distributed_c10d`` when None).

    Returns:
        The entries of every recorder :func:`flight_recorder_dumps` names, in that order; the status of each
        process group; None when every recorder was read, else why one (or all) could not be.
    """
    c10d = torch._C._distributed_c10d if c10d is None else c10d
    entries: list[dict[str, Any]] = []
    status: dict[str, Any] = {}
    notes = []
    for name in flight_recorder_dumps(backend or default_backend()):
        dump_json = getattr(c10d, name, None)
        if dump_json is None:  # NCCL's recorder on a CPU build of torch
            notes.append(f"{name} not in this torch build")
            continue
        try:
            dump = json.loads(dump_json(True, False))
        except (RuntimeError, TypeError, ValueError) as err:
            notes.append(f"{name} not readable: {err}")
            continue
        status.update(dump.get("pg_status", {}))
        if "entries" not in dump:
            notes.append(f"{name}: flight recorder off (TORCH_FR_BUFFER_SIZE=0)")
            continue
        entries += dump["entries"]
    return entries, status, "; ".join(notes) or None


def compact_collectives(entries: list[dict[str, Any]], kept: int = COLLECTIVES_KEPT) -> list[dict[str, Any]]:
    """The last ``kept`` collectives per process group, as plain records (p2p sends and receives left out)."""
    by_group: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        if entry.get("is_p2p"):
            continue
        group = str(entry.get("process_group", [""])[0]) or f"pg{entry.get('pg_id', '?')}"
        by_group.setdefault(group, []).append(
            {
                "group": group,
                "seq": int(entry.get("collective_seq_id", -1)),
                "op": str(entry.get("profiling_name", "?")).split(":")[-1],
                "input_sizes": entry.get("input_sizes", []),
                "output_sizes": entry.get("output_sizes", []),
                "dtypes": entry.get("input_dtypes", []),
                "state": entry.get("state"),
                "time_created_ns": entry.get("time_created_ns"),
            }
        )
    kept_records = []
    for records in by_group.values():
        kept_records += sorted(records, key=lambda r: r["seq"])[-kept:]
    return kept_records


def optimizer_step() -> dict[str, int] | None:
    """Optimizer and micro steps of this process's DeepSpeed engine (both backends train through one).

    Looked up only when a report is written, so a healthy step pays nothing for it.
    """
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    if engine_module is None:
        return None
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module proxies warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, engine_module.DeepSpeedEngine):
                return {"optimizer_steps": int(obj.global_steps), "micro_steps": int(obj.micro_steps)}
    return None


def frame_records(summary: traceback.StackSummary) -> list[dict[str, Any]]:
    return [{"file": f.filename, "line": f.lineno, "function": f.name} for f in summary]


def thread_stacks(exception: BaseException | None = None) -> tuple[list[dict[str, Any]], str]:
    """(the main thread's frames, innermost last; every thread's stack as text).

    With an ``exception`` (the main thread is handling it) its traceback stands for the main thread: it reaches
    down to where the collective failed, while the live stack is already in the handler.
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main_id = threading.main_thread().ident
    main_frames: list[dict[str, Any]] = []
    blocks = []
    if exception is not None and exception.__traceback__ is not None:
        failed = traceback.extract_tb(exception.__traceback__)
        main_frames = frame_records(failed)
        blocks.append(f"Main thread, where it raised {type(exception).__name__}:\n" + "".join(failed.format()))
    for thread_id, frame in sys._current_frames().items():
        summary = traceback.extract_stack(frame)
        blocks.append(f"Thread {names.get(thread_id, thread_id)} ({thread_id}):\n" + "".join(summary.format()))
        if thread_id == main_id and not main_frames:
            main_frames = frame_records(summary)
    return main_frames, "\n".join(blocks)


def where(frames: list[dict[str, Any]]) -> str:
    """Where a stack is, in a phrase: the collective it waits in and the training code that called it."""
    if not frames:
        return "stack unknown"
    user = [f for f in frames if not any(p in f["file"].replace("\\", "/") for p in (*LIBRARY_PATHS, "/common/"))]
    caller = user[-1] if user else frames[-1]
    called_from = f"{Path(caller['file']).name}:{caller['line']} in {caller['function']}"
    collective = [f for f in frames if COLLECTIVE_MODULE in f["file"].replace("\\", "/")]
    if collective:
        return f"waiting in {collective[-1]['function']} (torch.distributed), called from {called_from}"
    return f"at {called_from}, not in a collective"


# --- the monitor ---------------------------------------------------------------------------------------------


@dataclass
class HangMonitor:
    """One per process: the watchdog thread, the crash-stack file, and the report protocol through the store."""

    settings: HangSettings
    attached: bool = False
    rank: int = 0
    world_size: int = 1
    store: Any = None
    reported: bool = False
    reported_at: float | None = None
    crash_file: Any = None
    crash_path: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    # What the watchdog itself costs a healthy run (bench/hang_overhead.py): its thread's CPU time and its polls.
    cpu_s: float = 0.0
    polls: int = 0

    def start(self) -> None:
        self.thread = threading.Thread(target=self._watch, name="zr-hang-watchdog", daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """At exit: end the watchdog before the interpreter tears down. A daemon thread left inside a store call
        while the process exits aborted the process ("terminate called without an active exception", seen in
        CI after healthy runs)."""
        self.stopping.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5 * POLL_S)
        self.store = None

    # the watchdog

    def _watch(self) -> None:
        while not self.ensure_attached():
            if self.stopping.wait(POLL_S):
                return
        while not self.stopping.wait(POLL_S):
            self.polls += 1
            self.cpu_s = time.thread_time()  # this thread's CPU time so far: everything the watchdog did
            if self.reported_at is not None:
                if time.monotonic() - self.reported_at > EXIT_GRACE_S:
                    self._exit_now("did not exit after its hang report")
                continue
            if not dist.is_initialized():  # the process group is gone (the run ended), its store with it
                continue
            abort = self._peer_abort() if not self.reported else None
            # The main thread may be writing its own report (its collective failed too): let it finish.
            if abort is not None and self.report(reason=f"stopped by rank {abort.get('rank')}: {abort.get('reason')}"):
                self._exit_now("stopped after a hang report")

    def ensure_attached(self) -> bool:
        """Attach to the process group once it exists (the watchdog polls; an early exception attaches at once)."""
        with self.lock:
            if not self.attached and dist.is_available() and dist.is_initialized():
                self._attach()
            return self.attached

    def _attach(self) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        with contextlib.suppress(AttributeError, RuntimeError):
            self.store = dist.distributed_c10d._get_default_store()
        self._arm_crash_stacks()
        previous_hook = sys.excepthook

        def report_then_print(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            report_failure(value)  # Accelerate's loop (and any other) has no exception hook of its own
            previous_hook(kind, value, tb)

        sys.excepthook = report_then_print
        self.attached = True

    def _arm_crash_stacks(self) -> None:
        """faulthandler writes every thread's Python stack if this process dies of a signal (gloo's abort).

        The file is in the temporary folder (a healthy run writes nothing into its run directory) under a name the
        other ranks on this host can derive, since the store may have died with the crashed rank.
        """
        self.crash_path = crash_file_path(self.rank)
        self.crash_file = self.crash_path.open("w")
        faulthandler.enable(file=self.crash_file, all_threads=True)
        atexit.register(self._forget_crash_file)

    def _forget_crash_file(self) -> None:
        """At a clean exit: stop faulthandler writing there, and remove the file if nothing crashed."""
        with contextlib.suppress(OSError, ValueError):
            faulthandler.disable()
            self.crash_file.close()
            if self.crash_path.stat().st_size == 0:
                self.crash_path.unlink()

    def _peer_abort(self) -> dict[str, Any] | None:
        try:
            if self.store is None or not self.store.check([ABORT_KEY]):
                return None
            return json.loads(self.store.get(ABORT_KEY))
        except (RuntimeError, ValueError, OSError):  # store gone (its host exited): the launcher ends this rank
            return None

    def _store_set(self, key: str, value: str) -> None:
        with contextlib.suppress(RuntimeError, OSError, AttributeError):
            self.store.set(key, value)

    def _exit_now(self, why: str) -> None:
        print(f"hang: rank {self.rank} {why}; exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        self._forget_crash_file()  # os._exit skips atexit
        os._exit(HANG_EXIT_CODE)

    # the report

    def report(self, reason: str, exception: BaseException | None = None) -> bool:
        """Write this rank's report; the first rank to report collects the others' and prints the diagnosis.

        Returns False when this process had reported already (from another thread).
        """
        with self.lock:
            if self.reported:
                return False
            self.reported = True
        try:
            summary = self._write_own_report(reason, exception)
            claimed = self._claim_first(reason)
            self._store_set(f"{STORE_PREFIX}report/{self.rank}", json.dumps(summary))
            if claimed:
                self._diagnose(summary)
            else:
                self._wait_for(DONE_KEY, DONE_WAIT_S)
        finally:
            self.reported_at = time.monotonic()
        return True

    def _write_own_report(self, reason: str, exception: BaseException | None) -> dict[str, Any]:
        entries, status, recorder_note = flight_recorder_entries()
        main_frames, all_stacks = thread_stacks(exception)
        hang_dir = self.settings.hang_dir
        summary = {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "reason": reason,
            "exception": None if exception is None else f"{type(exception).__name__}: {exception}"[:4000],
            "timeout_s": self.settings.timeout_s,
            "consistency_checks": dist.get_debug_level() == dist.DebugLevel.DETAIL,
            "step": optimizer_step(),
            "collectives": compact_collectives(entries),
            "group_status": status,
            "flight_recorder": recorder_note or "on",
            "main_stack": main_frames[-12:],
            "where": where(main_frames),
        }
        with contextlib.suppress(OSError):
            hang_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(hang_dir / f"rank{self.rank}.json", json.dumps(summary, indent=1) + "\n")
            write_atomic(hang_dir / f"rank{self.rank}.stacks.txt", all_stacks)
            if entries:  # the whole ring, beyond the last collectives kept above
                write_atomic(hang_dir / f"flight_recorder_rank{self.rank}.json", json.dumps(entries) + "\n")
        return summary

    def _claim_first(self, reason: str) -> bool:
        mine = json.dumps({"rank": self.rank, "reason": reason})
        try:
            return self.store.compare_set(ABORT_KEY, "", mine).decode() == mine
        except (RuntimeError, OSError, AttributeError):
            return True  # no store to agree through: report alone

    def _wait_for(self, key: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.store.check([key]):
                    return True
            except (RuntimeError, OSError, AttributeError):
                return False
            time.sleep(0.2)
        return False

    def _diagnose(self, own: dict[str, Any]) -> None:
        reports: dict[int, dict[str, Any] | None] = {self.rank: own}
        deadline = time.monotonic() + REPORT_WAIT_S
        for rank in range(self.world_size):
            if rank != self.rank:
                key = f"{STORE_PREFIX}report/{rank}"
                answered = self._wait_for(key, deadline - time.monotonic())
                reports[rank] = json.loads(self.store.get(key)) if answered else None
        crashes = self._crash_stacks([r for r, rep in reports.items() if rep is None])
        diagnosis = analyze(reports, crashes)
        text = format_diagnosis(diagnosis, self.settings.hang_dir)
        with contextlib.suppress(OSError):
            write_atomic(self.settings.hang_dir / "diagnosis.txt", text + "\n")
            for rank, stack in crashes.items():
                write_atomic(self.settings.hang_dir / f"rank{rank}.crash.txt", stack)
                crash_file_path(rank).unlink()  # moved into the run directory
        print(f"error: {text}", file=sys.stderr, flush=True)
        self._store_set(DONE_KEY, "1")

    def _crash_stacks(self, silent_ranks: list[int]) -> dict[int, str]:
        """What faulthandler wrote for ranks that did not report (readable when they ran on this host)."""
        found = {}
        for rank in silent_ranks:
            with contextlib.suppress(OSError):
                text = crash_file_path(rank).read_text()
                if text.strip():
                    found[rank] = text
        return found


_MONITOR: HangMonitor | None = None


def crash_file_path(rank: int) -> Path:
    """Where rank ``rank`` of this job on this host has faulthandler write its stacks (one job: one master port)."""
    job = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', os.getppid())}"
    return Path(tempfile.gettempdir()) / f"zr-hang-{job}-rank{rank}.txt"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- comparing the ranks' reports (pure: reports in, diagnosis out) ------------------------------------------

# torch's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) names both sides of a mismatch in its error.
FINGERPRINT = re.compile(
    r"Rank (?P<rank>\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(?P<seq>\d+), "
    r"OpType=(?P<op>[A-Z_]+), TensorShape=\[(?P<shape>[^\]]*)\], TensorDtypes=(?P<dtype>\w+)"
)
MONITORED_BARRIER = re.compile(r"Ranks? (?P<ranks>[\d, ]+) failed to pass monitoredBarrier")
CRASH_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')


@dataclass
class Diagnosis:
    """Which ranks fell behind, and the first collective the ranks disagree on (with what each rank issued)."""

    world_size: int
    behind: list[int]
    silent: list[int]
    group: str | None
    seq: int | None
    issued: dict[int, str]
    ranks: dict[int, str]
    source: str
    reasons: dict[int, str]


def describe_collective(record: dict[str, Any] | None) -> str:
    if record is None:
        return "nothing"
    sizes = record.get("input_sizes") or []
    shapes = ", ".join("[" + ", ".join(str(d) for d in size) + "]" for size in sizes) or "[]"
    dtypes = ",".join(sorted(set(record.get("dtypes") or []))) or "?"
    return f"{record['op']} {shapes} {dtypes}"


def crash_frames(text: str) -> list[dict[str, Any]]:
    """The crashed thread's frames from a faulthandler dump, innermost last."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    # gloo aborts from its own C++ thread: the Python thread that matters is the one inside a collective.
    chosen = next((b for b in blocks if COLLECTIVE_MODULE in b), None)
    chosen = chosen or next((b for b in blocks if b.lstrip().startswith("Current thread")), blocks[-1])
    frames = [m.groupdict() for m in CRASH_FRAME.finditer(chosen)]
    return [{"file": f["file"], "line": int(f["line"]), "function": f["function"]} for f in reversed(frames)]


# The wrapper's op names, as the flight recorder (and torch.distributed) names the same collectives.
DETAIL_OPS = {
    "ALLREDUCE": "all_reduce",
    "_ALLGATHER_BASE": "all_gather_into_tensor",
    "ALLGATHER": "all_gather",
    "_REDUCE_SCATTER_BASE": "reduce_scatter_tensor",
    "REDUCE_SCATTER": "reduce_scatter",
    "BROADCAST": "broadcast",
    "BARRIER": "barrier",
}


def detail_op(name: str) -> str:
    return DETAIL_OPS.get(name, name.lower())


def _detail_mismatch(reports: dict[int, dict[str, Any] | None]) -> tuple[int, dict[int, str]] | None:
    for report in reports.values():
        text = (report or {}).get("exception") or ""
        found = {int(m["rank"]): m for m in FINGERPRINT.finditer(text)}
        if len(found) >= 2:
            # The wrapper counts from 0, the flight recorder from 1: report the flight recorder's number.
            seq = int(next(iter(found.values()))["seq"]) + 1
            return seq, {r: f"{detail_op(m['op'])} [{m['shape']}] {m['dtype']}" for r, m in sorted(found.items())}
    return None


def _first_disagreement(
    reports: dict[int, dict[str, Any]],
) -> tuple[str, int, dict[int, dict[str, Any] | None]] | None:
    """(group, seq, record per rank) of the earliest collective not issued alike by every reporting rank."""
    by_rank_group: dict[int, dict[str, dict[int, dict[str, Any]]]] = {}
    for rank, report in reports.items():
        for record in report.get("collectives", []):
            by_rank_group.setdefault(rank, {}).setdefault(record["group"], {})[record["seq"]] = record
    groups = sorted({g for groups in by_rank_group.values() for g in groups}, key=lambda g: (g != "0", g))
    candidates = []
    for group in groups:
        per_rank = {rank: by_rank_group.get(rank, {}).get(group, {}) for rank in reports}
        known = [set(seqs) for seqs in per_rank.values() if seqs]
        if not known:
            continue
        start = max(min(seqs) for seqs in known)  # the rings may have dropped different old entries
        last = max(max(seqs) for seqs in known)
        for seq in range(start, last + 1):
            records = {rank: seqs.get(seq) for rank, seqs in per_rank.items()}
            shown = {describe_collective(r) for r in records.values()}
            if len(shown) > 1:
                created = min((r["time_created_ns"] or 0) for r in records.values() if r is not None)
                candidates.append((created, group, seq, records))
                break
    if not candidates:
        return None
    # The earliest disagreement names the cause. When two come within a moment of each other they are one event
    # seen from two sides: a rank skipped a collective on the default group and went on into another group's,
    # where the others never follow. Which of the two was created first is then a race between the ranks, so
    # the default group's (where the training's own collectives are) is named, whatever the race.
    earliest = min(c[0] for c in candidates)
    _, group, seq, records = min(candidates, key=lambda c: (c[0] - earliest > SAME_EVENT_NS, c[1] != "0", c[0]))
    return group, seq, records


def rank_line(report: dict[str, Any]) -> str:
    """One rank in a phrase: where its main thread is, the last collective it issued, its optimizer step."""
    parts = [report.get("where", "stack unknown")]
    # Under DETAIL the recorder sees the checks' own helper collectives, not the run's: leave them out.
    collectives = [] if report.get("consistency_checks") else report.get("collectives") or []
    if collectives:
        last = max(collectives, key=lambda r: r.get("time_created_ns") or 0)
        issued = f"#{last['seq']} {describe_collective(last)} on process group {last['group']}"
        parts.append(f"last collective issued {issued}")
    step = report.get("step")
    if step:
        parts.append(f"after optimizer step {step['optimizer_steps']}")
    return "; ".join(parts)


def analyze(reports: dict[int, dict[str, Any] | None], crashes: dict[int, str] | None = None) -> Diagnosis:
    """Compare every rank's report: who fell behind, and the first collective the ranks disagree on.

    Args:
        reports: rank -> its report (``rankN.json``), None for a rank that wrote none (crashed or killed).
        crashes: rank -> faulthandler's stack dump, for ranks that crashed.
    """
    crashes = crashes or {}
    world_size = max([r.get("world_size", 0) for r in reports.values() if r] + [max(reports) + 1 if reports else 0])
    present = {rank: rep for rank, rep in reports.items() if rep}
    silent = sorted(set(range(world_size)) - set(present))
    ranks = {rank: rank_line(rep) for rank, rep in present.items()}
    for rank in silent:
        frames = crash_frames(crashes[rank]) if rank in crashes else []
        ranks[rank] = f"crashed, {where(frames)}" if frames else "wrote no report (crashed or killed)"
    reasons = {rank: rep.get("reason", "") for rank, rep in present.items()}

    detail = _detail_mismatch(present)
    if detail is not None:
        seq, issued = detail
        return Diagnosis(world_size, [], silent, "0", seq, issued, ranks, "torch's collective checks (DETAIL)", reasons)

    barrier_ranks = _monitored_barrier_ranks(present)
    found = _first_disagreement(present) if present else None
    if found is None and silent and present:
        return _crashed_in_collective(world_size, present, silent, ranks, reasons)
    if found is None:
        behind = sorted(set(barrier_ranks) | set(silent))
        return Diagnosis(world_size, behind, silent, None, None, {}, ranks, "flight recorder", reasons)
    group, seq, records = found
    issued = {rank: describe_collective(record) for rank, record in sorted(records.items())}
    for rank in silent:
        issued[rank] = "unknown (no report)"
    last = {
        rank: max((r["seq"] for r in rep.get("collectives", []) if r["group"] == group), default=-1)
        for rank, rep in present.items()
    }
    top = max(last.values())
    behind = sorted({rank for rank, value in last.items() if value < top} | set(barrier_ranks) | set(silent))
    return Diagnosis(world_size, behind, silent, group, seq, issued, ranks, "flight recorder", reasons)


def _crashed_in_collective(
    world_size: int,
    present: dict[int, dict[str, Any]],
    silent: list[int],
    ranks: dict[int, str],
    reasons: dict[int, str],
) -> Diagnosis:
    """Ranks that wrote nothing while the others agree so far: the collective in question is the survivors' last."""
    latest = {
        rank: max(rep["collectives"], key=lambda r: r.get("time_created_ns") or 0)
        for rank, rep in present.items()
        if rep.get("collectives") and not rep.get("consistency_checks")
    }
    if not latest:
        return Diagnosis(world_size, silent, silent, None, None, {}, ranks, "flight recorder", reasons)
    first = min(latest.values(), key=lambda r: r.get("time_created_ns") or 0)
    issued = {rank: describe_collective(record) for rank, record in latest.items()}
    for rank in silent:
        issued[rank] = ranks[rank]
    group, seq = first["group"], first["seq"]
    return Diagnosis(world_size, silent, silent, group, seq, issued, ranks, "flight recorder", reasons)


def _monitored_barrier_ranks(reports: dict[int, dict[str, Any]]) -> list[int]:
    for report in reports.values():
        match = MONITORED_BARRIER.search(report.get("exception") or "")
        if match:
            return [int(r) for r in re.findall(r"\d+", match["ranks"])]
    return []


def format_diagnosis(diagnosis: Diagnosis, hang_dir: Path | None = None) -> str:
    """The diagnosis as the error message a user reads (and ``zero-recipes doctor --hang`` prints)."""
    lagging = [rank for rank in diagnosis.behind if rank not in diagnosis.silent]
    headline = []
    if lagging:
        headline.append(f"rank(s) {', '.join(map(str, lagging))} fell behind")
    if diagnosis.silent:
        headline.append(f"rank(s) {', '.join(map(str, diagnosis.silent))} crashed or were killed")
    lines = ["hang: " + ("; ".join(headline) if headline else "the ranks disagree on a collective")]
    if diagnosis.seq is not None:
        issued = "; ".join(f"rank {rank}: {what}" for rank, what in sorted(diagnosis.issued.items()))
        lines.append(
            f"  first collective the ranks disagree on: #{diagnosis.seq} on process group {diagnosis.group} "
            f"({issued}) [from {diagnosis.source}]"
        )
    else:
        lines.append("  no disagreement in the collectives the ranks recorded")
    for rank in sorted(diagnosis.ranks):
        lines.append(f"  rank {rank}: {diagnosis.ranks[rank]}")
    if diagnosis.silent:
        lines.append(
            "  a rank that crashed inside a collective may have issued a different one: rerun with "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL to have torch compare every collective across ranks before it runs"
        )
    if hang_dir is not None:
        lines.append(f"  every rank's stacks, last collectives and step: {hang_dir}/ (zero-recipes doctor --hang)")
    return "\n".join(lines)


def read_reports(hang_dir: Path) -> tuple[dict[int, dict[str, Any] | None], dict[int, str]]:
    """(reports by rank, crash stacks by rank) from a ``hang/`` folder; ranks without a file map to None."""
    reports: dict[int, dict[str, Any] | None] = {}
    for path in sorted(hang_dir.glob("rank*.json")):
        match = re.fullmatch(r"rank(\d+)\.json", path.name)
        if match:
            reports[int(match.group(1))] = json.loads(path.read_text())
    crashes = {}
    for path in sorted(hang_dir.glob("rank*.crash.txt")):
        crashes[int(re.findall(r"\d+", path.name)[0])] = path.read_text()
    world = max([r.get("world_size", 0) for r in reports.values() if r] + [max(crashes, default=-1) + 1])
    for rank in range(world):
        reports.setdefault(rank, None)
    return reports, crashes
