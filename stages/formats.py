"""The row formats users' files may take, checked and brought to one shape per kind (TRL's conventions).

Standard rows hold text; conversational rows hold lists of {"role", "content"} turns (roles system, user,
assistant) that the tokenizer's chat template renders:

| kind        | standard                                   | conversational                                        |
|-------------|--------------------------------------------|-------------------------------------------------------|
| sft         | prompt, response                           | messages (every assistant turn is trained)            |
| preferences | prompt, chosen, rejected (prompt optional) | prompt, chosen, rejected as turns (prompt optional)   |
| prompts     | prompt (+ answer)                          | prompt as turns (+ answer)                            |

A preference row without a prompt has an implicit one: the longest shared beginning of chosen and rejected (whole
turns for conversations; for text, backed off to a word boundary). One file holds one format. Every mistake is an
InputError naming the file, the row and the field.
"""
from __future__ import annotations

from typing import Optional

from hybridcore.chat import ROLES
from hybridcore.errors import InputError

STANDARD = {"sft": ("prompt", "response"), "preferences": ("prompt", "chosen", "rejected"), "prompts": ("prompt",)}
CONVERSATIONAL = {"sft": ("messages",), "preferences": ("chosen", "rejected"), "prompts": ("prompt",)}
OPTIONAL = {"sft": (), "preferences": ("prompt",), "prompts": ("answer",)}
KNOWN = {kind: tuple(dict.fromkeys(STANDARD[kind] + CONVERSATIONAL[kind] + OPTIONAL[kind])) for kind in STANDARD}


def short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_conversational(kind: str, row: dict) -> bool:
    """Which format a row is in: a `messages` column (SFT) or turns where the standard form has text."""
    if kind == "sft":
        return "messages" in row
    return isinstance(row.get("chosen" if kind == "preferences" else "prompt"), list)


def rename(rows: list[tuple[str, dict]], columns: Optional[dict], kind: str, source: str) -> list[tuple[str, dict]]:
    """data.<kind>.columns maps our column names to the file's: {prompt: question} reads `question` as prompt."""
    if not columns:
        return rows
    field = f"data.{kind}.columns"
    for ours, theirs in columns.items():
        if ours not in KNOWN[kind]:
            raise InputError(f"{field}: '{ours}' is not a column of {kind} data (expected keys among "
                             f"{', '.join(KNOWN[kind])}, each naming a column of {source})")
    found = {k for _, r in rows for k in r}
    for ours, theirs in columns.items():
        if theirs not in found:
            raise InputError(f"{field}: {source} has no column '{theirs}' (mapped to {ours}); found: "
                             f"{', '.join(sorted(map(str, found))) or 'none'}")
    out = []
    for where, row in rows:
        row = dict(row)
        for ours, theirs in columns.items():
            if theirs in row:
                row[ours] = row.pop(theirs)
        out.append((where, row))
    return out


def check_columns(kind: str, found: list[str], source: str, field: str, conversational: bool) -> None:
    need = [c for c in (CONVERSATIONAL if conversational else STANDARD)[kind] if c not in OPTIONAL[kind]]
    missing = [c for c in need if c not in found]
    if missing:
        expected = ", ".join(STANDARD[kind]) + ("" if kind == "sft" else " (or as turns)")
        if kind == "sft":
            expected += "; or messages"
        raise InputError(f"{field}: {source} lacks column(s) {', '.join(missing)} (expected columns: {expected}; "
                         f"found: {', '.join(map(str, found)) or 'none'})")


def normalize(kind: str, rows: list[tuple[str, dict]], source: str, field: str) -> tuple[list[dict], bool]:
    """(rows in one shape, conversational?) for a file's rows [(where, row)], the first row deciding the format."""
    conv = is_conversational(kind, rows[0][1])
    found = list(dict.fromkeys(k for _, r in rows for k in r))
    check_columns(kind, found, source, field, conv)
    out = []
    for where, row in rows:
        at = f"{field}: {source} {where}"
        if is_conversational(kind, row) != conv:
            this, first = ("conversational (turns)", "standard (text)") if not conv else \
                ("standard (text)", "conversational (turns)")
            raise InputError(f"{at}: the row is {this} but the first row is {first}; expected one format per file")
        out.append((_conversation if conv else _standard)[kind](row, at))
    return out, conv


# ------------------------------------------------------------------------------------------------ standard rows

