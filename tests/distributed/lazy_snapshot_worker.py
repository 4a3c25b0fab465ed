"""One rank of the lazy-snapshot check: an asynchronous save holds the state of the moment it was taken.

``AsyncCheckpointer`` copies the tensors that only an optimizer update changes after the save call returns, while
the next forward and backward run, and makes the torch optimizer's step wait for that copy. For ZeRO stages 2 and
3 on DeepSpeed's own engine (fp32, torch AdamW, 2 processes over gloo) this worker trains two steps, saves
synchronously with DeepSpeed's own checkpoint engine (the reference), saves asynchronously at the same state, and
trains a third step at once: its forward pass changes the BatchNorm statistics in place, its update the weights,
the fp32 partitions and the moments. The copy is slowed by ``ZERO_RECIPES_TEST_CHECKPOINT_COPY_DELAY_S`` (the test
sets it), so it is still pending when that step runs. Then every tensor of both checkpoints is compared.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/lazy_snapshot_worker.py --out OUT

On a GPU (NCCL, one process per GPU) the model trains there and the snapshot takes the CUDA path: pinned host
memory, the update-only tensors copied on a side stream; each rank also reports the side streams it used and the
pinned bytes it holds, and prints one line per stage. On one GPU:

    ZERO_RECIPES_TEST_CHECKPOINT_COPY_DELAY_S=0.5 python3 -m torch.distributed.run --nproc_per_node 1 \
        tests/distributed/lazy_snapshot_worker.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from worker_util import write_rank_record

from common.async_checkpoint import AsyncCheckpointer, Checkpointer
from common.process_setup import end_process_group
from common.tools.zero_files import deepspeed_pickle_classes

STAGES = (2, 3)


class Net(nn.Module):
    """A BatchNorm between two linear layers: the forward pass changes its running statistics in place."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def train_step(engine, generator: torch.Generator) -> None:
    x = torch.randn(4, 16, generator=generator).to(engine.device)
    loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True))
    engine.backward(loss)
    engine.step()


def tensors(state, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a loaded checkpoint file, by its path in the structure."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list | tuple) else ()
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        found.update(tensors(value, f"{prefix}/{key}"))
    return found


def compare(reference: Path, candidate: Path) -> tuple[int, list[str]]:
    """How many tensors the reference checkpoint's files hold, and which differ in the candidate's (or are missing)."""
    compared, differing = 0, []
    for path in sorted(reference.rglob("*.pt")):
        with torch.serialization.safe_globals(deepspeed_pickle_classes()):
            expected = tensors(torch.load(path, weights_only=True))
            actual = tensors(torch.load(candidate / path.relative_to(reference), weights_only=True))
        for key, tensor in expected.items():
            compared += 1
            if key not in actual or not torch.equal(actual[key], tensor):
                differing.append(f"{path.name}:{key}")
    return compared, differing


def check_stage(stage: int, out: Path, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero, "zero_allow_untested_optimizer": True}
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):
        train_step(engine, generator)

    def save_to(folder: Path) -> None:
        engine.save_checkpoint(str(folder), tag="checkpoint")

    Checkpointer(out / f"stage{stage}-sync", rank, world, 1, 0, dist.barrier).save(2, save_to)
    checkpointer = AsyncCheckpointer(out / f"stage{stage}-async", rank, world, 1, 0, dist.barrier)
    checkpointer.install(engine)
    checkpointer.save(2, save_to)
    lazy_storages = len(checkpointer._lazy or ())
    train_step(engine, generator)  # changes what was saved: the BatchNorm statistics in place, then the update
    checkpointer.finish()
    dist.barrier()
    compared, differing = compare(
        out / f"stage{stage}-sync" / "checkpoints" / "step_000002",
        out / f"stage{stage}-async" / "checkpoints" / "step_000002",
    )
    pinned = [t for t in checkpointer._pool.values() if t.is_pinned()] if torch.cuda.is_available() else []
    return {
        "lazy_storages": lazy_storages,
        "update_waits": len(checkpointer.update_wait_s),
        "compared": compared,
        "differing": differing,
        "side_streams": len(checkpointer._device_copies._side),
        "pinned_bytes": sum(t.numel() * t.element_size() for t in pinned),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {f"stage{stage}": check_stage(stage, args.out, rank, world) for stage in STAGES}
    write_rank_record(args.out, rank, record)
    for stage, facts in record.items():
        print(f"rank {rank} {stage} ({'cuda' if on_gpu else 'cpu'}): {json.dumps(facts)}", flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
