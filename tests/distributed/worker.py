"""Train a small MLP for a few steps through Lightning or Accelerate with a factory preset; record facts.

Each rank writes ``OUT/rank{r}.json`` with its per-step losses, the loss on one fixed batch before and
after training, the world size as the launcher and the process group see it, the DeepSpeed engine's
effective settings (batch, accumulation, clipping, precision, every ZeRO field) next to the clipping the
factory wrote, and the model-state bytes it holds (``common.accounting``). The tests compare these across
stages and backends.

    python tests/distributed/worker.py --backend lightning --preset deepspeed_stage_3 --precision fp32 --out OUT
    accelerate launch --config_file CFG tests/distributed/worker.py --backend accelerate ...
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from worker_util import quiet_cpu_trainer, run_then_exit, write_rank_record

from common.accounting import model_state_bytes
from common.activation import apply_activation_checkpointing
from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config

HIDDEN = 512


class Block(torch.nn.Module):
    """A residual MLP block: the unit activation checkpointing wraps."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyNet(torch.nn.Module):
    def __init__(self, width: int = HIDDEN, depth: int = 3, frozen_body: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(32, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.out = torch.nn.Linear(width, 1)
        if frozen_body:  # the LoRA situation: most weights frozen, a few trainable
            for p in self.parameters():
                p.requires_grad_(False)
            self.out.requires_grad_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make_data(n: int = 256) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True)).tanh() + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank, before and after training: the whole data set (256 samples)."""
    return make_data().tensors


def fixed_batch_loss(net: torch.nn.Module, dtype: torch.dtype) -> float:
    """Loss of ``net`` on :func:`fixed_batch`; every rank calls it (stage 3 gathers weights collectively)."""
    x, y = fixed_batch()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(net(x.to(dtype)).float(), y).item()


def grad_norm(engine) -> float | None:
    """The global gradient norm DeepSpeed computed for the last step (before clipping), if it reports one."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def engine_facts(engine) -> dict:
    """The settings DeepSpeed actually runs with (what both backends must agree on)."""
    return {
        "train_batch_size": engine.train_batch_size(),
        "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
        "grad_accum": engine.gradient_accumulation_steps(),
        "gradient_clipping": engine.gradient_clipping(),
        "bf16": engine.bfloat16_enabled(),
        "fp16": engine.fp16_enabled(),
        "zero": engine._config.zero_config.model_dump(mode="json"),
    }


def launcher_world_size() -> int:
    """WORLD_SIZE as the launcher set it (0 if unset); read during training: Lightning deletes it at teardown."""
    return int(os.environ.get("WORLD_SIZE", "0"))


def dump(
    out: Path,
    rank: int,
    losses: list[float],
    norms: list[float | None],
    fixed: list[float],
    world_size_env: int,
    engine,
    ds_config: dict,
    num_params: int,
) -> None:
    record = {
        "rank": rank,
        "losses": losses,
        "grad_norms": norms,
        "fixed_batch_loss": {"before": fixed[0], "after": fixed[1]},
        "world_size_env": world_size_env,
        "factory_gradient_clipping": ds_config.get("gradient_clipping"),  # None: the factory left it out
        "engine": engine_facts(engine),
        "state_bytes": model_state_bytes(engine),
        "num_params": num_params,
        "persistent_params": sum(p.ds_numel for p in engine.module.parameters() if getattr(p, "ds_persist", False)),
        "optimizer": type(engine.optimizer).__name__,
        "world_size_process_group": torch.distributed.get_world_size(),  # the group DeepSpeed reduces over
    }
    write_rank_record(out, rank, record)


def run_lightning(args, ds_config) -> None:
    import lightning as L

    from common.strategy import lightning_trainer_kwargs

    losses: list[float] = []
    norms: list[float | None] = []
    fixed: list[float] = []
    world_size_env: list[int] = []
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = TinyNet(frozen_body=args.frozen)
            if args.activation_checkpointing != "none":
                apply_activation_checkpointing(self.net, args.activation_checkpointing, block_classes=[Block])

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
            losses.append(loss.item())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            norms.append(grad_norm(self.trainer.strategy.model))

        def on_train_start(self) -> None:
            world_size_env.append(launcher_world_size())
            fixed.append(fixed_batch_loss(self.net, dtype))

        def on_train_end(self) -> None:
            fixed.append(fixed_batch_loss(self.net, dtype))

        def configure_optimizers(self):
            params = [p for p in self.parameters() if p.requires_grad]
            return make_optimizer(params, self.trainer.strategy.config, lr=args.lr)

    module = Module()
    num_params = sum(p.numel() for p in module.parameters())
    loader = torch.utils.data.DataLoader(make_data(), batch_size=args.micro_batch_size)
    trainer = quiet_cpu_trainer(
        args.devices,
        args.steps,
        **lightning_trainer_kwargs(ds_config),
    )
    trainer.fit(module, loader)
    record = (losses, norms, fixed, world_size_env[0], trainer.strategy.model, ds_config, num_params)
    dump(Path(args.out), trainer.global_rank, *record)


def run_accelerate(args, ds_config) -> None:
    from accelerate import Accelerator

    from common.strategy import accelerator_kwargs

    accelerator = Accelerator(**accelerator_kwargs(ds_config))
    torch.manual_seed(0)
    net = TinyNet(frozen_body=args.frozen)
    if args.activation_checkpointing != "none":
        apply_activation_checkpointing(net, args.activation_checkpointing, block_classes=[Block])
    num_params = sum(p.numel() for p in net.parameters())
    optimizer = make_optimizer([p for p in net.parameters() if p.requires_grad], ds_config, lr=args.lr)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=args.micro_batch_size)
    engine, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32
    fixed = [fixed_batch_loss(engine, dtype)]
    losses: list[float] = []
    norms: list[float | None] = []
    for step, (x, y) in enumerate(loader, start=1):
        with accelerator.accumulate(engine):
            loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(grad_norm(engine))
        if step >= args.steps * ds_config["gradient_accumulation_steps"]:
            break
    fixed.append(fixed_batch_loss(engine, dtype))
    record = (losses, norms, fixed, launcher_world_size(), engine, ds_config, num_params)
    dump(Path(args.out), accelerator.process_index, *record)
    # Tear the process group down as the recipes do; the worker then leaves without interpreter shutdown
    # (run_then_exit says why).
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("lightning", "accelerate"), required=True)
    parser.add_argument("--preset", default="deepspeed_stage_2")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--gradient-clipping", type=float, default=1.0)
    parser.add_argument("--activation-checkpointing", default="none")
    parser.add_argument("--frozen", action="store_true")
    parser.add_argument("--nvme-path", default=None, help="NVMe offload folder (None: the preset's own, if any)")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from common.config import parse_overrides

    # The recipes' own constructor: the arguments carry the config fields of the same names, so the worker resolves
    # its DeepSpeed dict exactly as a recipe does.
    facts = RunFacts.from_fields(args, int(os.environ.get("WORLD_SIZE", args.devices)), HIDDEN)
    ds_config = resolve_deepspeed_config(args.preset, facts, parse_overrides(args.set))
    (run_lightning if args.backend == "lightning" else run_accelerate)(args, ds_config)


if __name__ == "__main__":
    run_then_exit(main)
