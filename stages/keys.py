"""Cache keys: one key per stage, derived from everything that can change its output.

key = sha256(the stage's own params section + the sections it reads (model, data, seed) + the `engine`
section + its inputs' keys + user files' fingerprints + code version). Code version hashes
stages/<stage>.py, stages/data.py (every stage reads data) and hybridcore/. The flow's Prefect cache
policy uses these same keys: the artifact store is the only cache.
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from stages.params import STAGES, Params

ROOT = Path(__file__).resolve().parent.parent
INPUTS = {"sft": [], "reward": ["sft"], "ppo": ["sft", "reward"], "evaluate": ["sft", "reward", "ppo"]}


@lru_cache(maxsize=None)
def code_version(stage: str) -> str:
    files = [ROOT / "stages" / f"{stage}.py", ROOT / "stages" / "data.py", *sorted((ROOT / "hybridcore").rglob("*.py"))]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _file_fingerprint(path: str | None) -> str | None:
    """Content hash of a data file; a model folder by its config and its files' names and sizes (hashing
    16 GB of weights on every run would cost more than it protects)."""
    if path is None:
        return None
    p = Path(path)
    if p.is_file():
        return hashlib.sha256(p.read_bytes()).hexdigest()
    if p.is_dir():
        listing = sorted((q.name, q.stat().st_size) for q in p.iterdir() if q.is_file())
        config = (p / "config.json").read_bytes().decode(errors="replace") if (p / "config.json").is_file() else ""
        return hashlib.sha256(json.dumps([listing, config]).encode()).hexdigest()
    return "missing"


# How often state is saved never changes the result; nor does on_nonfinite: a run that met no NaN ends the same
# under either policy, and one that met one under `stop` produced no artifact, so its rerun with `skip` resumes.
NOT_IN_KEY = {"checkpoint_every", "keep_checkpoints", "on_nonfinite"}


def stage_params(p: Params, stage: str) -> dict:
    """What a stage's output depends on among the params (artifacts_dir, tracking, the stage list and
    checkpoint cadence don't)."""
    own = {k: v for k, v in p.model_dump(mode="json")[stage].items() if k not in NOT_IN_KEY}
    return {"stage": own, "model": p.model.model_dump(mode="json"),
            "data": p.data.model_dump(mode="json"), "seed": p.pipeline.seed, "engine": p.engine.model_dump(mode="json")}


def stage_keys(p: Params) -> dict[str, str]:
    """Keys of all four stages, each chained on its inputs' keys."""
    files = {"model": _file_fingerprint(p.model.path), "tokenizer": _file_fingerprint(p.model.tokenizer),
             **{k: _file_fingerprint(getattr(p.data, k).path) for k in ("sft", "preferences", "prompts")}}
    keys: dict[str, str] = {}
    for stage in STAGES:
        doc = {"params": stage_params(p, stage), "inputs": {s: keys[s] for s in INPUTS[stage]},
               "files": files, "code": code_version(stage)}
        keys[stage] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]
    return keys
