"""``common.zero3_trace`` reaches DeepSpeed's cached release decisions, and leaves anything but a ZeRO-3 engine alone.
The end-to-end check (a run's all-gather bytes with and without it) is tests/recipes/test_comm_summary.py."""

from __future__ import annotations

import torch

from common.zero3_trace import cached_release_plan, retrace_after_evaluation


def test_the_installed_deepspeed_has_the_cache_it_forgets():
    # None would make the retrace a silent no-op: a DeepSpeed that moved the cache must fail here first.
    assert callable(getattr(cached_release_plan(), "cache_clear", None))


def test_engines_without_zero3_are_left_alone():
    module = torch.nn.Linear(2, 2)
    retrace_after_evaluation(module)  # FSDP2 trains the module itself: no optimizer attribute
    retrace_after_evaluation(type("Stage2Engine", (), {"optimizer": object()})())  # no parameter offload
