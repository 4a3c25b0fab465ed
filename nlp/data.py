"""Language-model data: corpora, a byte-level BPE tokenizer, and packed token blocks.

The built-in corpus is the running interpreter's own standard library (about 12 MB of Python,
present on every install), so the NLP recipe trains on real text without a network. Users point
``data`` at their own text instead: a ``.txt`` file, a folder of ``.txt``/``.py``/``.md`` files, a
``.jsonl`` file, or a folder written by ``datasets.Dataset.save_to_disk``.

Nothing here imports Lightning, Accelerate or DeepSpeed: the recipes wrap these plain objects.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

STDLIB = "stdlib"
"""The ``data`` value that selects the built-in corpus (the standard library's source)."""

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
TEXT_SUFFIXES = (".txt", ".py", ".md")

# Folder names that hold test suites, test data or third-party code in a CPython install. Tests are
# left out because they are full of deliberately odd code (bad encodings, syntax-error fixtures).
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


class DataError(ValueError):
    """A corpus, tokenizer or instruction file that cannot be used; the message names the file."""


# --------------------------------------------------------------------------------------------
# Corpora
# --------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    """Return the folder of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """List the standard library's ``.py`` files, without tests, site-packages or caches.

    Args:
        root: Folder to scan; defaults to :func:`stdlib_root`.

    Returns:
        Absolute paths sorted by their path relative to ``root`` (deterministic across runs).

    Raises:
        DataError: If the folder does not exist or holds no source files.
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise DataError(f"standard library folder not found: {root}")
    files = []
    for folder, subdirs, names in os.walk(root):
        # Prune in place: site-packages alone can be twenty times the size of the standard library.
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    if not files:
        raise DataError(f"no .py files found under the standard library folder {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(
    files: Sequence[Path | str], val_fraction: float = 0.05, seed: int = 0
) -> tuple[list[Path], list[Path]]:
    """Split a list of files into train and validation sets, by whole file.

    Splitting by file (not by block) keeps validation text unseen: a file's neighbouring blocks
    are near-duplicates of each other.

    Args:
        files: Files to split; their order does not matter (they are sorted first).
        val_fraction: Fraction of files for validation, in (0, 1).
        seed: Seed of the shuffle.

    Returns:
        ``(train, val)``, each sorted, disjoint, together all files; both non-empty.

    Raises:
        ValueError: If ``val_fraction`` is outside (0, 1) or there are fewer than two files.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    ordered = sorted((Path(f) for f in files), key=lambda p: p.as_posix())
    if len(ordered) < 2:
        raise ValueError(f"need at least 2 files to split into train and validation, got {len(ordered)}")
    shuffled = list(ordered)
    random.Random(seed).shuffle(shuffled)
    n_val = min(len(shuffled) - 1, max(1, round(len(shuffled) * val_fraction)))
    val = sorted(shuffled[:n_val], key=lambda p: p.as_posix())
    train = sorted(shuffled[n_val:], key=lambda p: p.as_posix())
    return train, val


def split_texts(texts: Sequence[str], val_fraction: float = 0.05, seed: int = 0) -> tuple[list[str], list[str]]:
    """Split documents into train and validation sets, by whole document.

    A corpus of a single document (one ``.txt`` file) is cut at the line break nearest to
    ``1 - val_fraction`` of its length instead, so that it still gives a validation set.

    Args:
        texts: Documents.
        val_fraction: Fraction of documents for validation, in (0, 1).
        seed: Seed of the shuffle.

    Returns:
        ``(train, val)`` lists of documents, both non-empty.

    Raises:
        ValueError: If ``val_fraction`` is outside (0, 1) or the corpus is too small to split.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(texts) >= 2:
        order = list(range(len(texts)))
        random.Random(seed).shuffle(order)
        n_val = min(len(texts) - 1, max(1, round(len(texts) * val_fraction)))
        val_ids = set(order[:n_val])
        return [t for i, t in enumerate(texts) if i not in val_ids], [t for i, t in enumerate(texts) if i in val_ids]
    if not texts:
        raise ValueError("cannot split an empty corpus")
    text = texts[0]
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.rfind("\n", 0, cut)
    cut = newline + 1 if newline > 0 else cut
    if cut <= 0 or cut >= len(text):
        raise ValueError("the corpus is a single document too short to split into train and validation")
    return [text[:cut]], [text[cut:]]


def _read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc.strerror or exc})") from exc


def read_files(files: Iterable[Path | str]) -> list[str]:
    """Read UTF-8 text files, one document per file.

    Raises:
        DataError: Naming the first file that cannot be read or decoded.
    """
    return [_read_text_file(Path(f)) for f in files]


