"""The NLP recipe's parallel rules exist once: its start-up check and ``zero-recipes estimate`` refuse the same layouts.

Each bad layout goes to the recipe's start-up check (``nlp_layout.run_layout``, what ``--describe`` and every entry
point run before any work) and to ``zero-recipes estimate --recipe nlp`` with the same degrees as flags; both must
refuse it, each in its own vocabulary (``tensor_parallel=3`` against ``--tensor-parallel 3``). The ZeRO stages a
layout cannot run are refused by the recipe and marked as not fitting, with the same reason, in the planner's rows
(it plans every stage).
"""

from __future__ import annotations

import functools

import pytest
from _util import NLP_ENTRY_POINTS, NLP_RECIPE, PYTHON, accelerate_launch, recipe_module, run

from common.errors import ConfigError
from common.tools import memory
from common.tools.cli import main as cli_main

# name: (recipe keys, the entry point is train_pipeline.py, the words both errors share after the option)
BAD_LAYOUTS = {
    "tp_not_dividing_heads": ({"tensor_parallel": 3, "devices": 3}, False, "does not divide the model's 4 attention"),
    "pp_above_layers": ({"pipeline_parallel": 5, "devices": 5}, True, "is more than the model's 4 layers"),
    "pp_unequal_stages": ({"pipeline_parallel": 3, "devices": 3}, True, "does not split the model's 4 layers"),
    "ep_not_dividing_experts": (
        {"model": "moe_tiny", "expert_parallel": 3, "devices": 3},
        False,
        "does not divide the model's 4 experts",
    ),
    "ep_on_a_dense_model": ({"expert_parallel": 2, "devices": 2}, False, "needs a model with experts"),
    "world_tp": ({"tensor_parallel": 2, "devices": 3}, False, "does not divide the 3 rank(s)"),
    "world_tp_sp": (
        {"tensor_parallel": 2, "sequence_parallel": 2, "devices": 2},
        False,
        "= 4 ranks per replica does not divide the 2 rank(s)",
    ),
    "world_pp_sp": (
        {"pipeline_parallel": 2, "sequence_parallel": 2, "devices": 6},
        True,
        "= 4 ranks per replica does not divide the 6 rank(s)",
    ),
    "sp_not_dividing_heads": ({"sequence_parallel": 3, "devices": 3, "seq_len": 66}, False, "does not divide the 4"),
    "tp_with_sp": ({"tensor_parallel": 2, "sequence_parallel": 2, "devices": 4}, False, "does not run"),
    "tp_with_pp": ({"tensor_parallel": 2, "pipeline_parallel": 2, "devices": 4}, True, "with the pipeline engine"),
    "sp_with_pp": ({"sequence_parallel": 2, "pipeline_parallel": 2, "devices": 4}, True, "with the pipeline engine"),
    "tp_with_moe": (
        {"model": "moe_tiny", "tensor_parallel": 2, "devices": 2},
        False,
        "with a Mixture-of-Experts model does not run",
    ),
    "sp_with_moe": (
        {"model": "moe_tiny", "sequence_parallel": 2, "devices": 2},
        False,
        "with a Mixture-of-Experts model does not run",
    ),
    "ep_with_sp": (
        {"model": "moe_tiny", "expert_parallel": 2, "sequence_parallel": 2, "devices": 4},
        False,
        "is not modelled",
    ),
}
DEGREES = ("tensor_parallel", "pipeline_parallel", "expert_parallel", "sequence_parallel")


def recipe_check(keys: dict, pipeline_engine: bool) -> None:
    """The recipe's start-up check, in this process (ZeRO stage 1: every layout above is refused without it)."""
    config, pretraining = recipe_module(NLP_RECIPE, "nlp_config"), recipe_module(NLP_RECIPE, "pretraining")
    layout = recipe_module(NLP_RECIPE, "nlp_layout")
    cfg = config.NLPConfig(**{"preset": "deepspeed_stage_1", **keys})
    ds_config = pretraining.deepspeed_config(cfg, cfg.devices, pretraining.hidden_size(cfg))
    layout.run_layout(cfg, cfg.devices, pretraining.model_config(cfg, tokenizer=None), ds_config, pipeline_engine)


