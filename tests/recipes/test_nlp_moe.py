"""``model=moe_tiny expert_parallel=N`` in the NLP recipe: DeepSpeed's MoE layer with ZeRO 1, through the recipe.

The equivalence run compares expert parallel 2 on 2 processes (each rank holds 2 of the 4 experts of every MoE
layer; tokens travel by all-to-all) with expert parallel 1 on 2 processes (every rank holds all 4 experts: pure
data parallelism), on the same batches: with deterministic routing, no dropped tokens and experts seeded by their
global index, fp32 losses and load-balancing losses agree to rounding.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from _util import (
    NLP_RECIPE,
    PYTHON,
    assert_trained,
    launch_nlp,
    one_error,
    read_json,
    run,
    stdlib_tokenizer,
    tiny_fp32_run,
)

from common.config import load_config
from common.errors import ConfigError
from common.memory_formulas import facts_from_model_config
from common.parallel import ParallelLayout, rank_params
from common.rundir import read_metrics
from common.tools.export import open_checkpoint

RECIPE = NLP_RECIPE
TRAIN_ACCELERATE = RECIPE / "train_accelerate.py"
sys.path.insert(0, str(RECIPE))  # nlp_config, pretraining, nlp_layout: next to the recipe

STEPS = 5  # then EP 2 resumes from its step-STEPS checkpoint for 2 more; EP 1 runs STEPS + 2 uninterrupted
RUN = ["model=moe_tiny", *tiny_fp32_run(STEPS), "preset=deepspeed_stage_1"]


# --- fast: the combinations refused before any work ---------------------------------------------------


def check(*args: str) -> None:
    """The recipe's start-up check on ``args`` (as --describe and every entry point run it), in this process."""
    from nlp_config import NLPConfig
    from nlp_layout import run_layout
    from pretraining import deepspeed_config, hidden_size, model_config

    cfg = load_config(NLPConfig, None, list(args))
    ds_config = deepspeed_config(cfg, cfg.devices, hidden_size(cfg))
    run_layout(cfg, cfg.devices, model_config(cfg, tokenizer=None), ds_config)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["expert_parallel=2", "devices=2"], "expert_parallel=2 needs a model with experts (model=tiny has none)"),
        (["model=moe_tiny", "preset=deepspeed_stage_2", "expert_parallel=3", "devices=3"], "divide the model's 4"),
        (
            ["model=moe_tiny", "preset=deepspeed_stage_2", "expert_parallel=2", "devices=3"],
            "does not divide the data-parallel degree 3",
        ),
        (["model=moe_tiny", "expert_parallel=2", "devices=2"], "Native DeepSpeed MoE is not supported with ZeRO"),
        (
            ["model=moe_tiny", "preset=deepspeed_stage_1", "expert_parallel=2", "tensor_parallel=2", "devices=4"],
            "tensor_parallel=2 with a Mixture-of-Experts model does not run",
        ),
    ],
    ids=["dense", "experts", "world", "zero3", "tensor_parallel"],
)
def test_a_bad_expert_parallel_is_refused(args, message):
    with pytest.raises(ConfigError) as error:
        check(*args)
    assert message in str(error.value), error.value


def test_the_entry_point_refuses_in_one_line():
    # The default preset is ZeRO-3, which DeepSpeed's MoE layer refuses: one line, no traceback, exit code 2.
    error = one_error(run([PYTHON, TRAIN_ACCELERATE, "--describe", "model=moe_tiny"], timeout=300, check=False))
    assert "use preset=deepspeed_stage_1 or deepspeed_stage_2" in error, error
    check("model=moe_tiny", "preset=deepspeed_stage_1", "expert_parallel=2", "devices=2")  # a good one passes


def test_the_quoted_deepspeed_refusal_is_the_installed_ones():
    # The ZeRO-3 error quotes deepspeed.initialize's own refusal of its MoE layer (runtime/engine.py).
    import inspect

    from deepspeed.runtime import engine

    source = inspect.getsource(engine)
    assert '"Native DeepSpeed MoE is not supported with ZeRO Stage 3. "' in source
    assert '"Use AutoEP or choose ZeRO stage 1/2."' in source


# --- fast, one process: the model's pieces the equivalence rests on -------------------------------------------


@pytest.fixture(scope="module")
def moe_model():
    from nlp.moe import build_moe_config, build_moe_model

    config = build_moe_config("moe_tiny", vocab_size=64)
    return config, build_moe_model(config, expert_parallel=1, ep_rank=0, seed=0, attention="sdpa")


