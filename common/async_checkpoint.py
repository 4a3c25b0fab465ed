"""Asynchronous checkpoints: training waits only while the state is copied to host memory, never for the disk.

A synchronous DeepSpeed save stops every rank for the whole write (DeepSpeed#1997 reports 427 s for one save).
:class:`AsyncCheckpointer` splits it in three:

* **save call** (the training loop waits): DeepSpeed's ``save_checkpoint`` runs as usual, but every file it hands to
  its checkpoint engine goes to the engine :func:`snapshot_engine` makes, whose ``save`` queues the state instead of
  writing it. Tensors that only an optimizer update changes (the module's parameters, the fp32 master partitions, the
  optimizer's moments: :func:`updated_by_the_optimizer`) are queued by reference; every other tensor (buffers such
  as BatchNorm statistics, which a forward pass changes in place; anything in the client state) is copied to host
  memory at once, and so is every other mutable object (DeepSpeed's loss scaler counts steps in place).
* **copy** (background, overlapping the next forward and backward): the referenced tensors are copied to host
  memory. ZeRO's optimizer ``state_dict()`` returns the live partitions, which the next optimizer step overwrites in
  place, so a hook before that step (``register_step_pre_hook`` on the torch optimizer inside DeepSpeed's) waits
  for the copy; the wait, if any, is added to the save's ``blocked_s``. This is the lazy snapshot of DataStates-LLM
  (Maurya et al., HPDC 2024): the state is immutable from the end of one update to the start of the next.
* **write** (background, while training goes on): ``torch.save`` of each snapshot straight to disk, past the page
  cache (:class:`DirectFile`, ``O_DIRECT``) and without torch's CRC-32 (:func:`without_crc32`), the two costs that
  made a background write take CPU time from training here; then ``fsync`` of every file in the rank's checkpoint
  folder, then a marker ``.written-rank<K>``. Rank 0's thread waits until every rank's marker
  is there and only then publishes (``publish_checkpoint``: rename into place, move ``latest``, retention). A crash
  at any point leaves ``latest`` naming the previous complete checkpoint.

On a GPU (written for it, not yet run on one) the copy is the GPU's: a copy into pageable host memory would hold the
calling thread and serialise with training's stream, so CUDA tensors are copied into pinned host memory, queued by
the save call itself (:class:`DeviceCopies`: the update-only tensors on a side stream, the others on training's
stream), and the writer waits for an event after each file's copies before it lets the next update go or writes.

Without a torch optimizer to hook (or with ZeRO's NVMe swapping, which moves the state between saves and steps)
every tensor is copied in the save call, as before. The writer thread runs only on CPU time nobody else wants
(:func:`run_when_idle`, ``SCHED_IDLE``): on a host whose cores training keeps busy, the copy and the write take the
cycles the training threads leave (while they wait in a collective), not theirs.

At most one save is in flight per rank: a save waits for the previous one to be written and published first (never
two writers on one folder), so host memory for snapshots is bounded by one checkpoint's share of the rank
(:attr:`AsyncCheckpointer.snapshot_bytes` reports it). Errors in the thread (disk full) are raised in the training
loop at the next save or at :meth:`AsyncCheckpointer.finish`.

Why not what DeepSpeed ships (0.19): its ``DecoupledCheckpointEngine`` writes in a subprocess but commits at the
next optimizer step's boundary, so a write longer than one forward and backward stalls the next step for the rest of
it; ``FastCheckpointEngine`` writes faster but synchronously. DataStates is not installed here.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import errno
import fcntl
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from common.checkpoint import publish_checkpoint, tmp_checkpoint_dir
from common.presets import is_fsdp2_name
from common.rundir import fsync_path

MARKER = ".written-rank"
WRITE_DELAY_ENV = "ZERO_RECIPES_TEST_CHECKPOINT_WRITE_DELAY_S"
COPY_DELAY_ENV = "ZERO_RECIPES_TEST_CHECKPOINT_COPY_DELAY_S"
DIRECT_BUFFER_BYTES = 32 * 2**20  # the writer's bounce buffer for O_DIRECT (a multiple of the block size)
ZERO_COPY_MIN_BYTES = 2**20  # tensors this large are snapshotted page-aligned and written to disk without a copy
WRITER_NICE = 10  # the writer thread's CPU priority below training's where SCHED_IDLE is not available
PUBLISH_POLL_S = 0.05
# Values a snapshot keeps by reference: none of them can change after the save call.
IMMUTABLE_LEAVES = (str, bytes, int, float, complex, type(None), range, torch.dtype, torch.device, enum.Enum)


def snapshot(
    state: Any,
    pool: dict | None = None,
    key: tuple = (),
    defer: Callable[[torch.Tensor], bool] | None = None,
    copy_into: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[Any, int]:
    """A deep copy of ``state`` with every tensor copied to host memory; and the bytes those copies hold.

    Other objects are deep-copied too (:data:`IMMUTABLE_LEAVES` excepted): the file holds them as they were when
    ``snapshot`` ran. Views are copied as themselves (compact and contiguous), so a partition of a flat buffer does
    not drag the whole buffer along, which is also what DeepSpeed's ``clone_tensors_for_torch_save`` does before a
    save. Large copies start on a page boundary (:func:`page_aligned_empty`), so that :class:`DirectFile` writes
    them to disk from where they are.

    Args:
        state: what DeepSpeed hands its checkpoint engine for one file.
        pool: host tensors of the previous snapshot, by position (``key``) in the state; one of the same shape and
            dtype is copied into instead of allocating a new one (fresh memory costs a page fault per 4 KiB the
            first time it is written, which made up most of the snapshot time measured here). Updated in place.
        key: this value's position in the state (for the pool).
        defer: tensors for which it is true are kept by reference, not copied (nor counted): a second
            ``snapshot`` of the result copies them later.
        copy_into: ``copy_into(source, host)`` copies each tensor (a plain ``copy_`` when None); a CUDA tensor's host
            tensor is pinned (:func:`host_buffer`), so that the copy can run asynchronously.
    """
    if isinstance(state, torch.Tensor):
        if defer is not None and defer(state):
            return state, 0
        host = pool.get(key) if pool is not None else None
        if host is state:  # copied by an earlier pass into this very tensor
            return host, host.numel() * host.element_size()
        if host is None or not fits(host, state):
            host = host_buffer(state)
            if pool is not None:
                pool[key] = host
        if copy_into is None:
            host.copy_(state.detach())
        else:
            copy_into(state, host)
        return host, host.numel() * host.element_size()
    if isinstance(state, dict):
        out, total = copy.copy(state), 0  # a shallow copy keeps the mapping's type (OrderedDict, defaultdict)
        for name, value in state.items():
            out[name], nbytes = snapshot(value, pool, (*key, name), defer, copy_into)
            total += nbytes
        return out, total
    if isinstance(state, list | tuple):
        items = [snapshot(value, pool, (*key, index), defer, copy_into) for index, value in enumerate(state)]
        copies, total = [c for c, _ in items], sum(n for _, n in items)
        if isinstance(state, list):
            return copies, total
        return (type(state)(*copies) if hasattr(state, "_fields") else type(state)(copies)), total
    if isinstance(state, IMMUTABLE_LEAVES):
        return state, 0
    # Any other object may change in place after the save call, as DeepSpeed's loss scaler does at every step
    # (cur_iter, cur_scale): written later by reference, the file would pair it with the tensors of an earlier step.
    return copy.deepcopy(state), 0


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An uninitialized host tensor to copy ``like`` into: pinned (page-locked) for a CUDA tensor, so that the copy
    runs asynchronously on a stream, by the GPU's copy engine; else :func:`page_aligned_empty`."""
    if like.is_cuda:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
    return page_aligned_empty(like)


