"""``zero-recipes export`` of an FSDP2 (DCP) checkpoint, in one process: a tied-embedding Llama's training state
saved as the Accelerate loop saves it (``common.fsdp2.dcp_write``: ``model``, ``optimizer``, ``extra``), in a run
directory whose ``final/`` holds the model's config. The export must load with ``from_pretrained`` and give the
saved model's logits (computed from the module itself, not from the checkpoint); ``--verify`` must pass against
torch's own reader and fail when one exported tensor is changed.
"""

from __future__ import annotations

import json

import pytest
import torch
from _util import tied_llama
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from common.fsdp2 import dcp_write
from common.tools.export import export_checkpoint, verify_export, verify_failures


@pytest.fixture
def fsdp2_run(tmp_path):
    """(run directory, the model saved in its step-1 checkpoint)."""
    model = tied_llama(hidden_size=32, vocab_size=128, max_positions=64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.arange(16)[None], labels=torch.arange(16)[None]).loss.backward()
    optimizer.step()  # moments in the optimizer state: the export must leave them out
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("preset: fsdp2\n")
    dcp_write(model, optimizer, {"scheduler": {"last_epoch": 1}})(run_dir / "checkpoints" / "step_000001")
    (run_dir / "checkpoints" / "latest").write_text("step_000001\n")
    model.save_pretrained(run_dir / "final")  # the config the export names the weights by
    return run_dir, model


def logits(model: torch.nn.Module) -> torch.Tensor:
    batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(input_ids=batch).logits


def test_an_fsdp2_checkpoint_exports_to_a_hugging_face_folder_with_the_saved_models_logits(fsdp2_run, tmp_path):
    run_dir, model = fsdp2_run
    out = tmp_path / "exported"
    result = export_checkpoint(run_dir, out, progress=False)
    assert result["fsdp2"] and result["hugging_face"] and result["world_size"] == 1, result
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # the tie is left to the config
    assert not [name for name in names if "exp_avg" in name or name.startswith(("optimizer", "extra"))]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(logits(loaded), logits(model))

    check = verify_export(run_dir, out, progress=False)
    assert check["reference"] == "torch's dcp_to_torch_save" and not verify_failures(check), check
    assert check["tensors_checked"] == len(names) and check["max_abs_logit_diff"] == 0.0


def test_verify_fails_when_one_exported_fsdp2_tensor_is_changed(fsdp2_run, tmp_path):
    run_dir, _ = fsdp2_run
    out = tmp_path / "exported"
    export_checkpoint(run_dir, out, progress=False)
    file = out / "model-00001-of-00001.safetensors"
    tensors = load_file(str(file))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3
    save_file(tensors, str(file), metadata={"format": "pt"})
    failures = verify_failures(verify_export(run_dir, out, progress=False))
    assert any("model.norm.weight" in failure for failure in failures) and any("logits" in f for f in failures)
