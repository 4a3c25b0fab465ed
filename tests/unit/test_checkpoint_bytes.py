"""bench/checkpoint_bytes.py's measurements, each against a reference built independently of it.

The bench publishes what a fine-tuning save costs beside a full-training one, how much of a full-training
checkpoint stays bit-identical between saves (what a differential save could skip), and what byte-plane compression
saves on an export-only copy. Its runs take minutes (bench only); the functions that turn files into those figures
are checked here on files whose answer is known by construction.
"""

from __future__ import annotations

import struct
import zlib

import torch
from safetensors.torch import save_file

from bench import checkpoint_bytes as bench


def test_folder_bytes_sorts_every_file_by_what_deepspeed_named_it(tmp_path):
    tag = tmp_path / "step_000002" / "checkpoint"
    tag.mkdir(parents=True)
    sizes = {
        "mp_rank_00_model_states.pt": 11,
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": 1000,
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": 300,
        "zero_to_fp32.py": 7,
    }
    for name, size in sizes.items():
        (tag / name).write_bytes(b"x" * size)
    (tmp_path / "step_000002" / "base_model.json").write_bytes(b"{}")
    assert bench.folder_bytes(tmp_path / "step_000002") == {
        "model states": 11,
        "optimizer states": 1300,
        "other": 9,
        "total": 1320,
    }


def test_unchanged_elements_compares_bit_patterns_file_by_file(tmp_path):
    before, after = tmp_path / "step_000001", tmp_path / "step_000002"
    for folder in (before, after):
        (folder / "tag").mkdir(parents=True)
    weights = torch.arange(10, dtype=torch.float32)
    moved = weights.clone()
    moved[[1, 4, 7]] += 0.5  # 3 of 10 changed
    signed = torch.tensor([0.0, 0.0, 1.0, float("nan")])
    flipped = torch.tensor([-0.0, -0.0, 1.0, float("nan")])  # -0.0 == 0.0 as values, not as bytes; NaN bits unchanged
    torch.save({"module": {"w": weights}, "step": 3, "ids": torch.arange(4)}, before / "tag" / "model_states.pt")
    torch.save({"module": {"w": moved}, "step": 4, "ids": torch.arange(4) + 1}, after / "tag" / "model_states.pt")
    torch.save({"state": [signed, torch.ones(5, dtype=torch.bfloat16)]}, before / "tag" / "optim_states.pt")
    torch.save({"state": [flipped, torch.ones(5, dtype=torch.bfloat16)]}, after / "tag" / "optim_states.pt")
    # Integer tensors (ids) are bookkeeping, not state a differential save would skip: not counted.
    assert bench.unchanged_elements(before, after) == {"elements": 10 + 4 + 5, "unchanged": 7 + 2 + 5}


def test_byte_planes_regroup_each_elements_bytes_losslessly():
    values = [1.0, -2.5, 0.15625]  # exact in bf16 too, whose bytes are then the float's top two
    tensor = torch.tensor(values, dtype=torch.float32)
    # Reference: the little-endian bytes of each float, byte k of every element together.
    packed = [struct.pack("<f", v) for v in values]
    expected = b"".join(bytes(p[k] for p in packed) for k in range(4))
    assert bench.byte_planes(tensor) == expected
    assert bench.byte_planes(tensor.to(torch.bfloat16)) == b"".join(
        bytes(struct.pack("<f", v)[2 + k] for v in values)
        for k in range(2)  # bf16: the float's top two bytes
    )


def test_compressed_sizes_count_every_tensor_and_planes_help_trained_like_weights(tmp_path):
    generator = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(256, 64, generator=generator) * 0.02, "b": torch.ones(1000)}
    save_file(weights, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"c": torch.zeros(10, dtype=torch.bfloat16)}, tmp_path / "model-00002-of-00002.safetensors")
    sizes = bench.compressed_sizes(tmp_path)
    assert sizes["raw"] == (256 * 64 + 1000) * 4 + 10 * 2
    as_is = sum(len(zlib.compress(t.numpy().tobytes(), bench.ZLIB_LEVEL)) for t in weights.values())
    assert sizes["zlib"] == as_is + len(zlib.compress(bytes(20), bench.ZLIB_LEVEL))
    assert sizes["zlib_planes"] < sizes["zlib"] < sizes["raw"]


def _document(lora_total: int) -> dict:
    def save(total: int) -> dict:
        return {"model states": 0, "optimizer states": total, "other": 0, "total": total}

    export = {"files_bytes": 200, "raw": 200, "zlib": 190, "zlib_planes": 150, "compress_s": 0.1, "tensors": 3}
    results = {
        "full": {"saves": {"1": save(1000), "2": save(1000)}, "unchanged": {"elements": 100, "unchanged": 10}},
        "finetune": {
            "saves": {"1": save(lora_total), "2": save(lora_total)},
            "unchanged": {"elements": 6, "unchanged": 0},
            "trainable_params": 2,
            "total_params": 50,
        },
        "export": {"fp32": export, "bf16": {**export, "files_bytes": 100}},
    }
    return {"provenance": {}, "results": results}


def test_the_rendered_verdict_follows_the_ten_percent_bar():
    met = bench.render_sections(_document(100))["checkpoint bytes"]
    assert "10.0% of a full-training save" in met and "(bar <= 10%: met)" in met
    missed = bench.render_sections(_document(101))["checkpoint bytes"]
    assert "10.1% of a full-training save" in missed and "(bar <= 10%: not met)" in missed
    assert "| bf16 safetensors | 0.00 | 10.0% |" in met and "10.00% of the saved elements" in met
