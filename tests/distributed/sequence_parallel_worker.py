"""One rank of the Ulysses gradient check: SGD, clipping off, ZeRO 1, 2 and 3, on DeepSpeed's own engine.

Adam divides the gradient by its own running scale, so a loss that is N times too large barely moves the loss curve;
SGD without clipping moves the weights by exactly the gradient, so every step's loss shows a wrong scale. Each ZeRO
stage trains a fresh tiny Llama (same seed) for ``STEPS`` steps on fixed sequences with the project's sequence-parallel
loss (``common.sequence_parallel.lm_loss``), and records every step's whole-sequence loss and DeepSpeed's gradient
norm, and the loss on one fixed probe batch before and after training (whole sequences, in eval mode, where Ulysses
steps aside). With ``--sequence-parallel 1`` the same loop is the reference; the test compares the two.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/sequence_parallel_worker.py \
        --sequence-parallel 2 --out OUT [--with-documented-loss]

``--with-documented-loss`` then trains the three stages again with the published example's loss
(``documented_loss``), to show its trap, in the same process group (one launch fewer).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel import parallel_state_sp
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from worker_util import run_then_exit

from common import sequence_parallel

STEPS = 4
SEQ_LEN = 32
VOCAB = 64
MICRO_BATCH = 2
LR = 0.5  # large: a gradient twice too large shows in the next step's loss at the third digit


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
    }


def documented_loss(engine, input_ids: torch.Tensor, labels: torch.Tensor, sp) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of DeepSpeed's and Accelerate's published Ulysses example: every rank's mean loss gathered with
    autograd's ``all_gather``, weighted by its token count: each rank back-propagates the whole sequence's mean."""
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    shard = sequence_parallel.shard
    logits = engine(input_ids=shard(input_ids, sp), position_ids=shard(positions, sp), use_cache=False).logits
    local = shard(labels, sp)
    loss = F.cross_entropy(logits.float().flatten(0, 1), local.flatten())
    losses = torch.distributed.nn.functional.all_gather(loss, group=sp.group)
    tokens = torch.distributed.nn.functional.all_gather(torch.tensor(float(local.numel())), group=sp.group)
    total = sum(one * count for one, count in zip(losses, tokens, strict=True)) / sum(tokens)
    return total, total.detach()


def probe_loss(engine, block: torch.Tensor) -> float:
    """The loss on ``block`` (whole sequences, every rank: ZeRO-3's forward is collective), without training."""
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=block[:, :-1], use_cache=False).logits
    engine.train()
    return float(F.cross_entropy(logits.float().flatten(0, 1), block[:, 1:].flatten()))


def train(stage: int, sp_size: int, documented: bool = False) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    net = model()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    mpu = sequence_parallel.register(net, sp_size, MICRO_BATCH, "sdpa") if sp_size > 1 else None
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=ds_config(stage), mpu=mpu)
    sp = sequence_parallel.this_rank(sp_size, stage)
    replicas, replica = world // sp_size, rank // sp_size
    data = torch.randint(
        0, VOCAB, (STEPS * replicas * MICRO_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1)
    )
    probe = data[:MICRO_BATCH]  # the first step's batch of the first replica: one fixed batch for every run
    before = probe_loss(engine, probe)
    losses, norms = [], []
    for step in range(STEPS):
        first = (step * replicas + replica) * MICRO_BATCH
        block = data[first : first + MICRO_BATCH]
        input_ids, labels = block[:, :-1], block[:, 1:]
        if sp is None:
            logits = engine(input_ids=input_ids, use_cache=False).logits
            total = loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        else:
            loss_of = documented_loss if documented else sequence_parallel.lm_loss
            total, loss = loss_of(engine, input_ids, labels, sp)
        engine.backward(total)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)  # each replica's loss counted once per rank of its group
        losses.append(float(mean) / world)
        norms.append(float(engine.get_global_grad_norm()))
    after = probe_loss(engine, probe)
    engine.destroy()
    if mpu is not None:  # the next stage registers again: undo this one's wrapper and groups
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        parallel_state_sp._release_sequence_parallel_groups()
    return {"losses": losses, "grad_norms": norms, "probe_loss": [before, after]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequence-parallel", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--with-documented-loss", action="store_true", help="then the published example's loss")
    args = parser.parse_args()
    deepspeed.init_distributed("gloo")
    name = f"sp{args.sequence_parallel}_world{torch.distributed.get_world_size()}"
    for documented in (False, True) if args.with_documented_loss else (False,):
        result = {f"stage{stage}": train(stage, args.sequence_parallel, documented) for stage in (1, 2, 3)}
        if torch.distributed.get_rank() == 0:
            (args.out / f"{name}{'_documented' if documented else ''}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_then_exit(main)
