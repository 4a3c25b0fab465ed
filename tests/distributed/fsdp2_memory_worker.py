"""What one rank holds under each FSDP2 preset, counted from its tensors (common.accounting), for the planner's test.

A tiny Llama (untied output layer), bf16 compute through the presets' ``MixedPrecisionPolicy``, AdamW, 2 processes.
For each preset of ``--presets``: the gathered (unsharded) weights alive after a forward pass, before backward,
read from FSDP2's own parameter records, and what the rank holds after ``backward()`` and ``optimizer.step()``
(gradients alive), counted by common.accounting. Rank r writes ``OUT/rank<r>.json``.

The gathered weights are read here rather than through common.accounting because, between forward and backward,
a module's parameters *are* the gathered copies: counting ``model.parameters()`` then finds those in place of the
fp32 shards.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/fsdp2_memory_worker.py --out OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from common.accounting import fsdp2_model_state_bytes
from common.fsdp2 import apply_fully_shard
from common.process_setup import end_process_group

# Every dimension even, so that each parameter's first dimension splits over 2 ranks without padding.
CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def gathered_bytes(model: torch.nn.Module) -> int:
    """Bytes of unsharded weights alive now: the storage of each FSDP2 parameter's gathered copy (empty once
    resharded), each storage once (torch's private records; a test failure here names a torch change)."""
    storages = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for fsdp_param in fully_shard.state(module)._fsdp_param_group.fsdp_params:
                storage = fsdp_param._unsharded_param.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--presets", default="fsdp2,fsdp2_grad_op")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    record = {"config": CONFIG}
    for preset in args.presets.split(","):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        apply_fully_shard(model, preset, "bf16")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, CONFIG["vocab_size"], (2, 16))
        module_buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        loss = model(input_ids=tokens, labels=tokens).loss
        after_forward = gathered_bytes(model)
        loss.backward()
        optimizer.step()
        record[preset] = {
            "gathered_after_forward": after_forward,
            "after_step": fsdp2_model_state_bytes(model, optimizer),
            "module_buffer_bytes": module_buffers,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    end_process_group()


if __name__ == "__main__":
    main()
