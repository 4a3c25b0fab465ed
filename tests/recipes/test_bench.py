"""The benchmarks as a user runs them: bench/gpu.sh's CPU mode, and the pieces every bench shares.

The slow test runs two variants of the GPU script's driver on the tiny model (one with ZeRO-3 + CPU offload,
one with full activation checkpointing), each a real DeepSpeed run, so the script works the first time it
meets a GPU. The fast tests check the shared docs writer and the script's refusals.
"""

from __future__ import annotations

import sys

import pytest
from _util import PYTHON, REPO, run

sys.path.insert(0, str(REPO / "bench"))
from _bench_util import read_results, write_section  # noqa: E402


def test_write_section_replaces_its_own_section_and_keeps_the_others(tmp_path):
    doc = tmp_path / "benchmarks.md"
    write_section("overhead", "cmd a", "2026-01-01", "first", doc=doc)
    write_section("export-memory", "cmd b", "2026-01-01", "theirs", doc=doc)
    write_section("overhead", "cmd c", "2026-01-02", "second", doc=doc)
    text = doc.read_text()
    assert text.startswith("# Benchmarks (measured here)")
    assert "second" in text and "first" not in text and "`cmd c` (2026-01-02" in text
    assert "theirs" in text and text.count("<!-- overhead:start -->") == 1
    assert text.index("overhead:start") < text.index("export-memory:start")  # replaced in place


