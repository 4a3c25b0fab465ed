"""Swin image classifier with ZeRO-2 (the cv preset) on Lightning: trains, evaluates, exports final/.

Launch, from the repository root:

    python recipes/cv/train.py                                                   # CPU: 2 processes, ~2 min
    python recipes/cv/train.py devices=1                                         # 1 GPU (or 1 CPU process)
    python recipes/cv/train.py --config recipes/cv/configs/swin_tiny.yaml data=my_images/ devices=8   # 8 GPUs
    # multi-node: the same command on every node, with num_nodes=N and MASTER_ADDR, MASTER_PORT, NODE_RANK set
    accelerate launch --config_file recipes/cv/accelerate.yaml recipes/cv/train_accelerate.py   # same, Accelerate

With no arguments it trains a 210k-parameter Swin Transformer (``transformers.SwinForImageClassification``
built from a config, no download) on scikit-learn's 1,797 handwritten digits, upscaled to 32 px, under the
``cv`` preset: ZeRO-2 in bf16 with overlap_comm and contiguous gradients. Vision models spread their parameters
evenly over many small tensors, with no giant embedding, so sharding gradients and optimizer states (stage 2)
is enough and stage 3's per-layer all-gathers would only cost time; grow the batch with
``grad_accum`` rather than with stage 3.

``key=value`` overrides any config key (``--print-config`` lists them): ``data=my_images/`` (one subfolder per
class, or a ``datasets.save_to_disk`` folder with image and label columns), ``model=path/to/hf_folder`` (a local
image classifier to fine-tune), ``image_size=64``, ``max_steps=100``. The run directory (``out_dir``) ends with
config.yaml, ds_config.json, env.json, metrics.jsonl, tb/, checkpoints/, final/ (Hugging Face format:
``AutoModelForImageClassification.from_pretrained`` loads it), confusion_matrix.png and summary.json.
``resume=true`` continues from checkpoints/latest; ``--describe`` prints what the planning tools read (no training).

The config's keys are in ``cv_config.py``; the data, the model (``build_model``), the loss, the evaluation and
the run files in ``classification.py``, shared with ``train_accelerate.py``.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from classification import (  # next to this script: data, model, loss, evaluation, run files, summary
    CVSummary,
    build_model,
    classification_loss,
    describe,
    evaluate,
    finish,
    load_data,
    lr_lambda,
    param_groups,
    resolve_ds_config,
    seed_micro_batch,
    step_lr,
    train_loader,
    write_run_files,
)
from cv_config import DEFAULT_CONFIG, CVConfig

from common.async_checkpoint import make_checkpointer
from common.config import config_to_dict, parse_recipe_args
from common.describe import local_world
from common.errors import exit_on_user_error
from common.metrics import Clock, all_reduce, grad_norm
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
from cv.data import DataError, ImageData
from cv.model import ModelError

# StepSampler starts a resumed run at the checkpoint's step, so the loader *is* resumable; Lightning cannot tell.
warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")  # in-memory digits need none


class ImageClassifier(L.LightningModule):
    """The training step, plus the run's bookkeeping at optimizer-step boundaries (log, evaluate, checkpoint).

    ``summary`` holds the run's summary on global rank 0 once training has ended; ``main()`` writes it.
    """

    def __init__(
        self,
        cfg: CVConfig,
        model: torch.nn.Module,
        data: ImageData,
        ds_config: dict,
        start_step: int,
        clock: Clock,
    ) -> None:
        super().__init__()
        self.cfg, self.model, self.data, self.ds_config = cfg, model, data, ds_config
        mark_universal(self)  # DeepSpeed wraps this module: its checkpoints can then resume on another world size
        self.start_step = self.last_step = start_step
        self.clock = clock
        self.micro_losses: list[torch.Tensor] = []  # this optimizer step's micro-batches
        self.step_losses: list[torch.Tensor] = []  # steps since the last log line
        self.step_norm: torch.Tensor | None = None  # FSDP2: the last step's gradient norm before clipping
        self.metrics = MetricsLog(cfg.out_dir, enabled=False)
        self.summary: CVSummary | None = None

    def on_fit_start(self) -> None:
        self.metrics = MetricsLog(self.cfg.out_dir, enabled=self.global_rank == 0)

    def configure_model(self) -> None:
        """FSDP2 presets: each block, then the root, sharded over the data-parallel ranks (ZeRO: DeepSpeed's own)."""
        mesh = self.device_mesh["data_parallel"] if self.device_mesh is not None else None
        shard_model(self.model, self.ds_config, mesh)

    def on_train_start(self) -> None:
        cfg, strategy = self.cfg, self.trainer.strategy
        self.checkpointer = make_checkpointer(cfg, self.global_rank, self.trainer.world_size, strategy.barrier)
        self.checkpointer.install(strategy.model)  # async_save: the backend's checkpoint files go through it

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        rank, world_size = self.global_rank, self.trainer.world_size
        return train_loader(self.data, self.cfg, rank, world_size, self.start_step, full_length=True)

    def configure_optimizers(self) -> dict:
        cfg = self.cfg
        optimizer = make_optimizer(
            param_groups(self.model, cfg.weight_decay),
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

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        pixels, labels = batch
        micro = self.trainer.global_step * self.cfg.grad_accum + len(self.micro_losses)
        seed_micro_batch(self.cfg, micro, self.global_rank)
        loss = classification_loss(self.model, pixels, labels, self.cfg.label_smoothing)
        self.micro_losses.append(loss.detach())  # a tensor: reading it (the progress bar) would wait for the device
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        cfg, step = self.cfg, self.trainer.global_step
        if step == self.last_step:  # inside a gradient-accumulation window
            return
        self.last_step = step
        self.clock.step_done()
        self.step_losses.append(torch.stack(self.micro_losses).mean())
        self.micro_losses.clear()
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            losses = all_reduce(torch.stack(self.step_losses)) / self.trainer.world_size
            last_norm = grad_norm(self.trainer.strategy.model, self.step_norm)  # this step's, before clipping
            for offset, loss in enumerate(losses.tolist()):  # one record per optimizer step
                at = step - len(losses) + 1 + offset
                norm = {"grad_norm": last_norm} if at == step else {}  # DeepSpeed keeps the last step's only
                self.metrics.log(at, train_loss=loss, lr=step_lr(cfg, at), **norm)
            self.log("loss", loss, prog_bar=True, logger=False)  # a float: the sync above was the only one
            self.step_losses.clear()
        if step % cfg.eval_interval == 0 and step < cfg.max_steps:  # the last step is evaluated in finish()
            result = evaluate(self.model, self.data, cfg, self.global_rank, self.trainer.world_size, self.device)
            self.metrics.log(
                step, val_loss=result.val_loss, val_accuracy=result.val_accuracy, elapsed_s=self.clock.wall()
            )
            self.print(f"step {step}: val_accuracy {result.val_accuracy:.4f} ({self.clock.wall():.0f} s)")
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            # Every rank writes its shards into a temporary folder; rank 0 publishes it once all are done.
            self.checkpointer.save(step, self.trainer.save_checkpoint)
            self.metrics.log(step, checkpoint_blocked_s=self.checkpointer.blocked_s[-1])
        self.clock.skip()

    def on_train_end(self) -> None:
        """Final evaluation, exported weights and confusion matrix; the summary is kept for main()."""
        self.checkpointer.finish()  # async_save: the last checkpoint written and published before the export
        self.summary = finish(
            self.cfg,
            self.ds_config,
            self.trainer.strategy.model,
            self.model,
            self.data,
            self.global_rank,
            self.trainer.world_size,
            self.device,
            self.clock,
            self.metrics,
            backend="lightning",
            steps=self.trainer.global_step,
            start_step=self.start_step,
            optimizer=self.trainer.optimizers[0],
        )


@exit_on_user_error(DataError, ModelError)
def main() -> None:
    cfg = parse_recipe_args(CVConfig, DEFAULT_CONFIG, describe=describe)
    clock = Clock()
    on_gpu = torch.cuda.is_available()
    devices, num_nodes = local_world(cfg.devices, cfg.num_nodes)
    world_size = devices * num_nodes
    set_cpu_threads(devices)
    # Lightning starts ranks 1.. at trainer.fit by re-running this script: rank 0 has prepared out_dir by then.
    rank0, out_dir = is_launcher_rank_zero(), Path(cfg.out_dir)
    if rank0:
        refuse_existing_out_dir(out_dir, cfg.resume, cfg.overwrite)  # before any work
    # A different model or config, no complete checkpoint: refused here; another world size: a universal checkpoint.
    resume = find_resume_point(out_dir, config_to_dict(cfg), world_size) if cfg.resume else None
    start_step = resume.step if resume else 0
    ds_config = resolve_ds_config(cfg, world_size)  # bad preset or DeepSpeed key: refused before any work
    data = load_data(cfg, world_size)  # empty folder, corrupt image, too few images: refused here
    model = build_model(cfg, data)  # class-count or image-size mismatch with model=: refused here
    if rank0:
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(cfg, out_dir, ds_config, data, world_size, "gpu" if on_gpu else "cpu")
        if resume:  # before Lightning starts ranks 1..: they find a universal conversion in place
            prepare_resume(resume, config_to_dict(cfg))

    module = ImageClassifier(cfg, model, data, ds_config, start_step, clock)
    load_config = with_universal_load(ds_config) if resume and resume.universal else ds_config
    setup_process(load_config, timeout=timedelta(seconds=cfg.collective_timeout_s))  # process-wide: printed once
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_steps=cfg.max_steps,
        use_distributed_sampler=False,  # StepSampler shards by rank itself: exact resume, same order as Accelerate
        logger=False,  # metrics.jsonl and tb/ are written by the module
        enable_checkpointing=False,  # checkpoints are saved and published by the module
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **lightning_trainer_kwargs(load_config, timeout=timedelta(seconds=cfg.collective_timeout_s)),
    )
    trainer.fit(module, ckpt_path=str(resume.load_path) if resume else None)

    if trainer.is_global_zero and module.summary is not None:
        write_json_atomic(out_dir / "summary.json", module.summary.to_json())
        print(module.summary.headline(out_dir), flush=True)
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort a healthy run


if __name__ == "__main__":
    main()
