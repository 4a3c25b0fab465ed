"""Shared test setup: make ``tests/_util.py`` importable and keep subprocesses to one thread each."""

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Two processes on two cores: one intra-op thread each (docs/design.md: more threads compete for the same cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A hang report of a process given no run directory goes to $ZR_HANG_DIR, else ./hang: never the checkout's.
os.environ.setdefault("ZR_HANG_DIR", os.path.join(tempfile.gettempdir(), "zr-test-hang"))


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread for the test (two cores, shared with the other tests), restored afterwards."""
    import torch  # here, not at the top: OMP_NUM_THREADS above must be set before anything imports torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def forbid(monkeypatch):
    """``forbid(module, name, why)``: for the rest of the test, a call of ``module.name`` fails it with ``why``."""

    def replace(module, name: str, why: str) -> None:
        def called(*args, **kwargs):
            raise AssertionError(why)

        monkeypatch.setattr(module, name, called)

    return replace
