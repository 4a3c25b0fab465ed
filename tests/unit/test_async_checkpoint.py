"""The asynchronous checkpoint writer: snapshot semantics and the publish protocol, in one process.

Two AsyncCheckpointers with ranks 0 and 1 share a run directory, as two processes would (the protocol between
ranks is files: one marker per rank, rank 0 publishes). DeepSpeed's side is its checkpoint-engine call, ``save(state,
path)`` of the engine ``snapshot_engine`` makes; the 2-process runs through both backends, including a SIGKILL during
an in-flight write, are in tests/recipes/test_resume.py.

A write is held in flight deterministically by a state object whose pickling waits on an event (no sleeps).
"""

from __future__ import annotations

import collections
import fcntl
import mmap
import os
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from common.async_checkpoint import (
    MARKER,
    WRITE_DELAY_ENV,
    ZERO_COPY_MIN_BYTES,
    AsyncCheckpointer,
    Checkpointer,
    DirectFile,
    page_aligned_empty,
    save_direct,
    snapshot,
    snapshot_engine,
    without_crc32,
    write_deferred,
)
from common.checkpoint import latest_checkpoint


class Gate:
    """Pickling this blocks until ``open`` is set: the background write is in flight until then."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def __reduce__(self):
        assert self.open.wait(60), "gate never opened"
        return (collections.OrderedDict, ())  # loads with weights_only=True

    def __deepcopy__(self, memo):
        return self  # the snapshot keeps the gate itself: its pickling is the write it holds


def no_barrier() -> None:
    pass


def wait_for(condition, seconds: float) -> bool:
    """Whether ``condition()`` became true within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def pair(out_dir: Path) -> list[AsyncCheckpointer]:
    return [AsyncCheckpointer(out_dir, rank, 2, keep_last=2, keep_every=0, barrier=no_barrier) for rank in (0, 1)]


