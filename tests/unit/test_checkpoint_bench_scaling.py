"""bench/checkpoint.py states the save-time scaling its table shows (the save time's scaling, stated)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.checkpoint import scaling_sentence  # noqa: E402


def row(params: float, world: int, gigabytes: float, seconds: list[float]) -> dict:
    return {"num_params": params, "world_size": world, "checkpoint_bytes": gigabytes * 1e9, "sync_save_s": seconds}


def test_size_exponent_and_process_scaling_from_the_rows():
    # 16x the bytes in 4x the time: time ~ bytes^0.5; 1 -> 4 processes in a quarter of the time: perfectly parallel
    scaling = [
        row(10e6, 2, 0.1, [0.9, 1.0, 1.1]),
        row(40e6, 2, 0.4, [2.0]),
        row(160e6, 2, 1.6, [3.0, 4.0, 50.0]),
        row(40e6, 1, 0.4, [4.0]),
        row(40e6, 4, 0.4, [1.0]),
    ]
    sentence = scaling_sentence(scaling)
    assert "x16.0 the bytes took x4.0 the time, save time ~ bytes^0.50 (sublinear)" in sentence, sentence
    assert "1: 4.00 s, 2: 2.00 s, 4: 1.00 s; x0.25 from 1 to 4 processes, close to the x0.25" in sentence, sentence


def test_a_save_that_does_not_speed_up_with_processes_says_so():
    scaling = [row(1e6, 2, 0.1, [1.0]), row(1e6, 1, 0.1, [1.0]), row(1e6, 4, 0.1, [0.9])]
    assert "far from the x0.25 of a perfectly parallel write" in scaling_sentence(scaling)


def test_one_row_states_nothing():
    assert scaling_sentence([row(1e6, 2, 0.1, [1.0])]) == ""
