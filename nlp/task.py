"""Instruction fine-tuning data: a built-in task with exact answers, users' JSONL, encoding, scoring.

The built-in task asks how many arguments a Python ``def`` line takes. Its answers are computed
by the ``ast`` module, so they are exact and a model's answer can be scored by string equality;
the ``def`` lines come from the standard library, the same text the NLP recipe pretrains on.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from nlp.data import DataError, jsonl_objects, read_files

ARG_COUNT_INSTRUCTION = "How many arguments does this function take?"
IGNORE_INDEX = -100
"""Label value that PyTorch's cross entropy (and so every Hugging Face model) leaves out of the loss."""

Example = dict[str, str]

_DEF_LINE = re.compile(r"^\s*(?:async\s+)?def\s")


# --------------------------------------------------------------------------------------------
# The built-in task
# --------------------------------------------------------------------------------------------


def count_def_args(source: str) -> int:
    """Count the parameters that a one-line ``def`` declares.

    Every named parameter counts once: positional-only, ordinary and keyword-only parameters,
    ``self`` and ``cls`` included, and ``*args`` and ``**kwargs`` as one each. The bare ``*`` and
    ``/`` markers are not parameters and do not count. So the answer is the number of names
    between the parentheses, which a reader can check by eye.

    Args:
        source: A ``def`` line such as ``"def f(self, a, b=2, *rest, **kw):"``.

    Returns:
        The number of parameters.

    Raises:
        ValueError: If ``source`` is not a single parsable ``def`` header.
    """
    header = source.strip()
    try:
        tree = ast.parse(header + "\n    pass\n")
    except SyntaxError as exc:
        raise ValueError(f"not a one-line def header: {header!r}") from exc
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError(f"not a one-line def header: {header!r}")
    args = tree.body[0].args
    named = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    return named + (args.vararg is not None) + (args.kwarg is not None)


def def_lines(texts: Iterable[str], max_chars: int = 100) -> list[tuple[str, int]]:
    """Collect distinct one-line ``def`` headers and their argument counts from source texts.

    Lines with a comment, longer than ``max_chars`` or not parsable on their own (multi-line
    signatures, one-line bodies) are skipped, so every kept line is a complete header.

    Returns:
        ``(header, count)`` pairs in order of first appearance, headers stripped of indentation.
    """
    seen: set[str] = set()
    found = []
    for text in texts:
        for line in text.splitlines():
            if not _DEF_LINE.match(line) or "#" in line:
                continue
            header = line.strip()
            if header in seen or len(header) > max_chars:
                continue
            try:
                count = count_def_args(header)
            except ValueError:
                continue
            seen.add(header)
            found.append((header, count))
    return found


def make_arg_count_task(
    files: Sequence[Path | str], n_train: int = 2000, n_val: int = 200, seed: int = 0, max_args: int = 6
) -> tuple[list[Example], list[Example]]:
    """Generate the "how many arguments does this ``def`` take" task from Python files.

    Headers are deduplicated and drawn round-robin over the answers ``0..max_args``, so the
    answers are as balanced as the source allows (a model that always says "2" scores about
    ``1 / (max_args + 1)`` on validation, see :func:`majority_baseline`). Validation takes the
    first, fully balanced rounds; no header is in both sets.

    Args:
        files: Python source files (e.g. :func:`nlp.data.stdlib_source_files`).
        n_train: Number of training examples.
        n_val: Number of validation examples.
        seed: Seed of the draw.
        max_args: Largest answer kept; rarer, longer headers are left out.

    Returns:
        ``(train, val)`` lists of ``{"instruction", "input", "output"}`` dicts.

    Raises:
        DataError: If the files hold fewer distinct headers than ``n_train + n_val``.
    """
    by_answer: dict[int, list[str]] = defaultdict(list)
    for header, count in def_lines(read_files(sorted(Path(f) for f in files))):
        if count <= max_args:
            by_answer[count].append(header)
    rng = random.Random(seed)
    for answer in sorted(by_answer):
        rng.shuffle(by_answer[answer])
    order = _round_robin([by_answer[a] for a in sorted(by_answer)], [a for a in sorted(by_answer)])
    if len(order) < n_train + n_val:
        raise DataError(
            f"the {len(files)} files give {len(order)} distinct def headers with at most {max_args} arguments, "
            f"fewer than the {n_train + n_val} asked for"
        )
    examples = [{"instruction": ARG_COUNT_INSTRUCTION, "input": h, "output": str(a)} for h, a in order]
    val, train = examples[:n_val], examples[n_val : n_val + n_train]
    rng.shuffle(train)
    rng.shuffle(val)
    return train, val


