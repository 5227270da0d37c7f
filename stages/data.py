"""Data for every stage: the built-in synthetic task, or a user's JSONL/Parquet files.

The built-in task is the RLHF story in miniature. Word problems add two digits ("mia has 7 pears and
gets 6 more. total:" -> " 13"). The demonstrator who wrote the SFT data is sloppy: when the sum
carries, it drops the tens digit `carry_error_rate` of the time, so SFT learns the mistake. The
preference labels come from a checker that is always right, so the reward model learns what a correct
answer is, and PPO can then fix what SFT copied. The answer is checkable, so evaluation measures it.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import datasets
from datasets import Dataset

from hybridcore.errors import InputError
from stages import formats

datasets.disable_progress_bars()  # a few thousand rows load in milliseconds; the stages have their own bars

NAMES = ["mia", "tom", "ana", "leo", "eva", "sam", "ivy", "max", "zoe", "ben", "amy", "dan",
         "kim", "joe", "liz", "ray", "ada", "bob", "fay", "gus", "ida", "ned", "pia", "ted"]
THINGS = ["apples", "pears", "coins", "books", "cards", "shells", "stones", "stamps",
          "beads", "pens", "cups", "hats", "keys", "nuts", "eggs", "plums"]
VERBS = ["gets", "finds", "buys", "wins"]

KINDS = ("sft", "preferences", "prompts")


@dataclass
class Split:
    train: Dataset
    heldout: Dataset


def _problem(rng: random.Random) -> tuple[str, int, int]:
    a, b = rng.randrange(10), rng.randrange(10)
    prompt = f"{rng.choice(NAMES)} has {a} {rng.choice(THINGS)} and {rng.choice(VERBS)} {b} more. total:"
    return prompt, a, b


def _problems(seed: int, n: int, exclude: set[str]) -> list[tuple[str, int, int]]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        p = _problem(rng)
        if p[0] not in exclude:
            out.append(p)
    return out


def _heldout_problems(seed: int, n: int) -> list[tuple[str, int, int]]:
    return _problems(seed * 1000 + 7, n, set())


def _demonstration(a: int, b: int, rng: random.Random, carry_error_rate: float) -> str:
    s = a + b
    return f" {s % 10 if s >= 10 and rng.random() < carry_error_rate else s}"


def _wrong_answer(a: int, b: int, rng: random.Random) -> str:
    """A wrong total as a checker meets them: the demonstrator's dropped carry, a near miss, or anything else.
    Near misses matter: an RM that never saw one rates them like the right answer, and PPO finds that out."""
    s, r = a + b, rng.random()
    if s >= 10 and r < 0.5:
        return f" {s % 10}"
    if r < 0.75:
        return f" {rng.choice([x for x in (s - 1, s + 1) if x >= 0])}"
    return f" {rng.choice([x for x in range(19) if x != s])}"


def synthetic(kind: str, syn, seed: int) -> Split:
    """Generate one kind of data (sft | preferences | prompts) for the built-in task."""
    held = _heldout_problems(seed, syn.n_heldout)
    exclude = {p for p, _, _ in held}
    offset = {"sft": 1, "preferences": 2, "prompts": 3}[kind]
    rng = random.Random(seed * 1000 + offset * 10)
    size = {"sft": syn.n_sft, "preferences": syn.n_preferences, "prompts": syn.n_prompts}[kind]

    def rows(problems):
        if kind == "sft":
            return [{"prompt": p, "response": _demonstration(a, b, rng, syn.carry_error_rate)} for p, a, b in problems]
        if kind == "preferences":
            return [{"prompt": p, "chosen": f" {a + b}", "rejected": _wrong_answer(a, b, rng)} for p, a, b in problems]
        return [{"prompt": p, "answer": str(a + b)} for p, a, b in problems]

    train = rows(_problems(seed * 1000 + offset, size, exclude))
    return Split(Dataset.from_list(train), Dataset.from_list(rows(held)))


JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
              type(None): "null"}
SUFFIXES = (".jsonl", ".json", ".parquet")


def _json_records(p: Path, field: str, kind: str) -> list[tuple[str, dict]]:
    """("line N", object) for every non-blank line of a JSONL file (or "item N" of a .json array), parsed
    with the json module so that each mistake is reported with the line it is on."""
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise InputError(f"{field}: could not read {p}: line {line} is not UTF-8 (byte 0x{raw[e.start]:02x} at "
                         f"offset {e.start}); expected UTF-8 text (re-save the file as UTF-8)") from None
    if p.suffix.lower() == ".json" and text.lstrip().startswith("["):
        unit = "item"
        try:
            numbered = list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as e:
            raise InputError(f"{field}: could not read {p}: not valid JSON ({e.msg} at line {e.lineno}, column "
                             f"{e.colno}); expected an array of objects, or one object per line") from None
        except RecursionError:
            raise InputError(f"{field}: could not read {p}: nested too deeply; expected an array of objects")
    else:
        unit, numbered = "line", []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise InputError(f"{field}: could not read {p}: line {n} is not valid JSON ({e.msg} at column "
                                 f"{e.colno}); expected one JSON object per line") from None
            except RecursionError:
                raise InputError(f"{field}: could not read {p}: line {n} is nested too deeply; expected one "
                                 f"JSON object per line") from None
    for n, obj in numbered:
        if not isinstance(obj, dict):
            found = JSON_TYPES.get(type(obj), type(obj).__name__)
            raise InputError(f"{field}: could not read {p}: {unit} {n} is a JSON {found}, expected an object "
                             f"with columns {', '.join(formats.STANDARD[kind])}")
    return [(f"row {i} ({unit} {n})", obj) for i, (n, obj) in enumerate(numbered, 1)]


def _parquet_records(p: Path, field: str) -> list[tuple[str, dict]]:
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        detail = (str(e).splitlines() or [""])[0][:200]
        raise InputError(f"{field}: could not read {p} as Parquet ({type(e).__name__}: {detail})") from None
    return [(f"row {i}", r) for i, r in enumerate(table.to_pylist(), 1)]


def _folder_records(p: Path, field: str) -> list[tuple[str, dict]]:
    """A `datasets.save_to_disk` folder (Arrow files and JSON metadata; nothing is unpickled): a Dataset, or the
    `train` split of a DatasetDict."""
    if not ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        raise InputError(f"{field}: {p} is a folder without state.json or dataset_dict.json (expected a JSONL or "
                         f"Parquet file, or a folder written by datasets' save_to_disk)")
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise InputError(f"{field}: could not load {p} with datasets.load_from_disk ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise InputError(f"{field}: {p} holds the splits {', '.join(ds)}; expected a 'train' split (or save "
                             f"one split alone)")
        ds = ds["train"]
    return [(f"row {i}", r) for i, r in enumerate(ds.to_list(), 1)]


def read_table(path: str, kind: str, columns: Optional[dict] = None) -> Dataset:
    """A user's file (JSONL, a .json array, Parquet, or a `datasets.save_to_disk` folder), checked and brought to
    one shape (stages/formats.py): standard text or conversational turns, one format per file, `columns` mapping
    our column names to the file's. Prompt rows keep the whole row (`row`, JSON) for evaluation's checker.
    Nothing is unpickled: JSON is parsed by the json module, Parquet and Arrow read by pyarrow."""
    p = Path(path)
    field = f"data.{kind}.path"
    if p.is_dir():
        records = _folder_records(p, field)
    elif not p.is_file():
        raise InputError(f"{field}: file {path} not found (expected a JSONL or Parquet file, or a datasets folder)")
    elif p.suffix.lower() not in SUFFIXES:
        raise InputError(f"{field}: {path} has suffix '{p.suffix}' (expected .jsonl, .json or .parquet, or a "
                         f"datasets folder)")
    elif p.stat().st_size == 0:
        raise InputError(f"{field}: {path} is empty (expected rows with columns {', '.join(formats.STANDARD[kind])})")
    else:
        records = _parquet_records(p, field) if p.suffix.lower() == ".parquet" else _json_records(p, field, kind)
    if not records:
        raise InputError(f"{field}: {path} has no rows (expected rows with columns "
                         f"{', '.join(formats.STANDARD[kind])})")
    records = formats.rename(records, columns, kind, str(path))
    rows, _ = formats.normalize(kind, records, str(path), field)
    for row, (where, raw) in zip(rows, records):
        row[WHERE] = where  # errors found later (a stage's tokenizer, a template) still name the file's row
        if kind == "prompts":
            row["row"] = json.dumps(raw, default=str)
    return Dataset.from_list(rows)


WHERE = "_where"


def where(ds: Dataset, i: int) -> str:
    """Row i of a split as its file numbers it ("row 7 (line 9)"), or its place in the built-in data."""
    return ds[i][WHERE] if WHERE in ds.column_names else f"row {i + 1}"


def source(p, kind: str) -> str:
    """How errors name a kind's data: its file, or the built-in task."""
    path = getattr(p.data, kind).path
    return f"data.{kind}.path: {path}" if path is not None else f"data.{kind} (built-in)"


