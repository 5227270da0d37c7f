"""The artifact store: `<root>/<stage>/<key>/` folders written atomically and verified by hashes.

A stage writes into `<key>.partial/`; only when the model and the manifest (which lists every file's
sha256) are complete is the folder renamed to `<key>/`. A folder whose manifest does not verify is not
an artifact, so a crash can never hand a half-written model to the next stage.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST and CHECKPOINTS not in p.relative_to(folder).parts}


def artifact_dir(root: str | Path, stage: str, key: str) -> Path:
    return Path(root) / stage / key


def read_verified(folder: Path) -> Optional[dict]:
    """The manifest if every file it lists is present with its recorded hash, else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, dict) or not files:
        return None
    for rel, digest in files.items():
        p = folder / rel
        if not p.is_file() or sha256_file(p) != digest:
            return None
    return manifest


def staging_dir(root: str | Path, stage: str, key: str) -> Path:
    """The `<key>.partial/` folder a stage writes into. Step checkpoints of an earlier, interrupted attempt
    are kept (the stage resumes from them); anything else there is a half-written output and goes."""
    tmp = artifact_dir(root, stage, key).with_name(f"{key}.partial")
    tmp.mkdir(parents=True, exist_ok=True)
    for p in tmp.iterdir():
        if p.name != CHECKPOINTS:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return tmp


@contextlib.contextmanager
def stage_lock(root: str | Path, stage: str, key: str, wait_s: float = float("inf"), on_wait=None):
    """One writer per stage key across processes: `<key>.lock` held with flock, which the kernel releases
    when its holder dies, so a killed run never leaves a stale lock."""
    path = artifact_dir(root, stage, key).with_name(f"{key}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        t0, told = time.time(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() - t0 > wait_s:
                    raise TimeoutError(f"{stage} artifact {key} is being built by another run (lock {path})") from None
                if not told and on_wait is not None:
                    on_wait(path)
                    told = True
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def publish(tmp: Path, manifest: dict) -> Path:
    """Write the manifest (with every file's hash) and atomically rename `<key>.partial/` to `<key>/`.
    Step checkpoints are dropped first: the artifact is the finished model, not the training state."""
    shutil.rmtree(tmp / CHECKPOINTS, ignore_errors=True)
    manifest = dict(manifest, files=file_hashes(tmp), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    part = tmp / (MANIFEST + ".tmp")
    part.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    os.replace(part, tmp / MANIFEST)
    final = tmp.with_name(tmp.name.removesuffix(".partial"))
    if final.exists():  # an unverified leftover: move it aside first so the rename stays atomic
        stale = final.with_name(f"{final.name}.stale-{os.getpid()}")
        os.replace(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(tmp, final)
    return final
