"""``estimate --network``: communication seconds per step, their share of the step, and a recommendation that keeps
within the bar or says it does not. Figures checked by hand; everything in-process except one CLI line."""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from common.communication import LINK_CLASSES, parse_link
from common.errors import ConfigError
from common.memory_formulas import GB, assumed_transformer
from common.tools.cli import build_parser
from common.tools.estimate_network import NetworkInputs
from common.tools.memory import PlanInputs, plan

REPO = Path(__file__).resolve().parents[2]
SEVEN_B = assumed_transformer(7_000_000_000)
# 7B on 4 nodes of 8 x 32 GB: stage 3 is what memory recommends (the lower rungs need checkpointing).
FOUR_NODES = PlanInputs(gpus_per_node=8, nodes=4, device_memory_bytes=32 * GB, offload="none")


def network(inter: str, **kwargs) -> NetworkInputs:
    return NetworkInputs(intra=LINK_CLASSES["nvlink"], inter=LINK_CLASSES[inter], label=inter, **kwargs)


def rows(inputs: PlanInputs) -> dict:
    return {(r.stage, r.offload): r for r in plan(SEVEN_B, inputs).rows}


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        parsed = build_parser().parse_args(["estimate", *args])
        try:
            code = parsed.func(parsed)
        except ConfigError as e:  # what main() prints as one line, exit 2
            print(f"error: {e}", file=err)
            code = 2
    return code, out.getvalue(), err.getvalue()


def test_without_network_flags_the_plan_is_unchanged():
    """The memory columns and the recommendation do not move when a network is given and is within the bar."""
    plain = plan(SEVEN_B, FOUR_NODES)
    fast = plan(SEVEN_B, replace(FOUR_NODES, network=network("400gbps", max_share=0.99)))
    memory_fields = ("model_states_bytes", "activations_bytes", "buffers_bytes", "total_bytes", "fits", "fits_with")
    for a, b in zip(plain.rows, fast.rows):
        assert a.network is None and b.network is not None
        assert [getattr(a, f) for f in memory_fields] == [getattr(b, f) for f in memory_fields]
    assert {k: fast.recommendation[k] for k in plain.recommendation if k != "reason"} == {
        k: v for k, v in plain.recommendation.items() if k != "reason"
    }
    assert fast.recommendation["reason"].startswith(plain.recommendation["reason"])
    code, out, _ = run_cli("--params", "7e9", "--gpus", "8", "--gpu-memory", "80GB")
    assert code == 0 and "comm s" not in out and "rules of thumb checked" not in out


def test_seconds_and_compute_by_hand():
    """Compute: 6 x 7e9 x 2,048 tokens / (312e12 x 0.5) = 0.5514 s. Stage 3's reduce-scatter over 25 Gbit/s: a rank
    sends 31/32 of the padded 2-byte gradients (13.56 GB) at 3.125 GB/s, plus 14 calls x 30 us."""
    row = rows(replace(FOUR_NODES, network=network("25gbps")))[(3, "none")]
    assert row.network["compute_seconds"] == pytest.approx(6 * 7e9 * 2048 / (312e12 * 0.5))
    scatter = next(t for t in row.network["terms"] if t["collective"] == "reduce_scatter")
    padded = 2 * 7e9  # 2 bytes a gradient; DeepSpeed's padding adds at most 31 elements a parameter
    assert scatter["sent_bytes"] == pytest.approx(padded * 31 / 32, rel=1e-4)
    assert scatter["seconds"] == pytest.approx(padded * 31 / 32 / 3.125e9 + scatter["calls"] * 30e-6, rel=1e-4)
    assert row.network["comm_seconds"] == pytest.approx(sum(t["seconds"] for t in row.network["terms"]))
    share = row.network["comm_seconds"] / (row.network["comm_seconds"] + row.network["compute_seconds"])
    assert row.network["comm_share"] == pytest.approx(share)


