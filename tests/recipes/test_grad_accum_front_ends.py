"""With gradient accumulation, each recipe's Lightning and Accelerate entry points log the same gradient norm.

Lightning's automatic optimization divides the loss by the accumulation steps and DeepSpeed's ``engine.backward``
divides again unless the strategy stops it (``common.lightning_cpu.ZeroDeepSpeedStrategy.backward``): the gradient,
its logged norm and what clipping sees would be ``grad_accum`` times too small on Lightning only. AdamW hides it in
the loss curve; the gradient norm does not. Each recipe runs 3 fp32 steps on 2 processes through both entry points,
with accumulation 2 and with 4, and every step's ``grad_norm`` (DeepSpeed's, before clipping) and training loss must
agree within 1e-5 relative. The NLP runs also take the recipe's other loss paths: accumulation 2 on the MoE model
(the routers' load-balancing loss added to the LM loss, ZeRO-1), accumulation 4 with Ulysses sequence parallelism
(ZeRO-3, each sequence split over the 2 processes). The fine-tuning recipe's runs are in
``test_finetune_batch_cuts.py``.
"""

from __future__ import annotations

import pytest
from _util import PYTHON, REPO, accelerate_launch, assert_same_metric, recipe_module, run, tiny_fp32_run

STEPS = 3
NLP_RUN = [*tiny_fp32_run(STEPS), "max_val_tokens=256"]
CV_RUN = [f"max_steps={STEPS}", "precision=fp32", "micro_batch_size=4", "warmup_steps=2", "log_interval=1"]
# The science recipe's own smoke run (its SMOKE_OVERRIDES: a small grid and model), at fp32 and STEPS steps.
SCIENCE_SMOKE = recipe_module(REPO / "recipes" / "science", "science_config").SMOKE_OVERRIDES
SCIENCE_RUN = [*SCIENCE_SMOKE, f"max_steps={STEPS}", "precision=fp32", "micro_batch_size=2", "log_interval=1"]
# name: (recipe folder, the run's arguments, grad_accum, the loss key of metrics.jsonl)
CASES = {
    "nlp_moe_ga2": ("nlp", [*NLP_RUN, "model=moe_tiny", "preset=deepspeed_stage_1"], 2, "train_loss"),
    "nlp_sp2_ga4": ("nlp", [*NLP_RUN, "sequence_parallel=2"], 4, "train_loss"),
    "cv_ga2": ("cv", CV_RUN, 2, "train_loss"),
    "cv_ga4": ("cv", CV_RUN, 4, "train_loss"),
    "science_ga2": ("science", SCIENCE_RUN, 2, "train_rel_l2"),
    "science_ga4": ("science", SCIENCE_RUN, 4, "train_rel_l2"),
}


def launch(backend: str, folder: str, args: list[str]) -> None:
    recipe = REPO / "recipes" / folder
    if backend == "lightning":
        run([PYTHON, recipe / "train.py", "devices=2", *args], timeout=600)
    else:
        accelerate_launch(recipe / "train_accelerate.py", args, recipe / "accelerate.yaml", num_processes=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name)``: the case's folder, holding its ``lightning`` and ``accelerate`` run (launched on first use)."""
    root = tmp_path_factory.mktemp("grad_accum")
    cache = root / "burgers-cache"  # the science runs solve their data once

    def get(name: str):
        folder, args, grad_accum, _ = CASES[name]
        if not (root / name).is_dir():
            extra = [f"cache_dir={cache}"] if folder == "science" else []
            for backend in ("lightning", "accelerate"):
                out_dir = root / name / backend
                launch(backend, folder, [f"out_dir={out_dir}", *args, f"grad_accum={grad_accum}", *extra])
        return root / name

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_lightning_and_accelerate_log_the_same_gradient_norm(runs, name):
    lightning, accelerate = runs(name) / "lightning", runs(name) / "accelerate"
    for key in ("grad_norm", CASES[name][3]):
        assert_same_metric(lightning, accelerate, key, STEPS)
