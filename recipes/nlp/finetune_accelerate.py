"""LoRA fine-tuning of a causal LM under ZeRO-3 as a plain Accelerate loop: the same run as finetune.py.

Launch, from the repository root:

    python recipes/nlp/train.py        # once: the default base model, runs/nlp/final
    accelerate launch --config_file recipes/nlp/accelerate_finetune.yaml recipes/nlp/finetune_accelerate.py  # CPU
    accelerate launch --config_file recipes/nlp/accelerate_finetune.yaml --num_processes 8 \\
        recipes/nlp/finetune_accelerate.py model=path/to/hf_folder data=my_data.jsonl                       # 8 GPUs
    accelerate launch --config_file recipes/nlp/accelerate_finetune.yaml recipes/nlp/finetune_accelerate.py \\
        sequence_parallel=2                                       # Ulysses: each example split over the 2 processes
    accelerate launch --config_file recipes/nlp/accelerate_finetune.yaml recipes/nlp/finetune_accelerate.py \\
        preset=fsdp2                                              # PyTorch FSDP2 instead of DeepSpeed, same launcher
    # multi-node: add --num_machines N --machine_rank R --main_process_ip HOST on every node

``accelerate_finetune.yaml`` + ``ds_config_finetune.json`` are the factory's output for the default config on 2
processes; the script builds its DeepSpeed plugin from the same factory, so a changed ``micro_batch_size`` or
``preset`` needs no edit of either file. Keys, run directory and ``summary.json`` are those of finetune.py.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from finetune_config import DEFAULT_CONFIG, FinetuneConfig
from finetune_loss import evaluate, global_batch_tokens, loss_scale, step_token_mean, train_loss  # next to this script
from finetuning import (
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
from tqdm.auto import tqdm

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
from common.errors import ConfigError, exit_on_user_error
from common.lint import lint_at_start
from common.metrics import Clock, barrier, grad_norm
from common.model_folder import base_reference, check_base_unchanged, check_weight_files, write_base_reference
from common.process_setup import end_process_group, setup_process
from common.rundir import MetricsLog, is_launcher_rank_zero, prepare_run_dir, refuse_existing_out_dir, set_cpu_threads
from common.strategy import (
    AccelerateCheckpointIO,
    accelerator_kwargs,
    gradient_norm,
    make_optimizer,
    shard_model,
    zero_stage,
)
from common.zero3_trace import retrace_after_evaluation
from nlp.data import DataError
from nlp.lora import trainable_parameter_shapes
from nlp.model import ModelError

warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


def write_checkpoint(state: AccelerateCheckpointIO, folder: Path, base: dict) -> Any:
    """Every rank writes its shards (adapters and their optimizer state, no frozen weights: DeepSpeed's or DCP's);
    rank 0 adds the base's reference (its files' hashes) first: DeepSpeed's save opens with a barrier, so with
    async_save no rank's writer thread lists the folder (to fsync it) while the reference's temporary file is there.
    Returns what the save returns (DCP's future under an asynchronous FSDP2 save)."""
    if state.accelerator.is_main_process:
        write_base_reference(folder, base)
    return state.save(folder)


@exit_on_user_error(DataError, ModelError)
def main() -> None:
    cfg = parse_recipe_args(FinetuneConfig, DEFAULT_CONFIG, describe=describe)
    clock = Clock()
    config = base_model_config(cfg)
    check_weight_files(cfg.pretrained)  # a truncated *.safetensors: one line naming it, not a traceback
    out_dir = Path(cfg.out_dir)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if is_launcher_rank_zero():  # rank 0 creates out_dir below, before the ranks meet: only it may judge it
        refuse_existing_out_dir(out_dir, cfg.resume, cfg.overwrite)
    # Adapters resumed on another base than the one they were trained on would train on and mean nothing.
    base = base_reference(cfg.pretrained)
    if cfg.resume:
        check_base_unchanged(latest_checkpoint(out_dir), base)
    on_gpu = torch.cuda.is_available()

    # --- checks, data and the base model's score: before any process group, rank 0 writes and scores alone ---
    tokenizer = load_tokenizer(cfg, config)
    data = load_sft_data(cfg, tokenizer)
    module_names = base_module_names(cfg, config)
    attention = resolve_attention_or_exit(cfg, "cuda" if on_gpu else "cpu")
    ds_config = resolve_ds_config(cfg, world_size, config.hidden_size)
    check_sequence_parallel(cfg, world_size, config, attention)
    # Known ZeRO pitfalls (common.lint), checked before any work (printed on rank 0; errors refuse the run).
    lint_at_start(ds_config, config_to_dict(cfg), hidden_size=config.hidden_size, world_size=world_size)
    base_val_accuracy = None
    if is_launcher_rank_zero():
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(cfg, out_dir, ds_config, world_size, "gpu" if on_gpu else "cpu")
        print(f"data: {len(data.train)} train / {len(data.val)} held-out examples ({cfg.data}); attention: {attention}")
        base_val_accuracy = score(load_plain(cfg, attention), tokenizer, data.val, cfg)
        print(f"base model exact match on the held-out set: {base_val_accuracy:.3f}", flush=True)

    # --- DeepSpeed through Accelerate; ZeRO-3's partitioned construction is on from here (FSDP2 presets: the
    # model is built whole, then each decoder layer and the root sharded by shard_model) ---
    setup_process(ds_config, timeout=timedelta(seconds=cfg.collective_timeout_s))  # process-wide: printed once
    accelerator_args = accelerator_kwargs(ds_config, timeout=timedelta(seconds=cfg.collective_timeout_s))
    if cfg.sequence_parallel > 1:  # Ulysses: prepare() routes attention through it and gives DeepSpeed the groups
        accelerator_args["parallelism_config"] = sequence_parallel.accelerate_parallelism(
            cfg.sequence_parallel, attention, world_size
        )
    accelerator = Accelerator(**accelerator_args)
    rank, device, main_process = accelerator.process_index, accelerator.device, accelerator.is_main_process
    model = build_lora_model(cfg, attention, module_names)
    shard_model(model, ds_config)  # FSDP2 presets only (ZeRO: DeepSpeed's, in prepare)
    optimizer = make_optimizer(
        lora_param_groups(model, cfg.weight_decay), ds_config, lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))  # stepped once per optimizer step
    engine, optimizer = accelerator.prepare(model, optimizer)
    sp = sequence_parallel.this_rank(cfg.sequence_parallel, zero_stage(ds_config))  # None unless sequence parallel
    accelerator.register_for_checkpointing(scheduler)
    net = accelerator.unwrap_model(engine)  # the peft model (DeepSpeed's engine.module; FSDP2: the model)
    # DeepSpeed's save_state, or DCP under FSDP2; the frozen base left out (it is model= again on resume).
    state = AccelerateCheckpointIO(accelerator, ds_config, engine, optimizer, scheduler, exclude_frozen_parameters=True)
    checkpointer = make_checkpointer(cfg, rank, world_size, state.barrier)
    checkpointer.install(engine)  # async_save: the backend's checkpoint files go through it

    start_step = 0
    if cfg.resume:
        latest = latest_checkpoint(out_dir)
        if latest is None:
            raise ConfigError(f"resume=true but {out_dir}/{CHECKPOINTS} holds no complete checkpoint")
        state.load(latest)  # the adapters and their optimizer state; the frozen base comes from model=
        start_step = checkpoint_step(latest)
        accelerator.print(f"resumed from {latest} (step {start_step})")
    # The ranks of a sequence-parallel group read the same examples; held-out batches are whole sequences on every
    # rank (Ulysses is off in eval mode), split over all ranks.
    dp_rank, dp_size = data_parallel(cfg, rank, world_size)
    loader = sft_loader(data, cfg, dp_rank, dp_size, start_step, False)
    held_out = val_batches(data, cfg, rank, world_size)
    log = MetricsLog(out_dir, enabled=main_process)
    bar = tqdm(total=cfg.max_steps, initial=start_step, desc="train", disable=not main_process, dynamic_ncols=True)

    def run_eval(step: int) -> float:
        val_loss = evaluate(engine, held_out, device)
        log.log(step, val_loss=val_loss, elapsed_s=clock.wall())
        if main_process:
            bar.write(f"step {step}: val_loss {val_loss:.4f} ({clock.wall():.0f} s)")
        return val_loss

    # --- training ---
    val_loss = float("nan")
    if start_step == 0:
        val_loss = run_eval(0)
        retrace_after_evaluation(engine)  # ZeRO-3 would keep the evaluation's release decisions
    engine.train()
    step, loss_sums, state_bytes, step_norm = start_step, [], {}, None
    clock.skip()
    for batch in loader:
        # The step's token mean (finetune_loss.loss_scale): the global batch's response tokens, known from the data.
        scale = loss_scale(cfg, dp_size, global_batch_tokens(data, cfg, dp_size, step))
        with accelerator.accumulate(engine):
            loss, sums = train_loss(engine, batch, device, scale, sp)
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # FSDP2 clips here and returns the norm; DeepSpeed, in its step (None)
                step_norm = gradient_norm(engine, ds_config, clip=True)
            optimizer.step()
            optimizer.zero_grad()
        loss_sums.append(sums)  # detached [summed loss, tokens]: reading it would wait for the device
        if len(loss_sums) < cfg.grad_accum:
            continue
        scheduler.step()
        step += 1
        clock.step_done()
        sums, loss_sums = loss_sums, []
        bar.update(1)
        if step == start_step + 1:
            state_bytes = model_state_bytes(engine, optimizer)
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            # Only on logging steps: the all-reduce and .item() are a collective and a host sync.
            mean_loss = step_token_mean(sums)
            bar.set_postfix(loss=f"{mean_loss:.3f}")
            log.log(
                step,
                train_loss=mean_loss,
                grad_norm=grad_norm(engine, step_norm),
                lr=cfg.lr * lr_lambda(cfg)(step - 1),
                elapsed_s=clock.wall(),
            )
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            val_loss = run_eval(step)
            engine.train()
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            checkpointer.save(step, lambda folder: write_checkpoint(state, folder, base))  # rank 0 publishes
            log.log(step, checkpoint_blocked_s=checkpointer.blocked_s[-1])
        clock.skip()
    bar.close()
    checkpointer.finish()  # async_save: the last checkpoint written and published before the export

    # --- export: logits on a fixed batch and whole weights (collective), then adapter/, merged/ on rank 0 ---
    if sp is not None:
        sequence_parallel.unregister(attention)  # the export runs (and generates) with the attention mask
    engine.eval()
    logits = batch_logits(engine, data.fixed_batch, device)
    shapes = trainable_parameter_shapes(net)
    weights = gather_full_state_dict(net, rank)
    peak = peak_memory_over_ranks(device)
    if main_process:
        export = final_export(cfg, net, weights, shapes, data, logits.cpu(), attention)
        summary = make_summary(
            cfg,
            ds_config,
            net,
            data,
            export,
            backend="accelerate",
            world_size=world_size,
            attention=attention,
            steps=step,
            val_loss=val_loss,
            median_step_s=clock.median_step(),
            peak_memory=peak,
            state_bytes=state_bytes,
            base_val_accuracy=base_val_accuracy,
            wall_time_s=round(clock.wall(), 1),
        )
        write_summary(out_dir, summary)
    log.close()
    barrier()  # the process group's: accelerator.wait_for_everyone returns at once under FSDP2 on a CPU
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort a healthy run
    accelerator.end_training()  # the trackers; the process group is already gone


if __name__ == "__main__":
    main()
