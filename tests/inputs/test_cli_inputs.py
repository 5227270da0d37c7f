"""A few corpus cases through the real CLI in a subprocess: exit code 2, the message on one stderr line, no
traceback unless --debug, and the artifact store untouched. (tests/flows/test_cli_errors.py covers unknown
keys, wrong types, a missing model path, a missing column, an unknown preset and a malformed --set.)"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hybridcore.artifacts import read_verified
from tests.conftest import run_cli
from tests.inputs.helpers import copy_model, write_jsonl


def _store(built) -> list[str]:
    return ["--set", f"pipeline.artifacts_dir={built.root}", "--set", "tracking.enabled=false"]


def _non_utf8(tmp_path, built, micro_model):
    f = tmp_path / "sft.jsonl"
    f.write_bytes(b'{"prompt": "caf\xe9 has 2 cups. total:", "response": " 2"}\n')
    return ["--set", f"data.sft.path={f}"], ["data.sft.path", "line 1 is not UTF-8", "byte 0xe9"]


def _pickle_only(tmp_path, built, micro_model):
    folder = copy_model(micro_model, tmp_path / "model")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return ["--set", f"model.path={folder}"], ["model.path", "only pickled weights", "model.allow_pickle: true"]


def _conflict(tmp_path, built, micro_model):
    return ["--set", "sft.micro_batch_size=32"], ["sft", "micro_batch_size (32) is larger than batch_size (16)"]


CASES = {"conflicting batch sizes": _conflict, "non-UTF-8 data file": _non_utf8, "pickle-only model": _pickle_only}


@pytest.mark.parametrize("case", list(CASES))
def test_cli_input_error_is_one_line_exit_2(case, tmp_path, built, micro_model):
    """Exit code 2, exactly one stderr line naming the problem, no traceback; the store is intact."""
    args, expected = CASES[case](tmp_path, built, micro_model)
    proc = run_cli(["run", "test", *_store(built), *args], tmp_path, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert read_verified(built.artifact) == built.manifest


def test_cli_debug_shows_the_traceback(tmp_path, built):
    """With --debug the same input error comes with its full traceback."""
    proc = run_cli(["run", "test", *_store(built), "--set", "sft.micro_batch_size=32", "--debug"], tmp_path,
                   timeout=300)
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr
    assert "InputError" in proc.stderr and "micro_batch_size (32)" in proc.stderr


def test_cli_error_found_inside_a_stage_exits_2_without_traceback(tmp_path, built):
    """A too-long row only SFT can measure (its tokenizer is trained there) still ends with exit code 2 and one
    'error:' line last on stderr, no traceback; the artifact built before still verifies."""
    rows = [{"prompt": f"mia has {i % 10} pears. total:", "response": " 3"} for i in range(40)]
    rows[7]["prompt"] = "mia has " + "many " * 120 + "pears. total:"
    f = write_jsonl(tmp_path / "long.jsonl", rows)
    prefs = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": f"tom has {i % 10} coins. total:", "chosen": " 1",
                                                    "rejected": " 2"} for i in range(40)])
    proc = run_cli(["run", "test", *_store(built), "--set", f"data.sft.path={f}", "--set",
                    f"data.preferences.path={prefs}", "--set", "sft.max_seq_len=64"], tmp_path, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error: ")]
    assert errors == [lines[-1]], proc.stderr[-3000:]
    assert "data.sft" in errors[0] and "over sft.max_seq_len=64" in errors[0]
    assert "Traceback" not in proc.stderr
    assert read_verified(built.artifact) == built.manifest
    assert json.loads((built.artifact / "manifest.json").read_text())["key"] == built.artifact.name
