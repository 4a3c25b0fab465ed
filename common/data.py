"""A sampler whose order depends only on (seed, step): identical on both backends, exact on resume.

Lightning's DistributedSampler and Accelerate's batch sharding split data differently, and neither
fast-forwards to the middle of an epoch on resume. :class:`StepSampler` fixes the global order once
(a seeded permutation per epoch), gives rank r the r-th slice of every global batch, and starts at
any optimizer step, so that a resumed run sees exactly the batches the uninterrupted run saw.

Use it with ``Trainer(use_distributed_sampler=False)`` and, under Accelerate, do not pass the
DataLoader to ``accelerator.prepare`` (it is already sharded).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class StepSampler(torch.utils.data.Sampler[int]):
    """Indices for one rank, ``max_steps`` optimizer steps long, starting at ``start_step``.

    Args:
        num_samples: dataset length.
        micro_batch_size: samples per rank per micro-batch.
        grad_accum: micro-batches per optimizer step.
        rank: this rank.
        world_size: ranks in total.
        seed: permutation seed.
        start_step: first optimizer step to produce (0 for a new run).
        max_steps: last optimizer step (exclusive).
        full_length: report the whole run's length even when starting at a later step. Lightning counts the
            batches of a resumed epoch from the checkpoint's count, so its loader must claim the full length;
            Accelerate's loop takes the remaining length (the default).
    """

    def __init__(
        self,
        num_samples: int,
        micro_batch_size: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        seed: int,
        start_step: int,
        max_steps: int,
        full_length: bool = False,
    ) -> None:
        if num_samples < micro_batch_size * world_size:
            raise ValueError(
                f"dataset has {num_samples} samples, fewer than one global micro-batch "
                f"({micro_batch_size} x {world_size} ranks)"
            )
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.start_step = start_step
        self.max_steps = max_steps
        self.full_length = full_length

    @property
    def global_micro_batch(self) -> int:
        return self.micro_batch_size * self.world_size

    def __len__(self) -> int:
        steps = self.max_steps if self.full_length else max(0, self.max_steps - self.start_step)
        return steps * self.grad_accum * self.micro_batch_size

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[int]:
        per_epoch = self.num_samples // self.global_micro_batch  # drop the ragged tail, as drop_last does
        first = self.start_step * self.grad_accum
        last = self.max_steps * self.grad_accum
        order, order_epoch = None, -1
        for micro in range(first, last):
            epoch, position = divmod(micro, per_epoch)
            if epoch != order_epoch:
                order, order_epoch = self._epoch_order(epoch), epoch
            start = position * self.global_micro_batch + self.rank * self.micro_batch_size
            yield from order[start : start + self.micro_batch_size].tolist()


def epochs_for(max_steps: int, num_samples: int, micro_batch_size: int, grad_accum: int, world_size: int) -> float:
    """How many passes over the data ``max_steps`` optimizer steps make (for the log)."""
    per_epoch = num_samples // (micro_batch_size * world_size)
    return max_steps * grad_accum / max(1, per_epoch)
