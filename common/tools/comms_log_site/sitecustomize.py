"""Imported by every Python process whose PYTHONPATH holds this folder: logs DeepSpeed's collectives when
``ZR_COMMS_LOG`` names a folder (common/comms_log.py says why and how); does nothing otherwise."""

import os

if os.environ.get("ZR_COMMS_LOG"):
    from common.comms_log import setup_comms_log

    steps = os.environ.get("ZR_COMMS_LOG_STEPS")
    setup_comms_log(os.environ["ZR_COMMS_LOG"], int(steps) if steps else None)
