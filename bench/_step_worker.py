"""One process group of a benchmark: time optimizer steps of the NLP tiny model under one backend and preset.

Launched by bench/overhead.py and bench/stages.py (through _bench_util.launch_group) on the same model,
DeepSpeed config and data:
  raw        python -m torch.distributed.run --nproc_per_node 2 bench/_step_worker.py --backend raw ...
  lightning  python bench/_step_worker.py --backend lightning ...     (Lightning starts rank 1 itself)
  accelerate accelerate launch --config_file CFG bench/_step_worker.py --backend accelerate ...
Step time = wall time between the ends of consecutive optimizer steps (the whole loop: data, forward,
backward, step, framework hooks). Beside it every rank records the CPU time it spent in the same interval:
``time.process_time`` (all threads of the rank: the training thread plus gloo's and the frameworks' own
threads) and ``time.thread_time`` (the training thread alone). CPU time counts only work this rank did, not
time it waited for a core taken by other work on the machine, so it is what bench/overhead.py judges by.
After the last step every rank reports its per-step CPU times, peak RSS, resident bytes at each step's end and
the model-state bytes it holds (common.accounting); rank 0 writes OUT.json. ``--profile PATH`` runs cProfile (timed
by the thread's CPU time) on rank 0 over the steps after warm-up and writes the pstats file there.

Each backend's loop is the one its recipe runs per optimizer step (recipes/nlp/train.py and
train_accelerate.py): forward, backward, step and a per-step LambdaLR scheduler; Accelerate's loop inside
``accelerator.accumulate``. The recipes' every-``log_interval`` work (loss all-reduce, metrics line,
evaluation, checkpoints) is left out: it is not a per-step cost of the framework.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

from common.accounting import model_state_bytes
from common.hang import watchdog_cost
from common.host_memory import keep_freed_memory, keeps_freed_memory_by_default
from common.process_setup import end_process_group
from common.strategy import RunFacts, make_optimizer, resolve_deepspeed_config
from nlp.model import build_llama_config, build_model_from_config

VOCAB, SEQ, MICRO_BATCH, HIDDEN = 4096, 256, 8, 256
PROFILE_AFTER = 3  # optimizer steps left out of the profile (start-up, first allocations)


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


def clocks() -> tuple[float, float, float, float]:
    """(wall, this process's CPU time over all threads, this thread's CPU time) in seconds, and the process's page
    faults so far (minor: a fresh page of memory the kernel maps and zeroes, CPU time that depends on where the
    allocator puts a tensor rather than on what the step computes)."""
    return (
        time.perf_counter(),
        time.process_time(),
        time.thread_time(),
        resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
    )


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``'s second field, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def intervals(ends: list[float]) -> list[float]:
    return [b - a for a, b in zip(ends, ends[1:])]


class StepClock:
    """Wall and CPU times at the ends of optimizer steps; starts cProfile (or torch.profiler, per op) on rank 0
    after warm-up when asked to."""

    def __init__(self, profile_path: str | None, is_rank0: bool, op_profile_path: str | None = None) -> None:
        self.ends = [clocks()]
        self.rss_after_step: list[int] = []  # resident bytes at each step's end: what the process keeps between steps
        # Timed by this thread's CPU time, like the verdict: load from other work does not move it.
        self.profiler = cProfile.Profile(time.thread_time) if profile_path and is_rank0 else None
        self.profile_path = profile_path
        self.op_profile_path = op_profile_path if is_rank0 else None
        self.op_profiler = None

    def restart(self) -> None:
        """The loop starts now (Lightning: after its own set-up, which is not a step)."""
        self.ends[0] = clocks()

    def step_done(self) -> None:
        self.ends.append(clocks())
        self.rss_after_step.append(resident_bytes())
        if self.profiler is not None and len(self.ends) == PROFILE_AFTER + 1:
            self.profiler.enable()
        if self.op_profile_path and len(self.ends) == PROFILE_AFTER + 1:
            self.op_profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.op_profiler.__enter__()

    def finish(self) -> dict[str, list[float]]:
        """Per step: seconds of ``wall``, ``cpu`` (process_time) and ``thread_cpu`` (thread_time); ``page_faults``;
        ``rss_after_step`` (bytes resident at each step's end)."""
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(self.profile_path)
        if self.op_profiler is not None:
            self.op_profiler.__exit__(None, None, None)
            steps = len(self.ends) - 1 - PROFILE_AFTER
            ops = {
                e.key: {"count": e.count / steps, "self_cpu_us": e.self_cpu_time_total / steps}
                for e in self.op_profiler.key_averages()
            }
            Path(self.op_profile_path).write_text(json.dumps(ops, indent=1, sort_keys=True))
        wall, cpu, thread, faults = zip(*self.ends)
        return {
            "wall": intervals(list(wall)),
            "cpu": intervals(list(cpu)),
            "thread_cpu": intervals(list(thread)),
            "page_faults": intervals(list(faults)),
            "rss_after_step": self.rss_after_step,
        }


def rank_report(engine, times: dict[str, list[float]]) -> list[dict]:
    """Every rank's per-step CPU times, peak RSS and model-state bytes, gathered (a collective: all ranks call it)."""
    mine = {
        "cpu_step_times": times["cpu"],
        "thread_cpu_step_times": times["thread_cpu"],
        "page_faults_per_step": times["page_faults"],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "rss_after_step_bytes": times["rss_after_step"],
        "hang_watchdog": watchdog_cost(),  # None when hang detection is off (or never armed: the raw loop)
        **model_state_bytes(engine),
    }
    everyone: list[dict | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return everyone  # type: ignore[return-value]


def constant_lr(optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The recipes step a LambdaLR every optimizer step; so does every backend here (a constant factor)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def run_raw(args, ds_config) -> tuple[torch.nn.Module, StepClock]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_model()
    optimizer = make_optimizer(model.parameters(), ds_config, lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    scheduler = constant_lr(optimizer)
    clock = StepClock(args.profile, rank == 0, args.op_profile)
    for (ids,) in loader_for(rank, world, args.steps):
        loss = lm_loss(engine, ids)
        engine.backward(loss)
        engine.step()
        scheduler.step()
        clock.step_done()
    return engine, clock


def run_accelerate(args, ds_config) -> tuple[torch.nn.Module, StepClock]:
    from accelerate import Accelerator

    from common.strategy import accelerator_kwargs

    accelerator = Accelerator(**accelerator_kwargs(ds_config))
    model = make_model()
    optimizer = make_optimizer(model.parameters(), ds_config, lr=1e-3)
    scheduler = constant_lr(optimizer)  # not prepared, as in the recipes (a prepared one steps once per process)
    engine, optimizer = accelerator.prepare(model, optimizer)
    clock = StepClock(args.profile, accelerator.is_main_process, args.op_profile)
    for (ids,) in loader_for(accelerator.process_index, accelerator.num_processes, args.steps):
        with accelerator.accumulate(engine):
            loss = lm_loss(engine, ids)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
        clock.step_done()
    return engine, clock


def run_lightning(args, ds_config) -> tuple[torch.nn.Module, StepClock]:
    import lightning as L

    from common.strategy import lightning_trainer_kwargs

    rank = int(os.environ.get("LOCAL_RANK", 0))
    clock = StepClock(args.profile, rank == 0, args.op_profile)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()

        def training_step(self, batch, batch_idx):
            return lm_loss(self.model, batch[0])

        def on_train_start(self) -> None:
            clock.restart()

        def on_train_batch_end(self, *unused) -> None:
            clock.step_done()

        def configure_optimizers(self):
            optimizer = make_optimizer(self.parameters(), self.trainer.strategy.config, lr=1e-3)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": constant_lr(optimizer), "interval": "step"}}

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
    trainer.fit(Module(), loader_for(rank, 2, args.steps))
    return trainer.strategy.model, clock


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("raw", "lightning", "accelerate"), required=True)
    parser.add_argument("--preset", default="nlp")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--profile", default=None, help="write a cProfile of rank 0's timed steps here")
    parser.add_argument("--op-profile", default=None, help="write rank 0's torch ops per step (count, self CPU) here")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", 2))
    with tempfile.TemporaryDirectory(prefix="zr-nvme-") as nvme:  # only the *_offload_nvme preset uses it
        facts = RunFacts(
            world_size=world, micro_batch_size=MICRO_BATCH, precision="bf16", hidden_size=HIDDEN, nvme_path=nvme
        )
        ds_config = resolve_deepspeed_config(args.preset, facts)
        # The recipes' processes keep freed host memory unless they offload (common.process_setup); the raw loop gets
        # the same setting, so that a ratio compares the frameworks' work and not where glibc put a step's tensors.
        keep_freed_memory(by_default=keeps_freed_memory_by_default(ds_config))
        runner = {"raw": run_raw, "lightning": run_lightning, "accelerate": run_accelerate}[args.backend]
        # Each runner returns right after its last step: the clock stops here, then the ranks gather their figures.
        engine, clock = runner(args, ds_config)
        times = clock.finish()
        ranks = rank_report(engine, times)
    if torch.distributed.get_rank() == 0:
        result = {"backend": args.backend, "preset": args.preset, "step_times": times["wall"], "ranks": ranks}
        result["profile_after"] = PROFILE_AFTER
        Path(args.out).write_text(json.dumps(result))
    end_process_group()  # on gloo, a process that exits the moment its work is done can abort


if __name__ == "__main__":
    main()
