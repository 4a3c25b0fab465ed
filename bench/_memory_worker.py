"""One process group of bench/memory.py: model-state bytes per rank after a real step, stages 0-3, two shapes.

    python -m torch.distributed.run --nproc_per_node N bench/_memory_worker.py --out OUT.json

For each model shape and each ZeRO stage (presets ddp, deepspeed_stage_1/2/3, bf16, resolved by the
factory), build the model afresh, ``deepspeed.initialize`` it, train one step, and count what every rank
holds with common.accounting.model_state_bytes: after the step, and at every parameter's gradient during
the second step's backward pass (the resident peak: gradients alive, buckets in use, stage-3 parameters
gathered; the second, because Adam allocates its moments in the first step).
Rank 0 writes OUT.json.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from common.accounting import _walk_tensors, model_state_bytes
from common.memory_formulas import count_module
from common.process_setup import end_process_group
from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config
from nlp.model import build_llama_config, build_model_from_config

STAGE_PRESETS = {0: "ddp", 1: "deepspeed_stage_1", 2: "deepspeed_stage_2", 3: "deepspeed_stage_3"}
# Two Llama shapes: the recipe's tiny model, and a wider, shallower one with tied embeddings and
# grouped-query attention (a shared tensor must be counted once; GQA makes K/V matrices narrower).
SHAPES = {
    "tiny": {"vocab_size": 4096},
    "wide-tied": {
        "vocab_size": 8192,
        "hidden_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1376,
        "tie_word_embeddings": True,
    },
}
SEQ, MICRO_BATCH = 32, 1  # one short step: only model states matter here, not activations


def make_model(shape: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model_from_config(build_llama_config("tiny", seq_len=SEQ, **SHAPES[shape]), "sdpa")


def gathered_bytes(engine) -> int:
    """Stage 3: bytes of full parameters gathered right now and not already counted by accounting.

    Persistent parameters are model states; gathered ones are often views of a flat all-gather buffer the
    ZeRO optimizer holds, which model_state_bytes counts among its buffers already.
    """
    held = {t.untyped_storage().data_ptr() for t in _walk_tensors(engine.optimizer, depth=4, seen=set())}
    storages = {}
    for param in engine.module.parameters():
        if hasattr(param, "ds_tensor") and not getattr(param, "ds_persist", False) and param.data.numel() > 0:
            storage = param.data.untyped_storage()
            if storage.data_ptr() not in held:
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def resident_now(engine) -> dict:
    """What the rank holds at this moment: model states, ZeRO buffers, and (stage 3) gathered parameters."""
    held = model_state_bytes(engine)
    held["gathered"] = gathered_bytes(engine)
    held["resident_buffers"] = held["buffers"] + held["gathered"]
    held["resident"] = held["total"] + held["gathered"]
    return held


def watch_backward(engine) -> dict:
    """Snapshot what is resident after each parameter's gradient is accumulated; keep the largest."""
    peak: dict = {"resident": -1}

    def snapshot(_param: torch.Tensor) -> None:
        now = resident_now(engine)
        if now["resident"] > peak["resident"]:
            peak.update(now)

    handles = [p.register_post_accumulate_grad_hook(snapshot) for p in engine.module.parameters()]
    return {"peak": peak, "handles": handles}


def one_step(shape: str, stage: int) -> dict:
    import deepspeed

    model = make_model(shape)
    num_params, largest = count_module(model)
    hidden = model.config.hidden_size
    facts = RunFacts(
        world_size=torch.distributed.get_world_size(),
        micro_batch_size=MICRO_BATCH,
        precision="bf16",
        hidden_size=hidden,
    )
    ds_config = resolve_deepspeed_config(STAGE_PRESETS[stage], facts)
    optimizer = make_optimizer(model.parameters(), ds_config, lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ids = torch.randint(0, model.config.vocab_size, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    watch = watch_backward(engine)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    for handle in watch["handles"]:
        handle.remove()
    after_backward = resident_now(engine)
    engine.step()
    persistent = sum(p.ds_numel for p in engine.module.parameters() if getattr(p, "ds_persist", False))
    measured = model_state_bytes(engine)
    measured["backward_peak"] = watch["peak"]
    measured["after_backward"] = after_backward
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, measured)
    row = {
        "shape": shape,
        "stage": stage,
        "preset": STAGE_PRESETS[stage],
        "num_params": num_params,
        "largest_layer_params": largest,
        "hidden_size": hidden,
        "persistent_params": persistent,
        "model_config": json.loads(model.config.to_json_string()),  # what `estimate --model-config` reads
        "zero_optimization": ds_config["zero_optimization"],
        "ranks": everyone,
    }
    del engine, optimizer, model
    gc.collect()
    return row


def main() -> None:
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rows = [one_step(shape, stage) for shape in SHAPES for stage in STAGE_PRESETS]
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort


if __name__ == "__main__":
    main()
