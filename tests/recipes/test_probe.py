"""``zero-recipes probe``: the ladder's recommendation, failed and interrupted candidates, and a real 2-process run.

The slow test is the one a user runs: three candidates of the NLP recipe, each a real ZeRO run with 2 CPU
processes (gloo), writing report.md, report.json, probe.png and a recommended config the recipe accepts.
The fast tests drive the same orchestration with a fake runner, so the ladder and Ctrl-C are checked
without training.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from _util import REPO, stdlib_tokenizer, subprocess_env

from common.tools import probe, recipes
from common.tools.probe import Candidate, ProbeRow
from common.tools.probe_report import communication_summary, format_offload_timing, write_config_yaml
from common.tools.recipes import describe, find_recipe

EXE = shutil.which("zero-recipes")
# Small enough that one candidate is start-up plus a few seconds of training on 2 cores.
TINY = [
    "--set", "max_train_tokens=60000",
    "--set", "max_val_tokens=2048",
    "--set", "eval_interval=1000",
    "--set", "checkpoint_interval=1000",
    "--set", "sample_tokens=4",
]  # fmt: skip


def row(
    candidate: str,
    throughput: float | None = 1000.0,
    peak: int | None = 10**9,
    status: str = "ok",
    ac: str = "none",
    oom: bool = False,
) -> ProbeRow:
    stage, offload = probe.preset_offload(candidate)
    return ProbeRow(
        candidate=candidate if ac == "none" else f"{candidate}+{ac}",
        preset=candidate,
        activation_checkpointing=ac,
        zero_stage=stage,
        offload=offload,
        status=status,
        out_of_memory=oom,
        peak_memory_bytes=peak if status == "ok" else None,
        throughput=throughput if status == "ok" else None,
        throughput_unit="tokens/s/device",
    )


# --- the ladder ---------------------------------------------------------------------------------------


def test_stage2_is_the_baseline_when_within_5_percent():
    rows = [row("deepspeed_stage_1", 1000), row("deepspeed_stage_2", 970), row("deepspeed_stage_3", 990)]
    rec = probe.recommend(rows, 80e9)
    assert rec["preset"] == "deepspeed_stage_2" and not rec["network_suspect"]
    assert "baseline" in rec["reason"]


def test_stage2_more_than_5_percent_slower_is_a_network_suspect():
    rec = probe.recommend([row("deepspeed_stage_1", 1000), row("deepspeed_stage_2", 900)], 80e9)
    assert rec["network_suspect"] and rec["preset"] == "deepspeed_stage_1"
    assert "network" in rec["reason"] and "10%" in rec["reason"]


def test_stage3_only_when_stage2_does_not_fit_or_cannot_grow_the_batch():
    oom = row("deepspeed_stage_2", status="failed: torch.OutOfMemoryError: CUDA out of memory", oom=True)
    rec = probe.recommend([row("ddp", status="failed: OOM", oom=True), oom, row("deepspeed_stage_3", 800)], 80e9)
    assert rec["preset"] == "deepspeed_stage_3" and "does not fit" in rec["reason"]
    tight = [row("deepspeed_stage_2", 1000, peak=int(75e9)), row("deepspeed_stage_3", 900, peak=int(40e9))]
    rec = probe.recommend(tight, 80e9)
    assert rec["preset"] == "deepspeed_stage_3" and "cannot grow the batch" in rec["reason"]
    roomy = [row("deepspeed_stage_2", 1000, peak=int(40e9)), row("deepspeed_stage_3", 1100, peak=int(30e9))]
    assert probe.recommend(roomy, 80e9)["preset"] == "deepspeed_stage_2"  # faster stage 3 is not a reason


def test_offload_is_the_last_rung_optimizer_first():
    rows = [
        row("deepspeed_stage_2", status="failed: OOM", oom=True),
        row("deepspeed_stage_3", status="failed: OOM", oom=True),
        row("deepspeed_stage_3_offload", 300),
        row("deepspeed_stage_2_offload", 400),
    ]
    rec = probe.recommend(rows, 80e9)
    assert rec["preset"] == "deepspeed_stage_2_offload" and "offload" in rec["reason"]


def test_checkpointing_variant_wins_only_by_measurement():
    rows = [row("deepspeed_stage_2", 1000), row("deepspeed_stage_2", 700, ac="full")]
    assert probe.recommend(rows, 80e9)["activation_checkpointing"] == "none"
    rows = [row("deepspeed_stage_2", status="failed: OOM", oom=True), row("deepspeed_stage_2", 700, ac="full")]
    rec = probe.recommend(rows, 80e9)
    assert (rec["preset"], rec["activation_checkpointing"]) == ("deepspeed_stage_2", "full")


def test_nothing_ran_gives_no_recommendation():
    rec = probe.recommend([row("ddp", status="failed: boom")], 80e9)
    assert rec["candidate"] is None and "no candidate ran" in rec["reason"]


def test_fsdp2_candidates_stand_beside_the_ladder_with_their_measured_ratios():
    # FSDP2 faster here: the ladder still answers with the ZeRO preset, and says how it compared with its peer.
    rows = [row("deepspeed_stage_3", 800), row("fsdp2", 1000)]
    rec = probe.recommend(rows, 80e9)
    assert rec["preset"] == "deepspeed_stage_3"
    (peer,) = rec["peers"]
    assert (peer["fsdp2"], peer["zero"], peer["throughput_ratio"], peer["peak_memory_ratio"]) == (
        "fsdp2",
        "deepspeed_stage_3",
        0.8,
        1.0,
    )
    assert "deepspeed_stage_3 ran at 0.80x fsdp2's throughput" in rec["reason"]
    # Only FSDP2 ran: it is the answer.
    rec = probe.recommend([row("deepspeed_stage_3", status="failed: boom"), row("fsdp2_grad_op", 900)], 80e9)
    assert (rec["preset"], rec["zero_stage"], rec["peers"]) == ("fsdp2_grad_op", None, [])
    assert [c.name for c in probe.parse_candidates("deepspeed_stage_3,fsdp2", None)] == ["deepspeed_stage_3", "fsdp2"]
    with pytest.raises(probe.ConfigError, match="did you mean 'fsdp2'"):
        probe.parse_candidates("fsdp3", None)


def test_candidates_are_checked_and_crossed():
    cands = probe.parse_candidates("deepspeed_stage_2,deepspeed_stage_3", "none,full")
    assert [c.name for c in cands] == [
        "deepspeed_stage_2", "deepspeed_stage_2+full", "deepspeed_stage_3", "deepspeed_stage_3+full"
    ]  # fmt: skip
    with pytest.raises(probe.ConfigError, match="did you mean 'deepspeed_stage_2'"):
        probe.parse_candidates("deepspeed_stage2", None)


def test_offload_timing_sets_the_planners_floor_beside_the_measured_cost():
    """Each offload row against its counterpart, with the planner's bytes / bandwidth summed here by hand."""
    rows = [
        row("deepspeed_stage_3"),
        row("deepspeed_stage_3_offload"),
        row("deepspeed_stage_3_offload_nvme"),
        row("deepspeed_stage_2_offload"),  # no stage-2 row without offload: nothing to compare it with
        row("deepspeed_stage_3_offload", status="failed: boom"),
    ]
    for r, step in zip(rows, (1.0, 1.5, 4.0, 2.0, None)):
        r.step_time_s = step
    k = 1_000_000 // 2  # 1M parameters on 2 ranks, bf16 (P = 2)
    bandwidth = {"pcie": (10.0, 10.0), "dram": (40.0, 40.0), "nvme": (1.0, 2.0), "hbm": (1000.0, 1000.0)}
    timing = probe.offload_timing(rows, 1_000_000, 2, 2, "bf16", bandwidth)
    assert [(t["candidate"], t["compared_with"]) for t in timing] == [
        ("deepspeed_stage_3_offload", "deepspeed_stage_3"),
        ("deepspeed_stage_3_offload_nvme", "deepspeed_stage_3_offload"),
    ]
    cpu, nvme = timing
    assert cpu["measured_s"] == pytest.approx(0.5) and nvme["measured_s"] == pytest.approx(2.5)
    # Parameter offload, per rank: PCIe 2k + 2k + 4k = 8k; DRAM (16 + 14 + 4 + 4) k = 38k, x 2 ranks on the node.
    pcie, dram = 8 * k / 10e9, 2 * 38 * k / 40e9
    assert cpu["link"] == ("dram" if dram > pcie else "pcie")
    assert cpu["planner_s"] == pytest.approx((max(pcie, dram),) * 2)
    # NVMe over host-RAM offload adds the disk only: 4k + 2k + 24k + 8k = 38k per rank, 2 ranks, 1-2 GB/s.
    assert nvme["link"] == "nvme" and nvme["planner_s"] == pytest.approx((2 * 38 * k / 2e9, 2 * 38 * k / 1e9))
    text = "\n".join(format_offload_timing(timing))
    assert "| deepspeed_stage_3_offload_nvme | deepspeed_stage_3_offload | +2.500 | 0.019-0.038 | nvme (1-2) |" in text


