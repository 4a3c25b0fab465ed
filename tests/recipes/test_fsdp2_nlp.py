"""The NLP recipe under the FSDP2 presets, run as a user runs it: fp32 on 2 processes, gradient accumulation 2,
clipping, 5 optimizer steps, through ``train.py`` (Lightning) and ``train_accelerate.py`` (Accelerate, launched
with the recipe's own ``accelerate.yaml``).

The model is a tiny Llama folder whose output matrix is its input embedding (``tie_word_embeddings``): both runs
load the same weights, and a tie lost by the sharding would change every loss from step 2 on. Each FSDP2 run is
compared with a ``deepspeed_stage_3`` run (real DeepSpeed sharding, same weights and batches): losses within 1e-5
relative at every step, logged gradient norms (before clipping) within 1e-4 (DeepSpeed's stage-3 norm of this model
differed from the global norm of FSDP2's shards by up to 2.2e-5 relative in a run whose losses agreed to the last
bit), and the ZeRO norm above the clipping threshold at every step so that clipping acts in both: this model's norms
stay near 1 (0.85-1.26 when clipping at 1.0, which then acted at 2 steps of 5), so it clips at 0.5. ``fsdp2_grad_op``
(ZeRO-2's counterpart) runs once, on Lightning, against the same reference: fp32 ZeRO-2 and ZeRO-3 give the same
losses (tests/distributed/test_fsdp2_equivalence.py).

The Accelerate ``fsdp2`` run saves DCP checkpoints in the background (``async_save=true``) at steps 3 and 5; a copy
of the step-3 one resumes on 1 process (the global batch kept) and must log steps 4-5 within 1e-6 of the 2-process
run. ``zero-recipes export`` of each FSDP2 run gives the Hugging Face folder the ZeRO run's export gives (the same
files, tensor names, shapes and dtypes, the tie left to the config), loaded by ``from_pretrained`` with the logits
of the run's own ``final/`` (whole weights gathered in the run, not read from the checkpoint).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from _util import PYTHON, REPO, accelerate_launch, run, tied_llama

from common.rundir import read_metrics
from common.tools.cli import main as cli_main

RECIPE = REPO / "recipes" / "nlp"
STEPS = 5
SAVED_STEP = 3
FP32_RTOL = 1e-5
NORM_RTOL = 1e-4
RESUME_RTOL = 1e-6
CLIP = 0.5
RUN = {
    "precision": "fp32",
    "max_steps": STEPS,
    "grad_accum": 2,
    "gradient_clipping": CLIP,
    "warmup_steps": 1,
    "min_lr_ratio": 1.0,
    "log_interval": 1,
    "eval_interval": 1000,
    "checkpoint_interval": SAVED_STEP,
    "data": "stdlib",
    "max_train_tokens": 20000,
    "max_val_tokens": 1024,
    "seq_len": 64,
    "micro_batch_size": 2,
    "sample_tokens": 0,
}
REFERENCE = ("lightning", "deepspeed_stage_3")
# (front-end, preset) of every FSDP2 run compared with the reference.
FSDP2_RUNS = [("lightning", "fsdp2"), ("accelerate", "fsdp2"), ("lightning", "fsdp2_grad_op")]
ASYNC_RUN = ("accelerate", "fsdp2")  # saves in the background: its step-3 checkpoint is the one resumed
pytestmark = pytest.mark.slow


def launch(front_end: str, out_dir: Path, processes: int = 2, **values) -> None:
    args = [f"{key}={value}" for key, value in {**RUN, "out_dir": out_dir, **values}.items()]
    if front_end == "lightning":
        run([PYTHON, RECIPE / "train.py", f"devices={processes}", *args], timeout=600)
    else:
        accelerate_launch(RECIPE / "train_accelerate.py", args, RECIPE / "accelerate.yaml", processes, timeout=600)


def logged(out_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out_dir) if "train_loss" in r}


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    """A tiny Llama whose output matrix is its input embedding, as a model folder (vocabulary of the trained BPE)."""
    folder = tmp_path_factory.mktemp("tied") / "model"
    tied_llama(hidden_size=64, vocab_size=4096, max_positions=256).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tied_model) -> dict[tuple[str, str], Path]:
    """(front-end, preset) -> run directory, for the reference and every FSDP2 run."""
    root = tmp_path_factory.mktemp("fsdp2-nlp")
    done = {}
    for front_end, preset in [REFERENCE, *FSDP2_RUNS]:
        out_dir = root / f"{front_end}-{preset}"
        launch(front_end, out_dir, preset=preset, model=tied_model, async_save=(front_end, preset) == ASYNC_RUN)
        done[front_end, preset] = out_dir
    return done


@pytest.mark.parametrize(("front_end", "preset"), FSDP2_RUNS)
def test_fsdp2_losses_and_norms_match_zero3(runs, front_end, preset):
    reference, actual = logged(runs[REFERENCE]), logged(runs[front_end, preset])
    assert sorted(reference) == sorted(actual) == list(range(1, STEPS + 1))
    for step in reference:
        expected, loss = reference[step]["train_loss"], actual[step]["train_loss"]
        assert abs(loss - expected) <= FP32_RTOL * abs(expected), (preset, front_end, step, loss, expected)
        expected, norm = reference[step]["grad_norm"], actual[step]["grad_norm"]
        assert math.isfinite(norm) and abs(norm - expected) <= NORM_RTOL * expected, (preset, front_end, step, norm)
    norms = [reference[step]["grad_norm"] for step in reference]
    assert min(norms) > CLIP, f"clipping must act at every step for the comparison to cover it: {norms}"
    summary = json.loads((runs[front_end, preset] / "summary.json").read_text())
    assert (summary["preset"], summary["backend"], summary["export_check"]["ok"]) == (preset, front_end, True)


def test_an_async_fsdp2_checkpoint_resumes_on_one_process(runs, tied_model, tmp_path):
    """DCP's shards of 2 ranks, re-sharded on load for 1; the global batch kept (4 sequences per micro-batch)."""
    whole = runs[ASYNC_RUN]
    assert not list((whole / "checkpoints").glob(".tmp-*"))
    assert (whole / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:06d}"
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "env.json", "tokenizer"):  # the run's own tokenizer (a resume trains none), env.json
        # after it: the ranks wait for env.json before they load the tokenizer
        copy = shutil.copytree if (whole / name).is_dir() else shutil.copy2
        copy(whole / name, resumed / name)
    name = f"step_{SAVED_STEP:06d}"
    shutil.copytree(whole / "checkpoints" / name, resumed / "checkpoints" / name)
    (resumed / "checkpoints" / "latest").write_text(name + "\n")
    launch(
        "accelerate",
        resumed,
        processes=1,
        preset="fsdp2",
        model=tied_model,
        micro_batch_size=4,
        resume="true",
        async_save="true",
    )
    expected, actual = logged(whole), logged(resumed)
    assert sorted(actual) == list(range(SAVED_STEP + 1, STEPS + 1)), actual  # the resumed process logged them
    for step in actual:
        loss, reference = actual[step]["train_loss"], expected[step]["train_loss"]
        assert abs(loss - reference) <= RESUME_RTOL * abs(reference), (step, loss, reference)


