"""Held-out tasks: not the built-in one, and not what the defaults were tuned on. Each has a sloppy demonstrator
(its SFT rows carry a systematic mistake), preference pairs labelled by an exact checker, and prompts with the
answer, written as users' JSONL files in the documented formats.

- count (standard rows): "count from 17 to 21:" -> " 17 18 19 20 21", 9 to 18 answer tokens. The demonstrator stops
  one number short on 5- and 6-number counts 60 % of the time.
- repeat (conversational rows, multi-turn SFT under a system turn): "say river 5 times" -> "river river river river
  river". On 5 and 6 repeats the demonstrator writes one fewer 60 % of the time.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDINGS = ("count from {a} to {b}:", "list the numbers from {a} to {b}:", "go from {a} up to {b}:")


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------------- count

def _count_problem(rng: random.Random) -> tuple[str, list[int]]:
    a, n = rng.randrange(10, 60), rng.randrange(3, 7)
    return rng.choice(WORDINGS).format(a=a, b=a + n - 1), list(range(a, a + n))


def _say(numbers: list[int]) -> str:
    return " " + " ".join(map(str, numbers))


def _count_wrong(numbers: list[int], rng: random.Random) -> list[int]:
    kind = rng.random()
    if kind < 0.5:
        return numbers[:-1]                                   # the demonstrator's mistake
    if kind < 0.75:
        i = rng.randrange(1, len(numbers) - 1)
        return numbers[:i] + numbers[i + 1:]                  # a number skipped
    return numbers + [numbers[-1] + 1]                        # one too far


def count_files(folder: Path, seed: int = 0, n_sft: int = 2000, n_prefs: int = 4000, n_prompts: int = 2304,
                error_rate: float = 0.6) -> dict[str, Path]:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    sft = []
    for _ in range(n_sft):
        prompt, numbers = _count_problem(rng)
        shown = numbers[:-1] if len(numbers) >= 5 and rng.random() < error_rate else numbers
        sft.append({"prompt": prompt, "response": _say(shown)})
    prefs = []
    for _ in range(n_prefs):
        prompt, numbers = _count_problem(rng)
        prefs.append({"prompt": prompt, "chosen": _say(numbers), "rejected": _say(_count_wrong(numbers, rng))})
    prompts = []
    for _ in range(n_prompts):
        prompt, numbers = _count_problem(rng)
        prompts.append({"prompt": prompt, "answer": _say(numbers).strip()})
    return {"sft": _write(folder / "sft.jsonl", sft), "preferences": _write(folder / "preferences.jsonl", prefs),
            "prompts": _write(folder / "prompts.jsonl", prompts)}


# ---------------------------------------------------------------------------------------------------- repeat

WORDS = ("dog", "cat", "sun", "tree", "river", "stone", "bird", "cloud", "apple", "lamp", "road", "fish", "moon",
         "rain", "wolf", "leaf", "ship", "bell", "sand", "rose", "king", "milk", "door", "fire", "snow", "hill",
         "bread", "chair", "clock", "horse")
REPEAT_SYSTEM = "Repeat the word."


def _repeat_problem(rng: random.Random) -> tuple[str, str, int]:
    word, n = rng.choice(WORDS), rng.randrange(2, 7)
    return f"say {word} {n} times", word, n


def _repeat_wrong(word: str, n: int, rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        return " ".join([word] * (n - 1))                     # the demonstrator's mistake
    if kind < 0.6:
        return " ".join([word] * (n + 1))                     # one too many
    if kind < 0.8:
        return " ".join([rng.choice([w for w in WORDS if w != word])] * n)  # another word
    return " ".join([word] * max(1, n - 2)) if n > 2 else " ".join([word] * (n + 2))


def repeat_files(folder: Path, seed: int = 0, n_sft: int = 2000, n_prefs: int = 4000, n_prompts: int = 2304,
                 error_rate: float = 0.6) -> dict[str, Path]:
    """Conversational rows: SFT rows are two requests in one chat under a system turn (4000 demonstrations, every
    assistant turn trained); preference rows are half explicit, half with the prompt implicit (TRL's two forms)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    system = [{"role": "system", "content": REPEAT_SYSTEM}]

    def exchange():
        ask, word, n = _repeat_problem(rng)
        shown = n - 1 if n >= 5 and rng.random() < error_rate else n
        return [{"role": "user", "content": ask}, {"role": "assistant", "content": " ".join([word] * shown)}]

    sft = [{"messages": system + exchange() + exchange()} for _ in range(n_sft)]
    prefs = []
    for i in range(n_prefs):
        ask, word, n = _repeat_problem(rng)
        prompt = system + [{"role": "user", "content": ask}]
        chosen = [{"role": "assistant", "content": " ".join([word] * n)}]
        rejected = [{"role": "assistant", "content": _repeat_wrong(word, n, rng)}]
        prefs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected} if i % 2 else
                     {"chosen": prompt + chosen, "rejected": prompt + rejected})
    prompts = []
    for _ in range(n_prompts):
        ask, word, n = _repeat_problem(rng)
        prompts.append({"prompt": system + [{"role": "user", "content": ask}], "answer": " ".join([word] * n)})
    return {"sft": _write(folder / "sft.jsonl", sft), "preferences": _write(folder / "preferences.jsonl", prefs),
            "prompts": _write(folder / "prompts.jsonl", prompts)}
