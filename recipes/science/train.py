"""FNO on Burgers' equation or Darcy flow (the FNO paper's benchmarks): BF16 + ZeRO-2, round-robin gradients, Lightning.

Scientific models need precision - bf16 or fp32, never fp16, whose narrow range overflows and underflows - with ZeRO
stage 2 and ``round_robin_gradients``. The data are made here (a spectral solver, cached), the metric is the
paper's relative L2 error on held-out pairs, and the model is also tested zero-shot at 4x resolution.

    # CPU, 2 processes (gloo), the tiny default: under 5 minutes
    python recipes/science/train.py
    # the paper's experiment (1,000 / 200 pairs, grid 256, 500 epochs' worth of steps)
    python recipes/science/train.py --config recipes/science/configs/paper.yaml out_dir=runs/science-paper
    # Burgers at viscosity 1e-3 (shocks) and Darcy flow 2-D (FNO-2D, 85 x 85): 5-minute CPU configs
    python recipes/science/train.py --config recipes/science/configs/burgers_nu1e-3.yaml
    python recipes/science/train.py --config recipes/science/configs/darcy.yaml
    # 1 GPU / every GPU of a node (devices=0)
    python recipes/science/train.py devices=1
    python recipes/science/train.py --config recipes/science/configs/paper.yaml devices=0
    # multi-node: the same command on every node (Lightning reads torchrun's or SLURM's environment)
    torchrun --nnodes 2 --nproc-per-node 8 ... recipes/science/train.py num_nodes=2 devices=8
    # your own pairs (arrays x and y, [N, grid], any grid), resume, fp32, the resolved config
    python recipes/science/train.py data=my_pairs.npz out_dir=runs/mine
    python recipes/science/train.py out_dir=runs/science resume=true max_steps=3000
    python recipes/science/train.py precision=fp32 out_dir=runs/science-fp32
    python recipes/science/train.py --print-config
    python recipes/science/train.py --describe        # what the planning tools read, no training

The config's keys are in ``science_config.py``; the data, the model (``build_model``), the evaluation and the run
files in ``operator_learning.py``, shared with ``train_accelerate.py``.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from operator_learning import (  # next to this script: data, model, evaluation, run files, summary
    Pairs,
    ScienceSummary,
    build_model,
    describe,
    evaluate,
    finish,
    load_data,
    lr_lambda,
    resolve_ds_config,
    train_loader,
    write_run_files,
)
from science_config import DEFAULT_CONFIG, ScienceConfig

from common.async_checkpoint import make_checkpointer
from common.config import config_to_dict, parse_recipe_args
from common.describe import local_world
from common.errors import exit_on_user_error
from common.metrics import Clock, grad_norm
from common.process_setup import end_process_group, setup_process
from common.resume import find_resume_point, mark_universal, prepare_resume, with_universal_load
from common.rundir import (
    MetricsLog,
    is_launcher_rank_zero,
    prepare_run_dir,
    refuse_existing_out_dir,
    set_cpu_threads,
    write_json_atomic,
)
from common.strategy import gradient_norm, lightning_trainer_kwargs, make_optimizer, shard_model
from science.burgers import DataError
from science.fno import relative_l2


class OperatorLearning(L.LightningModule):
    """An FNO trained on the relative L2 loss; logs, evaluates and checkpoints after each optimizer step.

    ``summary`` holds the run's summary on global rank 0 once training has ended; ``main()`` writes it.
    """

    def __init__(
        self,
        cfg: ScienceConfig,
        ds_config: dict,
        data: Pairs,
        superres: Pairs | None,
        out_dir: Path,
        start_step: int,
        clock: Clock,
    ) -> None:
        super().__init__()
        self.cfg, self.ds_config, self.out_dir, self.start_step, self.clock = cfg, ds_config, out_dir, start_step, clock
        self.net = build_model(cfg, data.scaling())
        mark_universal(self)  # DeepSpeed wraps this module: its checkpoints can then resume on another world size
        # Plain attributes, not buffers: DeepSpeed casts buffers to bf16, and the data must stay fp32.
        self.data, self.superres = data, superres
        self.metrics = MetricsLog(out_dir, enabled=False)
        self.losses: list[torch.Tensor] = []
        self.step_norm: torch.Tensor | None = None  # FSDP2: the last step's gradient norm before clipping
        self.step_lr = 0.0
        self.last_step = start_step
        self.summary: ScienceSummary | None = None

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.net(u)

    def on_fit_start(self) -> None:
        self.data = self.data.to(self.device)
        self.metrics = MetricsLog(self.out_dir, enabled=self.global_rank == 0)

    def configure_model(self) -> None:
        """FSDP2 presets: each block, then the root, sharded over the data-parallel ranks (ZeRO: DeepSpeed's own)."""
        mesh = self.device_mesh["data_parallel"] if self.device_mesh is not None else None
        shard_model(self.net, self.ds_config, mesh)

    def on_train_start(self) -> None:
        cfg, strategy = self.cfg, self.trainer.strategy
        self.checkpointer = make_checkpointer(cfg, self.global_rank, self.trainer.world_size, strategy.barrier)
        self.checkpointer.install(strategy.model)  # async_save: the backend's checkpoint files go through it
        if self.start_step == 0:  # the untrained model's error: where the curve starts
            error = evaluate(self.net, self.data.x_test, self.data.y_test, self.global_rank, self.trainer.world_size)
            self.metrics.log(0, val_rel_l2=error)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        rank, world_size = self.global_rank, self.trainer.world_size
        return train_loader(len(self.data.x_train), self.cfg, rank, world_size, self.start_step)

    def configure_optimizers(self) -> dict:
        cfg = self.cfg
        optimizer = make_optimizer(
            self.parameters(),
            self.ds_config,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(0.9, 0.999),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """FSDP2 presets: the gradient norm before the clipping Lightning does next (and whose norm it discards), for
        the log. ZeRO presets: nothing (DeepSpeed clips in its step and keeps the norm)."""
        self.step_norm = gradient_norm(self, self.ds_config)

    def training_step(self, idx: torch.Tensor, batch_idx: int) -> torch.Tensor:
        idx = idx.to(self.device)
        loss = relative_l2(self(self.data.x_train[idx]), self.data.y_train[idx])
        self.losses.append(loss.detach())
        self.step_lr = self.trainer.optimizers[0].param_groups[0]["lr"]  # the lr this step's update uses
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        step = self.trainer.global_step
        if step == self.last_step:  # inside a gradient-accumulation window
            return
        self.last_step = step
        self.clock.step_done()
        cfg = self.cfg
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            # Only on logging steps: the reduce and .item() are a collective and a host sync.
            loss = self.trainer.strategy.reduce(torch.stack(self.losses).mean(), reduce_op="mean").item()
            norm = grad_norm(self.trainer.strategy.model, self.step_norm)  # this step's, before clipping
            self.metrics.log(step, train_rel_l2=loss, lr=self.step_lr, grad_norm=norm)
            self.log("rel_l2", loss, prog_bar=True)
            self.losses.clear()
        if step % cfg.eval_interval == 0 and step < cfg.max_steps:  # the last step is evaluated in finish()
            rank, world_size = self.global_rank, self.trainer.world_size
            error = evaluate(self.net, self.data.x_test, self.data.y_test, rank, world_size)
            self.metrics.log(step, val_rel_l2=error)
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            # Every rank writes its shards into a temporary folder; rank 0 publishes it once all are done.
            self.checkpointer.save(step, self.trainer.save_checkpoint)
            self.metrics.log(step, checkpoint_blocked_s=self.checkpointer.blocked_s[-1])
        self.clock.skip()

    def on_train_end(self) -> None:
        """Final evaluation (also at the finer grid), figures and exported weights; the summary is kept for main()."""
        self.checkpointer.finish()  # async_save: the last checkpoint written and published before the export
        self.summary = finish(
            self.cfg,
            self.ds_config,
            self.trainer.strategy.model,
            self.net,
            self.data,
            self.superres,
            self.global_rank,
            self.trainer.world_size,
            self.clock,
            self.metrics,
            backend="lightning",
            steps=self.trainer.global_step,
            start_step=self.start_step,
            optimizer=self.trainer.optimizers[0],
        )


@exit_on_user_error(DataError)
def main() -> None:
    cfg = parse_recipe_args(ScienceConfig, DEFAULT_CONFIG, describe=describe)
    clock = Clock()
    on_gpu = torch.cuda.is_available()
    devices, num_nodes = local_world(cfg.devices, cfg.num_nodes)
    world_size = devices * num_nodes
    set_cpu_threads(devices)
    ds_config = resolve_ds_config(cfg, world_size)  # bad preset / DeepSpeed key / fp16: refused before any work
    out_dir = Path(cfg.out_dir)
    # Lightning starts the other local ranks inside trainer.fit by re-running this script: by then rank 0
    # has prepared the run directory and the data cache, so the other ranks only read them.
    rank_zero = is_launcher_rank_zero()
    if rank_zero:
        refuse_existing_out_dir(out_dir, cfg.resume, cfg.overwrite)  # before any work
    # A different model or config, no complete checkpoint: refused here; another world size: a universal checkpoint.
    resume = find_resume_point(out_dir, config_to_dict(cfg), world_size) if cfg.resume else None
    start_step = resume.step if resume else 0

    data = load_data(cfg, workers=cfg.data_workers if rank_zero else 1)
    superres = None
    if cfg.data == "burgers" and cfg.superres_factor > 1:  # the same test samples, 4x finer: a cache hit
        superres = load_data(cfg, grid_size=cfg.grid_size * cfg.superres_factor)
    if rank_zero:
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(out_dir, cfg, ds_config, world_size)
        if resume:  # before Lightning starts ranks 1..: they find a universal conversion in place
            prepare_resume(resume, config_to_dict(cfg))

    module = OperatorLearning(cfg, ds_config, data, superres, out_dir, start_step, clock)
    setup_process(ds_config, timeout=timedelta(seconds=cfg.collective_timeout_s))  # process-wide: printed once
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_steps=cfg.max_steps,
        logger=False,  # metrics.jsonl + TensorBoard come from common.rundir.MetricsLog
        enable_checkpointing=False,  # checkpoints are saved and published in on_train_batch_end
        use_distributed_sampler=False,  # StepSampler shards the data: exact resume, same order as Accelerate
        **lightning_trainer_kwargs(
            with_universal_load(ds_config) if resume and resume.universal else ds_config,
            timeout=timedelta(seconds=cfg.collective_timeout_s),
        ),
    )
    trainer.fit(module, ckpt_path=str(resume.load_path) if resume else None)

    if trainer.is_global_zero and module.summary is not None:
        write_json_atomic(out_dir / "summary.json", module.summary.to_json())
        print(module.summary.headline(out_dir), flush=True)
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort a healthy run


if __name__ == "__main__":
    main()
