"""bench/communication.py in its small mode: the planner against DeepSpeed's own communication log, on real ZeRO.

One 2-process group (gloo, the NLP recipe's tiny Llama) runs three rows and ``zero-recipes doctor --collectives``
measures the links; the planner must be within the bench's 5 % of the logged bytes of every collective. Seconds are
recorded and rendered, never judged here (a timing threshold inside a test would decide on the machine's load).
"""

from __future__ import annotations

import sys

import pytest
from _util import PYTHON, REPO, run

sys.path.insert(0, str(REPO))
from bench._bench_util import read_results  # noqa: E402
from bench.communication import SECTION, byte_rows, doctor_sizes_text, render_sections, time_rows  # noqa: E402


@pytest.mark.slow
def test_small_mode_plans_every_logged_byte_within_the_bar(tmp_path):
    results = tmp_path / "communication.json"
    args = ["--small", "--steps", "3", "--json", results, "--no-doc"]
    run([PYTHON, "bench/communication.py", *args], timeout=900)
    provenance, written = read_results(results)
    assert provenance["command"] == f"python bench/communication.py {' '.join(map(str, args))}"
    rows = {r["name"]: r for r in byte_rows(written)}
    assert list(rows) == [
        "stage 2, GA 2",
        "stage 3, GA 2, threshold 0, reuse distance 0",
        "stage 3, GA 1, threshold 10 x hidden",
    ]
    for name, r in rows.items():
        assert r["met"], (name, r["collectives"])
    stage2, stage3, persistent = rows.values()
    # What DeepSpeed runs, not the textbook: stage 2 all-reduces (its bucketed "reduce-scatter") every micro-batch.
    assert set(stage2["collectives"]) >= {"all_reduce", "all_gather"} and "reduce_scatter" not in stage2["collectives"]
    assert stage3["collectives"]["reduce_scatter"]["logged"] > 0
    # Reuse distance 0 without prefetch gathers every parameter twice a micro-batch (GA 2: four times a step); the
    # preset's prefetch keeps the tiny model gathered from forward to backward: once, its persistent norms after the
    # step instead of before their forward use.
    once = stage3["collectives"]["all_gather"]["logged"] / 4
    assert persistent["collectives"]["all_gather"]["logged"] == pytest.approx(once, rel=1e-3)
    timed = time_rows(written)
    assert [t["name"] for t in timed] == list(rows)[:2]
    # Small mode times the rows for --steps, and doctor timed the sizes that bracket the rows' messages.
    assert (written["timed_steps"], written["timing_warmup"]) == (3, 2)
    assert doctor_sizes_text(written) == "4 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB, 8 MiB and 16 MiB"
    assert all(t["measured_s"][0] > 0 and t["planned_s"][0] > 0 for t in timed)
    # Where the measured seconds go adds up to them, and the plan's split to the plan (one repetition, one step).
    for t in timed:
        part = t["split"]
        assert part["gather_logged_s"] + part["gather_wait_s"] + part["other_s"] == pytest.approx(t["measured_s"][0])
        assert part["planned_gather_s"] + part["planned_other_s"] == pytest.approx(t["planned_s"][0])
        assert part["gather_logged_s"] > 0 and part["planned_gather_s"] > 0 and part["other_s"] > 0
    # The worker's call-by-call seconds (its own wrapper of the logger) add up to the logger's totals per step, and on
    # the same calls as the logger counted: what the per-call measure matches across ranks is what DeepSpeed ran.
    for record in (rec for ranks in written["repetitions"][0]["rows"] for rec in ranks if rec["timed"]):
        for step in record["steps"]:
            # Each call's seconds are written to 0.1 us.
            assert sum(s for _, _, s in step["calls"]) == pytest.approx(step["comm_s"], abs=1e-7 * len(step["calls"]))
            logged = sum(sum(op["calls"].values()) for op in step["logged"].values())
            assert sum(1 for op, _, _ in step["calls"] if op != "wait") == logged
    split2, split3 = (t["split"] for t in timed)
    assert split2["gather_wait_s"] == 0 < split3["gather_wait_s"]  # stage 2 gathers synchronously, stage 3 waits
    body = render_sections({"results": written})[SECTION]
    assert "| stage 2, GA 2 | 2 |" in body and "planned / measured" in body
