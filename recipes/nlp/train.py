"""Causal LM (Llama) with ZeRO-3 and parameter persistence on Lightning: trains, evaluates, exports final/.

Launch, from the repository root:

    python recipes/nlp/train.py                                                         # CPU: 2 processes, ~4.5 min
    python recipes/nlp/train.py --config recipes/nlp/configs/llama_125m.yaml devices=1  # 1 GPU
    python recipes/nlp/train.py --config recipes/nlp/configs/llama_1b.yaml devices=8    # 8 GPUs
    # multi-node: the same command on every node, with num_nodes=N and MASTER_ADDR, MASTER_PORT, NODE_RANK set
    accelerate launch --config_file recipes/nlp/accelerate.yaml recipes/nlp/train_accelerate.py  # same, Accelerate

With no arguments it trains a 5M-parameter Llama (``transformers.LlamaForCausalLM`` built from a config) on the
Python standard library's own source, with a byte-level BPE tokenizer trained on the train split, under the
``nlp`` preset: ZeRO-3 with ``stage3_param_persistence_threshold`` 1e6, so the embedding and output matrices are
sharded across ranks while the small per-layer matrices stay whole. ``key=value`` overrides any config key
(``--print-config`` lists them): ``data=my_texts/``, ``model=path/to/hf_folder``, ``max_steps=50``.

The run directory (``out_dir``) ends with config.yaml, ds_config.json, env.json, metrics.jsonl, tb/,
checkpoints/, tokenizer/, final/ (Hugging Face format: ``AutoModelForCausalLM.from_pretrained`` loads it) and
summary.json. ``resume=true`` continues from checkpoints/latest; ``--describe`` prints what the planning tools read
(no training).

The config's keys are in ``nlp_config.py``; the data, the model (``build_model``), the loss, the evaluation, the
run files and the summary in ``pretraining.py``, shared with ``train_accelerate.py``.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from nlp_config import DEFAULT_CONFIG, NLPConfig  # next to this script
from nlp_layout import measured_text, memory_plan, resume_point, run_layout, tokens_per_rank_step  # next to this
from pretraining import (  # next to this script: data, model, loss, evaluation, run files, summary
    NLPSummary,
    RunRecord,
    build_model,
    describe,
    eval_batches,
    evaluate,
    finish,
    held_param_elements,
    hidden_size,
    load_data,
    lr_lambda,
    model_config,
    param_groups,
    resolve_ds_config,
    tokenizer_source,
    train_loader,
    train_loss,
    write_run_files,
)

from common import sequence_parallel
from common.accounting import model_state_bytes
from common.activation import checkpoint_offload, offload_text
from common.async_checkpoint import make_checkpointer
from common.config import config_to_dict, parse_recipe_args
from common.describe import local_world
from common.errors import exit_on_user_error
from common.metrics import Clock, all_reduce, grad_norm
from common.parallel import check_mesh, check_replica_batch
from common.process_setup import end_process_group, setup_process
from common.resume import mark_universal, prepare_resume, with_universal_load
from common.rundir import (
    MetricsLog,
    is_launcher_rank_zero,
    prepare_run_dir,
    refuse_existing_out_dir,
    set_cpu_threads,
    write_json_atomic,
)
from common.sequence_parallel import SequenceParallel
from common.strategy import (
    gradient_norm,
    lightning_trainer_kwargs,
    make_optimizer,
    shard_model,
    torch_dtype,
    zero_stage,
)
from nlp.data import DataError, LMData
from nlp.model import ModelError, resolve_attention

# StepSampler starts a resumed run at the checkpoint's step, so the loader *is* resumable; Lightning cannot tell.
warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


class CausalLM(L.LightningModule):
    """The training step, plus the run's bookkeeping at optimizer-step boundaries (log, evaluate, checkpoint).

    ``run`` is what the end of the run reports (pretraining.RunRecord: the setup, and what the hooks measure);
    ``summary`` holds the run's summary on global rank 0 once training has ended; ``main()`` writes it.
    """

    def __init__(self, run: RunRecord, data: LMData, start_step: int) -> None:
        super().__init__()
        self.run, self.cfg, self.data, self.start_step = run, run.cfg, data, start_step
        self.model = None  # built in configure_model, inside ZeRO-3's partitioned construction
        mark_universal(self)  # DeepSpeed wraps this module: its checkpoints can then resume on another world size
        self.losses: list[torch.Tensor] = []
        self.step_norm: torch.Tensor | None = None  # FSDP2: the last step's gradient norm before clipping
        self.aux_losses: list[torch.Tensor] = []  # a MoE model's load-balancing loss, logged apart
        self.log_file = MetricsLog(run.cfg.out_dir, enabled=is_launcher_rank_zero())
        self.summary: NLPSummary | None = None
        self.sp: SequenceParallel | None = None  # this rank's sequence-parallel group, once DeepSpeed has built it
        self.offload = checkpoint_offload() if run.cfg.offload_checkpoints else None  # common/activation.py

    def configure_model(self) -> None:
        # Lightning runs this inside deepspeed.zero.Init under stage 3, and the strategy keeps an HfDeepSpeedConfig
        # alive (common/lightning_cpu.py): from_config / from_pretrained initialise each weight already sharded, no
        # rank ever holds the whole model, and RoPE's frequencies stay fp32. Under an FSDP2 preset the model is built
        # whole, then each decoder layer and the root are sharded over the data-parallel ranks (shard_model).
        if self.model is not None:
            return
        run, layout = self.run, self.run.layout
        self.model = build_model(self.cfg, run.model_config, run.attention, layout.expert_rank(self.global_rank))
        run.held_at_construction = held_param_elements(self.model)
        mesh = self.device_mesh["data_parallel"] if self.device_mesh is not None else None
        shard_model(self.model, run.ds_config, mesh)  # FSDP2 presets only (ZeRO: DeepSpeed's, above)
        if layout.sequence > 1:  # Ulysses: attention rerouted, and the groups for deepspeed.initialize
            self.trainer.strategy.mpu = sequence_parallel.register(
                self.model, layout.sequence, self.cfg.micro_batch_size, run.attention
            )
        run.plan = memory_plan(self.model, run.ds_config, layout)
        self.print(run.plan.text())
        self.print(
            f"after construction rank 0 holds {run.held_at_construction:,} of "
            f"{run.plan.num_params:,} parameter elements"
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        layout = self.run.layout  # every rank of a replica reads its batches
        replica, replicas = layout.data_parallel_rank(self.global_rank), layout.data_parallel
        return train_loader(self.data, self.cfg, replica, replicas, self.start_step, full_length=True)

    def configure_optimizers(self) -> dict:
        groups = param_groups(self.model, self.cfg)
        optimizer = make_optimizer(groups, self.run.ds_config, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if batch_idx == 0:
            check_replica_batch(self.run.layout, batch["input_ids"])
        if self.offload is not None:  # left in on_after_backward: it must see the backward pass too
            self.offload.__enter__()
        total, loss, aux = train_loss(self.cfg, self.model, self.model, batch["input_ids"], batch["labels"], self.sp)
        self.losses.append(loss.detach())  # a tensor: reading it (.item(), the progress bar) would wait for the device
        if aux is not None:
            self.aux_losses.append(aux.detach())
        return total

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """FSDP2 presets: the gradient norm before the clipping Lightning does next (and whose norm it discards), for
        the log. ZeRO presets: nothing (DeepSpeed clips in its step and keeps the norm)."""
        self.step_norm = gradient_norm(self, self.run.ds_config)

    def on_after_backward(self) -> None:
        if self.offload is not None:
            self.offload.__exit__(None, None, None)

    def on_train_start(self) -> None:
        cfg, strategy, layout = self.cfg, self.trainer.strategy, self.run.layout
        self.checkpointer = make_checkpointer(cfg, self.global_rank, self.trainer.world_size, strategy.barrier)
        self.checkpointer.install(strategy.model)  # async_save: the backend's checkpoint files go through it
        check_mesh(layout, self.global_rank)  # DeepSpeed's groups are those the layout's rank map assumed
        self.sp = sequence_parallel.this_rank(layout.sequence, zero_stage(self.run.ds_config))
        if layout.tensor > 1:  # its check cannot read Lightning's batch dict: check_replica_batch instead
            strategy.deepspeed_engine.first_dataloader_check.remove()
        replica, replicas = layout.data_parallel_rank(self.global_rank), layout.data_parallel
        self.val_batches = eval_batches(self.data, cfg, replica, replicas)
        if self.start_step == 0:
            self.evaluate_and_log(0)
        self.run.clock.skip()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if len(self.losses) < self.cfg.grad_accum:
            return  # inside a gradient accumulation
        cfg, step, clock = self.cfg, self.trainer.global_step, self.run.clock
        clock.step_done()
        step_loss = torch.stack(self.losses).mean()
        step_aux = torch.stack(self.aux_losses).mean() if self.aux_losses else None
        self.losses.clear()
        self.aux_losses.clear()
        if step == self.start_step + 1:
            self.run.model_states = model_state_bytes(self.trainer.strategy.model, self.trainer.optimizers[0])
            self.print(measured_text(self.run.model_states))
            if self.offload is not None:
                self.print(offload_text(self.offload.stats))
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            # Only on logging steps: the all-reduce and .item() are a collective and a host sync.
            loss = all_reduce(step_loss).item() / self.trainer.world_size
            self.log("loss", loss, prog_bar=True, logger=False)
            tokens_per_s = tokens_per_rank_step(cfg, self.run.layout) / clock.median_step()
            moe = {} if step_aux is None else {"aux_loss": all_reduce(step_aux).item() / self.trainer.world_size}
            self.log_file.log(
                step,
                train_loss=loss,
                **moe,
                grad_norm=grad_norm(self.trainer.strategy.model, self.step_norm),
                lr=cfg.lr * lr_lambda(cfg)(step - 1),
                tokens_per_s_per_device=tokens_per_s,
                elapsed_s=clock.wall(),
            )
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            self.evaluate_and_log(step)
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            self.save(step)
        clock.skip()

    def evaluate_and_log(self, step: int) -> None:
        wall = self.run.clock.wall
        self.run.val_loss = evaluate(self.model, self.val_batches, self.device)
        self.log_file.log(step, val_loss=self.run.val_loss, elapsed_s=wall())
        self.print(f"step {step}: val_loss {self.run.val_loss:.4f} ({wall():.0f} s)")

    def save(self, step: int) -> None:
        # Every rank writes its shards into a temporary folder; rank 0 publishes it once all are done.
        self.checkpointer.save(step, self.trainer.save_checkpoint)
        self.log_file.log(step, checkpoint_blocked_s=self.checkpointer.blocked_s[-1])

    def on_train_end(self) -> None:
        """Logits on a fixed batch, whole weights gathered (every rank), then final/; the summary is kept for main()."""
        self.checkpointer.finish()  # async_save: the last checkpoint written and published before the export
        self.run.steps = self.trainer.global_step
        self.summary = finish(self.run, self.model, self.data, self.device, self.global_rank)
        self.log_file.close()
        self.trainer.strategy.barrier()


@exit_on_user_error(DataError, ModelError)
def main() -> None:
    cfg = parse_recipe_args(NLPConfig, DEFAULT_CONFIG, describe=describe)
    clock = Clock()
    on_gpu = torch.cuda.is_available()
    devices, num_nodes = local_world(cfg.devices, cfg.num_nodes)
    world_size = devices * num_nodes
    set_cpu_threads(devices)
    # Lightning starts ranks 1.. at trainer.fit by re-running this script: they read what rank 0 wrote before.
    rank0, out_dir = is_launcher_rank_zero(), Path(cfg.out_dir)
    if rank0:
        refuse_existing_out_dir(out_dir, cfg.resume, cfg.overwrite)  # before anything is read or written
    ds_config = resolve_ds_config(cfg, world_size, hidden_size(cfg))
    # How the ranks split the model (data parallel unless tensor/expert/sequence_parallel is set): refused here if bad.
    layout = run_layout(cfg, world_size, model_config(cfg, tokenizer=None), ds_config)
    # A different model or config, no complete checkpoint: refused; another data-parallel size: a universal checkpoint.
    resume = resume_point(cfg, layout)
    start_step = resume.step if resume else 0
    trained_tokenizer = tokenizer_source(cfg, trained_here=False) is None
    data = load_data(cfg, tokenizer_source(cfg, trained_here=cfg.resume or not rank0), world_size)
    config = model_config(cfg, data.tokenizer)
    attention = resolve_attention(cfg.attention, "cuda" if on_gpu else "cpu", torch_dtype(cfg.precision))
    if rank0:
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(
            cfg, out_dir, ds_config, data, world_size, "gpu" if on_gpu else "cpu", trained_tokenizer and not cfg.resume
        )
        print(f"data: {data.info()}", flush=True)
        if resume:  # before Lightning starts ranks 1..: they find a universal conversion in place
            prepare_resume(resume, config_to_dict(cfg))

    module = CausalLM(RunRecord(cfg, ds_config, layout, config, attention, "lightning", clock), data, start_step)
    load_config = with_universal_load(ds_config) if resume and resume.universal else ds_config
    setup_process(load_config, timeout=timedelta(seconds=cfg.collective_timeout_s))  # process-wide: printed once
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_steps=cfg.max_steps,
        use_distributed_sampler=False,  # StepSampler shards by rank itself
        logger=False,  # metrics.jsonl and tb/ are written by the module
        enable_checkpointing=False,  # checkpoints are saved and published by the module
        enable_model_summary=False,  # under ZeRO-3 it would count empty shards; the memory plan says more
        limit_val_batches=0,
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
