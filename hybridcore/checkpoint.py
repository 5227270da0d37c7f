"""Step checkpoints for exact resume: `<work>/checkpoints/step-N/`, written atomically, verified by
sha256 before use, the newest K kept.

Weights go to safetensors; optimizer, schedule and torch RNG states to a torch file that is loaded with
weights_only=True and only after its hash verifies (a DeepSpeed engine writes its own shards, in its own
format, into a sub-folder: also loaded only after the hashes verify); python/numpy RNG and the loop's own state (step,
loss history, counters) to JSON. A corrupt or truncated checkpoint is reported in one line and the
previous one is used.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from hybridcore import parallel
from hybridcore.artifacts import file_hashes, sha256_file
from hybridcore.errors import TrainingFault
from hybridcore.interrupts import fault_active, fault_point

log = logging.getLogger("hybridcore.checkpoint")
MANIFEST = "checkpoint.json"


class CheckpointWriteError(TrainingFault):
    """A step checkpoint could not be written (disk full, permissions); the previous ones are untouched."""


def _rng_state() -> dict:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}


def _set_rng_state(s: dict) -> None:
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = s["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))


class Checkpointer:
    def __init__(self, work_dir: Path, stage: str, every: int, keep: int):
        self.root = Path(work_dir) / "checkpoints"
        self.stage, self.every, self.keep = stage, every, keep

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, models: dict, stateful: dict, state: dict, engines: Optional[dict] = None) -> Path:
        """models: name -> nn.Module; stateful: name -> object with state_dict() (optimizers, schedules);
        state: JSON-able loop state; engines: name -> an Engine that owns its weights (save(folder)/load(folder)).
        Everything goes to a temp folder that is renamed only when complete, so a
        failed write (a full disk) leaves the previous checkpoints as they were; it raises CheckpointWriteError."""
        # several ranks: DeepSpeed's save is collective (each rank writes its shard), rank 0 does the rest
        main = parallel.is_main()
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{step}"
        tmp = self.root / f".step-{step}.tmp"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            if main:
                tmp.mkdir()
            parallel.barrier()
            self._write(tmp, step, models, stateful, state, engines or {}, main)
        except Exception as e:  # ENOSPC shows up as OSError, or as RuntimeError from torch.save's writer
            shutil.rmtree(tmp, ignore_errors=True)
            kept, why = self.latest(), getattr(e, "strerror", None) or e
            raise CheckpointWriteError(
                f"{self.stage}: could not write checkpoint step-{step} in {self.root} ({why}); "
                + (f"{kept.name} is intact and a rerun resumes from it" if kept else "no earlier checkpoint exists")
                + " -- free disk space and run again") from e
        if main:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        parallel.barrier()
        return final

    def _write(self, tmp: Path, step: int, models: dict, stateful: dict, state: dict, engines: dict,
               main: bool = True) -> None:
        for name, model in models.items():
            if main:
                save_model(model, str(tmp / f"{name}.safetensors"))
        for name, engine in engines.items():
            engine.save(tmp / name)
        fault_point(self.stage, "checkpoint", step)
        parallel.barrier()  # every rank's shard is on disk before rank 0 hashes them
        if not main:
            return
        if fault_active(self.stage, "enospc", step):  # a disk that fills up halfway through the write
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "state.pt"))
        torch.save({"stateful": {k: v.state_dict() for k, v in stateful.items()},
                    "torch_rng": torch.get_rng_state()}, tmp / "state.pt")
        (tmp / "loop.json").write_text(json.dumps({"step": step, "state": state, "rng": _rng_state()}))
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": file_hashes(tmp)}))

    def _prune(self) -> None:
        steps = sorted(self._steps(), reverse=True)
        for step in steps[self.keep:]:
            shutil.rmtree(self.root / f"step-{step}", ignore_errors=True)

    def _steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return [int(p.name.split("-", 1)[1]) for p in self.root.iterdir()
                if p.is_dir() and p.name.startswith("step-") and p.name.split("-", 1)[1].isdigit()]

    def verify(self, folder: Path) -> Optional[str]:
        """None if every file matches its recorded hash, else what is wrong."""
        try:
            files = json.loads((folder / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{MANIFEST} missing or unreadable"
        if not isinstance(files, dict) or not files:
            return f"{MANIFEST} lists no files"
        for rel, digest in files.items():
            p = folder / rel
            if not p.is_file():
                return f"{rel} is missing"
            if sha256_file(p) != digest:
                return f"{rel} does not match its hash (truncated or modified)"
        return None

    def latest(self) -> Optional[Path]:
        """The newest checkpoint that verifies; corrupt ones are reported and passed over."""
        for step in sorted(self._steps(), reverse=True):
            folder = self.root / f"step-{step}"
            problem = self.verify(folder)
            if problem is None:
                return folder
            log.warning("%s: checkpoint %s is unusable (%s); trying the previous one", self.stage, folder, problem)
        return None

    def load(self, folder: Path, models: dict, stateful: dict, engines: Optional[dict] = None) -> tuple[int, dict]:
        """Restore weights, optimizer/schedule and RNG states; returns (step, loop state)."""
        for name, model in models.items():
            load_model(model, str(folder / f"{name}.safetensors"))
        for name, engine in (engines or {}).items():
            engine.load(folder / name)
        blob = torch.load(folder / "state.pt", weights_only=True)
        for k, v in stateful.items():
            v.load_state_dict(blob["stateful"][k])
        torch.set_rng_state(blob["torch_rng"])
        loop = json.loads((folder / "loop.json").read_text())
        _set_rng_state(loop["rng"])
        return loop["step"], loop["state"]
