"""One rank of the DeepSpeed #8148 check: ZeRO-3 + full activation checkpointing + frozen Llama + LoRA, one step.

DeepSpeed 0.19.3 (#8148) lets activation-checkpoint recomputation gather frozen parameters under ZeRO-3; the
upstream review found cases where a recomputed frozen parameter stays gathered past its last use. If that happens
here, every rank keeps whole copies of the frozen base and ZeRO-3's saving for LoRA is silently gone. This worker
runs the fine-tuning situation on DeepSpeed's own engine (no Lightning, no Accelerate, no recipe code): a Llama
built with transformers, LoRA from peft, the project's ``full`` checkpointing preset, the ``finetune`` preset's
DeepSpeed dict with ``stage3_param_persistence_threshold`` 0 (so that no parameter is resident by design), then
records every parameter's ZeRO status after ``backward`` and after ``step``, and the bytes each rank holds.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/frozen_partition_worker.py --out OUT
"""

from __future__ import annotations

import argparse

import deepspeed
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from worker_util import run_then_exit, setup_gloo_rank, write_rank_record

from common.accounting import model_state_bytes
from common.activation import apply_activation_checkpointing
from common.strategy import RunFacts, resolve_deepspeed_config

LORA_RANK = 4
HIDDEN = 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_config() -> LlamaConfig:
    """The fine-tuning tests' base shape (tests/recipes/test_finetune_recipe.py), written out for --model-config."""
    return LlamaConfig(
        vocab_size=512,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )


def build(use_reentrant: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(llama_config()), LoraConfig(r=LORA_RANK, target_modules=TARGETS))
    for param in model.parameters():
        if param.requires_grad:  # peft makes the adapters fp32; the engine trains in bf16
            param.data = param.data.to(torch.bfloat16)
    apply_activation_checkpointing(model, "full", use_reentrant=use_reentrant)
    return model


def statuses(model: torch.nn.Module) -> dict[str, dict]:
    """Each parameter's ZeRO status and how many elements this rank holds in ``param.data`` right now."""
    return {
        name: {
            "frozen": not p.requires_grad,
            "ds_status": p.ds_status.name,
            "local_numel": p.data.numel(),
            "ds_numel": p.ds_numel,
            "persist": bool(getattr(p, "ds_persist", False)),
        }
        for name, p in model.named_parameters()
    }


def one_step(ds_config: dict, use_reentrant: bool, rank: int) -> dict:
    """Build, wrap in a ZeRO-3 engine, run one checkpointed forward/backward and one step; the statuses."""
    model = build(use_reentrant)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-3), config=ds_config)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    after_backward = statuses(engine.module)
    engine.step()
    return {
        "zero_stage": engine.zero_optimization_stage(),
        "checkpointed_blocks": sum(getattr(m, "_zr_checkpointed", False) for m in engine.module.modules()),
        "after_backward": after_backward,
        "after_step": statuses(engine.module),
        "state_bytes": model_state_bytes(engine),
        "loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, _ = setup_gloo_rank()
    facts = RunFacts(world_size=2, micro_batch_size=2, precision="bf16", hidden_size=HIDDEN, gradient_clipping=1.0)
    ds_config = resolve_deepspeed_config("finetune", facts)
    ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # nothing resident by design
    # The recipes' form (reentrant) and PyTorch's non-reentrant one, which #8148 changed most.
    record = {"rank": rank, "deepspeed": deepspeed.__version__, "config": ds_config}
    for mode, use_reentrant in (("reentrant", True), ("non_reentrant", False)):
        record[mode] = one_step(ds_config, use_reentrant, rank)
    write_rank_record(args.out, rank, record)


if __name__ == "__main__":
    run_then_exit(main)
