"""The NLP recipe as a user runs it: ``python recipes/nlp/train.py`` and ``accelerate launch ... train_accelerate.py``.

Every multi-process test starts the real scripts as subprocesses with 2 CPU processes and real DeepSpeed ZeRO-3
(gloo), on options a user has too: a small corpus folder (``data=``), a short ``seq_len``, a few ``max_steps``.
Checked:
- both entry points write the whole run directory with the same ``summary.json`` keys;
- ``final/`` loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` and reproduces the trained model: its loss on
  the validation blocks equals the ``val_loss`` the trained (sharded) model measured, within bf16 tolerance, and
  the recipe's own logits comparison on a fixed batch passed;
- both backends compute the same per-step losses (bf16, rtol 1e-5: one factory, one init, one data order);
- in fp32, the per-step losses after ``resume=true`` equal the uninterrupted run's (rtol 1e-5), on both backends;
- a local model folder is loaded under ZeRO-3 already partitioned (each rank holds about half the elements
  right after construction) and starts from the trained weights, not from a random init;
- bad input (missing data, empty corpus, corrupt tokenizer, unknown key, existing out_dir) is one ``error:``
  line, exit code 2, and no file created or changed;
- ``--describe`` prints the run as the planning tools read it (parameter counts against a model built for real or
  the Llama formula, the factory's DeepSpeed dict) without reading the corpus or writing anything.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _util import PYTHON, REPO, accelerate_launch, check_async_saves, describe, one_error, read_json, recipe_module, run
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import config_to_dict, load_config
from common.describe import RecipeDescription
from common.rundir import read_metrics
from common.strategy import write_accelerate_files
from nlp.data import build_lm_datasets, stdlib_source_files
from nlp.model import build_llama_config, build_model_from_config, llama_param_count

RECIPE = REPO / "recipes" / "nlp"
TRAIN = RECIPE / "train.py"
TRAIN_ACCELERATE = RECIPE / "train_accelerate.py"
# Every key of summary.json, in order (docs/nlp.md, the benches and test_multinode read them): the same on both
# backends.
SUMMARY_KEYS = [
    "val_loss",
    "val_perplexity",
    "initial_val_loss",
    "val_loss_ratio",
    "throughput",
    "mfu",
    "peak_memory_bytes",
    "memory_kind",
    "model_state_bytes_per_rank",
    "wall_time_s",
    "preset",
    "zero_stage",
    "stage3_param_persistence_threshold",
    "world_size",
    "attention",
    "precision",
    "model",
    "backend",
    "steps",
    "tokens_per_step",
    "median_step_s",
    "model_state_bytes_measured",
    "memory_plan",
    "params_at_construction",
    "data",
    "export_check",
    "sample",
    "pipeline",  # train_pipeline.py's layout; None from these two entry points
    "moe",  # a MoE model's routing and aux loss; None for the dense default
]
# Small but real: a folder of standard-library modules, short sequences, a few steps (vocab stays 4096, so the
# embedding and output matrices are above the 1e6 persistence threshold and really sharded).
TINY = [
    "seq_len=64",
    "micro_batch_size=2",
    "max_val_tokens=2048",
    "eval_interval=2",
    "checkpoint_interval=2",
    "log_interval=1",
    "sample_tokens=8",
    "warmup_steps=10",
    "min_lr_ratio=1.0",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 400 kB of standard-library source as a folder of files: the ``data=folder`` path of the recipe."""
    folder = tmp_path_factory.mktemp("corpus")
    files = [f for f in stdlib_source_files() if 8_000 < f.stat().st_size < 40_000][:24]
    for i, f in enumerate(files):
        shutil.copy(f, folder / f"{i:02d}_{f.name}")
    return folder


def lightning(args: list, **kw):
    return run([PYTHON, TRAIN, *args], timeout=600, **kw)


