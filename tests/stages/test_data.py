"""Unit tests for stages.data: the synthetic carry task, users' JSONL/Parquet files, check_answer."""
from __future__ import annotations

import json
import re

import pytest
from datasets import Dataset

from hybridcore.errors import InputError
from stages import data
from stages.data import WHERE
from stages.params import load_params

KINDS = ("sft", "preferences", "prompts")
PROMPT_RE = re.compile(r"^([a-z]+) has (\d) ([a-z]+) and ([a-z]+) (\d) more\. total:$")


def digits(prompt: str) -> tuple[int, int]:
    """The two digits a and b of a synthetic prompt."""
    m = PROMPT_RE.match(prompt)
    assert m is not None, f"prompt not in the synthetic format: {prompt!r}"
    return int(m.group(2)), int(m.group(5))


@pytest.fixture(scope="module")
def tiny():
    return load_params("tiny")


@pytest.fixture(scope="module")
def tiny_sft(tiny):
    return data.load("sft", tiny)


@pytest.fixture(scope="module")
def tiny_prefs(tiny):
    return data.load("preferences", tiny)


@pytest.fixture(scope="module")
def tiny_prompts(tiny):
    return data.load("prompts", tiny)


def user_params(kind: str, path, **data_extra):
    """The test preset with data.<kind>.path set to `path`."""
    return load_params("test", {"data": {kind: {"path": str(path)}, **data_extra}})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --- synthetic: shape and determinism -------------------------------------------------------------


@pytest.mark.parametrize("kind, columns, size", [
    ("sft", ["prompt", "response"], "n_sft"),
    ("preferences", ["prompt", "chosen", "rejected"], "n_preferences"),
    ("prompts", ["prompt", "answer"], "n_prompts"),
])
def test_synthetic_sizes_and_columns(kind, columns, size):
    """Each synthetic kind has its columns, n_<kind> training rows and n_heldout held-out rows."""
    p = load_params("test")
    split = data.load(kind, p)
    assert isinstance(split, data.Split)
    assert sorted(split.train.column_names) == sorted(columns)
    assert sorted(split.heldout.column_names) == sorted(columns)
    assert len(split.train) == getattr(p.data.synthetic, size)
    assert len(split.heldout) == p.data.synthetic.n_heldout


def test_synthetic_prompts_follow_the_format():
    """Every synthetic prompt is '<name> has <a> <things> and <verb> <b> more. total:' with known words."""
    split = data.load("sft", load_params("test"))
    for prompt in list(split.train["prompt"]) + list(split.heldout["prompt"]):
        m = PROMPT_RE.match(prompt)
        assert m is not None, prompt
        assert m.group(1) in data.NAMES
        assert m.group(3) in data.THINGS
        assert m.group(4) in data.VERBS


@pytest.mark.parametrize("kind", KINDS)
def test_synthetic_is_deterministic_for_a_seed(kind):
    """The same params give identical rows, train and held-out."""
    p = load_params("test")
    a, b = data.load(kind, p), data.load(kind, p)
    assert a.train.to_list() == b.train.to_list()
    assert a.heldout.to_list() == b.heldout.to_list()


@pytest.mark.parametrize("kind", KINDS)
def test_synthetic_differs_for_another_seed(kind):
    """Another pipeline.seed gives other rows, train and held-out."""
    a = data.load(kind, load_params("test"))
    b = data.load(kind, load_params("test", {"pipeline": {"seed": 1}}))
    assert list(a.train["prompt"]) != list(b.train["prompt"])
    assert list(a.heldout["prompt"]) != list(b.heldout["prompt"])


def test_heldout_prompts_shared_across_kinds():
    """Every kind evaluates on the same held-out prompts for one seed."""
    p = load_params("test")
    held = [list(data.load(kind, p).heldout["prompt"]) for kind in KINDS]
    assert held[0] == held[1] == held[2]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 5])
