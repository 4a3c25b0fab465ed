"""One rank of bench/offload_time.py: a stack of wide bias-free linear layers trained by a raw DeepSpeed loop.

Every matrix is square and wide (``--width``), so that each rank's partition of it is well above DeepSpeed's 1 MiB
swap minimum and every parameter really goes to the offload tier; fp32 and random data, so that the bytes moved
are the planner's fp32 terms. Rank 0 writes ``--out`` with the per-step wall and CPU times.

    python -m torch.distributed.run --nproc_per_node 2 bench/_offload_worker.py --preset deepspeed_stage_3 \\
        --width 2048 --depth 8 --steps 8 --out OUT.json [--nvme-path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import deepspeed
import torch

from common.process_setup import end_process_group
from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config

MICRO_BATCH = 8


def build_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def disk_bytes() -> tuple[int, int]:
    """(read, written) bytes this process moved to and from storage so far: the kernel's block-layer counters,
    which count DeepSpeed's O_DIRECT swap I/O (its aio threads are this process's) and not the page cache."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def disk_stats(path: str) -> tuple[int, int, int] | None:
    """(milliseconds the device under ``path`` was busy, sectors read, sectors written) so far, from
    /proc/diskstats (its io_ticks: time with at least one request in flight, whoever issued it); None when the
    folder is not on a block device listed there (an overlay or network file system)."""
    device = os.stat(path).st_dev
    for line in Path("/proc/diskstats").read_text().splitlines():
        fields = line.split()
        if (int(fields[0]), int(fields[1])) == (os.major(device), os.minor(device)):
            return int(fields[12]), int(fields[5]), int(fields[9])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--depth", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--nvme-path", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    facts = RunFacts(
        world_size=world,
        micro_batch_size=MICRO_BATCH,
        precision="fp32",
        hidden_size=args.width,
        nvme_path=args.nvme_path,
        gradient_clipping=0.0,
    )
    ds_config = resolve_deepspeed_config(args.preset, facts)
    model = build_model(args.width, args.depth)
    optimizer = make_optimizer(model.parameters(), ds_config, lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    generator = torch.Generator().manual_seed(rank)
    device_path = args.nvme_path or os.getcwd()
    wall, cpu, disk, device = [time.perf_counter()], [time.process_time()], [disk_bytes()], [disk_stats(device_path)]
    for _ in range(args.steps):
        x = torch.randn(MICRO_BATCH, args.width, generator=generator)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
        disk.append(disk_bytes())
        device.append(disk_stats(device_path))
    moved = [[b[0] - a[0], b[1] - a[1]] for a, b in zip(disk, disk[1:])]
    everyone: list = [None] * world
    torch.distributed.all_gather_object(everyone, moved)
    if rank == 0:
        record = {
            "disk_bytes_per_step": everyone,  # per rank, per step: [read, written]
            # the device, per step (both ranks and anything else on it): [busy seconds, bytes read, bytes written]
            "device_per_step": None
            if None in device
            else [[(b[0] - a[0]) / 1e3, (b[1] - a[1]) * 512, (b[2] - a[2]) * 512] for a, b in zip(device, device[1:])],
            "num_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()),
            "world_size": world,
            "step_s": [b - a for a, b in zip(wall, wall[1:])],
            "cpu_step_s": [b - a for a, b in zip(cpu, cpu[1:])],
            "zero": ds_config["zero_optimization"],
        }
        Path(args.out).write_text(json.dumps(record))
    torch.distributed.barrier()
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort


if __name__ == "__main__":
    main()
