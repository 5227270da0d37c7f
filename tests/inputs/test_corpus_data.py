"""Corpus of bad data files: each goes through load_params + preflight (or the SFT stage itself, for what only
a stage can find), ends as one InputError line naming the field and file, what was found and what was
expected, and costs no artifact already built."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridcore.artifacts import read_verified
from stages.keys import stage_keys
from stages.runner import run_stage
from tests.inputs.helpers import check, params_for, refuse, write_jsonl

SFT = [{"prompt": f"mia has {i % 10} pears and gets 2 more. total:", "response": f" {i % 10 + 2}"} for i in range(40)]
PREFS = [{"prompt": f"tom has {i % 10} coins. total:", "chosen": " 1", "rejected": " 2"} for i in range(40)]
PROMPTS = [{"prompt": f"ana has {i % 10} keys and finds 3 more. total:", "answer": str(i % 10 + 3)}
           for i in range(40)]


def _text(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def _parquet(path, columns: dict):
    pq.write_table(pa.table(columns), path)
    return path


# kind -> (writes the file into tmp_path, texts the message must hold besides the field and the file name)
CASES = {
    "empty JSONL file": ("preferences", lambda t: _text(t / "p.jsonl", ""), ["is empty"]),
    "JSONL of blank lines": ("prompts", lambda t: _text(t / "q.jsonl", "\n  \n\n"), ["has no rows"]),
    "Parquet without rows": ("sft", lambda t: _parquet(t / "s.parquet", {"prompt": pa.array([], pa.string()),
                                                                         "response": pa.array([], pa.string())}),
                             ["has no rows"]),
    "a column missing from every row": (
        "preferences", lambda t: write_jsonl(t / "p.jsonl", [{"prompt": "q", "chosen": " 1"}] * 20),
        ["lacks column(s) rejected", "expected columns: prompt, chosen, rejected", "found: prompt, chosen"]),
    "a column missing from one row": (
        "sft", lambda t: write_jsonl(t / "s.jsonl", SFT[:2] + [{"prompt": "q"}] + SFT[3:]),
        ["row 3 (line 3): column 'response' must be a non-empty string", "got nothing"]),
    "non-UTF-8 bytes": (
        "sft", lambda t: (t / "s.jsonl").write_bytes(b'{"prompt": "a", "response": " 1"}\n'
                                                     b'{"prompt": "caf\xe9", "response": " 2"}\n') and t / "s.jsonl",
        ["line 2 is not UTF-8", "byte 0xe9", "expected UTF-8 text"]),
    "a JSON line that is an array": (
        "sft", lambda t: _text(t / "s.jsonl", json.dumps(SFT[0]) + "\n[\"q\", \" 1\"]\n"),
        ["line 2 is a JSON array", "expected an object with columns prompt, response"]),
    "a JSON line that is a string": (
        "prompts", lambda t: _text(t / "q.jsonl", "\n" + json.dumps("just a prompt") + "\n"),
        ["line 2 is a JSON string", "expected an object with columns prompt"]),
    "a line that is not JSON": (
        "sft", lambda t: _text(t / "s.jsonl", '{"prompt": "a", "response": " 1",}\n'),
        ["line 1 is not valid JSON", "expected one JSON object per line"]),
    "a .json array with a number in it": (
        "sft", lambda t: _text(t / "s.json", json.dumps([SFT[0], 7])), ["item 2 is a JSON number"]),
    "a number where text belongs": (
        "sft", lambda t: write_jsonl(t / "s.jsonl", SFT[:4] + [{"prompt": 7, "response": " 1"}]),
        ["row 5 (line 5): column 'prompt' must be a non-empty string, got 7"]),
    "a numeric answer": (
        "prompts", lambda t: write_jsonl(t / "q.jsonl", PROMPTS[:1] + [{"prompt": "q", "answer": 13}]),
        ["row 2 (line 2): column 'answer' must be a string, got 13"]),
    "an integer Parquet column": (
        "sft", lambda t: _parquet(t / "s.parquet", {"prompt": ["a", "b"], "response": [1, 2]}),
        ["row 1: column 'response' must be a non-empty string, got 1"]),
    "a null in a Parquet column": (
        "sft", lambda t: _parquet(t / "s.parquet", {"prompt": ["a", None], "response": [" 1", " 2"]}),
        ["row 2: column 'prompt' must be a non-empty string, got None"]),
    "chosen equal to rejected": (
        "preferences", lambda t: write_jsonl(t / "p.jsonl", PREFS[:5] + [{"prompt": "q", "chosen": " 4",
                                                                          "rejected": " 4"}]),
        ["row 6 (line 6): chosen equals rejected"]),
    "a folder instead of a file": ("sft", lambda t: (t / "dir.jsonl").mkdir() or t / "dir.jsonl", ["is a folder"]),
    "a text file named .parquet": (
        "prompts", lambda t: _text(t / "q.parquet", "prompt\nhello\n"), ["could not read", "as Parquet"]),
    "fewer rows than one batch": (
        "sft", lambda t: write_jsonl(t / "s.jsonl", SFT[:10]),
        ["10 row(s), 9 for training after holding out 1", "expected at least sft.batch_size=16"]),
    "fewer prompts than one rollout batch": (
        "prompts", lambda t: write_jsonl(t / "q.jsonl", PROMPTS[:12]),
        ["expected at least ppo.rollout_batch_size=16 training rows"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_files_are_refused(case, built, tmp_path):
    """A bad data file is one InputError line naming data.<kind>.path and the file; the artifact survives."""
    kind, write, expected = CASES[case]
    path = write(tmp_path)
    refuse(built, check(built, {"data": {kind: {"path": str(path)}}}), f"data.{kind}.path", str(path), *expected)


def test_good_files_of_every_kind_pass(built, tmp_path):
    """The same checks let well-formed JSONL and Parquet files of every kind through."""
    sft = _parquet(tmp_path / "s.parquet", {"prompt": [r["prompt"] for r in SFT],
                                            "response": [r["response"] for r in SFT]})
    prefs = write_jsonl(tmp_path / "p.jsonl", PREFS)
    prompts = write_jsonl(tmp_path / "q.jsonl", PROMPTS)
    check(built, {"data": {"sft": {"path": str(sft)}, "preferences": {"path": str(prefs)},
                           "prompts": {"path": str(prompts)}}})()
    assert read_verified(built.artifact) == built.manifest


def test_prompt_longer_than_max_seq_len_is_found_by_the_stage(built, tmp_path):
    """With a preset the tokenizer is trained in SFT, so SFT itself refuses a row over max_seq_len: one line,
    nothing published under its key, and the earlier artifact still verifies."""
    rows = SFT[:5] + [{"prompt": "mia has " + "many " * 120 + "pears. total:", "response": " 1"}] + SFT[5:]
    f = write_jsonl(tmp_path / "long.jsonl", rows)
    p = params_for(built, {"data": {"sft": {"path": str(f)}}, "sft": {"max_seq_len": 64}})
    keys = stage_keys(p)
    assert keys["sft"] != built.artifact.name
    refuse(built, lambda: run_stage(p, "sft", keys), f"data.sft.path: {f} row 6 (line 6):",
           "tokens long, over sft.max_seq_len=64")
    assert not (built.root / "sft" / keys["sft"]).exists()