def test_heldout_prompts_never_in_training(kind, seed):
    """No held-out prompt appears among the training prompts of the same kind."""
    split = data.load(kind, load_params("tiny", {"pipeline": {"seed": seed}}))
    assert set(split.heldout["prompt"]).isdisjoint(set(split.train["prompt"]))


# --- synthetic SFT: the sloppy demonstrator -------------------------------------------------------


def test_sft_non_carry_responses_are_correct(tiny_sft):
    """When a+b < 10 the demonstration is always the correct sum."""
    n = 0
    for row in tiny_sft.train.to_list() + tiny_sft.heldout.to_list():
        a, b = digits(row["prompt"])
        if a + b < 10:
            n += 1
            assert row["response"] == f" {a + b}", row
    assert n > 1000


def test_sft_carry_error_rate_and_wrong_answer(tiny, tiny_sft):
    """On carry problems the demonstrator drops the tens digit about carry_error_rate of the time."""
    carries = wrong = 0
    for row in tiny_sft.train.to_list():
        a, b = digits(row["prompt"])
        s = a + b
        if s < 10:
            continue
        carries += 1
        assert row["response"] in (f" {s}", f" {s % 10}"), row
        wrong += row["response"] == f" {s % 10}"
    assert carries > 1000
    rate = wrong / carries
    assert tiny.data.synthetic.carry_error_rate == 0.6
    assert abs(rate - 0.6) <= 0.07, rate


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_sft_carry_error_rate_extremes(rate):
    """carry_error_rate 0 gives only correct answers; 1 drops every carry."""
    split = data.load("sft", load_params("test", {"data": {"synthetic": {"n_sft": 500, "carry_error_rate": rate}}}))
    carries = 0
    for row in split.train.to_list():
        a, b = digits(row["prompt"])
        s = a + b
        carries += s >= 10
        expected = s % 10 if (s >= 10 and rate == 1.0) else s
        assert row["response"] == f" {expected}", row
    assert carries > 0


# --- synthetic preferences and prompts ------------------------------------------------------------


def test_preferences_chosen_correct_rejected_differs(tiny_prefs):
    """chosen is always the correct sum; rejected is always a different number."""
    for row in tiny_prefs.train.to_list() + tiny_prefs.heldout.to_list():
        a, b = digits(row["prompt"])
        assert row["chosen"] == f" {a + b}", row
        assert row["rejected"] != row["chosen"], row
        assert re.fullmatch(r" \d+", row["rejected"]), row


def test_preferences_rejected_includes_dropped_carry(tiny_prefs):
    """Some rejected answers are the dropped-carry mistake SFT learns (sum mod 10)."""
    dropped = 0
    for row in tiny_prefs.train.to_list():
        a, b = digits(row["prompt"])
        dropped += a + b >= 10 and row["rejected"] == f" {(a + b) % 10}"
    assert dropped > 100


def test_prompts_answer_is_the_sum(tiny, tiny_prompts):
    """The prompts' answer column is str(a+b); heldout has n_heldout rows, train n_prompts."""
    for row in tiny_prompts.train.to_list() + tiny_prompts.heldout.to_list():
        a, b = digits(row["prompt"])
        assert row["answer"] == str(a + b), row
    assert len(tiny_prompts.heldout) == tiny.data.synthetic.n_heldout
    assert len(tiny_prompts.train) == tiny.data.synthetic.n_prompts


# --- check_answer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("response, answer, expected", [
    (" 13", "13", True),
    (" 13 apples", "13", True),
    (" 3", "13", False),
    (" 131", "13", False),
    ("no number", "13", False),
    ("", "13", False),
    (" 13", " 13 ", True),
    (" 4 then 13", "13", False),
])
def test_first_number_checker(response, answer, expected):
    """The built-in task's checker: the first number in the response is the answer."""
    assert data.first_number("p", response, {"answer": answer}) is expected


