"""Imported by every Python process whose PYTHONPATH holds this folder: counts the run's collectives per optimizer
step when ``ZR_PEER_COMMS`` names a folder (bench/_collective_counter.py says how), and profiles rank 0's steps when
``ZR_PEER_PROFILE`` names one (bench/_step_phases.py); does nothing otherwise."""

import os
from pathlib import Path

if os.environ.get("ZR_PEER_COMMS"):
    from bench._collective_counter import setup_collective_count

    setup_collective_count(Path(os.environ["ZR_PEER_COMMS"]))

if os.environ.get("ZR_PEER_PROFILE"):
    from bench._step_phases import setup_step_profile

    setup_step_profile(Path(os.environ["ZR_PEER_PROFILE"]), os.environ["ZR_PEER_PROFILE_STEPS"])