def export(*args) -> Path:
    """``zero-recipes export ...`` in this process (the console script's own entry point); the output folder."""
    assert cli_main(["export", *map(str, args), "--quiet"]) == 0
    return Path(args[1])


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for file in sorted(set(weight_map(folder).values())):
        found.update(load_file(str(folder / file)))
    return found


def logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    batch = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=batch).logits.float()


def test_export_of_an_fsdp2_run_is_the_hugging_face_folder_a_zero_run_gives(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    zero = export(runs[REFERENCE], tmp_path / "zero3")
    zero_tensors = tensors(zero)
    assert "lm_head.weight" not in zero_tensors  # the tie is left to the config
    for front_end, preset in FSDP2_RUNS[:2]:  # Lightning's DCP part (state_dict) and the Accelerate loop's (model)
        run_dir = runs[front_end, preset]
        out = export(run_dir, tmp_path / f"{front_end}-{preset}")
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in zero.iterdir()), front_end
        assert json.loads((out / "config.json").read_text()) == json.loads((zero / "config.json").read_text())
        found = tensors(out)
        assert {k: (v.shape, v.dtype) for k, v in found.items()} == {
            k: (v.shape, v.dtype) for k, v in zero_tensors.items()
        }, front_end
        # The logits of the run's final weights: final/ was gathered from the live shards at the end of the run.
        assert torch.equal(logits(out), logits(run_dir / "final")), front_end
        model = AutoModelForCausalLM.from_pretrained(out)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_export_verify_compares_an_fsdp2_checkpoint_with_torchs_own_reader(runs, tmp_path):
    out = tmp_path / "verified"
    proc = run(
        [PYTHON, "-m", "common.tools.cli", "export", runs["lightning", "fsdp2"], out, "--verify", "--dtype", "bf16"],
        timeout=300,
    )
    assert "exported FSDP2 (DCP) checkpoint" in proc.stdout and "(world size 2)" in proc.stdout, proc.stdout
    assert "verify against torch's dcp_to_torch_save: " in proc.stdout and "max abs difference 0;" in proc.stdout
    assert "logits of from_pretrained vs torch's reader's tensors: max abs difference 0" in proc.stdout, proc.stdout
