"""A run that hangs explains itself: faults injected into a real ZeRO-2 run on the factory, of 2 and 4 processes.

tests/distributed/hang_worker.py trains through ``lightning_trainer_kwargs`` / ``accelerator_kwargs`` (hang detection
comes from those calls alone, as in a recipe) and, at optimizer step 2, makes one rank (a) skip the loss all-reduce,
(b) all-reduce 2 numbers where the others all-reduce 1, or (c) sleep forever inside the step. The faulty rank is
rank 1 or rank 0 of 2 (rank 0 is the process Lightning's launcher runs in, and the one that writes the run's files)
and rank 2 of 4. For each: every process exits within 60 s after the collective timeout (10 s), none is left
running, and the diagnosis (the error message, the files in RUN/hang/ and ``zero-recipes doctor --hang RUN``) names
the faulty rank and the collective, by the sequence number the faulty rank recorded for itself before the fault (an
independent record: the worker reads torch's counter, the diagnosis reads the ranks' flight recorders).

Then ``zero-recipes doctor --collectives`` on the 2-node localhost layout (one torchrun per "node"), with rank 1's
matmuls slowed down by tests/distributed/slow_rank_doctor.py, names rank 1 as the slow rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from _marked_processes import kill_left_after
from _util import PYTHON, REPO, free_port, subprocess_env

from common.hang import analyze, read_reports
from common.strategy import RunFacts, resolve_deepspeed_config, write_accelerate_files
from common.tools import cli

WORKER = REPO / "tests" / "distributed" / "hang_worker.py"
SLOW_DOCTOR = REPO / "tests" / "distributed" / "slow_rank_doctor.py"
TIMEOUT_S = 10  # the collective timeout of the faulty runs
EXIT_WITHIN_S = 60  # after the timeout, every process must be gone
START_UP_S = 240  # imports, DeepSpeed set-up and the first steps on a loaded 2-core machine
MARKER = "ZR_HANG_TEST_RUN"


def launch(backend: str, fault: str, fault_rank: int, world: int, out: Path) -> tuple[str, float]:
    """Run the worker as a user would; return (its output, seconds from the fault until no process of it is left)."""
    run_id = uuid.uuid4().hex
    args = ["--backend", backend, "--fault", fault, "--fault-rank", str(fault_rank), "--timeout", str(TIMEOUT_S)]
    args += ["--out", str(out)]
    if backend == "lightning":
        command = [PYTHON, WORKER, *args, "--processes", str(world)]
    else:
        facts = RunFacts(world_size=world, micro_batch_size=8, precision="fp32")
        config = write_accelerate_files(resolve_deepspeed_config("deepspeed_stage_2", facts), out / "launch", world)
        command = [PYTHON, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", str(world)]
        command += ["--main_process_port", str(free_port()), WORKER, *args]
    env = subprocess_env(**{MARKER: run_id})
    with subprocess.Popen(
        [str(a) for a in command], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            output = proc.communicate(timeout=START_UP_S + TIMEOUT_S + EXIT_WITHIN_S)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
    fault_file = out / "fault.json"
    assert fault_file.exists(), f"the fault never happened:\n{output[-4000:]}"
    fault_time = json.loads(fault_file.read_text())["time"]
    left = kill_left_after(MARKER, run_id, fault_time + TIMEOUT_S + EXIT_WITHIN_S - time.time())
    assert not left, f"processes still running {EXIT_WITHIN_S} s after the timeout: {left}\n{output[-4000:]}"
    return output, time.time() - fault_time


def doctor_hang(run_dir: Path, capsys) -> str:
    capsys.readouterr()
    assert cli.main(["doctor", "--hang", str(run_dir)]) == 0
    return capsys.readouterr().out


# (backend, fault, faulty rank, ranks). Each fault runs on one backend, each backend gets a fault and a faulty rank 0:
# the detector is the same code under both, the backends differ in how it is wired in (all six fault x backend pairs
# ran and passed before the suite's time budget asked for fewer). Rank 2 of 4: a rank neither first nor last, among
# more than one waiting rank.
CASES = [
    ("lightning", "skip", 1, 2),
    ("accelerate", "shape", 0, 2),
    ("lightning", "sleep", 0, 2),
    ("accelerate", "skip", 2, 4),
]


def expected_issued(fault: str, fault_rank: int, world: int) -> dict[int, str]:
    """What each rank issued as the fault's collective: the loss all-reduce of one number, except the faulty rank."""
    faulty = {"skip": "nothing", "sleep": "nothing", "shape": "all_reduce [2] Float"}[fault]
    return {rank: faulty if rank == fault_rank else "all_reduce [1] Float" for rank in range(world)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "fault", "fault_rank", "world"), CASES, ids=[f"{b}-{f}-rank{r}-of-{w}" for b, f, r, w in CASES]
)
def test_a_fault_names_the_rank_and_the_collective(tmp_path, capsys, backend, fault, fault_rank, world):
    output, exited_after_s = launch(backend, fault, fault_rank, world, tmp_path)
    assert exited_after_s <= TIMEOUT_S + EXIT_WITHIN_S
    fault_record = json.loads((tmp_path / "fault.json").read_text())
    assert fault_record["rank"] == fault_rank
    seq, step = fault_record["seq"], fault_record["step"]

    # Every rank wrote its own report: stacks, last collectives, step.
    hang_dir = tmp_path / "hang"
    for rank in range(world):
        report = json.loads((hang_dir / f"rank{rank}.json").read_text())
        assert report["step"]["optimizer_steps"] == step
        assert report["collectives"], "no collectives recorded"
        assert "hang_worker.py" in (hang_dir / f"rank{rank}.stacks.txt").read_text()

    # The diagnosis, from the files: the fault's collective, what each rank issued there, who fell behind.
    issued = expected_issued(fault, fault_rank, world)
    diagnosis = analyze(*read_reports(hang_dir))
    assert (diagnosis.group, diagnosis.seq) == ("0", seq)
    assert diagnosis.issued == issued
    assert diagnosis.behind == ([fault_rank] if issued[fault_rank] == "nothing" else [])
    if fault == "sleep":
        where = diagnosis.ranks[fault_rank]
        assert "hang_worker.py" in where and "not in a collective" in where, where

    # The same names in the error message of the run and in doctor --hang.
    every_rank = "; ".join(f"rank {rank}: {what}" for rank, what in issued.items())
    for text in (output, doctor_hang(tmp_path, capsys)):
        assert f"#{seq} on process group 0 ({every_rank})" in text, text[-3000:]
        if issued[fault_rank] == "nothing":
            assert f"rank(s) {fault_rank} fell behind" in text
    assert "error: hang:" in output