def test_the_share_falls_as_the_link_gets_faster_and_as_tokens_grow():
    by_link = [rows(replace(FOUR_NODES, network=network(n)))[(3, "none")].network for n in ("25gbps", "100gbps")]
    by_link.append(rows(replace(FOUR_NODES, network=network("400gbps")))[(3, "none")].network)
    assert by_link[0]["comm_share"] > by_link[1]["comm_share"] > by_link[2]["comm_share"]
    by_tokens = [
        rows(replace(FOUR_NODES, micro_batch_size=mb, network=network("100gbps")))[(3, "none")].network
        for mb in (1, 4, 16)
    ]
    assert by_tokens[0]["comm_share"] > by_tokens[1]["comm_share"] > by_tokens[2]["comm_share"]
    assert by_tokens[0]["exposed_share"] >= by_tokens[1]["exposed_share"] >= by_tokens[2]["exposed_share"]


@pytest.mark.parametrize("link", ["25gbps", "100gbps", "400gbps"])
@pytest.mark.parametrize("micro_batch", [1, 8])
def test_a_plan_over_the_bar_is_never_recommended_silently(link, micro_batch):
    result = plan(SEVEN_B, replace(FOUR_NODES, micro_batch_size=micro_batch, network=network(link)))
    rec = result.recommendation
    chosen = next(r for r in result.rows if (r.stage, r.offload) == (rec["stage"], rec["offload"]))
    if chosen.network["exposed_share"] > 0.15:
        assert rec["over_max_share"] is True and "OVER THE COMMUNICATION BAR" in rec["reason"]
        assert rec["alternatives"], "an over-the-bar plan names its alternatives"
    else:
        assert "over_max_share" not in rec and "within 15 %" in rec["reason"]


def test_the_bar_moves_the_recommendation_to_a_row_within_it():
    """7B on 4 nodes of 8 x 80 GB at micro batch 2 over 400 Gbit/s: memory alone picks stage 1, whose all-gather of
    the updated parameters after the step cannot hide under compute (about 20 % exposed); stage 3 hides all but its
    persistent parameters' gathers. The network moves the recommendation to stage 3 and says what memory picked."""
    inputs = replace(FOUR_NODES, device_memory_bytes=80 * GB, micro_batch_size=2)
    assert plan(SEVEN_B, inputs).recommendation["stage"] == 1
    rec = plan(SEVEN_B, replace(inputs, network=network("400gbps"))).recommendation
    assert rec["stage"] == 3 and rec["memory_only"]["stage"] == 1 and "over_max_share" not in rec
    assert (
        "stage 1" in rec["reason"] and "over the 15 % bar" in rec["reason"] and rec["network"]["exposed_share"] < 0.15
    )
    # A looser bar keeps memory's choice.
    assert plan(SEVEN_B, replace(inputs, network=network("400gbps", max_share=0.25))).recommendation["stage"] == 1


def test_json_carries_the_numbers():
    code, out, _ = run_cli("--params", "7e9", "--gpus", "8", "--nodes", "4", "--gpu-memory", "32GB", "--network",
                           "25gbps", "--offload", "none", "--json")  # fmt: skip
    data = json.loads(out)
    stage3 = next(r for r in data["rows"] if r["stage"] == 3)
    assert {"comm_seconds", "compute_seconds", "comm_share", "exposed_share", "terms"} <= set(stage3["network"])
    assert set(data["recommendation"]["guide_stage3_shares"]) == {"25gbps", "100gbps"}


def test_buckets_follow_the_link():
    slow = rows(replace(FOUR_NODES, network=network("25gbps")))[(2, "none")].network["suggested_bucket_elements"]
    fast = rows(replace(FOUR_NODES, network=network("400gbps")))[(2, "none")].network["suggested_bucket_elements"]
    assert slow < fast


