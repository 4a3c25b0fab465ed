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
import time
from pathlib import Path

import deepspeed
import torch

from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config

MICRO_BATCH = 8


def build_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


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
    wall, cpu = [time.perf_counter()], [time.process_time()]
    for _ in range(args.steps):
        x = torch.randn(MICRO_BATCH, args.width, generator=generator)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
    if rank == 0:
        record = {
            "num_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()),
            "world_size": world,
            "step_s": [b - a for a, b in zip(wall, wall[1:])],
            "cpu_step_s": [b - a for a, b in zip(cpu, cpu[1:])],
            "zero": ds_config["zero_optimization"],
        }
        Path(args.out).write_text(json.dumps(record))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
