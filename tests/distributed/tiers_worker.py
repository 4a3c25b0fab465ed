"""Train worker.py's MLP, wider, through Lightning or Accelerate with an NVMe-offload or ZeRO++ preset; record facts.

The storage and communication tiers beyond the three stages need a model of their own size: DeepSpeed swaps
a partition to NVMe only when it has at least 1 MiB (smaller ones stay in host RAM without a word), so the blocks
here are 1024 wide (each matrix's partition on 2 ranks is 4 MiB in fp32). Each rank writes ``OUT/rank{r}.json`` with
its per-step losses, the fixed-batch loss before and after, the engine's ZeRO fields, the swap files DeepSpeed had
written under the NVMe folder while training (path -> largest size seen after any step) and how many parameters
carry hpZ's secondary (node-local) partition.

    python tests/distributed/tiers_worker.py --backend lightning --preset deepspeed_stage_3_offload_nvme \\
        --nvme-path /tmp/swap --out OUT
    accelerate launch --config_file CFG tests/distributed/tiers_worker.py --backend accelerate ...
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from worker import TinyNet, engine_facts, fixed_batch_loss, launcher_world_size, make_data
from worker_util import quiet_cpu_trainer, run_then_exit, write_rank_record

from common.config import parse_overrides
from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config

WIDTH = 1024  # an up/down matrix is 1024 x 2048: 4 MiB per rank on 2 ranks in fp32, 2 MiB in bf16
DEPTH = 2


class SwapWatch:
    """The swap files of this rank under the NVMe folder: largest size seen at any look, by path."""

    def __init__(self, nvme_path: str | None, rank: int) -> None:
        self.root = Path(nvme_path) if nvme_path else None
        self.rank_folder = f"rank{rank}"
        self.sizes: dict[str, int] = {}

    def look(self) -> None:
        if self.root is None:
            return
        for path in self.root.rglob("*"):
            relative = path.relative_to(self.root)
            if path.is_file() and self.rank_folder in relative.parts:
                self.sizes[str(relative)] = max(self.sizes.get(str(relative), 0), path.stat().st_size)


def secondary_partitions(engine) -> int:
    """Parameters holding hpZ's secondary partition (``ds_secondary_tensor``): 0 when hpZ is off."""
    return sum(1 for p in engine.module.parameters() if getattr(p, "ds_secondary_tensor", None) is not None)


def dump(out: Path, rank: int, losses: list[float], fixed: list[float], world_env: int, engine, watch) -> None:
    record = {
        "rank": rank,
        "losses": losses,
        "fixed_batch_loss": {"before": fixed[0], "after": fixed[1]},
        "world_size_env": world_env,
        "world_size_process_group": torch.distributed.get_world_size(),
        "engine": engine_facts(engine),
        "swap_files": watch.sizes,
        "secondary_partitions": secondary_partitions(engine),
        "optimizer": type(engine.optimizer).__name__,
    }
    write_rank_record(out, rank, record)


def run_lightning(args, ds_config) -> None:
    import lightning as L

    from common.strategy import lightning_trainer_kwargs

    losses: list[float] = []
    fixed: list[float] = []
    world_env: list[int] = []
    watch: list[SwapWatch] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = TinyNet(width=args.width, depth=DEPTH)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
            losses.append(loss.item())
            return loss

        def on_train_start(self) -> None:
            world_env.append(launcher_world_size())
            watch.append(SwapWatch(args.nvme_path, self.global_rank))
            fixed.append(fixed_batch_loss(self.net, torch.float32))

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            watch[0].look()

        def on_train_end(self) -> None:
            fixed.append(fixed_batch_loss(self.net, torch.float32))

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), self.trainer.strategy.config, lr=args.lr)

    trainer = quiet_cpu_trainer(
        args.devices,
        args.steps,
        **lightning_trainer_kwargs(ds_config),
    )
    loader = torch.utils.data.DataLoader(make_data(), batch_size=args.micro_batch_size)
    trainer.fit(Module(), loader)
    dump(Path(args.out), trainer.global_rank, losses, fixed, world_env[0], trainer.strategy.model, watch[0])


def run_accelerate(args, ds_config) -> None:
    from accelerate import Accelerator

    from common.strategy import accelerator_kwargs

    accelerator = Accelerator(**accelerator_kwargs(ds_config))
    torch.manual_seed(0)
    net = TinyNet(width=args.width, depth=DEPTH)
    optimizer = make_optimizer(net.parameters(), ds_config, lr=args.lr)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=args.micro_batch_size)
    engine, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    watch = SwapWatch(args.nvme_path, accelerator.process_index)
    fixed = [fixed_batch_loss(engine, torch.float32)]
    losses: list[float] = []
    for step, (x, y) in enumerate(loader, start=1):
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        watch.look()
        if step >= args.steps:
            break
    fixed.append(fixed_batch_loss(engine, torch.float32))
    dump(Path(args.out), accelerator.process_index, losses, fixed, launcher_world_size(), engine, watch)
    # Tear the process group down as the recipes do; the worker then leaves without interpreter shutdown
    # (run_then_exit says why).
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("lightning", "accelerate"), required=True)
    parser.add_argument("--preset", default="deepspeed_stage_3")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--devices-per-node", type=int, default=None)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--nvme-path", default=None)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    facts = RunFacts(
        world_size=int(os.environ.get("WORLD_SIZE", args.devices)),
        micro_batch_size=args.micro_batch_size,
        precision="fp32",  # the equivalence bar (1e-5) is an fp32 one
        hidden_size=args.width,
        nvme_path=args.nvme_path,
        devices_per_node=args.devices_per_node,
    )
    ds_config = resolve_deepspeed_config(args.preset, facts, parse_overrides(args.set))
    (run_lightning if args.backend == "lightning" else run_accelerate)(args, ds_config)


if __name__ == "__main__":
    run_then_exit(main)