def fits(host: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether a pooled host tensor can take a copy of ``like``: same shape and dtype, and pinned for a CUDA one."""
    return host.shape == like.shape and host.dtype == like.dtype and (not like.is_cuda or host.is_pinned())


def page_aligned_empty(like: torch.Tensor) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor of ``like``'s shape and dtype; from ``ZERO_COPY_MIN_BYTES`` up, in an
    anonymous ``mmap`` of its own, so its storage starts on a page boundary (torch's allocator aligns to 64 bytes).
    ``O_DIRECT`` can write such a storage to disk without a copy into :class:`DirectFile`'s buffer."""
    nbytes = like.numel() * like.element_size()
    if nbytes < ZERO_COPY_MIN_BYTES:
        return torch.empty(like.shape, dtype=like.dtype)
    region = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive, and the mapping cannot close under it
    return torch.frombuffer(region, dtype=like.dtype, count=like.numel()).view(like.shape)


def address_of(data: memoryview) -> int:
    """The address of a (non-empty) buffer's first byte, read-only buffers included (``ctypes`` wants writable)."""
    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)


def torch_optimizer(engine: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a DeepSpeed engine's (ZeRO's and the mixed-precision wrappers are not torch
    optimizers; the AdamW, CPUAdam or FusedAdam they drive is): the one whose ``step`` changes the state in place."""
    optimizer = getattr(engine, "optimizer", None)
    for _ in range(4):  # engine -> ZeRO or bf16 wrapper -> the torch optimizer
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def updated_by_the_optimizer(engine: Any, optimizer: torch.optim.Optimizer) -> set[int]:
    """The storages that change only in an optimizer update: the module's parameters (ZeRO-3: their partitions,
    ``ds_tensor``), the torch optimizer's parameters and state, and ZeRO's fp32 master partitions (ZeRO-3 hands its
    torch optimizer one sub-group at a time, so not all of them are in its parameter groups)."""
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for key, state in optimizer.state.items():
        tensors += [key, *(v for v in state.values() if isinstance(v, torch.Tensor))]
    for parameter in engine.module.parameters():
        tensors += [parameter, getattr(parameter, "ds_tensor", None)]
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        tensors += list(getattr(engine.optimizer, name, None) or [])
    storages = {storage_of(t) for t in tensors if isinstance(t, torch.Tensor) and t.numel()}
    storages.discard(0)
    return storages


def swaps_to_nvme(engine: Any) -> bool:
    """Whether ZeRO moves the optimizer state or the parameters to NVMe and back (they change place between a save
    and the next step, so they are copied in the save call)."""
    offloads = [getattr(engine, f"zero_offload_{kind}", lambda: None)() for kind in ("optimizer", "param")]
    return any(getattr(offload, "device", None) == "nvme" for offload in offloads)


@contextlib.contextmanager
def without_crc32(storage_alignment: int | None = None) -> Iterator[None]:
    """``torch.save`` without the CRC-32 of every record in its zip file, for the duration.

    The CRC costs CPU time (measured by bench/checkpoint.py) and protects nothing on the
    way back: ``torch.load`` never checks it, so a damaged byte loads silently with or without it (both pinned by
    tests/unit/test_async_checkpoint.py). The files are the same zip format, read by every loader as before.

    Args:
        storage_alignment: where given, each tensor's bytes start at a multiple of it in the file (torch pads the
            record's zip header; 64 by default): :func:`save_direct` asks for the block size.
    """
    try:
        from torch.utils.serialization import config  # torch >= 2.6; before it, every save computes the CRC
    except ImportError:
        yield
        return
    before = config.save.compute_crc32, config.save.storage_alignment
    config.save.compute_crc32 = False
    if storage_alignment is not None:
        config.save.storage_alignment = storage_alignment
    try:
        yield
    finally:
        config.save.compute_crc32, config.save.storage_alignment = before


class DirectFile:
    """A file ``torch.save`` writes to that bypasses the page cache (``O_DIRECT``), through an aligned buffer.

    A buffered write copies every byte into the page cache, and the kernel's work on those pages costs CPU time of
    its own (``bench/checkpoint.py`` measures both ways). The background writer
    spends that CPU on the cores training needs, so it is what an asynchronous save costs the steps around it.
    ``O_DIRECT`` wants the memory, the length and the file offset aligned to the block size: the bytes go through
    an ``mmap``-ed buffer (page-aligned), which is written whole each time it fills; the last, unaligned part is
    written with ``O_DIRECT`` cleared. A large write that starts on a page and at an aligned offset of the file (a
    tensor of :func:`page_aligned_empty`, saved by :func:`save_direct`) goes to disk from where it is, all but its
    unaligned tail: no copy, and no Python lock held while the bytes move (``os.write`` lets go of the GIL, a copy
    into the buffer does not, and the training thread needs it between every two ops). The file is flushed
    (``fsync``) on close. Where ``O_DIRECT`` is refused (tmpfs, macOS) it is a buffered file.

    Args:
        path: the file to write (created or truncated).
        buffer: the bounce buffer, page-aligned (``mmap.mmap(-1, size)``), reused from file to file.
    """

    ALIGN = 4096

    def __init__(self, path: str | Path, buffer: mmap.mmap) -> None:
        self.buffer, self.view, self.filled = buffer, memoryview(buffer), 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:  # the file system refuses O_DIRECT (tmpfs): the page cache it is
            self.fd = os.open(path, flags, 0o644)

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        start, total = self._write_in_place(data), len(data)
        while start < total:
            take = min(len(self.buffer) - self.filled, total - start)
            self.view[self.filled : self.filled + take] = data[start : start + take]
            self.filled, start = self.filled + take, start + take
            if self.filled == len(self.buffer):
                self._write_out(self.view[: self.filled])
                self.filled = 0
        return total

    def _write_in_place(self, data: memoryview) -> int:
        """Write the aligned part of ``data`` straight from its memory where it can go so (the buffer's bytes first,
        whole blocks by then); how many bytes were written."""
        aligned = len(data) // self.ALIGN * self.ALIGN
        if (
            aligned < ZERO_COPY_MIN_BYTES
            or self.filled % self.ALIGN  # the file offset is not on a block: the bytes go through the buffer
            or address_of(data) % self.ALIGN
            or not fcntl.fcntl(self.fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)
        ):
            return 0
        self._write_out(self.view[: self.filled])
        self.filled = 0
        self._write_out(data[:aligned])
        return aligned

    def flush(self) -> None:
        """Nothing: ``close`` writes what the buffer holds (torch.save calls this at the end of the archive)."""

    def close(self) -> None:
        try:
            aligned = self.filled // self.ALIGN * self.ALIGN
            self._write_out(self.view[:aligned])
            self._buffered()  # for the unaligned tail
            self._write_out(self.view[aligned : self.filled])
            os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def _buffered(self) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~getattr(os, "O_DIRECT", 0))

    def _write_out(self, data: memoryview) -> None:
        done = 0
        while done < len(data):  # a write may take fewer bytes than it is given
            try:
                done += os.write(self.fd, data[done:])
            except OSError as error:  # a file system that opens O_DIRECT but wants another alignment: buffered
                if error.errno != errno.EINVAL or not fcntl.fcntl(self.fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
                    raise
                self._buffered()


def save_direct(state: Any, path: str | Path, buffer: mmap.mmap, zipfile_serialization: bool = True) -> None:
    """``torch.save`` of ``state`` to ``path`` the way the background writer saves: without the CRC-32, past the page
    cache (:class:`DirectFile` through ``buffer``), flushed. Where the state holds a tensor large enough to be
    written in place, every tensor's bytes start on a block of the file (up to a block of padding per tensor, so
    files of small tensors only keep torch's 64 bytes)."""
    direct = DirectFile(path, buffer)
    alignment = (
        DirectFile.ALIGN if any_tensor(state, lambda t: t.numel() * t.element_size() >= ZERO_COPY_MIN_BYTES) else None
    )
    try:
        with without_crc32(alignment):
            torch.save(state, direct, _use_new_zipfile_serialization=zipfile_serialization)
    finally:
        direct.close()


