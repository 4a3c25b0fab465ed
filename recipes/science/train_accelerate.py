"""FNO on Burgers' equation or Darcy flow: BF16 + ZeRO-2 with round-robin gradients, as a plain Accelerate loop.

The same training as ``train.py`` (same config, data order, model, DeepSpeed dict), written as a loop.
``accelerate.yaml`` names ``ds_config.json``, the factory's output for the default config on 2
processes; the script resolves its own DeepSpeed dict from the config and the launcher's world size.

    # CPU, 2 processes (gloo), the tiny default
    accelerate launch --config_file recipes/science/accelerate.yaml recipes/science/train_accelerate.py
    # the paper's experiment on 8 GPUs
    accelerate launch --config_file recipes/science/accelerate.yaml --num_processes 8 \\
        recipes/science/train_accelerate.py --config recipes/science/configs/paper.yaml
    # multi-node: on each machine
    accelerate launch --config_file recipes/science/accelerate.yaml --num_machines 2 --machine_rank R \\
        --main_process_ip HOST --num_processes 16 recipes/science/train_accelerate.py
    # overrides as in train.py: key=value, resume=true, precision=fp32, data=my_pairs.npz
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from operator_learning import (  # next to this script: data, model, evaluation, run files, summary
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
from tqdm.auto import tqdm

from common.async_checkpoint import make_checkpointer
from common.config import config_to_dict, parse_recipe_args
from common.errors import exit_on_user_error
from common.metrics import Clock, all_reduce, barrier, grad_norm, main_process_first
from common.process_setup import end_process_group, setup_process
from common.resume import find_resume_point, mark_universal, param_groups_kept, prepare_resume, with_universal_load
from common.rundir import MetricsLog, prepare_run_dir, refuse_existing_out_dir, set_cpu_threads, write_json_atomic
from common.strategy import AccelerateCheckpointIO, accelerator_kwargs, gradient_norm, make_optimizer, shard_model
from science.burgers import DataError
from science.fno import relative_l2


@exit_on_user_error(DataError)
def main() -> None:
    cfg = parse_recipe_args(ScienceConfig, DEFAULT_CONFIG, describe=describe)
    clock = Clock()
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    out_dir, world_size = Path(cfg.out_dir), int(os.environ.get("WORLD_SIZE", 1))
    ds_config = resolve_ds_config(cfg, world_size)  # bad preset / DeepSpeed key / fp16: refused before any work
    if int(os.environ.get("RANK", 0)) == 0:
        refuse_existing_out_dir(out_dir, cfg.resume, cfg.overwrite)  # before any work
    # A different model or config, no complete checkpoint: refused here; another world size: a universal checkpoint.
    resume = find_resume_point(out_dir, config_to_dict(cfg), world_size) if cfg.resume else None
    start_step = resume.step if resume else 0
    load_config = with_universal_load(ds_config) if resume and resume.universal else ds_config
    setup_process(load_config, timeout=timedelta(seconds=cfg.collective_timeout_s))  # process-wide: printed once
    accelerator = Accelerator(**accelerator_kwargs(load_config, timeout=timedelta(seconds=cfg.collective_timeout_s)))
    rank, main_process = accelerator.process_index, accelerator.is_main_process

    # The main process generates (and caches) the data first; the others then read the cache. Over the process group:
    # accelerator.main_process_first lets every rank in at once under FSDP2 on a CPU (common.metrics.barrier).
    with main_process_first(main_process):
        data = load_data(cfg, workers=cfg.data_workers if main_process else 1)
        superres = None
        if cfg.data == "burgers" and cfg.superres_factor > 1:  # the same test samples, 4x finer
            superres = load_data(cfg, grid_size=cfg.grid_size * cfg.superres_factor)
    if main_process:
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(out_dir, cfg, ds_config, world_size)
        if resume:  # the other ranks wait below (a universal conversion counts against collective_timeout_s)
            prepare_resume(resume, config_to_dict(cfg))
    barrier()  # the process group's, for the same reason
    data = data.to(accelerator.device)  # fp32: DeepSpeed bf16 casts the model, not the data
    x_train, y_train = data.x_train, data.y_train

    net = build_model(cfg, data.scaling())
    mark_universal(net)  # DeepSpeed wraps this module: its checkpoints can then resume on another world size
    betas = (0.9, 0.999)  # the paper's Adam
    shard_model(net, ds_config)  # FSDP2 presets: each block, then the root (ZeRO: DeepSpeed's, in prepare)
    optimizer = make_optimizer(net.parameters(), ds_config, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=betas)
    # Not prepared: a prepared scheduler steps once per *process* per optimizer step (Accelerate counts
    # single-process steps); this one counts optimizer steps, as Lightning's does, and is saved with the state.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    accelerator.register_for_checkpointing(scheduler)
    # The DataLoader is not prepared either: StepSampler already gives each rank its slice (exact on resume).
    model, optimizer = accelerator.prepare(net, optimizer)
    state = AccelerateCheckpointIO(accelerator, ds_config, model, optimizer, scheduler)  # save_state, or DCP
    checkpointer = make_checkpointer(cfg, rank, world_size, state.barrier)
    checkpointer.install(model)  # async_save: the backend's checkpoint files go through it
    if resume is not None:
        with param_groups_kept(optimizer):  # DeepSpeed's ZeRO-3 universal load flattens the groups' settings
            state.load(resume.load_path)  # the model's and optimizer's shards, the scheduler (DeepSpeed: RNG too)
    loader = train_loader(len(x_train), cfg, rank, world_size, start_step)

    metrics = MetricsLog(out_dir, enabled=main_process)
    if start_step == 0:  # the untrained model's error: where the curve starts
        metrics.log(0, val_rel_l2=evaluate(model, data.x_test, data.y_test, rank, world_size))
    bar = tqdm(total=cfg.max_steps, initial=start_step, desc="train", disable=not main_process)
    step, losses, step_lr, step_norm = start_step, [], 0.0, None
    model.train()
    for idx in loader:
        idx = idx.to(accelerator.device)
        with accelerator.accumulate(model):
            step_lr = optimizer.param_groups[0]["lr"]  # the lr this step's update uses
            loss = relative_l2(model(x_train[idx]), y_train[idx])
            accelerator.backward(loss)  # under DeepSpeed: backward, and the engine's step at the boundary
            if accelerator.sync_gradients:  # FSDP2 clips here and returns the norm; DeepSpeed, in its step (None)
                step_norm = gradient_norm(model, ds_config, clip=True)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
        if not accelerator.sync_gradients:  # inside a gradient-accumulation window
            continue
        scheduler.step()
        step += 1
        clock.step_done()
        bar.update(1)
        if step % cfg.log_interval == 0 or step == cfg.max_steps:  # the only host sync of the loop's losses
            # common.metrics.all_reduce, not accelerator.reduce: under FSDP2 on a CPU Accelerate runs in its distributed
            # type NO, where reduce returns this rank's value.
            mean_loss = all_reduce(torch.stack(losses).mean()).item() / world_size
            norm = grad_norm(model, step_norm)  # this step's, before clipping
            metrics.log(step, train_rel_l2=mean_loss, lr=step_lr, grad_norm=norm)
            bar.set_postfix(rel_l2=f"{mean_loss:.4f}")
            losses.clear()
        if step % cfg.eval_interval == 0 and step < cfg.max_steps:  # the last step is evaluated in finish()
            error = evaluate(model, data.x_test, data.y_test, rank, world_size)
            metrics.log(step, val_rel_l2=error)
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
        model,
        accelerator.unwrap_model(model),
        data,
        superres,
        rank,
        world_size,
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