def test_gpu_driver_refuses_an_unknown_variant_with_one_line(tmp_path):
    proc = run([PYTHON, "bench/gpu.py", "--cpu", "--variants", "stage9", "--doc", tmp_path / "x.md"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: unknown variant 'stage9' (did you mean 'stage3'?); valid: stage0, stage1, stage2, stage3, "
        "fsdp2_grad_op, fsdp2, stage3_offload, stage3_zeropp, stage3_nvme, stage2_bf16_states, sdpa, ac_none, "
        "ac_full, ac_every_k, long, long_tiled, long_sp2, long_tiled_offload, recipe_async_save, doctor"
    )
    assert not (tmp_path / "x.md").exists()


def test_gpu_render_without_a_results_file_is_one_line(tmp_path):
    missing = tmp_path / "none.json"
    proc = run(
        [PYTHON, "bench/gpu.py", "--cpu", "--render", "--json", missing, "--doc", tmp_path / "x.md"], check=False
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error:") and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.md").exists()


def test_gpu_script_without_a_gpu_points_to_the_cpu_mode():
    proc = run(["bash", "bench/gpu.sh"], check=False, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2
    assert "error: no GPU visible; run 'bash bench/gpu.sh --cpu'" in proc.stderr


@pytest.mark.slow
def test_gpu_script_cpu_mode_runs_offload_sequence_parallel_tiling_and_fsdp2_variants(tmp_path):
    doc, results = tmp_path / "benchmarks_gpu.md", tmp_path / "gpu.json"
    variants = "stage3_offload,long_sp2,long_tiled_offload,fsdp2_grad_op"
    args = ["--cpu", "--variants", variants, "--doc", doc, "--json", results]
    run([PYTHON, "bench/gpu.py", *args], timeout=300)
    provenance, written = read_results(results)  # through write_results: provenance with the command line
    assert provenance["command"] == f"python bench/gpu.py {' '.join(map(str, args))}"
    assert written["mode"] == "cpu" and written["run"]["config"] == "recipes/nlp/configs/tiny_cpu.yaml"
    rows = written["variants"]
    assert [r["name"] for r in rows] == variants.split(",")
    for r in rows:
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert r["mfu"] is None  # no made-up peak FLOPs on a CPU
        assert r["attention_used"] == "sdpa"
    assert [r["stage"] for r in rows] == [3, 2, 2, "fsdp2_grad_op"]
    assert [r["activation_checkpointing"] for r in rows] == ["selective", "selective", "full", "selective"]
    # FSDP2's peer of stage 2 trains the same model (its parameters counted whole, not as this rank's shards)
    assert rows[3]["num_params"] == rows[0]["num_params"] > 0
    assert "sequence_parallel=2" in rows[1]["overrides"]  # 2 gloo processes, Ulysses between them
    assert {"seq_len=256", "tiled_mlp_shards=8", "offload_checkpoints=true"} <= set(rows[2]["overrides"])
    assert rows[2]["checkpoint_offload_bytes"] == 0  # a CPU is host memory: nothing to move
    text = doc.read_text()
    assert "<!-- cpu-mode:start -->" in text and "CPU mode" in text
    assert "| stage3_offload | 3 | sdpa | selective |" in text and "| long_tiled_offload | 2 | sdpa | full |" in text
    assert "| fsdp2_grad_op | fsdp2_grad_op | sdpa | selective |" in text
    # --render rebuilds the same section from the results file alone, measuring nothing
    rendered = tmp_path / "again" / "benchmarks_gpu.md"  # same name: write_section titles a new page by its name
    run([PYTHON, "bench/gpu.py", "--cpu", "--render", "--json", results, "--doc", rendered], timeout=60)
    assert rendered.read_text() == text


@pytest.mark.slow
def test_gpu_script_nvme_variant_starts_and_a_failed_variant_names_its_exception(tmp_path):
    """The NVMe variant swaps into a folder of its own (the recipes refuse one that does not exist); ZeRO++'s
    quantized collectives have no CPU kernel, and its row says why in the run's own words, not torchrun's."""
    results = tmp_path / "gpu.json"
    args = ["--cpu", "--variants", "stage3_nvme,stage3_zeropp", "--doc", tmp_path / "x.md", "--json", results]
    run([PYTHON, "bench/gpu.py", *args], timeout=300)
    nvme, zeropp = read_results(results)[1]["variants"]
    assert "error" not in nvme, nvme["error"]  # the variant's own line, which a dict's repr would cut off
    assert nvme["tokens_per_s"] > 0, nvme
    assert zeropp["error"].startswith("common.errors.ConfigError: config linter: [zeropp-quantized-needs-gpu]"), zeropp


def test_checkpoint_bench_cpu_mode_writes_its_results_with_provenance(tmp_path):
    """bench/checkpoint.py on a 0.5M-parameter model, one launch: both writers measured, results renderable."""
    results = tmp_path / "checkpoint.json"
    args = ["--hidden-size", "128", "--layers", "2", "--vocab", "512", "--saves", "2", "--repeats", "1"]
    args += ["--saves-per-run", "1", "--processes", "2", "--smaller-sizes", "0", "--write-megabytes", "8"]
    args += ["--json", results, "--no-doc"]
    run([PYTHON, "bench/checkpoint.py", *args], timeout=300)
    provenance, written = read_results(results)
    assert provenance["command"] == f"python bench/checkpoint.py {' '.join(map(str, args))}"
    assert provenance["git_commit"] and provenance["versions"]["deepspeed"] and provenance["cpu_count"] >= 1
    stall = written["stall"]
    assert stall["world_size"] == 2 and stall["num_params"] > 0 and stall["checkpoint_bytes"] > 0
    assert [len(stall["blocked_s"][mode]) for mode in ("sync", "async")] == [2, 2]
    assert written["summary"]["first_async_blocked_s"] == stall["blocked_s"]["async"][0]
    # The snapshot is one rank's share of what a checkpoint holds: between a tenth and all of it.
    assert stall["checkpoint_bytes"] / 10 < stall["snapshot_bytes_per_rank"] < stall["checkpoint_bytes"]
    assert written["summary"]["stall_ratio"] > 0 and len(written["scaling"]) == 1
    assert len(stall["writer_cpu_s"]) == 2 and stall["cpu_cores"] >= 1
    sys.path.insert(0, str(REPO))
    from bench.checkpoint import WRITE_MODES, render_sections

    assert written["write_cost"]["megabytes"] == 8 and all(len(written["write_cost"][m]) == 3 for m in WRITE_MODES)

    body = render_sections({"results": written})["checkpoint saves"]
    assert "stall_ratio" in body and "| 1M | 2 |" in body


@pytest.mark.slow
def test_peer_bench_quick_mode_measures_zero3_and_fsdp2_side_by_side(tmp_path):
    """bench/peer.py --quick: the science recipe's smoke model, Lightning, ZeRO-3 and fsdp2 back to back (two real
    2-process runs); every figure measured, and the rendered ratios are the two sides' own figures divided."""
    results, work = tmp_path / "peer.json", tmp_path / "work"
    args = ["--quick", "--steps", "6", "--json", results, "--no-doc", "--work-dir", work]
    run([PYTHON, "bench/peer.py", *args], timeout=300)
    provenance, written = read_results(results)
    assert provenance["command"] == f"python bench/peer.py {' '.join(map(str, args))}"
    (row,) = written["rows"]
    assert (row["recipe"], row["front_end"], row["zero"], row["fsdp2"], row["error"]) == (
        "science",
        "lightning",
        "deepspeed_stage_3",
        "fsdp2",
        None,
    )
    (zero,), (fsdp2,) = row["runs"]["deepspeed_stage_3"], row["runs"]["fsdp2"]
    for side in (zero, fsdp2):
        assert side["cpu_s_per_step"] > 0 and side["wall_s_per_step"] > 0 and side["samples_per_s"] > 0, side
        assert 0 < side["post_step_rss_bytes"] <= side["peak_rss_bytes"] and side["checkpoint_bytes"] > 0, side
        assert side["checkpoint_blocked_s"] >= 0 and side["model_state_bytes"] > 0, side
        assert side["comm_by_collective"]["all_gather"] > 0 and side["comm_by_collective"]["reduce_scatter"] > 0, side
    # The counter that measures FSDP2's side, checked against DeepSpeed's own log on the ZeRO run (both ran in it):
    # the same all-gathers and reduce-scatters, byte for byte, in every measured step.
    sys.path.insert(0, str(REPO))
    from bench._collective_counter import read_rank_steps, steady_sent_bytes

    zero_comms = work / "science-lightning-deepspeed_stage_3-0-comms"
    logged, counted = (steady_sent_bytes(read_rank_steps(zero_comms / s), 4, 6, 2) for s in ("deepspeed", "torch"))
    for collective in ("all_gather", "reduce_scatter"):
        assert logged[collective] == counted[collective] == zero["comm_by_collective"][collective] > 0, counted
    # Both shard the optimizer state. Under bf16 ZeRO's optimizer holds the fp32 master weights beside Adam's m and v
    # (12 B per parameter), FSDP2's only m and v (8 B: its fp32 parameter shards are the master weights).
    optimizer_ratio = zero["model_state_breakdown"]["optimizer"] / fsdp2["model_state_breakdown"]["optimizer"]
    assert 1.45 < optimizer_ratio < 1.55, (zero, fsdp2)
    from bench.peer import render_sections

    body = render_sections({"results": written})["peer"]
    cpu = zero["cpu_s_per_step"] / fsdp2["cpu_s_per_step"]
    states = zero["model_state_bytes"] / fsdp2["model_state_bytes"]
    sent = zero["comm_bytes_per_step"] / fsdp2["comm_bytes_per_step"]
    assert f"| science | lightning | deepspeed_stage_3 / fsdp2 | {cpu:.2f} | " in body, body
    assert f" | {states:.2f} | " in body.split("\n\n")[1] and f" | {sent:.2f} |\n" in body.split("\n\n")[1] + "\n"
    assert f" | {fsdp2['comm_bytes_per_step'] / 1e6:.2f} |" in body.split("\n\n")[2], body


def test_peer_communication_counts_what_each_rank_sends_with_ring_algorithms():
    """A logged step (DeepSpeed's message convention: an all-gather's shard, a reduce-scatter's or an all-reduce's whole
    buffer) turned into bytes sent per rank, against the ring algorithms' arithmetic done by hand; broadcasts (start-up
    and checkpoint traffic) left out, and the median taken over the chosen steps only."""
    sys.path.insert(0, str(REPO))
    from bench._collective_counter import sent_bytes_per_step, steady_sent_bytes

    step = {
        "all_gather_into_tensor": {"calls": {"100": 2}, "seconds": 0.1},  # 2 shards of 100 B: 2 buffers of 200 B
        "reduce_scatter_tensor": {"calls": {"400": 1}, "seconds": 0.1},
        "all_reduce": {"calls": {"8": 1}, "seconds": 0.0},
        "broadcast": {"calls": {"1000": 3}, "seconds": 0.0},
    }
    # 2 ranks: each sends half of every all-gathered or reduce-scattered buffer, an all-reduce's buffer once.
    assert sent_bytes_per_step(step, 2) == {"all_gather": 200.0, "reduce_scatter": 200.0, "all_reduce": 8.0}
    # 4 ranks: all-gathered buffers of 400 B, 3/4 of each sent; 3/4 of the 400 B reduce-scattered; 2 x 3/4 x 8.
    assert sent_bytes_per_step(step, 4) == {"all_gather": 600.0, "reduce_scatter": 300.0, "all_reduce": 12.0}
    warm_up = {"all_gather": {"calls": {"100000": 1}, "seconds": 0.0}}
    later = {"all_gather": {"calls": {"100": 4}, "seconds": 0.0}}  # 400 B sent
    assert steady_sent_bytes([warm_up, step, step, later], 2, 4, 2)["all_gather"] == 200.0  # median of 200, 200, 400


def test_peer_render_judges_the_nlp_goal_on_each_pairs_medians():
    """The NLP goal (ZeRO at most 1.00x FSDP2's CPU time and 1.10x its model states) is judged per pair on the
    median of the repetitions' ratios; rows of other recipes are not judged."""
    sys.path.insert(0, str(REPO))
    from bench.peer import nlp_goal_text

    def row(recipe, front_end, zero_cpu, zero_states):  # FSDP2's side: 1.0 s and 100 bytes in every repetition
        zero = [{"cpu_s_per_step": c, "model_state_bytes": s} for c, s in zip(zero_cpu, zero_states)]
        fsdp2 = [{"cpu_s_per_step": 1.0, "model_state_bytes": 100}] * len(zero)
        return {"recipe": recipe, "front_end": front_end, "zero": "z", "fsdp2": "f", "runs": {"z": zero, "f": fsdp2}}

    text = nlp_goal_text(
        [
            row("nlp", "lightning", [0.9, 1.0, 1.3], [110, 110, 110]),  # medians 1.00 and 1.10: on the bar
            row("nlp", "accelerate", [0.9, 1.02, 1.02], [100, 100, 100]),  # CPU median 1.02
            row("cv", "lightning", [2.0, 2.0, 2.0], [300, 300, 300]),
        ]
    )
    assert "- lightning, z / f: CPU time 1.00x, model states 1.10x: met." in text, text
    assert "- accelerate, z / f: CPU time 1.02x, model states 1.00x: not met." in text, text
    assert "2.00x" not in text and nlp_goal_text([row("cv", "lightning", [2.0], [300])]) == ""


def test_peer_125m_mode_renders_its_own_section_and_refuses_the_other_modes(tmp_path):
    """--model 125m results go to their own section (the default model's "peer" section stays), judged against the
    same NLP goal; with --quick or --settings it is one usage error before any run."""
    sys.path.insert(0, str(REPO))
    from bench.peer import NLP_125M, command, render_sections

    def side(cpu):
        return {"cpu_s_per_step": cpu, "wall_s_per_step": cpu, "samples_per_s": 1.0, "model_state_bytes": 100,
                "model_state_breakdown": {"params": 100}, "peak_rss_bytes": 1, "post_step_rss_bytes": 1,
                "checkpoint_bytes": 1, "checkpoint_blocked_s": 0.1, "final_loss": 1.0, "comm_bytes_per_step": 1.0,
                "comm_by_collective": {"all_gather": 1.0}}  # fmt: skip

    row = {"recipe": "nlp", "front_end": "lightning", "zero": "z", "fsdp2": "f", "error": None}
    row["runs"] = {"z": [side(2.0)], "f": [side(1.0)]}
    results = {"mode": "125m", "reps": 1, "steps": 8, "warmup": 3, "model": "125M", "skipped": {}, "rows": [row]}
    sections = render_sections({"results": results})
    assert list(sections) == ["peer-125m"]
    assert "- lightning, z / f: CPU time 2.00x, model states 1.00x: not met." in sections["peer-125m"]
    # The shipped config is read before the overrides (argparse takes --config ahead of the key=value list).
    argv = command("nlp", "lightning", [*NLP_125M, "preset=fsdp2"])
    assert argv[2:4] == ["--config", str(REPO / "recipes" / "nlp" / "configs" / "llama_125m.yaml")]
    assert argv[-1] == "devices=2" and (REPO / "recipes" / "nlp" / "configs" / "llama_125m.yaml").is_file()
    for other in ("--quick", "--settings"):
        proc = run([PYTHON, "bench/peer.py", "--model", "125m", other, "--work-dir", tmp_path], check=False)
        assert proc.returncode == 2 and "not with --quick or --settings" in proc.stderr, proc.stderr
    proc = run([PYTHON, "bench/peer.py", "--profile", "--work-dir", tmp_path], check=False)
    assert proc.returncode == 2 and "add --model 125m" in proc.stderr, proc.stderr  # its file is the 125M config's
    assert not list(tmp_path.iterdir())  # nothing ran


def test_peer_lists_a_figure_where_zero_is_above_fsdp2_in_every_repetition_to_the_printed_decimals():
    """ "Where ZeRO costs more" names a figure whose ratio is above 1.00 in every repetition as printed: 1.02 and
    1.06 are, 1.00004 (a few bytes more a step) is not, nor a figure above 1.00 in one repetition only."""
    sys.path.insert(0, str(REPO))
    from bench.peer import where_zero_loses

    def runs(cpu, sent):
        return [{"cpu_s_per_step": c, "comm_bytes_per_step": b, "model_state_breakdown": {}} for c, b in zip(cpu, sent)]

    zero, fsdp2 = runs([1.02, 1.06], [100_004, 100_004]), runs([1.0, 1.0], [100_000, 100_000])
    row = {"recipe": "nlp", "front_end": "lightning", "zero": "z", "fsdp2": "f", "runs": {"z": zero, "f": fsdp2}}
    text = where_zero_loses([row])
    assert "CPU time per step 1.04x FSDP2's" in text and "communication" not in text, text
    row["runs"]["z"] = runs([1.02, 0.98], [100_004, 100_004])
    assert "CPU time" not in where_zero_loses([row])


def test_peer_names_a_zero_preset_whose_bytes_differ_between_front_ends():
    """A ZeRO preset sending different bytes a step on the two front-ends of one recipe is named with both medians;
    equal bytes (within 1 %) and a front-end alone are not."""
    sys.path.insert(0, str(REPO))
    from bench.peer import front_end_traffic_text

    def row(recipe, front_end, sent):
        return {"recipe": recipe, "front_end": front_end, "zero": "z", "fsdp2": "f",
                "runs": {"z": [{"comm_bytes_per_step": b} for b in sent], "f": [{}]}}  # fmt: skip

    text = front_end_traffic_text(
        [
            row("nlp", "lightning", [10e6, 10e6]),
            row("nlp", "accelerate", [15e6, 16e6, 17e6]),  # median 16 MB
            row("cv", "lightning", [1e6]),
            row("cv", "accelerate", [1.005e6]),  # within 1 %
            row("science", "lightning", [3e6]),  # no accelerate row
        ]
    )
    assert "- nlp, z: the accelerate run sends 16.00 MB a step, the lightning run 10.00 MB" in text, text
    assert "cv" not in text and "science" not in text
    assert front_end_traffic_text([row("cv", "lightning", [1e6]), row("cv", "accelerate", [1e6])]) == ""
