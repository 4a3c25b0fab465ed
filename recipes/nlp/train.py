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
summary.json. ``resume=true`` continues from checkpoints/latest.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from recipe_config import (
    Clock,
    NLPConfig,
    all_reduce,
    build_model,
    check_out_dir,
    eval_batches,
    evaluate,
    final_export,
    held_param_elements,
    initial_val_loss,
    lm_loss,
    load_data,
    lr_lambda,
    measured_text,
    memory_plan,
    model_config,
    param_groups,
    param_sizes,
    parse_args,
    plan_text,
    resolve_ds_config,
    set_threads,
    summary,
    tokenizer_source,
    train_loader,
    write_run_files,
)

from common.accounting import model_state_bytes
from common.checkpoint import gather_full_state_dict, publish_checkpoint, tmp_checkpoint_dir
from common.config import config_to_dict
from common.errors import exit_on_user_error
from common.metrics import gpu_peak_flops, mfu, peak_memory_bytes, throughput
from common.resume import find_resume_point, mark_universal, prepare_resume, with_universal_load
from common.rundir import MetricsLog, is_launcher_rank_zero, prepare_run_dir, write_json_atomic
from common.strategy import lightning_trainer_kwargs, make_optimizer
from nlp.data import DataError
from nlp.model import ModelError, flops_per_token, resolve_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# StepSampler starts a resumed run at the checkpoint's step, so the loader *is* resumable; Lightning cannot tell.
warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