def any_tensor(state: Any, predicate: Callable[[torch.Tensor], bool]) -> bool:
    """Whether a tensor anywhere in ``state`` (dicts, lists, tuples) satisfies ``predicate``."""
    if isinstance(state, torch.Tensor):
        return predicate(state)
    if isinstance(state, dict):
        return any(any_tensor(value, predicate) for value in state.values())
    if isinstance(state, list | tuple):
        return any(any_tensor(value, predicate) for value in state)
    return False


def tensor_devices(state: Any, cuda_only: bool = False) -> set[torch.device]:
    """The devices of the tensors anywhere in ``state`` (dicts, lists, tuples), CUDA ones only when asked."""
    if isinstance(state, torch.Tensor):
        return {state.device} if state.is_cuda or not cuda_only else set()
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list | tuple) else ()
    return set().union(*(tensor_devices(value, cuda_only) for value in values))


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` and the folders themselves to disk.

    A file listed but gone by the time it is opened was a temporary one renamed into place by its writer (an atomic
    write); the file it became is listed too, or was flushed with its folder.
    """
    for path in sorted(folder.rglob("*"), reverse=True):
        with contextlib.suppress(FileNotFoundError):
            fsync_path(path)
    fsync_path(folder)


class DeviceCopies:
    """A save's copies of CUDA tensors into pinned host memory, issued by the save call, finished by the GPU while
    training goes on (CUDA only; a CPU tensor never comes here).

    A tensor only an optimizer update changes (``lazy``) is copied on a side stream of its own: the side stream first
    waits for what training has queued (the update that made the state), then the GPU's copy engine moves the bytes
    while the next forward and backward run on training's stream. Training's stream does not wait for it; the update
    after it does, through the writer (:meth:`AsyncCheckpointer._before_update`). Any other tensor (a buffer the next
    forward changes in place, a temporary of the save) is copied on training's own stream, so the next forward is
    ordered after its copy. :meth:`events` marks the end of each, for the writer to wait on before it reads the
    host tensors.
    """

    def __init__(self) -> None:
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self._used: dict[int, torch.cuda.Stream] = {}  # the streams copied on since the last events()

    def begin(self, device: torch.device) -> None:
        """Before a file's copies: the side stream waits for everything training's stream has queued so far."""
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device=device)
        self._side[device].wait_stream(torch.cuda.current_stream(device))

    def copy(self, source: torch.Tensor, host: torch.Tensor, lazy: bool) -> None:
        """Queue ``host.copy_(source)`` (``host`` pinned) on the side stream (``lazy``) or on training's stream."""
        stream = self._side[source.device] if lazy else torch.cuda.current_stream(source.device)
        with torch.cuda.stream(stream):
            host.copy_(source.detach(), non_blocking=True)
        if lazy:  # the allocator must not hand the source's memory to training before the side stream has read it
            source.record_stream(stream)
        self._used[id(stream)] = stream

    def events(self) -> list[torch.cuda.Event]:
        """One event per stream copied on since the last call, recorded after its last copy."""
        events = []
        for stream in self._used.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        self._used.clear()
        return events


def snapshot_engine(checkpointer: AsyncCheckpointer, replaced: Any) -> Any:
    """A DeepSpeed checkpoint engine whose ``save`` snapshots now and lets ``checkpointer``'s thread write later.

    It is DeepSpeed's ``TorchCheckpointEngine`` (same files, same loading) with ``save`` replaced; made here, not
    at import, because importing DeepSpeed prints to stdout, which a recipe's ``--describe`` keeps for its JSON.

    Args:
        checkpointer: the rank's writer.
        replaced: the engine DeepSpeed built (its zip-serialization setting is kept), or None.
    """
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SnapshotCheckpointEngine(TorchCheckpointEngine):
        def save(self, state_dict: Any, path: str) -> None:
            checkpointer.enqueue_file(state_dict, path, self.zipfile_serialization)

        def preserves_storage_sharing(self) -> bool:
            return False  # snapshot() copies every tensor compactly: DeepSpeed's own clone would be a second copy

    engine = SnapshotCheckpointEngine(None)
    engine.name = "SnapshotCheckpointEngine"
    engine.zipfile_serialization = getattr(replaced, "zipfile_serialization", True)
    return engine


def run_when_idle() -> None:
    """Give the calling thread only the CPU time no other thread wants (Linux: ``SCHED_IDLE``, per thread; elsewhere
    a lower priority where it is allowed). The writer then takes the cycles the training threads leave while they
    wait in a collective, not theirs; when training waits for the writer (the next save, or the copy before an
    update), the training threads sleep and the writer runs, so it is never starved for good."""
    thread = threading.get_native_id()
    try:
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICE)


class Checkpointer:
    """The synchronous save: every rank writes and fsyncs, a barrier, rank 0 publishes, a barrier; the loop waits for
    the disk.

    :class:`AsyncCheckpointer` has the same interface; a recipe builds either with :func:`make_checkpointer`.

    Args:
        out_dir: the run directory.
        rank: this process's global rank.
        world_size: processes that write a share of each checkpoint.
        keep_last, keep_every: retention, applied by rank 0 when it publishes.
        barrier: the backend's barrier (``strategy.barrier``, ``accelerator.wait_for_everyone``).
    """

    def __init__(
        self,
        out_dir: str | Path,
        rank: int,
        world_size: int,
        keep_last: int,
        keep_every: int,
        barrier: Callable[[], None],
    ) -> None:
        self.out_dir, self.rank, self.world_size = Path(out_dir), rank, world_size
        self.keep_last, self.keep_every, self.barrier = keep_last, keep_every, barrier
        self.snapshot_bytes = 0  # host memory held for snapshots (none when synchronous)
        self.blocked_s: list[float] = []  # per save: how long the training loop waited

    def install(self, engine: Any) -> None:
        """Nothing to route: DeepSpeed's own checkpoint engine writes synchronously."""

    def save(self, step: int, write: Callable[[Path], None]) -> None:
        """Every rank: the backend's save into the temporary folder, then rank 0 publishes it.

        Args:
            step: the optimizer step being saved.
            write: the backend's save call, given the folder (``trainer.save_checkpoint``,
                ``accelerator.save_state``).
        """
        start = time.perf_counter()
        folder = tmp_checkpoint_dir(self.out_dir, step)
        with without_crc32():
            write(folder)
        fsync_tree(folder)  # on disk before `latest` can name it: a power loss must not leave it pointing at holes
        self.barrier()
        if self.rank == 0:
            publish_checkpoint(self.out_dir, step, self.keep_last, self.keep_every)
        self.barrier()
        self.blocked_s.append(time.perf_counter() - start)

    def finish(self) -> None:
        """Every rank, at the end of training (nothing is in flight)."""


def make_checkpointer(cfg: Any, rank: int, world_size: int, barrier: Callable[[], None]) -> Checkpointer:
    """The writer a recipe's config asks for: ``async_save`` picks it, ``out_dir``, ``keep_last``, ``keep_every`` and
    ``collective_timeout_s`` (how long rank 0 waits for the other ranks' writes) set it up. Under an FSDP2 preset the
    checkpoints are DCP's: asynchronous ones go through :class:`DcpAsyncCheckpointer` (every rank must then call this
    at the same point: it creates a process group)."""
    common = (cfg.out_dir, rank, world_size, cfg.keep_last, cfg.keep_every, barrier)
    if cfg.async_save and is_fsdp2_name(getattr(cfg, "preset", None)):
        return DcpAsyncCheckpointer(*common)
    if cfg.async_save:
        return AsyncCheckpointer(*common, publish_timeout_s=cfg.collective_timeout_s)
    return Checkpointer(*common)


class AsyncCheckpointer(Checkpointer):
    """One rank's background writer; see the module docstring for the protocol.

    Args: those of :class:`Checkpointer` (the barrier is not used: no rank waits for another to save), and
        publish_timeout_s: rank 0 gives up waiting for the other ranks' markers after this long (a rank died).

    ``snapshot_bytes`` is the largest snapshot held at once (the host memory saving costs this rank);
    ``written_s`` the time from snapshot to marker of each save, in the background.
    """

    def __init__(
        self,
        out_dir: str | Path,
        rank: int,
        world_size: int,
        keep_last: int,
        keep_every: int,
        barrier: Callable[[], None],
        publish_timeout_s: float = 900.0,
    ) -> None:
        super().__init__(out_dir, rank, world_size, keep_last, keep_every, barrier)
        self.publish_timeout_s = publish_timeout_s
        self._pool: dict[tuple, torch.Tensor] = {}  # the snapshot's host tensors, reused by the next save
        self.written_s: list[float] = []
        self.update_wait_s: list[float] = []  # per wait: how long an optimizer step waited for a save's copy
        self.writer_cpu_s: list[float] = []  # per save: the writer thread's CPU time (copy, write, fsync, publish)
        self._cpu_start: float | None = None
        # Tests only: slow every file write (or copy) down, so that a test can kill a rank while a write is in
        # flight (or take an optimizer step that must wait for the copy).
        self._write_delay_s = float(os.environ.get(WRITE_DELAY_ENV, "0"))
        self._copy_delay_s = float(os.environ.get(COPY_DELAY_ENV, "0"))
        self._lazy: set[int] | None = None  # the storages copied after the save call; None: copy everything in it
        self._device_copies = DeviceCopies()  # CUDA tensors: pinned memory, asynchronous copies
        self._engine: Any = None
        self._hooked: set[int] = set()  # ids of the torch optimizers that wait for the copy before they step
        self._copied = threading.Event()  # the last save's tensors are all in host memory
        self._copied.set()
        self._files: list[tuple] = []  # the last save's files: queued, then copied, then written (writer thread)
        self._direct_buffer = mmap.mmap(-1, DIRECT_BUFFER_BYTES)  # DirectFile's, allocated once
        self._pending_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-writer-{rank}", daemon=True)
        self._thread.start()

    def install(self, engine: Any) -> None:
        """Route a DeepSpeed engine's checkpoint files through this writer (after ``deepspeed.initialize``), and make
        its optimizer wait for a save's copy before it changes the state (see the module docstring)."""
        engine.checkpoint_engine = snapshot_engine(self, engine.checkpoint_engine)
        optimizer = torch_optimizer(engine)
        self._engine = engine if optimizer is not None and not swaps_to_nvme(engine) else None
        if self._engine is not None and id(optimizer) not in self._hooked:
            optimizer.register_step_pre_hook(self._before_update)
            self._hooked.add(id(optimizer))

    def save(self, step: int, write: Callable[[Path], None]) -> None:
        """Wait for the previous save, then run the backend's save into the temporary folder; returns once snapshotted.

        Args:
            step: the optimizer step being saved.
            write: the backend's save call, given the folder (``trainer.save_checkpoint`` or
                ``accelerator.save_state``); every rank calls it, as a synchronous save would.
        """
        start = time.perf_counter()
        self.wait()
        # Which storages may be copied after the save call: found again at each save (ZeRO may reallocate).
        self._lazy = updated_by_the_optimizer(self._engine, torch_optimizer(self._engine)) if self._engine else None
        self._copied.clear()
        folder = tmp_checkpoint_dir(self.out_dir, step)
        try:
            write(folder)
        except BaseException:
            self._queue.put(("abort",))  # what was queued is dropped, never published; no step waits for its copy
            raise
        self._queue.put(("done", step, folder, time.perf_counter()))
        self.blocked_s.append(time.perf_counter() - start)

    def enqueue_file(self, state: Any, path: str, zipfile_serialization: bool) -> None:
        # The pool is free to overwrite: save() waited for the previous write before the backend's save called us.
        lazy = self._lazy or set()
        # A CPU tensor that only an update changes is copied by the writer thread later; a CUDA tensor is queued for
        # the GPU to copy now (DeviceCopies), the update after the save waiting for that copy as for the writer's.
        defer = (lambda tensor: not tensor.is_cuda and storage_of(tensor) in lazy) if lazy else None
        for device in tensor_devices(state, cuda_only=True):
            self._device_copies.begin(device)
        copy, _ = snapshot(state, self._pool, (Path(path).name,), defer, self._copy_into)
        events = self._device_copies.events()
        self._queue.put(("file", copy, path, zipfile_serialization, events))

    def _copy_into(self, source: torch.Tensor, host: torch.Tensor) -> None:
        """The save call's copy of one tensor: through :class:`DeviceCopies` from a GPU, a plain copy on a CPU."""
        if source.is_cuda:
            lazy = self._lazy is not None and storage_of(source) in self._lazy
            self._device_copies.copy(source, host, lazy)
        else:
            host.copy_(source.detach())

    def _before_update(self, *_: Any) -> None:
        """Before the torch optimizer's step: wait until the last save's tensors are in host memory (counted as
        blocked time of that save)."""
        if self._copied.is_set():
            return
        start = time.perf_counter()
        self._copied.wait()
        waited = time.perf_counter() - start
        self.update_wait_s.append(waited)
        if self.blocked_s:
            self.blocked_s[-1] += waited

    def wait(self) -> None:
        """Block until every queued write (and rank 0's publish) is done; raise what the writer raised."""
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint write failed: {error}") from error

    def finish(self) -> None:
        """Every rank, at the end of training: wait for the last write (and, on rank 0, its publish)."""
        self.wait()

    # --- the writer thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        run_when_idle()

        while True:
            item = self._queue.get()
            try:
                if self._error is None:  # after a failure, drain without writing: the folder is never published
                    self._handle(item)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the training loop by wait()
                self._error = exc
            finally:
                if item[0] in ("done", "abort"):
                    self._files, self._pending_bytes, self._cpu_start = [], 0, None
                    self._copied.set()  # also after a failure: no optimizer step waits for a copy that never comes
                self._queue.task_done()

    def _handle(self, item: tuple) -> None:
        if item[0] == "abort":
            return
        if self._cpu_start is None:
            self._cpu_start = time.thread_time()
        if item[0] == "file":  # kept until the save call has returned: the copy does not compete with it
            self._files.append(item[1:])
            return
        _, step, folder, snapshotted_at = item
        for index, (state, path, zipfile_serialization, events) in enumerate(self._files):
            time.sleep(self._copy_delay_s)
            state, nbytes = snapshot(state, self._pool, (Path(path).name,))  # what the save call left by reference
            self._pending_bytes += nbytes
            for event in events:  # the GPU's copies of this file, queued by the save call, are in host memory
                event.synchronize()
            self._files[index] = (state, path, zipfile_serialization)
        self.snapshot_bytes = max(self.snapshot_bytes, self._pending_bytes)
        self._copied.set()  # the optimizer may change the live tensors from here on
        for state, path, zipfile_serialization in self._files:
            time.sleep(self._write_delay_s)
            save_direct(state, path, self._direct_buffer, zipfile_serialization)
        fsync_tree(folder)
        self._mark_written(folder)
        if self.rank == 0:
            self._publish_when_all_written(step, folder)
        self.written_s.append(time.perf_counter() - snapshotted_at)
        self.writer_cpu_s.append(time.thread_time() - self._cpu_start)

    def _mark_written(self, folder: Path) -> None:
        """Create and flush this rank's marker through one file descriptor, never by path again: once the marker is
        visible, rank 0 may rename the folder at any moment (its ``fsync_path(folder)`` flushes the marker's entry)."""
        fd = os.open(folder / f"{MARKER}{self.rank:05d}", os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _publish_when_all_written(self, step: int, folder: Path) -> None:
        deadline = time.monotonic() + self.publish_timeout_s
        while len(list(folder.glob(f"{MARKER}*"))) < self.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{folder}: only {len(list(folder.glob(f'{MARKER}*')))} of {self.world_size} ranks finished "
                    f"writing after {self.publish_timeout_s:.0f} s; not published"
                )
            time.sleep(PUBLISH_POLL_S)
        fsync_path(folder)  # every rank's marker entry on disk before the rename
        publish_checkpoint(self.out_dir, step, self.keep_last, self.keep_every)


class DcpAsyncCheckpointer(Checkpointer):
    """DCP's asynchronous save, published like every checkpoint here: rank 0 renames the folder and moves ``latest``
    only once every rank's shards and DCP's metadata are written and flushed.

    The save call copies this rank's state to host memory (the training loop waits for that only), then a thread
    writes the files and, over a gloo group of its own, gathers every rank's result on rank 0, which writes the
    metadata last: rank 0's write completes only after every rank has written. Two kinds of ``write`` go through it:
    ``common.fsdp2.dcp_write(..., async_group=self.group)``, which calls DCP's ``async_save`` and returns its future,
    and a front-end's own synchronous save (Lightning's ``trainer.save_checkpoint`` under ``ModelParallelStrategy``,
    :class:`common.strategy.AccelerateCheckpointIO`), each of whose ``dcp.save`` calls is deferred
    (:func:`deferred_dcp_saves`): staged to host memory in the call and written, in order, by one thread. Rank 0 then
    publishes from that thread (:func:`common.checkpoint.publish_checkpoint`: rename, ``latest``, retention). At
    most one save is in flight: the next waits for the previous. A crash mid-write leaves ``.tmp-step_N`` unnamed by
    ``latest``, deleted by the next publish or resume.

    Args: those of :class:`common.async_checkpoint.Checkpointer` (the barrier is not used). Every rank must construct
    it at the same point: it creates the gloo group collectively.
    """

    def __init__(
        self,
        out_dir: str | Path,
        rank: int,
        world_size: int,
        keep_last: int,
        keep_every: int,
        barrier: Callable[[], None],
    ) -> None:
        super().__init__(out_dir, rank, world_size, keep_last, keep_every, barrier)
        self.group = dist.new_group(backend="gloo")
        self.written_s: list[float] = []  # per save: from the save call to rank 0's publish (rank 0 only)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-writer")  # one save at a time
        self._future: Future | None = None
        self._error: BaseException | None = None
        self._published = threading.Event()
        self._published.set()

    def save(self, step: int, write: Callable[[Path], Any]) -> None:
        """Wait for the previous save, then start this one; returns once the state is copied to host memory.

        Args:
            step: the optimizer step being saved.
            write: ``dcp_write(model, optimizer, extra, async_group=self.group)`` (returns DCP's future), or a
                front-end's save call given the folder, whose ``dcp.save`` calls are deferred.
        """
        start = time.perf_counter()
        self.wait()
        folder = tmp_checkpoint_dir(self.out_dir, step)
        with deferred_dcp_saves() as deferred:
            future = write(folder)
        if not isinstance(future, Future):
            if not deferred:
                raise TypeError(f"{write!r} saved nothing through torch.distributed.checkpoint: not an FSDP2 save")
            future = self._writer.submit(write_deferred, deferred, self.group)
        self._future = future
        if self.rank == 0:
            self._published.clear()
            future.add_done_callback(lambda done: self._publish(done, step, folder, start))
        self.blocked_s.append(time.perf_counter() - start)

    def _publish(self, done: Future, step: int, folder: Path, started: float) -> None:
        """Rank 0, in DCP's writer thread once every rank has written: flush, rename into place, move ``latest``."""
        try:
            done.result()
            fsync_tree(folder)
            publish_checkpoint(self.out_dir, step, self.keep_last, self.keep_every)
            self.written_s.append(time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - raised in the training loop by wait()
            self._error = exc
        finally:
            self._published.set()

    def wait(self) -> None:
        """Block until the save in flight is written (and, on rank 0, published); raise what it raised."""
        future, self._future = self._future, None
        error: BaseException | None = None
        if future is not None:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below with the step's context
                error = exc
        self._published.wait()
        error, self._error = error or self._error, None
        if error is not None:
            raise RuntimeError(f"the background checkpoint write failed: {error}") from error

    def finish(self) -> None:
        """Every rank, at the end of training: wait for the last write (and, on rank 0, its publish)."""
        self.wait()
        self._writer.shutdown()


@contextlib.contextmanager
def deferred_dcp_saves() -> Iterator[list[tuple[Any, dict[str, Any]]]]:
    """While in the block, each ``torch.distributed.checkpoint.save(state_dict, ...)`` stages its state to host memory
    and returns, recording ``(staged state, keyword arguments)`` in the yielded list for :func:`write_deferred`.

    The front-ends' own saves call ``dcp.save`` synchronously (Lightning's ``ModelParallelStrategy`` imports it from
    the package at each save; :func:`common.fsdp2.dcp_write` calls ``dcp.save``): replacing the package's attribute
    for the length of one save call makes them asynchronous without a copy of their code.
    """
    deferred: list[tuple[Any, dict[str, Any]]] = []
    original = dcp.save

    def stage(state_dict: Any, *args: Any, **kwargs: Any) -> None:
        names = ("checkpoint_id", "storage_writer", "planner", "process_group", "no_dist")
        deferred.append((host_copy(state_dict), {**dict(zip(names, args)), **kwargs}))

    dcp.save = stage
    try:
        yield deferred
    finally:
        dcp.save = original


def host_copy(state: Any) -> Any:
    """A copy of a state dict that training cannot change: every tensor copied to host memory, a DTensor as a DTensor
    (its mesh and placements kept: DCP writes this rank's shard under the whole tensor's name)."""
    if isinstance(state, DTensor):
        local = state.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(
            local, state.device_mesh, state.placements, run_check=False, shape=state.shape, stride=state.stride()
        )
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: host_copy(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(host_copy(value) for value in state)
    return copy.deepcopy(state)


def write_deferred(deferred: list[tuple[Any, dict[str, Any]]], group: Any) -> None:
    """The writer thread: each deferred ``dcp.save``, in the order the front-end made them, over ``group`` (a gloo
    group of every rank, not the training's, whose collectives run meanwhile)."""
    # Tests only: each write held in flight this long, as common.fsdp2's writer holds the Accelerate loop's, so that a
    # test can kill a rank while a front-end's own save (Lightning's) is being written.
    write_delay_s = float(os.environ.get(WRITE_DELAY_ENV, "0"))
    for state_dict, kwargs in deferred:
        time.sleep(write_delay_s)
        dcp.save(state_dict, **{**kwargs, "process_group": group})
