"""LoRA fine-tuning of a causal LM under ZeRO-3 on Lightning: adapters gathered whole, merged model, exact match.

Launch, from the repository root:

    python recipes/nlp/train.py                 # once: the default base model, runs/nlp/final (~4.5 min on CPU)
    python recipes/nlp/finetune.py              # CPU: 2 processes, under 5 min
    python recipes/nlp/finetune.py model=path/to/hf_folder data=my_data.jsonl devices=1   # 1 GPU
    python recipes/nlp/finetune.py model=path/to/hf_folder data=my_data.jsonl devices=8   # 8 GPUs
    python recipes/nlp/finetune.py devices=2 sequence_parallel=2 preset=deepspeed_stage_2  # each example split in 2
    python recipes/nlp/finetune.py preset=fsdp2      # PyTorch FSDP2 instead of DeepSpeed (fsdp2_grad_op: ZeRO-2's peer)
    # multi-node: the same command on every node, with num_nodes=N and MASTER_ADDR, MASTER_PORT, NODE_RANK set
    accelerate launch --config_file recipes/nlp/accelerate_finetune.yaml recipes/nlp/finetune_accelerate.py  # same

With no arguments it puts LoRA (peft, r 16 on the attention and MLP projections) on the NLP recipe's model and
teaches it the built-in task "how many arguments does this ``def`` take" (headers from the standard library,
answers exact by ``ast``), loss on the response tokens only. The ``finetune`` preset is ZeRO-3: the frozen base
is sharded across ranks and so are the adapters; checkpoints hold the adapters and their optimizer state only
(frozen weights excluded), and the adapter is saved from gathered, whole tensors, then read back and checked.
``data=file.jsonl`` takes Alpaca (``instruction``/``input``/``output``) or chat (``messages``) lines.

The run directory ends with config.yaml, ds_config.json, env.json, metrics.jsonl, tb/, checkpoints/, adapter/
(``adapter_config.json``, ``adapter_model.safetensors``), merged/ (Hugging Face format) and summary.json
(``val_accuracy`` vs ``base_val_accuracy``). ``resume=true`` continues from checkpoints/latest.
``sequence_parallel=N``: DeepSpeed's Ulysses splits every sequence over N ranks, which read the same examples
(docs/finetune.md). ``--describe`` prints what the planning tools need (base model counted from its config.json,
DeepSpeed dict) as JSON and trains nothing.

The keys are in ``finetune_config.py``; the model (``build_lora_model``), data, exact match and export are in
``finetuning.py`` and the loss in ``finetune_loss.py``, both shared with ``finetune_accelerate.py``.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from finetune_config import DEFAULT_CONFIG, FinetuneConfig
from finetune_loss import evaluate, global_batch_tokens, loss_scale, step_token_mean, train_loss  # next to this script
from finetuning import (
    FinetuneSummary,
    SFTData,
    base_model_config,
    base_module_names,
    batch_logits,
    build_lora_model,
    check_sequence_parallel,
    data_parallel,
    describe,
    final_export,
    load_plain,
    load_sft_data,
    load_tokenizer,
    lora_param_groups,
    lr_lambda,
    make_summary,
    peak_memory_over_ranks,
    resolve_attention_or_exit,
    resolve_ds_config,
    score,
    sft_loader,
    val_batches,
    write_run_files,
    write_summary,
)

from common import sequence_parallel
from common.accounting import model_state_bytes
from common.async_checkpoint import make_checkpointer
from common.checkpoint import (
    CHECKPOINTS,
    checkpoint_step,
    gather_full_state_dict,
    latest_checkpoint,
)
from common.config import config_to_dict, parse_recipe_args
from common.describe import local_world
from common.errors import ConfigError, exit_on_user_error
from common.lint import lint_at_start
from common.metrics import Clock, grad_norm
from common.model_folder import base_reference, check_base_unchanged, check_weight_files, write_base_reference
from common.process_setup import end_process_group, setup_process
from common.rundir import (
    MetricsLog,
    is_launcher_rank_zero,
    prepare_run_dir,
    refuse_existing_out_dir,
    set_cpu_threads,
)
from common.sequence_parallel import SequenceParallel
from common.strategy import (
    gradient_norm,
    is_fsdp2,
    lightning_trainer_kwargs,
    make_optimizer,
    shard_model,
    zero_stage,
)
from nlp.data import DataError
from nlp.lora import trainable_parameter_shapes
from nlp.model import ModelError

# StepSampler starts a resumed run at the checkpoint's step, so the loader *is* resumable; Lightning cannot tell.
warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


class LoRAFinetune(L.LightningModule):
    """The training step, plus the run's bookkeeping at optimizer-step boundaries (log, evaluate, checkpoint)."""

    def __init__(
        self,
        cfg: FinetuneConfig,
        data: SFTData,
        ds_config: dict,
        attention: str,
        module_names: list[str],
        base_val_accuracy: float | None,
        base: dict,
        start_step: int,
        clock: Clock,
    ) -> None:
        super().__init__()
        self.cfg, self.data, self.ds_config, self.attention = cfg, data, ds_config, attention
        self.module_names = module_names  # the base's Linear layer names: LoRA's targets are checked against them
        self.base_val_accuracy = base_val_accuracy  # measured on rank 0 only, before training
        self.base = base  # the frozen base's files and hashes: every checkpoint names what its adapters sit on
        self.start_step, self.clock = start_step, clock
        self.model = None  # built in configure_model, inside ZeRO-3's partitioned construction
        self.strict_loading = False  # checkpoints leave the frozen base out: it comes from model= on resume
        self.loss_sums: list[torch.Tensor] = []  # this step's micro-batches: [summed response-token loss, tokens]
        self.log_file = MetricsLog(cfg.out_dir, enabled=is_launcher_rank_zero())
        self.val_loss = float("nan")
        self.state_bytes: dict[str, int] = {}  # model states measured after the first step
        self.summary: FinetuneSummary | None = None  # set on rank 0 in on_train_end; main() writes it
        self.sp: SequenceParallel | None = None  # this rank's sequence-parallel group, once DeepSpeed has built it
        self.step_norm: torch.Tensor | None = None  # FSDP2: the last step's gradient norm before clipping

    def configure_model(self) -> None:
        # Lightning runs this inside deepspeed.zero.Init under stage 3, and the strategy keeps an HfDeepSpeedConfig
        # alive (common/lightning_cpu.py): from_pretrained loads each base weight already sharded. Under an FSDP2
        # preset the model is built whole, then each decoder layer and the root are sharded (shard_model).
        if self.model is None:
            self.model = build_lora_model(self.cfg, self.attention, self.module_names)
            mesh = self.device_mesh["data_parallel"] if self.device_mesh is not None else None
            shard_model(self.model, self.ds_config, mesh)  # FSDP2 presets only (ZeRO: DeepSpeed's, above)
            if self.cfg.sequence_parallel > 1:  # Ulysses: attention rerouted, and the groups for deepspeed.initialize
                self.trainer.strategy.mpu = sequence_parallel.register(
                    self.model, self.cfg.sequence_parallel, self.cfg.micro_batch_size, self.attention
                )

    def state_dict(self, *args, **kwargs) -> dict:
        """What a checkpoint holds of the model: the adapters, not the frozen base (it comes from model= on resume).

        Lightning's FSDP2 strategy saves what this returns and, on resume, loads the keys it returns (DCP reads the
        keys it is given); DeepSpeed's strategy saves from its engine and is told apart (exclude_frozen_parameters).
        """
        state = super().state_dict(*args, **kwargs)
        for name, param in self.named_parameters():
            if not param.requires_grad:
                state.pop(name, None)
        return state

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        dp_rank, dp_size = data_parallel(self.cfg, self.global_rank, self.trainer.world_size)
        return sft_loader(self.data, self.cfg, dp_rank, dp_size, self.start_step, True)

    def configure_optimizers(self):
        groups = lora_param_groups(self.model, self.cfg.weight_decay)
        optimizer = make_optimizer(groups, self.ds_config, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # The step's token mean (finetune_loss.loss_scale); global_step counts the optimizer steps done so far.
        dp_size = data_parallel(self.cfg, self.global_rank, self.trainer.world_size)[1]
        tokens = global_batch_tokens(self.data, self.cfg, dp_size, self.trainer.global_step)
        loss, sums = train_loss(self.model, batch, self.device, loss_scale(self.cfg, dp_size, tokens), self.sp)
        self.loss_sums.append(sums)  # detached: reading it (.item()) would wait for the device
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """FSDP2 presets: the gradient norm before the clipping Lightning does next (and whose norm it discards), for
        the log. ZeRO presets: nothing (DeepSpeed clips in its step and keeps the norm)."""
        self.step_norm = gradient_norm(self, self.ds_config)

    def on_train_start(self) -> None:
        cfg, strategy = self.cfg, self.trainer.strategy
        self.checkpointer = make_checkpointer(cfg, self.global_rank, self.trainer.world_size, strategy.barrier)
        self.checkpointer.install(strategy.model)  # async_save: the backend's checkpoint files go through it
        self.sp = sequence_parallel.this_rank(cfg.sequence_parallel, zero_stage(self.ds_config))
        # Held-out batches are whole sequences on every rank (Ulysses is off in eval mode): split over all ranks.
        self.val_batches = val_batches(self.data, self.cfg, self.global_rank, self.trainer.world_size)
        if self.start_step == 0:
            self.evaluate(0)
        self.clock.skip()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if len(self.loss_sums) < self.cfg.grad_accum:
            return  # inside a gradient accumulation
        cfg, step = self.cfg, self.trainer.global_step
        self.clock.step_done()
        sums, self.loss_sums = self.loss_sums, []
        if step == self.start_step + 1:
            self.state_bytes = model_state_bytes(self.trainer.strategy.model, self.trainer.optimizers[0])
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            # Only on logging steps: the all-reduce and .item() are a collective and a host sync.
            loss = step_token_mean(sums)
            self.log_file.log(
                step,
                train_loss=loss,
                grad_norm=grad_norm(self.trainer.strategy.model, self.step_norm),
                lr=cfg.lr * lr_lambda(cfg)(step - 1),
                elapsed_s=self.clock.wall(),
            )
            self.print(f"step {step}: train_loss {loss:.4f} ({self.clock.wall():.0f} s)")
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            self.evaluate(step)
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            self.save(step)
        self.clock.skip()

    def evaluate(self, step: int) -> None:
        self.val_loss = evaluate(self.model, self.val_batches, self.device)
        self.log_file.log(step, val_loss=self.val_loss, elapsed_s=self.clock.wall())
        self.print(f"step {step}: val_loss {self.val_loss:.4f} ({self.clock.wall():.0f} s)")

    def save(self, step: int) -> None:
        # Every rank writes its shards (adapters and their optimizer state only) into a temporary folder, rank 0
        # the base's reference too; rank 0 publishes it once all are done. The reference goes first: DeepSpeed's
        # save opens with a barrier, so with async_save no rank's writer thread lists the folder (to fsync it)
        # while the reference's temporary file is there.
        def write(folder: Path) -> None:
            if self.trainer.is_global_zero:
                write_base_reference(folder, self.base)
            self.trainer.save_checkpoint(folder)

        self.checkpointer.save(step, write)
        self.log_file.log(step, checkpoint_blocked_s=self.checkpointer.blocked_s[-1])

    def on_train_end(self) -> None:
        self.checkpointer.finish()  # async_save: the last checkpoint written and published before the export
        # Collective work first (every rank): logits on a fixed batch, whole weights gathered one at a time.
        cfg, rank = self.cfg, self.global_rank
        if self.sp is not None:
            sequence_parallel.unregister(self.attention)  # the export runs (and generates) with the attention mask
        self.model.eval()
        logits = batch_logits(self.model, self.data.fixed_batch, self.device)
        shapes = trainable_parameter_shapes(self.model)
        state = gather_full_state_dict(self.model, rank)
        peak = peak_memory_over_ranks(self.device)
        if rank == 0:
            export = final_export(cfg, self.model, state, shapes, self.data, logits.cpu(), self.attention)
            self.summary = make_summary(
                cfg,
                self.ds_config,
                self.model,
                self.data,
                export,
                backend="lightning",
                world_size=self.trainer.world_size,
                attention=self.attention,
                steps=self.trainer.global_step,
                val_loss=self.val_loss,
                median_step_s=self.clock.median_step(),
                peak_memory=peak,
                state_bytes=self.state_bytes,
                base_val_accuracy=self.base_val_accuracy,
                wall_time_s=round(self.clock.wall(), 1),
            )
        self.log_file.close()
        self.trainer.strategy.barrier()


@exit_on_user_error(DataError, ModelError)
def main() -> None:
    cfg = parse_recipe_args(FinetuneConfig, DEFAULT_CONFIG, describe=describe)
    clock = Clock()
    config = base_model_config(cfg)
    check_weight_files(cfg.pretrained)  # a truncated *.safetensors: one line naming it, not a traceback
    on_gpu = torch.cuda.is_available()
    devices, num_nodes = local_world(cfg.devices, cfg.num_nodes)
    world_size = devices * num_nodes
    set_cpu_threads(devices)
    # Lightning starts ranks 1.. at trainer.fit by re-running this script: rank 0 alone checks and writes first.
    rank0 = is_launcher_rank_zero()
    out_dir = Path(cfg.out_dir)
    if rank0:
        refuse_existing_out_dir(out_dir, cfg.resume, cfg.overwrite)
    # Adapters resumed on another base than the one they were trained on would train on and mean nothing.
    base = base_reference(cfg.pretrained)
    if cfg.resume:
        check_base_unchanged(latest_checkpoint(out_dir), base)
    tokenizer = load_tokenizer(cfg, config)
    data = load_sft_data(cfg, tokenizer)
    module_names = base_module_names(cfg, config)
    attention = resolve_attention_or_exit(cfg, "cuda" if on_gpu else "cpu")
    ds_config = resolve_ds_config(cfg, world_size, config.hidden_size)
    check_sequence_parallel(cfg, world_size, config, attention)
    # Known ZeRO pitfalls (common.lint), checked before any work (printed on rank 0; errors refuse the run).
    lint_at_start(ds_config, config_to_dict(cfg), hidden_size=config.hidden_size, world_size=world_size)
    base_val_accuracy = None
    if rank0:
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(cfg, out_dir, ds_config, world_size, "gpu" if on_gpu else "cpu")
        print(f"data: {len(data.train)} train / {len(data.val)} held-out examples ({cfg.data}); attention: {attention}")
        # The base model's score, on rank 0 before the other ranks start (a whole copy, no ZeRO yet).
        base_val_accuracy = score(load_plain(cfg, attention), tokenizer, data.val, cfg)
        print(f"base model exact match on the held-out set: {base_val_accuracy:.3f}", flush=True)
    latest = latest_checkpoint(out_dir) if cfg.resume else None
    if cfg.resume and latest is None:
        raise ConfigError(f"resume=true but {out_dir}/{CHECKPOINTS} holds no complete checkpoint")
    start_step = checkpoint_step(latest) if latest else 0

    module = LoRAFinetune(cfg, data, ds_config, attention, module_names, base_val_accuracy, base, start_step, clock)
    setup_process(ds_config, timeout=timedelta(seconds=cfg.collective_timeout_s))  # process-wide: printed once
    trainer_kwargs = lightning_trainer_kwargs(ds_config, timeout=timedelta(seconds=cfg.collective_timeout_s))
    if not is_fsdp2(ds_config):  # the frozen base is model=, not checkpoint state (FSDP2: state_dict above)
        trainer_kwargs["strategy"].exclude_frozen_parameters = True
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_steps=cfg.max_steps,
        use_distributed_sampler=False,  # StepSampler shards by rank itself
        logger=False,  # metrics.jsonl and tb/ are written by the module
        enable_checkpointing=False,  # checkpoints are saved and published by the module
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(module, ckpt_path=str(latest) if latest else None)

    if trainer.is_global_zero and module.summary is not None:
        write_summary(out_dir, module.summary)
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort a healthy run


if __name__ == "__main__":
    main()