def accelerate(args: list, **kw):
    return accelerate_launch(TRAIN_ACCELERATE, [str(a) for a in args], RECIPE / "accelerate.yaml", **kw)


def losses(out_dir: Path, key: str = "train_loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(out_dir) if key in r}


# --- fast: configs and shipped files --------------------------------------------------------------


def test_every_shipped_config_loads_and_opens_with_launch_commands():
    rc = recipe_module(RECIPE, "nlp_config")
    # finetune*.yaml belong to finetune.py (tests/recipes/test_finetune_recipe.py)
    names = sorted(p.name for p in (RECIPE / "configs").glob("*.yaml") if not p.name.startswith("finetune"))
    assert names == [
        "llama_125m.yaml",
        "llama_1b.yaml",
        "llama_7b.yaml",
        "llama_8b_long.yaml",
        "mixtral_8x7b.yaml",
        "tiny_cpu.yaml",
    ]
    assert rc.DEFAULT_CONFIG.name == "tiny_cpu.yaml"
    for name in names:
        path = RECIPE / "configs" / name
        cfg = load_config(rc.NLPConfig, path)
        # DeepSpeed's MoE layer refuses ZeRO-3: the Mixtral config runs ZeRO-2 (docs/moe.md)
        assert cfg.preset == ("deepspeed_stage_2" if cfg.moe else "nlp"), name
        header = path.read_text().split("\n\n")[0]
        assert "python recipes/nlp/train.py" in header and "accelerate launch" in header, name
    assert load_config(rc.NLPConfig, rc.DEFAULT_CONFIG) == rc.NLPConfig()  # the YAML states the dataclass defaults


def test_accelerate_files_are_the_factorys_output_for_the_default_config(tmp_path, monkeypatch):
    config_module, pretraining = recipe_module(RECIPE, "nlp_config"), recipe_module(RECIPE, "pretraining")
    cfg = load_config(config_module.NLPConfig, config_module.DEFAULT_CONFIG)
    ds_config = pretraining.resolve_ds_config(cfg, 2, pretraining.hidden_size(cfg))
    assert (RECIPE / "ds_config.json").read_text() == json.dumps(ds_config, indent=2) + "\n"
    assert ds_config["zero_optimization"]["stage"] == 3
    assert ds_config["zero_optimization"]["stage3_param_persistence_threshold"] == 1_000_000
    # The whole YAML, header included, as the factory writes it from the repository root (paths as typed there).
    shipped = (RECIPE / "accelerate.yaml").read_text()
    regenerate = next(line for line in shipped.splitlines() if "zero-recipes config" in line).lstrip("# ")
    monkeypatch.chdir(tmp_path)
    written = write_accelerate_files(
        ds_config,
        "recipes/nlp",
        num_processes=2,
        script="recipes/nlp/train_accelerate.py",
        regenerate=regenerate,
    )
    assert written.read_text() == shipped
    assert yaml.safe_load(shipped)["deepspeed_config"]["deepspeed_config_file"] == "recipes/nlp/ds_config.json"


def test_print_config_shows_overrides():
    proc = run([PYTHON, TRAIN, "--print-config", "max_steps=7", "model=125m"], timeout=120)
    assert "max_steps: 7\n" in proc.stdout and "model: 125m\n" in proc.stdout


# --- fast: --describe, what the planning tools read -------------------------------------------------


@pytest.mark.parametrize("script", [TRAIN, TRAIN_ACCELERATE], ids=["lightning", "accelerate"])
def test_describe_counts_the_default_model_without_reading_data_or_writing(tmp_path, script):
    out_dir = tmp_path / "run"
    # data= names nothing: the description must not read the corpus (the vocabulary is vocab_size).
    printed = describe(script, f"out_dir={out_dir}", f"data={tmp_path / 'no_such_corpus'}")
    assert not out_dir.exists() and list(tmp_path.iterdir()) == []
    description = RecipeDescription.from_json(printed)
    cfg = load_config(
        recipe_module(RECIPE, "nlp_config").NLPConfig,
        None,
        [f"out_dir={out_dir}", f"data={tmp_path / 'no_such_corpus'}"],
    )
    assert description.recipe == "nlp" and description.config == config_to_dict(cfg)
    assert (description.world_size, description.devices_per_node, description.num_nodes) == (2, 2, 1)
    assert (description.seq_len, description.micro_batch_size) == (256, 4)
    assert description.ds_config == read_json(RECIPE / "ds_config.json")  # the factory's dict for this run
    # Reference: the tiny model built for real (fp32 weights on the CPU), counted parameter by parameter.
    model = build_model_from_config(build_llama_config("tiny", vocab_size=4096, seq_len=256))
    numels = [p.numel() for p in model.parameters()]
    facts = description.model
    assert facts.num_params == sum(numels) == 5_261_568
    assert sorted(facts.param_numels) == sorted(numels)
    assert (facts.hidden_size, facts.num_layers, facts.num_heads, facts.vocab_size) == (256, 4, 4, 4096)
    # Under the nlp preset's 1e6 threshold every matrix but the embedding and output ones stays whole (docs/nlp.md).
    assert description.persistent_params == sum(n for n in numels if n <= 1_000_000) == 3_164_416


def test_describe_follows_the_overrides_and_the_named_size():
    facts = describe(TRAIN, "model=1b", "devices=8", "num_nodes=2", "vocab_size=32000", "seq_len=2048")
    assert (facts["world_size"], facts["devices_per_node"], facts["num_nodes"]) == (16, 8, 2)
    assert facts["ds_config"]["train_batch_size"] == 16 * 4
    assert facts["seq_len"] == 2048 and facts["model"]["num_kv_heads"] == 4
    # Reference: the Llama parameter formula (nlp.model), not the meta-device count the recipe prints.
    config = build_llama_config("1b", vocab_size=32000, seq_len=2048)
    assert facts["model"]["num_params"] == llama_param_count(config) == 1_100_048_384


def test_describe_with_an_unknown_key_is_one_clear_error():
    proc = run([PYTHON, TRAIN, "--describe", "max_step=3"], timeout=120, check=False)
    assert "did you mean 'max_steps'" in one_error(proc) and proc.stdout == ""


# --- fast: bad input, one line and nothing touched -------------------------------------------------


def _bad_inputs(tmp_path: Path, corpus: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp_path / "empty_corpus"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_text("  \n\n")
    corrupt = tmp_path / "corrupt_tokenizer"
    corrupt.mkdir()
    (corrupt / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    (corrupt / "tokenizer_config.json").write_text("{}")
    return {
        "missing data": ([f"data={tmp_path / 'no_such_corpus'}"], "data not found"),
        "empty corpus": ([f"data={empty}"], "empty corpus"),
        "corrupt tokenizer": ([f"data={corpus}", f"tokenizer={corrupt}"], "corrupt or unreadable tokenizer"),
        "unknown key": (["max_step=3"], "did you mean 'max_steps'"),
    }


@pytest.mark.parametrize("case", ["missing data", "empty corpus", "corrupt tokenizer", "unknown key"])
def test_bad_input_is_one_error_line_and_creates_nothing(case, tmp_path, corpus):
    args, message = _bad_inputs(tmp_path, corpus)[case]
    out_dir = tmp_path / "run"
    assert message in one_error(lightning([f"out_dir={out_dir}", *args], check=False))
    assert not out_dir.exists()


def test_existing_out_dir_is_refused_and_left_untouched(tmp_path, corpus):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "summary.json").write_text('{"val_loss": 1.0}')
    before = (out_dir / "summary.json").stat().st_mtime_ns
    assert "overwrite=true" in one_error(lightning([f"out_dir={out_dir}", f"data={corpus}"], check=False))
    assert sorted(p.name for p in out_dir.iterdir()) == ["summary.json"]
    assert (out_dir / "summary.json").stat().st_mtime_ns == before


# --- slow: real 2-process ZeRO-3 runs -------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory, corpus):
    out_dir = tmp_path_factory.mktemp("nlp") / "lightning"
    # async_save: the step-4 checkpoint is written in the background and published before final/ (check_run_dir)
    proc = lightning([f"out_dir={out_dir}", f"data={corpus}", "max_steps=4", "async_save=true", *TINY])
    return out_dir, proc


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory, corpus):
    out_dir = tmp_path_factory.mktemp("nlp") / "accelerate"
    proc = accelerate([f"out_dir={out_dir}", f"data={corpus}", "max_steps=4", "async_save=true", *TINY])
    return out_dir, proc


def check_run_dir(out_dir: Path, backend: str) -> dict:
    for name in ("config.yaml", "ds_config.json", "env.json", "metrics.jsonl", "summary.json", "tokenizer"):
        assert (out_dir / name).exists(), name
    assert any((out_dir / "tb").iterdir())
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == "step_000004"
    assert not list((out_dir / "checkpoints").glob(".tmp-*"))  # nothing left in flight
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (out_dir / "final").iterdir()}
    ds_config = read_json(out_dir / "ds_config.json")
    assert ds_config["zero_optimization"]["stage"] == 3
    summary = read_json(out_dir / "summary.json")
    assert list(summary) == SUMMARY_KEYS, list(summary)
    assert summary["backend"] == backend and summary["preset"] == "nlp" and summary["zero_stage"] == 3
    assert summary["world_size"] == 2 and summary["attention"] == "sdpa" and summary["precision"] == "bf16"
    assert summary["throughput"]["unit"] == "tokens/s/device" and summary["throughput"]["value"] > 0
    assert summary["mfu"] is None  # no GPU, no made-up peak
    assert summary["peak_memory_bytes"] > 0 and summary["model_state_bytes_per_rank"] > 0
    assert math.isclose(summary["val_perplexity"], math.exp(summary["val_loss"]), rel_tol=1e-9)
    assert summary["val_loss"] < summary["initial_val_loss"]
    # ZeRO-3 really shards: right after construction a rank holds about half of every parameter.
    held = summary["params_at_construction"]
    assert 0.45 * held["num_params"] <= held["elements_on_rank0"] <= 0.55 * held["num_params"]
    assert summary["export_check"]["ok"], summary["export_check"]
    assert summary["sample"].startswith("    def __init__(self")
    assert sorted(losses(out_dir)) == [1, 2, 3, 4]
    return summary


