"""Cache keys: one key per stage, derived from everything that can change its output.

key = sha256(the stage's own params section + the sections it reads (model, the data it loads, seed, the chat
template) + the `engine` section + its inputs' keys + its files' fingerprints (data, model folder, a template file,
evaluation's checker) + code version). Code version hashes stages/<stage>.py, the stage modules every stage runs
(SHARED: data, formats, examples, common) and hybridcore/. The flow's Prefect cache
policy uses these same keys: the artifact store is the only cache.
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from stages.params import Params, stage_inputs, stage_list
from stages.user_code import fingerprint

ROOT = Path(__file__).resolve().parent.parent


# what every stage runs besides its own module: reading and encoding the data, loading and exporting models
SHARED = ("data.py", "formats.py", "examples.py", "common.py")


# the modules a stage runs besides its own and SHARED
OWN = {"ppo": ("estimators.py", "rewards.py", "user_code.py"), "evaluate": ("user_code.py",)}


@lru_cache(maxsize=None)
def code_version(stage: str) -> str:
    files = [ROOT / "stages" / f"{stage}.py", *(ROOT / "stages" / f for f in (*SHARED, *OWN.get(stage, ()))),
             *sorted((ROOT / "hybridcore").rglob("*.py"))]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _file_fingerprint(path: str | None, whole_folder: bool = False) -> str | None:
    """Content hash of a data file (or of every file of a datasets folder: `whole_folder`); a model folder by its
    config and its files' names and sizes (hashing 16 GB of weights on every run would cost more than it
    protects)."""
    if path is None:
        return None
    p = Path(path)
    if p.is_file():
        return hashlib.sha256(p.read_bytes()).hexdigest()
    if p.is_dir() and whole_folder:
        h = hashlib.sha256()
        for q in sorted(q for q in p.rglob("*") if q.is_file()):
            h.update(str(q.relative_to(p)).encode())
            h.update(q.read_bytes())
        return h.hexdigest()
    if p.is_dir():
        listing = sorted((q.name, q.stat().st_size) for q in p.iterdir() if q.is_file())
        config = (p / "config.json").read_bytes().decode(errors="replace") if (p / "config.json").is_file() else ""
        return hashlib.sha256(json.dumps([listing, config]).encode()).hexdigest()
    return "missing"


# How often state is saved never changes the result; nor does on_nonfinite: a run that met no NaN ends the same
# under either policy, and one that met one under `stop` produced no artifact, so its rerun with `skip` resumes.
NOT_IN_KEY = {"checkpoint_every", "keep_checkpoints", "on_nonfinite"}


# The data each stage reads (data.load kinds); SFT also reads every kind when it trains the tokenizer.
DATA_KINDS = {"sft": ("sft",), "reward": ("preferences",), "ppo": ("prompts",), "dpo": ("preferences",),
              "evaluate": ("prompts",)}
ALL_KINDS = ("sft", "preferences", "prompts")


def data_kinds(p: Params, stage: str) -> tuple[str, ...]:
    """The data kinds `stage`'s output depends on: its own, or all of them for an SFT run that trains its
    tokenizer on every text of the run (a built-in preset without model.tokenizer)."""
    if stage == "sft" and p.model.path is None and p.model.tokenizer is None:
        return ALL_KINDS
    return DATA_KINDS[stage]


def data_params(p: Params, stage: str) -> dict:
    """The data settings behind `stage`'s kinds: a user's file (its content is fingerprinted separately) and
    the held-out share, or the synthetic task's settings; nothing about the kinds it never reads."""
    out = {}
    for kind in data_kinds(p, stage):
        path = getattr(p.data, kind).path
        out[kind] = ({"file": True, "heldout_fraction": p.data.heldout_fraction,
                      "columns": getattr(p.data, kind).columns} if path is not None
                     else {"synthetic": p.data.synthetic.model_dump(mode="json")})
    return out


def stage_params(p: Params, stage: str) -> dict:
    """What a stage's output depends on among the params (artifacts_dir, tracking, the stage list, checkpoint
    cadence and the data of other stages don't). Evaluation reads ppo.max_new_tokens when its own is null."""
    own = {k: v for k, v in p.model_dump(mode="json")[stage].items() if k not in NOT_IN_KEY}
    if stage == "evaluate" and own["max_new_tokens"] is None:
        own["max_new_tokens"] = p.ppo.max_new_tokens
    return {"stage": own, "model": p.model.model_dump(mode="json"), "data": data_params(p, stage),
            "seed": p.pipeline.seed, "engine": p.engine.model_dump(mode="json"), "chat_template": p.data.chat_template}


USER_CODE = {"evaluate": ("checker",), "ppo": ("reward_function",)}  # FILE.py:NAME fields, by stage


def stage_keys(p: Params) -> dict[str, str]:
    """Keys of the stages that run, each chained on its inputs' keys."""
    model_files = {"model": _file_fingerprint(p.model.path), "tokenizer": _file_fingerprint(p.model.tokenizer)}
    data_files = {k: _file_fingerprint(getattr(p.data, k).path, whole_folder=True) for k in ALL_KINDS}
    template = p.data.chat_template
    model_files["chat_template"] = _file_fingerprint(template) if template and Path(template).is_file() else None
    keys: dict[str, str] = {}
    for stage in stage_list(p):
        files = {**model_files, **{k: data_files[k] for k in data_kinds(p, stage)}}
        for field in USER_CODE.get(stage, ()):  # a user's function's source: editing it reruns the stage
            files[field] = fingerprint(getattr(getattr(p, stage), field))
        doc = {"params": stage_params(p, stage), "inputs": {s: keys[s] for s in stage_inputs(p, stage)},
               "files": files, "code": code_version(stage)}
        keys[stage] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]
    return keys