def jsonl_objects(text: str, path: Path) -> Iterator[tuple[str, dict]]:
    """The JSON objects of a JSON Lines file's text, each with where it stands (``file:line``); blank lines skipped.

    Raises:
        DataError: Naming the file and line of a line that is not JSON or not a JSON object.
    """
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record


def _read_jsonl_texts(path: Path, text_field: str) -> list[str]:
    texts = []
    for where, record in jsonl_objects(_read_text_file(path), path):
        if text_field not in record:
            raise DataError(f"{where}: no {text_field!r} field (fields: {', '.join(sorted(record)) or 'none'})")
        if not isinstance(record[text_field], str):
            raise DataError(f"{where}: field {text_field!r} is {type(record[text_field]).__name__}, not text")
        texts.append(record[text_field])
    return texts


def _is_saved_dataset(folder: Path) -> bool:
    # Files that datasets' save_to_disk writes for a Dataset and for a DatasetDict respectively.
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _read_saved_dataset(folder: Path, text_field: str) -> list[str]:
    import datasets  # imported here: it is slow to import and only this source needs it

    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as exc:  # datasets raises many types for a damaged folder
        raise DataError(f"{folder}: cannot load the saved dataset ({exc})") from exc
    if isinstance(loaded, datasets.DatasetDict):
        # A user's own validation split must not leak into training: take "train" (or the only split).
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(loaded) == 1:
            loaded = next(iter(loaded.values()))
        else:
            raise DataError(f"{folder}: a DatasetDict without a 'train' split (splits: {', '.join(loaded)})")
    if text_field not in loaded.column_names:
        raise DataError(f"{folder}: no {text_field!r} column (columns: {', '.join(loaded.column_names)})")
    texts = loaded[text_field]
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise DataError(f"{folder}: row {bad} of column {text_field!r} is {type(texts[bad]).__name__}, not text")
    return list(texts)


