"""bench/overhead.py's allocator comparison under one torch build: the verdict words follow the measured ratios."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench/ is importable from there

from bench import overhead  # noqa: E402
from common.host_memory import SWITCH_ENV as KEEP_FREED_MEMORY_ENV  # noqa: E402


@pytest.mark.parametrize(
    ("ratios", "words"),
    [
        ([0.95, 0.97, 0.99], "helps: CPU time per step x0.970 (0.950-0.990), lower in every repetition"),
        ([0.97, 1.00, 1.02], "no effect beyond the noise: x1.000 (0.970-1.020), on both sides of 1"),
        ([1.01, 1.03, 1.05], "costs CPU time: x1.030 (1.010-1.050), higher in every repetition"),
    ],
)
def test_effect_words_follow_the_ratios(ratios, words):
    assert overhead.effect_words(ratios) == words


def test_kept_over_defaults_pairs_each_repetition_with_its_own():
    def runs(default_ms, kept_ms):
        return {
            "glibc defaults": {"raw": [{"cpu_ms": ms} for ms in default_ms]},
            "freed memory kept": {"raw": [{"cpu_ms": ms} for ms in kept_ms]},
        }

    assert overhead.kept_over_defaults(runs([100.0, 200.0], [90.0, 220.0]), "raw") == [0.9, 1.1]


def test_the_section_names_the_build_and_both_backends():
    figures = {"cpu_ms": 100.0, "wall_ms": 50.0, "thread_cpu_ms": 90.0, "page_faults": 1000.0}
    kept = {**figures, "cpu_ms": 95.0, "page_faults": 100.0}
    runs = {
        "glibc defaults": {"raw": [figures], "lightning": [figures]},
        "freed memory kept": {"raw": [kept], "lightning": [kept]},
    }
    measured = {"preset": "deepspeed_stage_2", "runs": runs}
    body = overhead.render_allocator_build({**measured, "torch_build": "2.14.1+cu130", "torch_cuda": "13.0"}, "2.14.1")
    assert "torch 2.14.1+cu130 (a CUDA 13.0 build, run on this CPU" in body
    assert "torch 2.13.0+cpu (a CPU build)." in overhead.render_allocator_build(measured, "2.13.0+cpu")
    assert "torch 2.14.1. How much" in overhead.render_allocator_build(measured, "2.14.1")  # no build recorded
    assert "raw: helps: CPU time per step x0.950" in body and "lightning: helps" in body
    assert "| glibc defaults | 1,000 | 1,000 | 100 | 100 |" in body


def test_allocator_groups_rotate_the_order_and_set_the_setting_for_each_run_alone(monkeypatch):
    seen = []

    def fake_worker(backend, preset, steps, out):
        seen.append((os.environ.get(KEEP_FREED_MEMORY_ENV), backend))
        return {"preset": preset, "steps": steps}

    monkeypatch.setattr(overhead, "run_step_worker", fake_worker)
    monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, "outside")
    settings = {"kept": "on", "defaults": None}
    groups = list(overhead.allocator_groups("deepspeed_stage_2", settings, ("raw", "lightning"), reps=2, steps=6))
    first = [("kept", "raw"), ("kept", "lightning"), ("defaults", "raw"), ("defaults", "lightning")]
    assert [(setting, backend) for _, setting, backend, _ in groups] == first + first[1:] + first[:1]
    assert [rep for rep, *_ in groups] == [0] * 4 + [1] * 4
    assert seen == [(settings[setting], backend) for _, setting, backend, _ in groups]
    assert groups[0][3] == {"preset": "deepspeed_stage_2", "steps": 6}
    assert os.environ[KEEP_FREED_MEMORY_ENV] == "outside"  # restored after the runs
