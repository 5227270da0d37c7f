"""Data for every stage: the built-in synthetic task, or a user's JSONL/Parquet files.

The built-in task is the RLHF story in miniature. Word problems add two digits ("mia has 7 pears and
gets 6 more. total:" -> " 13"). The demonstrator who wrote the SFT data is sloppy: when the sum
carries, it drops the tens digit `carry_error_rate` of the time, so SFT learns the mistake. The
preference labels come from a checker that is always right, so the reward model learns what a correct
answer is, and PPO can then fix what SFT copied. The answer is checkable, so evaluation measures it.
"""
from __future__ import annotations

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


def read_table(path: str, kind: str) -> Dataset:
    """Load a user's JSONL or Parquet file and check that it has the columns `kind` needs."""
    p = Path(path)
    field = f"data.{kind}.path"
    if not p.is_file():
        raise InputError(f"{field}: file {path} not found (expected a JSONL or Parquet file)")
    suffix = p.suffix.lower()
    if p.stat().st_size == 0:
        raise InputError(f"{field}: {path} is empty (expected rows with columns {', '.join(COLUMNS[kind])})")
    try:
        if suffix in (".jsonl", ".json"):
            ds = Dataset.from_json(str(p))
        elif suffix == ".parquet":
            ds = Dataset.from_parquet(str(p))
        else:
            raise InputError(f"{field}: {path} has suffix '{p.suffix}' (expected .jsonl, .json or .parquet)")
    except InputError:
        raise
    except Exception as e:  # pyarrow/datasets raise many types for unreadable files
        detail = (str(e).splitlines() or [""])[0][:200]
        raise InputError(f"{field}: could not read {path} ({type(e).__name__}: {detail})") from None
    if len(ds) == 0:
        raise InputError(f"{field}: {path} has no rows")
    missing = [c for c in COLUMNS[kind] if c not in ds.column_names]
    if missing:
        raise InputError(f"{field}: {path} lacks column(s) {', '.join(missing)} "
                         f"(expected columns: {', '.join(COLUMNS[kind])}; found: {', '.join(ds.column_names)})")
    for col in COLUMNS[kind] + (("answer",) if "answer" in ds.column_names else ()):
        bad = next((i for i, v in enumerate(ds[col]) if not isinstance(v, str) or (col != "answer" and not v)), None)
        if bad is not None:
            raise InputError(f"{field}: {path} row {bad + 1}: column '{col}' must be a non-empty string, "
                             f"got {ds[bad][col]!r}")
    if kind == "preferences":
        same = next((i for i, r in enumerate(ds) if r["chosen"] == r["rejected"]), None)
        if same is not None:
            raise InputError(f"{field}: {path} row {same + 1}: chosen equals rejected (a pair must differ)")
    return ds


def load(kind: str, params) -> Split:
    """The train/held-out split of one kind of data, synthetic unless `data.<kind>.path` is set."""
    path = getattr(params.data, kind).path
    if path is None:
        return synthetic(kind, params.data.synthetic, params.pipeline.seed)
    ds = read_table(path, kind).shuffle(seed=params.pipeline.seed)
    n_held = max(1, int(len(ds) * params.data.heldout_fraction))
    if len(ds) - n_held < 1:
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
