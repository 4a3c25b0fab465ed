"""A small ZeRO-2 training run on the factory, with one fault switched on, for tests/distributed/test_hang.py.

    python tests/distributed/hang_worker.py --backend lightning --fault sleep --fault-rank 0 --out RUN
    accelerate launch --config_file RUN/accelerate.yaml --num_processes 4 \\
        tests/distributed/hang_worker.py --backend accelerate --fault skip --fault-rank 2 --out RUN

Each step computes the loss, all-reduces it for the log (as the recipes do) and lets DeepSpeed reduce the
gradients. At optimizer step ``--fault-step`` rank ``--fault-rank`` then misbehaves:
- ``skip``: it does not issue the loss all-reduce (the other ranks do);
- ``shape``: it all-reduces 2 numbers where the other ranks all-reduce 1;
- ``sleep``: it sleeps forever inside the step, outside any collective.
Hang detection comes only from the factory calls (``lightning_trainer_kwargs`` / ``accelerator_kwargs`` with
``timeout`` and ``run_dir``), as in a recipe. The faulty rank writes ``RUN/fault.json`` (its rank, the step, the
sequence number the skipped or misshapen collective would have had, and the time) just before the fault.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from worker_util import quiet_cpu_trainer

from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config

FAULTS = ("none", "skip", "shape", "sleep")
WIDTH, MICRO_BATCH = 64, 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))


def make_batches(steps: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(steps * MICRO_BATCH, WIDTH, generator=g), torch.randn(steps * MICRO_BATCH, 1, generator=g)
    )
    return torch.utils.data.DataLoader(data, batch_size=MICRO_BATCH)


def next_sequence_number() -> int:
    """The flight recorder's sequence number of the next collective on the default process group."""
    return int(dist.group.WORLD._get_sequence_number_for_group()) + 1


def logged_loss(loss: torch.Tensor, step: int, args: argparse.Namespace) -> None:
    """All-reduce the loss for the log, or misbehave here when this rank and step are the fault's."""
    value = loss.detach().reshape(1).clone()
    if args.fault == "none" or dist.get_rank() != args.fault_rank or step != args.fault_step:
        dist.all_reduce(value)
        return
    fault = {"rank": dist.get_rank(), "step": step, "seq": next_sequence_number(), "time": time.time()}
    Path(args.out, "fault.json").write_text(json.dumps(fault))
    if args.fault == "shape":
        dist.all_reduce(torch.cat([value, value]))
    elif args.fault == "sleep":
        while True:
            time.sleep(3600)
    # "skip": go on to the next step without the all-reduce


def run_lightning(args: argparse.Namespace, ds_config: dict) -> None:
    import lightning as L

    from common.strategy import lightning_trainer_kwargs

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            logged_loss(loss, self.trainer.global_step, args)
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), self.trainer.strategy.config, lr=1e-3)

    trainer = quiet_cpu_trainer(
        args.processes,
        args.steps,
        use_distributed_sampler=False,
        **lightning_trainer_kwargs(ds_config, timeout=timedelta(seconds=args.timeout), run_dir=args.out),
    )
    trainer.fit(Module(), make_batches(args.steps))


def run_accelerate(args: argparse.Namespace, ds_config: dict) -> None:
    from accelerate import Accelerator

    from common.strategy import accelerator_kwargs

    accelerator = Accelerator(
        **accelerator_kwargs(ds_config, timeout=timedelta(seconds=args.timeout), run_dir=args.out)
    )
    model = make_model()
    engine, optimizer = accelerator.prepare(model, make_optimizer(model.parameters(), ds_config, lr=1e-3))
    for step, (x, y) in enumerate(make_batches(args.steps)):
        with accelerator.accumulate(engine):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            logged_loss(loss, step, args)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("lightning", "accelerate"), required=True)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=2)
    parser.add_argument("--processes", type=int, default=2, help="ranks Lightning starts (Accelerate: the launcher's)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=10.0, help="collective timeout, seconds")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", args.processes))
    ds_config = resolve_deepspeed_config(
        "deepspeed_stage_2", RunFacts(world_size=world, micro_batch_size=MICRO_BATCH, precision="fp32")
    )
    {"lightning": run_lightning, "accelerate": run_accelerate}[args.backend](args, ds_config)


if __name__ == "__main__":
    main()
