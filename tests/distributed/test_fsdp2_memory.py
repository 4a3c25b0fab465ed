"""The planner's FSDP2 rows (``zero-recipes estimate``, common.memory_formulas.fsdp2): bytes computed by hand for a
small shape, then against what each rank of a real 2-process FSDP2 run holds (tests/distributed/fsdp2_memory_worker.py:
a tiny Llama under both FSDP2 presets, bf16 compute, AdamW, one launch)."""

from __future__ import annotations

import json

import pytest
from _util import PYTHON, REPO, free_port, run

from common.memory_formulas import ModelFacts, facts_from_model_config, fsdp2_memory, fsdp2_units
from common.tools.memory import PlanInputs, format_plan, plan

WORKER = REPO / "tests" / "distributed" / "fsdp2_memory_worker.py"
# hidden 4, 2 layers, 2 heads of 2, 1 k/v head, MLP 8, vocab 10, 1,000 parameters in all.
SMALL = ModelFacts(
    num_params=1000,
    architecture="transformer",
    hidden_size=4,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    intermediate_size=8,
    vocab_size=10,
    block="llama",
)


def test_fsdp2_bytes_computed_by_hand():
    # A block: q and o 4 x 4 each (32), k and v 4 x 2 each (16), gate, up and down 4 x 8 each (96), two norms (8).
    units = fsdp2_units(SMALL)
    assert (units.blocks, units.block_params, units.root_params) == (2, 152, 1000 - 2 * 152)
    fsdp2 = fsdp2_memory(SMALL, ranks=2, precision="bf16", reshard_after_forward=True)
    # 16 B a parameter sharded over 2 ranks; the root's 696 bf16 weights held from forward to backward.
    assert (fsdp2.sharded, fsdp2.gathered, fsdp2.model_states) == (8000, 1392, 9392)
    assert fsdp2.model_states_after_step == 12 * 1000 / 2  # fp32 parameters and Adam's moments, gradients freed
    # Two blocks gathered in bf16 (2 x 2 x 152) + the largest unit's (the root's) gradient in bf16 and in fp32.
    assert fsdp2.buffers == 608 + 6 * 696
    grad_op = fsdp2_memory(SMALL, ranks=2, precision="bf16", reshard_after_forward=False)
    assert (grad_op.gathered, grad_op.model_states, grad_op.buffers) == (2000, 10000, 6 * 696)
    fp32 = fsdp2_memory(SMALL, ranks=4, precision="fp32", reshard_after_forward=False)
    assert (fp32.sharded, fp32.gathered, fp32.buffers) == (4000, 4000, 4 * 696)  # fp32 reduces without a copy


def test_estimate_shows_fsdp2_beside_its_zero_counterpart():
    inputs = PlanInputs(gpus_per_node=8, seq_len=512, device_memory_bytes=80e9)
    result = plan(SMALL, inputs)
    rows = {r.preset: r for r in result.fsdp2_rows}
    assert rows["fsdp2"].counterpart == "deepspeed_stage_3" and rows["fsdp2_grad_op"].counterpart == "deepspeed_stage_2"
    zero3 = next(r for r in result.rows if r.preset == "deepspeed_stage_3" and r.offload == "none")
    assert rows["fsdp2"].counterpart_model_states_bytes == zero3.model_states_bytes == 16 * 1000 / 8
    assert rows["fsdp2"].model_states_bytes == 16 * 1000 / 8 + 2 * 696
    text = format_plan(result)
    assert "fsdp2_grad_op" in text and "deepspeed_stage_2:" in text
    assert result.to_json()["fsdp2_rows"][0]["preset"] == "fsdp2"
    # Offload, LoRA, tensor parallelism: nothing the FSDP2 presets run, no rows.
    assert plan(SMALL, PlanInputs(gpus_per_node=8, offload="optimizer")).fsdp2_rows == []


@pytest.mark.slow
def test_fsdp2_rows_match_what_two_real_ranks_hold(tmp_path):
    from transformers import LlamaConfig

    out = tmp_path / "counted"
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    run([*command, WORKER, "--out", out], timeout=300)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    facts = facts_from_model_config(LlamaConfig(**ranks[0]["config"]), "the worker's Llama")
    for rank in ranks:
        for preset, reshard in (("fsdp2", True), ("fsdp2_grad_op", False)):
            expected = fsdp2_memory(facts, ranks=2, precision="bf16", reshard_after_forward=reshard)
            counted = rank[preset]
            assert counted["after_step"]["model_states"] == expected.sharded, (preset, counted, expected)
            assert counted["gathered_after_forward"] == expected.gathered, (preset, counted, expected)
