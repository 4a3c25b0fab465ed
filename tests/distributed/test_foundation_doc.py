"""The facts docs/foundation.md states about the test model are the model's own (counted, not typed)."""

from __future__ import annotations

import re

from _util import REPO
from worker import TinyNet

FOUNDATION = REPO / "docs" / "foundation.md"


def test_the_documented_parameter_count_is_the_worker_models():
    counted = sum(p.numel() for p in TinyNet().parameters())
    stated = re.findall(r"([\d,]+)-parameter residual MLP", FOUNDATION.read_text())
    assert stated, "docs/foundation.md no longer names the test model's size"
    assert {int(s.replace(",", "")) for s in stated} == {counted}, (stated, counted)
