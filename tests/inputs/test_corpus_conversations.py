"""Corpus of bad conversational data, chat templates, column mappings, datasets folders and checkers: each goes
through load_params + preflight (the CLI's order) and ends as one InputError line naming the field, the file, the
row and what was expected, and costs no artifact already built."""
from __future__ import annotations

import datasets
import pytest

from tests.inputs.helpers import check, refuse, write_jsonl

SYS, ASK = {"role": "system", "content": "be brief"}, {"role": "user", "content": "mia has 3 pears. total:"}


def said(text: str) -> dict:
    return {"role": "assistant", "content": text}


SFT = [{"messages": [SYS, ASK, said(str(i % 10)), {"role": "user", "content": "and one more?"},
                     said(str(i % 10 + 1))]} for i in range(40)]
PREFS = [{"prompt": [SYS, ASK], "chosen": [said("3")], "rejected": [said(str(i % 9 + 4))]} for i in range(40)]
PROMPTS = [{"prompt": [SYS, ASK], "answer": "3"} for _ in range(40)]
STD_SFT = [{"prompt": f"q {i}", "response": f" {i}"} for i in range(40)]


def with_row(rows: list, at: int, row) -> list:
    return rows[:at] + [row] + rows[at + 1:]


# kind -> (rows, texts the message must hold besides the field and the file name)
CASES = {
    "an unknown role": ("sft", with_row(SFT, 2, {"messages": [{"role": "bot", "content": "hi"}, said("1")]}),
                        ["row 3 (line 3): column 'messages' turn 1 has role 'bot'",
                         "expected one of system, user, assistant"]),
    "a turn without a role": ("sft", with_row(SFT, 1, {"messages": [{"content": "hi"}, said("1")]}),
                              ["row 2 (line 2): column 'messages' turn 1 has no role"]),
    "a turn without content": ("sft", with_row(SFT, 4, {"messages": [ASK, {"role": "assistant"}]}),
                               ["row 5 (line 5): column 'messages' turn 2 (assistant) has no content",
                                "expected a string"]),
    "content that is not a string": ("sft", with_row(SFT, 0, {"messages": [{"role": "user", "content": 5},
                                                                            said("1")]}),
                                     ["row 1 (line 1): column 'messages' turn 1 (user) has content 5"]),
    "messages that are not a list": ("sft", with_row(SFT, 3, {"messages": "hello"}),
                                     ["row 4 (line 4): column 'messages' must be a non-empty list of turns",
                                      "got 'hello'"]),
    "a turn that is not an object": ("sft", with_row(SFT, 3, {"messages": [ASK, "4"]}),
                                     ["row 4 (line 4): column 'messages' turn 2 is '4'"]),
    "an SFT conversation with no assistant turn": (
        "sft", with_row(SFT, 6, {"messages": [SYS, ASK]}),
        ["row 7 (line 7): column 'messages' has no assistant turn", "expected at least one"]),
    "a conversational row in a standard file": (
        "sft", with_row(STD_SFT, 5, SFT[0]),
        ["row 6 (line 6): the row is conversational (turns) but the first row is standard (text)",
         "expected one format per file"]),
    "a standard row in a conversational file": (
        "sft", with_row(SFT, 5, STD_SFT[0]),
        ["row 6 (line 6): the row is standard (text) but the first row is conversational (turns)"]),
    "chosen that does not end with an assistant turn": (
        "preferences", with_row(PREFS, 2, {"prompt": [ASK], "chosen": [ASK], "rejected": [said("4")]}),
        ["row 3 (line 3): column 'chosen' must end with a non-empty assistant turn, found a user turn"]),
    "implicit-prompt conversations that are the same": (
        "preferences", with_row(PREFS, 8, {"chosen": [ASK, said("3")], "rejected": [ASK, said("3")]}),
        ["row 9 (line 9): chosen equals rejected"]),
    "explicit turns that are the same": (
        "preferences", with_row(PREFS, 8, {"prompt": [ASK], "chosen": [said("3")], "rejected": [said("3")]}),
        ["row 9 (line 9): chosen equals rejected"]),
    "a prompt that ends with the assistant": (
        "prompts", with_row(PROMPTS, 1, {"prompt": [ASK, said("3")], "answer": "3"}),
        ["row 2 (line 2): column 'prompt' ends with an assistant turn", "expected the last turn to be the user's"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_conversations_are_refused(case, built, tmp_path):
    kind, rows, expected = CASES[case]
    path = write_jsonl(tmp_path / f"{kind}.jsonl", rows)
    refuse(built, check(built, {"data": {kind: {"path": str(path)}}}), f"data.{kind}.path", str(path), *expected)


def test_pairs_that_render_the_same_are_refused(built, tmp_path):
    """chosen "3" and rejected "3 " differ as data but not under a template that trims content."""
    template = tmp_path / "trim.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}")
    rows = with_row(PREFS, 4, {"prompt": [ASK], "chosen": [said("3")], "rejected": [said("3 ")]})
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    refuse(built, check(built, {"data": {"preferences": {"path": str(path)}, "chat_template": str(template)}}),
           f"data.preferences.path: {path} row 5 (line 5): chosen and rejected are the same tokens once rendered")


def test_a_template_that_fails_to_render_is_refused(built, tmp_path):
    template = tmp_path / "no-system.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns')"
                        " }}{% endif %}{{ m['content'] }}{% endfor %}")
    path = write_jsonl(tmp_path / "s.jsonl", SFT)
    refuse(built, check(built, {"data": {"sft": {"path": str(path)}, "chat_template": str(template)}}),
           f"data.sft.path: {path} row 1 (line 1): the chat template failed to render", "no system turns")


@pytest.mark.parametrize("spec, expected", [
    ("nope", "data.chat_template: 'nope' is neither a built-in template (chatml, plain) nor a file"),
    ("missing.jinja", "data.chat_template: 'missing.jinja' is neither a built-in template"),
])
def test_unknown_templates_are_refused(built, spec, expected):
    refuse(built, check(built, {"data": {"chat_template": spec}}), expected)


def test_column_mappings_are_checked(built, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "2 + 2?", "solution": "4"}] * 40)
    refuse(built, check(built, {"data": {"prompts": {"path": str(path), "columns": {"prompt": "q"}}}}),
           "data.prompts.columns", f"{path} has no column 'q' (mapped to prompt)", "found: question, solution")
    refuse(built, check(built, {"data": {"prompts": {"path": str(path), "columns": {"query": "question"}}}}),
           "data.prompts.columns: 'query' is not a column of prompts data", "expected keys among prompt, answer")
    refuse(built, check(built, {"data": {"prompts": {"path": str(path)}}}),
           "data.prompts.path", "lacks column(s) prompt", "found: question, solution")


