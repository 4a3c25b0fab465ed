"""summary.json's fields: every recipe's summary dataclass goes through ``common.rundir.summary_fields``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.rundir import summary_fields


@dataclass
class Summary:
    loss: float
    extra: dict[str, Any] | None = None
    communication: dict[str, Any] | None = None


def test_communication_is_left_out_only_when_the_run_did_not_log_it():
    assert summary_fields(Summary(1.5)) == {"loss": 1.5, "extra": None}  # other None fields stay
    logged = {"steps": 3, "collectives": {}}
    assert summary_fields(Summary(1.5, communication=logged)) == {"loss": 1.5, "extra": None, "communication": logged}
