"""A rank that runs a few gloo collectives and returns, its tensors and group still held as DeepSpeed holds them.

``python -m torch.distributed.run ... exit_worker.py end|return``: ``end`` finishes through
``common.process_setup.end_process_group`` as the recipes do; ``return`` exits straight after the last collective.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from common.process_setup import end_process_group

# What an engine keeps until the interpreter tears it down: the process group (past destroy_process_group) and the
# buffers its last collectives used.
HELD: list = []


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    HELD.append(dist.group.WORLD)
    gathered = [torch.empty(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]))
    bucket = torch.ones(1000)
    dist.all_reduce(bucket)
    HELD.extend([gathered, bucket])
    if sys.argv[1] == "end":
        end_process_group()


if __name__ == "__main__":
    main()
