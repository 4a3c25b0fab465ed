"""Train a tiny Llama, loaded from one saved folder, under DeepSpeed ZeRO and under FSDP2; record what each did.

``equivalence``: fp32, gradient accumulation 2, clipping 1.0, 5 steps, 2 processes. With ``--frontend torch`` each
configuration of ``--configs`` trains in turn in this one process group: ``deepspeed_stage_2`` and
``deepspeed_stage_3`` through ``deepspeed.initialize`` (the factory's config), ``fsdp2`` and ``fsdp2_grad_op``
through ``common.fsdp2.apply_fully_shard`` and a plain loop (``fsdp2+full``: with activation checkpointing). With
``--frontend lightning`` (``ModelParallelStrategy``) or ``accelerate`` (the FSDP plugin at version 2) the FSDP2
configurations train through the front-end's own loop, with the factory-side builders of ``common.fsdp2``. Every
rank writes ``OUT/<frontend>-rank<r>.json``: per configuration, its loss of every micro-batch, the gradient norm of
every step (before clipping) and the model-state bytes it holds after the last step.

``checkpoint``: the same model and data on any world size. ``--phase train`` (2 processes) trains 6 steps,
saves asynchronously after step 3 and step 5 (``common.fsdp2.DcpAsyncCheckpointer``), records the losses, the
live model's logits on a fixed input at step 3, and then kills itself (SIGKILL) while step 5's write is still in
flight (the test slows writes down). ``--phase resume`` loads the newest published checkpoint and trains on to
step 6.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/fsdp2_worker.py equivalence \\
        --frontend torch --init INIT --out OUT --configs deepspeed_stage_3,fsdp2
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from worker_util import quiet_cpu_trainer

from common.accounting import fsdp2_model_state_bytes
from common.activation import apply_activation_checkpointing
from common.checkpoint import clean_partial_checkpoints, latest_checkpoint
from common.fsdp2 import (
    DcpAsyncCheckpointer,
    accelerator_fsdp2_kwargs,
    apply_fully_shard,
    dcp_write,
    lightning_fsdp2_trainer_kwargs,
    load_checkpoint,
)
from common.process_setup import end_process_group

BLOCK = "LlamaDecoderLayer"
VOCAB, SEQ_LEN = 256, 32
GLOBAL_MICRO_BATCH = 4  # sequences per micro-step over all ranks: 4 / world_size per rank (world 1, 2 or 4)
GRAD_ACCUM = 2
CLIP = 1.0
# The factory's AdamW (common.strategy.make_optimizer) for DeepSpeed, and the same for FSDP2: torch's AdamW defaults
# to weight_decay=0.01 where make_optimizer passes 0.
ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
EQUIVALENCE_STEPS = 5
CHECKPOINT_STEPS = 6
SAVE_STEPS = (3, 5)


@functools.cache
def data() -> torch.Tensor:
    """The global batch of every optimizer step (the same each step, so that a falling loss means it learned): micro-
    batch m is rows [4m, 4m + 4), split evenly over the ranks."""
    return torch.randint(
        0, VOCAB, (GRAD_ACCUM * GLOBAL_MICRO_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(7)
    )


def micro_batch(micro: int, rank: int, world: int) -> torch.Tensor:
    """This rank's share of micro-batch ``micro`` (from 0) of every optimizer step."""
    per_rank = GLOBAL_MICRO_BATCH // world
    first = micro * GLOBAL_MICRO_BATCH + rank * per_rank
    return data()[first : first + per_rank]


def save_initial_model(folder: Path) -> Path:
    """The one initial model every run loads: a 2-layer Llama (114k parameters), initialised wide enough (std 0.1)
    that the gradient norm is 1.4-1.8 at every step, so clipping at 1.0 acts each time."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ_LEN,
        initializer_range=0.1,
        use_cache=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def load(init: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    model.config.use_cache = False
    return model


def norm_value(norm: torch.Tensor) -> float:
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def train_deepspeed(
    preset: str, model: torch.nn.Module, rank: int, world: int, precision: str
) -> tuple[list, list, dict]:
    import deepspeed

    from common.accounting import model_state_bytes as deepspeed_state_bytes
    from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config

    facts = RunFacts(
        world_size=world,
        micro_batch_size=GLOBAL_MICRO_BATCH // world,
        grad_accum=GRAD_ACCUM,
        precision=precision,
        hidden_size=model.config.hidden_size,
        gradient_clipping=CLIP,
    )
    # "deepspeed_stage_3@fp32_reduce": gradients reduced in fp32 (DeepSpeed's bf16 default reduces them in bf16).
    preset, _, reduce = preset.partition("@")
    overrides = {"communication_data_type": "fp32"} if reduce == "fp32_reduce" else {}
    config = resolve_deepspeed_config(preset, facts, overrides)
    optimizer = make_optimizer(model.parameters(), config, **ADAMW)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    losses, norms = [], []
    for _ in range(EQUIVALENCE_STEPS):
        for micro in range(GRAD_ACCUM):
            ids = micro_batch(micro, rank, world)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms, deepspeed_state_bytes(engine)


def fsdp2_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> tuple:
    """One optimizer step of the plain FSDP2 loop: the micro-batches' losses and the norm before clipping."""
    losses = []
    for micro in range(GRAD_ACCUM):
        ids = micro_batch(micro, rank, world)
        loss = model(input_ids=ids, labels=ids).loss
        (loss / GRAD_ACCUM).backward()
        losses.append(loss.item())
    norm = norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    optimizer.step()
    optimizer.zero_grad()
    return losses, norm