def read_texts(data: str | Path, text_field: str = "text") -> list[str]:
    """Read a corpus as a list of documents.

    Args:
        data: ``"stdlib"`` for the built-in corpus; a ``.txt`` file (one document); a ``.jsonl``
            file (one JSON object per line, text in ``text_field``); a folder written by
            ``datasets.save_to_disk`` (its ``text_field`` column; the ``train`` split of a
            DatasetDict); or any other folder, whose ``.txt``/``.py``/``.md`` files are read
            recursively, one document per file.
        text_field: Field or column that holds the text in JSONL and saved datasets.

    Returns:
        The non-blank documents, in a deterministic order.

    Raises:
        DataError: The path is missing, a file cannot be read, a JSONL line is malformed (the
            message names the line number), or the corpus holds no text at all.
    """
    if str(data) == STDLIB:
        return _non_empty(read_files(stdlib_source_files()), STDLIB)
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"data not found: {path} (give 'stdlib', a .txt/.jsonl file or a folder)")
    if path.is_dir():
        if _is_saved_dataset(path):
            texts = _read_saved_dataset(path, text_field)
        else:
            files = sorted(
                (p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            if not files:
                raise DataError(f"{path}: no {'/'.join(TEXT_SUFFIXES)} files in this folder")
            texts = read_files(files)
    elif path.suffix == ".jsonl":
        texts = _read_jsonl_texts(path, text_field)
    else:
        texts = [_read_text_file(path)]
    return _non_empty(texts, path)


def _non_empty(texts: list[str], source: str | Path) -> list[str]:
    kept = [t for t in texts if t.strip()]
    if not kept:
        raise DataError(f"{source}: empty corpus (no text in {len(texts)} document(s))")
    return kept


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 4096, out_dir: str | Path | None = None, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2 style) on ``texts``.

    Byte level means every string can be encoded (no unknown tokens) and decoding gives the
    exact text back. ``<|endoftext|>`` serves as bos, eos and unk; ``<|pad|>`` is a separate pad
    token so that collators that mask padding in the labels never mask the end of a document.

    Args:
        texts: Training documents.
        vocab_size: Size of the vocabulary, special tokens and the 256 byte tokens included.
        out_dir: If given, the tokenizer is saved there with ``save_pretrained`` (loadable with
            ``AutoTokenizer.from_pretrained(out_dir)``).
        min_frequency: Least number of occurrences of a pair for it to be merged.

    Returns:
        The trained tokenizer.

    Raises:
        ValueError: If ``vocab_size`` cannot hold the byte alphabet and special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise ValueError(f"vocab_size must be at least {len(alphabet) + 2} (bytes + special tokens), got {vocab_size}")
    backend = Tokenizer(models.BPE())
    # add_prefix_space=False: source code is whitespace-sensitive, keep the text exactly as given.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def train_stdlib_tokenizer(
    vocab_size: int, val_fraction: float, seed: int, out_dir: str | Path
) -> PreTrainedTokenizerFast:
    """The tokenizer a ``data=stdlib`` run trains when given none (:func:`load_lm_data`): a byte-level BPE on the
    train split of the same ``val_fraction`` and ``seed``, so the same tokens, saved to ``out_dir``. Tests and
    benches train it once and give it to many runs (``tokenizer=``)."""
    train_files, _ = split_files(stdlib_source_files(), val_fraction, seed)
    return train_bpe_tokenizer(read_files(train_files), vocab_size=vocab_size, out_dir=out_dir)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder (never from a hub).

    Raises:
        DataError: If the folder is missing, holds no tokenizer files, or they are corrupt.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DataError(f"tokenizer folder not found: {folder}")
    known = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((folder / name).is_file() for name in known):
        raise DataError(f"{folder}: no tokenizer files (expected one of {', '.join(known)})")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # tokenizers/transformers raise many types for a damaged file
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{folder}: corrupt or unreadable tokenizer ({detail})") from exc


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def encode_stream(
    texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, max_tokens: int | None = None, batch_docs: int = 64
) -> list[int]:
    """Encode documents into one token stream with eos after every document.

    Encodes in batches (the Rust tokenizer parallelises a batch) and stops early once
    ``max_tokens`` are reached, so capping a big corpus also caps the time spent encoding it.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos token; documents cannot be separated")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    stream: list[int] = []
    for start in range(0, len(texts), batch_docs):
        batch = list(texts[start : start + batch_docs])
        if backend is not None:
            # The backend directly: no per-call checks, no "sequence longer than model_max_length" warning.
            # encode_batch_fast skips character offsets, about 3x faster; older tokenizers lack it.
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            ids = [enc.ids for enc in encode(batch, add_special_tokens=False)]
        else:
            ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
        for doc in ids:
            stream.extend(doc)
            stream.append(eos)
        if max_tokens is not None and len(stream) >= max_tokens:
            return stream[:max_tokens]
    return stream


def pack_tokens(
    texts: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    max_tokens: int | None = None,
    min_blocks: int = 1,
    source: str = "corpus",
) -> torch.Tensor:
    """Concatenate documents (eos between them) and cut the stream into blocks of ``seq_len + 1``.

    Consecutive blocks overlap by one token, so every token of the stream is a prediction
    target exactly once when a block is split into inputs ``[:-1]`` and targets ``[1:]``.

    Args:
        texts: Documents.
        tokenizer: Tokenizer with an eos token.
        seq_len: Model sequence length.
        max_tokens: Stop after this many tokens (a cap on training tokens and on encoding time).
        min_blocks: Least number of blocks the corpus must give.
        source: Name of the corpus for error messages.

    Returns:
        A LongTensor of shape ``[n_blocks, seq_len + 1]``.

    Raises:
        DataError: If the corpus gives fewer than ``min_blocks`` blocks.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    stream = encode_stream(texts, tokenizer, max_tokens=max_tokens)
    n_blocks = (len(stream) - 1) // seq_len if stream else 0
    if n_blocks < max(1, min_blocks):
        raise DataError(
            f"{source}: {len(stream)} tokens give {n_blocks} block(s) of {seq_len + 1} tokens, fewer than the "
            f"{max(1, min_blocks)} needed; use more text or a shorter seq_len"
        )
    flat = torch.tensor(stream[: n_blocks * seq_len + 1], dtype=torch.long)
    return flat.unfold(0, seq_len + 1, seq_len).contiguous()


class TokenBlockDataset(Dataset):
    """Causal-LM examples from packed blocks of ``seq_len + 1`` tokens.

    By default each item follows the Hugging Face convention, ``labels`` equal to ``input_ids``
    (``LlamaForCausalLM`` shifts them itself), so ``model(**batch).loss`` is right. With
    ``shifted=True`` items hold ``labels`` already shifted by one (``block[1:]``) for a loss
    computed by hand as ``cross_entropy(logits.flatten(0, 1), labels.flatten())``; never pass
    those to a Hugging Face model, which would shift them a second time.
    """

    def __init__(self, blocks: torch.Tensor, shifted: bool = False) -> None:
        if blocks.ndim != 2 or blocks.shape[1] < 2:
            raise ValueError(f"blocks must have shape [n, seq_len + 1], got {tuple(blocks.shape)}")
        self.blocks = blocks
        self.shifted = shifted

    @property
    def seq_len(self) -> int:
        """Length of ``input_ids`` in every item."""
        return self.blocks.shape[1] - 1

    @property
    def n_tokens(self) -> int:
        """Number of input tokens over all items."""
        return self.blocks.shape[0] * self.seq_len

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        inputs = block[:-1]
        return {"input_ids": inputs, "labels": block[1:] if self.shifted else inputs.clone()}


