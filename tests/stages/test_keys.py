"""Cache keys change with what a stage reads and only with that: a user's preference file reruns the RM and
what follows it, never SFT, unless SFT trains its tokenizer on every text of the run."""
from __future__ import annotations

import json

from stages.keys import stage_keys
from stages.params import load_params


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _files(tmp_path, tag: str) -> dict:
    """A preferences and a prompts file whose content differs with `tag`."""
    return {"preferences": {"path": _jsonl(tmp_path / f"pref-{tag}.jsonl", [
                {"prompt": f"1+{tag}=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "chosen": "4", "rejected": "5"}])},
            "prompts": {"path": _jsonl(tmp_path / f"prompts-{tag}.jsonl", [{"prompt": f"3+{tag}="}, {"prompt": "4+4="}])}}


def _changed(a: dict, b: dict) -> set[str]:
    return {s for s in a if a[s] != b[s]}


def test_preferences_file_reruns_reward_and_later_not_sft(tmp_path):
    """With a tokenizer given, SFT reads only data.sft: a new preference file changes reward, ppo and evaluate."""
    (tmp_path / "tok").mkdir()
    tok = {"tokenizer": str(tmp_path / "tok")}    # any fixed folder: keys fingerprint it, nothing loads it here
    base = stage_keys(load_params("test", {"model": tok, "data": _files(tmp_path, "1")}))
    prefs = _files(tmp_path, "1") | {"preferences": _files(tmp_path, "2")["preferences"]}
    assert _changed(base, stage_keys(load_params("test", {"model": tok, "data": prefs}))) == {
        "reward", "ppo", "evaluate"}
    prompts = _files(tmp_path, "1") | {"prompts": _files(tmp_path, "2")["prompts"]}
    assert _changed(base, stage_keys(load_params("test", {"model": tok, "data": prompts}))) == {"ppo", "evaluate"}
    carry = {"synthetic": {"carry_error_rate": 0.1}}    # the synthetic SFT demonstrations: SFT and what follows
    assert _changed(base, stage_keys(load_params("test", {"model": tok, "data": _files(tmp_path, "1") | carry}))) \
        == {"sft", "reward", "ppo", "evaluate"}


def test_trained_tokenizer_makes_sft_read_every_file(tmp_path):
    """A preset without model.tokenizer trains its tokenizer on every text, so any data file changes SFT."""
    base = stage_keys(load_params("test", {"data": _files(tmp_path, "1")}))
    prompts = _files(tmp_path, "1") | {"prompts": _files(tmp_path, "2")["prompts"]}
    assert _changed(base, stage_keys(load_params("test", {"data": prompts}))) == {"sft", "reward", "ppo", "evaluate"}


def test_same_content_same_keys_and_checkpoint_cadence_is_not_in_the_key(tmp_path):
    """A file's content, not where it lies, is in the key; so is nothing about how often checkpoints are saved."""
    a = stage_keys(load_params("test", {"data": _files(tmp_path, "1")}))
    (tmp_path / "moved").mkdir()
    b = stage_keys(load_params("test", {"data": _files(tmp_path / "moved", "1"),
                                        "sft": {"checkpoint_every": 7}}))
    assert a == b