def test_communication_summary_reads_rank_0s_log_after_the_first_step(tmp_path):
    """The log's steady steps (the first one gathers stage 3's trace) beside the planner's bytes for the config."""
    run = probe.candidate_config(find_recipe("nlp"), Candidate("deepspeed_stage_2"), None, [], 2)
    first = {"all_reduce": {"calls": {"4000": 9}, "seconds": 0.9}, "broadcast": {"calls": {"8": 40}, "seconds": 0.1}}
    step = {
        "all_reduce": {"calls": {"4000": 3, "4": 1}, "seconds": 0.31},
        "all_gather_into_tensor": {"calls": {"1000": 2}, "seconds": 0.2},
    }
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "steps": [first, step, step]}))
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "steps": [first, first, first]}))
    summary = communication_summary(tmp_path, run)
    assert summary["steps"] == 2
    reduce, gather = summary["collectives"]["all_reduce"], summary["collectives"]["all_gather"]
    assert (reduce["logged_bytes"], reduce["calls"], reduce["logged_s"]) == (12004, 4, pytest.approx(0.31))
    assert (gather["logged_bytes"], gather["calls"]) == (2000, 2)
    # Stage 2 all-reduces every gradient once a micro-batch (bf16: 2 bytes each) beside the 4-byte norm and the
    # 1-byte overflow flag, and all-gathers a partition of each of the recipe's two parameter groups.
    k = run.model.num_params
    assert reduce["planned_bytes"] == 2 * k + 5 and gather["planned_bytes"] == pytest.approx(2 * k / 2, rel=1e-3)
    assert "broadcast" not in summary["collectives"]
    assert communication_summary(tmp_path / "none", run) is None


