"""Users' files in every documented format (stages/formats.py) load into one shape per kind: standard and
conversational rows, implicit prompts, column mappings, Parquet with turns, datasets folders."""
from __future__ import annotations

import json

import datasets
import pytest

from stages import data, formats
from stages.data import WHERE
from tests.inputs.helpers import write_jsonl

SYS = {"role": "system", "content": "be brief"}
ASK = {"role": "user", "content": "2 + 2?"}


def turn(role, content):
    return {"role": role, "content": content}


def loaded(path, kind, columns=None) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in (WHERE, "row")} for r in
            data.read_table(str(path), kind, columns).to_list()]


def test_standard_rows_keep_their_text(tmp_path):
    f = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "q1", "response": " a"}, {"prompt": "q2", "response": " b"}])
    assert loaded(f, "sft") == [{"prompt": "q1", "response": " a"}, {"prompt": "q2", "response": " b"}]
    assert not data.is_conversational(data.read_table(str(f), "sft"), "sft")


def test_conversational_sft_keeps_roles_and_content_only(tmp_path):
    """messages rows (system/user/assistant, multi-turn) load as turns; other keys of a turn are dropped."""
    rows = [{"messages": [SYS, ASK, {**turn("assistant", "4"), "name": "bot"}, turn("user", "x"),
                          turn("assistant", "y")]}] * 3
    f = write_jsonl(tmp_path / "s.jsonl", rows)
    got = loaded(f, "sft")
    assert got[0]["messages"] == [SYS, ASK, turn("assistant", "4"), turn("user", "x"), turn("assistant", "y")]
    assert data.is_conversational(data.read_table(str(f), "sft"), "sft")


def test_trl_preferences_explicit_and_implicit_prompt_agree(tmp_path):
    """{"prompt": turns, "chosen": [...], "rejected": [...]} and the implicit form (two whole conversations) give
    the same row; both forms may share one file."""
    explicit = {"prompt": [SYS, ASK], "chosen": [turn("assistant", "4")], "rejected": [turn("assistant", "5")]}
    implicit = {"chosen": [SYS, ASK, turn("assistant", "4")], "rejected": [SYS, ASK, turn("assistant", "5")]}
    f = write_jsonl(tmp_path / "p.jsonl", [explicit, implicit])
    a, b = loaded(f, "preferences")
    assert a == b == explicit


def test_standard_preferences_without_prompt_split_at_a_word(tmp_path):
    """HH-style text pairs: the shared beginning becomes the prompt, backed off to a word boundary, so
    prompt + response is each original text."""
    rows = [{"chosen": "Human: add 2 and 11\n\nAssistant: 13", "rejected": "Human: add 2 and 11\n\nAssistant: 15"},
            {"chosen": "Q: hi A: hello there", "rejected": "Q: hi A: go away"}]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    got = loaded(f, "preferences")
    assert got[0] == {"prompt": "Human: add 2 and 11\n\nAssistant: ", "chosen": "13", "rejected": "15"}
    assert got[1]["prompt"] == "Q: hi A: "
    for row, raw in zip(got, rows):
        assert row["prompt"] + row["chosen"] == raw["chosen"] and row["prompt"] + row["rejected"] == raw["rejected"]


def test_conversational_prompts_keep_answer_and_the_whole_row(tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", [{"prompt": [SYS, ASK], "answer": "4", "source": "math"}] * 2)
    ds = data.read_table(str(f), "prompts")
    assert ds[0]["prompt"] == [SYS, ASK] and ds[0]["answer"] == "4"
    assert data.rows(ds)[0] == {"prompt": [SYS, ASK], "answer": "4", "source": "math"}


def test_column_mapping_reads_the_files_names(tmp_path):
    """data.<kind>.columns maps our names to the file's; the row handed to a checker carries our names."""
    f = write_jsonl(tmp_path / "q.jsonl", [{"question": "2 + 2?", "solution": "4"}] * 2)
    ds = data.read_table(str(f), "prompts", {"prompt": "question", "answer": "solution"})
    assert ds[0]["prompt"] == "2 + 2?" and ds[0]["answer"] == "4"
    assert data.rows(ds)[0] == {"prompt": "2 + 2?", "answer": "4"}


def test_parquet_with_turns(tmp_path):
    rows = [{"messages": [ASK, turn("assistant", "4")]}] * 4
    f = tmp_path / "s.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(f))
    assert loaded(f, "sft") == rows


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_datasets_folder(tmp_path, as_dict):
    """A save_to_disk folder loads (a DatasetDict through its train split); rows are numbered in errors."""
    ds = datasets.Dataset.from_list([{"prompt": [ASK], "chosen": [turn("assistant", "4")],
                                      "rejected": [turn("assistant", "5")]}] * 3)
    folder = tmp_path / "prefs"
    (datasets.DatasetDict({"train": ds, "test": ds}) if as_dict else ds).save_to_disk(str(folder))
    got = data.read_table(str(folder), "preferences")
    assert len(got) == 3 and got[0][WHERE] == "row 1"
    assert got[0]["prompt"] == [ASK]


def test_known_columns_cover_both_formats():
    assert formats.KNOWN["sft"] == ("prompt", "response", "messages")
    assert set(formats.KNOWN["preferences"]) == {"prompt", "chosen", "rejected"}
    assert json.dumps(formats.KNOWN)  # plain data, printable in an error line


def test_the_example_verifier_scores_the_builtin_tasks_answers(tmp_path):
    """stages/example_reward.py:correct (tiny-grpo's ppo.reward_function, copied beside the example files): 1.0
    for a response whose first integer is the row's answer, 0.0 for a near miss or no number."""
    from stages import example_files, user_code
    from stages.params import load_params
    paths = example_files.write(tmp_path, load_params("test"), False)
    rows = [json.loads(x) for x in paths["prompts"].read_text().splitlines()][:8]
    correct = user_code.load(f"{tmp_path / 'reward.py'}:correct", "ppo.reward_function")
    prompts = [r["prompt"] for r in rows]
    right = [f" {r['answer']}" for r in rows]
    assert correct(prompts, right, rows) == [1.0] * len(rows)
    assert correct(prompts, [f" {int(r['answer']) + 1}" for r in rows], rows) == [0.0] * len(rows)
    assert correct(prompts[:1], [" no number"], rows[:1]) == [0.0]


@pytest.mark.parametrize("conversational", [False, True])
def test_example_files_of_the_builtin_task_load(tmp_path, conversational):
    """`hybrid-rlhf example-data` writes the built-in task in either format; each file reads back in that format
    with every row (the conversational SFT file holds two demonstrations per chat, both trained)."""
    from stages import example_files
    from stages.params import load_params
    p = load_params("test")
    paths = example_files.write(tmp_path, p, conversational)
    for kind, path in paths.items():
        ds = data.read_table(str(path), kind)
        assert data.is_conversational(ds, kind) is conversational
        n = {"sft": 64 + 16, "preferences": 64 + 16, "prompts": 64 + 16}[kind]
        assert len(ds) == (n // 2 if conversational and kind == "sft" else n)
    if conversational:
        raw = [json.loads(x) for x in paths["preferences"].read_text().splitlines()]
        assert "prompt" in raw[0] and "prompt" not in raw[1]  # the explicit and the implicit form alternate
        rows = data.read_table(str(paths["preferences"]), "preferences")
        for r in rows:  # both read as a system + user prompt and one assistant turn each
            assert [t["role"] for t in r["prompt"]] == ["system", "user"]
            assert [t["role"] for t in r["chosen"]] == [t["role"] for t in r["rejected"]] == ["assistant"]
