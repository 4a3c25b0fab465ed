"""Shared test setup: make ``tests/_util.py`` importable and keep subprocesses to one thread each."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Two processes on two cores: one intra-op thread each (docs/design.md: more threads compete for the same cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
