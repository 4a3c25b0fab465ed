"""The peer rules (common/lint/peer.py): when ZeRO is the only choice, and when the measured table favours FSDP2.

The table here is written by hand in bench/peer.py's format, so each direction of every bar is checked whatever the
committed bench/results/peer.json says (tests/unit/test_lint.py trips the rule on that file)."""

from __future__ import annotations

from common.lint import LintView, run_rules
from common.lint.peer import peer_findings, zero_only_features


def ds(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, **zero},
    }


def run(cpu: float, states: float) -> dict:
    return {"cpu_s_per_step": cpu, "model_state_bytes": states}


def table(zero_runs: list[dict], fsdp2_runs: list[dict], zero: str = "deepspeed_stage_3", fsdp2: str = "fsdp2") -> dict:
    row = {"recipe": "cv", "front_end": "lightning", "zero": zero, "fsdp2": fsdp2, "error": None}
    return {"rows": [{**row, "runs": {zero: zero_runs, fsdp2: fsdp2_runs}}]}


def ids(findings) -> list[str]:
    return [f.rule_id for f in findings]


def test_zero_only_features_are_named_from_the_deepspeed_dict_and_the_recipe_config():
    assert zero_only_features(LintView(ds_config=ds(3))) == []
    nvme = ds(3, offload_param={"device": "nvme", "nvme_path": "/nvme"})
    assert zero_only_features(LintView(ds_config=nvme)) == ["nvme_path"]
    assert zero_only_features(LintView(ds_config=ds(2, offload_optimizer={"device": "cpu"}))) == ["offload_optimizer"]
    assert zero_only_features(LintView(ds_config=ds(3, zero_hpz_partition_size=2))) == ["zeropp"]
    view = LintView(ds_config=ds(3), recipe_config={"sequence_parallel": 2, "tensor_parallel": 1})
    assert zero_only_features(view) == ["sequence_parallel"]
    assert zero_only_features(LintView(ds_config={**ds(1), "tensor_parallel": {"autotp_size": 2}})) == [
        "tensor_parallel"
    ]
    finding = next(f for f in run_rules(view) if f.rule_id == "zero-only-feature")
    assert "Ulysses sequence parallelism" in finding.message and "ZeRO is the only choice" in finding.message


def test_the_measured_table_favours_fsdp2_only_when_every_repetition_is_over_a_bar():
    stage3 = LintView(ds_config=ds(3))
    # CPU time above 1.00x in every repetition: the finding, with the median and range.
    (finding,) = peer_findings(stage3, table([run(1.3, 1), run(1.2, 1), run(1.25, 1)], [run(1, 1)] * 3))
    assert finding.rule_id == "peer-measured-faster" and "preset=fsdp2" in finding.fix
    assert "CPU time per step 1.25x (1.20-1.30) fsdp2's" in finding.message
    # One repetition at or below 1.00x: not resolved, no finding.
    assert peer_findings(stage3, table([run(1.3, 1), run(0.9, 1)], [run(1, 1)] * 2)) == []
    # Model-state bytes: the bar is 1.10x.
    assert peer_findings(stage3, table([run(1, 1.08)], [run(1, 1)])) == []
    assert ids(peer_findings(stage3, table([run(1, 1.2)], [run(1, 1)]))) == ["peer-measured-faster"]
    # Another stage's pair, a ZeRO-only feature, or no table: no finding.
    assert peer_findings(LintView(ds_config=ds(2)), table([run(2, 1)], [run(1, 1)])) == []
    offloaded = LintView(ds_config=ds(3, offload_optimizer={"device": "cpu"}))
    assert peer_findings(offloaded, table([run(2, 1)], [run(1, 1)])) == []
    assert peer_findings(stage3, None) == []
    at_start = LintView(ds_config=ds(3), source_kind="run")  # a recipe linting itself has chosen already
    assert peer_findings(at_start, table([run(2, 1)], [run(1, 1)])) == []
    stage2 = table([run(2, 1)], [run(1, 1)], zero="deepspeed_stage_2", fsdp2="fsdp2_grad_op")
    assert "preset=fsdp2_grad_op" in peer_findings(LintView(ds_config=ds(2)), stage2)[0].fix
