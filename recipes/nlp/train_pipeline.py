"""Causal LM (Llama) split into pipeline stages with DeepSpeed's pipeline engine: the NLP recipe's third entry point.

Launch, from the repository root (any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT):

    torchrun --nproc_per_node 2 recipes/nlp/train_pipeline.py pipeline_parallel=2 preset=deepspeed_stage_1  # CPU
    torchrun --nproc_per_node 4 recipes/nlp/train_pipeline.py pipeline_parallel=2 preset=deepspeed_stage_1 \\
        pipeline_micro_batches=4                                                        # 2 stages x 2 replicas
    deepspeed --no_local_rank --num_gpus 8 recipes/nlp/train_pipeline.py --config recipes/nlp/configs/llama_1b.yaml \\
        pipeline_parallel=2 preset=deepspeed_stage_1 grad_accum=1 pipeline_micro_batches=16 \\
        activation_checkpointing=full                                                   # 8 GPUs: 2 stages x 4
    python recipes/nlp/train_pipeline.py preset=deepspeed_stage_1                       # one process, one stage

Lightning and Accelerate drive a plain DeepSpeed engine, so pipeline parallelism has a loop of its own: the same
Llama (``build_model``, so the same initial weights) is cut into a list of layers (embedding, decoder layers, final
norm + output layer), ``deepspeed.pipe.PipelineModule`` gives each stage its share of the decoder layers
(embedding on the first stage, output layer and loss on the last), and ``engine.train_batch()`` runs one optimizer
step of ``pipeline_micro_batches`` micro-batches through the 1F1B schedule. World size = pipeline_parallel x data
parallel, and pipeline_parallel divides the decoder layers (stages of equal depth: llama_1b's 22 take 2 or 11); every
data-parallel replica reads its own shard (the layout's ``data_parallel_rank``, nlp_layout.py). DeepSpeed refuses
ZeRO-2 and ZeRO-3 with its pipeline engine: use ``preset=deepspeed_stage_1`` (or stage 0).
``activation_checkpointing=full`` (or ``every_k``) becomes PipelineModule's ``activation_checkpoint_interval`` 1 (2).

Keys, run directory and ``summary.json`` are those of train.py; ``summary.json`` adds ``pipeline`` (stages,
micro-batches, the parameter bytes each rank holds). checkpoints/ hold DeepSpeed's pipeline files
(``layer_XX-model_states.pt``); ``final/`` is the whole model in Hugging Face format, gathered from the stages and
checked against the pipeline's own logits. ``resume=true`` continues from checkpoints/latest with the same stages
and data-parallel size (a universal conversion of pipeline checkpoints is not supported here).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from nlp_config import DEFAULT_CONFIG, NLPConfig  # next to this script
from nlp_layout import (  # next to this script: the run's layout, what crosses the pipeline's stages
    PIPELINE_CHECKPOINT_INTERVAL,
    evaluate_pipeline,
    gather_pipeline_state_dict,
    measured_text,
    memory_plan,
    micro_batches,
    pipeline_logits,
    resume_point,
    run_layout,
    tokens_per_rank_step,
)
from pretraining import (  # next to this script: data, model, loss, evaluation, run files, summary
    RunRecord,
    build_model,
    describe,
    eval_batches,
    final_export,
    hidden_size,
    load_data,
    lr_lambda,
    model_config,
    param_groups,
    resolve_ds_config,
    summarize,
    tokenizer_source,
    train_loader,
    write_run_files,
)
from tqdm.auto import tqdm

from common.accounting import model_state_bytes
from common.async_checkpoint import make_checkpointer
from common.config import config_to_dict, parse_recipe_args
from common.errors import ConfigError, exit_on_user_error
from common.metrics import Clock, all_reduce, peak_memory_bytes
from common.parallel import check_mesh
from common.presets import is_fsdp2_name
from common.process_setup import end_process_group, setup_process
from common.resume import prepare_resume
from common.rundir import MetricsLog, prepare_run_dir, refuse_existing_out_dir, set_cpu_threads, write_json_atomic
from common.strategy import make_optimizer, torch_dtype
from nlp.data import DataError
from nlp.model import ModelError, build_model_from_config, resolve_attention

warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


# --- the model as a list of layers: each takes and returns one tensor --------------------------------------------


class Embedding(torch.nn.Module):
    """First stage: token ids -> hidden states."""

    def __init__(self, embed_tokens: torch.nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"model.embed_tokens.{k}": v for k, v in self.embed_tokens.state_dict().items()}


class DecoderLayer(torch.nn.Module):
    """One transformers decoder layer; RoPE's cos/sin are recomputed on each stage (no parameters, a few flops)."""

    def __init__(self, layer: torch.nn.Module, rotary_emb: torch.nn.Module, index: int, causal_mask: bool) -> None:
        super().__init__()
        self.layer, self.rotary_emb, self.index = layer, rotary_emb, index
        self.causal_mask = causal_mask  # eager attention needs the mask; sdpa and FlashAttention are causal without

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = None
        if self.causal_mask:
            mask = torch.full((hidden.shape[1],) * 2, torch.finfo(hidden.dtype).min, device=hidden.device)
            mask = mask.triu(1)[None, None]
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.layer(
            hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings
        )

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"model.layers.{self.index}.{k}": v for k, v in self.layer.state_dict().items()}


