"""Users' own files through the real CLI with default params (params/tiny.yaml plus data paths), judged the way a
user's own script would judge the exported folders: plain transformers, no pipeline code.

- the built-in task in conversational form (multi-turn SFT under a system turn, TRL-style preferences with
  explicit and implicit prompts, prompts as turns) learns by the standard run's bars;
- two held-out tasks of our own (tests/tasks.py), not what the defaults were tuned on: `count` (standard rows,
  answers of 9-18 tokens, longer than the old fixed 8) and `repeat` (conversational). Each must learn: the RM ranks
  fresh pairs >= 0.75, and PPO's greedy answers beat SFT's by >= 5 points of exact match on fresh prompts.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hybridcore.artifacts import read_verified
from tests import tasks
from tests.conftest import ONE_THREAD, ROOT, PipelineRun, Started, assert_learns


RUNS = ("conversational", "count", "repeat")


def start_on_files(folder: Path, paths: dict[str, Path]) -> Started:
    sets = [x for kind, path in paths.items() for x in ("--set", f"data.{kind}.path={path}")]
    return Started(["run", str(ROOT / "params" / "tiny.yaml"), *sets, "--summary-json", "summary.json"], folder,
                   "run", extra_env=ONE_THREAD)


def finished(folder: Path, started: Started) -> PipelineRun:
    proc = started.result(timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return PipelineRun(folder, json.loads((folder / "summary.json").read_text()), proc.stdout + proc.stderr,
                       started.seconds)


@pytest.fixture(scope="module")
def started_runs(tmp_path_factory) -> dict[str, tuple[Path, Started]]:
    """The three runs on users' files (independent folders, keys and stores) start together, one thread each, and
    share the cores while the first one's tests already run; each fixture below waits for its own. This process
    also runs one thread while they do (plain transformers here beside them)."""
    from stages import example_files
    from stages.params import load_params
    folders = {name: tmp_path_factory.mktemp(name) for name in RUNS}
    files = {"conversational": example_files.write(folders["conversational"] / "data", load_params("tiny"),
                                                   conversational=True),
             "count": tasks.count_files(folders["count"] / "data"),
             "repeat": tasks.repeat_files(folders["repeat"] / "data")}
    runs = {name: (folders[name], start_on_files(folders[name], files[name])) for name in RUNS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield runs
    finally:
        torch.set_num_threads(threads)
        for _, started in runs.values():
            started.stop()


@pytest.fixture(scope="module")
def conversational_run(started_runs) -> PipelineRun:
    return finished(*started_runs["conversational"])


@pytest.fixture(scope="module")
def count_run(started_runs) -> PipelineRun:
    return finished(*started_runs["count"])


@pytest.fixture(scope="module")
def repeat_run(started_runs) -> PipelineRun:
    return finished(*started_runs["repeat"])


def folder(run: PipelineRun, stage: str) -> Path:
    return Path(run.summary["stages"][stage]["artifact"]) / "model"


def evaluation_rows(run: PipelineRun) -> list[dict]:
    path = Path(run.summary["stages"]["evaluate"]["artifact"]) / "evaluation.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def normalised(text: str) -> str:
    return " ".join(text.split())


@torch.no_grad()
def plain_scores(rm_dir: Path, conversations: list) -> list[float]:
    """What a user's script gets from the exported RM: the rendered chat (turns) or the text itself."""
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tok = AutoTokenizer.from_pretrained(rm_dir)
    out = []
    for c in conversations:
        ids = (tok.apply_chat_template(c, tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
               if isinstance(c, list) else tok(c, return_tensors="pt")["input_ids"])
        out.append(float(rm(input_ids=ids).logits[0, 0]))
    return out


@torch.no_grad()
def plain_answers(model_dir: Path, prompts: list, max_new_tokens: int) -> list[str]:
    """Greedy answers from the exported policy through plain transformers: the chat template for turns, the
    tokenizer call for text; generation stops where the folder's generation_config says."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for p in prompts:
        ids = (tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True,
                                       return_tensors="pt")["input_ids"]
               if isinstance(p, list) else tok(p, return_tensors="pt")["input_ids"])
        new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)[0, ids.shape[1]:]
        out.append(tok.decode(new, skip_special_tokens=True))
    return out


# ---------------------------------------------------------------------------------- the built-in task, as chat

def test_the_conversational_builtin_task_learns(conversational_run):
    assert_learns(conversational_run.summary)
    assert "warning: ppo" not in conversational_run.stdout  # nothing cut at max_new_tokens
    assert "warning: evaluate" not in conversational_run.stdout


def test_the_exported_rm_scores_conversations_as_the_pipeline_did(conversational_run):
    """Plain AutoModelForSequenceClassification on apply_chat_template(prompt + answer) gives evaluation's
    reward for that answer within 1e-4."""
    rows = evaluation_rows(conversational_run)[:40]
    convs = [r["prompt"] + [{"role": "assistant", "content": r["sft_response"]}] for r in rows]
    for got, row in zip(plain_scores(folder(conversational_run, "reward"), convs), rows):
        assert abs(got - row["sft_reward"]) < 1e-4


def test_the_exported_policy_chats_through_its_own_template(conversational_run):
    """The PPO folder's tokenizer carries the chat template and its generation_config stops at <|im_end|>: plain
    generate answers the held-out chats as the pipeline's rollout did."""
    d = folder(conversational_run, "ppo")
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    stops = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in stops
    rows = evaluation_rows(conversational_run)[:40]
    answers = plain_answers(d, [r["prompt"] for r in rows], 32)
    assert sum(a == r["ppo_response"] for a, r in zip(answers, rows)) >= 0.95 * len(rows)


# --------------------------------------------------------------------------------------- held-out task: count

def test_count_learns_with_the_default_lengths(count_run):
    """Answers of 9-18 tokens: max_new_tokens follows the data (no rollout cut short), evaluation's accuracy is an
    exact-match count of its own recorded answers, and PPO improves on SFT."""
    s = count_run.summary["stages"]
    assert s["ppo"]["metrics"]["max_new_tokens"] >= 18 + 1
    assert s["ppo"]["metrics"]["truncated_iterations"] == 0 and "warning: ppo" not in count_run.stdout
    ev, rows = s["evaluate"]["metrics"], evaluation_rows(count_run)
    for name in ("sft", "ppo"):
        count = sum(normalised(r[f"{name}_response"]) == normalised(r["answer"]) for r in rows)
        assert ev[f"{name}_accuracy"] == ev[f"{name}_exact_match"] == count / len(rows)
    assert ev["ppo_accuracy"] >= ev["sft_accuracy"] + 0.05


def test_count_judged_by_plain_transformers(count_run):
    """Fresh pairs and prompts (another seed): the RM ranks >= 75 % of pairs right; PPO's greedy answers beat SFT's
    by >= 5 points of exact match."""
    fresh = tasks.count_files(count_run.workdir / "fresh", seed=99, n_sft=2, n_prefs=200, n_prompts=200)
    judge(count_run, fresh, conversational=False)


def test_repeat_learns_and_is_judged_by_plain_transformers(repeat_run):
    assert_learns(repeat_run.summary)
    fresh = tasks.repeat_files(repeat_run.workdir / "fresh", seed=99, n_sft=2, n_prefs=200, n_prompts=200)
    judge(repeat_run, fresh, conversational=True)


def judge(run: PipelineRun, fresh: dict[str, Path], conversational: bool) -> None:
    pairs = [json.loads(x) for x in fresh["preferences"].read_text().splitlines()]
    if conversational:
        full = [((p.get("prompt") or []) + p["chosen"], (p.get("prompt") or []) + p["rejected"]) for p in pairs]
    else:
        full = [(p["prompt"] + p["chosen"], p["prompt"] + p["rejected"]) for p in pairs]
    scores = plain_scores(folder(run, "reward"), [c for c, _ in full] + [r for _, r in full])
    n = len(full)
    assert sum(scores[i] > scores[n + i] for i in range(n)) / n >= 0.75
    prompts = [json.loads(x) for x in fresh["prompts"].read_text().splitlines()]
    new = int(run.summary["stages"]["evaluate"]["metrics"]["max_new_tokens"])
    acc = {}
    for stage in ("sft", "ppo"):
        answers = plain_answers(folder(run, stage), [q["prompt"] for q in prompts], new)
        acc[stage] = sum(normalised(a) == normalised(q["answer"]) for a, q in zip(answers, prompts)) / len(prompts)
    assert acc["ppo"] >= acc["sft"] + 0.05, acc


def test_count_with_grpo_and_dpo_judged_by_plain_transformers(count_run):
    """The other recipes on the held-out task with their presets' settings (tiny-grpo: a verifier of the user's own,
    exact match on the `answer` column, no RM; tiny-dpo: the user's preference pairs): SFT is count_run's cache
    hit, no RM stage runs, --summary-json and the table name the policy stage (stages.dpo.artifact), and on fresh
    prompts each exported policy beats SFT's greedy answers by >= 5 points of exact match under plain
    transformers. The two runs go together (one thread each, each in its own folder over count_run's artifacts
    folder)."""
    verifier = count_run.workdir / "exact.py"
    verifier.write_text("def exact(prompts, responses, rows):\n"
                        "    return [float(' '.join(r.split()) == ' '.join(str(row['answer']).split()))\n"
                        "            for r, row in zip(responses, rows)]\n")
    data = count_run.workdir / "data"
    sets = [x for kind in ("sft", "preferences", "prompts") for x in ("--set", f"data.{kind}.path={data / kind}.jsonl")]
    sets += ["--set", f"pipeline.artifacts_dir={count_run.workdir / 'artifacts'}"]
    runs = {}
    try:
        for preset in ("tiny-grpo", "tiny-dpo"):
            (count_run.workdir / preset).mkdir()
            runs[preset] = Started(["run", preset, *sets, "--set", f"ppo.reward_function={verifier}:exact",
                                    "--summary-json", "summary.json"], count_run.workdir / preset, "run",
                                   extra_env=ONE_THREAD)
        fresh = tasks.count_files(count_run.workdir / "fresh-recipes", seed=98, n_sft=2, n_prefs=2, n_prompts=200)
        prompts = [json.loads(x) for x in fresh["prompts"].read_text().splitlines()]
        sft = plain_answers(folder(count_run, "sft"), [q["prompt"] for q in prompts], 24)
        for preset, policy in (("tiny-grpo", "ppo"), ("tiny-dpo", "dpo")):
            proc = runs[preset].result(timeout=1200)
            assert proc.returncode == 0, proc.stderr[-3000:]
            s = json.loads((count_run.workdir / preset / "summary.json").read_text())["stages"]
            assert list(s) == ["sft", policy, "evaluate"]
            assert s["sft"]["cached"] and s["sft"]["key"] == count_run.summary["stages"]["sft"]["key"]
            assert Path(s[policy]["artifact"]) == count_run.workdir / "artifacts" / policy / s[policy]["key"]
            assert read_verified(Path(s["evaluate"]["artifact"]))["inputs"] == {"sft": s["sft"]["key"],
                                                                                policy: s[policy]["key"]}
            assert "sft_reward" not in s["evaluate"]["metrics"] and f"{policy}_reward" not in s["evaluate"]["metrics"]
            assert f"-> {policy.upper()} " in proc.stdout
            answers = plain_answers(Path(s[policy]["artifact"]) / "model", [q["prompt"] for q in prompts], 24)
            acc = {name: sum(normalised(a) == normalised(q["answer"]) for a, q in zip(out, prompts)) / len(prompts)
                   for name, out in (("sft", sft), (policy, answers))}
            assert acc[policy] >= acc["sft"] + 0.05, (preset, acc)
    finally:
        for started in runs.values():
            started.stop()