def _text(row: dict, col: str, at: str, allow_empty: bool = False) -> str:
    v = row.get(col)
    if not isinstance(v, str) or (not allow_empty and not v):
        got = "nothing (the key is missing)" if col not in row else short(v)
        raise InputError(f"{at}: column '{col}' must be {'a string' if allow_empty else 'a non-empty string'}, "
                         f"got {got}")
    return v


def _answer(row: dict, at: str) -> dict:
    return {"answer": _text(row, "answer", at, allow_empty=True)} if "answer" in row else {}


def _std_sft(row, at):
    return {"prompt": _text(row, "prompt", at), "response": _text(row, "response", at)}


def _std_prefs(row, at):
    chosen, rejected = _text(row, "chosen", at), _text(row, "rejected", at)
    if "prompt" in row:
        prompt = _text(row, "prompt", at)
    else:  # implicit: the shared beginning, backed off to a word boundary (the RM reads prompt + response whole)
        n = _shared(list(chosen), list(rejected))
        while n and n < len(chosen) and not chosen[n - 1].isspace() and not chosen[n].isspace():
            n -= 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    if chosen == rejected:
        raise InputError(f"{at}: chosen equals rejected (a pair must differ)")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _std_prompts(row, at):
    return {"prompt": _text(row, "prompt", at), **_answer(row, at)}


_standard = {"sft": _std_sft, "preferences": _std_prefs, "prompts": _std_prompts}


# ------------------------------------------------------------------------------------------- conversational rows

def _turns(row: dict, col: str, at: str) -> list[dict]:
    """A column of turns: a non-empty list of {"role": system|user|assistant, "content": str} (other keys go)."""
    v = row.get(col)
    if not isinstance(v, list) or not v:
        got = "nothing (the key is missing)" if col not in row else short(v)
        raise InputError(f"{at}: column '{col}' must be a non-empty list of turns ({{\"role\", \"content\"}}), "
                         f"got {got}")
    out = []
    for i, t in enumerate(v, 1):
        if not isinstance(t, dict):
            raise InputError(f"{at}: column '{col}' turn {i} is {short(t)}; expected an object with role and content")
        role, content = t.get("role"), t.get("content")
        if role not in ROLES:
            got = "no role" if "role" not in t else f"role {short(role)}"
            raise InputError(f"{at}: column '{col}' turn {i} has {got}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            got = "no content" if "content" not in t else f"content {short(content)}"
            raise InputError(f"{at}: column '{col}' turn {i} ({role}) has {got}; expected a string")
        out.append({"role": role, "content": content})
    return out


def _ends_with_assistant(turns: list[dict], col: str, at: str) -> None:
    if turns[-1]["role"] != "assistant" or not turns[-1]["content"]:
        raise InputError(f"{at}: column '{col}' must end with a non-empty assistant turn, found a "
                         f"{turns[-1]['role']} turn{'' if turns[-1]['content'] else ' with no content'}")


def _conv_sft(row, at):
    turns = _turns(row, "messages", at)
    if not any(t["role"] == "assistant" and t["content"] for t in turns):
        raise InputError(f"{at}: column 'messages' has no assistant turn with content (SFT learns the assistant's "
                         f"turns; expected at least one)")
    return {"messages": turns}


def _conv_prefs(row, at):
    chosen, rejected = _turns(row, "chosen", at), _turns(row, "rejected", at)
    if "prompt" in row:
        prompt = _turns(row, "prompt", at)
    else:  # implicit: the turns both conversations share
        n = _shared(chosen, rejected)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not chosen or not rejected:
            raise InputError(f"{at}: chosen equals rejected{' or is its beginning' if chosen or rejected else ''} "
                             f"(a pair must differ in its last turns)")
    for col, turns in (("chosen", chosen), ("rejected", rejected)):
        _ends_with_assistant(turns, col, at)
    if chosen == rejected:
        raise InputError(f"{at}: chosen equals rejected (a pair must differ)")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _conv_prompts(row, at):
    turns = _turns(row, "prompt", at)
    if turns[-1]["role"] == "assistant":
        raise InputError(f"{at}: column 'prompt' ends with an assistant turn; expected the last turn to be the "
                         f"user's (or system's): the model writes the next assistant turn")
    return {"prompt": turns, **_answer(row, at)}


_conversation = {"sft": _conv_sft, "preferences": _conv_prefs, "prompts": _conv_prompts}


def _shared(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