def is_conversational(ds: Dataset, kind: str) -> bool:
    """Whether a loaded split holds turns (see stages/formats.py) rather than text."""
    return len(ds) > 0 and formats.is_conversational(kind, ds[0])


def split_sizes(n_rows: int, heldout_fraction: float) -> tuple[int, int]:
    """(train, held-out) row counts of a user's file: at least one row is held out."""
    n_held = max(1, int(n_rows * heldout_fraction))
    return n_rows - n_held, n_held


def load(kind: str, params) -> Split:
    """The train/held-out split of one kind of data, synthetic unless `data.<kind>.path` is set."""
    source = getattr(params.data, kind)
    if source.path is None:
        return synthetic(kind, params.data.synthetic, params.pipeline.seed)
    ds = read_table(source.path, kind, source.columns).shuffle(seed=params.pipeline.seed)
    n_train, n_held = split_sizes(len(ds), params.data.heldout_fraction)
    if n_train < 1:
        raise InputError(f"data.{kind}.path: {source.path} has {len(ds)} row(s); need at least 2 to keep some "
                         f"held out")
    return Split(ds.select(range(n_held, len(ds))), ds.select(range(n_held)))


def rows(ds: Dataset) -> list[dict]:
    """Each prompt row as the file had it (column names mapped to ours), for checkers and reward functions."""
    if "row" in ds.column_names:
        return [json.loads(r) for r in ds["row"]]
    return ds.to_list()


def first_number(prompt, response: str, row: dict) -> bool:
    """The built-in task's checker: is the first integer in the response the answer?"""
    m = re.search(r"-?\d+", response)
    return m is not None and m.group(0) == str(row["answer"]).strip()


def exact_match(prompt, response: str, row: dict) -> bool:
    """The default checker for users' prompts: the response equals the answer after whitespace normalisation."""
    return " ".join(response.split()) == " ".join(str(row["answer"]).split())


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return []


def corpus(params) -> list[str]:
    """Every text a locally trained tokenizer should cover (turns' roles and contents included)."""
    texts = []
    for kind in KINDS:
        split = load(kind, params)
        for ds in (split.train, split.heldout):
            for col in ("prompt", "response", "chosen", "rejected", "messages"):
                if col in ds.column_names:
                    texts.extend(s for v in ds[col] for s in _strings(v))
    return texts
