"""A user's mistake ends with one line naming it and what was expected, exit code 2, no traceback, and
nothing already computed is lost."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridcore.artifacts import read_verified
from tests.conftest import ROOT, run_cli


def _bad_yaml(tmp_path: Path, text: str) -> str:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return str(p)


CASES = {
    "unknown key": (lambda t: [_bad_yaml(t, "sft:\n  lrr: 0.1\n")], ["unknown key 'sft.lrr'"]),
    "wrong type": (lambda t: [_bad_yaml(t, "ppo:\n  iterations: many\n")], ["ppo.iterations", "integer"]),
    "missing model path": (lambda t: [str(ROOT / "params" / "tiny.yaml"), "--set", f"model.path={t}/nowhere"],
                           ["model.path", "not found"]),
    "data file without a needed column": (
        lambda t: [str(ROOT / "params" / "tiny.yaml"), "--set", f"data.sft.path={_jsonl(t)}"],
        ["data.sft.path", "response", "expected columns"]),
    "unknown preset": (lambda t: ["no-such-preset"], ["no-such-preset", "tiny"]),
    "malformed --set": (lambda t: [str(ROOT / "params" / "tiny.yaml"), "--set", "ppo.kl_coef"], ["key.path=value"]),
}


def _jsonl(tmp_path: Path) -> str:
    p = tmp_path / "sft.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": "a"}) for i in range(4)) + "\n")
    return str(p)


@pytest.mark.parametrize("case", list(CASES))
def test_input_error_is_one_line_exit_2(case, tmp_path, tiny_run):
    """Exit code 2, a single stderr line naming the problem, no traceback; the cache is intact."""
    make_args, expected = CASES[case]
    proc = run_cli(["run", *make_args(tmp_path)], tiny_run.workdir, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for text in expected:
        assert text in lines[0], lines[0]
    for stage, r in tiny_run.summary["stages"].items():
        assert read_verified(Path(r["artifact"])) is not None, stage


def test_fault_inside_a_stage_is_one_line_exit_1(tmp_path):
    """A NaN found mid-SFT through the whole flow: exit code 1, no traceback, and the message appears once (the
    CLI's `error:` line), not again in Prefect's task and flow state lines."""
    from hybridcore.interrupts import FAULT_ENV
    proc = run_cli(["run", str(ROOT / "params" / "test.yaml"), "--set", "tracking.enabled=false"], tmp_path,
                   timeout=300, extra_env={FAULT_ENV: "sft:nan:1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    mentions = [x for x in proc.stderr.splitlines() if "loss=nan" in x]
    assert len(mentions) == 1 and mentions[0].startswith("error: sft step 1: loss=nan"), proc.stderr[-2000:]