def writer(checkpointer, state: dict):
    """What DeepSpeed's save_checkpoint does on one rank: one file per rank through its checkpoint engine."""
    engine = snapshot_engine(checkpointer, replaced=None)

    def write(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        engine.save(state, str(folder / f"rank{checkpointer.rank}_states.pt"))

    return write


def test_snapshot_copies_every_tensor_compactly_and_keeps_container_types():
    flat = torch.arange(1000, dtype=torch.float32)
    Pair = collections.namedtuple("Pair", "a b")
    state = {"partition": flat[10:20], "steps": collections.defaultdict(int, {"x": 3}), "pair": Pair(flat[:2], 7)}
    copy, nbytes = snapshot(state)
    flat.add_(1.0)  # the next optimizer step, in place
    assert copy["partition"].tolist() == list(map(float, range(10, 20)))
    assert copy["partition"].untyped_storage().nbytes() == 10 * 4  # not the whole 1000-element buffer
    assert isinstance(copy["steps"], collections.defaultdict) and copy["steps"]["missing"] == 0
    assert isinstance(copy["pair"], Pair) and copy["pair"].b == 7 and copy["pair"].a.tolist() == [0.0, 1.0]
    assert nbytes == (10 + 2) * 4


def test_the_loss_scaler_is_written_as_it_was_at_the_save_not_as_the_next_steps_left_it(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from common.tools.zero_files import deepspeed_pickle_classes

    scaler = DynamicLossScaler(2.0**16, 2, 1.0, 2, False)  # a scale window of 2: the scale doubles every 2 steps
    for _ in range(3):
        scaler.update_scale(False)
    at_save = (scaler.cur_iter, scaler.cur_scale)
    rank0, rank1 = pair(tmp_path)
    gate = Gate()
    for rank in (rank0, rank1):  # both writes stay in flight; each pickles the scaler only after the gate opens
        rank.save(3, writer(rank, {"gate": gate, "loss_scaler": scaler}))
    for _ in range(2):
        scaler.update_scale(False)  # the next steps, as ZeRO's optimizer takes them, while the writes go on
    assert (scaler.cur_iter, scaler.cur_scale) != at_save
    gate.open.set()
    rank1.finish()
    rank0.finish()
    latest = latest_checkpoint(tmp_path)
    with torch.serialization.safe_globals(deepspeed_pickle_classes()):
        for rank in (0, 1):
            saved = torch.load(latest / f"rank{rank}_states.pt", weights_only=True)["loss_scaler"]
            assert (saved.cur_iter, saved.cur_scale) == at_save


def test_latest_moves_only_after_every_rank_wrote_and_holds_the_state_at_snapshot_time(tmp_path):
    rank0, rank1 = pair(tmp_path)
    weights = [torch.zeros(4), torch.ones(4)]
    gate = Gate()
    rank0.save(4, writer(rank0, {"w": weights[0]}))
    rank1.save(4, writer(rank1, {"w": weights[1], "gate": gate}))  # returns with rank 1's write in flight
    for w in weights:
        w.add_(5.0)  # training goes on and changes the live tensors
    rank0_marker = tmp_path / "checkpoints" / ".tmp-step_000004" / f"{MARKER}00000"
    assert wait_for(rank0_marker.exists, 30)  # rank 0 has written its share...
    assert not wait_for(lambda: latest_checkpoint(tmp_path) is not None, 0.5)  # ...and publishes nothing without rank 1
    gate.open.set()
    rank1.finish()
    rank0.finish()
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step_000004"
    for rank, expected in ((0, 0.0), (1, 1.0)):
        state = torch.load(latest / f"rank{rank}_states.pt", weights_only=True)
        assert state["w"].tolist() == [expected] * 4
    assert sorted(p.name for p in latest.glob(".written-rank*")) == [".written-rank00000", ".written-rank00001"]
    assert rank0.snapshot_bytes == 16 and len(rank0.blocked_s) == 1


def test_a_second_save_waits_for_the_first_to_be_published(tmp_path):
    rank0, rank1 = pair(tmp_path)
    gate = Gate()
    rank1.save(4, writer(rank1, {"w": torch.ones(2)}))
    rank0.save(4, writer(rank0, {"w": torch.ones(2), "gate": gate}))
    second = threading.Thread(target=rank0.save, args=(8, writer(rank0, {"w": torch.zeros(2)})))
    second.start()
    second.join(timeout=1.0)
    assert second.is_alive()  # still waiting: the step-4 write holds the only slot
    assert not (tmp_path / "checkpoints" / ".tmp-step_000008").exists()  # no second writer on the folder
    gate.open.set()
    second.join(timeout=60)
    assert not second.is_alive()
    rank1.save(8, writer(rank1, {"w": torch.zeros(2)}))
    rank0.finish()
    assert latest_checkpoint(tmp_path).name == "step_000008"


def test_a_failed_write_is_raised_in_the_training_loop_and_never_published(tmp_path):
    rank0, rank1 = pair(tmp_path)
    rank1.save(4, writer(rank1, {"w": torch.ones(2)}))
    rank0.save(4, writer(rank0, {"unpicklable": lambda: None}))
    with pytest.raises(RuntimeError, match="background checkpoint write failed"):
        rank0.finish()
    assert latest_checkpoint(tmp_path) is None


def test_the_synchronous_checkpointer_publishes_before_save_returns(tmp_path):
    sync = Checkpointer(tmp_path, 0, 1, keep_last=1, keep_every=0, barrier=no_barrier)

    def write(folder: Path) -> None:
        folder.mkdir(parents=True)
        torch.save({"w": torch.ones(1)}, folder / "states.pt")

    sync.save(2, write)
    assert latest_checkpoint(tmp_path).name == "step_000002" and sync.snapshot_bytes == 0


def test_the_next_snapshot_reuses_the_host_tensors_of_the_last():
    pool: dict = {}
    live = {"w": torch.zeros(8), "step": 3}
    first, _ = snapshot(live, pool, ("states.pt",))
    live["w"].add_(2.0)
    second, nbytes = snapshot(live, pool, ("states.pt",))
    assert second["w"].data_ptr() == first["w"].data_ptr()  # no new allocation
    assert second["w"].tolist() == [2.0] * 8 and nbytes == 32
    other, _ = snapshot({"w": torch.zeros(4)}, pool, ("states.pt",))  # another shape: a tensor of its own
    assert other["w"].data_ptr() != first["w"].data_ptr()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_every_file_the_rename_and_latest_are_on_disk_before_latest_names_the_step(tmp_path, monkeypatch, asynchronous):
    """A power loss after ``latest`` moved must find the files it names: each fsync is recorded (by the path behind
    the descriptor) together with what ``latest`` said at that moment."""
    real_fsync, synced = os.fsync, []
    pointer = tmp_path / "checkpoints" / "latest"

    def recording_fsync(fd: int) -> None:
        latest = pointer.read_text().strip() if pointer.exists() else None
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), latest))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    kind = AsyncCheckpointer if asynchronous else Checkpointer
    checkpointer = kind(tmp_path, 0, 1, keep_last=1, keep_every=0, barrier=no_barrier)
    if asynchronous:
        checkpointer.save(2, writer(checkpointer, {"w": torch.ones(2)}))
    else:

        def write(folder: Path) -> None:
            (folder / "tag").mkdir(parents=True)
            torch.save({"w": torch.ones(2)}, folder / "tag" / "rank0_states.pt")

        checkpointer.save(2, write)
    checkpointer.finish()
    assert latest_checkpoint(tmp_path).name == "step_000002"
    before_latest = {path for path, latest in synced if latest is None}
    tmp = tmp_path / "checkpoints" / ".tmp-step_000002"
    written = {
        str(tmp / p.relative_to(tmp_path / "checkpoints" / "step_000002"))
        for p in (tmp_path / "checkpoints" / "step_000002").rglob("*")
    }
    assert written and written <= before_latest  # every file and folder of the checkpoint
    assert str(tmp_path / "checkpoints") in before_latest  # the rename into step_000002
    assert any(Path(path).name.startswith(".latest.tmp") for path in before_latest)  # the pointer's own bytes