@pytest.fixture(scope="module")
def estimate(tmp_path_factory):
    """``zero-recipes estimate --recipe nlp`` in this process, on the recipe's default config or a MoE one.

    The recipe's ``--describe`` (a subprocess) depends on the config alone, not on the degrees given as flags: it
    runs once per config, and the planner gets its real output.
    """
    moe = tmp_path_factory.mktemp("configs") / "moe.yaml"
    moe.write_text("model: moe_tiny\npreset: deepspeed_stage_2\n")
    cached = functools.cache(memory.describe)
    patch = pytest.MonkeyPatch()
    patch.setattr(memory, "describe", cached)

    def run(keys: dict, capsys) -> tuple[int, str]:
        args = ["estimate", "--recipe", "nlp", "--gpus", str(keys["devices"]), "--gpu-memory", "80GB", "--json"]
        if keys.get("model") == "moe_tiny":
            args += ["--config", str(moe)]
        args += [f"--{key.replace('_', '-')}={keys[key]}" for key in DEGREES if key in keys]
        if "seq_len" in keys:
            args.append(f"--seq-len={keys['seq_len']}")
        with pytest.raises(SystemExit) as stop:
            cli_main(args)
        return stop.value.code, capsys.readouterr().err

    yield run
    patch.undo()


@pytest.mark.parametrize("name", BAD_LAYOUTS)
def test_the_recipe_and_the_planner_refuse_the_same_layout(name, estimate, capsys):
    keys, pipeline_engine, words = BAD_LAYOUTS[name]
    with pytest.raises(ConfigError) as refused:
        recipe_check(keys, pipeline_engine)
    recipe_error = str(refused.value)
    code, stderr = estimate(keys, capsys)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    planner_error = errors[0]
    assert words in recipe_error and words in planner_error, (recipe_error, planner_error)
    # Each in its own vocabulary: every degree the recipe's error names, the planner's names as its flag.
    named = [key for key in DEGREES if f"{key}={keys.get(key)}" in recipe_error]
    assert named and "--" not in recipe_error, recipe_error
    for key in named:
        flag = f"--{key.replace('_', '-')} {keys[key]}"
        assert flag in planner_error and f"{key}=" not in planner_error, planner_error


# name: (recipe keys, pipeline engine, refused stage, words of the reason)
REFUSED_STAGES = {
    "pipeline_zero_2": ({"pipeline_parallel": 2, "devices": 2}, True, 2, "DeepSpeed's pipeline engine runs ZeRO 0-1"),
    "moe_zero_3": ({"model": "moe_tiny", "devices": 2}, False, 3, "Native DeepSpeed MoE is not supported with ZeRO"),
    "tp_zero_3": ({"tensor_parallel": 2, "devices": 2}, False, 3, "the tensor-parallel export gathers AutoTP's"),
}


@pytest.mark.parametrize("name", REFUSED_STAGES)
def test_a_stage_the_layout_cannot_run_is_refused_and_marked(name, tmp_path):
    keys, pipeline_engine, stage, reason = REFUSED_STAGES[name]
    preset = {2: "deepspeed_stage_2", 3: "deepspeed_stage_3"}[stage]
    with pytest.raises(ConfigError, match=reason):
        recipe_check({**keys, "preset": preset}, pipeline_engine)
    config, pretraining = recipe_module(NLP_RECIPE, "nlp_config"), recipe_module(NLP_RECIPE, "pretraining")
    description = pretraining.describe(config.NLPConfig(**{**keys, "preset": "deepspeed_stage_1"}), pipeline_engine)
    inputs = memory.PlanInputs(
        gpus_per_node=keys["devices"],
        device_memory_bytes=80e9,
        tensor_parallel=keys.get("tensor_parallel", 1),
        pipeline_parallel=keys.get("pipeline_parallel", 1),
        parallel_components=description.parallel_components,
    )
    rows = memory.plan(description.model, inputs).rows
    assert all((reason in row.note) == (row.stage >= stage) for row in rows), [(r.stage, r.note) for r in rows]
    assert not any(row.fits for row in rows if row.stage >= stage)


@pytest.mark.slow  # accelerate launch starts 2 processes (they refuse at once: about 20 s each entry point)
@pytest.mark.parametrize("entry", ["lightning", "accelerate"])
def test_both_twins_refuse_a_bad_layout_before_any_work(entry, tmp_path):
    """The layout is refused before the corpus is read or the tokenizer trained: with data that does not exist, the
    one error line is the layout's, not the data's, and no run directory appears."""
    out_dir, args = tmp_path / "run", ["sequence_parallel=3", "data=/nonexistent/corpus"]
    if entry == "lightning":
        proc = run([PYTHON, NLP_ENTRY_POINTS["lightning"], "devices=2", f"out_dir={out_dir}", *args], check=False)
    else:
        config = NLP_RECIPE / "accelerate.yaml"
        proc = accelerate_launch(NLP_ENTRY_POINTS["accelerate"], [f"out_dir={out_dir}", *args], config, check=False)
    assert "error: sequence_parallel=3 does not divide the 2 rank(s)" in proc.stderr, proc.stderr[-3000:]
    assert "/nonexistent/corpus" not in proc.stderr and not out_dir.exists()