def sharded(
    init: str, preset: str, checkpointing: str = "none", precision: str = "fp32"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = load(init)
    apply_activation_checkpointing(model, checkpointing, block_classes=[BLOCK])
    apply_fully_shard(model, preset, precision, [BLOCK])
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def train_fsdp2(config: str, init: str, rank: int, world: int, precision: str) -> tuple[list, list, dict]:
    preset, _, checkpointing = config.partition("+")
    model, optimizer = sharded(init, preset, checkpointing or "none", precision)
    losses, norms = [], []
    for _ in range(EQUIVALENCE_STEPS):
        step_losses, norm = fsdp2_step(model, optimizer, rank, world)
        losses += step_losses
        norms.append(norm)
    with torch.no_grad():  # an evaluation forward leaves weights gathered (the root; every block under fsdp2_grad_op)
        model(input_ids=micro_batch(0, rank, world))
    return losses, norms, fsdp2_model_state_bytes(model, optimizer)  # still the shards: counted from FSDP2's records


def run_torch(args: argparse.Namespace, rank: int, world: int) -> dict:
    results = {}
    for config in args.configs.split(","):
        if config.startswith("deepspeed"):
            losses, norms, state = train_deepspeed(config, load(args.init), rank, world, args.precision)
        else:
            losses, norms, state = train_fsdp2(config, args.init, rank, world, args.precision)
        results[config] = {"losses": losses, "grad_norms": norms, "state_bytes": state}
    return results


def run_lightning(args: argparse.Namespace, rank: int, world: int) -> dict:
    import lightning as L

    results = {}

    class Module(L.LightningModule):
        def __init__(self, preset: str) -> None:
            super().__init__()
            self.preset, self.net = preset, load(args.init)
            self.losses: list[float] = []
            self.norms: list[float] = []
            self.rows: list[int] = []  # a checksum of each micro-batch's tokens

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            apply_fully_shard(self.net, self.preset, args.precision, [BLOCK], mesh=mesh)

        def training_step(self, batch, batch_idx):
            loss = self.net(input_ids=batch[0], labels=batch[0]).loss
            self.losses.append(loss.item())
            self.rows.append(int(batch[0].sum()))
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:  # before Lightning clips
            grads = [p.grad for p in self.net.parameters() if p.grad is not None]
            self.norms.append(norm_value(torch.nn.utils.get_total_norm(grads)))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.net.parameters(), **ADAMW)

    # This rank's rows, in the order the other loops read them. Lightning's own DistributedSampler would shuffle them:
    # it shuffles every training loader it replaces the sampler of (lightning 2.6), hence use_distributed_sampler=False.
    rows = torch.cat([micro_batch(micro, rank, world) for micro in range(GRAD_ACCUM)]).repeat(EQUIVALENCE_STEPS, 1)
    for preset in args.configs.split(","):
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(rows), batch_size=GLOBAL_MICRO_BATCH // world
        )
        module = Module(preset)
        trainer = quiet_cpu_trainer(
            world,
            EQUIVALENCE_STEPS,
            use_distributed_sampler=False,
            **lightning_fsdp2_trainer_kwargs(world, GRAD_ACCUM, CLIP),
        )
        trainer.fit(module, loader)
        optimizer = trainer.optimizers[0]
        results[preset] = {
            "losses": module.losses,
            "grad_norms": module.norms,
            "rows": module.rows,
            "state_bytes": fsdp2_model_state_bytes(module.net, optimizer),
        }
    return results


