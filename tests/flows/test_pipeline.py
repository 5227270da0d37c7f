"""The whole pipeline on the tiny default: it learns, it caches, it hands on loadable HF folders."""
from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from hybridcore.artifacts import read_verified
from tests.conftest import ROOT, assert_learns, run_cli

STAGES = ("sft", "reward", "ppo", "evaluate")


def test_pipeline_learns(tiny_run):
    """RM held-out accuracy > 0.75; on >= 200 held-out prompts PPO beats SFT on RM reward and on task
    accuracy by >= 3 points; the run fits the 10-minute budget."""
    assert_learns(tiny_run.summary)
    assert tiny_run.seconds < 600
    for text in ("sft_accuracy", "heldout_accuracy", "task accuracy SFT"):
        assert text in tiny_run.stdout


def test_sft_runs_its_whole_budget_and_flattens(tiny_run):
    """SFT does every configured step (epochs x rows / batch) and its loss has flattened by the end."""
    p = yaml.safe_load((ROOT / "params" / "tiny.yaml").read_text())["sft"]
    m = tiny_run.summary["stages"]["sft"]["metrics"]
    assert m["steps"] == p["epochs"] * (4000 // p["batch_size"])
    assert abs(m["train_loss"] - m["train_loss_prev"]) / m["train_loss_prev"] < 0.05


def test_summary_json_contract(tiny_run):
    """--summary-json holds run ids and, per stage, artifact, key, cache status and metrics."""
    s = tiny_run.summary
    assert s["run_id"] and s["mlflow_run_id"]
    for stage in STAGES:
        r = s["stages"][stage]
        assert set(r) >= {"artifact", "key", "cached", "metrics"}
        assert r["cached"] is False
        assert Path(r["artifact"]) == tiny_run.workdir / "artifacts" / stage / r["key"]


def test_artifacts_are_verified_hf_folders(tiny_run):
    """Each stage's folder verifies against its manifest; models load with plain from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    s = tiny_run.summary["stages"]
    for stage in STAGES:
        manifest = read_verified(Path(s[stage]["artifact"]))
        assert manifest is not None and manifest["key"] == s[stage]["key"]
        assert manifest["inputs"] == {d: s[d]["key"] for d in manifest["inputs"]}
    for stage in ("sft", "ppo"):
        folder = Path(s[stage]["artifact"]) / "model"
        assert list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin"))
        AutoModelForCausalLM.from_pretrained(folder)
        AutoTokenizer.from_pretrained(folder)
    rm = AutoModelForSequenceClassification.from_pretrained(Path(s["reward"]["artifact"]) / "model")
    assert rm.config.num_labels == 1
    rows = [json.loads(x) for x in (Path(s["evaluate"]["artifact"]) / "samples.jsonl").read_text().splitlines()]
    assert rows and {"prompt", "sft_response", "ppo_response", "ppo_reward"} <= set(rows[0])


def test_second_run_is_all_cached_and_fast(tiny_run):
    """Same params again: every stage is a cache hit, the same artifacts, in under half the first run's wall time
    (a relative bound: two test workers and a busy CI machine slow both runs alike)."""
    t0 = time.time()
    proc = run_cli(["run", str(ROOT / "params" / "tiny.yaml"), "--summary-json", "again.json"], tiny_run.workdir)
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((tiny_run.workdir / "again.json").read_text())
    for stage in STAGES:
        assert again["stages"][stage]["cached"] is True
        assert again["stages"][stage]["key"] == tiny_run.summary["stages"][stage]["key"]
        assert again["stages"][stage]["metrics"] == tiny_run.summary["stages"][stage]["metrics"]
    assert wall < 0.5 * tiny_run.seconds, (wall, tiny_run.seconds)


def test_changing_ppo_params_reruns_only_ppo(tiny_run):
    """A ppo.* change keeps SFT and RM cached; PPO (and the evaluation that reads it) run again."""
    proc = run_cli(["run", str(ROOT / "params" / "tiny.yaml"), "--set", "ppo.iterations=2", "--set",
                    "ppo.kl_coef=0.1", "--summary-json", "ppo_changed.json"], tiny_run.workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    changed = json.loads((tiny_run.workdir / "ppo_changed.json").read_text())["stages"]
    assert changed["sft"]["cached"] and changed["reward"]["cached"]
    assert not changed["ppo"]["cached"] and not changed["evaluate"]["cached"]
    assert changed["ppo"]["key"] != tiny_run.summary["stages"]["ppo"]["key"]
    assert changed["ppo"]["metrics"]["steps"] == 2


def test_mlflow_parent_and_nested_stage_runs(tiny_run):
    """The SQLite store under mlruns/ has the parent run, one nested run per stage with flattened params
    and per-step metrics."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tiny_run.workdir / 'mlruns' / 'mlflow.db'}")
    parent = client.get_run(tiny_run.summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.params["ppo.kl_coef"] == "0.2"
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_stage = {r.data.tags["stage"]: r for r in children}
    assert set(by_stage) == set(STAGES)
    assert by_stage["ppo"].data.params["ppo.kl_coef"] == "0.2"
    loss = client.get_metric_history(by_stage["sft"].info.run_id, "loss")
    assert len(loss) == tiny_run.summary["stages"]["sft"]["metrics"]["steps"]
    for name in ("reward", "kl", "clipfrac", "value_loss", "explained_variance", "entropy", "response_length"):
        assert len(client.get_metric_history(by_stage["ppo"].info.run_id, name)) > 1, name
    assert by_stage["sft"].data.tags["cache_hit"] == "false"

