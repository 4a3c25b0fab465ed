"""Fine-tuning data of the NLP domain (nlp/task.py): the argument-count task, JSONL, encoding, scoring."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from nlp import data as nd
from nlp import model as nm
from nlp import task as nt
from nlp.data import DataError


@pytest.fixture(scope="module")
def tokenizer():
    texts = [(nd.stdlib_root() / n).read_text(encoding="utf-8") for n in ("bisect.py", "heapq.py", "shlex.py")]
    return nd.train_bpe_tokenizer(texts, vocab_size=300)


# ---------------------------------------------------------------- the argument-count task


@pytest.mark.parametrize(
    ("header", "count"),
    [
        ("def f():", 0),
        ("def method(self):", 1),
        ("    def build(cls, name, *, strict=False):", 3),
        ("def f(a, b=1, *args, c, d=2, **kwargs):", 6),
        ("def f(a, /, b, *, c):", 3),
        ("def f(*args, **kwargs):", 2),
        ("def f(*, key):", 1),
        ('async def fetch(url: str, headers: dict[str, str] = {"a": "b, c"}) -> bytes:', 2),
        ("def f(x=(1, 2, 3), y=lambda a, b: a):", 2),
    ],
)
def test_count_def_args(header, count):
    assert nt.count_def_args(header) == count


@pytest.mark.parametrize("bad", ["def f(x): return x", "def f(a,", "class A:", "x = 1"])
def test_count_def_args_rejects_non_headers(bad):
    with pytest.raises(ValueError, match="not a one-line def header"):
        nt.count_def_args(bad)


def test_def_lines_keeps_distinct_complete_headers():
    source = (
        "def a(x, y):\n    pass\n"
        "class K:\n    def a(x, y):\n        pass\n"  # same header after stripping: kept once
        "    def b(self):  # comment\n        pass\n"  # comments are skipped
        "def c(p,\n      q):\n    pass\n"  # multi-line signature: skipped
        "def d(): return 1\n"  # one-line body: skipped
        "async def e(*a):\n    pass\n"
    )
    assert nt.def_lines([source]) == [("def a(x, y):", 2), ("async def e(*a):", 1)]


def _write_defs(tmp_path, counts: dict[int, int]) -> list:
    files = []
    for n_args, how_many in counts.items():
        lines = [
            f"def f{n_args}_{i}({', '.join(f'a{j}' for j in range(n_args))}):\n    pass\n" for i in range(how_many)
        ]
        files.append(tmp_path / f"m{n_args}.py")
        files[-1].write_text("".join(lines))
    return files


def test_make_arg_count_task_balanced_disjoint_and_exact(tmp_path):
    files = _write_defs(tmp_path, {0: 40, 1: 40, 2: 40, 3: 10, 7: 30})
    train, val = nt.make_arg_count_task(files, n_train=80, n_val=20, seed=1)
    assert len(train) == 80 and len(val) == 20
    assert not {e["input"] for e in train} & {e["input"] for e in val}
    assert all(nt.count_def_args(e["input"]) == int(e["output"]) for e in train + val)
    assert all(e["instruction"] == nt.ARG_COUNT_INSTRUCTION for e in train + val)
    assert Counter(e["output"] for e in val) == {"0": 5, "1": 5, "2": 5, "3": 5}  # 7 > max_args is left out
    assert nt.majority_baseline(val) == 0.25
    assert nt.make_arg_count_task(files, n_train=80, n_val=20, seed=1) == (train, val)
    with pytest.raises(DataError, match="fewer than the 500 asked for"):
        nt.make_arg_count_task(files, n_train=450, n_val=50)


def test_make_arg_count_task_on_stdlib_is_balanced_ish():
    train, val = nt.make_arg_count_task(nd.stdlib_source_files()[:200], n_train=300, n_val=70, seed=0)
    assert nt.majority_baseline(val) <= 0.2 and nt.majority_baseline(train) < 0.35


def test_majority_baseline():
    examples = [{"output": a} for a in ("1", "1", " 1\n", "2")]
    assert nt.majority_baseline(examples) == 0.75
    assert nt.majority_baseline([]) == 0.0


# ---------------------------------------------------------------- instruction JSONL


def _jsonl(tmp_path, records) -> str:
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def test_load_alpaca_and_chat_formats(tmp_path):
    path = _jsonl(
        tmp_path,
        [
            {"instruction": "Add", "input": "1 2", "output": "3"},
            {"instruction": "Say hi", "output": "hi"},
            "",
            {
                "messages": [
                    {"role": "user", "content": "Capital of France?"},
                    {"role": "assistant", "content": "Paris"},
                ]
            },
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "and 3+3?"},
                    {"role": "assistant", "content": "6"},
                ]
            },
        ],
    )
    assert nt.load_instruction_jsonl(path) == [
        {"instruction": "Add", "input": "1 2", "output": "3"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "Capital of France?", "input": "", "output": "Paris"},
        {
            "instruction": "system: Be brief.\nuser: 2+2?\nassistant: 4\nuser: and 3+3?",
            "input": "",
            "output": "6",
        },
    ]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"instruction": "x", "output": ', r"sft\.jsonl:2: invalid JSON"),
        ({"instruction": "x"}, r"sft\.jsonl:2: missing field 'output'"),
        ({"instruction": "x", "output": 3}, r"sft\.jsonl:2: field 'output' is int"),
        ({"messages": [{"role": "user", "content": "hi"}]}, r"sft\.jsonl:2: no assistant message"),
        (
            {"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]},
            r"sft\.jsonl:2: messages\[0\]: missing",
        ),
        ({"messages": "hello"}, r"sft\.jsonl:2: 'messages' must be"),
        ("[1, 2]", r"sft\.jsonl:2: expected a JSON object"),
    ],
)
def test_load_instruction_jsonl_errors_name_the_line(tmp_path, bad_line, message):
    path = _jsonl(tmp_path, [{"instruction": "ok", "output": "ok"}, bad_line])
    with pytest.raises(DataError, match=message):
        nt.load_instruction_jsonl(path)


def test_load_instruction_jsonl_missing_and_empty(tmp_path):
    with pytest.raises(DataError, match="instruction file not found"):
        nt.load_instruction_jsonl(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no examples"):
        nt.load_instruction_jsonl(tmp_path / "empty.jsonl")


# ---------------------------------------------------------------- prompts and encoding


def test_format_prompt_with_and_without_input():
    with_input = nt.format_prompt({"instruction": "Count", "input": "def f(a):", "output": "1"})
    assert with_input == "### Instruction:\nCount\n### Input:\ndef f(a):\n### Response:\n"
    assert (
        nt.format_prompt({"instruction": "Hi", "input": "", "output": "x"}) == "### Instruction:\nHi\n### Response:\n"
    )


def test_encode_example_masks_the_prompt(tokenizer):
    example = {"instruction": nt.ARG_COUNT_INSTRUCTION, "input": "def f(a, b):", "output": "2"}
    enc = nt.encode_example(example, tokenizer, max_len=256)
    prompt = [tokenizer.bos_token_id] + tokenizer(nt.format_prompt(example), add_special_tokens=False)["input_ids"]
    response = tokenizer("2", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert enc["input_ids"] == prompt + response
    assert enc["labels"] == [-100] * len(prompt) + response
    assert tokenizer.decode([t for t in enc["labels"] if t != -100], skip_special_tokens=True) == "2"


def test_encode_example_truncates_the_prompt_not_the_response(tokenizer):
    example = {"instruction": "word " * 200, "input": "", "output": "the answer"}
    enc = nt.encode_example(example, tokenizer, max_len=32)
    response = tokenizer("the answer", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(enc["input_ids"]) == 32 and enc["labels"][-len(response) :] == response
    assert enc["labels"][: 32 - len(response)] == [-100] * (32 - len(response))


def test_collate_sft_pads_right_and_masks_padding():
    features = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = nt.collate_sft(features, pad_token_id=1)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


# ---------------------------------------------------------------- scoring


class OracleModel(torch.nn.Module):
    """Answers from a lookup table: tests the batching, padding and comparison of exact_match."""

    def __init__(self, tokenizer, answers: dict[str, str]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.answers = tokenizer, answers

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **kwargs):
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            assert mask[-1] == 1  # left padding: every prompt ends at the last column
            prompt = self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            key = prompt.split("### Input:\n")[1].split("\n")[0]
            answer = (self.tokenizer(self.answers[key], add_special_tokens=False)["input_ids"] + [eos_token_id])[
                :max_new_tokens
            ]
            rows.append(answer + [pad_token_id] * (max_new_tokens - len(answer)))
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)


def test_exact_match_compares_stripped_first_lines(tokenizer):
    examples = [
        {"instruction": "Count", "input": "def f(a):", "output": "1"},
        {"instruction": "Count", "input": "def a_much_longer_header(self, x, y):", "output": "3"},
        {"instruction": "Count", "input": "def g():", "output": "0"},
    ]
    answers = {"def f(a):": " 1\nextra", "def a_much_longer_header(self, x, y):": "3", "def g():": "2"}
    model = OracleModel(tokenizer, answers)
    assert nt.predict_answers(model, tokenizer, examples, max_new_tokens=16, batch_size=2) == ["1", "3", "2"]
    assert nt.exact_match(model, tokenizer, examples, max_new_tokens=16, batch_size=2) == pytest.approx(2 / 3)
    assert nt.exact_match(model, tokenizer, [], max_new_tokens=8) == 0.0


def test_batched_greedy_answers_equal_one_by_one(tokenizer):
    # Left padding must not change a real model's greedy answers.
    torch.manual_seed(0)
    config = nm.build_llama_config(
        "tiny",
        tokenizer=tokenizer,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = nm.build_model_from_config(config, attn_implementation="sdpa")
    examples = [
        {"instruction": "Count", "input": h, "output": "0"} for h in ("def f():", "def longer_name(self, a, b, c):")
    ]
    batched = nt.predict_answers(model, tokenizer, examples, max_new_tokens=4, batch_size=2)
    single = [nt.predict_answers(model, tokenizer, [e], max_new_tokens=4, batch_size=1)[0] for e in examples]
    assert batched == single
