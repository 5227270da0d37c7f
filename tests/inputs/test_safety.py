"""Safety defaults: what a user hands in is read without unpickling or running its code, and every server we
start listens on 127.0.0.1 only."""
from __future__ import annotations

import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridcore import models
from stages import data
from tests.inputs.helpers import check, write_jsonl


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any call to pickle.load(s) or torch.load fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")
    for target, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(target, name, refuse)


def test_checks_and_data_reading_never_unpickle(no_unpickling, built, micro_model, tmp_path):
    """Pre-flight of a model folder plus reading JSONL and Parquet data touch no pickle."""
    f = write_jsonl(tmp_path / "s.jsonl", [{"prompt": f"q{i}", "response": " 1"} for i in range(20)])
    data.read_table(str(f), "sft").to_parquet(str(tmp_path / "s.parquet"))
    assert len(data.read_table(str(tmp_path / "s.parquet"), "sft")) == 20
    prefs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "chosen": " 1", "rejected": " 2"}
                                               for i in range(20)])
    check(built, {"model": {"path": str(micro_model)},
                  "data": {"sft": {"path": str(f)}, "preferences": {"path": str(prefs)}}})()


def test_loaders_ask_for_safetensors_and_no_remote_code(monkeypatch, micro_model):
    """By default from_pretrained is called with use_safetensors=True and trust_remote_code=False."""
    seen, model = {}, torch.nn.Identity()

    def fake(path, **kwargs):
        seen.update(kwargs)
        return model
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake)
    assert models.load_causal_lm(str(micro_model)) is model
    assert seen["use_safetensors"] is True and seen["trust_remote_code"] is False


def test_mlflow_ui_binds_loopback(tmp_path):
    """`hybrid-rlhf ui` starts mlflow server with --host 127.0.0.1, and the CLI offers no --host to change it."""
    from flows.cli import parser
    from flows.ui import command

    (tmp_path / "mlflow.db").write_bytes(b"")
    cmd = command(tmp_path, 5000)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    with pytest.raises(SystemExit):
        parser().parse_args(["ui", "--host", "0.0.0.0"])


def test_prefect_api_server_binds_loopback(monkeypatch):
    """The Prefect API server the pipeline starts listens on 127.0.0.1 (uvicorn flag and Prefect setting)."""
    from flows import server

    started = {}

    class FakeProc:
        def poll(self):
            return None

    def fake_popen(args, env=None, **kwargs):
        started.update(args=args, env=env)
        return FakeProc()
    monkeypatch.setattr(server.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(server, "wait_healthy", lambda url, proc, timeout: None)
    _, url = server.start(port=45678)
    args = started["args"]
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert started["env"]["PREFECT_SERVER_API_HOST"] == "127.0.0.1"
    assert url == "http://127.0.0.1:45678/api"
