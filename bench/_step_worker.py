"""One process group of the overhead benchmark: time optimizer steps of the NLP tiny model.

Launched by bench/overhead.py three ways on the same model, DeepSpeed config and data:
  raw        python -m torch.distributed.run --nproc_per_node 2 bench/_step_worker.py --backend raw ...
  lightning  python bench/_step_worker.py --backend lightning ...     (Lightning starts rank 1 itself)
  accelerate accelerate launch --config_file CFG bench/_step_worker.py --backend accelerate ...
Step time = wall time between the ends of consecutive optimizer steps (the whole loop: data, forward,
backward, step, framework hooks). Rank 0 writes OUT.json with the per-step times.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config
from nlp.model import build_llama_config, build_model_from_config

VOCAB, SEQ, MICRO_BATCH = 4096, 256, 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = build_llama_config("tiny", vocab_size=VOCAB, seq_len=SEQ)
    return build_model_from_config(config, attn_implementation="sdpa")


def make_data(n_batches: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (n_batches * MICRO_BATCH, SEQ), generator=g))


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def loader_for(rank: int, world: int, steps: int) -> torch.utils.data.DataLoader:
    data = make_data(steps * world)
    shard = torch.utils.data.Subset(data, list(range(rank, len(data), world)))
    return torch.utils.data.DataLoader(shard, batch_size=MICRO_BATCH)


def run_raw(args, ds_config) -> list[float]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_model()
    optimizer = make_optimizer(model.parameters(), ds_config, lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ends = [time.perf_counter()]
    for (ids,) in loader_for(rank, world, args.steps):
        loss = lm_loss(engine, ids)
        engine.backward(loss)
        engine.step()
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])] if rank == 0 else []


def run_accelerate(args, ds_config) -> list[float]:
    from accelerate import Accelerator

    from common.strategy import accelerator_kwargs

    accelerator = Accelerator(**accelerator_kwargs(ds_config))
    model = make_model()
    optimizer = make_optimizer(model.parameters(), ds_config, lr=1e-3)
    engine, optimizer = accelerator.prepare(model, optimizer)
    ends = [time.perf_counter()]
    for (ids,) in loader_for(accelerator.process_index, accelerator.num_processes, args.steps):
        loss = lm_loss(engine, ids)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])] if accelerator.is_main_process else []


def run_lightning(args, ds_config) -> list[float]:
    import lightning as L

    from common.strategy import lightning_trainer_kwargs

    ends: list[float] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()

        def training_step(self, batch, batch_idx):
            return lm_loss(self.model, batch[0])

        def on_train_batch_end(self, *unused) -> None:
            ends.append(time.perf_counter())

        def on_train_start(self) -> None:
            ends.append(time.perf_counter())

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), self.trainer.strategy.config, lr=1e-3)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **lightning_trainer_kwargs(ds_config),
    )
    rank = int(os.environ.get("LOCAL_RANK", 0))
    trainer.fit(Module(), loader_for(rank, 2, args.steps))
    return [b - a for a, b in zip(ends, ends[1:])] if trainer.is_global_zero else []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("raw", "lightning", "accelerate"), required=True)
    parser.add_argument("--preset", default="nlp")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    facts = RunFacts(world_size=2, micro_batch_size=MICRO_BATCH, precision="bf16", hidden_size=256)
    ds_config = resolve_deepspeed_config(args.preset, facts)
    runner = {"raw": run_raw, "lightning": run_lightning, "accelerate": run_accelerate}[args.backend]
    times = runner(args, ds_config)
    if times:
        Path(args.out).write_text(json.dumps({"backend": args.backend, "preset": args.preset, "step_times": times}))


if __name__ == "__main__":
    main()
