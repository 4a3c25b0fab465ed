"""Swin image classifier with ZeRO-2 (the cv preset), as a plain Accelerate loop.

The same training as ``train.py`` (same config, data order, model, DeepSpeed dict, run files), written as a
loop. ``accelerate.yaml`` names ``ds_config.json``, the factory's output for the default config on 2
processes; the script resolves its own DeepSpeed dict from the config and the launcher's world size.

    # CPU, 2 processes (gloo), the tiny default: digits, ~1.5 min
    accelerate launch --config_file recipes/cv/accelerate.yaml recipes/cv/train_accelerate.py
    # Swin-T at 224 px on your images, 8 GPUs
    accelerate launch --config_file recipes/cv/accelerate.yaml --num_processes 8 \\
        recipes/cv/train_accelerate.py --config recipes/cv/configs/swin_tiny.yaml data=my_images/
    # multi-node: on each machine
    accelerate launch --config_file recipes/cv/accelerate.yaml --num_machines 2 --machine_rank R \\
        --main_process_ip HOST --num_processes 16 recipes/cv/train_accelerate.py
    # overrides as in train.py: key=value, resume=true, precision=fp32, model=path/to/hf_folder
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from classification import (  # next to this script: data, model, loss, evaluation, run files, summary
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
from tqdm.auto import tqdm

from common.async_checkpoint import make_checkpointer
from common.config import config_to_dict, parse_recipe_args
from common.errors import exit_on_user_error
from common.metrics import Clock, all_reduce, barrier, grad_norm
from common.process_setup import end_process_group, setup_process
from common.resume import find_resume_point, mark_universal, param_groups_kept, prepare_resume, with_universal_load
from common.rundir import MetricsLog, prepare_run_dir, refuse_existing_out_dir, set_cpu_threads, write_json_atomic
from common.strategy import AccelerateCheckpointIO, accelerator_kwargs, gradient_norm, make_optimizer, shard_model
from cv.data import DataError
from cv.model import ModelError


@exit_on_user_error(DataError, ModelError)
def main() -> None:
    cfg = parse_recipe_args(CVConfig, DEFAULT_CONFIG, describe=describe)
    clock = Clock()
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    out_dir, main_process = Path(cfg.out_dir), int(os.environ.get("RANK", 0)) == 0
    if main_process:
        refuse_existing_out_dir(out_dir, cfg.resume, cfg.overwrite)  # before any work
    # A different model or config, no complete checkpoint: refused here; another world size: a universal checkpoint.
    resume = find_resume_point(out_dir, config_to_dict(cfg), world_size) if cfg.resume else None
    start_step = resume.step if resume else 0
    ds_config = resolve_ds_config(cfg, world_size)  # bad preset or DeepSpeed key: refused before any work
    data = load_data(cfg, world_size)  # empty folder, corrupt image, too few images: refused here
    model = build_model(cfg, data)  # class-count or image-size mismatch with model=: refused here
    mark_universal(model)  # DeepSpeed wraps this module: its checkpoints can then resume on another world size

    load_config = with_universal_load(ds_config) if resume and resume.universal else ds_config
    setup_process(load_config, timeout=timedelta(seconds=cfg.collective_timeout_s))  # process-wide: printed once
    accelerator = Accelerator(**accelerator_kwargs(load_config, timeout=timedelta(seconds=cfg.collective_timeout_s)))
    rank, device = accelerator.process_index, accelerator.device
    if accelerator.is_main_process:
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(cfg, out_dir, ds_config, data, world_size, device.type)
        if resume:  # the other ranks wait below (a universal conversion counts against collective_timeout_s)
            prepare_resume(resume, config_to_dict(cfg))
    barrier()  # the process group's: accelerator.wait_for_everyone returns at once under FSDP2 on a CPU

    shard_model(model, ds_config)  # FSDP2 presets: each block, then the root (ZeRO: DeepSpeed's, in prepare)
    optimizer = make_optimizer(
        param_groups(model, cfg.weight_decay), ds_config, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999)
    )
    # Not prepared: a prepared scheduler steps once per *process* per optimizer step (Accelerate counts
    # single-process steps); this one counts optimizer steps, as Lightning's does, and is saved with the state.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    accelerator.register_for_checkpointing(scheduler)
    # The DataLoader is not prepared either: StepSampler already gives each rank its slice (exact on resume).
    engine, optimizer = accelerator.prepare(model, optimizer)
    state = AccelerateCheckpointIO(accelerator, ds_config, engine, optimizer, scheduler)  # save_state, or DCP
    if resume is not None:
        with param_groups_kept(optimizer):  # DeepSpeed's ZeRO-3 universal load flattens the groups' settings
            state.load(resume.load_path)  # the model's and optimizer's shards, the scheduler
    loader = train_loader(data, cfg, rank, world_size, start_step)
    net = accelerator.unwrap_model(engine)
    checkpointer = make_checkpointer(cfg, rank, world_size, state.barrier)
    checkpointer.install(engine)  # async_save: the backend's checkpoint files go through it

    metrics = MetricsLog(out_dir, enabled=accelerator.is_main_process)
    bar = tqdm(total=cfg.max_steps, initial=start_step, desc="train", disable=not accelerator.is_main_process)
    step, micro_losses, step_losses, step_norm = start_step, [], [], None
    engine.train()
    clock.skip()
    for pixels, labels in loader:
        pixels, labels = pixels.to(device), labels.to(device)
        seed_micro_batch(cfg, step * cfg.grad_accum + len(micro_losses), rank)  # stochastic depth, as in train.py
        with accelerator.accumulate(engine):
            loss = classification_loss(engine, pixels, labels, cfg.label_smoothing)  # bf16 pixels, fp32 loss
            accelerator.backward(loss)  # under DeepSpeed: backward, and the engine's step at the boundary
            if accelerator.sync_gradients:  # FSDP2 clips here and returns the norm; DeepSpeed, in its step (None)
                step_norm = gradient_norm(engine, ds_config, clip=True)
            optimizer.step()
            optimizer.zero_grad()
        micro_losses.append(loss.detach())
        if not accelerator.sync_gradients:  # inside a gradient-accumulation window
            continue
        scheduler.step()
        step += 1
        clock.step_done()
        step_losses.append(torch.stack(micro_losses).mean())
        micro_losses.clear()
        bar.update(1)
        if step % cfg.log_interval == 0 or step == cfg.max_steps:  # the only host sync of the loop's losses
            losses = all_reduce(torch.stack(step_losses)) / world_size
            last_norm = grad_norm(engine, step_norm)  # this step's, before clipping
            for offset, value in enumerate(losses.tolist()):  # one record per optimizer step
                at = step - len(losses) + 1 + offset
                norm = {"grad_norm": last_norm} if at == step else {}  # DeepSpeed keeps the last step's only
                metrics.log(at, train_loss=value, lr=step_lr(cfg, at), **norm)
            bar.set_postfix(loss=f"{value:.4f}")
            step_losses.clear()
        if step % cfg.eval_interval == 0 and step < cfg.max_steps:  # the last step is evaluated in finish()
            result = evaluate(net, data, cfg, rank, world_size, device)
            metrics.log(step, val_loss=result.val_loss, val_accuracy=result.val_accuracy, elapsed_s=clock.wall())
            bar.write(f"step {step}: val_accuracy {result.val_accuracy:.4f} ({clock.wall():.0f} s)")
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            # Every rank writes its shards into a temporary folder; rank 0 publishes it once all are done.
            checkpointer.save(step, state.save)
            metrics.log(step, checkpoint_blocked_s=checkpointer.blocked_s[-1])
        clock.skip()
    bar.close()
    checkpointer.finish()  # async_save: the last checkpoint written and published before the export

    summary = finish(
        cfg,
        ds_config,
        engine,
        net,
        data,
        rank,
        world_size,
        device,
        clock,
        metrics,
        backend="accelerate",
        steps=step,
        start_step=start_step,
        optimizer=optimizer,
    )
    if summary is not None:  # rank 0
        write_json_atomic(out_dir / "summary.json", summary.to_json())
        print(summary.headline(out_dir), flush=True)
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort a healthy run
    accelerator.end_training()  # the trackers; the process group is already gone


if __name__ == "__main__":
    main()
