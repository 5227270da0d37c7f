"""The artifact store: `<root>/<stage>/<key>/` folders written atomically and verified by hashes.

A stage writes into `<key>.partial/`; only when the model and the manifest (which lists every file's
sha256) are complete is the folder renamed to `<key>/`. A folder whose manifest does not verify is not
an artifact, so a crash can never hand a half-written model to the next stage.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST and "checkpoints" not in p.relative_to(folder).parts}


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
    """A fresh `<key>.partial/` folder to write the stage's output into."""
    tmp = artifact_dir(root, stage, key).with_name(f"{key}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, manifest: dict) -> Path:
    """Write the manifest (with every file's hash) and atomically rename `<key>.partial/` to `<key>/`."""
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
