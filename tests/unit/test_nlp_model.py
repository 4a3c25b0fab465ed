"""Llama sizes, construction, attention choice and FLOPs of the NLP domain (nlp/model.py)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from nlp import data as nd
from nlp import model as nm
from nlp.model import ModelError


@pytest.fixture(scope="module")
def tokenizer():
    texts = [(nd.stdlib_root() / n).read_text(encoding="utf-8") for n in ("bisect.py", "heapq.py", "shlex.py")]
    return nd.train_bpe_tokenizer(texts, vocab_size=300)


def micro_config(tokenizer, **overrides):
    # The tiny size shrunk further so that building and running it takes milliseconds.
    kwargs = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    }
    kwargs.update(overrides)
    return nm.build_llama_config("tiny", tokenizer=tokenizer, seq_len=64, **kwargs)


# ---------------------------------------------------------------- sizes and parameter counts


def test_tiny_has_about_5_3m_parameters_with_vocab_4096():
    config = nm.build_llama_config("tiny", vocab_size=4096, seq_len=256)
    model = nm.build_model_from_config(config)
    n = sum(p.numel() for p in model.parameters())
    assert n == nm.llama_param_count(config) == 5_261_568
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.intermediate_size) == (
        256,
        4,
        4,
        688,
    )


@pytest.mark.parametrize(("size", "billions"), [("125m", 0.134), ("1b", 1.100), ("7b", 6.738)])
def test_reference_sizes_match_their_models(size, billions):
    # Counted from the config alone: 1.100B is TinyLlama-1.1B, 6.738B is Llama-2-7B.
    assert nm.llama_param_count(nm.build_llama_config(size)) / 1e9 == pytest.approx(billions, abs=5e-4)


def test_param_count_matches_a_built_model_with_gqa_bias_and_tying(tokenizer):
    for overrides in ({"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}, {}):
        for tie in (False, True):
            config = micro_config(tokenizer, tie_word_embeddings=tie, **overrides)
            model = nm.build_model_from_config(config)
            assert sum(p.numel() for p in model.parameters()) == nm.llama_param_count(config)


def test_build_llama_config_takes_ids_and_vocab_from_tokenizer(tokenizer):
    config = nm.build_llama_config("tiny", tokenizer=tokenizer, seq_len=1024)
    assert config.vocab_size == len(tokenizer) == 300
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert config.max_position_embeddings >= 1024 and config.tie_word_embeddings is False
    assert nm.build_llama_config("tiny", vocab_size=512, tokenizer=tokenizer).vocab_size == 512
    with pytest.raises(ModelError, match="smaller than the tokenizer"):
        nm.build_llama_config("tiny", vocab_size=100, tokenizer=tokenizer)
    with pytest.raises(ModelError, match="unknown Llama size 'huge'"):
        nm.build_llama_config("huge")


def test_flops_per_token_formula():
    config = nm.build_llama_config("tiny", vocab_size=4096)
    non_embedding_input = 5_261_568 - 4096 * 256
    assert nm.flops_per_token(config, 256) == 6 * non_embedding_input + 12 * 4 * 4 * 64 * 256
    assert nm.flops_per_token(config, 512) > nm.flops_per_token(config, 256)


def test_block_class_is_the_decoder_layer(tokenizer):
    assert nm.llama_block_class() is LlamaDecoderLayer
    model = nm.build_model_from_config(micro_config(tokenizer))
    assert sum(isinstance(m, nm.llama_block_class()) for m in model.modules()) == 2


# ---------------------------------------------------------------- attention choice


@pytest.mark.parametrize(
    ("device", "dtype", "installed", "expected"),
    [
        ("cuda", torch.bfloat16, True, "flash_attention_2"),
        ("cuda", torch.float16, True, "flash_attention_2"),
        ("cuda", torch.float32, True, "sdpa"),
        ("cuda", torch.bfloat16, False, "sdpa"),
        ("cpu", torch.bfloat16, True, "sdpa"),
        ("cpu", torch.float32, False, "sdpa"),
    ],
)
def test_resolve_auto(device, dtype, installed, expected):
    assert nm.resolve_attention("auto", device, dtype, flash_installed=installed) == expected


@pytest.mark.parametrize("choice", ["sdpa", "eager"])
def test_resolve_explicit_passes_through(choice):
    assert nm.resolve_attention(choice, "cpu", torch.float32, flash_installed=False) == choice
    assert nm.resolve_attention(choice, "cuda", torch.bfloat16, flash_installed=True) == choice


def test_resolve_explicit_flash_where_it_runs():
    assert (
        nm.resolve_attention("flash_attention_2", "cuda", torch.bfloat16, flash_installed=True) == "flash_attention_2"
    )


@pytest.mark.parametrize(
    ("device", "dtype", "installed", "reason"),
    [
        ("cuda", torch.bfloat16, False, r"not installed \(pip install zero-recipes\[flash\]\)"),
        ("cpu", torch.bfloat16, True, r"no GPU \(device is cpu\)"),
        ("cuda", torch.float32, True, r"dtype is float32"),
    ],
)
def test_resolve_explicit_flash_names_why_it_cannot_run(device, dtype, installed, reason):
    with pytest.raises(ValueError, match=reason):
        nm.resolve_attention("flash_attention_2", device, dtype, flash_installed=installed)


def test_resolve_explicit_flash_names_every_reason():
    with pytest.raises(ValueError) as err:
        nm.resolve_attention("flash_attention_2", "cpu", torch.float32, flash_installed=False)
    assert all(s in str(err.value) for s in ("not installed", "no GPU", "float32"))


def test_resolve_unknown_choice_and_installed_check():
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        nm.resolve_attention("flash", "cuda", torch.bfloat16)
    assert isinstance(nm.flash_attn_installed(), bool)
    # None means "look": the answer must agree with the helper.
    expected = "flash_attention_2" if nm.flash_attn_installed() else "sdpa"
    assert nm.resolve_attention("auto", "cuda", torch.bfloat16) == expected


# ---------------------------------------------------------------- building, loading, running


def test_initial_loss_is_about_ln_vocab(tokenizer):
    torch.manual_seed(0)
    model = nm.build_model_from_config(micro_config(tokenizer), attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(0, len(tokenizer), (2, 32))
    loss = model(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - math.log(len(tokenizer))) < 0.5
    with pytest.raises(ValueError, match="resolve 'auto'"):
        nm.build_model_from_config(micro_config(tokenizer), attn_implementation="auto")


def test_save_and_load_pretrained(tokenizer, tmp_path):
    model = nm.build_model_from_config(micro_config(tokenizer))
    model.save_pretrained(tmp_path / "m")
    loaded = nm.load_pretrained(tmp_path / "m", torch_dtype=torch.bfloat16)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight.float(), model.lm_head.weight.to(torch.bfloat16).float())


def test_load_pretrained_errors(tmp_path):
    with pytest.raises(ModelError, match="model folder not found"):
        nm.load_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        nm.load_pretrained(tmp_path / "empty")


def test_generate_sample_returns_new_text_and_restores_mode(tokenizer):
    model = nm.build_model_from_config(micro_config(tokenizer))
    model.train()
    text = nm.generate_sample(model, tokenizer, "def f(", max_new_tokens=5)
    assert isinstance(text, str) and not text.startswith("def f(")
    assert model.training
