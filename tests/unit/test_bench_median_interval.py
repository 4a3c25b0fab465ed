"""The confidence interval of a median that the checkpoint bench's verdicts read (bench/_bench_util.median_interval).

Its coverage is checked against an independent count: every way n values can fall below or above the median (each
with probability 1/2, whatever the distribution), counting those that leave at least k on each side.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench._bench_util import MEDIAN_CONFIDENCE, median_interval  # noqa: E402
from bench.checkpoint import render_sections, slowdowns  # noqa: E402


def coverage_by_enumeration(n: int, k: int) -> float:
    """P(k-th smallest < median < k-th largest): at least k of the n values below it and at least k above it."""
    patterns = list(itertools.product((False, True), repeat=n))  # True: the value is above the median
    held = sum(1 for above in patterns if k <= sum(above) <= n - k)
    return held / len(patterns)


@pytest.mark.parametrize("n", range(1, 16))
def test_the_interval_is_the_narrowest_order_statistics_pair_with_the_coverage(n):
    values = random.Random(n).sample(range(1000), n)
    low, high, coverage = median_interval([float(v) for v in values])
    ordered = sorted(values)
    k = ordered.index(low) + 1
    assert high == ordered[n - k]  # symmetric: the k-th smallest and the k-th largest
    assert coverage == pytest.approx(coverage_by_enumeration(n, k))
    if k > 1:
        assert coverage >= MEDIAN_CONFIDENCE
    if k + 1 <= n // 2:  # one step narrower would fall below the confidence
        assert coverage_by_enumeration(n, k + 1) < MEDIAN_CONFIDENCE


def test_five_repetitions_give_min_max_and_nine_drop_one_at_each_end():
    five = [1.02, 0.94, 1.08, 1.05, 1.06]
    assert median_interval(five)[:2] == (0.94, 1.08)
    nine = [1.02, 0.94, 1.08, 1.05, 1.06, 1.01, 1.03, 0.99, 1.12]
    low, high, coverage = median_interval(nine)
    assert (low, high) == (0.99, 1.08) and coverage == pytest.approx(1 - 2 * 10 / 512)


def test_the_throughput_verdict_reads_the_interval_not_the_extremes():
    """Nine repetitions whose one slowest ratio is past the bar: the interval leaves it out, min-max would not."""
    document = json.loads((REPO / "bench" / "results" / "checkpoint.json").read_text())
    stall = document["results"]["stall"]
    async_walls = (1.01, 1.02, 0.99, 1.03, 1.00, 1.02, 1.01, 0.98, 1.09)

    def run(wall: float) -> dict:
        return {"wall_s_per_step": wall, "cpu_s_per_step": 1.0, "process_cpu_s_per_step": 1.0}

    # Every save interval alike: sync costs 30 % at each, so the bar is judged at the largest N.
    for row in stall["throughput"]:
        row["runs"] = {"none": [run(1.0)] * 9, "sync": [run(1.3)] * 9, "async": [run(w) for w in async_walls]}
    figures = slowdowns(stall["throughput"][-1]["runs"])
    assert figures["slowdown_async_spread"] == (0.98, 1.09)
    assert figures["slowdown_async_interval"][:2] == (0.99, 1.03)
    body = render_sections(document)["checkpoint saves"]
    bar_row = next(line for line in body.splitlines() if "async within 5%" in line)
    assert "met (upper end 0.030 <= 0.05)" in bar_row, bar_row
    assert "min-max 0.980-1.090; 96.09% interval of the median 0.990-1.030" in bar_row, bar_row


@pytest.mark.parametrize(("saves", "resolved"), [(5, False), (6, True)])
def test_the_stall_verdict_needs_the_documented_confidence(saves, resolved):
    """4 ratios (5 saves, the first dropped) hold the median with 87.5 % at best: below the rule's 93.75 %, so even
    ratios far under the bar are "not resolved"; 5 ratios reach 93.75 % and the same ratios are met."""
    document = json.loads((REPO / "bench" / "results" / "checkpoint.json").read_text())
    stall = document["results"]["stall"]
    stall["blocked_s"] = {"sync": [7.0] * saves, "async": [0.5] + [0.07] * (saves - 1)}  # every ratio 0.01
    body = render_sections(document)["checkpoint saves"]
    stall_row = next(line for line in body.splitlines() if line.startswith("| training blocked per save"))
    if resolved:
        assert "93.75% interval of the median" in stall_row and "<= 0.15: met (upper end 0.010 <= 0.15)" in stall_row
    else:
        assert "87.50% interval of the median" in stall_row, stall_row
        assert "<= 0.15: not resolved" in stall_row and "met (" not in stall_row, stall_row