class OutputLayer(torch.nn.Module):
    """Last stage: final norm and output matrix -> logits (the loss is PipelineModule's ``loss_fn``)."""

    def __init__(self, norm: torch.nn.Module, lm_head: torch.nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"model.norm.{k}": v for k, v in self.norm.state_dict().items()}
        return state | {f"lm_head.{k}": v for k, v in self.lm_head.state_dict().items()}


def pipeline_layers(model: Any, attention: str) -> list[torch.nn.Module]:
    """The causal LM as the sequence PipelineModule cuts into stages (the same modules, so the same weights)."""
    inner = model.model
    blocks = [DecoderLayer(layer, inner.rotary_emb, i, attention == "eager") for i, layer in enumerate(inner.layers)]
    return [Embedding(inner.embed_tokens), *blocks, OutputLayer(inner.norm, model.lm_head)]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``pretraining.lm_loss``'s next-token cross entropy, in fp32, on the logits the last stage computed."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


@exit_on_user_error(DataError, ModelError)
def main() -> None:
    cfg = parse_recipe_args(NLPConfig, DEFAULT_CONFIG, describe=functools.partial(describe, pipeline_engine=True))
    clock = Clock()
    out_dir = Path(cfg.out_dir)
    # torchrun, deepspeed and accelerate launch set these; a bare `python` run is one process.
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a port nobody listens on: two one-process runs may share the machine
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    refuse_existing_out_dir(out_dir, cfg.resume, cfg.overwrite)
    if is_fsdp2_name(cfg.preset):  # train.py and train_accelerate.py run it; this script is DeepSpeed's engine
        raise ConfigError(
            f"train_pipeline.py runs DeepSpeed's pipeline engine, not preset={cfg.preset} (FSDP2): use "
            "preset=deepspeed_stage_1, or recipes/nlp/train.py for FSDP2"
        )
    ds_config = resolve_ds_config(cfg, world_size, hidden_size(cfg))
    # Stages x data-parallel replicas, refused here if bad (ZeRO 2-3, more stages than layers, ...).
    layout = run_layout(cfg, world_size, model_config(cfg, tokenizer=None), ds_config, pipeline_engine=True)
    # A different model or config (pipeline_parallel too), no complete checkpoint, another data-parallel size: refused.
    resume = resume_point(cfg, layout, pipeline_engine=True)
    start_step = resume.step if resume else 0
    on_gpu = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if on_gpu else "cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    setup_process(ds_config, timeout=timedelta(seconds=cfg.collective_timeout_s))  # process-wide: printed once
    deepspeed.init_distributed(
        dist_backend="nccl" if on_gpu else "gloo", timeout=timedelta(seconds=cfg.collective_timeout_s)
    )
    main_process = rank == 0

    # --- data: rank 0 trains the tokenizer and writes the run files, the other ranks then load them ---
    trained_tokenizer = tokenizer_source(cfg, trained_here=False) is None
    if main_process:
        data = load_data(cfg, tokenizer_source(cfg, trained_here=cfg.resume), world_size)
        prepare_run_dir(out_dir, overwrite=cfg.overwrite, resume=cfg.resume)
        write_run_files(cfg, out_dir, ds_config, data, world_size, device.type, trained_tokenizer and not cfg.resume)
        print(f"data: {data.info()}", flush=True)
        if resume:
            prepare_resume(resume, config_to_dict(cfg))
    dist.barrier()
    if not main_process:
        data = load_data(cfg, tokenizer_source(cfg, trained_here=True), world_size)

    # --- model: the recipe's Llama (same seed, same weights), cut into stages; each rank keeps its stage's layers ---
    config = model_config(cfg, data.tokenizer)
    attention = resolve_attention(cfg.attention, device.type, torch_dtype(cfg.precision))
    # Without transformers-level checkpointing: PipelineModule checkpoints its layers itself.
    model = build_model(dataclasses.replace(cfg, activation_checkpointing="none"), config, attention)
    run = RunRecord(cfg, ds_config, layout, config, attention, "deepspeed_pipeline", clock, steps=cfg.max_steps)
    run.plan = memory_plan(model, ds_config, layout)
    pipe = deepspeed.pipe.PipelineModule(
        layers=pipeline_layers(model, attention),
        num_stages=cfg.pipeline_parallel,
        loss_fn=loss_fn,
        partition_method="type:DecoderLayer",  # the same number of decoder layers on each stage
        activation_checkpoint_interval=PIPELINE_CHECKPOINT_INTERVAL[cfg.activation_checkpointing],
        # Only runs of decoder layers: a checkpointed embedding gets token ids, which need no gradient, and DeepSpeed's
        # (reentrant) checkpoint then returns activations without one ("loss must be a scalar tensor" in backward).
        checkpointable_layers=["DecoderLayer"],
    )
    held = run.held_at_construction = sum(p.numel() for p in pipe.parameters())
    del model  # the other stages' layers are freed with it
    if main_process:
        print(run.plan.text())
        print(f"after construction rank 0 holds {held:,} of {run.plan.num_params:,} parameter elements", flush=True)
    optimizer = make_optimizer(param_groups(pipe, cfg), ds_config, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, _, _, _ = deepspeed.initialize(model=pipe, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    check_mesh(layout, rank, engine)  # the grid's stages and replicas are those the layout's rank map assumed
    checkpointer = make_checkpointer(cfg, rank, world_size, dist.barrier)
    checkpointer.install(engine)
    if resume:  # each rank its stage's layers and optimizer shard; the scheduler is in the engine's files
        engine.load_checkpoint(str(resume.load_path))

    replica, replicas = layout.data_parallel_rank(rank), layout.data_parallel  # every stage reads its replica's
    batches = micro_batches(train_loader(data, cfg, replica, replicas, start_step))  # grad_accum a train_batch()
    val_batches = eval_batches(data, cfg, replica, replicas)
    log = MetricsLog(out_dir, enabled=main_process)
    bar = tqdm(total=cfg.max_steps, initial=start_step, desc="train", disable=not main_process, dynamic_ncols=True)

    def run_eval(step: int) -> float:
        loss = evaluate_pipeline(engine, val_batches, cfg.micro_batch_size)
        log.log(step, val_loss=loss, elapsed_s=clock.wall())
        if main_process:
            bar.write(f"step {step}: val_loss {loss:.4f} ({clock.wall():.0f} s)")
        return loss

    # --- training: one train_batch() = one optimizer step over grad_accum micro-batches in flight ---
    tokens_per_step = tokens_per_rank_step(cfg, layout)  # per device
    if start_step == 0:
        run.val_loss = run_eval(0)
    clock.skip()
    for step in range(start_step + 1, cfg.max_steps + 1):
        loss = engine.train_batch(data_iter=batches)  # the mean over micro-batches and replicas, on every stage
        clock.step_done()
        bar.update(1)
        if step == start_step + 1:
            run.model_states = model_state_bytes(engine)
            if main_process:
                bar.write(measured_text(run.model_states))
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            log.log(
                step,
                train_loss=loss.item(),
                lr=cfg.lr * lr_lambda(cfg)(step - 1),
                tokens_per_s_per_device=tokens_per_step / clock.median_step(),
                elapsed_s=clock.wall(),
            )
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            run.val_loss = run_eval(step)
        if step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            # Every rank writes its stage's layers and optimizer shard; rank 0 publishes the folder.
            checkpointer.save(step, lambda folder: engine.save_checkpoint(str(folder)))
            log.log(step, checkpoint_blocked_s=checkpointer.blocked_s[-1])
        clock.skip()
    bar.close()
    checkpointer.finish()

    # --- export: the pipeline's logits on a fixed batch and the stages' weights on rank 0, then final/ ---
    fixed = data.val.blocks[: cfg.micro_batch_size]  # one micro-batch: the engine's buffers have that shape
    logits = pipeline_logits(engine, fixed, device)
    state = gather_pipeline_state_dict(engine, rank)
    params_bytes = torch.zeros(world_size, dtype=torch.float64)
    params_bytes[rank] = run.model_states.get("params", 0)
    all_reduce(params_bytes)
    peak = int(all_reduce(torch.tensor(float(peak_memory_bytes()), device=device), "max").item())
    if main_process:
        skeleton = build_model_from_config(config, attn_implementation=attention)  # what save_pretrained fills
        export_check, sample = final_export(run, skeleton, state, data.tokenizer, fixed, logits, device)
        pipeline = {
            "stages": layout.pipeline,
            "data_parallel": layout.data_parallel,
            "micro_batches": cfg.grad_accum,
            "activation_checkpoint_interval": PIPELINE_CHECKPOINT_INTERVAL[cfg.activation_checkpointing],
            "params_bytes_per_rank": [int(b) for b in params_bytes.tolist()],
        }
        summary = summarize(run, data, peak, export_check, sample, pipeline)
        write_json_atomic(out_dir / "summary.json", summary.to_json())
        print(summary.headline(out_dir), flush=True)
    log.close()
    dist.barrier()
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort a healthy run


if __name__ == "__main__":
    main()
