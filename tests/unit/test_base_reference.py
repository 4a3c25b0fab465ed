"""The frozen base's reference in a fine-tuning checkpoint: what it records and when a resume is refused.

The digests are recomputed here with hashlib on the files themselves, not through the code under test. The
2-process runs that write the reference and refuse a changed base on both backends are in
tests/recipes/test_finetune_recipe.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.errors import ConfigError
from common.model_folder import BASE_REFERENCE, base_reference, check_base_unchanged, write_base_reference


@pytest.fixture
def base(tmp_path) -> Path:
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8}')
    save_file({"w": torch.ones(4, 4)}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")  # not part of the weights: not referenced
    return folder


def test_the_reference_holds_the_sha256_of_config_and_weights(base):
    reference = base_reference(base)
    expected = {
        name: hashlib.sha256((base / name).read_bytes()).hexdigest() for name in ("config.json", "model.safetensors")
    }
    assert reference == {"path": str(base.resolve()), "sha256": expected}


def test_an_unchanged_base_resumes_and_a_changed_one_is_refused_naming_the_file(base, tmp_path):
    checkpoint = tmp_path / "step_000004"
    checkpoint.mkdir()
    write_base_reference(checkpoint, base_reference(base))
    assert (checkpoint / BASE_REFERENCE).is_file()
    check_base_unchanged(checkpoint, base_reference(base))  # same files: nothing to say

    save_file({"w": torch.ones(4, 4) * 1.001}, str(base / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.safetensors changed; resume with the base the run started with"):
        check_base_unchanged(checkpoint, base_reference(base))


def test_shards_that_went_missing_or_appeared_are_named(base, tmp_path):
    checkpoint = tmp_path / "step_000004"
    checkpoint.mkdir()
    write_base_reference(checkpoint, base_reference(base))
    (base / "model.safetensors").rename(base / "model-00001-of-00001.safetensors")
    with pytest.raises(ConfigError, match="model.safetensors missing, model-00001-of-00001.safetensors new"):
        check_base_unchanged(checkpoint, base_reference(base))


def test_a_checkpoint_without_a_reference_or_no_checkpoint_is_not_checked(base, tmp_path):
    check_base_unchanged(None, base_reference(base))
    (tmp_path / "old_checkpoint").mkdir()  # written before references existed
    check_base_unchanged(tmp_path / "old_checkpoint", base_reference(base))
