"""``zero-recipes doctor --collectives`` on 2 real gloo ranks measures each collective per buffer dtype, and the
planner reads one fit per dtype back from its doctor.json (the bf16 fit prices a bf16 run's gradients)."""

from __future__ import annotations

import json

import pytest
from _util import PYTHON, run

from common.communication import links_from_doctor
from common.tools.doctor import MEASURED_OPS


@pytest.mark.slow
def test_doctor_measures_every_collective_in_each_dtype(tmp_path):
    out = tmp_path / "doctor"
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "common.tools.doctor"]
    proc = run([*torchrun, "--collectives", "--sizes", "64KiB,1MiB", "--iters", "2", "--dtypes", "fp32,bf16",
                "--out", out], timeout=300)  # fmt: skip
    measured = json.loads((out / "doctor.json").read_text())["measured"]
    rows = {(r["dtype"], r["op"], r["bytes"]) for r in measured["collectives"]}
    expected = {(d, op, size) for d in ("fp32", "bf16") for op in MEASURED_OPS for size in (65536, 1 << 20)}
    assert rows == expected and all(r["seconds"] > 0 for r in measured["collectives"])
    # The buffers really hold the dtype: as many 4-byte or 2-byte elements as the size has room for.
    width = {"fp32": 4, "bf16": 2}
    assert all(r["elements"] == r["bytes"] // width[r["dtype"]] for r in measured["collectives"])
    links = links_from_doctor({"measured": measured}, world_size=2)
    assert set(links.by_dtype) == {"fp32", "bf16"} and set(links.by_dtype["bf16"]) == set(MEASURED_OPS)
    assert links.for_dtype("bf16") is links.by_dtype["bf16"] and links.links is links.by_dtype["fp32"]
    # The printed table: a line per op, dtype and size.
    printed = [line.split()[:2] for line in proc.stdout.splitlines() if line.strip().startswith(MEASURED_OPS)]
    assert sorted(map(tuple, printed)) == sorted((op, d) for d in ("fp32", "bf16") for op in MEASURED_OPS for _ in "ab")
