"""bench/offload_time.py prices the planner's NVMe link at the disk bandwidth measured in the same run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import offload_time  # noqa: E402


def row(read: list[float], write: list[float]) -> dict:
    return {"processes": 2, "block_size": 2**20, "queue_depth": 8, "read_gbps": read, "write_gbps": write}


def test_the_bandwidth_is_the_mean_of_the_median_read_and_write_over_every_loop_of_every_repetition():
    rows = [row([1.0, 1.2, 5.0], [2.0, 2.1, 2.2]), row([1.1, 1.3, 1.4], [0.5, 2.3, 2.4])]
    disk = offload_time.disk_bandwidth(rows)
    # read loops sorted: 1.0 1.1 1.2 1.3 1.4 5.0 -> median 1.25; write: 0.5 2.0 2.1 2.2 2.3 2.4 -> 2.15
    assert disk["read_gbps"] == pytest.approx(1.25) and disk["write_gbps"] == pytest.approx(2.15)
    assert disk["gbps"] == pytest.approx(1.7)
    assert (disk["processes"], disk["block_size"], disk["queue_depth"]) == (2, 2**20, 8)
    assert disk["per_rep"] == rows
    assert offload_time.disk_spread(disk, "read_gbps") == "1.00-5.00"
