"""LoRA fine-tuning of a causal LM under ZeRO-3 on Lightning: adapters gathered whole, merged model, exact match.

Launch, from the repository root:

    python recipes/nlp/train.py                 # once: the default base model, runs/nlp/final (~4.5 min on CPU)
    python recipes/nlp/finetune.py              # CPU: 2 processes, under 5 min
    python recipes/nlp/finetune.py model=path/to/hf_folder data=my_data.jsonl devices=1   # 1 GPU
    python recipes/nlp/finetune.py model=path/to/hf_folder data=my_data.jsonl devices=8   # 8 GPUs
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
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import torch
from finetune_config import (
    DTYPES,
    FinetuneConfig,
    base_module_names,
    build_lora_model,
    count_params,
    evaluate,
    final_export,
    load_examples,
    load_plain,
    load_tokenizer,
    lora_param_groups,
    parse_args,
    require_base_model,
    resolve_attention_or_exit,
    score,
    sft_loader,
    sft_loss,
    val_batches,
    write_run_files,
)
from recipe_config import (
    Clock,
    all_reduce,
    check_out_dir,
    initial_val_loss,
    lr_lambda,
    model_config,
    resolve_ds_config,
    set_threads,
    summary,
)

from common.accounting import model_state_bytes
from common.checkpoint import (
    CHECKPOINTS,
    checkpoint_step,
    gather_full_state_dict,
    latest_checkpoint,
    publish_checkpoint,
    tmp_checkpoint_dir,
)
from common.errors import ConfigError, exit_on_user_error
from common.metrics import peak_memory_bytes, throughput
from common.rundir import MetricsLog, is_launcher_rank_zero, prepare_run_dir, write_json_atomic
from common.strategy import lightning_trainer_kwargs, make_optimizer
from nlp.data import DataError
from nlp.lora import folder_bytes, trainable_parameter_shapes
from nlp.model import ModelError
from nlp.task import collate_sft, encode_examples, majority_baseline

warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


class LoRAFinetune(L.LightningModule):
    """The training step, plus the run's bookkeeping at optimizer-step boundaries (log, evaluate, checkpoint)."""

    def __init__(self, cfg: FinetuneConfig, run: dict) -> None:
        super().__init__()
        self.cfg, self.run = cfg, run
        self.model = None  # built in configure_model, inside ZeRO-3's partitioned construction
        self.strict_loading = False  # checkpoints leave the frozen base out: it comes from model= on resume
        self.losses: list[torch.Tensor] = []
        self.clock = Clock()
        self.log_file = MetricsLog(cfg.out_dir, enabled=is_launcher_rank_zero())
        self.facts: dict = {}

    def configure_model(self) -> None:
        if self.model is None:
            run = self.run
            self.model = build_lora_model(self.cfg, run["model_config"], run["attention"], run["module_names"])

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        run, world_size = self.run, self.trainer.world_size
        return sft_loader(run["train"], self.cfg, run["pad_id"], self.global_rank, world_size, run["start_step"], True)

    def configure_optimizers(self):
        groups = lora_param_groups(self.model, self.cfg.weight_decay)
        optimizer = make_optimizer(groups, self.run["ds_config"], lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = sft_loss(self.model, batch, self.device)
        self.losses.append(loss.detach())
        return loss

    def on_train_start(self) -> None:
        self.val_batches = val_batches(
            self.run["val_encoded"], self.cfg, self.run["pad_id"], self.global_rank, self.trainer.world_size
        )
        if self.run["start_step"] == 0:
            self.evaluate(0)
        self.clock.skip()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if len(self.losses) < self.cfg.grad_accum:
            return  # inside a gradient accumulation
        cfg, step = self.cfg, self.trainer.global_step
        self.clock.step_done()
        step_loss = torch.stack(self.losses).mean()  # a tensor: reading it would wait for the device
        self.losses.clear()
        if step == self.run["start_step"] + 1:
            self.facts["model_state_bytes"] = model_state_bytes(self.trainer.strategy.model)
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            # Only on logging steps: the all-reduce and .item() are a collective and a host sync.
            loss = all_reduce(step_loss).item() / self.trainer.world_size
            self.log_file.log(step, train_loss=loss, lr=cfg.lr * lr_lambda(cfg)(step - 1), elapsed_s=self.clock.wall())
            self.print(f"step {step}: train_loss {loss:.4f} ({self.clock.wall():.0f} s)")
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            self.evaluate(step)
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            self.save(step)
        self.clock.skip()

    def evaluate(self, step: int) -> None:
        self.facts["val_loss"] = evaluate(self.model, self.val_batches, self.device)
        self.log_file.log(step, val_loss=self.facts["val_loss"], elapsed_s=self.clock.wall())
        self.print(f"step {step}: val_loss {self.facts['val_loss']:.4f} ({self.clock.wall():.0f} s)")

    def save(self, step: int) -> None:
        # Every rank writes its shards (adapters and their optimizer state only) into a temporary folder.
        out_dir, strategy = Path(self.cfg.out_dir), self.trainer.strategy
        self.trainer.save_checkpoint(tmp_checkpoint_dir(out_dir, step))
        strategy.barrier()
        if self.trainer.is_global_zero:
            publish_checkpoint(out_dir, step)
        strategy.barrier()

    def on_train_end(self) -> None:
        # Collective work first (every rank): logits on a fixed batch, whole weights gathered one at a time.
        cfg, run, rank, out_dir = self.cfg, self.run, self.global_rank, Path(self.cfg.out_dir)
        self.model.eval()
        with torch.no_grad():
            logits = self.model(
                input_ids=run["fixed"]["input_ids"].to(self.device),
                attention_mask=run["fixed"]["attention_mask"].to(self.device),
                use_cache=False,
            ).logits.float()
        shapes = trainable_parameter_shapes(self.model)
        state = gather_full_state_dict(self.model, rank)
        peak = int(all_reduce(torch.tensor(float(peak_memory_bytes()), device=self.device), "max").item())
        if rank == 0:
            dtype = DTYPES[cfg.precision]
            exported = final_export(
                self.model, state, shapes, run["tokenizer"], out_dir, run["fixed"], logits.cpu(),
                run["val"], cfg, run["attention"], dtype,
            )  # fmt: skip
            self.facts["summary"] = self.summary(peak, exported)
        self.log_file.close()
        self.trainer.strategy.barrier()

    def summary(self, peak: int, exported: dict) -> dict:
        cfg, run = self.cfg, self.run
        samples_per_s = cfg.micro_batch_size * cfg.grad_accum / self.clock.median_step()
        trainable, total = count_params(self.model)
        measured = self.facts.get("model_state_bytes", {})
        checkpoint_bytes = folder_bytes([latest_checkpoint(cfg.out_dir)])
        return summary(
            cfg,
            run["ds_config"],
            val_loss=self.facts["val_loss"],
            initial_val_loss=initial_val_loss(Path(cfg.out_dir)),
            throughput=throughput(samples_per_s, "samples/s/device"),
            mfu=None,
            peak_memory_bytes=peak,
            model_state_bytes_per_rank=measured.get("model_states"),
            wall_time_s=None,
            world_size=self.trainer.world_size,
            attention=run["attention"],
            backend="lightning",
            steps=self.trainer.global_step,
            trainable_params=trainable,
            total_params=total,
            checkpoint_bytes=checkpoint_bytes,
            # A full-parameter ZeRO checkpoint of the same model holds 2 B of weights + 12 B of fp32 Adam state each.
            checkpoint_fraction_of_full=checkpoint_bytes / (14 * total),
            base_val_accuracy=run["base_val_accuracy"],
            majority_baseline_accuracy=run["majority_baseline"],
            accuracy_gain=exported["val_accuracy"] - max(run["base_val_accuracy"], run["majority_baseline"]),
            activation_checkpointing=cfg.activation_checkpointing,
            model_state_bytes_measured=measured,
            **exported,
        )


@exit_on_user_error(DataError, ModelError)
def main() -> None:
    cfg = parse_args()
    require_base_model(cfg)
    clock = Clock()
    on_gpu = torch.cuda.is_available()
    devices = cfg.devices or (torch.cuda.device_count() if on_gpu else 2)
    world_size = devices * cfg.num_nodes
    set_threads(devices)
    # Lightning starts ranks 1.. at trainer.fit by re-running this script: rank 0 alone checks and writes first.
    rank0 = is_launcher_rank_zero()
    out_dir = Path(cfg.out_dir)
    if rank0:
        check_out_dir(cfg)
    tokenizer = load_tokenizer(cfg)
    train, val = load_examples(cfg)
    config = model_config(cfg, tokenizer)
    module_names = base_module_names(cfg, config)
    attention = resolve_attention_or_exit(cfg, "cuda" if on_gpu else "cpu")
    ds_config = resolve_ds_config(cfg, world_size, config.hidden_size)
    base_val_accuracy = None
    if rank0:
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(cfg, out_dir, ds_config, world_size, "gpu" if on_gpu else "cpu")
        print(f"data: {len(train)} train / {len(val)} held-out examples ({cfg.data}); attention: {attention}")
        # The base model's score, on rank 0 before the other ranks start (a whole copy, no ZeRO yet).
        base_val_accuracy = score(load_plain(cfg, attention), tokenizer, val, cfg)
        print(f"base model exact match on the held-out set: {base_val_accuracy:.3f}", flush=True)
    latest = latest_checkpoint(out_dir) if cfg.resume else None
    if cfg.resume and latest is None:
        raise ConfigError(f"resume=true but {out_dir}/{CHECKPOINTS} holds no complete checkpoint")
    val_encoded = encode_examples(val, tokenizer, cfg.seq_len)

    run = {
        "model_config": config,
        "module_names": module_names,
        "attention": attention,
        "ds_config": ds_config,
        "tokenizer": tokenizer,
        "pad_id": tokenizer.pad_token_id,
        "train": encode_examples(train, tokenizer, cfg.seq_len),
        "val": val,
        "val_encoded": val_encoded,
        "fixed": collate_sft(val_encoded[:4], tokenizer.pad_token_id),
        "base_val_accuracy": base_val_accuracy,
        "majority_baseline": majority_baseline(val),
        "start_step": checkpoint_step(latest) if latest else 0,
    }
    module = LoRAFinetune(cfg, run)
    trainer_kwargs = lightning_trainer_kwargs(ds_config)
    trainer_kwargs["strategy"].exclude_frozen_parameters = True  # the frozen base is model=, not checkpoint state
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=devices,
        num_nodes=cfg.num_nodes,
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

    if trainer.is_global_zero and "summary" in module.facts:
        result = module.facts["summary"]
        result["wall_time_s"] = round(clock.wall(), 1)
        write_json_atomic(out_dir / "summary.json", result)
        print(
            f"exact match {result['val_accuracy']:.3f} (base {result['base_val_accuracy']:.3f}, majority answer "
            f"{result['majority_baseline_accuracy']:.3f}); val_loss {result['val_loss']:.4f}; "
            f"{result['trainable_params']:,} trainable of {result['total_params']:,}; "
            f"wall {result['wall_time_s']:.0f} s; run directory {out_dir}"
        )


if __name__ == "__main__":
    main()
