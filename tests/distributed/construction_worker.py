"""Build a transformers model no recipe uses (Qwen2: RoPE, tied embeddings) on the factory alone; train a few steps.

The question is who owns ZeRO-3 model construction: with nothing but the factory's public adapters
(``lightning_trainer_kwargs`` / ``accelerator_kwargs``), a model built with ``from_config`` must start
from the same weights under stage 3 as under stage 0, and keep its RoPE frequencies in fp32.

    python tests/distributed/construction_worker.py --backend lightning --preset deepspeed_stage_3 --out OUT
    accelerate launch --config_file CFG tests/distributed/construction_worker.py --backend accelerate ...

Each rank feeds its own fixed batches (no sampler), so both backends see the same data on every rank and
one stage-0 run is the reference for all (``--pretrained DIR`` loads the same initial weights everywhere).
Rank r writes ``OUT/rank{r}.json``: per-step losses, the step-0 loss of a model built with the same seed
outside ``zero.Init`` (transformers' ZeRO-3 initialisation draws the same distribution in another order, so
that one agrees in distribution, not bit for bit), and the RoPE buffer's dtype and its largest difference
from a fresh fp32 computation.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from worker_util import quiet_cpu_trainer, run_then_exit, write_rank_record

from common.errors import exit_on_user_error
from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config

HIDDEN = 64
VOCAB = 256
SEQ = 32
MICRO_BATCH = 4
SEED = 0


def model_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def build(how: str, pretrained: str | None) -> torch.nn.Module:
    torch.manual_seed(SEED)
    if pretrained:  # the same initial weights whatever the stage: losses can be compared exactly
        return AutoModelForCausalLM.from_pretrained(pretrained)
    if how == "from_config":
        return AutoModelForCausalLM.from_config(model_config())
    return Qwen2ForCausalLM(model_config())  # the direct constructor call the strategy must refuse under ZeRO-3


def rank_batches(rank: int, steps: int) -> list[torch.Tensor]:
    """This rank's token batches: fixed by (rank, step), the same whichever backend runs them."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g) for _ in range(steps)]


def reference_step0_loss(batch: torch.Tensor) -> float:
    """The first batch's loss of the same seeded model, built plainly (no zero.Init, no DeepSpeed)."""
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(model_config()).eval()
    with torch.no_grad():
        return model(input_ids=batch, labels=batch).loss.item()


def rope_facts(model: torch.nn.Module) -> dict:
    """The RoPE buffer's dtype and how far it is from an fp32 computation made outside any zero.Init."""
    rotary = next(m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor))
    fresh = type(rotary)(rotary.config).inv_freq
    return {
        "inv_freq_dtype": str(rotary.inv_freq.dtype),
        "inv_freq_max_error": (rotary.inv_freq.float().cpu() - fresh).abs().max().item(),
    }


def dump(
    args, rank: int, world_size: int, losses: list[float], model: torch.nn.Module, batches: list[torch.Tensor]
) -> None:
    record = {
        "losses": losses,
        "reference_step0_loss": reference_step0_loss(batches[0]),
        "world_size": world_size,
        **rope_facts(model),
    }
    write_rank_record(args.out, rank, record)


def run_lightning(args, ds_config) -> None:
    import lightning as L

    from common.strategy import lightning_trainer_kwargs

    losses: list[float] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = build(args.build, args.pretrained)

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return make_optimizer(list(self.parameters()), self.trainer.strategy.config, lr=args.lr)

    module = Module()
    trainer = quiet_cpu_trainer(
        args.devices,
        args.steps,
        use_distributed_sampler=False,  # each rank already holds its own batches
        **lightning_trainer_kwargs(ds_config),
    )
    batches = rank_batches(int(os.environ.get("LOCAL_RANK", "0")), args.steps)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    dump(args, trainer.global_rank, trainer.world_size, losses, module.model, batches)


def run_accelerate(args, ds_config) -> None:
    from accelerate import Accelerator

    from common.strategy import accelerator_kwargs

    accelerator = Accelerator(**accelerator_kwargs(ds_config))
    model = build(args.build, args.pretrained)
    optimizer = make_optimizer(list(model.parameters()), ds_config, lr=args.lr)
    engine, optimizer = accelerator.prepare(model, optimizer)
    batches = rank_batches(accelerator.process_index, args.steps)
    losses: list[float] = []
    for batch in batches:
        loss = engine(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    dump(args, accelerator.process_index, accelerator.num_processes, losses, engine.module, batches)


@exit_on_user_error()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("lightning", "accelerate"), required=True)
    parser.add_argument("--preset", default="deepspeed_stage_3")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--build", choices=("from_config", "constructor"), default="from_config")
    parser.add_argument("--pretrained", help="a folder saved by save_pretrained: load it instead of building")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", args.devices))
    facts = RunFacts(world_size=world_size, micro_batch_size=MICRO_BATCH, precision=args.precision, hidden_size=HIDDEN)
    ds_config = resolve_deepspeed_config(args.preset, facts)
    (run_lightning if args.backend == "lightning" else run_accelerate)(args, ds_config)


if __name__ == "__main__":
    run_then_exit(main)
