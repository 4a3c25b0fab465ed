"""Tensor, pipeline and expert parallelism in the planner and the linter.

Parameter counts are summed by hand from each config's shapes; activations come from Korthikanti et al. 2022
(arXiv:2205.05198): eq. 2 for tensor parallelism, section 4.2.3 for the pipeline's first stage.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from common import lint
from common.lint import LintView
from common.memory_formulas import ModelFacts, activation_parts, facts_from_hf_config, pipeline_activations
from common.tools import memory
from common.tools.lint import lint_file
from common.tools.memory import PlanInputs

EXE = shutil.which("zero-recipes")
CURRENT = {"torch": "2.6.0", "deepspeed": "0.19.8"}

# Small shapes so that the meta-device build takes well under a second.
LLAMA = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4}
LLAMA_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2}  # head size 16: k and v are 32 wide
MIXTRAL = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4}
MIXTRAL_MOE = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}


def cli(*args: str) -> subprocess.CompletedProcess:
    assert EXE, "zero-recipes is not installed: pip install -e ."
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    """A Llama-like and a Mixtral-like config.json, written as a user's would be."""
    from transformers import LlamaConfig, MixtralConfig

    root = tmp_path_factory.mktemp("configs")
    LlamaConfig(**LLAMA, **LLAMA_HEADS, tie_word_embeddings=False).save_pretrained(root / "llama")
    MixtralConfig(**MIXTRAL, **MIXTRAL_MOE, tie_word_embeddings=False).save_pretrained(root / "mixtral")
    return {"llama": root / "llama" / "config.json", "mixtral": root / "mixtral" / "config.json"}


