"""``zero-recipes doctor`` in one process, its pure checks, and the hang diagnosis it shares with the recipes.

The measured parts (``--collectives``, a real hang) run in tests/distributed/test_hang.py; here: the command on
this machine (no GPU: it must say so and give the CPU facts), known-bad version pairs given as the test's own
versions, nccl-tests' bus bandwidth worked by hand, and the comparison of per-rank hang reports built by hand.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed

from common import hang
from common.hang import analyze, crash_frames, format_diagnosis, read_reports, settings_for
from common.tools import cli, doctor
from common.tools.doctor import bus_bandwidth, parse_dtypes, parse_sizes, slow_ranks, stage_advice, version_checks

EXE = shutil.which("zero-recipes")

# --- the command on this machine ---------------------------------------------------------------------------


def test_doctor_on_this_machine_says_no_gpu_and_gives_the_cpu_facts(tmp_path, capsys):
    assert cli.main(["doctor", "--out", str(tmp_path), "--checkpoint-path", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "doctor.json").read_text())
    hardware = report["hardware"]
    assert hardware["accelerator"] == "no GPU" and hardware["gpus"] == []
    assert "accelerator   no GPU" in out
    assert hardware["cpu_count"] == os.cpu_count() and f"of {os.cpu_count()} cores usable" in out
    meminfo = Path("/proc/meminfo").read_text().split()
    assert hardware["host_ram_bytes"] == int(meminfo[meminfo.index("MemTotal:") + 1]) * 1024
    assert hardware["checkpoint_free_bytes"] > 0  # the nearest existing folder of a path not created yet
    assert hardware["nvlink"].startswith("not found") and hardware["infiniband"] == "not found"
    assert report["versions"]["torch"] in out and "nccl          not used (no GPU)" in out
    assert {s["name"] for s in report["env"]} >= {"NCCL_ALGO", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["doctor", "--collectives"], "launch it like a recipe"),
        (["doctor", "--hang", "{tmp}"], "no hang reports in"),
        (["doctor", "--dtypes", "bf16"], "--dtypes"),  # read by --collectives only
    ],
)
def test_doctor_refuses_with_one_line(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as stop:
        cli.main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.startswith("error:") and says in err and len(err.splitlines()) == 1


def op_statuses(report: str) -> dict[str, str]:
    """Op name -> status from ``doctor --build-ops``'s lines (an op's line is indented two spaces, its detail six)."""
    return {line.split()[0]: line.split()[1] for line in report.splitlines() if re.match(r"  \S", line)}


def test_build_ops_loads_every_op_a_preset_can_need_here(capfd):
    """The ops were built before the suite (``.ci/run``) or on first use; either way each must load now. (capfd, not
    capsys: DeepSpeed's compatibility test compiles with the process's real stderr file descriptor.)"""
    assert cli.main(["doctor", "--build-ops"]) == 0
    statuses = op_statuses(capfd.readouterr().out)
    assert statuses == {"deepspeed_shm_comm": "ready", "cpu_adam": "ready", "async_io": "ready"}


def test_build_ops_without_a_compiler_fails_and_says_which_op(tmp_path):
    """A fresh extensions folder and no working compiler: every op fails to build or is unavailable, exit 1."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "false", "CC": "false"}
    proc = subprocess.run([EXE, "doctor", "--build-ops"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1 and str(tmp_path) in proc.stdout.splitlines()[0], proc.stdout + proc.stderr
    statuses = op_statuses(proc.stdout)
    assert statuses == {"deepspeed_shm_comm": "failed", "cpu_adam": "failed", "async_io": "unavailable"}, proc.stdout
    assert "apt-get install libaio-dev" in proc.stdout


def test_dtypes_are_parsed_and_a_bad_one_names_the_nearest():
    assert parse_dtypes("fp32, BF16,fp32") == ("fp32", "bf16")
    with pytest.raises(doctor.ConfigError, match="did you mean 'bf16'"):
        parse_dtypes("fp32,bf61")
    with pytest.raises(doctor.ConfigError, match="at least one"):
        parse_dtypes(" , ")


def test_sizes_are_parsed_and_a_bad_one_is_refused():
    assert parse_sizes("64KiB,1MiB, 2GiB,100,1MB") == [65536, 1 << 20, 2 << 30, 100, 1_000_000]
    with pytest.raises(doctor.ConfigError, match="not a size"):
        parse_sizes("64KB,lots")


# --- versions -----------------------------------------------------------------------------------------------


def ids(checks) -> set[str]:
    return {c.check_id for c in checks}


def test_a_known_bad_pair_is_flagged_with_its_issue_number():
    """DeepSpeed 0.19.2 with PEFT installed: ZeRO-3 + LoRA in bf16 fails (DeepSpeed #8072)."""
    checks = version_checks({"torch": "2.13.0", "deepspeed": "0.19.2", "peft": "0.21.0"})
    flagged = [c for c in checks if c.check_id == "deepspeed-8072-zero3-peft-bf16"]
    assert len(flagged) == 1 and flagged[0].severity == "error" and flagged[0].source == "DeepSpeed #8072"
    assert "deepspeed 0.19.2 with peft 0.21.0" in flagged[0].message
    assert "deepspeed-8148-frozen-recompute" in ids(checks)  # 0.19.2 also predates #8148


@pytest.mark.parametrize(
    ("versions", "absent"),
    [
        ({"deepspeed": "0.19.2"}, "deepspeed-8072-zero3-peft-bf16"),  # no PEFT: not the pair
        ({"deepspeed": "0.19.3", "peft": "0.21.0"}, "deepspeed-8072-zero3-peft-bf16"),  # fixed
        ({"deepspeed": "0.19.3", "peft": "0.21.0"}, "deepspeed-8148-frozen-recompute"),
    ],
)
def test_fixed_or_incomplete_pairs_are_not_flagged(versions, absent):
    assert absent not in ids(version_checks(versions))


def test_pins_defaults_and_the_guides_old_pairs():
    checks = version_checks(
        {"torch": "1.11.0", "deepspeed": "0.6.5", "lightning": "2.7.0", "nccl": "2.8.4", "cuda": "10.2"},
        lightning_pin="<0.17.0,>=0.15.0",
        clipping_default=1.0,
        tested_lightning=">=2.6,<2.7",
    )
    assert ids(checks) >= {
        "lightning-deepspeed-pin",
        "lightning-untested",
        "deepspeed-8068-clipping-default",
        "torch-zero-memory-leak",
        "deepspeed-0.6-zero3-sync",
        "nccl-version",
        "fused-adam-cuda",
    }
    inside = version_checks(
        {"deepspeed": "0.16.0", "lightning": "2.6.6"}, lightning_pin="<0.17.0,>=0.15.0", tested_lightning=">=2.6,<2.7"
    )
    assert not ids(inside) & {"lightning-deepspeed-pin", "lightning-untested", "deepspeed-8068-clipping-default"}


# --- measured figures (pure) ---------------------------------------------------------------------------------


def test_bus_bandwidth_is_nccl_tests_definition():
    """nccl-tests (doc/PERFORMANCE.md): busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for the gathers."""
    gigabyte = 1e9
    assert bus_bandwidth("all_reduce", gigabyte, 1.0, 8) == pytest.approx(1.75e9)
    assert bus_bandwidth("all_gather", gigabyte, 0.5, 4) == pytest.approx(1.5e9)
    assert bus_bandwidth("reduce_scatter", gigabyte, 2.0, 2) == pytest.approx(0.25e9)


@pytest.mark.parametrize(
    ("op", "message_bytes"), [("all_reduce", 4096), ("all_gather", 1 << 20), ("reduce_scatter", 16 << 20)]
)
def test_each_timed_call_moves_buffers_no_call_before_it_touched(monkeypatch, op, message_bytes):
    """One buffer timed back to back runs from the CPU's cache, which a training step's buffers do not: every timed
    call takes its own buffers from a pool of BUFFER_POOL_BYTES, reused only once the whole pool has gone by. Counted
    from the buffers each real gloo call (one rank) received."""
    name = {
        "all_reduce": "all_reduce",
        "all_gather": "all_gather_into_tensor",
        "reduce_scatter": "reduce_scatter_tensor",
    }
    real, seen = getattr(torch.distributed, name[op]), []

    def counted(*args, **kwargs):
        seen.append(args[0].data_ptr())  # the output buffer (all-reduce's only one)
        return real(*args, **kwargs)

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(torch.distributed, name[op], counted)
        iters = 20
        doctor._time_collective(op, message_bytes, iters, torch.device("cpu"))
    finally:
        torch.distributed.destroy_process_group()
    timed = seen[1 : iters + 1]  # after the warm-up call (an all-reduce's last call is the timing's own maximum)
    slots = doctor.buffer_slots(message_bytes)
    assert len(set(timed)) == min(slots, iters)  # as many distinct buffers as the pool holds, up to one per call
    assert all(timed[i] != timed[i - 1] for i in range(1, iters))  # never the previous call's buffer
    assert all(timed[i] == timed[i - slots] for i in range(slots, iters))  # a buffer returns after the whole pool
    assert seen[0] not in timed[: min(slots, iters) - 1]  # the warm-up's buffer is the last the rotation reaches


def test_a_burst_of_other_work_during_one_round_does_not_move_the_figure(monkeypatch):
    """On a clock that each real gloo call (one rank) moves by 1 ms, and one call by 100 ms (a neighbour's burst): the
    figure is the median round's 1 ms a call, where the mean of all calls would say 6 ms."""
    clock = {"now": 0.0, "calls": 0}
    real = torch.distributed.all_gather_into_tensor

    def slow_once(*args, **kwargs):
        clock["calls"] += 1
        clock["now"] += 0.1 if clock["calls"] == 4 else 1e-3  # the warm-up is call 1: call 4 is in the first round
        return real(*args, **kwargs)

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(torch.distributed, "all_gather_into_tensor", slow_once)
        monkeypatch.setattr(doctor.time, "perf_counter", lambda: clock["now"])
        seconds = doctor._time_collective("all_gather", 4096, 20, torch.device("cpu"))
    finally:
        torch.distributed.destroy_process_group()
    assert clock["calls"] == 21  # the warm-up and 20 timed calls, in 5 rounds of 4
    assert seconds == pytest.approx(1e-3)


def test_a_rank_more_than_ten_percent_behind_the_median_is_named():
    assert slow_ranks([100.0, 100.0, 85.0, 100.0]) == [2]
    assert slow_ranks([100.0, 95.0]) == []  # median 97.5: 95 is 2.6 % behind
    assert slow_ranks([100.0, 40.0]) == [1]  # median 70: 40 is 43 % behind


def test_the_guides_stage_advice_at_25_gbps():
    assert stage_advice(10.0).severity == "warning" and "ZeRO-2" in stage_advice(10.0).fix
    assert stage_advice(100.0).severity == "ok"
    assert stage_advice(None).severity == "info"


# --- the hang diagnosis (pure: reports built by hand) ----------------------------------------------------------


def record(seq: int, op: str = "all_reduce", shape: tuple[int, ...] = (1,), group: str = "0") -> dict:
    return {
        "group": group,
        "seq": seq,
        "op": op,
        "input_sizes": [list(shape)],
        "dtypes": ["Float"],
        "time_created_ns": seq * 1000,
    }


def report(rank: int, records: list[dict], where: str = "", **extra) -> dict:
    return {"rank": rank, "world_size": 2, "collectives": records, "where": where, "reason": "r", **extra}


def test_a_rank_that_skipped_a_collective_is_behind_at_that_collective():
    common = [record(s) for s in range(1, 6)]
    reports = {0: report(0, [*common, record(6)]), 1: report(1, common)}
    diagnosis = analyze(reports)
    assert diagnosis.behind == [1] and diagnosis.seq == 6
    assert diagnosis.issued == {0: "all_reduce [1] Float", 1: "nothing"}
    assert "rank(s) 1 fell behind" in format_diagnosis(diagnosis)


@pytest.mark.parametrize("rank1_first_ns", [-5_000_000, 5_000_000])  # rank 1 won or lost the race by 5 ms
def test_a_skip_into_another_group_names_the_skipped_collective_whoever_won_the_race(rank1_first_ns):
    """Rank 1 skipped all_reduce #6 on the default group and went on into group 1's #3, where rank 0 never follows:
    two disagreements a moment apart. Which was created first is a race between the ranks (seen in CI): the
    diagnosis names the skipped one either way. One created much later is a consequence and is not named."""
    common = [record(s) for s in range(1, 6)] + [record(s, group="1") for s in (1, 2)]
    skipped = record(6)
    onward = {**record(3, group="1"), "time_created_ns": skipped["time_created_ns"] + rank1_first_ns}
    diagnosis = analyze({0: report(0, [*common, skipped]), 1: report(1, [*common, onward])})
    assert (diagnosis.group, diagnosis.seq, diagnosis.behind) == ("0", 6, [1])
    later = {**onward, "time_created_ns": skipped["time_created_ns"] - 10**10}  # group 1's came 10 s earlier
    diagnosis = analyze({0: report(0, [*common, skipped]), 1: report(1, [*common, later])})
    assert (diagnosis.group, diagnosis.seq) == ("1", 3)


def test_a_shape_mismatch_names_both_shapes_and_nobody_behind():
    common = [record(s) for s in range(1, 6)]
    reports = {0: report(0, [*common, record(6)]), 1: report(1, [*common, record(6, shape=(2,))])}
    diagnosis = analyze(reports)
    assert diagnosis.behind == [] and diagnosis.seq == 6
    assert diagnosis.issued == {0: "all_reduce [1] Float", 1: "all_reduce [2] Float"}


def test_rings_that_dropped_different_old_entries_are_compared_where_both_have_them():
    reports = {0: report(0, [record(s) for s in range(3, 10)]), 1: report(1, [record(s) for s in range(5, 10)])}
    diagnosis = analyze(reports)
    assert diagnosis.seq is None and diagnosis.behind == []


def test_torchs_detail_check_message_is_used_with_the_flight_recorders_numbering():
    message = (
        "RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=17, OpType=ALLREDUCE, TensorShape=[1], TensorDtypes=Float, ...), "
        "but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=17, OpType=ALLREDUCE, "
        "TensorShape=[2], TensorDtypes=Float, ...)."
    )
    reports = {0: report(0, [], exception=message), 1: report(1, [])}
    diagnosis = analyze(reports)
    assert diagnosis.seq == 18 and diagnosis.issued == {0: "all_reduce [1] Float", 1: "all_reduce [2] Float"}
    assert "DETAIL" in diagnosis.source


# faulthandler's dump when gloo aborts from its C++ thread: the "current" Python thread is whichever held the GIL.
CRASH = """Fatal Python error: Aborted

Current thread 0x00007fb8201206c0 (most recent call first):
  File "/x/common/hang.py", line 255 in _watch

Thread 0x00007fb8507d8b80 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/work/train.py", line 57 in logged_loss
  File "/work/train.py", line 82 in training_step

Thread 0x00007fb8209216c0 (most recent call first):
  File "/site-packages/lightning/fabric/strategies/launchers/subprocess_script.py", line 205 in run
"""


def test_a_crashed_rank_is_named_with_the_collective_its_stack_was_in():
    assert crash_frames(CRASH)[-1]["function"] == "all_reduce"
    reports = {0: report(0, [record(s) for s in range(1, 8)]), 1: None}
    diagnosis = analyze(reports, {1: CRASH})
    assert diagnosis.silent == [1] and diagnosis.seq == 7
    assert "crashed, waiting in all_reduce" in diagnosis.issued[1] and "train.py:57" in diagnosis.issued[1]
    assert "rank(s) 1 crashed or were killed" in format_diagnosis(diagnosis)


def test_doctor_hang_reads_the_files_a_run_wrote(tmp_path, capsys):
    hang_dir = tmp_path / "hang"
    hang_dir.mkdir()
    for rank, records in ((0, [record(1), record(2)]), (1, [record(1)])):
        (hang_dir / f"rank{rank}.json").write_text(json.dumps(report(rank, records, where=f"where {rank}")))
    reports, crashes = read_reports(hang_dir)
    assert set(reports) == {0, 1} and crashes == {}
    assert cli.main(["doctor", "--hang", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "rank(s) 1 fell behind" in out
        and "#2 on process group 0 (rank 0: all_reduce [1] Float; rank 1: nothing)" in out
    )


def test_reports_go_to_the_run_directory_else_the_environment_else_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(hang.HANG_DIR_ENV, raising=False)
    assert settings_for(timedelta(seconds=20), tmp_path / "run") == hang.HangSettings(20.0, tmp_path / "run" / "hang")
    assert settings_for(None, None).hang_dir == tmp_path / "hang"
    assert settings_for(None, None).timeout_s == hang.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(hang.HANG_DIR_ENV, str(tmp_path / "elsewhere"))
    assert settings_for(None, None).hang_dir == tmp_path / "elsewhere"


def test_user_stops_and_bad_input_do_not_stop_the_other_ranks():
    assert hang.is_reportable(RuntimeError("gloo timed out"))
    assert not hang.is_reportable(KeyboardInterrupt())
    assert not hang.is_reportable(doctor.ConfigError("bad key"))
