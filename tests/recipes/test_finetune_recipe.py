"""The fine-tuning recipe as a user runs it: ``python recipes/nlp/finetune.py`` and its Accelerate twin.

The multi-process tests start the real scripts with 2 CPU processes and real DeepSpeed ZeRO-3 (gloo) on a base
model made here (a 2-layer Llama saved with ``save_pretrained`` and a BPE tokenizer trained on a few standard-library
files), never on ``runs/``. ``stage3_param_persistence_threshold=0`` forces every LoRA matrix to be partitioned:
with the preset's threshold, small adapters stay whole on every rank and a save without gathering would look
complete (docs/design.md). Each backend runs once with full activation checkpointing on the frozen base and is resumed
once. The Lightning run is long enough to learn: it starts from a briefly pretrained copy of the base (next-token
loss on the same files, in the test) and trains 150 steps, so that it also backs docs/finetune.md's claim. Checked:
- every saved adapter tensor has its whole shape and a non-zero norm, their count equals the trainable tensors and
  their elements ``trainable_params``; ``PeftModel(base, adapter/)`` gives the trained (sharded) model's logits
  (the recipe's check) and ``merged/`` the same logits as base + adapter (checked here, outside the recipe);
- checkpoints hold no frozen weights: a small fraction of a full checkpoint's bytes;
- fine-tuning works: held-out exact match, recomputed here by a plain greedy loop on ``merged/`` and on the base,
  beats ``max(base, always-the-most-common-answer)`` by at least ``MIN_GAIN``, and ``summary.json`` reports the same
  figures (``base_val_accuracy``, ``majority_baseline_accuracy``, ``val_accuracy``, ``accuracy_gain``);
- model states per rank (``model_state_bytes_per_rank``, ZeRO-3 + full checkpointing + LoRA: DeepSpeed #8148's
  case) within 5 % of ``zero-recipes estimate --lora-rank 4`` for the same model and 2 ranks;
- ``resume=true`` continues from the checkpoint (steps after it are logged, the step before it is not redone);
- checkpoints are saved with ``async_save=true``: the published folder holds every rank's ``.written-rank`` marker
  and ``base_model.json``, and each save logged ``checkpoint_blocked_s``;
- bad input (missing base model, malformed JSONL line, unknown target module, FlashAttention on a CPU) is one
  ``error:`` line, exit code 2, and no run directory;
- ``--describe`` prints one JSON object whose model facts are the saved base model's (counted here on its real
  weights) and whose DeepSpeed dict is the factory's, and writes nothing; after a run, it equals the run's
  ``ds_config.json`` and ``config.yaml``.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from _util import PYTHON, REPO, accelerate_launch, check_async_saves, read_json, recipe_module, run, save_tiny_llama

RECIPE = REPO / "recipes" / "nlp"
FINETUNE = RECIPE / "finetune.py"
FINETUNE_ACCELERATE = RECIPE / "finetune_accelerate.py"
SUMMARY_KEYS = {
    "val_accuracy",
    "base_val_accuracy",
    "majority_baseline_accuracy",
    "val_loss",
    "trainable_params",
    "throughput",
    "peak_memory_bytes",
    "attention",
    "zero_stage",
    "world_size",
    "adapter_check",
    "adapter_logits_check",
    "checkpoint_bytes",
    "checkpoint_fraction_of_full",
}
# Small but real: 4 steps of 2 examples per rank, LoRA r 4 on every projection, every adapter matrix partitioned;
# checkpoints written in the background (async_save), base_model.json with them.
TINY = [
    "async_save=true",
    "n_train=64",
    "n_val=8",
    "micro_batch_size=2",
    "max_steps=4",
    "eval_interval=2",
    "checkpoint_interval=2",
    "log_interval=1",
    "warmup_steps=1",
    "lora_r=4",
    "lora_alpha=8",
    "max_new_tokens=2",
    "activation_checkpointing=full",
    'ds_overrides=["zero_optimization.stage3_param_persistence_threshold=0"]',
]
# Long enough to learn the built-in task from the pretrained base: 150 steps of 8 examples per rank, 64 held-out
# headers, same ZeRO-3, LoRA r 4 and checkpointing (`pytest -s` prints the figures; 0.3 gain needs about 0.46).
LEARN = [
    *TINY,
    "n_train=1024",
    "n_val=64",
    "micro_batch_size=8",
    "max_steps=150",
    "warmup_steps=10",
    "lr=4e-3",
    "eval_interval=50",
    "checkpoint_interval=50",
]
LEARN_STEPS = 150
MIN_GAIN = 0.3  # the fine-tuning bar: held-out exact match over max(base, majority answer)
STATE_BYTES_RTOL = 0.05  # model_state_bytes_per_rank against `zero-recipes estimate --lora-rank`
PRETRAIN_STEPS = 500  # next-token steps that turn the random base into one with useful features (about 25 s)
EXE = shutil.which("zero-recipes")


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """A 2-layer Llama (about 150k parameters) and its BPE tokenizer, saved as a Hugging Face folder."""
    return save_tiny_llama(tmp_path_factory.mktemp("base"), source_files=12)


@pytest.fixture(scope="module")
def pretrained_base(base_model, tmp_path_factory) -> Path:
    """``base_model`` after ``PRETRAIN_STEPS`` of next-token training on its tokenizer's files (batch 8 x 128).

    A random base gives LoRA nothing to build on (logits barely move from its random head); a short pretraining
    makes it a small real base, as ``python recipes/nlp/train.py`` makes the default one, in a fraction of the time.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nlp.data import read_files, stdlib_source_files

    folder = tmp_path_factory.mktemp("pretrained")
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    files = [f for f in stdlib_source_files() if 8_000 < f.stat().st_size < 40_000][:12]
    ids = torch.tensor(tokenizer("\n".join(read_files(files)))["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(base_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(PRETRAIN_STEPS):
        starts = torch.randint(0, len(ids) - 129, (8,), generator=generator)
        batch = torch.stack([ids[i : i + 129] for i in starts])
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def lightning(args: list, **kw):
    return run([PYTHON, FINETUNE, *map(str, args)], timeout=600, **kw)


def accelerate(args: list, **kw):
    return accelerate_launch(FINETUNE_ACCELERATE, [str(a) for a in args], RECIPE / "accelerate_finetune.yaml", **kw)


# --- fast: configs and shipped files --------------------------------------------------------------


def test_shipped_configs_load_and_the_default_states_the_dataclass():
    fc = recipe_module(RECIPE, "finetune_config")
    from common.config import load_config

    for path in sorted((RECIPE / "configs").glob("finetune*.yaml")):
        cfg = load_config(fc.FinetuneConfig, path)
        assert cfg.preset == "finetune"
        assert "python recipes/nlp/finetune.py" in path.read_text().split("\n\n")[0]
    assert load_config(fc.FinetuneConfig, fc.DEFAULT_CONFIG) == fc.FinetuneConfig()
    smoke = load_config(fc.FinetuneConfig, fc.DEFAULT_CONFIG, fc.SMOKE_OVERRIDES)  # `zero-recipes cp`'s smoke run
    assert smoke.max_steps <= 10 and smoke.n_train <= 100


def test_accelerate_files_are_the_factorys_output_for_the_default_config():
    fc, ft = recipe_module(RECIPE, "finetune_config"), recipe_module(RECIPE, "finetuning")
    from common.strategy import accelerate_config
    from nlp.model import LLAMA_SIZES

    # The default base is the NLP recipe's tiny Llama: hidden size 256 sizes the buckets and the threshold.
    ds_config = ft.resolve_ds_config(fc.FinetuneConfig(), 2, LLAMA_SIZES["tiny"]["hidden_size"])
    assert read_json(RECIPE / "ds_config_finetune.json") == ds_config
    assert ds_config["zero_optimization"]["stage"] == 3
    shipped = yaml.safe_load((RECIPE / "accelerate_finetune.yaml").read_text())
    assert shipped == accelerate_config("recipes/nlp/ds_config_finetune.json", 2, zero3_init=True)


def describe(script: Path, args: list, **kw):
    """``script --describe args``: the planning tools' only way into the recipe."""
    return run([PYTHON, script, "--describe", *map(str, args)], timeout=300, **kw)


def test_describe_counts_the_base_model_and_resolves_the_factorys_dict_without_writing(tmp_path, base_model):
    from transformers import AutoModelForCausalLM

    from common.describe import RecipeDescription
    from common.strategy import RunFacts, resolve_deepspeed_config

    out_dir = tmp_path / "run"
    proc = describe(FINETUNE, [f"model={base_model}", f"out_dir={out_dir}", "micro_batch_size=3"], cwd=tmp_path)
    description = RecipeDescription.from_json(json.loads(proc.stdout))  # stdout is one JSON object, nothing else
    assert list(tmp_path.iterdir()) == []  # no out_dir, nothing in the working directory
    assert description.recipe == "nlp:finetune" and description.config["model"] == str(base_model)
    assert (description.world_size, description.devices_per_node, description.num_nodes) == (2, 2, 1)
    assert (description.seq_len, description.micro_batch_size) == (128, 3)
    # References: the saved base loaded with its weights, and the factory called directly for 2 ranks.
    base = AutoModelForCausalLM.from_pretrained(base_model, local_files_only=True)
    numels = [p.numel() for p in base.parameters()]
    facts = description.model
    assert facts.num_params == sum(numels) and sorted(facts.param_numels) == sorted(numels)
    assert (facts.hidden_size, facts.num_layers, facts.num_heads) == (64, 2, 4)
    assert facts.vocab_size == base.config.vocab_size
    run_facts = RunFacts(world_size=2, micro_batch_size=3, precision="bf16", hidden_size=64, gradient_clipping=1.0)
    ds_config = resolve_deepspeed_config("finetune", run_facts)
    assert description.ds_config == ds_config
    threshold = ds_config["zero_optimization"]["stage3_param_persistence_threshold"]
    assert description.persistent_params == sum(n for n in numels if n <= threshold) > 0


# --- fast: bad input, one line and nothing written -------------------------------------------------


def _one_error(proc, out_dir: Path, exit_code: int = 2) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out_dir.exists()
    return errors[0]


def test_missing_base_model_names_the_command_that_makes_it(tmp_path):
    out_dir = tmp_path / "run"
    line = _one_error(lightning([f"out_dir={out_dir}", "model=runs/nlp/final"], check=False, cwd=tmp_path), out_dir)
    assert "base model runs/nlp/final not found" in line and "`python recipes/nlp/train.py`" in line
    line = _one_error(lightning([f"out_dir={out_dir}", f"model={tmp_path / 'nope'}"], check=False), out_dir)
    assert "nope not found" in line


def test_malformed_jsonl_names_its_line(tmp_path, base_model):
    data = tmp_path / "data.jsonl"
    good = json.dumps({"instruction": "Say hi.", "output": "hi"})
    data.write_text(f"{good}\n{good}\n{{'instruction': 'single quotes'}}\n")
    out_dir = tmp_path / "run"
    line = _one_error(lightning([f"out_dir={out_dir}", f"model={base_model}", f"data={data}"], check=False), out_dir)
    assert f"{data}:3: invalid JSON" in line


def test_unknown_target_module_names_the_nearest(tmp_path, base_model):
    out_dir = tmp_path / "run"
    args = [f"out_dir={out_dir}", f"model={base_model}", "lora_targets=q_proj,vproj"]
    line = _one_error(lightning(args, check=False), out_dir)
    assert "'vproj' (did you mean 'v_proj'?)" in line


def test_flash_attention_on_a_cpu_says_why(tmp_path, base_model):
    out_dir = tmp_path / "run"
    args = [f"out_dir={out_dir}", f"model={base_model}", "attention=flash_attention_2"]
    line = _one_error(lightning(args, check=False), out_dir)
    assert "flash-attn is not installed" in line and "no GPU (device is cpu)" in line


def test_describe_with_a_bad_key_or_no_base_model_is_one_error_line(tmp_path, base_model):
    proc = describe(FINETUNE, [f"model={base_model}", "lora_rr=4"], check=False, cwd=tmp_path)
    assert "unknown key 'lora_rr' (did you mean 'lora_r'?)" in _one_error(proc, tmp_path / "runs")
    assert proc.stdout == ""
    proc = describe(FINETUNE_ACCELERATE, [], check=False, cwd=tmp_path)  # runs/nlp/final is not in tmp_path
    # A missing input is exit code 3 (not 2): lint then checks the config without the model (common.errors).
    assert "`python recipes/nlp/train.py`" in _one_error(proc, tmp_path / "runs", exit_code=3)
    assert proc.stdout == ""


# --- slow: ZeRO-3 + LoRA + activation checkpointing on 2 processes, then resume, per backend ----------------


def check_run(out_dir: Path, base_model: Path, backend: str) -> dict:
    """The run directory, the adapter read back here, and merged/ against base + adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    summary = read_json(out_dir / "summary.json")
    assert set(summary) >= SUMMARY_KEYS, SUMMARY_KEYS - set(summary)
    assert summary["backend"] == backend and summary["zero_stage"] == 3 and summary["world_size"] == 2
    assert summary["attention"] == "sdpa" and summary["activation_checkpointing"] == "full"
    assert summary["stage3_param_persistence_threshold"] == 0  # every adapter matrix was partitioned
    # 2 layers x 7 projections x (A, B); trainable_params counted on the model, elements counted in the file.
    adapter = load_file(str(out_dir / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == summary["adapter_check"]["trainable_tensors"] == 28
    assert sum(t.numel() for t in adapter.values()) == summary["trainable_params"]
    for name, tensor in adapter.items():
        assert tensor.dim() == 2 and 4 in tensor.shape and min(tensor.shape) > 0, (name, tensor.shape)
        assert tensor.float().norm() > 0, name
    assert summary["adapter_logits_check"]["ok"], summary["adapter_logits_check"]
    # merged/ is base + adapter folded into the weights: same logits, loaded as a plain transformers model.
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_model, local_files_only=True)
        with_adapter = PeftModel.from_pretrained(base, out_dir / "adapter").eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out_dir / "merged", local_files_only=True).eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, with_adapter, rtol=1e-4, atol=1e-4)
    # No frozen weights in checkpoints: far below the 14 B/param of a full-parameter ZeRO checkpoint.
    assert summary["checkpoint_fraction_of_full"] < 0.35, summary["checkpoint_bytes"]
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and summary["val_loss"] > 0 and summary["wall_time_s"] > 0
    return summary


def check_checkpoints(out_dir: Path, saved_steps: list[int]) -> None:
    """Published by the background writers of every rank, with the frozen base's reference (compared on resume)."""
    latest = check_async_saves(out_dir, saved_steps)
    assert read_json(latest / "base_model.json")["sha256"], latest


def check_resume(out_dir: Path, proc, first_steps: int = 4) -> None:
    from common.rundir import read_metrics

    steps = [r["step"] for r in read_metrics(out_dir) if "train_loss" in r]
    # Steps 1..first_steps from the first run, two more after resuming at its last checkpoint.
    assert steps == list(range(1, first_steps + 3)), steps
    assert (out_dir / "checkpoints" / f"step_{first_steps + 2:06d}").is_dir()


def greedy_answer(model, tokenizer, example: dict, max_new_tokens: int) -> str:
    """One prompt, no padding, argmax token by token: a scorer that shares nothing with the recipe's batched one."""
    from nlp.task import format_prompt

    ids = [tokenizer.bos_token_id, *tokenizer(format_prompt(example), add_special_tokens=False)["input_ids"]]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    return text.splitlines()[0].strip() if text else ""


def accuracy_of(folder: Path, tokenizer, examples: list[dict], max_new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, torch_dtype=torch.float32).eval()
    return sum(greedy_answer(model, tokenizer, e, max_new_tokens) == e["output"] for e in examples) / len(examples)


def check_gain(out_dir: Path, base: Path, summary: dict) -> None:
    """Held-out exact match of merged/ and of the base, scored here, and the majority answer counted here."""
    from transformers import AutoTokenizer

    from nlp.data import stdlib_source_files
    from nlp.task import make_arg_count_task

    cfg = yaml.safe_load((out_dir / "config.yaml").read_text())  # the resolved config the run saved
    _, val = make_arg_count_task(stdlib_source_files(), n_train=cfg["n_train"], n_val=cfg["n_val"], seed=0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    majority = Counter(e["output"] for e in val).most_common(1)[0][1] / len(val)
    base_accuracy = accuracy_of(base, tokenizer, val, cfg["max_new_tokens"])
    tuned_accuracy = accuracy_of(out_dir / "merged", tokenizer, val, cfg["max_new_tokens"])
    print(f"exact match: base {base_accuracy:.3f}, majority {majority:.3f}, fine-tuned {tuned_accuracy:.3f}")
    assert tuned_accuracy - max(base_accuracy, majority) >= MIN_GAIN, (tuned_accuracy, base_accuracy, majority)
    # The run reports what it measured; the batched, left-padded scorer may flip a near-tie or two.
    assert summary["majority_baseline_accuracy"] == majority
    assert abs(summary["base_val_accuracy"] - base_accuracy) <= 2 / len(val), summary["base_val_accuracy"]
    assert abs(summary["val_accuracy"] - tuned_accuracy) <= 2 / len(val), summary["val_accuracy"]
    expected_gain = summary["val_accuracy"] - max(summary["base_val_accuracy"], majority)
    assert summary["accuracy_gain"] == pytest.approx(expected_gain) and summary["accuracy_gain"] >= MIN_GAIN


def check_state_bytes_against_the_planner(base: Path, summary: dict) -> None:
    """``model_state_bytes_per_rank`` (read off the engine) against what a user's ``estimate`` call predicts."""
    assert EXE, "zero-recipes is not installed: pip install -e ."
    args = ["--model-config", base / "config.json", "--lora-rank", 4, "--gpus", 2, "--gpu-memory", "80GB", "--json"]
    plan = json.loads(run([EXE, "estimate", *args]).stdout)
    (row,) = [r for r in plan["rows"] if r["stage"] == 3 and r["offload"] == "none"]
    measured = summary["model_state_bytes_per_rank"]
    print(f"model states per rank: measured {measured} B, estimate {row['model_states_bytes']:.0f} B")
    assert measured == pytest.approx(row["model_states_bytes"], rel=STATE_BYTES_RTOL), summary[
        "model_state_bytes_measured"
    ]


def check_refused_on_a_changed_base(launch, out_dir: Path, base: Path, args: list, code: int) -> None:
    """One weight of the frozen base changed, then resume: one error line naming the file; the run untouched.

    ``code``: the script exits 2; accelerate launch reports a failed rank as 1."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(base / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    before = {p.name: p.stat().st_mtime_ns for p in (out_dir / "checkpoints").iterdir()}
    proc = launch([f"out_dir={out_dir}", f"model={base}", *args], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == code and errors, proc.stderr[-2000:]
    assert "model.safetensors changed" in errors[0] and "base model" in errors[0], errors
    assert {p.name: p.stat().st_mtime_ns for p in (out_dir / "checkpoints").iterdir()} == before


@pytest.mark.slow
def test_lightning_zero3_lora_learns_the_task_saves_whole_adapters_and_resumes(tmp_path, pretrained_base):
    base = shutil.copytree(pretrained_base, tmp_path / "base")  # changed at the end
    out_dir = tmp_path / "run"
    lightning([f"out_dir={out_dir}", f"model={base}", *LEARN])
    summary = check_run(out_dir, base, "lightning")
    check_checkpoints(out_dir, [50, 100, LEARN_STEPS])
    check_gain(out_dir, base, summary)
    check_state_bytes_against_the_planner(base, summary)
    resume = [f"max_steps={LEARN_STEPS + 2}", "resume=true"]
    proc = lightning([f"out_dir={out_dir}", f"model={base}", *LEARN, *resume])
    check_resume(out_dir, proc, LEARN_STEPS)
    check_run(out_dir, base, "lightning")
    check_checkpoints(out_dir, [50, 100, LEARN_STEPS, LEARN_STEPS + 2])
    check_refused_on_a_changed_base(
        lightning, out_dir, base, [*LEARN, f"max_steps={LEARN_STEPS + 4}", "resume=true"], 2
    )


@pytest.mark.slow
def test_accelerate_zero3_lora_saves_whole_adapters_and_resumes(tmp_path, base_model):
    base_model = shutil.copytree(base_model, tmp_path / "base")  # changed at the end
    out_dir = tmp_path / "run"
    accelerate([f"out_dir={out_dir}", f"model={base_model}", *TINY])
    check_run(out_dir, base_model, "accelerate")
    check_checkpoints(out_dir, [2, 4])
    # What --describe tells the tools is what the run used.
    described = json.loads(describe(FINETUNE_ACCELERATE, [f"out_dir={out_dir}", f"model={base_model}", *TINY]).stdout)
    assert described["ds_config"] == read_json(out_dir / "ds_config.json")
    assert described["config"] == yaml.safe_load((out_dir / "config.yaml").read_text())
    proc = accelerate([f"out_dir={out_dir}", f"model={base_model}", *TINY, "max_steps=6", "resume=true"])
    check_resume(out_dir, proc)
    check_run(out_dir, base_model, "accelerate")
    check_checkpoints(out_dir, [2, 4, 6])
    check_refused_on_a_changed_base(accelerate, out_dir, base_model, [*TINY, "max_steps=8", "resume=true"], 1)