def _round_robin(pools: list[list[str]], answers: list[int]) -> list[tuple[str, int]]:
    order = []
    for i in range(max((len(p) for p in pools), default=0)):
        order.extend((pool[i], answer) for pool, answer in zip(pools, answers) if i < len(pool))
    return order


def majority_baseline(examples: Sequence[Example]) -> float:
    """Exact-match score of always giving the most common answer of ``examples``.

    A fine-tuned model that collapsed to one constant answer scores this much; report gains
    over it, not over zero.
    """
    if not examples:
        return 0.0
    counts = Counter(_first_line(e["output"]) for e in examples)
    return counts.most_common(1)[0][1] / len(examples)


# --------------------------------------------------------------------------------------------
# Users' instruction data
# --------------------------------------------------------------------------------------------


def load_instruction_jsonl(path: str | Path) -> list[Example]:
    """Read instruction examples from a JSONL file, one JSON object per line.

    Two formats are accepted, line by line:

    - Alpaca: ``instruction`` and ``output`` (text), ``input`` optional.
    - Chat: ``messages``, a list of ``{"role", "content"}``. The last ``assistant`` message is the
      target; the messages before it become the instruction (a lone user message as it is,
      otherwise ``role: content`` lines). Messages after it are ignored.

    Returns:
        ``{"instruction", "input", "output"}`` dicts.

    Raises:
        DataError: Naming the file and line of a malformed JSON line or a missing field, or if
            the file is missing or holds no examples.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"instruction file not found: {file}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{file}: cannot read file ({exc})") from exc
    examples = []
    for where, record in jsonl_objects(text, file):
        examples.append(_chat_example(record, where) if "messages" in record else _alpaca_example(record, where))
    if not examples:
        raise DataError(f"{file}: no examples (the file is empty)")
    return examples


def _text_field(record: dict, key: str, where: str, required: bool = True) -> str:
    if key not in record:
        if required:
            raise DataError(f"{where}: missing field {key!r} (fields: {', '.join(sorted(record)) or 'none'})")
        return ""
    if not isinstance(record[key], str):
        raise DataError(f"{where}: field {key!r} is {type(record[key]).__name__}, not text")
    return record[key]


def _alpaca_example(record: dict, where: str) -> Example:
    return {
        "instruction": _text_field(record, "instruction", where),
        "input": _text_field(record, "input", where, required=False),
        "output": _text_field(record, "output", where),
    }


def _chat_example(record: dict, where: str) -> Example:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: messages[{i}] is {type(message).__name__}, not an object")
        _text_field(message, "role", f"{where}: messages[{i}]")
        _text_field(message, "content", f"{where}: messages[{i}]")
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise DataError(f"{where}: no assistant message to learn from")
    context = messages[:last]
    if not context:
        raise DataError(f"{where}: the assistant message has no prompt before it")
    if len(context) == 1 and context[0]["role"] == "user":
        instruction = context[0]["content"]
    else:
        instruction = "\n".join(f"{m['role']}: {m['content']}" for m in context)
    return {"instruction": instruction, "input": "", "output": messages[last]["content"]}


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def format_prompt(example: Example) -> str:
    """Render the prompt of an example with a fixed template; the response follows it directly.

    The template is short on purpose: the tiny model's sequences are 256 tokens.
    """
    parts = [f"### Instruction:\n{example['instruction'].strip()}\n"]
    if example.get("input", "").strip():
        parts.append(f"### Input:\n{example['input'].strip()}\n")
    parts.append("### Response:\n")
    return "".join(parts)


def _prompt_ids(prompt: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # Pretraining documents follow an end-of-text token; a prompt starts the same way.
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + list(ids)


def encode_example(example: Example, tokenizer: PreTrainedTokenizerBase, max_len: int = 256) -> dict[str, list[int]]:
    """Tokenize an example for supervised fine-tuning, with the loss on the response only.

    The prompt and the response are tokenized separately and concatenated, so the response's
    tokens are the ones the model produces when it continues the prompt alone at evaluation.
    eos ends the response so that the model learns to stop.

    Over-long examples keep the whole response (cut only if it alone exceeds ``max_len``) and
    lose the start of the prompt.

    Args:
        example: ``{"instruction", "input", "output"}``.
        tokenizer: Tokenizer with an eos token.
        max_len: Longest sequence in tokens.

    Returns:
        ``input_ids`` and ``labels`` (same length; ``-100`` on every prompt token).
    """
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token; responses cannot be terminated")
    prompt = _prompt_ids(format_prompt(example), tokenizer)
    response = list(tokenizer(example["output"], add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    response = response[:max_len]
    prompt = prompt[len(prompt) - (max_len - len(response)) :] if len(prompt) + len(response) > max_len else prompt
    return {"input_ids": prompt + response, "labels": [IGNORE_INDEX] * len(prompt) + response}


def encode_examples(
    examples: Iterable[Example], tokenizer: PreTrainedTokenizerBase, max_len: int = 256
) -> list[dict[str, list[int]]]:
    """Encode many examples with :func:`encode_example`."""
    return [encode_example(e, tokenizer, max_len) for e in examples]


def collate_sft(features: Sequence[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad encoded examples into a batch; padding gets label ``-100`` and attention mask 0.

    Use as ``DataLoader(..., collate_fn=functools.partial(collate_sft, pad_token_id=...))``.
    """
    width = max(len(f["input_ids"]) for f in features)
    input_ids = torch.full((len(features), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(features), width), dtype=torch.long)
    for row, feature in enumerate(features):
        n = len(feature["input_ids"])
        input_ids[row, :n] = torch.tensor(feature["input_ids"])
        labels[row, :n] = torch.tensor(feature["labels"])
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def _first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0].strip() if stripped else ""