class CausalLM(L.LightningModule):
    """The training step, plus the run's bookkeeping at optimizer-step boundaries (log, evaluate, checkpoint)."""

    def __init__(self, cfg: NLPConfig, run: dict) -> None:
        super().__init__()
        self.cfg, self.run = cfg, run
        self.model = None  # built in configure_model, inside ZeRO-3's partitioned construction
        mark_universal(self)  # DeepSpeed wraps this module: its checkpoints can then resume on another world size
        self.losses: list[torch.Tensor] = []
        self.clock = Clock()
        self.log_file = MetricsLog(cfg.out_dir, enabled=is_launcher_rank_zero())
        self.facts: dict = {}

    def configure_model(self) -> None:
        # Lightning runs this inside deepspeed.zero.Init under stage 3, and the strategy keeps an HfDeepSpeedConfig
        # alive (common/lightning_cpu.py): from_config / from_pretrained initialise each weight already sharded, no
        # rank ever holds the whole model, and RoPE's frequencies stay fp32.
        if self.model is not None:
            return
        self.model = build_model(self.cfg, self.run["model_config"], self.run["attention"])
        self.facts["param_elements_at_construction"] = held_param_elements(self.model)
        self.run["plan"] = memory_plan(param_sizes(self.model), self.run["ds_config"], self.trainer.world_size)
        self.print(plan_text(self.run["plan"]))
        self.print(
            f"after construction rank 0 holds {self.facts['param_elements_at_construction']:,} of "
            f"{self.run['plan']['num_params']:,} parameter elements"
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return train_loader(
            self.run["data"],
            self.cfg,
            self.global_rank,
            self.trainer.world_size,
            self.run["start_step"],
            full_length=True,
        )

    def configure_optimizers(self):
        groups = param_groups(self.model, self.cfg.weight_decay)
        optimizer = make_optimizer(groups, self.run["ds_config"], lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.model, batch["input_ids"], batch["labels"])
        self.losses.append(loss.detach())  # a tensor: reading it (.item(), the progress bar) would wait for the device
        return loss

    def on_train_start(self) -> None:
        self.val_batches = eval_batches(self.run["data"], self.cfg, self.global_rank, self.trainer.world_size)
        if self.run["start_step"] == 0:
            self.evaluate(0)
        self.clock.skip()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if len(self.losses) < self.cfg.grad_accum:
            return  # inside a gradient accumulation
        cfg, step = self.cfg, self.trainer.global_step
        self.clock.step_done()
        step_loss = torch.stack(self.losses).mean()
        self.losses.clear()
        if step == self.run["start_step"] + 1:
            self.facts["model_state_bytes"] = model_state_bytes(self.trainer.strategy.model)
            self.print(measured_text(self.facts["model_state_bytes"]))
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            # Only on logging steps: the all-reduce and .item() are a collective and a host sync.
            loss = all_reduce(step_loss).item() / self.trainer.world_size
            self.log("loss", loss, prog_bar=True, logger=False)
            tokens_per_s = cfg.micro_batch_size * cfg.grad_accum * cfg.seq_len / self.clock.median_step()
            self.log_file.log(
                step,
                train_loss=loss,
                lr=cfg.lr * lr_lambda(cfg)(step - 1),
                tokens_per_s_per_device=tokens_per_s,
                elapsed_s=self.clock.wall(),
            )
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            self.evaluate(step)
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            self.save(step)
        self.clock.skip()

    def evaluate(self, step: int) -> None:
        val_loss = evaluate(self.model, self.val_batches, self.device)
        self.facts["val_loss"] = val_loss
        self.log_file.log(step, val_loss=val_loss, elapsed_s=self.clock.wall())
        self.print(f"step {step}: val_loss {val_loss:.4f} ({self.clock.wall():.0f} s)")

    def save(self, step: int) -> None:
        # Every rank writes its shards into a temporary folder; rank 0 publishes it once all are done.
        out_dir, strategy = Path(self.cfg.out_dir), self.trainer.strategy
        self.trainer.save_checkpoint(tmp_checkpoint_dir(out_dir, step))
        strategy.barrier()
        if self.trainer.is_global_zero:
            publish_checkpoint(out_dir, step)
        strategy.barrier()

    def on_train_end(self) -> None:
        # Collective work first (every rank): logits on a fixed batch, whole weights gathered one at a time.
        cfg, rank, out_dir = self.cfg, self.global_rank, Path(self.cfg.out_dir)
        fixed = self.run["data"].val.blocks[:2].to(self.device)
        self.model.eval()
        with torch.no_grad():
            logits = self.model(input_ids=fixed[:, :-1], use_cache=False).logits.float().cpu()
        state = gather_full_state_dict(self.model, rank)
        peak = int(all_reduce(torch.tensor(float(peak_memory_bytes()), device=self.device), "max").item())
        if rank == 0:
            exported = final_export(
                self.model,
                state,
                self.run["data"].tokenizer,
                out_dir,
                fixed.cpu(),
                logits,
                cfg,
                self.run["attention"],
                self.device,
            )
            self.facts["summary"] = self.summary(peak, exported)
        self.log_file.close()
        self.trainer.strategy.barrier()

    def summary(self, peak: int, exported: dict) -> dict:
        cfg, run = self.cfg, self.run
        tokens_per_s = cfg.micro_batch_size * cfg.grad_accum * cfg.seq_len / self.clock.median_step()
        initial = initial_val_loss(Path(cfg.out_dir))
        measured = self.facts.get("model_state_bytes", {})
        return summary(
            cfg,
            run["ds_config"],
            val_loss=self.facts["val_loss"],
            initial_val_loss=initial,
            throughput=throughput(tokens_per_s, "tokens/s/device"),
            mfu=mfu(tokens_per_s, flops_per_token(run["model_config"], cfg.seq_len), gpu_peak_flops()),
            peak_memory_bytes=peak,
            model_state_bytes_per_rank=measured.get("model_states"),
            wall_time_s=round(run["clock"].wall(), 1),
            world_size=self.trainer.world_size,
            attention=run["attention"],
            backend="lightning",
            steps=self.trainer.global_step,
            tokens_per_step=cfg.micro_batch_size * cfg.grad_accum * cfg.seq_len * self.trainer.world_size,
            median_step_s=round(self.clock.median_step(), 4),
            model_state_bytes_measured=measured,
            memory_plan=run["plan"],
            params_at_construction={
                "elements_on_rank0": self.facts.get("param_elements_at_construction"),
                "num_params": run["plan"]["num_params"],
            },
            data=run["data"].info(),
            **exported,
        )


@exit_on_user_error(DataError, ModelError)
def main() -> None:
    cfg = parse_args()
    clock = Clock()
    on_gpu = torch.cuda.is_available()
    devices = cfg.devices or (torch.cuda.device_count() if on_gpu else 2)
    world_size = devices * cfg.num_nodes
    set_threads(devices)
    # Lightning starts ranks 1.. at trainer.fit by re-running this script: they read what rank 0 wrote before.
    rank0 = is_launcher_rank_zero()
    out_dir = Path(cfg.out_dir)
    if rank0:
        check_out_dir(cfg)
    # A different model or config, no complete checkpoint: refused here; another world size: a universal checkpoint.
    resume = find_resume_point(out_dir, config_to_dict(cfg), world_size) if cfg.resume else None
    start_step = resume.step if resume else 0
    trained_tokenizer = tokenizer_source(cfg, trained_here=False) is None
    data = load_data(cfg, tokenizer_source(cfg, trained_here=cfg.resume or not rank0), world_size)
    config = model_config(cfg, data.tokenizer)
    ds_config = resolve_ds_config(cfg, world_size, config.hidden_size)
    attention = resolve_attention(cfg.attention, "cuda" if on_gpu else "cpu", DTYPES[cfg.precision])
    if rank0:
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(
            cfg, out_dir, ds_config, data, world_size, "gpu" if on_gpu else "cpu", trained_tokenizer and not cfg.resume
        )
        print(f"data: {data.info()}", flush=True)
        if resume:  # before Lightning starts ranks 1..: they find a universal conversion in place
            prepare_resume(resume, config_to_dict(cfg))

    run = {
        "model_config": config,
        "attention": attention,
        "ds_config": ds_config,
        "data": data,
        "start_step": start_step,
        "clock": clock,
    }
    module = CausalLM(cfg, run)
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=devices,
        num_nodes=cfg.num_nodes,
        max_steps=cfg.max_steps,
        use_distributed_sampler=False,  # StepSampler shards by rank itself
        logger=False,  # metrics.jsonl and tb/ are written by the module
        enable_checkpointing=False,  # checkpoints are saved and published by the module
        enable_model_summary=False,  # under ZeRO-3 it would count empty shards; the memory plan says more
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **lightning_trainer_kwargs(
            with_universal_load(ds_config) if resume and resume.universal else ds_config,
            timeout=timedelta(seconds=cfg.collective_timeout_s),
        ),
    )
    trainer.fit(module, ckpt_path=str(resume.load_path) if resume else None)

    if trainer.is_global_zero and "summary" in module.facts:
        result = module.facts["summary"]
        result["wall_time_s"] = round(clock.wall(), 1)
        write_json_atomic(out_dir / "summary.json", result)
        print(f"sample: {result['sample']!r}")
        print(
            f"val_loss {result['val_loss']:.4f} (step 0: {result['initial_val_loss']:.4f}, ratio "
            f"{result['val_loss_ratio']:.3f}); {result['throughput']['value']:.0f} tokens/s/device; "
            f"wall {result['wall_time_s']:.0f} s; run directory {out_dir}"
        )


if __name__ == "__main__":
    main()