def test_experts_are_seeded_by_their_global_index(moe_model):
    from nlp.moe import build_moe_model

    config, whole = moe_model
    half = build_moe_model(config, expert_parallel=2, ep_rank=1, seed=0, attention="sdpa")  # experts 2 and 3
    for layer_whole, layer_half in zip(whole.model.layers, half.model.layers):
        experts_whole = layer_whole.mlp.moe.deepspeed_moe.experts.deepspeed_experts
        experts_half = layer_half.mlp.moe.deepspeed_moe.experts.deepspeed_experts
        assert len(experts_half) == 2
        for local, expert in enumerate(experts_half):
            assert torch.equal(expert.up_proj.weight, experts_whole[2 + local].up_proj.weight)
        assert not torch.equal(experts_whole[0].up_proj.weight, experts_whole[1].up_proj.weight)
        assert torch.equal(
            layer_whole.mlp.moe.deepspeed_moe.gate.wg.weight, layer_half.mlp.moe.deepspeed_moe.gate.wg.weight
        )
    assert torch.equal(whole.model.embed_tokens.weight, half.model.embed_tokens.weight)


def test_the_load_balancing_loss_is_in_the_loss_and_reaches_the_routers(moe_model):
    from nlp_config import NLPConfig
    from pretraining import train_loss

    _, model = moe_model
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    router = model.model.layers[0].mlp.moe.deepspeed_moe.gate.wg.weight
    grads = {}
    for coef in (0.0, 0.5):
        cfg = NLPConfig(model="moe_tiny", moe_aux_loss_coef=coef)
        model.zero_grad()
        total, lm, aux = train_loss(cfg, model, model, ids[:, :-1], ids[:, 1:])
        assert aux is not None and math.isfinite(aux.item()) and aux.item() > 0
        assert torch.allclose(total, lm + coef * aux)
        total.backward()
        grads[coef] = router.grad.clone()
    assert not torch.allclose(grads[0.0], grads[0.5])


