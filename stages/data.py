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

datasets.disable_progress_bars()  # a few thousand rows load in milliseconds; the stages have their own bars

NAMES = ["mia", "tom", "ana", "leo", "eva", "sam", "ivy", "max", "zoe", "ben", "amy", "dan",
         "kim", "joe", "liz", "ray", "ada", "bob", "fay", "gus", "ida", "ned", "pia", "ted"]
THINGS = ["apples", "pears", "coins", "books", "cards", "shells", "stones", "stamps",
          "beads", "pens", "cups", "hats", "keys", "nuts", "eggs", "plums"]
VERBS = ["gets", "finds", "buys", "wins"]

COLUMNS = {"sft": ("prompt", "response"), "preferences": ("prompt", "chosen", "rejected"), "prompts": ("prompt",)}


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
    s = a + b
    if s >= 10 and rng.random() < 0.5:
        return f" {s % 10}"
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


OPTIONAL = {"prompts": ("answer",)}   # kept when present; may be an empty string
JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
              type(None): "null"}


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
                             f"with columns {', '.join(COLUMNS[kind])}")
    return [(f"{unit} {n}", obj) for n, obj in numbered]


def _check_rows(rows: list[tuple[str, dict]], columns: tuple[str, ...], path, field: str) -> None:
    """Every row has every column as a string, non-empty except `answer`; preference pairs differ. Each row
    comes with where it is in the file ("row 3 (line 4)")."""
    for where, row in rows:
        for col in columns:
            v = row.get(col)
            if not isinstance(v, str) or (col != "answer" and not v):
                got = "nothing (the key is missing)" if col not in row else _short(v)
                kind = "a string" if col == "answer" else "a non-empty string"
                raise InputError(f"{field}: {path} {where}: column '{col}' must be {kind}, got {got}")
        if "chosen" in columns and row["chosen"] == row["rejected"]:
            raise InputError(f"{field}: {path} {where}: chosen equals rejected (a pair must differ)")


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _columns(kind: str, found: list[str], path, field: str) -> tuple[str, ...]:
    missing = [c for c in COLUMNS[kind] if c not in found]
    if missing:
        raise InputError(f"{field}: {path} lacks column(s) {', '.join(missing)} "
                         f"(expected columns: {', '.join(COLUMNS[kind])}; found: {', '.join(found) or 'none'})")
    return COLUMNS[kind] + tuple(c for c in OPTIONAL.get(kind, ()) if c in found)


def read_table(path: str, kind: str) -> Dataset:
    """Load a user's JSONL or Parquet file and check it: UTF-8, one JSON object per line, the columns
    `kind` needs as non-empty strings on every row, preference pairs that differ. Only those columns (and
    an optional `answer` for prompts) are kept. Nothing is unpickled: JSON is parsed by the json module,
    Parquet read by pyarrow."""
    p = Path(path)
    field = f"data.{kind}.path"
    if p.is_dir():
        raise InputError(f"{field}: {path} is a folder (expected a JSONL or Parquet file)")
    if not p.is_file():
        raise InputError(f"{field}: file {path} not found (expected a JSONL or Parquet file)")
    suffix = p.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise InputError(f"{field}: {path} has suffix '{p.suffix}' (expected .jsonl, .json or .parquet)")
    if p.stat().st_size == 0:
        raise InputError(f"{field}: {path} is empty (expected rows with columns {', '.join(COLUMNS[kind])})")
    if suffix == ".parquet":
        return _read_parquet(p, kind, field)
    records = _json_records(p, field, kind)
    if not records:
        raise InputError(f"{field}: {path} has no rows (expected JSON objects with columns "
                         f"{', '.join(COLUMNS[kind])})")
    found = list(dict.fromkeys(k for _, r in records for k in r))
    keep = _columns(kind, found, path, field)
    _check_rows([(f"row {i} ({where})", r) for i, (where, r) in enumerate(records, 1)], keep, path, field)
    return Dataset.from_dict({c: [r[c] for _, r in records] for c in keep})


def _read_parquet(p: Path, kind: str, field: str) -> Dataset:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.table import InMemoryTable
    try:
        found = list(pq.read_schema(p).names)
        keep = _columns(kind, found, p, field)
        table = pq.read_table(p, columns=list(keep))
    except InputError:
        raise
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        detail = (str(e).splitlines() or [""])[0][:200]
        raise InputError(f"{field}: could not read {p} as Parquet ({type(e).__name__}: {detail})") from None
    if table.num_rows == 0:
        raise InputError(f"{field}: {p} has no rows")
    for col in keep:
        t = table.schema.field(col).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise InputError(f"{field}: {p} column '{col}' has type {t}, expected string")
    _check_rows([(f"row {i}", r) for i, r in enumerate(table.to_pylist(), 1)], keep, p, field)
    return Dataset(InMemoryTable(table))


def split_sizes(n_rows: int, heldout_fraction: float) -> tuple[int, int]:
    """(train, held-out) row counts of a user's file: at least one row is held out."""
    n_held = max(1, int(n_rows * heldout_fraction))
    return n_rows - n_held, n_held


def load(kind: str, params) -> Split:
    """The train/held-out split of one kind of data, synthetic unless `data.<kind>.path` is set."""
    path = getattr(params.data, kind).path
    if path is None:
        return synthetic(kind, params.data.synthetic, params.pipeline.seed)
    ds = read_table(path, kind).shuffle(seed=params.pipeline.seed)
    n_train, n_held = split_sizes(len(ds), params.data.heldout_fraction)
    if n_train < 1:
        raise InputError(f"data.{kind}.path: {path} has {len(ds)} row(s); need at least 2 to keep some held out")
    return Split(ds.select(range(n_held, len(ds))), ds.select(range(n_held)))


def check_answer(response: str, answer: Optional[str]) -> Optional[bool]:
    """Is the first number in the response the answer? None when no answer is known."""
    if answer is None:
        return None
    m = re.search(r"-?\d+", response)
    return m is not None and m.group(0) == answer.strip()


def corpus(params) -> list[str]:
    """Every text a locally trained tokenizer should cover."""
    texts = []
    for kind in COLUMNS:
        split = load(kind, params)
        for ds in (split.train, split.heldout):
            for col in ("prompt", "response", "chosen", "rejected"):
                if col in ds.column_names:
                    texts.extend(ds[col])
    return texts
