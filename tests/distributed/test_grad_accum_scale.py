"""Gradient accumulation divides the loss once, on every front-end: SGD against a hand-written reference.

Lightning's automatic optimization divides the loss by ``accumulate_grad_batches`` and DeepSpeed's
``engine.backward`` divides by ``gradient_accumulation_steps`` again unless told not to
(``common.lightning_cpu.ZeroDeepSpeedStrategy.backward`` tells it). AdamW hardly sees a gradient's scale; SGD,
clipping and the logged gradient norm do. One 2-process job (``grad_accum_worker.py``) trains a small MLP with SGD
(lr 0.2, clipping 2.0, fp32) from one saved initial state, accumulation 2 and 4, ZeRO stages 0-3, through Lightning
and Accelerate, and through DeepSpeed's pipeline engine (``engine.train_batch()``, what the pipeline entry point
drives) at stages 0-1. Each run must equal, within 1e-5 relative at each of 5 steps, a single-process loop written
here with plain torch: the whole global batch averaged at once, the gradient clipped with ``clip_grad_norm_``, an SGD
step. Compared: the global batch's loss before each update (the trajectory), the gradient norm DeepSpeed reports
before clipping (the scale itself; ZeRO stages 1-3, stage 0 reports none for a torch optimizer), the optimizer steps
taken, and under Lightning DeepSpeed's micro-step count (one per micro-batch, as before the fix).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _util import PYTHON, REPO, free_port, run
from grad_accum_worker import load_init

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "distributed" / "grad_accum_worker.py"
RTOL = 1e-5
GRAD_ACCUMS = (2, 4)
STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[dict, object]:
    out = tmp_path_factory.mktemp("grad_accum")
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    run([*torchrun, WORKER, "--out", out, "--grad-accum", *GRAD_ACCUMS, "--stages", *STAGES], timeout=600)
    return json.loads((out / "runs.json").read_text()), out / "init.safetensors"


def reference(init, settings: dict, grad_accum: int) -> tuple[list[float], list[float]]:
    """(loss before each update, gradient norm before clipping) of one process training on each global batch."""
    net, x, y = load_init(init)
    return train_reference(net, x, y, settings, grad_accum)


def train_reference(net, x, y, settings: dict, grad_accum: int) -> tuple[list[float], list[float]]:
    optimizer = torch.optim.SGD(net.parameters(), lr=settings["lr"])
    per_step = settings["micro_batch_size"] * settings["world_size"] * grad_accum
    losses, norms = [], []
    for step in range(settings["steps"]):
        batch = slice(step * per_step, (step + 1) * per_step)
        loss = torch.nn.functional.mse_loss(net(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), settings["clipping"])))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


def assert_close(found: list[float], expected: list[float], what: str) -> None:
    assert len(found) == len(expected), (what, found, expected)
    for step, (a, b) in enumerate(zip(found, expected), start=1):
        assert math.isclose(a, b, rel_tol=RTOL), f"{what}, step {step}: {found} vs reference {expected}"


def test_every_front_end_ran_every_case(job):
    runs, _ = job
    cases = {(r["front_end"], r["stage"], r["grad_accum"]) for r in runs["runs"]}
    expected = {(f, s, g) for f in ("lightning", "accelerate") for s in STAGES for g in GRAD_ACCUMS}
    expected |= {("pipeline", s, g) for s in (0, 1) for g in GRAD_ACCUMS}
    assert cases == expected


@pytest.mark.parametrize("front_end", ["lightning", "accelerate", "pipeline"])
def test_sgd_with_clipping_equals_the_single_process_reference(job, front_end):
    runs, init = job
    settings = runs["settings"]
    expected = {g: reference(init, settings, g) for g in GRAD_ACCUMS}
    checked = 0
    for record in runs["runs"]:
        if record["front_end"] != front_end:
            continue
        grad_accum, what = record["grad_accum"], f"{front_end} ZeRO-{record['stage']} grad_accum {record['grad_accum']}"
        losses, norms = expected[grad_accum]
        assert_close(record["losses"], losses, f"{what} loss")
        if record["stage"] == 0:  # DeepSpeed reports no norm without a ZeRO optimizer (torch's SGD keeps none)
            assert all(math.isnan(norm) for norm in record["grad_norms"]), record["grad_norms"]
        else:
            assert_close(record["grad_norms"], norms, f"{what} gradient norm")
        assert record["global_steps"] == settings["steps"], what  # one optimizer step per global batch
        if front_end == "lightning":  # Lightning steps the engine every micro-batch: the fix keeps DeepSpeed's count
            assert record["micro_steps"] == settings["steps"] * grad_accum, what
        checked += 1
    assert checked == len(GRAD_ACCUMS) * (2 if front_end == "pipeline" else len(STAGES))
    # The bar means something only if clipping acted on some steps and not on others, and the model learned.
    all_norms = [n for losses, norms in expected.values() for n in norms]
    assert min(all_norms) < settings["clipping"] < max(all_norms), all_norms


def test_the_reference_learned(job):
    """The loss on one fixed batch (the whole data set) is lower after the reference's steps than before."""
    runs, init = job
    for grad_accum in GRAD_ACCUMS:
        net, x, y = load_init(init)
        before = torch.nn.functional.mse_loss(net(x), y).item()
        train_reference(net, x, y, runs["settings"], grad_accum)
        with torch.no_grad():
            assert torch.nn.functional.mse_loss(net(x), y).item() < before, grad_accum