def test_last_error_line_finds_the_exception():
    log = "step 1\nTraceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory.\n\n"
    assert probe.last_error_line(log) == "torch.OutOfMemoryError: CUDA out of memory."
    assert probe.last_error_line("a\nb\n") == "b"
    launcher = (
        "[rank0]: RuntimeError: Connection closed by peer\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n"
    )
    assert probe.last_error_line(launcher) == "RuntimeError: Connection closed by peer"


def test_commands_are_what_a_user_types(tmp_path):
    nlp = find_recipe("nlp")
    run = probe.candidate_config(nlp, Candidate("deepspeed_stage_3", "full"), None, ["seq_len=128", "max_steps=9"], 2)
    cfg = run.config
    assert (cfg["preset"], cfg["activation_checkpointing"], cfg["seq_len"], cfg["devices"]) == (
        "deepspeed_stage_3", "full", 128, 2
    )  # fmt: skip
    assert cfg["max_steps"] != 9  # the probe's own keys are not the user's to set
    assert run.ds_config["zero_optimization"]["stage"] == 3 and run.world_size == 2
    none_run = probe.candidate_config(nlp, Candidate("deepspeed_stage_2", "none"), None, [], 2)
    path = write_config_yaml(none_run.config, tmp_path / "c.yaml", ["test"])
    back = describe(nlp, path)  # the recipe reads the file the candidate runs with
    assert back.config == none_run.config and back.config["activation_checkpointing"] == "none"
    light = probe.candidate_command(nlp, "lightning", 5, 2, tmp_path / "run", path)
    assert light[1].endswith("recipes/nlp/train.py") and light[2:4] == ["--config", str(path)]
    assert {"max_steps=5", "devices=2", "overwrite=true"} <= set(light)
    acc = probe.candidate_command(nlp, "accelerate", 5, 2, tmp_path / "run", path, tmp_path / "launch.yaml")
    assert acc[1:3] == ["-m", "accelerate.commands.launch"] and acc[acc.index("--num_processes") + 1] == "2"
    assert any(a.endswith("train_accelerate.py") for a in acc)
    finetune = probe.candidate_command(find_recipe("nlp:finetune"), "accelerate", 5, 2, tmp_path / "run", path)
    assert any(a.endswith("recipes/nlp/finetune_accelerate.py") for a in finetune)