def doctor_file(tmp_path, world: int, bf16_bytes_per_s: float | None = None, fp32_bytes_per_s: float = 2e9) -> str:
    """A ``doctor.json`` of fp32 rows, plus bf16 rows at ``bf16_bytes_per_s`` when given."""
    rates = {"fp32": fp32_bytes_per_s, **({"bf16": bf16_bytes_per_s} if bf16_bytes_per_s else {})}
    rows = [
        {"op": op, "dtype": dtype, "bytes": size, "seconds": 1e-4 + size / rate}
        for dtype, rate in rates.items()
        for op in ("all_reduce", "all_gather")
        for size in (1 << 16, 1 << 20, 1 << 24)
    ]
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps({"measured": {"world_size": world, "collectives": rows}}))
    return str(path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--network", "nvlnk"], "did you mean 'nvlink'"),
        (["--network=-5GB/s"], "positive"),
        (["--network", "25gbps", "--utilisation", "1.5"], "(0, 1]"),
        (["--network", "25gbps", "--max-comm-share", "150"], "(0, 100)"),
        (["--peak-tflops", "312"], "goes with --network"),
        (["--bandwidth-from", "DOCTOR2"], "measured 2 ranks but the plan has 8"),
        (["--bandwidth-from", "/nonexistent/doctor.json"], "no such file"),
    ],
)
def test_bad_inputs_are_one_line(tmp_path, args, message):
    args = [doctor_file(tmp_path, 2) if a == "DOCTOR2" else a for a in args]
    code, _, err = run_cli("--params", "7e9", "--gpus", "8", "--gpu-memory", "80GB", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_measured_links_from_doctor(tmp_path):
    code, out, _ = run_cli("--params", "7e9", "--gpus", "2", "--gpu-memory", "80GB", "--offload", "none",
                           "--bandwidth-from", doctor_file(tmp_path, 2), "--json")  # fmt: skip
    assert code == 0
    stage3 = next(r for r in json.loads(out)["rows"] if r["stage"] == 3)
    assert {t["link"] for t in stage3["network"]["terms"]} <= {"all_reduce", "all_gather", "reduce_scatter"}
    assert parse_link("pcie3").bus_bytes_per_s == 16e9


def test_buckets_follow_the_links_fit_in_the_runs_precision(tmp_path):
    def bucket(precision: str, bf16_rate: float | None) -> int:
        code, out, _ = run_cli("--params", "7e9", "--gpus", "2", "--gpu-memory", "80GB", "--offload", "none",
                               "--precision", precision, "--json",
                               "--bandwidth-from", doctor_file(tmp_path, 2, bf16_rate, 1e11))  # fmt: skip
        assert code == 0
        return next(r for r in json.loads(out)["rows"] if r["stage"] == 2)["network"]["suggested_bucket_elements"]

    # bf16 measured 4x faster than fp32: a bf16 run's buckets grow with its own fit; an fp32 run's stay at fp32's.
    assert bucket("bf16", 4e11) > bucket("bf16", None)
    assert bucket("fp32", 4e11) == bucket("fp32", None)


DOC = REPO / "docs" / "choosing_a_stage.md"
WORKED = re.compile(r"```\n\$ (zero-recipes estimate [^\n]*--network [^\n]*)\n(.*?)\n```", re.S)


def test_worked_examples_are_the_commands_output():
    """docs/choosing_a_stage.md's network examples: each block equals a fresh run, and each figure of the summary
    table is in its example's guide-check line (13B on one node of 8; 7B on 4 nodes at micro batch 1 and 8)."""
    text = DOC.read_text()
    blocks = WORKED.findall(text)
    assert len(blocks) == 5, "the 13B NVLink and PCIe 3.0 examples, 7B over 25 and 100 Gbit/s, and at micro batch 8"
    guide_lines = {}
    for command, shown in blocks:
        code, out, err = run_cli(*command.split()[2:])
        assert code == 0, err
        fix = f"paste the output of `{command}` into docs/choosing_a_stage.md"
        assert shown.splitlines() == out.rstrip("\n").splitlines(), fix
        guide = " ".join(out.split("rules of thumb checked:")[1].split("stage 3, term by term")[0].split())
        guide_lines[
            ("13B" if "13e9" in command else "7B", "8 x 2,048" if "--micro-batch-size 8" in command else "1")
        ] = guide
    table = re.findall(r"^\| (13B|7B), [^|]* \| (1|8) x 2,048 tokens \| (.*?) \| (.*?) \|$", text, re.M)
    assert len(table) == 3
    for model, batch, over25, over100 in table:
        guide = guide_lines[(model, "8 x 2,048" if batch == "8" else "1")]
        assert f"over 25gbps {over25}" in guide and f"over 100gbps {over100}" in guide, (model, batch, guide)