def llama_params_by_hand() -> int:
    v, h, i, n = LLAMA["vocab_size"], LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["num_hidden_layers"]
    h_kv = 2 * (h // 4)
    attention = h * h + 2 * h * h_kv + h * h  # q, k, v, o
    mlp = 3 * h * i  # gate, up, down
    return v * h + n * (attention + mlp + 2 * h) + h + h * v  # embedding, blocks (2 norms), final norm, output


def replicated_by_hand(config: dict, router: int = 0) -> int:
    """What AutoTP keeps whole on every tensor-parallel rank: the embedding, 2 norms per block and the final one,
    and each block's router (not an ``nn.Linear`` in transformers' Mixtral); the output layer is split."""
    v, h, n = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    return v * h + n * (2 * h + router) + h


def mixtral_params_by_hand() -> tuple[int, int]:
    """(all parameters, expert parameters): each expert is a gated MLP, 3 h i, in every layer."""
    v, h, i, n = (
        MIXTRAL["vocab_size"],
        MIXTRAL["hidden_size"],
        MIXTRAL["intermediate_size"],
        MIXTRAL["num_hidden_layers"],
    )
    e = MIXTRAL_MOE["num_local_experts"]
    h_kv = 2 * (h // 4)
    attention = 2 * h * h + 2 * h * h_kv
    experts = e * 3 * h * i
    router = h * e
    return v * h + n * (attention + router + experts + 2 * h) + h + h * v, n * experts


def states_row(facts: ModelFacts, stage: int, **layout) -> float:
    inputs = PlanInputs(gpus_per_node=8, device_memory_bytes=80e9, **layout)
    rows = {(r.stage, r.offload): r for r in memory.plan(facts, inputs).rows}
    return rows[(stage, "none")].model_states_bytes


# --- parameters and model states per rank -------------------------------------------------------------------


def test_llama_states_per_rank_follow_tp_pp_and_dp(configs):
    facts = facts_from_hf_config(configs["llama"])
    k = llama_params_by_hand()
    assert facts.num_params == k and facts.expert_params == 0 and facts.num_experts is None
    # 16 ranks = TP 2 x PP 2 x DP 4: a rank holds (split / 2 + replicated) / 2 and ZeRO shards it over 4 ranks.
    replicated = replicated_by_hand(LLAMA)
    assert facts.tensor_replicated_params == replicated
    k_rank, dp = ((k - replicated) / 2 + replicated) / 2, 4
    layout = {"nodes": 2, "tensor_parallel": 2, "pipeline_parallel": 2}
    assert states_row(facts, 1, **layout) == pytest.approx(2 * k_rank + 2 * k_rank + 12 * k_rank / dp, rel=1e-12)
    assert states_row(facts, 2, **layout) == pytest.approx(2 * k_rank + 14 * k_rank / dp, rel=1e-12)


def test_mixtral_experts_split_by_ep_and_sharded_over_expert_data_parallel(configs):
    facts = facts_from_hf_config(configs["mixtral"])
    k, k_experts = mixtral_params_by_hand()
    assert (facts.num_params, facts.expert_params, facts.num_experts) == (k, k_experts, 4)
    # 16 ranks = TP 2 x PP 2 x DP 4, EP 2: dense (split / TP + replicated) / PP over DP 4; experts K_e / (EP PP)
    # over DP / EP = 2.
    replicated = replicated_by_hand(MIXTRAL, router=MIXTRAL["hidden_size"] * MIXTRAL_MOE["num_local_experts"])
    assert facts.tensor_replicated_params == replicated
    dense, experts = ((k - k_experts - replicated) / 2 + replicated) / 2, k_experts / 4
    layout = {"nodes": 2, "tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 2}
    stage2 = 2 * dense + 14 * dense / 4 + 2 * experts + 14 * experts / 2
    assert states_row(facts, 2, **layout) == pytest.approx(stage2, rel=1e-12)
    stage1 = 4 * dense + 12 * dense / 4 + 4 * experts + 12 * experts / 2
    assert states_row(facts, 1, **layout) == pytest.approx(stage1, rel=1e-12)


def test_the_cli_reports_the_same_states(configs):
    k, k_experts = mixtral_params_by_hand()
    replicated = replicated_by_hand(MIXTRAL, router=MIXTRAL["hidden_size"] * MIXTRAL_MOE["num_local_experts"])
    dense = (k - k_experts - replicated) / 2 + replicated  # 8 ranks = TP 2 x DP 4; EP 2 -> expert DP 2
    experts = k_experts / 2
    out = cli(
        "estimate", "--model-config", str(configs["mixtral"]), "--gpus", "8", "--gpu-memory", "80GB",
        "--tensor-parallel", "2", "--expert-parallel", "2", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    row = next(r for r in data["rows"] if (r["stage"], r["offload"]) == (2, "none"))
    assert row["model_states_bytes"] == pytest.approx(2 * dense + 14 * dense / 4 + 2 * experts + 14 * experts / 2)
    assert row["deepspeed_estimate_bytes"] is None  # DeepSpeed's estimators know no TP, PP or EP
    assert data["inputs"]["data_parallel"] == 4


def test_pipeline_rows_above_zero_1_never_fit():
    facts = ModelFacts(num_params=10_000_000, architecture="transformer", hidden_size=256, num_layers=8, num_heads=8)
    result = memory.plan(facts, PlanInputs(gpus_per_node=4, pipeline_parallel=2, device_memory_bytes=80e9))
    for row in result.rows:
        assert row.fits == (row.stage < 2), (row.stage, row.offload)
        assert (row.stage >= 2) == ("pipeline engine" in row.note)
    assert result.recommendation["stage"] in (0, 1)


# --- activations ------------------------------------------------------------------------------------------------

S, H, A, L = 2048, 4096, 32, 32
GPT = ModelFacts(num_params=1, architecture="transformer", hidden_size=H, num_heads=A, num_layers=L, block="gpt")


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_tensor_parallel_activations_are_korthikantis_eq_2(tp):
    """Per layer, 16-bit, one sample: s*b*h*(10 + 24/t + 5*a*s/(h*t)) with eager scores; SDPA keeps a float32
    log-sum-exp per head instead of the scores (4 a s / t)."""
    one = replace(GPT, num_layers=1)
    eager = activation_parts(one, S, 1, "bf16", "eager", tensor_parallel=tp)
    assert eager.layer == pytest.approx(S * H * (10 + 24 / tp + 5 * A * S / (H * tp)), rel=1e-12)
    sdpa = activation_parts(one, S, 1, "bf16", "sdpa", tensor_parallel=tp)
    assert sdpa.layer == pytest.approx(S * H * (10 + 24 / tp) + 4 * A * S / tp, rel=1e-12)


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (4, 1), (4, 8)])
def test_first_pipeline_stage_holds_l_layers_of_one_micro_batch(pp, tp):
    """Korthikanti 4.2.3: under 1F1B the first stage keeps PP micro-batches x L/PP layers = L layers, whatever PP."""
    layer = S * H * (10 + 24 / tp) + 4 * A * S / tp  # eq. 2, SDPA
    assert pipeline_activations(GPT, S, 1, "none", "bf16", "sdpa", tp, pp) == pytest.approx(L * layer, rel=1e-12)


def test_first_pipeline_stage_with_full_checkpointing():
    """Every block of the PP micro-batches in flight keeps its 2-byte input (L inputs in all); the one in its backward
    pass recomputes one block whole, and the token ids (8 B) are alive."""
    layer = S * H * 34 + 4 * A * S
    expected = L * 2 * S * H + layer + 8 * S
    assert pipeline_activations(GPT, S, 1, "full", "bf16", "sdpa", 1, 4) == pytest.approx(expected, rel=1e-12)


# --- refused combinations, through the command a user runs ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "6.7e9", "--gpus", "6", "--tensor-parallel", "4"], "--tensor-parallel 4 does not divide the 6"),
        (
            ["--params", "6.7e9", "--gpus", "8", "--pipeline-parallel", "3", "--nodes", "3"],
            "--pipeline-parallel 3 does not split the model's 32 layers",
        ),
        (
            ["--params", "6.7e9", "--gpus", "6", "--tensor-parallel", "3"],
            "--tensor-parallel 3 does not divide the model's 32 attention heads",
        ),
        (["llama", "--gpus", "8", "--expert-parallel", "2"], "--expert-parallel 2 needs a model with experts"),
        (
            ["mixtral", "--gpus", "8", "--nodes", "3", "--expert-parallel", "3"],
            "--expert-parallel 3 does not divide the model's 4 experts",
        ),
        (
            ["mixtral", "--gpus", "4", "--tensor-parallel", "2", "--expert-parallel", "4"],
            "--expert-parallel 4 does not divide the data-parallel degree 2",
        ),
    ],
    ids=["world-tp", "layers-pp", "heads-tp", "ep-dense", "experts-ep", "dp-ep"],
)
def test_bad_layouts_are_one_line_errors(args, message, configs):
    if args[0] in configs:
        args = ["--model-config", str(configs[args[0]]), *args[1:]]
    out = cli("estimate", *args, "--gpu-memory", "80GB")
    assert out.returncode == 2, out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr


