"""common/process_setup.py: every process-wide setting is named in the start-up banner with its off switch, and each
off switch really turns its setting off.

The settings are checked where they act, in a fresh process per case (they are process-wide): the hang watchdog's
thread is alive or not, DeepSpeed's ``Init._set_dtype`` is the patched one or not, and the allocator keeps what a
step freed or not, measured as minor page faults of a second "step" (200 MiB of 1 MiB tensors allocated and freed)
after glibc's start-up thresholds were pinned, as tests/unit/test_host_memory.py does: with the thresholds left
alone nearly every page faults again, with the memory kept few do.

Its pair, ``end_process_group``, is checked where it is called: every script that joins a process group calls it
(tests/distributed/test_process_end.py runs it on 4 gloo processes).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common import process_setup

REPO = Path(__file__).resolve().parents[2]
# Written out here, not read from the module: the banner must name these, and these variables must switch them off.
OFF_SWITCHES = {
    "hang detection": "ZR_HANG_DETECTION",
    "zero.Init keeps a given dtype": "ZR_KEEP_ZERO_INIT_DTYPE",
    "freed host memory kept": "ZR_KEEP_FREED_MEMORY",
}
PAGES_PER_STEP = 200 * 2**20 // 4096
STAGE_2 = {"zero_optimization": {"stage": 2}}
STAGE_2_OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}

IN_A_FRESH_PROCESS = """
import ctypes, json, resource, sys, threading
import torch
from common.host_memory import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
from common.process_setup import setup_process

libc = ctypes.CDLL(None)  # glibc's start-up thresholds, fixed: what a fresh process has before it moves them
assert libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024) == 1 and libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
ds_config = json.loads(sys.argv[1])
setup = setup_process(ds_config)
setup_process(ds_config)  # the adapters call it again: nothing is printed twice


def step():
    tensors = [torch.ones(2**18) for _ in range(200)]
    del tensors


step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
from deepspeed.runtime.zero.partition_parameters import Init

print(json.dumps({
    "reported": {s.name: s.on for s in setup.settings},
    "watchdog_alive": any(t.name == "zr-hang-watchdog" and t.is_alive() for t in threading.enumerate()),
    "zero_init_patched": bool(getattr(Init._set_dtype, "keeps_given_dtype", False)),
    "second_step_faults": faults,
}))
"""

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage's faults")


def run_fresh(ds_config: dict, **env: str) -> tuple[dict, str]:
    """(what the settings really are in a fresh process after setup_process, the banner it printed)."""
    drop = (*OFF_SWITCHES.values(), "RANK", "LOCAL_RANK", "NODE_RANK")
    environ = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("MALLOC_")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", IN_A_FRESH_PROCESS, json.dumps(ds_config)],
        env={**environ, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def banner_lines(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = [i for i, line in enumerate(lines) if line.startswith("process set-up")]
    assert len(start) == 1, f"the banner must be printed exactly once, found {len(start)}:\n{stderr[-3000:]}"
    return lines[start[0] + 1 : start[0] + 1 + len(OFF_SWITCHES)]


def line_for(lines: list[str], name: str) -> str:
    found = [line for line in lines if line.strip().startswith(f"{name}:")]
    assert len(found) == 1, f"the banner does not name {name!r}:\n" + "\n".join(lines)
    return found[0]


@linux_only
def test_the_banner_names_each_setting_and_its_off_switch_and_each_switch_turns_it_off():
    state, stderr = run_fresh(STAGE_2)
    lines = banner_lines(stderr)
    for name, variable in OFF_SWITCHES.items():
        line = line_for(lines, name)
        assert f"{name}: on" in line and f"off: {variable}=off" in line, line
    assert state["watchdog_alive"] and state["zero_init_patched"], state
    assert state["second_step_faults"] < 0.25 * PAGES_PER_STEP, state  # the step reused the freed memory
    assert all(state["reported"].values()), state

    state, stderr = run_fresh(STAGE_2, **{variable: "off" for variable in OFF_SWITCHES.values()})
    lines = banner_lines(stderr)
    for name in OFF_SWITCHES:
        assert f"{name}: off" in line_for(lines, name)
    assert not state["watchdog_alive"] and not state["zero_init_patched"], state
    assert state["second_step_faults"] > 0.75 * PAGES_PER_STEP, state  # glibc's thresholds untouched: faulted again
    assert not any(state["reported"].values()), state


@linux_only
def test_an_offload_run_leaves_glibcs_defaults_and_says_how_to_keep_the_memory():
    state, stderr = run_fresh(STAGE_2_OFFLOAD)
    line = line_for(banner_lines(stderr), "freed host memory kept")
    assert "freed host memory kept: off" in line and "on: ZR_KEEP_FREED_MEMORY=on" in line, line
    assert state["second_step_faults"] > 0.75 * PAGES_PER_STEP, state
    assert state["watchdog_alive"] and state["zero_init_patched"], state


def test_only_the_launchers_rank_zero_prints_the_banner_once(monkeypatch, capsys):
    setting = process_setup.ProcessSetting("a setting", True, "what it does", "ZR_A=off")
    setup = process_setup.ProcessSetup(setting, setting, setting)
    for variable in ("RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(process_setup, "_ANNOUNCED", False)
    monkeypatch.setenv("RANK", "1")
    process_setup.announce_once(setup)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(process_setup, "_ANNOUNCED", False)
    monkeypatch.setenv("RANK", "0")
    process_setup.announce_once(setup)
    process_setup.announce_once(setup)
    assert capsys.readouterr().err.count("process set-up") == 1


# What joins a process group in a script of this project: the process set-up, DeepSpeed's or torch's own call, or the
# factory's adapters (Lightning's and Accelerate's strategies join it at start).
JOINS_A_GROUP = re.compile(
    r"setup_process\(|init_distributed\(|init_process_group\(|_trainer_kwargs\(|accelerator_kwargs\("
)
SCRIPT_FOLDERS = ("recipes/*/*.py", "bench/*.py", "common/tools/*.py")


def scripts_that_join_a_process_group() -> list[Path]:
    scripts = sorted(path for folder in SCRIPT_FOLDERS for path in REPO.glob(folder))
    return [
        path
        for path in scripts
        if '__name__ == "__main__"' in (text := path.read_text()) and JOINS_A_GROUP.search(text) is not None
    ]


def calls(path: Path, name: str) -> bool:
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_every_script_that_joins_a_process_group_ends_it_through_end_process_group():
    scripts = scripts_that_join_a_process_group()
    names = {str(path.relative_to(REPO)) for path in scripts}
    # The search must find the scripts users and the suite launch most, or it proves nothing.
    assert {"recipes/nlp/train.py", "recipes/cv/train_accelerate.py", "bench/_comm_worker.py"} <= names, names
    assert [str(path.relative_to(REPO)) for path in scripts if not calls(path, "end_process_group")] == []