@pytest.mark.slow
def test_doctor_collectives_names_a_slowed_rank_on_two_nodes(tmp_path):
    """Two "nodes" of one process each on localhost (the layout of tests/recipes/test_multinode.py)."""
    port = str(free_port())
    out = tmp_path / "doctor"
    procs = []
    for node in (0, 1):
        command = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
        command += ["--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port]
        command += [SLOW_DOCTOR, "--slow-rank", "1", "--", "--collectives", "--out", str(out), "--sizes", "64KB,1MB"]
        procs.append(
            subprocess.Popen(
                [str(a) for a in command],
                cwd=REPO,
                env=subprocess_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    try:
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    report = json.loads((out / "doctor.json").read_text())
    measured = report["measured"]
    assert measured["world_size"] == 2 and len(set(measured["nodes"])) == 2
    assert measured["slow_ranks"] == [1]
    assert measured["inter_node_Gbps"] > 0
    slow = [c for c in report["checks"] if c["check_id"] == "slow-rank"]
    assert len(slow) == 1 and slow[0]["severity"] == "warning" and slow[0]["message"].startswith("rank 1 ")
    assert "[slow-rank] rank 1 " in outputs[0]
    assert {c["check_id"] for c in report["checks"]} >= {"inter-node-bandwidth"}
    assert (out / "doctor_ranks.png").stat().st_size > 0