def test_accelerate_candidates_get_their_own_launch_files(tmp_path):
    run = probe.candidate_config(find_recipe("science"), Candidate("deepspeed_stage_3"), None, [], 2)
    launch = yaml.safe_load(probe.accelerate_launch_file(run, 2, tmp_path).read_text())
    assert launch["num_processes"] == 2 and launch["deepspeed_config"]["zero3_init_flag"] is True
    ds = json.loads(Path(launch["deepspeed_config"]["deepspeed_config_file"]).read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds == run.ds_config


# --- orchestration with a fake runner -----------------------------------------------------------------


def fake_runner(outcomes: dict[str, object]):
    """A runner that writes summary.json (or fails, or raises) per preset instead of training."""

    def run(command: list[str], log: Path, timeout_s: float) -> tuple[int, str]:
        keys = yaml.safe_load(Path(command[command.index("--config") + 1]).read_text())
        keys.update(a.split("=", 1) for a in command if "=" in a and not a.startswith("-"))
        outcome = outcomes[keys["preset"]]
        if isinstance(outcome, BaseException):
            raise outcome
        log.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(outcome, str):  # a failure: the recipe's last words
            log.write_text(f"loading\n{outcome}\n")
            return 1, log.read_text()
        out = Path(keys["out_dir"])
        out.mkdir(parents=True, exist_ok=True)
        throughput, peak = outcome
        stage, _ = probe.preset_offload(keys["preset"])
        (out / "summary.json").write_text(json.dumps({
            "throughput": {"value": throughput, "unit": "tokens/s/device"}, "peak_memory_bytes": peak,
            "model_state_bytes_per_rank": peak // 10, "wall_time_s": 10.0, "zero_stage": stage, "world_size": 2,
            "memory_kind": "cpu_peak_rss", "median_step_s": 0.5,
        }))  # fmt: skip
        log.write_text("ok\n")
        return 0, "ok\n"

    return run


def test_an_oom_candidate_is_a_row_not_a_crash(tmp_path, monkeypatch):
    outcomes = {
        "ddp": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "deepspeed_stage_2": (1000.0, 900_000_000),
        "deepspeed_stage_3": (950.0, 800_000_000),
    }
    cands = probe.parse_candidates(",".join(outcomes), None)
    described = []  # the recipe processes the probe starts to describe the runs (seconds of imports each)
    run_recipe_process = recipes._run_recipe_process
    monkeypatch.setattr(recipes, "_run_recipe_process", lambda *a: described.append(a[1]) or run_recipe_process(*a))
    monkeypatch.setattr(recipes, "_DESCRIPTIONS", {})  # nothing described by an earlier test
    result = probe.run_probe(
        "nlp", cands, steps=3, devices=2, out=tmp_path, runner=fake_runner(outcomes), progress=False
    )
    assert len(described) == 3  # the user's config, every candidate in one process, then the recommended one
    ddp = result.rows[0]
    assert ddp.status == "failed: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert ddp.out_of_memory
    assert result.recommendation["preset"] == "deepspeed_stage_2"
    for name in ("report.md", "report.json", "probe.png", "recommended.yaml"):
        assert (tmp_path / name).is_file(), name
    assert "does not fit" in (tmp_path / "report.md").read_text()


def test_ctrl_c_stops_cleanly_and_keeps_the_rows(tmp_path):
    outcomes = {
        "deepspeed_stage_1": (1000.0, 10**9),
        "deepspeed_stage_2": KeyboardInterrupt(),
        "deepspeed_stage_3": (900.0, 10**9),
    }
    cands = probe.parse_candidates(",".join(outcomes), None)
    result = probe.run_probe(
        "nlp", cands, steps=3, devices=2, out=tmp_path, runner=fake_runner(outcomes), progress=False
    )
    assert result.interrupted and [r.candidate for r in result.rows] == ["deepspeed_stage_1"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["interrupted"] and len(report["rows"]) == 1
    assert report["recommendation"]["preset"] == "deepspeed_stage_1"
    assert "interrupted" in (tmp_path / "report.md").read_text()


# --- real runs ----------------------------------------------------------------------------------------


def zr(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    assert EXE, "zero-recipes is not installed: pip install -e ."
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=subprocess_env())


def test_a_failing_candidate_becomes_a_failed_row(tmp_path):
    # NVMe offload without nvme_path: the recipe itself refuses it (one error line, exit 2) before training.
    out = zr(
        "probe",
        "nlp",
        "--candidates",
        "deepspeed_stage_3_offload_nvme",
        "--steps",
        "2",
        "--devices",
        "2",
        "--out",
        str(tmp_path),
        *TINY,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    (failed,) = report["rows"]
    assert failed["status"].startswith("failed: ") and "nvme" in failed["status"].lower()
    assert report["recommendation"]["candidate"] is None
    assert (tmp_path / "probe.png").is_file() and (tmp_path / "report.md").is_file()


def processes_of(folder: Path) -> list[int]:
    """Pids of the live processes whose command line names ``out_dir=`` under ``folder`` (a candidate's ranks)."""
    found = subprocess.run(["pgrep", "-f", f"out_dir={folder}"], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found if int(pid) != os.getpid()]


def rows_written(report: Path) -> int:
    """How many rows the probe's report.json holds now (0 before the first; it is rewritten after each row)."""
    try:
        return len(json.loads(report.read_text())["rows"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_probe_four_candidates_on_two_cpu_processes_then_ctrl_c_keeps_the_rows_and_leaves_no_rank(tmp_path):
    """One real probe, the one a user runs: four candidates measured, then Ctrl-C while a fifth starts its ranks.

    The four rows, the report, the offload timing, the communication and the recommendation come from the rows
    measured before the interruption; the interruption must leave no rank of the fifth candidate behind."""
    names = ["ddp", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload"]
    interrupted = "deepspeed_stage_1"
    args = ["probe", "nlp", "--candidates", ",".join([*names, interrupted]), "--steps", "4", "--devices", "2",
            "--out", str(tmp_path), *TINY, "--set", f"tokenizer={stdlib_tokenizer()}"]  # fmt: skip
    # As from a terminal: SIGINT at its default even when this test runs in a background job (which ignores it).
    restore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    start = time.perf_counter()
    proc = subprocess.Popen([EXE, *args], cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=restore_sigint)  # fmt: skip
    try:
        report_path, fifth = tmp_path / "report.json", tmp_path / "runs" / interrupted
        deadline = time.time() + 900
        # Both ranks of the fifth candidate are up (the launcher's rank 0 and the rank it started).
        while len(processes_of(fifth)) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert len(processes_of(fifth)) >= 2, "the fifth candidate did not start its ranks in time"
        assert rows_written(report_path) == len(names)
        elapsed = time.perf_counter() - start
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    assert processes_of(tmp_path) == [], "a candidate's rank survived Ctrl-C"
    for name in ("report.md", "report.json", "probe.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = json.loads(report_path.read_text())
    assert report["interrupted"] and "interrupted" in (tmp_path / "report.md").read_text()
    assert [r["candidate"] for r in report["rows"]] == names
    for r in report["rows"]:
        assert r["status"] == "ok", r["status"]
        assert r["world_size"] == 2 and r["peak_memory_bytes"] > 0 and r["throughput"] > 0
        assert r["model_state_bytes_per_rank"] > 0 and r["step_time_s"] > 0
    states = {r["zero_stage"]: r["model_state_bytes_per_rank"] for r in report["rows"] if r["offload"] == "none"}
    assert states[3] < states[2] < states[0]  # real sharding: 16K/N < 2K + 14K/N < 16K (less freed grads)
    # The offload row's measured cost beside the planner's time column (the planner's default link bandwidths).
    (timing,) = report["offload_timing"]
    steps = {r["candidate"]: r["step_time_s"] for r in report["rows"]}
    assert (timing["candidate"], timing["compared_with"]) == ("deepspeed_stage_3_offload", "deepspeed_stage_3")
    assert timing["measured_s"] == pytest.approx(steps["deepspeed_stage_3_offload"] - steps["deepspeed_stage_3"])
    assert 0 < timing["planner_s"][0] < timing["planner_s"][1] and timing["link"] in ("pcie", "dram")
    assert "What each offload tier added to a step" in (tmp_path / "report.md").read_text()
    # Each candidate's communication per step, from DeepSpeed's own log, beside the planner's bytes.
    comm = {r["candidate"]: r["communication"] for r in report["rows"]}
    assert all(c and c["steps"] == probe.COMMS_LOG_STEPS - 1 for c in comm.values()), comm
    expected = {
        "ddp": {"all_reduce"},
        "deepspeed_stage_2": {"all_reduce", "all_gather"},  # DeepSpeed's bucketed "reduce-scatter" all-reduces
        "deepspeed_stage_3": {"all_gather", "reduce_scatter"},
        "deepspeed_stage_3_offload": {"all_gather", "reduce_scatter"},
    }
    for name, collectives in expected.items():
        for collective in collectives:
            c = comm[name]["collectives"][collective]
            assert c["logged_bytes"] == pytest.approx(c["planned_bytes"], rel=0.05), (name, collective, c)
    assert "Communication per optimizer step" in (tmp_path / "report.md").read_text()
    rec = report["recommendation"]
    assert rec["candidate"] in names[:3] and rec["reason"]
    # The chosen preset as a config the recipe accepts.
    cfg = describe("nlp", tmp_path / "recommended.yaml").config
    assert (cfg["preset"], cfg["activation_checkpointing"]) == (rec["preset"], rec["activation_checkpointing"])
    assert "Recommended" in (tmp_path / "report.md").read_text()
    print(f"probe of 4 candidates: {elapsed:.0f} s")


@pytest.mark.slow
def test_probe_a_mixed_zero_and_fsdp2_candidate_list_on_two_cpu_processes(tmp_path):
    """``--candidates deepspeed_stage_3,fsdp2`` on the science recipe's smoke model (the NLP recipe refuses FSDP2):
    two real 2-process runs, each measured, the ZeRO one recommended and the FSDP2 one beside it."""
    smoke = ["n_train=40", "n_test=8", "grid_size=64", "solve_grid=256", "modes=8", "width=16", "n_layers=2"]
    smoke += ["proj_width=32", "micro_batch_size=4", "data_workers=1", "eval_interval=1000", "checkpoint_interval=1000"]
    sets = [part for value in smoke for part in ("--set", value)]
    args = ["probe", "science", "--candidates", "deepspeed_stage_3,fsdp2", "--steps", "4", "--devices", "2"]
    out = zr(*args, "--out", str(tmp_path), *sets, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    rows = {r["candidate"]: r for r in report["rows"]}
    assert list(rows) == ["deepspeed_stage_3", "fsdp2"]
    for r in rows.values():
        assert r["status"] == "ok" and r["world_size"] == 2, r
        assert r["throughput"] > 0 and r["peak_memory_bytes"] > 0 and r["model_state_bytes_per_rank"] > 0, r
    assert (rows["deepspeed_stage_3"]["zero_stage"], rows["fsdp2"]["zero_stage"]) == (3, None)
    summary = json.loads((tmp_path / "runs" / "fsdp2" / "summary.json").read_text())
    assert summary["preset"] == "fsdp2"  # the candidate ran under FSDP2, not under the recipe's default preset
    rec = report["recommendation"]
    assert rec["preset"] == "deepspeed_stage_3"
    (peer,) = rec["peers"]
    ratio = rows["deepspeed_stage_3"]["throughput"] / rows["fsdp2"]["throughput"]
    assert peer["throughput_ratio"] == pytest.approx(ratio)
