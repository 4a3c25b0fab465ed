"""bench/nvme_io.py's pure parts: reading ds_io's log, the GB/s arithmetic, the best setting, the folder checks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from common.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench/ is importable from there

from bench import nvme_io  # noqa: E402

# The lines ds_io (DeepSpeed 0.19, deepspeed/nvme/io_engine.py) prints for tid 0, warm-up loop first.
DS_IO_LOG = """tid 0: running main task 3
tid 0: running post-task
tid 0: task_latency_sec = [0.5, 0.25, 0.2, 0.4]
Task Write Latency = 0.85 sec
"""


def test_loop_seconds_drops_the_warm_up_loop_and_gbps_is_decimal():
    seconds = nvme_io.loop_seconds(DS_IO_LOG)
    assert seconds == [0.25, 0.2, 0.4]
    assert nvme_io.gbps(10**9, seconds) == pytest.approx([4.0, 5.0, 2.5])
    assert nvme_io.loop_seconds("no latency line here") == []


def test_best_setting_minimises_write_plus_read_time():
    runs = [
        {"block_size": 2**20, "queue_depth": 8, "write_gbps": [1.0, 1.1, 0.9], "read_gbps": [10.0, 10.0, 10.0]},
        {"block_size": 2**22, "queue_depth": 32, "write_gbps": [2.0, 2.0, 2.0], "read_gbps": [2.0, 2.0, 2.0]},
    ]
    # The first reads fast but writes slowly: 1/1.0 + 1/10 = 1.1 s per GB against 1/2 + 1/2 = 1.0 for the second.
    best = nvme_io.best_setting(runs)
    assert (best["block_size"], best["queue_depth"]) == (2**22, 32)
    text = nvme_io.render_nvme_io(
        {
            "settings": {
                "size_bytes": 2**28,
                "reps": 3,
                "warmup_loops": 1,
                "aio": {"single_submit": False, "overlap_events": True, "intra_op_parallelism": 1},
                "preset_aio": {"block_size": 2**20, "queue_depth": 8},
            },
            "storage": {"filesystem": "ext4", "device": "/dev/vda"},
            "runs": runs,
        }
    )
    assert "| **4 MiB** | **32** | 2.00 (2.00-2.00) | 2.00 (2.00-2.00) |" in text
    assert "| 1 MiB | 8 | 1.00 (0.90-1.10) | 10.00 (10.00-10.00) |" in text
    assert "--bandwidth nvme=2.00" in text and "block_size: 4194304" in text
    assert "processes at once" not in text  # no node measurement in this document


def test_node_figure_is_every_process_file_over_the_shared_time(tmp_path):
    """2 processes, 1 GB each, 0.5 s a loop: 4 GB/s for the node; the command asks ds_io for 2 processes."""
    assert nvme_io.gbps(2 * 10**9, [0.5]) == pytest.approx([4.0])
    aio = {"single_submit": False, "overlap_events": True, "intra_op_parallelism": 1}
    cmd = nvme_io.ds_io_command(tmp_path, 2**20, 2**20, 8, 3, aio, read=True, processes=2)
    assert cmd[cmd.index("--multi_process") + 1] == "2" and cmd[-1] == "--read"
    assert "--multi_process" not in nvme_io.ds_io_command(tmp_path, 2**20, 2**20, 8, 3, aio, read=True)
    node = {"processes": 2, "block_size": 2**20, "queue_depth": 8, "write_gbps": [1.8], "read_gbps": [2.2]}
    text = nvme_io.render_nvme_io(
        {
            "settings": {
                "size_bytes": 2**28,
                "reps": 1,
                "warmup_loops": 1,
                "aio": aio,
                "preset_aio": {"block_size": 2**20, "queue_depth": 8},
            },
            "storage": {"filesystem": "ext4", "device": "/dev/vda"},
            "runs": [{"block_size": 2**20, "queue_depth": 8, "write_gbps": [1.5], "read_gbps": [1.5]}],
            "node": node,
        }
    )
    assert "**2 processes at once**" in text and "`--bandwidth nvme=2.00`" in text


def test_mount_of_takes_the_longest_mount_point():
    mounts = "/dev/vda / ext4 rw 0 0\ntmpfs /tmp tmpfs rw 0 0\n/dev/nvme0n1 /mnt/nvme xfs rw 0 0\n"
    assert nvme_io.mount_of("/mnt/nvme/swap", mounts)["filesystem"] == "xfs"
    assert nvme_io.mount_of("/mnt/nvmex", mounts)["device"] == "/dev/vda"
    assert nvme_io.mount_of("/tmp", mounts)["filesystem"] == "tmpfs"


def test_bad_input_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such folder"):
        nvme_io.check_folder(tmp_path / "missing", 0)
    with pytest.raises(ConfigError, match="multiple of 4096"):
        nvme_io.parse_sizes("1000")
    with pytest.raises(ConfigError, match="positive integers"):
        nvme_io.parse_depths("8,deep")
    assert nvme_io.parse_sizes("256KiB,1MiB") == [262144, 1048576]
