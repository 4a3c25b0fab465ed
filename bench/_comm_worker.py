"""One process group of bench/communication.py: DeepSpeed's communication log per optimizer step, row after row.

    python -m torch.distributed.run --nproc_per_node 2 bench/_comm_worker.py --rows ROWS.json --out OUT.json

Each row (a preset, gradient accumulation, precision, DeepSpeed overrides) builds the NLP recipe's tiny Llama the way
the recipe does (inside ``deepspeed.zero.Init`` at stage 3, the factory's DeepSpeed config, AdamW or DeepSpeed's
CPU Adam under offload), trains ``--steps`` optimizer steps (a row's own ``steps`` if it names them) on fixed
random tokens with DeepSpeed's ``comms_logger`` on, and records per step: the logged calls (per op and message size,
common.comms_log), the step's wall time, and the seconds the training thread spent in collectives: a synchronous
call's logged latency plus the time it waited for stage 3's asynchronous all-gathers (``AllGather*Handle.wait``, timed
here: the logger times only their launch); and, for a timed row, the same seconds call by call in the order the rank
made them (``calls``: op, message bytes, seconds), so that each call can be matched with the other ranks' same call.
Rows run one after the other in one group; rank 0 writes every rank's records to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from common.comms_log import snapshot_difference, take_snapshot
from common.host_memory import keep_freed_memory
from common.process_setup import end_process_group
from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config
from nlp.model import build_llama_config, build_model_from_config

VOCAB, HIDDEN = 4096, 256
# This step's calls in order: [op, message bytes, seconds] ("wait": the training thread blocked on an
# AllGather*Handle, bytes 0).
CALLS: list[list] = []


def time_async_waits() -> None:
    """Wrap stage 3's all-gather handles' ``wait`` so that the time the training thread blocks on them is counted."""
    from deepspeed.runtime.zero import partition_parameters as pp

    for handle in (pp.AllGatherHandle, pp.AllGatherCoalescedHandle):
        wait = handle.wait

        def timed(self, *args, _wait=wait, **kwargs):
            start = time.perf_counter()
            try:
                return _wait(self, *args, **kwargs)
            finally:
                CALLS.append(["wait", 0, time.perf_counter() - start])

        handle.wait = timed


def record_each_call() -> None:
    """Wrap DeepSpeed's ``comms_logger.append`` so that each logged call's own seconds join :data:`CALLS`.

    The logger is handed the op timer's running total (common.comms_log.take_snapshot): a call's own time is the
    difference from the total the op's previous call was handed."""
    from deepspeed.comm.comm import comms_logger

    append, totals = comms_logger.append, {}

    def appended(raw_name, record_name, latency, msg_size):
        CALLS.append([raw_name, int(msg_size), (latency - totals.get(record_name, 0.0)) / 1e3])
        totals[record_name] = latency
        return append(raw_name, record_name, latency, msg_size)

    comms_logger.append = appended


def build(row: dict, world: int, nvme: str) -> tuple:
    import deepspeed

    facts = RunFacts(
        world_size=world,
        micro_batch_size=row["micro_batch_size"],
        grad_accum=row.get("grad_accum", 1),
        precision=row.get("precision", "bf16"),
        hidden_size=HIDDEN,
        nvme_path=nvme,
        check_storage=False,
    )
    ds_config = resolve_deepspeed_config(row["preset"], facts, row.get("overrides") or {})
    torch.manual_seed(0)
    config = build_llama_config("tiny", vocab_size=VOCAB, seq_len=row["seq_len"])
    if ds_config["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build_model_from_config(config, attn_implementation="sdpa")
    else:
        model = build_model_from_config(config, attn_implementation="sdpa")
    numels = [getattr(p, "ds_numel", p.numel()) for p in model.parameters()]
    optimizer = make_optimizer(model.parameters(), ds_config, lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine, ds_config, numels


def run_row(row: dict, steps: int, nvme: str) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine, ds_config, numels = build(row, world, nvme)
    ga, mb, seq = row.get("grad_accum", 1), row["micro_batch_size"], row["seq_len"]
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, VOCAB, (mb, seq), generator=g) for _ in range(ga)]  # one fixed step, every step
    records = []
    before = take_snapshot()  # DeepSpeed's op timers keep running totals: a row's steps are differences
    for _ in range(steps):
        torch.distributed.barrier()  # every rank starts the step together: waits are the step's, not the last one's
        CALLS.clear()
        start = time.perf_counter()
        for ids in batches:
            logits = engine(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
        wall = time.perf_counter() - start
        after = take_snapshot()
        logged = snapshot_difference(before, after)
        before = after
        sync_seconds = sum(op["seconds"] for op in logged.values())
        waited = sum(seconds for op, _, seconds in CALLS if op == "wait")
        record = {"logged": logged, "wall_s": wall, "comm_s": sync_seconds + waited}
        if row.get("timed"):  # only the timed rows' seconds are compared; written to 0.1 us
            record["calls"] = [[op, size, round(seconds, 7)] for op, size, seconds in CALLS]
        records.append(record)
    engine.destroy()
    return {
        "name": row["name"],
        "timed": row.get("timed", False),
        "rank": rank,
        "ds_config": ds_config,
        "param_numels": numels,
        "steps": records,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", required=True, help="JSON list of rows")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of a row that names none")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as the recipes' processes do
    import deepspeed
    from deepspeed.comm.comm import comms_logger

    deepspeed.init_distributed(dist_backend="gloo")
    comms_logger.enabled, comms_logger.prof_all = True, True
    time_async_waits()
    record_each_call()
    rows = json.loads(Path(args.rows).read_text())
    results = []
    with tempfile.TemporaryDirectory(prefix="zr-nvme-") as nvme:
        for row in rows:
            mine = run_row(row, row.get("steps", args.steps), nvme)  # a timed row may run longer
            everyone: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, mine)
            results.append(everyone)
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results) + "\n")
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort


if __name__ == "__main__":
    main()
