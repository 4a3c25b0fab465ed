"""Corpora, tokenizer and packing of the NLP domain (nlp/data.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from nlp import data as nd
from nlp.data import DataError

SAMPLE = "def add(a, b=2):\n    return a + b  # sum\n\nprint(add(1), 'é ü 中')\n"


@pytest.fixture(scope="module")
def small_corpus() -> list[str]:
    # A few stdlib modules: real code, but small enough to train a tokenizer in well under a second.
    names = ("abc.py", "bisect.py", "colorsys.py", "copy.py", "fnmatch.py", "heapq.py", "keyword.py", "shlex.py")
    return [(nd.stdlib_root() / n).read_text(encoding="utf-8") for n in names]


@pytest.fixture(scope="module")
def tokenizer(small_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    return nd.train_bpe_tokenizer(small_corpus, vocab_size=512, out_dir=out), out


# ---------------------------------------------------------------- stdlib discovery and splits


def test_stdlib_files_exclude_tests_site_packages_and_caches():
    files = nd.stdlib_source_files()
    root = nd.stdlib_root()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 300
    assert "os.py" in rel and "json/__init__.py" in rel
    assert rel == sorted(rel)
    excluded = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    assert not any(excluded.intersection(r.split("/")[:-1]) for r in rel)
    assert all(f.suffix == ".py" for f in files)
    assert nd.stdlib_source_files() == files  # deterministic


def test_stdlib_files_on_a_fake_tree(tmp_path):
    for rel in (
        "a.py",
        "pkg/b.py",
        "pkg/c.txt",
        "test/test_a.py",
        "pkg/tests/t.py",
        "idlelib/idle_test/x.py",
        "lib2to3/tests/data/y.py",
        "site-packages/numpy/core.py",
        "__pycache__/a.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert [f.relative_to(tmp_path).as_posix() for f in nd.stdlib_source_files(tmp_path)] == ["a.py", "pkg/b.py"]
    with pytest.raises(DataError, match="not found"):
        nd.stdlib_source_files(tmp_path / "missing")


def test_split_files_is_deterministic_disjoint_and_complete():
    files = [Path(f"/x/f{i:03d}.py") for i in range(100)]
    train, val = nd.split_files(files, 0.1, seed=3)
    assert nd.split_files(list(reversed(files)), 0.1, seed=3) == (train, val)
    assert len(val) == 10 and not set(train) & set(val) and set(train) | set(val) == set(files)
    assert nd.split_files(files, 0.1, seed=4)[1] != val
    assert len(nd.split_files(files[:3], 0.01)[1]) == 1  # never an empty validation set
    with pytest.raises(ValueError, match="val_fraction"):
        nd.split_files(files, 0.0)


def test_split_texts_by_document_and_single_document():
    train, val = nd.split_texts([f"doc {i}" for i in range(20)], 0.1, seed=0)
    assert len(val) == 2 and len(train) == 18 and not set(train) & set(val)
    text = "".join(f"line {i}\n" for i in range(100))
    train, val = nd.split_texts([text], 0.1)
    assert train[0] + val[0] == text and val[0].startswith("line ") and 0 < len(val[0]) < len(text) // 5


# ---------------------------------------------------------------- reading corpora


def test_read_texts_txt_folder_and_jsonl(tmp_path):
    (tmp_path / "one.txt").write_text("hello world\n")
    assert nd.read_texts(str(tmp_path / "one.txt")) == ["hello world\n"]

    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha")
    (folder / "sub" / "b.py").write_text("beta = 1")
    (folder / "sub" / "c.md").write_text("# gamma")
    (folder / "skip.bin").write_bytes(b"\xff\x00")
    (folder / "blank.txt").write_text("  \n")
    assert nd.read_texts(folder) == ["alpha", "beta = 1", "# gamma"]

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"text": "first"}) + "\n\n" + json.dumps({"body": "second", "text": "x"}) + "\n")
    assert nd.read_texts(jsonl) == ["first", "x"]
    other = tmp_path / "body.jsonl"
    other.write_text(json.dumps({"body": "second"}) + "\n")
    assert nd.read_texts(other, text_field="body") == ["second"]


def test_read_texts_jsonl_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        nd.read_texts(bad)
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no 'text' field \(fields: body\)"):
        nd.read_texts(bad)
    bad.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: .*not text"):
        nd.read_texts(bad)


def test_read_texts_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["a b c", "d e f"]}).save_to_disk(str(tmp_path / "ds"))
    assert nd.read_texts(tmp_path / "ds") == ["a b c", "d e f"]
    with pytest.raises(DataError, match="no 'content' column"):
        nd.read_texts(tmp_path / "ds", text_field="content")
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["tr"]}),
            "validation": datasets.Dataset.from_dict({"text": ["va"]}),
        }
    )
    splits.save_to_disk(str(tmp_path / "dd"))
    assert nd.read_texts(tmp_path / "dd") == ["tr"]


def test_read_texts_errors(tmp_path):
    with pytest.raises(DataError, match="data not found"):
        nd.read_texts(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(DataError, match="empty corpus"):
        nd.read_texts(tmp_path / "empty.txt")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="no .txt/.py/.md files"):
        nd.read_texts(tmp_path / "empty_dir")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8"):
        nd.read_texts(tmp_path / "latin1.txt")


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_special_tokens(tokenizer):
    tok, _ = tokenizer
    ids = tok(SAMPLE, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == SAMPLE  # byte level: exact, even for characters never seen
    assert len(tok) == 512
    assert tok.eos_token == tok.bos_token == nd.EOS_TOKEN and tok.pad_token == nd.PAD_TOKEN
    assert tok.pad_token_id != tok.eos_token_id
    assert tok("x = 1")["input_ids"] == tok("x = 1", add_special_tokens=False)["input_ids"]  # no implicit bos


def test_tokenizer_save_and_load(tokenizer):
    tok, folder = tokenizer
    for loaded in (AutoTokenizer.from_pretrained(str(folder)), nd.load_tokenizer(folder)):
        assert loaded(SAMPLE)["input_ids"] == tok(SAMPLE)["input_ids"]
        assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)


def test_load_tokenizer_errors(tokenizer, tmp_path):
    _, folder = tokenizer
    with pytest.raises(DataError, match="tokenizer folder not found"):
        nd.load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no tokenizer files"):
        nd.load_tokenizer(tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    content = (broken / "tokenizer.json").read_bytes()
    (broken / "tokenizer.json").write_bytes(content[: len(content) // 2])
    with pytest.raises(DataError, match="corrupt or unreadable tokenizer"):
        nd.load_tokenizer(broken)


# ---------------------------------------------------------------- packing


def test_pack_tokens_shapes_overlap_and_eos(tokenizer, small_corpus):
    tok, _ = tokenizer
    blocks = nd.pack_tokens(small_corpus, tok, seq_len=64)
    stream = nd.encode_stream(small_corpus, tok)
    assert blocks.dtype == torch.long and blocks.shape == ((len(stream) - 1) // 64, 65)
    assert torch.equal(blocks[:, -1][:-1], blocks[1:, 0])  # one-token overlap: every target used once
    assert stream.count(tok.eos_token_id) == len(small_corpus)
    assert blocks.flatten().tolist()[:65] == stream[:65]
    capped = nd.pack_tokens(small_corpus, tok, seq_len=64, max_tokens=1000)
    assert capped.shape == (999 // 64, 65)


def test_pack_tokens_too_short_corpus(tokenizer):
    tok, _ = tokenizer
    with pytest.raises(DataError, match="fewer than the 4 needed"):
        nd.pack_tokens(["x = 1"], tok, seq_len=64, min_blocks=4, source="tiny.txt")


def test_token_block_dataset_label_conventions():
    blocks = torch.arange(20).reshape(2, 10)
    hf = nd.TokenBlockDataset(blocks)
    item = hf[1]
    assert item["input_ids"].tolist() == list(range(10, 19)) and torch.equal(item["labels"], item["input_ids"])
    assert len(hf) == 2 and hf.seq_len == 9 and hf.n_tokens == 18
    shifted = nd.TokenBlockDataset(blocks, shifted=True)[0]
    assert shifted["labels"].tolist() == list(range(1, 10))


def test_build_lm_datasets_from_folder(tmp_path, small_corpus):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(small_corpus):
        (folder / f"m{i}.py").write_text(text)
    lm = nd.build_lm_datasets(
        folder, None, seq_len=32, val_fraction=0.25, vocab_size=400, tokenizer_out_dir=tmp_path / "t"
    )
    assert lm.vocab_size == 400 and (tmp_path / "t" / "tokenizer.json").is_file()
    assert (lm.n_train_docs, lm.n_val_docs) == (6, 2)
    assert lm.train.seq_len == 32 and len(lm.val) > 0
    assert lm.info()["train_tokens"] == len(lm.train) * 32 and "tokenizer_train_s" in lm.info()["timings_s"]


def test_build_lm_datasets_stdlib_trains_tokenizer_on_train_split_only(monkeypatch, tokenizer):
    tok, _ = tokenizer
    seen: list[str] = []

    def fake_train(texts, vocab_size=4096, out_dir=None):
        seen.extend(texts)
        return tok  # the real training on 12 MB takes seconds; the split is what is tested here

    monkeypatch.setattr(nd, "train_bpe_tokenizer", fake_train)
    lm = nd.build_lm_datasets("stdlib", None, seq_len=64, max_train_tokens=5000, max_val_tokens=2000)
    train_files, val_files = nd.split_files(nd.stdlib_source_files(), 0.05, 0)
    train_texts = [t for t in nd.read_files(train_files) if t.strip()]  # empty __init__.py files are dropped
    assert seen == train_texts and lm.n_train_docs == len(train_texts)
    val_texts = [t for t in nd.read_files(val_files) if t.strip() and t not in set(train_texts)]
    assert lm.n_val_docs == len(val_texts) > 0  # copies of training files are left out of validation
    assert len(lm.train) == 4999 // 64 and len(lm.val) == 1999 // 64