@pytest.mark.parametrize("response, answer, expected", [
    (" 13", "13", True),
    ("  a  b\nc ", "a b c", True),
    (" 13 apples", "13", False),
    ("1 2 3", "123", False),
    ("", "", True),
    ("A b", "a b", False),
])
def test_exact_match_checker(response, answer, expected):
    """Users' prompts: exact match after whitespace normalisation (runs of whitespace are one space, ends trimmed)."""
    assert data.exact_match("p", response, {"answer": answer}) is expected


# --- users' files ---------------------------------------------------------------------------------

SFT_ROWS = [{"prompt": f"question {i}?", "response": f" {i}"} for i in range(20)]


def plain(ds) -> list[dict]:
    """A split's rows without the file position read_table adds (data.WHERE)."""
    return [{k: v for k, v in r.items() if k != WHERE} for r in ds.to_list()]


def test_user_jsonl_sft_splits_by_heldout_fraction(tmp_path):
    """A JSONL file with prompt/response loads and splits by data.heldout_fraction (0.1 of 20 = 2)."""
    f = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    split = data.load("sft", user_params("sft", f))
    assert len(split.heldout) == 2
    assert len(split.train) == 18
    train, held = plain(split.train), plain(split.heldout)
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held)
    assert sorted(train + held, key=lambda r: r["prompt"]) == sorted(SFT_ROWS, key=lambda r: r["prompt"])


def test_user_parquet_sft_splits_by_heldout_fraction(tmp_path):
    """A Parquet file loads and splits by a custom data.heldout_fraction (0.25 of 20 = 5)."""
    f = tmp_path / "sft.parquet"
    Dataset.from_list(SFT_ROWS).to_parquet(str(f))
    split = data.load("sft", user_params("sft", f, heldout_fraction=0.25))
    assert len(split.heldout) == 5
    assert len(split.train) == 15
    got = plain(split.train) + plain(split.heldout)
    assert sorted(got, key=lambda r: r["prompt"]) == sorted(SFT_ROWS, key=lambda r: r["prompt"])


def test_user_file_split_is_deterministic(tmp_path):
    """The same file and seed give the same split."""
    f = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    p = user_params("sft", f)
    assert data.load("sft", p).heldout.to_list() == data.load("sft", p).heldout.to_list()


def test_user_file_tiny_keeps_at_least_one_heldout(tmp_path):
    """Two rows keep one held out; one row is refused since nothing would be left to train on."""
    two = write_jsonl(tmp_path / "two.jsonl", SFT_ROWS[:2])
    split = data.load("sft", user_params("sft", two))
    assert (len(split.train), len(split.heldout)) == (1, 1)
    one = write_jsonl(tmp_path / "one.jsonl", SFT_ROWS[:1])
    with pytest.raises(InputError, match="need at least 2"):
        data.load("sft", user_params("sft", one))


def test_user_preferences_and_prompts_files(tmp_path):
    """Preferences and prompts files (prompts with an optional answer column) load."""
    prefs = write_jsonl(tmp_path / "p.jsonl",
                        [{"prompt": f"q{i}", "chosen": " 1", "rejected": " 2"} for i in range(10)])
    split = data.load("preferences", user_params("preferences", prefs))
    assert len(split.train) + len(split.heldout) == 10
    prompts = write_jsonl(tmp_path / "q.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    split = data.load("prompts", user_params("prompts", prompts))
    assert "answer" in split.train.column_names
    assert len(split.train) + len(split.heldout) == 10


def test_user_file_missing_column(tmp_path):
    """A file lacking a column is an InputError naming the missing column and the expected ones."""
    f = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "q", "answer": " 1"}])
    with pytest.raises(InputError) as exc:
        data.load("sft", user_params("sft", f))
    msg = str(exc.value)
    assert "data.sft.path" in msg
    assert "lacks column(s) response" in msg
    assert "expected columns: prompt, response" in msg


