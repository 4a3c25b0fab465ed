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

import math
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from nlp_config import DEFAULT_CONFIG, NLPConfig  # next to this script
from pretraining import (  # next to this script: data, model, loss, evaluation, run files, summary
    MemoryPlan,
    NLPSummary,
    build_model,
    check_combinations,
    check_mesh,
    check_replica_batch,
    data_parallel,
    describe,
    eval_batches,
    evaluate,
    finish,
    held_param_elements,
    load_data,
    lr_lambda,
    measured_text,
    memory_plan,
    model_config,
    param_groups,
    resolve_ds_config,
    resume_point,
    tokenizer_source,
    tokens_per_rank_step,
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
from common.strategy import lightning_trainer_kwargs, make_optimizer, torch_dtype, zero_stage
from nlp.data import DataError, LMData
from nlp.model import ModelError, resolve_attention

# StepSampler starts a resumed run at the checkpoint's step, so the loader *is* resumable; Lightning cannot tell.
warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


class CausalLM(L.LightningModule):
    """The training step, plus the run's bookkeeping at optimizer-step boundaries (log, evaluate, checkpoint).

    ``summary`` holds the run's summary on global rank 0 once training has ended; ``main()`` writes it.
    """

    def __init__(
        self,
        cfg: NLPConfig,
        model_config: object,
        attention: str,
        ds_config: dict,
        data: LMData,
        start_step: int,
        clock: Clock,
    ) -> None:
        super().__init__()
        self.cfg, self.model_config, self.attention, self.ds_config = cfg, model_config, attention, ds_config
        self.data, self.start_step, self.clock = data, start_step, clock
        self.model = None  # built in configure_model, inside ZeRO-3's partitioned construction
        mark_universal(self)  # DeepSpeed wraps this module: its checkpoints can then resume on another world size
        self.losses: list[torch.Tensor] = []
        self.aux_losses: list[torch.Tensor] = []  # MoE: the routers' load-balancing loss, logged apart
        self.log_file = MetricsLog(cfg.out_dir, enabled=is_launcher_rank_zero())
        self.plan: MemoryPlan | None = None
        self.held_at_construction = 0  # parameter elements this rank held right after construction
        self.model_states: dict[str, int] = {}  # measured after the first step
        self.val_loss = math.nan
        self.summary: NLPSummary | None = None
        self.sp: SequenceParallel | None = None  # this rank's sequence-parallel group, once DeepSpeed has built it
        self.offload = checkpoint_offload() if cfg.offload_checkpoints else None  # common/activation.py

    def configure_model(self) -> None:
        # Lightning runs this inside deepspeed.zero.Init under stage 3, and the strategy keeps an HfDeepSpeedConfig
        # alive (common/lightning_cpu.py): from_config / from_pretrained initialise each weight already sharded, no
        # rank ever holds the whole model, and RoPE's frequencies stay fp32.
        if self.model is not None:
            return
        self.model = build_model(self.cfg, self.model_config, self.attention, self.global_rank)  # MoE: its experts
        self.held_at_construction = held_param_elements(self.model)
        if self.cfg.sequence_parallel > 1:  # Ulysses: attention rerouted, and the groups for deepspeed.initialize
            self.trainer.strategy.mpu = sequence_parallel.register(
                self.model, self.cfg.sequence_parallel, self.cfg.micro_batch_size, self.attention
            )
        self.plan = memory_plan(
            self.model, self.ds_config, self.trainer.world_size, self.cfg.tensor_parallel, self.cfg.expert_parallel
        )
        self.print(self.plan.text())
        self.print(
            f"after construction rank 0 holds {self.held_at_construction:,} of "
            f"{self.plan.num_params:,} parameter elements"
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        dp_rank, dp_size = data_parallel(self.cfg, self.global_rank, self.trainer.world_size)
        return train_loader(self.data, self.cfg, dp_rank, dp_size, self.start_step, full_length=True)

    def configure_optimizers(self) -> dict:
        groups = param_groups(self.model, self.cfg.weight_decay)
        optimizer = make_optimizer(groups, self.ds_config, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if batch_idx == 0:
            check_replica_batch(self.cfg, batch["input_ids"])
        if self.offload is not None:  # left in on_after_backward: it must see the backward pass too
            self.offload.__enter__()
        total, loss, aux = train_loss(self.cfg, self.model, self.model, batch["input_ids"], batch["labels"], self.sp)
        self.losses.append(loss.detach())  # a tensor: reading it (.item(), the progress bar) would wait for the device
        if aux is not None:
            self.aux_losses.append(aux.detach())
        return total

    def on_after_backward(self) -> None:
        if self.offload is not None:
            self.offload.__exit__(None, None, None)

    def on_train_start(self) -> None:
        cfg, strategy = self.cfg, self.trainer.strategy
        self.checkpointer = make_checkpointer(cfg, self.global_rank, self.trainer.world_size, strategy.barrier)
        self.checkpointer.install(strategy.deepspeed_engine)  # async_save: DeepSpeed's files go through it
        check_mesh(cfg, self.global_rank, self.trainer.world_size)
        self.sp = sequence_parallel.this_rank(cfg.sequence_parallel, zero_stage(self.ds_config))
        if cfg.tensor_parallel > 1:  # its check cannot read Lightning's batch dict: check_replica_batch instead
            strategy.deepspeed_engine.first_dataloader_check.remove()
        self.val_batches = eval_batches(self.data, cfg, *data_parallel(cfg, self.global_rank, self.trainer.world_size))
        if self.start_step == 0:
            self.evaluate_and_log(0)
        self.clock.skip()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if len(self.losses) < self.cfg.grad_accum:
            return  # inside a gradient accumulation
        cfg, step = self.cfg, self.trainer.global_step
        self.clock.step_done()
        step_loss = torch.stack(self.losses).mean()
        step_aux = torch.stack(self.aux_losses).mean() if self.aux_losses else None
        self.losses.clear()
        self.aux_losses.clear()
        if step == self.start_step + 1:
            self.model_states = model_state_bytes(self.trainer.strategy.model)
            self.print(measured_text(self.model_states))
            if self.offload is not None:
                self.print(offload_text(self.offload.stats))
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            # Only on logging steps: the all-reduce and .item() are a collective and a host sync.
            loss = all_reduce(step_loss).item() / self.trainer.world_size
            self.log("loss", loss, prog_bar=True, logger=False)
            tokens_per_s = tokens_per_rank_step(cfg) / self.clock.median_step()
            moe = {} if step_aux is None else {"aux_loss": all_reduce(step_aux).item() / self.trainer.world_size}
            self.log_file.log(
                step,
                train_loss=loss,
                **moe,
                grad_norm=grad_norm(self.trainer.strategy.deepspeed_engine),
                lr=cfg.lr * lr_lambda(cfg)(step - 1),
                tokens_per_s_per_device=tokens_per_s,
                elapsed_s=self.clock.wall(),
            )
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            self.evaluate_and_log(step)
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            self.save(step)
        self.clock.skip()

    def evaluate_and_log(self, step: int) -> None:
        self.val_loss = evaluate(self.model, self.val_batches, self.device)
        self.log_file.log(step, val_loss=self.val_loss, elapsed_s=self.clock.wall())
        self.print(f"step {step}: val_loss {self.val_loss:.4f} ({self.clock.wall():.0f} s)")

    def save(self, step: int) -> None:
        # Every rank writes its shards into a temporary folder; rank 0 publishes it once all are done.
        self.checkpointer.save(step, self.trainer.save_checkpoint)
        self.log_file.log(step, checkpoint_blocked_s=self.checkpointer.blocked_s[-1])

    def on_train_end(self) -> None:
        """Logits on a fixed batch, whole weights gathered (every rank), then final/; the summary is kept for main()."""
        self.checkpointer.finish()  # async_save: the last checkpoint written and published before the export
        self.summary = finish(
            self.cfg,
            self.ds_config,
            self.model,
            self.data,
            self.model_config,
            self.attention,
            self.device,
            self.global_rank,
            self.trainer.world_size,
            self.clock,
            backend="lightning",
            steps=self.trainer.global_step,
            val_loss=self.val_loss,
            model_states=self.model_states,
            plan=self.plan,
            held_at_construction=self.held_at_construction,
        )
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
    # A different model or config, no complete checkpoint: refused; another data-parallel size: a universal checkpoint.
    resume = resume_point(cfg, world_size)
    start_step = resume.step if resume else 0
    trained_tokenizer = tokenizer_source(cfg, trained_here=False) is None
    data = load_data(cfg, tokenizer_source(cfg, trained_here=cfg.resume or not rank0), world_size)
    config = model_config(cfg, data.tokenizer)
    ds_config = resolve_ds_config(cfg, world_size, config.hidden_size)
    check_combinations(cfg, world_size, config, ds_config)
    attention = resolve_attention(cfg.attention, "cuda" if on_gpu else "cpu", torch_dtype(cfg.precision))
    if rank0:
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(
            cfg, out_dir, ds_config, data, world_size, "gpu" if on_gpu else "cpu", trained_tokenizer and not cfg.resume
        )
        print(f"data: {data.info()}", flush=True)
        if resume:  # before Lightning starts ranks 1..: they find a universal conversion in place
            prepare_resume(resume, config_to_dict(cfg))

    module = CausalLM(cfg, config, attention, ds_config, data, start_step, clock)
    load_config = with_universal_load(ds_config) if resume and resume.universal else ds_config
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


if __name__ == "__main__":
    main()