def test_a_rank_never_touches_its_folder_by_path_once_its_marker_is_visible(tmp_path, monkeypatch):
    """Rank 0 publishes (renames the folder) as soon as every marker is there: a rank that opened its marker by path
    after creating it lost that race in CI (FileNotFoundError on ``.tmp-step_*/.written-rank00001``). Here rank 1's
    writer is made slow after its marker appears, until rank 0 has published: it must still finish cleanly."""
    rank0, rank1 = pair(tmp_path)
    marker = tmp_path / "checkpoints" / ".tmp-step_000004" / f"{MARKER}00001"
    real_open, real_fsync = os.open, os.fsync

    def after_rank0_published_if_rank1_marked(call):
        def slowed(*args, **kwargs):
            if threading.current_thread().name == "checkpoint-writer-1" and marker.exists():
                assert wait_for(lambda: latest_checkpoint(tmp_path) is not None, 30)
            return call(*args, **kwargs)

        return slowed

    monkeypatch.setattr(os, "open", after_rank0_published_if_rank1_marked(real_open))
    monkeypatch.setattr(os, "fsync", after_rank0_published_if_rank1_marked(real_fsync))
    rank0.save(4, writer(rank0, {"w": torch.zeros(2)}))
    rank1.save(4, writer(rank1, {"w": torch.ones(2)}))
    rank1.finish()  # raises "background checkpoint write failed" if rank 1 lost the race
    rank0.finish()
    assert latest_checkpoint(tmp_path).name == "step_000004"


def data_record_crcs(path: Path) -> list[int]:
    """The CRC-32 fields of a torch file's tensor-data records (0 where torch.save did not compute them)."""
    with zipfile.ZipFile(path) as archive:
        return [info.CRC for info in archive.infolist() if "/data/" in info.filename]


def test_torch_load_never_checks_the_crc32_which_is_why_the_writers_skip_it(tmp_path):
    """The premise of ``without_crc32``: a flipped byte in a file saved with its CRC loads without error."""
    tensor = torch.arange(1_000_000, dtype=torch.float32)
    path = tmp_path / "with_crc.pt"
    torch.save({"t": tensor}, path)
    assert all(data_record_crcs(path))  # torch.save computed them
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # inside the tensor's 4 MB
    path.write_bytes(bytes(damaged))
    assert not torch.equal(torch.load(path, weights_only=True)["t"], tensor)  # no error: the CRC is never read

    with without_crc32():
        torch.save({"t": tensor}, tmp_path / "without_crc.pt")
    assert data_record_crcs(tmp_path / "without_crc.pt") == [0]
    assert torch.equal(torch.load(tmp_path / "without_crc.pt", weights_only=True)["t"], tensor)
    torch.save({"t": tensor}, tmp_path / "after.pt")
    assert all(data_record_crcs(tmp_path / "after.pt"))  # the setting was given back


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_both_writers_save_without_the_crc32(tmp_path, asynchronous):
    kind = AsyncCheckpointer if asynchronous else Checkpointer
    checkpointer = kind(tmp_path, 0, 1, keep_last=1, keep_every=0, barrier=no_barrier)
    checkpointer.save(2, writer(checkpointer, {"w": torch.ones(1000)}) if asynchronous else plain_writer)
    checkpointer.finish()
    files = list(latest_checkpoint(tmp_path).rglob("*.pt"))
    assert files and all(data_record_crcs(path) == [0] for path in files)
    assert torch.load(files[0], weights_only=True)["w"].tolist() == [1.0] * 1000


def plain_writer(folder: Path) -> None:
    """What DeepSpeed's own (synchronous) checkpoint engine does: ``torch.save`` into the folder."""
    folder.mkdir(parents=True)
    torch.save({"w": torch.ones(1000)}, folder / "rank0_states.pt")