# --------------------------------------------------------------------------------------------
# Everything at once
# --------------------------------------------------------------------------------------------


@dataclass
class LMData:
    """Train and validation sets of a language-model run, and how they were made."""

    train: TokenBlockDataset
    val: TokenBlockDataset
    tokenizer: PreTrainedTokenizerBase
    source: str
    n_train_docs: int
    n_val_docs: int
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model's embedding must hold (``len(tokenizer)``)."""
        return len(self.tokenizer)

    def info(self) -> dict[str, object]:
        """JSON-ready facts for a run's summary."""
        return {
            "data": self.source,
            "vocab_size": self.vocab_size,
            "seq_len": self.train.seq_len,
            "train_docs": self.n_train_docs,
            "val_docs": self.n_val_docs,
            "train_blocks": len(self.train),
            "val_blocks": len(self.val),
            "train_tokens": self.train.n_tokens,
            "val_tokens": self.val.n_tokens,
            "timings_s": dict(self.timings),
        }


def build_lm_datasets(
    data: str | Path,
    tokenizer: PreTrainedTokenizerBase | str | Path | None,
    seq_len: int,
    val_fraction: float = 0.05,
    seed: int = 0,
    max_train_tokens: int | None = None,
    max_val_tokens: int | None = None,
    vocab_size: int = 4096,
    tokenizer_out_dir: str | Path | None = None,
    text_field: str = "text",
    shifted_labels: bool = False,
) -> LMData:
    """Read, split, tokenize and pack a corpus into train and validation datasets.

    The split comes first (by file for the standard library, by document otherwise) and a new
    tokenizer is trained on the train split only, so validation text is unseen by both.
    Validation documents identical to a training document are dropped.

    Args:
        data: See :func:`read_texts`.
        tokenizer: A tokenizer, a local tokenizer folder, or None to train a byte-level BPE
            tokenizer of ``vocab_size`` on the train split.
        seq_len: Model sequence length.
        val_fraction: Fraction of files or documents for validation.
        seed: Seed of the split.
        max_train_tokens: Cap on training tokens (also caps encoding time).
        max_val_tokens: Cap on validation tokens (caps evaluation time).
        vocab_size: Vocabulary size of a newly trained tokenizer.
        tokenizer_out_dir: Where to save a newly trained tokenizer.
        text_field: Text field of JSONL files and saved datasets.
        shifted_labels: See :class:`TokenBlockDataset`.

    Returns:
        An :class:`LMData`; ``timings`` holds seconds spent reading, training the tokenizer and packing.
    """
    timings: dict[str, float] = {}
    start = time.perf_counter()
    if str(data) == STDLIB:
        train_files, val_files = split_files(stdlib_source_files(), val_fraction, seed)
        train_texts = _non_empty(read_files(train_files), "stdlib (train split)")
        val_texts = _non_empty(read_files(val_files), "stdlib (validation split)")
    else:
        train_texts, val_texts = split_texts(read_texts(data, text_field), val_fraction, seed)
    # Identical files exist (the standard library has a few): a copy in both splits leaks validation text.
    in_train = set(train_texts)
    val_texts = _non_empty(
        [t for t in val_texts if t not in in_train], f"{data} (validation split, after deduplication)"
    )
    timings["read_s"] = time.perf_counter() - start

    start = time.perf_counter()
    if tokenizer is None:
        tokenizer = train_bpe_tokenizer(train_texts, vocab_size=vocab_size, out_dir=tokenizer_out_dir)
        timings["tokenizer_train_s"] = time.perf_counter() - start
    elif isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)

    start = time.perf_counter()
    train_blocks = pack_tokens(train_texts, tokenizer, seq_len, max_train_tokens, source=f"{data} (train split)")
    val_blocks = pack_tokens(val_texts, tokenizer, seq_len, max_val_tokens, source=f"{data} (validation split)")
    timings["pack_s"] = time.perf_counter() - start
    return LMData(
        train=TokenBlockDataset(train_blocks, shifted=shifted_labels),
        val=TokenBlockDataset(val_blocks, shifted=shifted_labels),
        tokenizer=tokenizer,
        source=str(data),
        n_train_docs=len(train_texts),
        n_val_docs=len(val_texts),
        timings=timings,
    )
