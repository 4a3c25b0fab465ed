"""SGD with gradient accumulation through every front-end, in one 2-process job; rank 0 writes what each run did.

    torchrun --nproc_per_node 2 tests/distributed/grad_accum_worker.py --out OUT

One process group runs, one after the other, for each gradient accumulation in ``--grad-accum`` and each ZeRO stage
in ``--stages``: Lightning (``common.strategy.lightning_trainer_kwargs``), Accelerate
(``common.strategy.accelerator_kwargs``), and for stages 0-1 DeepSpeed's pipeline engine (``engine.train_batch()``,
the loop ``recipes/nlp/train_pipeline.py`` drives; one stage per data-parallel rank), each with a fresh model loaded
from one saved initial state (``OUT/init.safetensors``, which also holds the data). The optimizer is plain SGD,
whose step scales with the gradient, and DeepSpeed clips at 2.0: a gradient off by the accumulation factor changes
the trajectory. Every run
of step ``s`` reads the same global batch (samples ``s * G .. s * G + G - 1``, ``G`` = micro-batch x ranks x
accumulation), rank ``r``'s micro-batch ``m`` being its ``m * ranks + r``-th slice of ``micro_batch_size``.
``OUT/runs.json`` holds, per run, the global batch's mean loss at each step (before its update), the gradient norm
DeepSpeed computed before clipping, and the engine's micro-step and step counters at the end; the test compares
them with a single-process reference that averages each global batch by hand, clips and steps.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from worker_util import quiet_cpu_trainer, run_then_exit

from common.config import parse_overrides
from common.strategy import RunFacts, accelerator_kwargs, lightning_trainer_kwargs, resolve_deepspeed_config

STAGE_PRESETS = {0: "ddp", 1: "deepspeed_stage_1", 2: "deepspeed_stage_2", 3: "deepspeed_stage_3"}
WIDTH = 64
INPUTS = 16
SAMPLES = 256
LR = 0.2
CLIPPING = 2.0  # the reference's norms run 0.9-2.4: clipping acts on some steps and not on others
# SGD is not one of the optimizers DeepSpeed's ZeRO lists as partition-tested; it partitions it all the same.
OVERRIDES = ["zero_allow_untested_optimizer=true"]


def make_net() -> torch.nn.Sequential:
    """A 3-layer MLP as a flat Sequential: its children are also the pipeline's layers."""
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, 1),
    )


def make_init(path: Path) -> None:
    """The initial weights and the data set, in one file every run (and the test's reference) loads."""
    torch.manual_seed(0)
    net = make_net()
    x = torch.randn(SAMPLES, INPUTS)
    y = torch.sin(x[:, :3].sum(dim=1, keepdim=True)) + 0.1 * torch.randn(SAMPLES, 1)
    tensors = {f"net.{k}": v.contiguous() for k, v in net.state_dict().items()}
    save_file({**tensors, "data.x": x, "data.y": y}, str(path))


def load_init(path: Path) -> tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor]:
    """A fresh model holding the saved initial weights, and the data."""
    tensors = load_file(str(path))
    net = make_net()
    net.load_state_dict({k.removeprefix("net."): v for k, v in tensors.items() if k.startswith("net.")})
    return net, tensors["data.x"], tensors["data.y"]


def rank_indices(steps: int, grad_accum: int, micro_batch_size: int, rank: int, world_size: int) -> list[int]:
    """This rank's samples in order: micro-batch ``m`` of step ``s`` is slice ``m * world + rank`` of the step."""
    per_step = micro_batch_size * world_size * grad_accum
    indices = []
    for step in range(steps):
        for micro in range(grad_accum):
            start = step * per_step + (micro * world_size + rank) * micro_batch_size
            indices.extend(range(start, start + micro_batch_size))
    return indices


def ds_config(stage: int, world_size: int, micro_batch_size: int, grad_accum: int) -> dict:
    facts = RunFacts(
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        precision="fp32",
        hidden_size=WIDTH,
        gradient_clipping=CLIPPING,
    )
    return resolve_deepspeed_config(STAGE_PRESETS[stage], facts, parse_overrides(OVERRIDES))


def global_step_losses(micro_losses: list[torch.Tensor], grad_accum: int) -> list[float]:
    """Each step's mean loss over the global batch: every rank's micro-batch means (all the same size) averaged."""
    losses = torch.stack(micro_losses).double()
    torch.distributed.all_reduce(losses)
    losses /= torch.distributed.get_world_size()
    return losses.view(-1, grad_accum).mean(dim=1).tolist()


def norm_of(engine) -> float:
    norm = engine.get_global_grad_norm()
    return float("nan") if norm is None else float(norm)


