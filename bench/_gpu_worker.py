"""One variant of bench/gpu.py in one process: the NLP recipe's model and DeepSpeed config, timed steps.

Under an FSDP2 preset (``fsdp2``, ``fsdp2_grad_op``) the same model is sharded the recipe's way instead
(``common.strategy.shard_model``) and trained by a plain loop (backward, the recipe's clipping, the optimizer step):
the ZeRO stage's peer, measured the same way.

    python -m torch.distributed.run --nproc_per_node 1 bench/_gpu_worker.py --variant '{"name": ...}' --out OUT.json

Uses the recipe's own setup functions (recipes/nlp/pretraining.py): the config file and overrides, the
model built by ``build_model`` (activation checkpointing and tiling applied the recipe's way), the DeepSpeed
dict from ``resolve_ds_config``, the loss ``lm_loss`` and the checkpoint offload around each forward and
backward pass; tokens are random (throughput does not depend on them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes" / "nlp"))

from nlp_config import NLPConfig  # noqa: E402
from pretraining import build_model, hidden_size, lm_loss, model_config, resolve_ds_config  # noqa: E402

from common import sequence_parallel  # noqa: E402
from common.activation import checkpoint_offload  # noqa: E402
from common.config import load_config  # noqa: E402
from common.metrics import gpu_peak_flops, median, mfu, peak_memory_bytes  # noqa: E402
from common.process_setup import end_process_group  # noqa: E402
from nlp.model import flops_per_token, resolve_attention  # noqa: E402

# Tests only: the variant so named sleeps inside its process group instead of training (a hang, on a CPU), beside a
# child process of its own, so that tests/recipes/test_gpu_bench_limits.py can watch bench/gpu.py kill it with every
# process of its launch.
HANG_ENV = "ZERO_RECIPES_TEST_GPU_BENCH_HANG"


def main() -> None:
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True, help="JSON: name, config, overrides, steps, warmup")
    parser.add_argument("--out", required=True)
    variant = json.loads(parser.parse_args().variant)
    out = Path(parser.parse_args().out)
    on_gpu = torch.cuda.is_available()
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    if os.environ.get(HANG_ENV) == variant["name"]:  # with a child of its own, as a worker's compile or loader has
        subprocess.Popen(["sleep", "3600"])
        print(f"{variant['name']}: hanging ({HANG_ENV})", flush=True)
        time.sleep(3600)
    cfg = load_config(NLPConfig, variant["config"], variant["overrides"])
    config = model_config(cfg, tokenizer=None)
    attention = resolve_attention(cfg.attention, device.type, torch.bfloat16)
    ds_config = resolve_ds_config(cfg, world_size=world_size, hidden_size=hidden_size(cfg))
    with torch.device(device):  # create the weights where they train: a 1B model initialises in seconds on a GPU
        model = build_model(cfg, config, attention)
    from common.strategy import gradient_norm, is_fsdp2, make_optimizer, shard_model

    # Sequence parallel (2 processes): Ulysses and its groups, the recipe's loss (common/sequence_parallel.py).
    mpu = None
    if cfg.sequence_parallel > 1:
        mpu = sequence_parallel.register(model, cfg.sequence_parallel, cfg.micro_batch_size, attention)
        ds_config.pop("train_batch_size", None)  # DeepSpeed derives it over the data-parallel ranks (world / N)
    fsdp2 = is_fsdp2(ds_config)
    shard_model(model, ds_config)  # FSDP2 presets only (ZeRO: DeepSpeed's, in initialize)
    optimizer = make_optimizer(model.parameters(), ds_config, lr=cfg.lr)
    if fsdp2:
        engine, stage = model, cfg.preset
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=mpu)
        stage = ds_config["zero_optimization"]["stage"]
    sp = None if fsdp2 else sequence_parallel.this_rank(cfg.sequence_parallel, stage)
    tiled = cfg.tiled_loss_shards > 1
    generator = torch.Generator().manual_seed(0)
    shape = (cfg.micro_batch_size, cfg.seq_len)
    ends = [time.perf_counter()]
    offload = checkpoint_offload() if cfg.offload_checkpoints else contextlib.nullcontext()
    for _ in range(variant["steps"]):
        ids = torch.randint(0, config.vocab_size, shape, generator=generator).to(device)
        with offload:  # around the forward and the backward pass, as in the recipe
            labels = torch.roll(ids, -1, dims=1)
            if sp is None:
                loss = lm_loss(engine, ids, labels, tiled=tiled)
            else:  # the same sequences on every rank (one seed), each its slice
                loss, _ = sequence_parallel.lm_loss(engine, ids, labels, sp, tiled)
            if fsdp2:
                loss.backward()
            else:
                engine.backward(loss)
        if fsdp2:  # the recipe's loop: clip (DeepSpeed's engine clips inside its step), step, free the gradients
            gradient_norm(model, ds_config, clip=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            engine.step()
        if on_gpu:
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    step_s = median([b - a for a, b in zip(ends, ends[1:])][variant["warmup"] :])
    # Per device: a sequence-parallel group of N devices trains one batch, each device 1/N of its tokens.
    tokens_per_s = cfg.micro_batch_size * cfg.seq_len / cfg.sequence_parallel / step_s
    peak_flops = gpu_peak_flops()
    result = {
        **variant,
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "attention_used": attention,
        "activation_checkpointing": cfg.activation_checkpointing,
        "stage": stage,
        "num_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
        "median_step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, flops_per_token(config, cfg.seq_len), peak_flops),
        "peak_memory_bytes": peak_memory_bytes(),
        "memory_kind": "gpu_max_allocated" if on_gpu else "cpu_peak_rss",
        "final_loss": float(loss.detach().float()),
        "checkpoint_offload_bytes": offload.stats.offloaded_bytes if cfg.offload_checkpoints else None,
    }
    if rank == 0:  # peak memory: rank 0's (every rank holds the same share)
        out.write_text(json.dumps(result))
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort


if __name__ == "__main__":
    main()
