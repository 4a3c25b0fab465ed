"""One process, gloo: ZenFlow (ZeRO-2 with CPU optimizer offload) through ``deepspeed.initialize`` and a few steps, with
the optimizer from DeepSpeed's config (``optimizer`` section) or a client ``DeepSpeedCPUAdam`` as the recipes pass.

Writes ``{"trained": bool, "error": str | None, "losses": [...]}`` to ``--out``: what DeepSpeed did, for
tests/distributed/test_zenflow.py to hold the lint rule ``zenflow`` against.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import deepspeed
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
from worker_util import run_then_exit

STEPS = 6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True, help="the DeepSpeed config (JSON)")
    parser.add_argument("--client-optimizer", action="store_true", help="pass DeepSpeedCPUAdam, as the recipes do")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    config = json.loads(args.config.read_text())
    record: dict = {"trained": False, "error": None, "losses": []}
    try:
        if args.client_optimizer:
            optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-3)
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        else:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        generator = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            inputs = torch.randn(2, 64, generator=generator).to(torch.bfloat16)
            loss = engine(inputs).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            record["losses"].append(loss.item())
        record["trained"] = True
    except Exception as exc:  # noqa: BLE001 - the test compares DeepSpeed's outcome with the linter's verdict
        record["error"] = f"{type(exc).__name__}: {exc}"
    args.out.write_text(json.dumps(record))


if __name__ == "__main__":
    run_then_exit(main)  # ZenFlow's optimizer process and gloo end without the interpreter's teardown
