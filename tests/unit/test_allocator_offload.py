"""The offload runs' allocator default: decided by bench/allocator_offload.py's verdict, applied per preset."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from common.host_memory import keeps_freed_memory_by_default
from common.presets import PRESET_NAMES
from common.strategy import RunFacts, resolve_deepspeed_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench/ is importable from there

from bench.allocator_offload import raises_host_memory  # noqa: E402


def runs(kept_mib: list[float], default_mib: list[float]) -> dict:
    def rows(values: list[float]) -> list[dict]:
        return [{"rss_after_step_bytes": v, "peak_rss_bytes": v, "cpu_ms": 1.0, "page_faults": 0.0} for v in values]

    default = {"raw": rows(default_mib), "lightning": rows(default_mib)}
    return {"freed memory kept": {"raw": rows(kept_mib), "lightning": rows(default_mib)}, "glibc defaults": default}


def test_the_verdict_needs_more_resident_memory_in_every_repetition():
    assert raises_host_memory(runs([110, 120, 105], [100, 100, 100]))
    assert not raises_host_memory(runs([110, 95, 105], [100, 100, 100]))  # one repetition lower: noise
    assert not raises_host_memory(runs([90, 95, 99], [100, 100, 100]))


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_offload_presets_leave_glibcs_defaults_and_the_others_keep_freed_memory(preset):
    with tempfile.TemporaryDirectory() as nvme:
        facts = RunFacts(world_size=2, micro_batch_size=2, precision="bf16", hidden_size=256, nvme_path=nvme)
        ds_config = resolve_deepspeed_config(preset, facts)
    assert keeps_freed_memory_by_default(ds_config) is ("offload" not in preset), ds_config["zero_optimization"]
