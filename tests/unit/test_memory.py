"""The memory planner: ZeRO's 7B table exactly, DeepSpeed's own estimators, Korthikanti's activations, buffers."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from common import memory_formulas
from common.memory_formulas import GB, ModelFacts
from common.tools import memory
from common.tools.memory import PlanInputs

EXE = shutil.which("zero-recipes")
DOCS = Path(__file__).resolve().parents[2] / "docs"

# The ZeRO paper's formulas: 7B parameters, mixed-precision Adam, 8 GPUs.
GUIDE_TABLE_GB = {0: 112.0, 1: 38.5, 2: 26.25, 3: 14.0}


def cli(*args: str) -> subprocess.CompletedProcess:
    assert EXE, "zero-recipes is not installed: pip install -e ."
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=180)


def test_guide_table_exactly():
    facts = memory_formulas.assumed_transformer(7_000_000_000)
    result = memory.plan(facts, PlanInputs(gpus_per_node=8))
    rows = {r.stage: r for r in result.rows if r.offload == "none"}
    # Stage 3 keeps parameters under the persistence threshold (10 x hidden) whole as well as sharded: for
    # the assumed Llama shape those are the 2 L + 1 RMSNorm weights of h elements, 2 bytes each.
    persistent = (2 * facts.num_layers + 1) * facts.hidden_size
    for stage, gb in GUIDE_TABLE_GB.items():
        whole_copies = 2 * persistent if stage == 3 else 0
        assert rows[stage].model_states_bytes == gb * GB + whole_copies, (stage, rows[stage].model_states_bytes)
        assert memory_formulas.fmt_gb(rows[stage].model_states_bytes) == f"{gb:.2f} GB"  # the 7B table, as printed
    assert rows[3].persistent_params == persistent


def test_stage3_persistent_parameters_counted_by_deepspeeds_rule():
    """A parameter persists when numel <= threshold (DeepSpeed's mark_persistent_parameters); P bytes each, N-free."""
    facts = ModelFacts(num_params=1_000_010, param_numels=(1_000_000, 4, 6))
    assert memory_formulas.persistent_params(facts, 6) == 10 and memory_formulas.persistent_params(facts, 5) == 4
    on_device, _ = memory_formulas.guide_model_states(facts, 3, "none", 4, "bf16", persistence_threshold=6)
    assert on_device == 16 * 1_000_010 / 4 + 2 * 10
    after_step, _ = memory_formulas.guide_model_states(
        facts, 3, "none", 4, "bf16", persistence_threshold=6, grads_alive=False
    )
    assert on_device - after_step == 2 * 1_000_010 / 4  # the sharded bf16 gradients, released by step()


def test_guide_table_through_the_cli_text_and_json():
    out = cli("estimate", "--params", "7e9", "--gpus", "8", "--gpu-memory", "80GB")
    assert out.returncode == 0, out.stderr
    lines = {
        line.split()[0]: line for line in out.stdout.splitlines() if line[:5].strip() in "0123" and " none " in line
    }
    for stage, gb in GUIDE_TABLE_GB.items():
        assert f"{gb:.2f} GB" in lines[str(stage)], lines[str(stage)]
    assert "recommended:" in out.stdout

    data = json.loads(cli("estimate", "--params", "7e9", "--gpus", "8", "--gpu-memory", "80GB", "--json").stdout)
    by_key = {(r["stage"], r["offload"]): r for r in data["rows"]}
    persistent = by_key[(3, "none")]["persistent_params"]
    assert persistent > 0
    for stage, gb in GUIDE_TABLE_GB.items():
        assert by_key[(stage, "none")]["model_states_bytes"] == gb * GB + (2 * persistent if stage == 3 else 0)
    for key in (
        "stage",
        "offload",
        "model_states_bytes",
        "deepspeed_estimate_bytes",
        "activations_bytes",
        "buffers_bytes",
        "host_ram_per_node_bytes",
        "fits",
    ):
        assert key in data["rows"][0]
    assert data["recommendation"]["stage"] in (0, 1, 2, 3)


def _deepspeed_estimators():
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed announces its accelerator on import
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


@pytest.mark.parametrize("total_params", [5_300_000, 125_000_000, 7_000_000_000, 70_000_000_000])
@pytest.mark.parametrize(("gpus", "nodes"), [(1, 1), (8, 1), (8, 4), (2, 3)])
def test_agrees_with_deepspeeds_estimators(total_params, gpus, nodes):
    zero2, zero3 = _deepspeed_estimators()
    largest = total_params // 50
    for offload, cpu_offload in (("none", False), ("optimizer", True)):
        cpu, gpu = zero2(total_params, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=cpu_offload)
        assert memory_formulas.deepspeed_estimate(total_params, largest, 2, offload, gpus, nodes) == (gpu, cpu)
    for offload, cpu_offload, offload_params in (
        ("none", False, False),
        ("optimizer", True, False),
        ("params", True, True),
    ):
        cpu, gpu, _ = zero3(
            total_params,
            largest,
            num_gpus_per_node=gpus,
            num_nodes=nodes,
            cpu_offload=cpu_offload,
            cpu_offload_params=offload_params,
        )
        assert memory_formulas.deepspeed_estimate(total_params, largest, 3, offload, gpus, nodes) == (gpu, cpu)


def test_plan_rows_carry_deepspeeds_numbers():
    zero2, zero3 = _deepspeed_estimators()
    facts = memory_formulas.assumed_transformer(7_000_000_000)
    rows = {(r.stage, r.offload): r for r in memory.plan(facts, PlanInputs(gpus_per_node=8)).rows}
    k, largest = facts.num_params, facts.largest_layer_params
    assert rows[(2, "none")].deepspeed_estimate_bytes == zero2(k, 8, 1, cpu_offload=False)[1]
    assert rows[(2, "optimizer")].deepspeed_estimate_bytes == zero2(k, 8, 1, cpu_offload=True)[1]
    assert rows[(3, "none")].deepspeed_estimate_bytes == zero3(k, largest, 8, 1, False, False)[1]
    assert rows[(3, "params")].deepspeed_estimate_bytes == zero3(k, largest, 8, 1, True, True)[1]
    assert rows[(0, "none")].deepspeed_estimate_bytes is None  # DeepSpeed has no stage-0/1 estimator
    assert rows[(1, "none")].deepspeed_estimate_bytes is None


def test_korthikanti_per_layer_formula_keeps_the_score_term_only_for_eager():
    # A GPT block (not Llama-like), Llama-2-7B size: s 2048, b 1, h 4096, a 32 -> s*b*h*(34 + 5*a*s/h)
    # = 8,388,608 x 114 bytes per layer with eager attention (the paper's count, which stores the scores).
    gpt = {"num_params": 1, "architecture": "transformer", "hidden_size": 4096, "num_heads": 32, "block": "gpt"}
    one_layer = ModelFacts(num_layers=1, **gpt)
    parts = memory_formulas.activation_parts(one_layer, 2048, 1, "bf16", "eager")
    assert parts.layer == 2048 * 4096 * 114
    # SDPA / FlashAttention never store the a x s x s scores, only a float32 log-sum-exp per head and token.
    assert (
        memory_formulas.activation_parts(one_layer, 2048, 1, "bf16", "sdpa").layer == 2048 * 4096 * 34 + 4 * 32 * 2048
    )


def test_llama_block_counted_op_by_op():
    # Llama-3-8B: h 4096, 8 KV heads of 128 (h_kv 1024), MLP 14336, 32 heads. Per token and layer, bf16:
    # 2 RMSNorms x (4 + 2 + 2) h + 4 (fp32 rsqrt); SDPA q, out 2 x 2 h, k, v 2 x 2 h_kv, lse 4 a; MLP 4 x 2 i.
    llama3 = ModelFacts(
        num_params=1,
        architecture="transformer",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        block="llama",
    )
    per_token = 2 * (8 * 4096 + 4) + 4 * 4096 + 4 * 1024 + 4 * 32 + 8 * 14336
    parts = memory_formulas.activation_parts(llama3, 2048, 1, "bf16", "sdpa")
    assert parts.layer == 2048 * per_token
    # Eager: q, k, v (repeated to 32 heads), out copy: 4 x 2 h; the softmax in fp32 and its bf16 copy, 6 B/score.
    eager = memory_formulas.activation_parts(llama3, 2048, 1, "bf16", "eager")
    assert eager.layer - parts.layer == 2048 * (4 * 4096 - 4 * 1024 - 4 * 32) + 6 * 32 * 2048 * 2048
    none = memory_formulas.transformer_activations(llama3, 2048, 1, "none", "bf16", "sdpa")
    # The loss's float32 log-probabilities (4 V per token), the final norm and the token ids come on top.
    assert none == 32 * parts.layer + parts.head + parts.rope
    assert 14e9 < none < 15e9  # Korthikanti's s*b*h*(34 + 5as/h) said 31.65 GB
    assert memory_formulas.transformer_activations(llama3, 2048, 2, "none") == pytest.approx(2 * none, rel=1e-3)
    layers = ModelFacts(num_params=1, architecture="transformer", hidden_size=4096, num_layers=32, num_heads=32)
    none = memory_formulas.transformer_activations(layers, 2048, 1, "none")
    full = memory_formulas.transformer_activations(layers, 2048, 1, "full")
    assert (
        full
        < memory_formulas.transformer_activations(layers, 2048, 1, "save_memory_optimized")
        < memory_formulas.transformer_activations(layers, 2048, 1, "every_k")
        < none
    )
    fno = ModelFacts(num_params=500_000, architecture="FNO1d")
    assert memory_formulas.transformer_activations(fno, 256, 10, "none") is None  # not a transformer: not estimated


def test_buffers_follow_deepspeed_and_the_measured_stage3_bucket():
    # DeepSpeed's docs: overlap_comm uses 4.5 x the buckets: 5e8 x 2 B x 2 buckets x 4.5 = 9 GB.
    zero2 = {"overlap_comm": True, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}
    assert memory_formulas.buffer_bytes(2, zero2, "bf16", 0, int(5e8)) == 9e9
    # Measured here (docs/design.md): stage 3 preallocates reduce_bucket_size elements: 5e8 -> 1 GB, 5e7 -> 100 MB.
    for bucket, preallocated in ((5e8, 1e9), (5e7, 1e8)):
        zero3 = {"reduce_bucket_size": bucket, "stage3_prefetch_bucket_size": 0}
        assert memory_formulas.buffer_bytes(3, zero3, "bf16", 0, int(bucket)) == preallocated


def test_ladder_recommendation_climbs_with_less_memory():
    facts = memory_formulas.assumed_transformer(7_000_000_000)

    def rec(device_gb: float, host_gb: float | None = None) -> dict:
        inputs = PlanInputs(
            gpus_per_node=8, device_memory_bytes=device_gb * GB, host_memory_bytes=host_gb * GB if host_gb else None
        )
        return memory.plan(facts, inputs).recommendation

    assert rec(400)["stage"] == 0
    # SDPA activations (13.3 GB at seq 2048): stage 1 needs 53.8 GB, stage 2 48.5 GB (9 GB of buffers).
    assert (rec(80)["stage"], rec(80)["activation_checkpointing"]) == (1, "none")
    assert (rec(56)["stage"], rec(56)["activation_checkpointing"]) == (2, "none")
    assert (rec(24)["stage"], rec(24)["offload"], rec(24)["activation_checkpointing"]) == (3, "none", "full")
    low = rec(8, host_gb=2000)
    assert low["offload"] in ("optimizer", "params") and "offload" in low["reason"]
    # The host cannot hold the offloaded states either: ZeRO-Infinity's last rung puts them on NVMe.
    nvme = rec(8, host_gb=10)
    assert (nvme["stage"], nvme["offload"], nvme["preset"]) == (3, "nvme", "deepspeed_stage_3_offload_nvme")
    assert rec(2, host_gb=10)["stage"] is None  # not even one layer's working set fits
    assert "stage 0 needs" in rec(80)["reason"] and "stage 1 needs" in rec(56)["reason"]


def test_offload_moves_states_to_the_host():
    facts = ModelFacts(num_params=1_000_000_000)
    on_device, host = memory_formulas.guide_model_states(facts, 2, "optimizer", 8)
    assert on_device == 2e9 + 2e9 / 8 and host == 12e9 / 8
    on_device, host = memory_formulas.guide_model_states(facts, 3, "params", 8)
    assert on_device == 0 and host == 16e9 / 8


def test_lora_shrinks_model_states():
    facts = memory_formulas.assumed_transformer(7_000_000_000)
    full, _ = memory_formulas.guide_model_states(facts, 2, "none", 8)
    lora, _ = memory_formulas.guide_model_states(facts, 2, "none", 8, lora_rank=16)
    adapters = memory_formulas.lora_params(facts, 16)
    # The frozen base keeps only its 2-byte copy (replicated below stage 3); the adapters follow 2K + 14K/N.
    assert lora == pytest.approx(2 * facts.num_params + 2 * adapters + 14 * adapters / 8)
    assert lora < full
    lora3, _ = memory_formulas.guide_model_states(facts, 3, "none", 8, lora_rank=16)
    assert lora3 == pytest.approx((2 * facts.num_params + 16 * adapters) / 8)


def test_model_config_counts_parameters_exactly(tmp_path):
    from transformers import LlamaConfig

    from nlp.model import LLAMA_SIZES, llama_param_count

    config = LlamaConfig(**LLAMA_SIZES["tiny"])
    config.save_pretrained(tmp_path)
    facts = memory_formulas.facts_from_hf_config(tmp_path / "config.json")
    assert facts.num_params == llama_param_count(config)
    assert (facts.hidden_size, facts.num_layers, facts.num_heads) == (256, 4, 4)
    assert facts.largest_layer_params == 4096 * 256  # the embedding, as DeepSpeed's model_to_params counts it


@pytest.mark.parametrize(
    ("text", "expected"), [("80GB", 80e9), ("80GiB", 80 * 2**30), ("141e9", 141e9), ("24 GB", 24e9), ("512MB", 512e6)]
)
def test_parse_bytes(text, expected):
    assert memory_formulas.parse_bytes(text) == expected


def test_parse_count():
    assert memory_formulas.parse_count("7e9") == memory_formulas.parse_count("7B") == 7_000_000_000
    assert memory_formulas.parse_count("125M") == 125_000_000


def test_bad_input_is_one_line_exit_2():
    out = cli("estimate", "--params", "seven")
    assert out.returncode == 2 and out.stderr.startswith("error:") and len(out.stderr.strip().splitlines()) == 1
    out = cli("estimate", "--params", "7e9", "--gpu-memory", "lots")
    assert out.returncode == 2 and "memory size" in out.stderr


def test_recipe_input_reads_the_recipe_and_labels_the_device():
    out = cli("estimate", "--recipe", "nlp", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["model"]["architecture"] == "transformer" and data["model"]["hidden_size"] == 256
    assert data["inputs"]["seq_len"] == 256 and data["inputs"]["micro_batch_size"] == 4
    assert data["inputs"]["device_memory_label"]  # "local GPU: ..." or "no GPU: host RAM ..."


@pytest.mark.parametrize(
    "doc, command",
    [
        ("tools.md", "zero-recipes estimate --params 7e9 --gpus 8 --gpu-memory 80GB"),
        ("choosing_a_stage.md", "zero-recipes estimate --params 7e9 --gpus 8 --gpu-memory 80GB --offload nvme"),
    ],
)
def test_docs_example_is_the_commands_output(doc, command):
    """The docs show the 7B example as `estimate` prints it: the block must equal a fresh run, line for line."""
    text = (DOCS / doc).read_text()
    match = re.search(rf"```\n\$ {re.escape(command)}\n(.*?)\n```", text, re.S)
    assert match, f"docs/{doc}: no example block for `{command}`"
    out = cli(*command.split()[1:])
    assert out.returncode == 0, out.stderr
    fix = f"paste the output of `{command}` into docs/{doc}"
    assert match.group(1).splitlines() == out.stdout.rstrip("\n").splitlines(), fix


def test_offload_time_column_on_guide_1s_7b_example_by_hand():
    """The time column for 7B on 8 GPUs, summed by hand from the bytes each step moves (docs/choosing_a_stage.md).

    Per rank k = 875M elements, bf16. Optimizer offload: PCIe 2k (gradients out) + 2k (parameters back); DRAM
    16k (CPU Adam reads) + 14k (writes) + 4k (fp32 gradients) = 34k, shared by 8 ranks. Parameter offload adds
    2 x 2k of fetches to PCIe and DRAM. NVMe: 4k fetches + 2k written + 24k master/m/v read and written + 8k
    fp32 gradients written and read = 38k per rank, 8 ranks, 2-4 GB/s.
    """
    k = 7e9 / 8
    expected = {  # (offload) -> {link: (fast, slow) seconds}
        "optimizer": {"pcie": 4 * k / 32e9, "dram": 8 * 34 * k / 100e9},
        "params": {"pcie": 8 * k / 32e9, "dram": 8 * 38 * k / 100e9},
        "nvme": {"pcie": 8 * k / 32e9, "dram": 8 * 38 * k / 100e9, "nvme": 8 * 38 * k / 4e9},
    }
    facts = memory_formulas.assumed_transformer(7_000_000_000)
    rows = {(r.stage, r.offload): r for r in memory.plan(facts, PlanInputs(gpus_per_node=8)).rows}
    for offload, links in expected.items():
        row = rows[(3, offload)]
        assert row.link_seconds.keys() == links.keys()
        for link, fast in links.items():
            slow = fast * 2  # the default ranges: every link's low figure is half its high one
            assert row.link_seconds[link] == pytest.approx((fast, slow), rel=1e-12), (offload, link)
        slowest = max(links, key=links.get)
        assert row.slowest_link == slowest and row.offload_seconds == pytest.approx(row.link_seconds[slowest])
    assert rows[(3, "nvme")].offload_seconds == pytest.approx((66.5, 133.0))
    assert rows[(3, "none")].offload_seconds is None
    # A measured disk replaces the default range by one figure (bench/nvme_io.py measures it).
    measured = memory.plan(
        facts, PlanInputs(gpus_per_node=8, bandwidth_gbps=memory_formulas.parse_bandwidths(["nvme=1.7"]))
    )
    nvme = next(r for r in measured.rows if r.offload == "nvme")
    assert nvme.offload_seconds == pytest.approx((8 * 38 * k / 1.7e9,) * 2)


def test_tools_md_claim_about_guide_1s_measured_totals():
    """tools.md: the planner's totals (no / full checkpointing) bracket published 47 and 22 GB; both exceed 33 GB."""
    facts = memory_formulas.assumed_transformer(7_000_000_000)
    rows = {r.stage: r for r in memory.plan(facts, PlanInputs(gpus_per_node=8)).rows if r.offload == "none"}
    for stage, measured_gb in {1: 47, 3: 22}.items():
        assert rows[stage].total_checkpointed_bytes < measured_gb * GB < rows[stage].total_bytes
    assert rows[2].total_checkpointed_bytes > 33 * GB


def test_choosing_a_stage_quotes_what_estimate_prints():
    """Every figure in docs/choosing_a_stage.md's estimate table is in the output of the command on its row."""
    rows = re.findall(
        r"^\| `(zero-recipes estimate [^`]*)` \| (.*?) \| (.*?) \|$", (DOCS / "choosing_a_stage.md").read_text(), re.M
    )
    assert len(rows) == 3
    for command, recommends, why in rows:
        out = cli(*command.split()[1:])
        assert out.returncode == 0, out.stderr
        recommended = " ".join(out.stdout.split("recommended:")[1].split())
        for figure in re.findall(r"[0-9]+\.[0-9]+ GB", why):
            assert figure in recommended, (command, figure, recommended)
        preset = re.search(r"`(deepspeed_stage_\d)`", recommends)
        assert preset is None or recommended.split()[0] == preset.group(1), (command, recommended)
