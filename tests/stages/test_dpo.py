"""The DPO stage: it learns the built-in task from the preference pairs alone (tiny preset, against SFT, judged by
evaluation); its reference log-probs are the SFT model's, computed once (with LoRA: the policy's base with the
adapters off, no second copy); a run killed mid-way resumes bit for bit, reading the cached reference log-probs;
an out-of-memory error is survived at the same effective batch. Micro preset except the learning test."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hybridcore import chat
from hybridcore.errors import InputError
from hybridcore.interrupts import FAULT_ENV, InjectedFault
from hybridcore.models import load_tokenizer
from stages import data, dpo, examples
from stages.examples import policy_pairs, prompt_ids
from stages.keys import stage_keys
from stages.params import load_params
from stages.runner import run_stage
from tests.conftest import ROOT
from tests.flows.test_resume import EXACT_ENV, assert_same_weights
from tests.stages.test_examples import SYS, ask, said, tok  # noqa: F401 -- tok: the tokenizer fixture

STAGES = ["sft", "dpo", "evaluate"]
LORA = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}


class ListSink:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))


def params(root: Path, preset: str = "test", **sections):
    return load_params(preset, {"pipeline": {"artifacts_dir": str(root), "stages": STAGES}, **sections})


def weights(result) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result.artifact) / "model" / "model.safetensors"))


def test_dpo_learns_the_built_in_task_from_preferences_alone(tiny_artifacts):
    """Tiny preset: DPO on the preference pairs makes the policy's greedy answers right far more often than SFT's
    (measured 99.6 % vs 68.8 %), and its implicit reward prefers the chosen answer on held-out pairs."""
    p = load_params("tiny", {"pipeline": {"artifacts_dir": str(tiny_artifacts), "stages": STAGES}})
    keys = stage_keys(p)
    sink = ListSink()
    result = run_stage(p, "dpo", keys, sink)
    m = result.metrics
    assert m["steps"] == 125 and m["heldout_accuracy"] > 0.8 and m["heldout_margin"] > 0, m
    assert m["longest_response_tokens"] >= 3  # " 13" + EOS: what evaluation's max_new_tokens is derived from
    steps = [r for _, r in sink.rows if "reward_margin" in r]
    assert len(steps) == 125
    first, last = steps[:10], steps[-10:]
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "loss") < mean(first, "loss")  # log 2 at the reference
    assert mean(last, "reward_margin") > mean(first, "reward_margin")
    assert mean(last, "accuracy") > 0.8
    model = AutoModelForCausalLM.from_pretrained(Path(result.artifact) / "model")  # a plain, merged HF folder
    assert not any("lora" in n for n, _ in model.named_parameters())
    ev = run_stage(p, "evaluate", keys).metrics
    print(f"\nSFT accuracy {ev['sft_accuracy']:.4f}  DPO accuracy {ev['dpo_accuracy']:.4f}  "
          f"held-out preference accuracy {m['heldout_accuracy']:.4f}  margin {m['heldout_margin']:.4f}")
    assert ev["prompts"] >= 200
    assert ev["dpo_accuracy"] >= ev["sft_accuracy"] + 0.15, ev
    assert ev["dpo_ended"] > 0.95, ev


def test_policy_pairs_split_each_side_where_sft_and_rollouts_would(tok):
    """Text: tok(prompt), then the response + EOS (SFT's encoding); turns: SFT's encoding of prompt + response, cut
    after the generation prompt before the response's assistant turn, so an earlier assistant turn is prompt, never
    scored; an empty prompt lends the response's first token; a pair equal once rendered is refused."""
    turns = [SYS, ask(3, 4), said("7"), ask(1, 2)]
    conv = examples.policy_pairs(tok, Dataset.from_list([{"prompt": turns, "chosen": [said("3")],
                                                          "rejected": [said("4")]}]), True, None, "prefs", 256)
    for ex, text in ((conv.chosen, "3"), (conv.rejected, "4")):
        ids, mask = chat.encode(tok, turns + [said(text)])
        assert ex.prompts[0] + ex.responses[0] == ids and ex.masks[0] == mask[len(ex.prompts[0]):]
        assert tok.decode(ex.prompts[0]).endswith("<|im_start|>assistant\n")
        assert tok.decode(ex.responses[0]) == f"{text}<|im_end|>\n"
        assert tok.decode([t for t, m in zip(ex.responses[0], ex.masks[0]) if m]) == f"{text}<|im_end|>\n"
    rows = [{"prompt": "mia has 3 pears and gets 4 more. total:", "chosen": " 7", "rejected": " 1"},
            {"prompt": "", "chosen": "total: 7", "rejected": "total: 1"}]
    text = examples.policy_pairs(tok, Dataset.from_list(rows), False, None, "prefs", 256)
    assert text.chosen.prompts[0] == examples.prompt_ids(tok, rows[0]["prompt"])
    assert text.chosen.responses[0] == tok(" 7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert text.chosen.masks[0] == [1] * len(text.chosen.responses[0])
    assert len(text.chosen.prompts[1]) == 1 and text.chosen.longest_reply == len(tok("total: 7")["input_ids"]) + 1
    with pytest.raises(InputError, match="same tokens once rendered"):
        examples.policy_pairs(tok, Dataset.from_list([{"prompt": "q", "chosen": " 7", "rejected": " 7"}]), False,
                              None, "prefs", 256)


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> dict:
    """SFT of the micro preset, plain and with LoRA on the actor, each once."""
    out = {}
    for name, engine in (("plain", {}), ("lora", {"roles": {"actor": {"lora": LORA}}})):
        root = tmp_path_factory.mktemp(f"dpo-{name}")
        p = params(root, engine=engine)
        run_stage(p, "sft", stage_keys(p))
        out[name] = (root, engine)
    return out


def by_hand(model, prompt: list[int], response: list[int]) -> float:
    """Summed log-prob of `response` after `prompt` under plain transformers, one unpadded row."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = F.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    return float(logp[len(prompt) - 1:].sum())


def sft_folder(p) -> Path:
    return Path(p.pipeline.artifacts_dir) / "sft" / stage_keys(p)["sft"] / "model"


def cached_reference(root: Path) -> dict[str, torch.Tensor]:
    partial = next((root / "dpo").glob("*.partial"))
    return load_file(str(partial / dpo.REFERENCE))


def stop_at_first_step(p, monkeypatch) -> int:
    """Run the stage until just before its first step (an injected fault there); how many models it loaded."""
    loads = []
    real = dpo.load_policy
    monkeypatch.setattr(dpo, "load_policy", lambda *a, **k: loads.append(a[2]) or real(*a, **k))
    monkeypatch.setenv(FAULT_ENV, "dpo:raise:0")
    with pytest.raises(InjectedFault):
        run_stage(p, "dpo", stage_keys(p))
    monkeypatch.delenv(FAULT_ENV)
    monkeypatch.setattr(dpo, "load_policy", real)
    return loads


@pytest.mark.parametrize("name", ["plain", "lora"])
def test_reference_logprobs_are_the_sft_models_computed_once(micro, name, monkeypatch, capsys):
    """The cached reference log-probs equal the SFT model's under plain transformers (with LoRA: the adapters-off
    base, from the one model loaded); the rerun reads them instead of loading a reference again."""
    root, engine = micro[name]
    p = params(root, engine=engine)
    loads = stop_at_first_step(p, monkeypatch)
    assert loads == (["actor"] if name == "lora" else ["actor", "reference"])  # LoRA: no second copy
    ref = cached_reference(root)
    sft_dir = sft_folder(p)
    tok = load_tokenizer(str(sft_dir))
    plain = AutoModelForCausalLM.from_pretrained(sft_dir, torch_dtype=torch.float32).eval()
    split = data.load("preferences", p)
    pairs = policy_pairs(tok, split.train, False, None, "prefs", None, report=False)
    for j in (0, 1, 17, 63):
        row = split.train[j]
        assert pairs.chosen.prompts[j] == prompt_ids(tok, row["prompt"])  # SFT's tokenisation of a text row
        assert pairs.chosen.responses[j][-1] == tok.eos_token_id
        for side, ex in (("chosen", pairs.chosen), ("rejected", pairs.rejected)):
            want = by_hand(plain, ex.prompts[j], ex.responses[j])
            assert abs(float(ref[f"train.{side}"][j]) - want) < 1e-5, (side, j)
    assert ref["train.chosen"].shape == (len(pairs),) and ref["heldout.chosen"].shape == (16,)
    capsys.readouterr()
    loads = []
    real = dpo.load_policy
    monkeypatch.setattr(dpo, "load_policy", lambda *a, **k: loads.append(a[2]) or real(*a, **k))
    result = run_stage(p, "dpo", stage_keys(p))
    assert loads == ["actor"]  # the reference was not loaded again
    assert "reference log-probs read from" in capsys.readouterr().err
    assert (Path(result.artifact) / "model" / "model.safetensors").is_file()
    assert (Path(result.artifact) / "adapter").is_dir() == (name == "lora")


def test_qlora_actor_trains_on_a_4bit_base(tmp_path):
    """params/test-qlora.yaml: a 4-bit actor with LoRA, the reference its base with the adapters off; the artifact
    is a plain merged folder."""
    p = params(tmp_path, "test-qlora", dpo={"lr": 1e-3})
    keys = stage_keys(p)
    run_stage(p, "sft", keys)
    result = run_stage(p, "dpo", keys)
    assert result.metrics["steps"] == 2 and result.metrics["heldout_margin"] != 0
    model = AutoModelForCausalLM.from_pretrained(Path(result.artifact) / "model")
    assert not any("lora" in n for n, _ in model.named_parameters())


def runner(root: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **EXACT_ENV}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    args = [sys.executable, "-m", "stages.runner", str(ROOT / "params" / "test.yaml"), "dpo",
            "--set", f"pipeline.artifacts_dir={root}", "--set", "pipeline.stages=[sft,dpo,evaluate]"]
    for s in ("dpo.epochs=2", "dpo.batch_size=16", "dpo.micro_batch_size=8", "dpo.checkpoint_every=2",
              "dpo.lr=1e-3"):
        args += ["--set", s]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def test_kill_and_resume_is_exact_and_reads_the_cached_reference(micro, tmp_path):
    """SIGKILL before step 5 of 8, rerun: the same weights and loss as an uninterrupted run, bit for bit, from
    the step-4 checkpoint and the reference log-probs the killed run cached."""
    root, _ = micro["plain"]
    for run in ("whole", "killed"):
        shutil.copytree(root / "sft", tmp_path / run / "sft")
    whole = runner(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = runner(tmp_path / "killed", "dpo:5")
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    assert (next((tmp_path / "killed" / "dpo").glob("*.partial")) / dpo.REFERENCE).is_file()
    resumed = runner(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step-4" in resumed.stdout + resumed.stderr
    assert "reference log-probs read from" in resumed.stderr and "computed once" not in resumed.stderr
    a, b = (json.loads(proc.stdout.strip().splitlines()[-1]) for proc in (whole, resumed))
    assert a["key"] == b["key"] and a["metrics"]["steps"] == b["metrics"]["steps"] == 8
    assert_same_weights(a["artifact"], b["artifact"])
    assert a["metrics"]["train_loss"] == b["metrics"]["train_loss"]
    assert a["metrics"]["heldout_accuracy"] == b["metrics"]["heldout_accuracy"]


def test_an_out_of_memory_step_is_redone_at_half_the_micro_batch(micro, monkeypatch, capsys):
    """An injected OOM in step 0 is survived: the step is redone at micro-batch 4 x 4 (the same 16 pairs), the size
    sticks, and the result equals a run configured at 4 from the start (1e-5); so does one in the reference pass."""
    root, _ = micro["plain"]
    dpo_cfg = {"batch_size": 16, "micro_batch_size": 4, "lr": 1e-4}
    p = params(root, dpo=dpo_cfg)
    halved = run_stage(p, "dpo", stage_keys(p), force=True)
    p = params(root, dpo={**dpo_cfg, "micro_batch_size": 8})
    for fault in ("dpo:oom:0", "dpo:reference:oom:0"):
        monkeypatch.setenv(FAULT_ENV, fault)
        sink = ListSink()
        result = run_stage(p, "dpo", stage_keys(p), sink, force=True)
        out = capsys.readouterr().out
        if fault == "dpo:oom:0":
            assert ("dpo: out of memory at step 0 with micro-batch 8 x 2; redoing it with micro-batch 4 x 4 (same "
                    "16 rows per step)") in out
            assert [m["micro_batch"] for _, m in sink.rows if "micro_batch" in m] == [4.0] * 4
        else:
            assert "dpo reference: out of memory at step 0 with micro-batch 8" in out
        assert out.count("out of memory") == 1
        got, want = weights(result), weights(halved)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)
    start = load_file(str(sft_folder(p) / "model.safetensors"))
    assert max(float((want[k] - start[k]).abs().max()) for k in want) > 1e-4  # DPO moved the weights


def test_planner_nan_skip_and_refused_layouts(micro, monkeypatch, capsys):
    """engine.memory_budget_gib measures DPO's micro-step with its probe; a NaN loss with on_nonfinite: skip skips
    that batch; several processes are refused in one line naming the layout."""
    from hybridcore.errors import NotYetSupported
    root, _ = micro["plain"]
    p = params(root, dpo={"batch_size": 16, "micro_batch_size": 16, "on_nonfinite": "skip"},
               engine={"memory_budget_gib": 4})
    keys = stage_keys(p)
    run_stage(p, "sft", keys)
    monkeypatch.setenv(FAULT_ENV, "dpo:nan:1")
    result = run_stage(p, "dpo", keys)
    assert result.metrics["planned_micro_batch"] >= 1 and result.metrics["steps"] == 3
    assert "dpo step 1: loss=nan; skipping this batch" in capsys.readouterr().out
    with pytest.raises(NotYetSupported, match=r"the dpo stage with engine.layout.dp=2"):  # before SFT runs
        params(root, engine={"layout": {"dp": 2}})
