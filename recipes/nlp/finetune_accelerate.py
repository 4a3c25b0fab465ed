"""LoRA fine-tuning of a causal LM under ZeRO-3 as a plain Accelerate loop: the same run as finetune.py.

Launch, from the repository root:

    python recipes/nlp/train.py        # once: the default base model, runs/nlp/final
    accelerate launch --config_file recipes/nlp/accelerate_finetune.yaml recipes/nlp/finetune_accelerate.py  # CPU
    accelerate launch --config_file recipes/nlp/accelerate_finetune.yaml --num_processes 8 \\
        recipes/nlp/finetune_accelerate.py model=path/to/hf_folder data=my_data.jsonl                       # 8 GPUs
    # multi-node: add --num_machines N --machine_rank R --main_process_ip HOST on every node

``accelerate_finetune.yaml`` + ``ds_config_finetune.json`` are the factory's output for the default config on 2
processes; the script builds its DeepSpeed plugin from the same factory, so a changed ``micro_batch_size`` or
``preset`` needs no edit of either file. Keys, run directory and ``summary.json`` are those of finetune.py.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from finetune_config import (
    DTYPES,
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
from tqdm.auto import tqdm

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
from common.strategy import accelerator_kwargs, make_optimizer
from nlp.data import DataError
from nlp.lora import folder_bytes, trainable_parameter_shapes
from nlp.model import ModelError
from nlp.task import collate_sft, encode_examples, majority_baseline

warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


def save_checkpoint(accelerator: Accelerator, out_dir: Path, step: int) -> None:
    """Every rank writes its shards (adapters and their optimizer state, no frozen weights); rank 0 publishes."""
    accelerator.save_state(str(tmp_checkpoint_dir(out_dir, step)), exclude_frozen_parameters=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        publish_checkpoint(out_dir, step)
    accelerator.wait_for_everyone()


@exit_on_user_error(DataError, ModelError)
def main() -> None:
    cfg = parse_args()
    require_base_model(cfg)
    clock = Clock()
    out_dir = Path(cfg.out_dir)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if is_launcher_rank_zero():  # rank 0 creates out_dir below, before the ranks meet: only it may judge it
        check_out_dir(cfg)
    on_gpu = torch.cuda.is_available()

    # --- checks, data and the base model's score: before any process group, rank 0 writes and scores alone ---
    tokenizer = load_tokenizer(cfg)
    train, val = load_examples(cfg)
    config = model_config(cfg, tokenizer)
    module_names = base_module_names(cfg, config)
    attention = resolve_attention_or_exit(cfg, "cuda" if on_gpu else "cpu")
    ds_config = resolve_ds_config(cfg, world_size, config.hidden_size)
    base_val_accuracy = None
    if is_launcher_rank_zero():
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(cfg, out_dir, ds_config, world_size, "gpu" if on_gpu else "cpu")
        print(f"data: {len(train)} train / {len(val)} held-out examples ({cfg.data}); attention: {attention}")
        base_val_accuracy = score(load_plain(cfg, attention), tokenizer, val, cfg)
        print(f"base model exact match on the held-out set: {base_val_accuracy:.3f}", flush=True)

    # --- DeepSpeed through Accelerate; ZeRO-3's partitioned construction is on from here ---
    accelerator = Accelerator(**accelerator_kwargs(ds_config))
    rank, device, main_process = accelerator.process_index, accelerator.device, accelerator.is_main_process
    model = build_lora_model(cfg, config, attention, module_names)
    optimizer = make_optimizer(
        lora_param_groups(model, cfg.weight_decay), ds_config, lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))  # stepped once per optimizer step
    engine, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    start_step = 0
    if cfg.resume:
        latest = latest_checkpoint(out_dir)
        if latest is None:
            raise ConfigError(f"resume=true but {out_dir}/{CHECKPOINTS} holds no complete checkpoint")
        accelerator.load_state(str(latest), load_module_strict=False)  # the frozen base comes from model=
        start_step = checkpoint_step(latest)
        accelerator.print(f"resumed from {latest} (step {start_step})")
    pad_id = tokenizer.pad_token_id
    loader = sft_loader(
        encode_examples(train, tokenizer, cfg.seq_len), cfg, pad_id, rank, world_size, start_step, False
    )
    val_encoded = encode_examples(val, tokenizer, cfg.seq_len)
    held_out = val_batches(val_encoded, cfg, pad_id, rank, world_size)
    log = MetricsLog(out_dir, enabled=main_process)
    facts: dict = {}
    bar = tqdm(total=cfg.max_steps, initial=start_step, desc="train", disable=not main_process, dynamic_ncols=True)

    def run_eval(step: int) -> None:
        facts["val_loss"] = evaluate(engine, held_out, device)
        log.log(step, val_loss=facts["val_loss"], elapsed_s=clock.wall())
        if main_process:
            bar.write(f"step {step}: val_loss {facts['val_loss']:.4f} ({clock.wall():.0f} s)")

    # --- training ---
    if start_step == 0:
        run_eval(0)
    engine.train()
    step, losses = start_step, []
    clock.skip()
    for batch in loader:
        with accelerator.accumulate(engine):
            loss = sft_loss(engine, batch, device)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
        if len(losses) < cfg.grad_accum:
            continue
        scheduler.step()
        step += 1
        clock.step_done()
        step_loss = torch.stack(losses).mean()  # a tensor: reading it would wait for the device
        losses.clear()
        bar.update(1)
        if step == start_step + 1:
            facts["model_state_bytes"] = model_state_bytes(engine)
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            # Only on logging steps: the all-reduce and .item() are a collective and a host sync.
            mean_loss = all_reduce(step_loss).item() / world_size
            bar.set_postfix(loss=f"{mean_loss:.3f}")
            log.log(step, train_loss=mean_loss, lr=cfg.lr * lr_lambda(cfg)(step - 1), elapsed_s=clock.wall())
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            run_eval(step)
            engine.train()
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            save_checkpoint(accelerator, out_dir, step)
        clock.skip()
    bar.close()

    # --- export: logits on a fixed batch and whole weights (collective), then adapter/, merged/ on rank 0 ---
    fixed = collate_sft(val_encoded[:4], pad_id)
    engine.eval()
    with torch.no_grad():
        logits = engine(
            input_ids=fixed["input_ids"].to(device), attention_mask=fixed["attention_mask"].to(device), use_cache=False
        ).logits.float()
    shapes = trainable_parameter_shapes(engine.module)
    trainable, total = count_params(engine.module)
    state = gather_full_state_dict(engine.module, rank)
    peak = int(all_reduce(torch.tensor(float(peak_memory_bytes()), device=device), "max").item())
    if main_process:
        exported = final_export(
            engine.module, state, shapes, tokenizer, out_dir, fixed, logits.cpu(), val, cfg, attention,
            DTYPES[cfg.precision],
        )  # fmt: skip
        measured = facts.get("model_state_bytes", {})
        checkpoint_bytes = folder_bytes([latest_checkpoint(out_dir)])
        result = summary(
            cfg,
            ds_config,
            val_loss=facts["val_loss"],
            initial_val_loss=initial_val_loss(out_dir),
            throughput=throughput(cfg.micro_batch_size * cfg.grad_accum / clock.median_step(), "samples/s/device"),
            mfu=None,
            peak_memory_bytes=peak,
            model_state_bytes_per_rank=measured.get("model_states"),
            wall_time_s=round(clock.wall(), 1),
            world_size=world_size,
            attention=attention,
            backend="accelerate",
            steps=step,
            trainable_params=trainable,
            total_params=total,
            checkpoint_bytes=checkpoint_bytes,
            checkpoint_fraction_of_full=checkpoint_bytes / (14 * total),  # full: 2 B weights + 12 B Adam state each
            base_val_accuracy=base_val_accuracy,
            majority_baseline_accuracy=majority_baseline(val),
            accuracy_gain=exported["val_accuracy"] - max(base_val_accuracy, majority_baseline(val)),
            activation_checkpointing=cfg.activation_checkpointing,
            model_state_bytes_measured=measured,
            **exported,
        )
        write_json_atomic(out_dir / "summary.json", result)
        print(
            f"exact match {result['val_accuracy']:.3f} (base {base_val_accuracy:.3f}, majority answer "
            f"{result['majority_baseline_accuracy']:.3f}); val_loss {result['val_loss']:.4f}; "
            f"{trainable:,} trainable of {total:,}; wall {result['wall_time_s']:.0f} s; run directory {out_dir}"
        )
    log.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