def test_user_file_non_string_value_names_row(tmp_path):
    """A non-string value is an InputError naming the row and column."""
    f = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "q", "response": " 1"}, {"prompt": "", "response": " 2"}])
    with pytest.raises(InputError) as exc:
        data.load("sft", user_params("sft", f))
    assert "row 2" in str(exc.value)
    assert "'prompt'" in str(exc.value)


def test_user_parquet_with_no_rows(tmp_path):
    """A Parquet file with the right columns but no rows is an InputError."""
    f = tmp_path / "empty.parquet"
    Dataset.from_list(SFT_ROWS).select([]).to_parquet(str(f))
    with pytest.raises(InputError, match="data.sft.path"):
        data.load("sft", user_params("sft", f))


def test_user_blank_jsonl(tmp_path):
    """A JSONL file holding only blank lines is an InputError."""
    f = tmp_path / "blank.jsonl"
    f.write_text("\n\n", encoding="utf-8")
    with pytest.raises(InputError, match="data.sft.path"):
        data.load("sft", user_params("sft", f))


def test_user_empty_jsonl(tmp_path):
    """A 0-byte JSONL file is an InputError naming data.sft.path."""
    f = tmp_path / "empty.jsonl"
    f.write_text("", encoding="utf-8")
    with pytest.raises(InputError, match="data.sft.path"):
        data.load("sft", user_params("sft", f))


def test_user_file_csv_suffix(tmp_path):
    """A .csv file is an InputError naming the suffix and the accepted ones."""
    f = tmp_path / "sft.csv"
    f.write_text("prompt,response\nq, 1\n", encoding="utf-8")
    with pytest.raises(InputError) as exc:
        data.load("sft", user_params("sft", f))
    msg = str(exc.value)
    assert "data.sft.path" in msg
    assert ".csv" in msg
    assert ".jsonl" in msg and ".parquet" in msg


def test_user_file_unreadable_jsonl(tmp_path):
    """A .jsonl file that is not JSON is an InputError, not a parser exception."""
    f = tmp_path / "bad.jsonl"
    f.write_text("this is not json\n", encoding="utf-8")
    with pytest.raises(InputError, match="could not read"):
        data.load("sft", user_params("sft", f))


def test_user_preferences_chosen_equals_rejected(tmp_path):
    """A preference pair whose chosen equals rejected is an InputError naming the row."""
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "q1", "chosen": " 1", "rejected": " 2"},
        {"prompt": "q2", "chosen": " 3", "rejected": " 4"},
        {"prompt": "q3", "chosen": " 5", "rejected": " 5"},
    ])
    with pytest.raises(InputError) as exc:
        data.load("preferences", user_params("preferences", f))
    msg = str(exc.value)
    assert "data.preferences.path" in msg
    assert "row 3" in msg
    assert "chosen equals rejected" in msg


def test_user_file_missing(tmp_path):
    """A path to a file that does not exist is an InputError naming data.sft.path."""
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(InputError) as exc:
        data.load("sft", user_params("sft", missing))
    msg = str(exc.value)
    assert "data.sft.path" in msg
    assert str(missing) in msg
    assert "not found" in msg


def test_read_table_returns_whole_file(tmp_path):
    """read_table returns every row of a valid file, unshuffled."""
    f = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    assert plain(data.read_table(str(f), "sft")) == SFT_ROWS
    assert data.read_table(str(f), "sft")[WHERE] == [f"row {i} (line {i})" for i in range(1, 21)]


def test_corpus_covers_every_text():
    """corpus holds every prompt and answer text of every kind, train and held-out."""
    p = load_params("test")
    texts = set(data.corpus(p))
    for kind in KINDS:
        split = data.load(kind, p)
        for ds in (split.train, split.heldout):
            for col in ("prompt", "response", "chosen", "rejected"):
                if col in ds.column_names:
                    assert set(ds[col]) <= texts