@pytest.mark.parametrize("sizes", [[0], [100], [8192], [8192, 8192, 5], [3, 20000, 1, 4095]])
def test_direct_file_writes_every_byte_through_its_aligned_buffer(tmp_path, sizes):
    """Chunks smaller than, equal to and larger than the buffer (8 KiB here), and an unaligned tail."""
    chunks = [os.urandom(n) for n in sizes]
    direct = DirectFile(tmp_path / "f.bin", mmap.mmap(-1, 8192))
    if os.uname().sysname == "Linux" and os.statvfs(tmp_path).f_bsize <= DirectFile.ALIGN:
        assert fcntl.fcntl(direct.fd, fcntl.F_GETFL) & os.O_DIRECT  # the page cache is bypassed
    assert [direct.write(chunk) for chunk in chunks] == sizes
    direct.close()
    assert (tmp_path / "f.bin").read_bytes() == b"".join(chunks)


def direct_io(path: Path) -> bool:
    """Whether ``path``'s file system takes ``O_DIRECT`` (tmpfs does not; then every write is buffered)."""
    try:
        os.close(os.open(path / ".direct-probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644))
    except OSError:
        return False
    return hasattr(os, "O_DIRECT")


def test_large_snapshot_tensors_start_on_a_page_of_their_own():
    large = page_aligned_empty(torch.zeros(ZERO_COPY_MIN_BYTES // 2, dtype=torch.bfloat16).view(-1, 8))
    assert large.untyped_storage().data_ptr() % mmap.PAGESIZE == 0 and large.shape == (ZERO_COPY_MIN_BYTES // 16, 8)
    assert large.dtype == torch.bfloat16 and large.is_contiguous()
    assert large.untyped_storage().nbytes() == ZERO_COPY_MIN_BYTES  # the storage is the tensor, nothing around it
    transposed = torch.randn(512, ZERO_COPY_MIN_BYTES // 2048).t()  # a non-contiguous view: copied compact
    copy, _ = snapshot({"w": transposed})
    assert copy["w"].untyped_storage().data_ptr() % mmap.PAGESIZE == 0 and torch.equal(copy["w"], transposed)


def test_a_page_aligned_tensor_goes_to_disk_from_where_it_is(tmp_path, monkeypatch):
    """The snapshot's large tensors are written by ``os.write`` from their own memory (no copy into the buffer), the
    unaligned tail and the small tensors through the buffer; every byte loads back as saved."""
    if not direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    live = {
        "big": torch.randn(ZERO_COPY_MIN_BYTES // 4 + 5),
        "small": torch.arange(7),
        "other": torch.randn(3, 100_000),
    }
    state, _ = snapshot(live)
    real_write, written_from = os.write, []

    def recording_write(fd: int, data) -> int:
        view = memoryview(data)
        written_from.append((int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0, len(view)))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", recording_write)
    save_direct(state, tmp_path / "s.pt", mmap.mmap(-1, 8192))
    monkeypatch.undo()
    for name in ("big", "other"):
        storage = state[name].untyped_storage()
        assert (storage.data_ptr(), storage.nbytes() // 4096 * 4096) in written_from, name
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    assert all(torch.equal(loaded[name], live[name]) for name in live)


def test_a_torch_save_through_a_direct_file_loads_as_saved(tmp_path):
    state = {"w": torch.randn(3000), "ids": torch.arange(7), "step": 5}
    direct = DirectFile(tmp_path / "s.pt", mmap.mmap(-1, 8192))
    torch.save(state, direct)
    direct.close()
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["ids"], state["ids"]) and loaded["step"] == 5


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: as asked
def test_the_test_write_delay_holds_a_front_ends_deferred_dcp_save_before_it_writes(tmp_path, monkeypatch):
    """Lightning's own FSDP2 save reaches DCP through :func:`write_deferred`: the test-only write delay must hold it
    before anything is written, as common.fsdp2's writer holds the Accelerate loop's (the SIGKILL test of
    tests/recipes/test_fsdp2_recipes.py kills a rank inside that window on both front-ends)."""
    import common.async_checkpoint as async_checkpoint

    folder = tmp_path / "step"
    held = []  # (seconds, whether DCP's metadata existed yet) per sleep of the writer
    monkeypatch.setenv(WRITE_DELAY_ENV, "2.5")
    monkeypatch.setattr(async_checkpoint.time, "sleep", lambda s: held.append((s, (folder / ".metadata").exists())))
    write_deferred([({"w": torch.arange(4.0)}, {"checkpoint_id": folder, "no_dist": True})], group=None)
    assert held == [(2.5, False)]  # held once, before the write
    assert (folder / ".metadata").is_file()  # then written