def check_final_loads(out_dir: Path, corpus: Path, summary: dict) -> None:
    """Load final/ as a user does and recompute the trained model's validation loss on the same blocks."""
    model = AutoModelForCausalLM.from_pretrained(out_dir / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(out_dir / "final")
    assert model.dtype == torch.bfloat16 and len(tokenizer) == model.config.vocab_size
    data = build_lm_datasets(corpus, tokenizer, seq_len=64, max_val_tokens=2048)
    blocks = data.val.blocks[: len(data.val) // 2 * 2]  # what the two ranks evaluated together
    with torch.no_grad():
        logits = model(input_ids=blocks[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten()).item()
    assert math.isclose(loss, summary["val_loss"], rel_tol=5e-3), (loss, summary["val_loss"])
    check = summary["export_check"]  # the recipe's own comparison: the trained engine's logits vs the reload's
    assert check["max_abs_logit_diff"] <= 2**-6 * max(1.0, check["max_abs_logit"]), check


@pytest.mark.slow
def test_lightning_run_writes_the_run_directory_and_a_loadable_final(lightning_run, corpus):
    out_dir, proc = lightning_run
    assert "memory plan: ZeRO-3" in proc.stdout and "memory measured" in proc.stdout
    assert proc.stdout.index("memory plan") < proc.stdout.index("step 0: val_loss")
    summary = check_run_dir(out_dir, "lightning")
    assert summary["pipeline"] is None and summary["moe"] is None
    check_async_saves(out_dir, saved_steps=[2, 4])  # async_save=true: written in the background, published
    check_final_loads(out_dir, corpus, summary)


@pytest.mark.slow
def test_accelerate_run_writes_the_same_run_directory_and_trains_the_same(accelerate_run, lightning_run, corpus):
    out_dir, proc = accelerate_run
    assert "memory plan: ZeRO-3" in proc.stdout
    summary = check_run_dir(out_dir, "accelerate")
    check_async_saves(out_dir, saved_steps=[2, 4])  # async_save=true: written in the background, published
    check_final_loads(out_dir, corpus, summary)
    assert set(summary) == set(read_json(lightning_run[0] / "summary.json"))
    # One factory, one init, one data order: both backends compute the same steps.
    for key in ("train_loss", "val_loss"):
        expected = losses(lightning_run[0], key)
        for step, value in losses(out_dir, key).items():
            assert math.isclose(value, expected[step], rel_tol=1e-5), (key, step, value, expected[step])


@pytest.fixture(scope="module")
def fp32_straight(tmp_path_factory, corpus):
    """The uninterrupted fp32 run that resumed runs must reproduce."""
    out_dir = tmp_path_factory.mktemp("nlp") / "straight"
    lightning([f"out_dir={out_dir}", "max_steps=6", f"data={corpus}", "precision=fp32", "checkpoint_interval=3", *TINY])
    return out_dir


def check_resumed(split: Path, straight: Path) -> None:
    expected, resumed = losses(straight), losses(split)
    assert sorted(resumed) == list(range(1, 7))
    for step in range(4, 7):
        assert math.isclose(resumed[step], expected[step], rel_tol=1e-5), (step, resumed[step], expected[step])
    assert math.isclose(losses(split, "val_loss")[6], losses(straight, "val_loss")[6], rel_tol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
def test_fp32_resume_gives_the_uninterrupted_losses(backend, fp32_straight, tmp_path, corpus):
    launch = lightning if backend == "lightning" else accelerate
    split = tmp_path / "split"
    common = [f"out_dir={split}", f"data={corpus}", "precision=fp32", "checkpoint_interval=3", *TINY]
    launch([*common, "max_steps=3"])  # stopped after step 3; its checkpoint is checkpoints/step_000003
    launch([*common, "max_steps=6", "resume=true"])
    check_resumed(split, fp32_straight)  # (the Accelerate run is checked against Lightning's: same math)


@pytest.mark.slow
def test_pretrained_folder_loads_partitioned_and_keeps_its_weights(lightning_run, tmp_path, corpus):
    trained, _ = lightning_run
    out_dir = tmp_path / "continued"
    lightning([f"out_dir={out_dir}", f"data={corpus}", f"model={trained / 'final'}", "max_steps=2", *TINY])
    summary = read_json(out_dir / "summary.json")
    held = summary["params_at_construction"]
    assert 0.45 * held["num_params"] <= held["elements_on_rank0"] <= 0.55 * held["num_params"]
    # The tokenizer came from the model folder and the weights are the trained ones: step 0 starts where the
    # first run ended (bf16), not at the ~ln(vocab) of a random init.
    vocab = read_json(trained / "env.json")["data"]["vocab_size"]
    assert read_json(out_dir / "env.json")["data"]["vocab_size"] == vocab
    assert math.isclose(summary["initial_val_loss"], read_json(trained / "summary.json")["val_loss"], rel_tol=2e-2)


@pytest.mark.slow
def test_accelerate_refuses_an_existing_out_dir(tmp_path, corpus):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = accelerate([f"out_dir={out_dir}", f"data={corpus}"], check=False)
    assert proc.returncode != 0
    assert "error: out_dir" in proc.stderr and "overwrite=true" in proc.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == ["metrics.jsonl"]
    assert (out_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