def test_bad_datasets_folders_are_refused(built, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    refuse(built, check(built, {"data": {"sft": {"path": str(plain)}}}),
           f"data.sft.path: {plain} is a folder without state.json or dataset_dict.json")
    ds = datasets.Dataset.from_list(STD_SFT)
    splits = tmp_path / "splits"
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(splits))
    refuse(built, check(built, {"data": {"sft": {"path": str(splits)}}}),
           f"{splits} holds the splits validation; expected a 'train' split")


CHECKER = "def is_right(prompt, response, row):\n    return response.strip() == row['answer']\n"


@pytest.mark.parametrize("write, spec, expected", [
    (None, "{tmp}/checks.py:is_right", "evaluate.checker: file {tmp}/checks.py not found"),
    (CHECKER, "{tmp}/checks.py", "is not FILE.py:NAME"),
    (CHECKER, "{tmp}/checks.py:is_wrong", "evaluate.checker: is_wrong is not defined there"),
    ("def is_right(:\n", "{tmp}/checks.py:is_right", "evaluate.checker: importing {tmp}/checks.py failed (SyntaxError"),
    ("is_right = 3\n", "{tmp}/checks.py:is_right", "is_right is not callable"),
])
def test_bad_checkers_are_refused(built, tmp_path, write, spec, expected):
    if write is not None:
        (tmp_path / "checks.py").write_text(write)
    refuse(built, check(built, {"evaluate": {"checker": spec.format(tmp=tmp_path)}}), expected.format(tmp=tmp_path))