@pytest.mark.parametrize(("keys", "min_capacity"), [({"moe_drop_tokens": True, "moe_min_capacity": 3}, 3), ({}, None)])
def test_token_dropping_keys_reach_deepspeeds_gate_at_the_planned_capacity(keys, min_capacity):
    """The recipe's ``moe_drop_tokens`` and ``moe_min_capacity`` reach DeepSpeed's gate, whose dispatch buffer then
    has the slot :func:`common.communication.expert_capacity` plans (checked against the gate's own output); by
    default no token is dropped and the slot is the busiest expert's load."""
    from nlp_config import NLPConfig

    from common.communication import expert_capacity

    cfg = NLPConfig(model="moe_tiny", **keys)
    config = cfg.family.config("moe_tiny", 64, None, 16)
    model = cfg.family.build(config, "sdpa", seed=0)
    gate = model.model.layers[0].mlp.moe.deepspeed_moe.gate
    assert gate.drop_tokens is bool(keys)
    tokens = torch.randn(10, config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, _, dispatch_mask, expert_counts = gate(tokens)
    slot = dispatch_mask.shape[-1]
    if min_capacity is None:
        assert slot == int(expert_counts.max())
    else:
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        assert slot == expert_capacity(10, experts, top_k, 1.0, min_capacity) == 5  # ceil(10 / 4 x 2): not the minimum
        few = gate(tokens[:1])[2]
        assert few.shape[-1] == expert_capacity(1, experts, top_k, 1.0, min_capacity) == min_capacity


def test_the_export_is_a_transformers_mixtral_with_the_same_logits(moe_model):
    from transformers import MixtralForCausalLM

    from nlp.moe import to_mixtral_state_dict

    config, model = moe_model
    mixtral = MixtralForCausalLM(config)
    mixtral.load_state_dict(to_mixtral_state_dict(model.state_dict(), config), strict=True)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert torch.allclose(mixtral(input_ids=ids).logits, expected, atol=1e-5)


# --- slow: EP 2 trains like EP 1 (pure data parallel); its memory is the planner's; its checkpoint and export ---


def launch(out_dir: Path, ep: int, *extra: str) -> Path:
    launch_nlp("accelerate", out_dir, 2, f"expert_parallel={ep}", *RUN, *extra)
    return out_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2-process runs on the same batches, shared by the slow tests: Accelerate EP 2 (STEPS steps, then resumed to
    STEPS + 2), Accelerate EP 1 (STEPS + 2 steps) and Lightning EP 2 (STEPS steps)."""
    root = tmp_path_factory.mktemp("moe")
    launch(root / "ep2", 2)
    launch(root / "ep2", 2, "resume=true", f"max_steps={STEPS + 2}")
    # Lightning, EP 2 on 2 processes, STEPS steps: the same batches as the Accelerate runs.
    lightning = root / "lightning_ep2"
    launch_nlp("lightning", lightning, 2, "expert_parallel=2", *RUN)
    return {2: root / "ep2", 1: launch(root / "ep1", 1, f"max_steps={STEPS + 2}"), "lightning": lightning}


def metric(out_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(out_dir) if key in r}


@pytest.mark.slow
def test_expert_parallel_2_trains_and_resumes_like_data_parallel(runs):
    for key in ("train_loss", "aux_loss"):
        ep2, ep1 = metric(runs[2], key), metric(runs[1], key)
        assert sorted(ep2) == sorted(ep1) == list(range(1, STEPS + 3)), (key, ep2, ep1)
        for step in ep1:
            assert math.isfinite(ep2[step]), (key, ep2)
            assert math.isclose(ep2[step], ep1[step], rel_tol=1e-5), (key, step, ep2, ep1)
    for key in ("train_loss", "aux_loss"):  # Lightning's EP 2 run: the same losses as Accelerate's EP 1
        lightning, ep1 = metric(runs["lightning"], key), metric(runs[1], key)
        assert sorted(lightning) == list(range(1, STEPS + 1)), (key, lightning)
        for step in lightning:
            assert math.isclose(lightning[step], ep1[step], rel_tol=1e-5), (key, step, lightning, ep1)
    assert read_json(runs["lightning"] / "summary.json")["moe"]["expert_parallel"] == 2
    assert_trained(runs[2])  # the loss on the fixed validation blocks went down, not step 1's vs step N's batch
    summary, reference = read_json(runs[2] / "summary.json"), read_json(runs[1] / "summary.json")
    assert math.isclose(summary["val_loss"], reference["val_loss"], rel_tol=1e-5)
    moe = summary["moe"]
    assert moe["expert_parallel"] == 2 and moe["num_experts"] == 4 and moe["top_k"] == 2
    assert moe["aux_loss"] == metric(runs[2], "aux_loss")[STEPS + 2] and math.isfinite(moe["aux_loss"])


@pytest.mark.slow
def test_parameter_bytes_per_rank_are_the_planners(runs):
    from transformers import AutoTokenizer

    from nlp.moe import build_moe_config

    tokenizer = AutoTokenizer.from_pretrained(str(stdlib_tokenizer()))  # the one the runs loaded
    facts = facts_from_model_config(build_moe_config("moe_tiny", tokenizer=tokenizer, seq_len=64), "test")
    measured = {}
    for ep in (2, 1):
        dense, experts = rank_params(facts, ParallelLayout(world_size=2, expert=ep))
        planned = (dense + experts) * 4  # fp32 weights, whole on every rank under ZeRO 1
        measured[ep] = read_json(runs[ep] / "summary.json")["model_state_bytes_measured"]["params"]
        assert abs(measured[ep] - planned) <= 0.05 * planned, (ep, measured[ep], planned)
    # EP 2 holds half the experts: the measured saving is the experts' half.
    saved, expected = measured[1] - measured[2], facts.expert_params / 2 * 4
    assert abs(saved - expected) <= 0.05 * expected, (saved, expected)


@pytest.mark.slow
def test_the_run_saves_exports_a_mixtral_and_zero_recipes_export_refuses(runs):
    summary = read_json(runs[2] / "summary.json")
    # final_export reloaded final/ with AutoModelForCausalLM and compared its logits with the trained model's.
    check = summary["export_check"]
    assert check["ok"] and check["max_abs_logit_diff"] < 1e-4, check
    assert read_json(runs[2] / "final" / "config.json")["model_type"] == "mixtral"
    checkpoint = runs[2] / "checkpoints" / f"step_{STEPS + 2:06d}"
    assert len(list(checkpoint.glob("*/layer_*_expert_*_model_states.pt"))) == 2 * 4  # layers x experts
    with pytest.raises(ConfigError, match="DeepSpeed MoE"):
        open_checkpoint(checkpoint)