@torch.no_grad()
def predict_answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    max_new_tokens: int = 8,
    batch_size: int = 32,
) -> list[str]:
    """Answer each example's prompt by greedy decoding; return the first line of each answer.

    Prompts are left-padded so that every row's answer starts at the same position. Under
    ZeRO-3 call this on every rank (each rank may take its own shard of the examples).
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    answers = []
    try:
        for start in range(0, len(examples), batch_size):
            prompts = [_prompt_ids(format_prompt(e), tokenizer) for e in examples[start : start + batch_size]]
            width = max(len(p) for p in prompts)
            input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for row, ids in enumerate(prompts):
                input_ids[row, width - len(ids) :] = torch.tensor(ids)
                attention_mask[row, width - len(ids) :] = 1
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            answers.extend(_first_line(t) for t in texts)
    finally:
        model.train(was_training)
    return answers


def exact_match(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    max_new_tokens: int = 8,
    batch_size: int = 32,
) -> float:
    """Fraction of examples whose greedy answer's first line equals the expected output's first line.

    Both sides are stripped of surrounding whitespace before comparing.
    """
    if not examples:
        return 0.0
    answers = predict_answers(model, tokenizer, examples, max_new_tokens, batch_size)
    return sum(a == _first_line(e["output"]) for a, e in zip(answers, examples)) / len(examples)
