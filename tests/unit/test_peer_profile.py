"""bench/peer.py --profile's attribution and rendering, on synthetic profiles (no recipe run, no timing)."""

from __future__ import annotations

import pytest

from bench import _step_phases as phases
from bench import peer


@pytest.fixture
def fake_clock(monkeypatch):
    """A clock the test moves by hand: ``clock[0] += s`` spends s seconds of process CPU and wall, half of it on the
    main thread."""
    clock = [0.0]
    monkeypatch.setattr(phases, "now", lambda: (clock[0], clock[0] / 2, clock[0], 10 * clock[0]))
    return clock


def test_a_nested_call_is_charged_to_the_innermost_phase_once(fake_clock):
    clock = phases.PhaseClock()

    def reduce_bucket():
        fake_clock[0] += 3.0

    reduce_bucket = clock.wrap(reduce_bucket, "gradient reduction")

    def backward():
        fake_clock[0] += 5.0
        reduce_bucket()
        reduce_bucket()
        fake_clock[0] += 1.0

    backward = clock.wrap(backward, "backward (autograd)")
    clock.start()
    fake_clock[0] += 2.0  # the loop, before any phase
    backward()
    fake_clock[0] += 0.5
    spent = clock.stop()
    assert spent["gradient reduction"] == {
        "cpu_s": 6.0,
        "thread_s": 3.0,
        "wall_s": 6.0,
        "minor_faults": 60.0,
        "calls": 2,
    }
    assert spent["backward (autograd)"]["cpu_s"] == 6.0 and spent["backward (autograd)"]["calls"] == 1
    assert spent["other"]["cpu_s"] == 2.5
    # Every second of the window is in exactly one phase.
    assert sum(s["cpu_s"] for s in spent.values()) == 14.5


def test_an_inactive_clock_only_calls_through(fake_clock):
    clock = phases.PhaseClock()
    doubled = clock.wrap(lambda x: 2 * x, "forward and loss")
    assert doubled(4) == 8 and clock.totals == {} and clock.calls == {}


def test_phase_ms_per_step_orders_the_phases_and_counts_the_missing_as_zero():
    spent = {"other": {"cpu_s": 0.5}, "forward and loss": {"cpu_s": 1.0}}
    ms = phases.phase_ms_per_step(spent, steps=5)
    assert list(ms) == [*phases.PHASES, phases.OTHER]
    assert ms["forward and loss"] == 200.0 and ms["other"] == 100.0 and ms["gradient reduction"] == 0.0
    with pytest.raises(ValueError, match="not in PHASES"):
        phases.phase_ms_per_step({"made up": {"cpu_s": 1.0}}, steps=1)


def run_with(cpu_s: dict[str, float]) -> dict:
    """A profiled run of 5 phase steps (4-8) spending ``cpu_s`` (seconds over the window) per phase, and a million
    minor page faults per CPU second."""
    spent = {
        phase: {"cpu_s": s, "thread_s": s, "wall_s": s, "minor_faults": 1e6 * s, "calls": 1}
        for phase, s in cpu_s.items()
    }
    areas = {"torch": 1.0}
    return {"profile": {"phase_steps": [4, 8], "phases": spent}, "cprofile": {"areas": areas, "top_calls": []}}


def row(front_end: str, label: str, runs: list[dict], override: str | None = None) -> dict:
    preset = peer.STAGE_2 if label != peer.PROFILE_REFERENCE else label
    return {
        "front_end": front_end,
        "label": label,
        "preset": preset,
        "ds_override": override,
        "runs": runs,
        "error": None,
    }


ZERO = {"forward and loss": 1.0, "optimizer step, rest (flatten, casts, copies)": 1.5, "other": 0.25}
FSDP2 = {"forward and loss": 1.0, "parameter all-gather and release": 0.5, "other": 0.25}


def test_the_gap_is_split_by_phase_largest_first_and_adds_up():
    rows = [
        row("accelerate", peer.STAGE_2, [run_with(ZERO)]),
        row("accelerate", peer.PROFILE_REFERENCE, [run_with(FSDP2)]),
        row("accelerate", "overlap_comm off", [run_with({**ZERO, "other": 0.75})], "zero_optimization.x=1"),
    ]
    text = peer.profile_gap_text(rows)
    first, second = text.splitlines()
    # per step: ZeRO 550 ms against FSDP2's 350: +300 in its step's copies, -100 in the all-gather
    assert first.startswith("- accelerate, deepspeed_stage_2 over fsdp2_grad_op: +200 ms of rank 0's CPU time a step;")
    parts = first.split("largest first: ")[1].rstrip(".").split("; ")
    assert parts[0] == "optimizer step, rest (flatten, casts, copies) +300"
    assert parts[-1] == "parameter all-gather and release -100"
    assert "+300 ms of rank 0's CPU time a step (+100 against deepspeed_stage_2's)" in second
    table = peer.profile_phase_table(rows)
    assert "| **total** | 550 | +200 | 350 | 650 | +300 |" in table
    faults = peer.profile_phase_table(rows, "minor_faults")  # thousands a step: 2.75 million in 5 steps
    assert "| **total** | 550 | +200 | 350 | 650 | +300 |" in faults and "thousand minor page faults" in faults
    assert "| accelerate | deepspeed_stage_2 | 550 | 550 | 550 | 550000 |" in peer.profile_clock_table(rows)


def test_the_medians_are_per_phase_over_repetitions():
    runs = [run_with({"other": 0.5}), run_with({"other": 1.5}), run_with({"other": 1.0})]
    assert peer.phase_medians(runs)["other"] == 200.0


def test_the_section_renders_from_a_results_document_alone():
    rows = [row("lightning", peer.STAGE_2, [run_with(ZERO)]), row("lightning", peer.PROFILE_REFERENCE, [])]
    rows[1]["error"] = "boom"
    results = {"mode": "profile", "reps": 1, "model": "m", "rows": rows, "profile_steps": [3, 8, 11]}
    body = peer.render_sections({"provenance": {}, "results": results})["peer-125m-profile"]
    assert "steps 4-8" in body and "steps 9-11" in body
    assert "- lightning, fsdp2_grad_op: did not run: `boom`" in body