def run_lightning(init: Path, stage: int, grad_accum: int, args) -> dict:
    import lightning as L

    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    net, x, y = load_init(init)
    indices = rank_indices(args.steps, grad_accum, args.micro_batch_size, rank, world_size)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=args.micro_batch_size, sampler=indices
    )

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.micro_losses: list[torch.Tensor] = []
            self.norms: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.micro_losses.append(loss.detach())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            if (batch_idx + 1) % grad_accum == 0:
                self.norms.append(norm_of(self.trainer.strategy.deepspeed_engine))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    module = Module()
    trainer = quiet_cpu_trainer(
        world_size,
        args.steps,
        use_distributed_sampler=False,
        **lightning_trainer_kwargs(ds_config(stage, world_size, args.micro_batch_size, grad_accum)),
    )
    trainer.fit(module, loader)
    engine = trainer.strategy.deepspeed_engine
    return {
        "losses": global_step_losses(module.micro_losses, grad_accum),
        "grad_norms": module.norms,
        "micro_steps": engine.micro_steps,
        "global_steps": engine.global_steps,
    }


def run_accelerate(init: Path, stage: int, grad_accum: int, args) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    accelerator = Accelerator(**accelerator_kwargs(ds_config(stage, world_size, args.micro_batch_size, grad_accum)))
    net, x, y = load_init(init)
    engine, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    indices = rank_indices(args.steps, grad_accum, args.micro_batch_size, rank, world_size)
    micro_losses, norms = [], []
    for micro, start in enumerate(range(0, len(indices), args.micro_batch_size), start=1):
        batch = indices[start : start + args.micro_batch_size]
        with accelerator.accumulate(engine):
            loss = torch.nn.functional.mse_loss(engine(x[batch]), y[batch])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        micro_losses.append(loss.detach())
        if micro % grad_accum == 0:
            norms.append(norm_of(engine))
    record = {
        "losses": global_step_losses(micro_losses, grad_accum),
        "grad_norms": norms,
        "micro_steps": engine.micro_steps,
        "global_steps": engine.global_steps,
    }
    AcceleratorState._reset_state()  # the next run builds its own Accelerator, with its own DeepSpeed plugin
    return record


def run_pipeline(init: Path, stage: int, grad_accum: int, args) -> dict:
    """DeepSpeed's pipeline engine, ``train_batch()`` pulling ``grad_accum`` micro-batches a step, one stage on each
    of the data-parallel ranks (the same data layout as the other front-ends). With 2 stages the fp32 stage-0
    engine clips each stage by a norm that is not the whole model's (seen here; not what this test is about)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    net, x, y = load_init(init)
    pipe = PipelineModule(layers=list(net), num_stages=1, loss_fn=torch.nn.functional.mse_loss)
    config = ds_config(stage, world_size, args.micro_batch_size, grad_accum)
    engine, _, _, _ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=LR), config=config
    )
    indices = rank_indices(args.steps, grad_accum, args.micro_batch_size, rank, world_size)
    size = args.micro_batch_size
    micro_batches = iter((x[indices[i : i + size]], y[indices[i : i + size]]) for i in range(0, len(indices), size))
    losses, norms = [], []
    for _ in range(args.steps):
        losses.append(
            float(engine.train_batch(data_iter=micro_batches))
        )  # the step's mean over micro-batches and ranks
        norms.append(norm_of(engine))
    return {
        "losses": losses,
        "grad_norms": norms,
        "micro_steps": engine.micro_steps,
        "global_steps": engine.global_steps,
    }


RUNNERS = {"lightning": run_lightning, "accelerate": run_accelerate, "pipeline": run_pipeline}
PIPELINE_STAGES = (0, 1)  # DeepSpeed refuses ZeRO-2 and ZeRO-3 with its pipeline engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--front-ends", nargs="+", default=list(RUNNERS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")  # every front-end finds it and keeps it
    out = Path(args.out)
    init = out / "init.safetensors"
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        make_init(init)
    torch.distributed.barrier()
    # The pipeline engine last: it leaves DeepSpeed's global model-parallel state set, and a later plain engine then
    # looks for model-parallel groups that are not there ('NoneType' object has no attribute 'get_model_parallel_rank').
    cases = [
        (front_end, stage, grad_accum)
        for front_end in sorted(args.front_ends, key=lambda name: name == "pipeline")
        for grad_accum in args.grad_accum
        for stage in args.stages
        if front_end != "pipeline" or stage in PIPELINE_STAGES
    ]
    runs = []
    for front_end, stage, grad_accum in cases:
        record = RUNNERS[front_end](init, stage, grad_accum, args)
        runs.append({"front_end": front_end, "stage": stage, "grad_accum": grad_accum, **record})
    if torch.distributed.get_rank() == 0:
        settings = {"steps": args.steps, "micro_batch_size": args.micro_batch_size, "world_size": 2, "lr": LR}
        (out / "runs.json").write_text(json.dumps({"settings": {**settings, "clipping": CLIPPING}, "runs": runs}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_then_exit(main)