# --- the linter ---------------------------------------------------------------------------------------------------

# A hybrid-parallel config as often written ("ZeRO-3 + pipeline 4 + tensor 8"), keys as given.
GUIDE_2_HYBRID = {
    "zero_optimization": {"stage": 3},
    "pipeline": {"stages": 4},
    "tensor": {"size": 8},
    "activation_checkpointing": {"strategy": "save_memory_optimized"},
}


def test_guide_2s_zero3_pipeline_tensor_example_is_an_error_naming_the_fix(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(GUIDE_2_HYBRID))
    findings = {f.rule_id: f for f in lint_file(path, versions=CURRENT)}
    error = findings["pipeline-zero-stage"]
    assert error.severity == "error"
    assert "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in error.message  # DeepSpeed's own words
    assert "ZeRO-1" in error.fix and "stage 1" in error.fix  # keep the pipeline ...
    assert "ZeRO-3 with tensor parallelism" in error.fix and "autotp_size 8" in error.fix  # ... or drop it
    assert findings["parallel-keys-ignored"].severity == "warning"  # DeepSpeed reads neither tensor.size ...
    assert "tensor.size 8" in findings["parallel-keys-ignored"].message
    assert "pipeline.stages" in findings["parallel-keys-ignored"].message  # ... nor pipeline.stages
    out = cli("lint", str(path))
    assert out.returncode == 1 and "[pipeline-zero-stage]" in out.stdout and "Traceback" not in out.stderr


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pipeline_is_refused_exactly_from_zero_2(stage):
    view = LintView(
        ds_config={"zero_optimization": {"stage": stage}, "pipeline": {"activation_checkpoint_interval": 1}}
    )
    fired = [f.rule_id for f in lint.run_rules(view)]
    assert ("pipeline-zero-stage" in fired) == (stage >= 2)
    assert "parallel-keys-ignored" not in fired  # the section's other keys are DeepSpeed's


@pytest.mark.parametrize(
    ("world", "autotp", "source", "fires"),
    [(8, 4, "run", False), (6, 4, "run", True), (2, 4, "run", True), (8, 1, "run", False), (1, 4, "deepspeed", False)],
)
def test_autotp_size_must_divide_the_ranks(world, autotp, source, fires):
    """A bare DeepSpeed JSON without batch sizes says nothing of its world size (the view's 1 is a default)."""
    view = LintView(
        ds_config={"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": autotp}},
        world_size=world,
        source_kind=source,
    )
    findings = [f for f in lint.run_rules(view) if f.rule_id == "autotp-size"]
    assert bool(findings) == fires
    assert all(f.severity == "error" and f"{world} ranks" in f.message for f in findings)