def run_accelerate(args: argparse.Namespace, rank: int, world: int) -> dict:
    from accelerate import Accelerator

    presets = args.configs.split(",")
    # One Accelerator for both presets: the script shards each model itself, so the plugin's own settings are unused.
    accelerator = Accelerator(**accelerator_fsdp2_kwargs(presets[0], args.precision, GRAD_ACCUM))
    rank, world = accelerator.process_index, accelerator.num_processes
    results = {}
    for preset in presets:
        model, optimizer = sharded(args.init, preset, precision=args.precision)
        model, optimizer = accelerator.prepare(model, optimizer)
        losses, norms = [], []
        for _ in range(EQUIVALENCE_STEPS):
            for micro in range(GRAD_ACCUM):
                ids = micro_batch(micro, rank, world)
                with accelerator.accumulate(model):
                    loss = model(input_ids=ids, labels=ids).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        norms.append(norm_value(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
        results[preset] = {
            "losses": losses,
            "grad_norms": norms,
            "state_bytes": fsdp2_model_state_bytes(model, optimizer),
        }
        results[preset]["distributed_type"] = accelerator.distributed_type.value
        results[preset]["num_processes"] = accelerator.num_processes
    accelerator.end_training()
    return results


# --- checkpoint ----------------------------------------------------------------------------------------------------


def probe_logits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A fixed input and the (sharded) model's logits on it; every rank calls it."""
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return {"input_ids": ids, "logits": model(input_ids=ids).logits.float()}


def step_loss(losses: list[float], world: int) -> float:
    """The global mean loss of one optimizer step from this rank's micro-batch losses (every rank calls it)."""
    total = torch.tensor(sum(losses) / (len(losses) * world), dtype=torch.float64)
    dist.all_reduce(total)
    return total.item()


def run_checkpoint(args: argparse.Namespace, rank: int, world: int) -> None:
    out = Path(args.out)
    model, optimizer = sharded(args.init, "fsdp2")
    checkpointer = DcpAsyncCheckpointer(out, rank, world, keep_last=2, keep_every=0, barrier=dist.barrier)
    first = 0
    record: dict = {"world": world, "losses": {}}
    if args.phase == "resume":
        if rank == 0:
            clean_partial_checkpoints(out)
        dist.barrier()
        latest = latest_checkpoint(out)
        extra = load_checkpoint(latest, model, optimizer)
        first = extra["step"]
        record["resumed_from"] = latest.name
    started = time.perf_counter()
    for step in range(first, CHECKPOINT_STEPS):
        losses, _ = fsdp2_step(model, optimizer, rank, world)
        record["losses"][step + 1] = step_loss(losses, world)
        if args.phase == "train" and step + 1 == SAVE_STEPS[1]:
            record["step5_updated_s"] = time.perf_counter() - started  # from step 3's save call
        if args.phase == "train" and step + 1 in SAVE_STEPS:
            if step + 1 == SAVE_STEPS[0]:
                started = time.perf_counter()
            write = dcp_write(model, optimizer, {"step": step + 1}, async_group=checkpointer.group)
            checkpointer.save(step + 1, write)
            record.setdefault("blocked_s", []).append(checkpointer.blocked_s[-1])
            if step + 1 == SAVE_STEPS[0]:
                probe = probe_logits(model)
                if rank == 0:
                    save_file(probe, str(out / "logits_step3.safetensors"))
            elif rank == 0:  # the save of step 5 waited for step 3's write and publish
                record["step3_written_s"] = checkpointer.written_s[0]
    if rank == 0:
        (out / f"{args.phase}-world{world}.json").write_text(json.dumps(record))
    if args.phase == "train":
        # The crash: every rank dies while step 5's write is still in flight (the test slows writes down).
        dist.barrier()
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.finish()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("equivalence", "checkpoint"))
    parser.add_argument("--frontend", choices=("torch", "lightning", "accelerate"), default="torch")
    parser.add_argument("--configs", default="fsdp2")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")  # equivalence: fp32
    parser.add_argument("--phase", choices=("train", "resume"), default="train")
    parser.add_argument("--init", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.frontend == "accelerate":
        results = run_accelerate(args, 0, 1)
        rank = int(os.environ["RANK"])
    else:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.mode == "checkpoint":
            run_checkpoint(args, rank, world)
            end_process_group()
            return
        results = (run_lightning if args.frontend == "lightning" else run_torch)(args, rank, world)
    Path(args.out, f"{args.frontend}-rank{rank}.json").write_text(json.dumps(results))
    end_process_group()


if __name__ == "__main__":
    main()
