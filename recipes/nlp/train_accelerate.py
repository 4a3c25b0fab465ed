"""Causal LM (Llama) with ZeRO-3 and parameter persistence as a plain Accelerate loop: the same run as train.py.

Launch, from the repository root:

    accelerate launch --config_file recipes/nlp/accelerate.yaml recipes/nlp/train_accelerate.py          # CPU: 2 procs
    accelerate launch --config_file recipes/nlp/accelerate.yaml --num_processes 1 \\
        recipes/nlp/train_accelerate.py --config recipes/nlp/configs/llama_125m.yaml                      # 1 GPU
    accelerate launch --config_file recipes/nlp/accelerate.yaml --num_processes 8 \\
        recipes/nlp/train_accelerate.py --config recipes/nlp/configs/llama_1b.yaml                        # 8 GPUs
    # multi-node: add --num_machines N --machine_rank R --main_process_ip HOST on every node

``accelerate.yaml`` + ``ds_config.json`` are the factory's output for the default config on 2 processes; the
script builds its DeepSpeed plugin from the same factory (``common.strategy.accelerator_kwargs``), so a changed
``micro_batch_size`` or ``preset`` needs no edit of either file. Keys, run directory and ``summary.json`` are
those of train.py (``--print-config`` lists the keys; ``--describe`` prints what the planning tools read). The
config's keys are in ``nlp_config.py``; the data, the model (``build_model``), the loss, the evaluation, the run
files and the summary in ``pretraining.py``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from nlp_config import DEFAULT_CONFIG, NLPConfig  # next to this script
from nlp_layout import measured_text, memory_plan, resume_point, run_layout, tokens_per_rank_step  # next to this
from pretraining import (  # next to this script: data, model, loss, evaluation, run files, summary
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
from tqdm.auto import tqdm

from common import sequence_parallel
from common.accounting import model_state_bytes
from common.activation import checkpoint_offload, offload_text
from common.async_checkpoint import make_checkpointer
from common.config import config_to_dict, parse_recipe_args
from common.errors import exit_on_user_error
from common.metrics import Clock, all_reduce, barrier, grad_norm, main_process_first
from common.parallel import check_mesh
from common.process_setup import end_process_group, setup_process
from common.resume import (
    mark_universal,
    param_groups_kept,
    prepare_resume,
    with_universal_load,
)
from common.rundir import MetricsLog, prepare_run_dir, refuse_existing_out_dir, set_cpu_threads, write_json_atomic
from common.strategy import (
    AccelerateCheckpointIO,
    accelerator_kwargs,
    gradient_norm,
    make_optimizer,
    shard_model,
    torch_dtype,
    zero_stage,
)
from common.zero3_trace import retrace_after_evaluation
from nlp.data import DataError
from nlp.model import ModelError, resolve_attention

warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


@exit_on_user_error(DataError, ModelError)
def main() -> None:
    cfg = parse_recipe_args(NLPConfig, DEFAULT_CONFIG, describe=describe)
    clock = Clock()
    out_dir = Path(cfg.out_dir)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    # Every rank sees the same folder, so every rank stops with the same one-line error.
    refuse_existing_out_dir(out_dir, cfg.resume, cfg.overwrite)
    # --- DeepSpeed through Accelerate: the factory's dict, with ZeRO-3's partitioned construction turned on ---
    ds_config = resolve_ds_config(cfg, world_size, hidden_size(cfg))
    # How the ranks split the model (data parallel unless tensor/expert/sequence_parallel is set): refused here if bad.
    layout = run_layout(cfg, world_size, model_config(cfg, tokenizer=None), ds_config)
    # A different model or config, no complete checkpoint: refused; another data-parallel size: a universal checkpoint.
    resume = resume_point(cfg, layout)
    start_step = resume.step if resume else 0
    load_config = with_universal_load(ds_config) if resume and resume.universal else ds_config
    setup_process(load_config, timeout=timedelta(seconds=cfg.collective_timeout_s))  # process-wide: printed once
    accelerator_args = accelerator_kwargs(load_config, timeout=timedelta(seconds=cfg.collective_timeout_s))
    if cfg.sequence_parallel > 1:  # Ulysses: prepare() routes attention through it and gives DeepSpeed the groups
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        attention = resolve_attention(cfg.attention, device_type, torch_dtype(cfg.precision))
        accelerator_args["parallelism_config"] = sequence_parallel.accelerate_parallelism(
            cfg.sequence_parallel, attention, world_size
        )
    accelerator = Accelerator(**accelerator_args)
    rank, device, main_process = accelerator.process_index, accelerator.device, accelerator.is_main_process
    if cfg.devices not in (0, world_size) and main_process:
        print(f"note: devices={cfg.devices} is Lightning's; accelerate launched {world_size} process(es)")

    # --- data: rank 0 trains the tokenizer and writes the run files, the other ranks then load them ---
    trained_tokenizer = tokenizer_source(cfg, trained_here=False) is None
    # Over the process group: accelerator.main_process_first lets every rank in at once under FSDP2 on a CPU.
    with main_process_first(main_process):
        data = load_data(cfg, tokenizer_source(cfg, trained_here=cfg.resume or not main_process), world_size)
        if main_process:
            prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
            trained = trained_tokenizer and not cfg.resume
            write_run_files(cfg, out_dir, ds_config, data, world_size, device.type, trained)
            print(f"data: {data.info()}", flush=True)
            if resume:  # a universal conversion counts against collective_timeout_s for the waiting ranks
                prepare_resume(resume, config_to_dict(cfg))

    # --- model: built inside zero.Init (the plugin's zero3_init_flag), so no rank holds it whole; under an FSDP2
    # preset built whole, then each decoder layer and the root sharded (shard_model) before the optimizer sees it ---
    config = model_config(cfg, data.tokenizer)
    attention = resolve_attention(cfg.attention, device.type, torch_dtype(cfg.precision))
    model = build_model(cfg, config, attention, layout.expert_rank(rank))  # MoE: this rank's experts
    mark_universal(model)  # DeepSpeed wraps this module: its checkpoints can then resume on another world size
    run = RunRecord(cfg, ds_config, layout, config, attention, "accelerate", clock)  # what finish() reports
    held = run.held_at_construction = held_param_elements(model)
    run.plan = memory_plan(model, ds_config, layout)
    if main_process:
        print(run.plan.text())
        print(f"after construction rank 0 holds {held:,} of {run.plan.num_params:,} parameter elements", flush=True)
    shard_model(model, ds_config)  # FSDP2 presets only (ZeRO: DeepSpeed's, in prepare)
    optimizer = make_optimizer(param_groups(model, cfg), ds_config, lr=cfg.lr, weight_decay=cfg.weight_decay)
    # A plain LambdaLR stepped once per optimizer step (a prepared scheduler would step once per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, optimizer = accelerator.prepare(model, optimizer)
    check_mesh(layout, rank)  # tensor/expert parallel: DeepSpeed's groups are those the layout's rank map assumed
    sp = sequence_parallel.this_rank(cfg.sequence_parallel, zero_stage(ds_config))  # None unless sequence parallel
    accelerator.register_for_checkpointing(scheduler)
    net = accelerator.unwrap_model(engine)  # the transformers model (DeepSpeed's engine.module; FSDP2: the model)
    state = AccelerateCheckpointIO(accelerator, ds_config, engine, optimizer, scheduler)  # save_state, or DCP
    checkpointer = make_checkpointer(cfg, rank, world_size, state.barrier)
    checkpointer.install(engine)  # async_save: the backend's checkpoint files go through it

    if resume:
        with param_groups_kept(optimizer):  # DeepSpeed's ZeRO-3 universal load flattens the groups' settings
            state.load(resume.load_path)  # the model's and optimizer's shards, the scheduler
    # Not prepared: StepSampler already gives each replica its slice, in an order fixed by (seed, step). Without
    # tensor or sequence parallelism a replica is a rank; with them every rank of a replica reads its batches.
    replica, replicas = layout.data_parallel_rank(rank), layout.data_parallel
    loader = train_loader(data, cfg, replica, replicas, start_step)
    val_batches = eval_batches(data, cfg, replica, replicas)
    log = MetricsLog(out_dir, enabled=main_process)
    bar = tqdm(total=cfg.max_steps, initial=start_step, desc="train", disable=not main_process, dynamic_ncols=True)

    def say(text: str) -> None:  # rank 0 only, without breaking the progress bar
        if main_process:
            bar.write(text)

    def run_eval(step: int) -> float:
        loss = evaluate(engine, val_batches, device)
        log.log(step, val_loss=loss, elapsed_s=clock.wall())
        say(f"step {step}: val_loss {loss:.4f} ({clock.wall():.0f} s)")
        return loss

    # --- training ---
    tokens_per_step = tokens_per_rank_step(cfg, layout)  # per device
    if start_step == 0:
        run.val_loss = run_eval(0)
        retrace_after_evaluation(engine)  # ZeRO-3 would keep the evaluation's release decisions
    engine.train()
    step, losses, aux_losses, step_norm = start_step, [], [], None
    clock.skip()
    offload = checkpoint_offload() if cfg.offload_checkpoints else contextlib.nullcontext()
    for batch in loader:
        with accelerator.accumulate(engine), offload:  # offload: around the forward and the backward pass
            # A MoE model adds its routers' load-balancing loss to the LM loss (logged apart); a dense one nothing.
            total, loss, aux = train_loss(
                cfg, engine, net, batch["input_ids"].to(device), batch["labels"].to(device), sp
            )
            accelerator.backward(total)  # DeepSpeed's backward, and its optimizer step at the accumulation boundary
            if accelerator.sync_gradients:  # FSDP2 clips here and returns the norm; DeepSpeed, in its step (None)
                step_norm = gradient_norm(engine, ds_config, clip=True)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
        if aux is not None:
            aux_losses.append(aux.detach())
        if len(losses) < cfg.grad_accum:
            continue
        scheduler.step()
        step += 1
        clock.step_done()
        step_loss = torch.stack(losses).mean()  # a tensor: reading it would wait for the device
        step_aux = torch.stack(aux_losses).mean() if aux_losses else None
        losses.clear()
        aux_losses.clear()
        bar.update(1)
        if step == start_step + 1:
            run.model_states = model_state_bytes(engine, optimizer)
            say(measured_text(run.model_states))
            if cfg.offload_checkpoints:
                say(offload_text(offload.stats))
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            # Only on logging steps: the all-reduce and .item() are a collective and a host sync. The ranks of a
            # tensor-parallel group hold their replica's loss, each counted once per rank: the mean over replicas.
            mean_loss = all_reduce(step_loss).item() / world_size
            bar.set_postfix(loss=f"{mean_loss:.3f}")
            moe = {} if step_aux is None else {"aux_loss": all_reduce(step_aux).item() / world_size}
            log.log(
                step,
                train_loss=mean_loss,
                **moe,
                grad_norm=grad_norm(engine, step_norm),
                lr=cfg.lr * lr_lambda(cfg)(step - 1),
                tokens_per_s_per_device=tokens_per_step / clock.median_step(),
                elapsed_s=clock.wall(),
            )
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            run.val_loss = run_eval(step)
            engine.train()
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            # Every rank writes its shards (and the scheduler, RNG) into a temporary folder; rank 0 publishes it.
            checkpointer.save(step, state.save)
            log.log(step, checkpoint_blocked_s=checkpointer.blocked_s[-1])
        clock.skip()
    bar.close()
    checkpointer.finish()  # async_save: the last checkpoint written and published before the export

    # --- export: logits on a fixed batch and whole weights (collective), then final/ and its check on rank 0 ---
    run.steps = step
    summary = finish(run, net, data, device, rank)
    log.close()
    if summary is not None:
        write_json_atomic(out_dir / "summary.json", summary.to_json())
        print(summary.headline(out_dir), flush=True)
    barrier()  # the process group's: accelerator.wait_for_everyone returns at once under FSDP2 on a CPU
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort a healthy run
    accelerator.end_training()  # the trackers; the process group is already gone


if __name__ == "__main__":
    main()
