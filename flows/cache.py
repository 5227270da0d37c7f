"""`hybrid-rlhf cache ls | gc`: what the artifact store holds, and clearing what no run can use."""
from __future__ import annotations

import fcntl
import json
import shutil
import time
from pathlib import Path

from hybridcore.artifacts import read_verified
from stages.params import STAGES


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _locked(lock: Path) -> bool:
    """Is a live run holding this stage key's lock? (flock dies with its holder)."""
    if not lock.exists():
        return False
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def entries(root: Path) -> list[dict]:
    """Every folder under <root>/<stage>/: verified artifacts, partial (resumable) runs, broken leftovers."""
    rows = []
    for stage in STAGES:
        for folder in sorted((root / stage).glob("*")) if (root / stage).is_dir() else []:
            if not folder.is_dir():
                continue
            key, _, suffix = folder.name.partition(".")
            manifest = read_verified(folder) if not suffix else None
            status = "ok" if manifest else ("partial" if suffix == "partial" else "broken")
            own = manifest["params"]["stage"] if manifest else {}
            rows.append({"stage": stage, "key": key, "status": status, "path": folder, "bytes": _size(folder),
                         "created": manifest.get("created", "") if manifest else
                         time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(folder.stat().st_mtime)),
                         "mtime": folder.stat().st_mtime, "params": own,
                         "busy": _locked(folder.with_name(f"{key}.lock"))})
    return rows


def ls(root: Path) -> str:
    rows = entries(root)
    if not rows:
        return f"{root}: no artifacts"
    out = [f"{'stage':<9} {'key':<21} {'status':<8} {'size':>9}  {'created':<25} params"]
    for r in rows:
        params = json.dumps(r["params"], separators=(",", ":"))
        out.append(f"{r['stage']:<9} {r['key']:<21} {r['status'] + ('*' if r['busy'] else ''):<8} "
                   f"{_human(r['bytes']):>9}  {r['created']:<25} {params[:100] + ('...' if len(params) > 100 else '')}")
    total = sum(r["bytes"] for r in rows)
    out.append(f"{len(rows)} entries, {_human(total)} under {root} (* = a run is writing it now)")
    return "\n".join(out)


def gc(root: Path, older_than_days: float | None = None, partial: bool = False, dry_run: bool = False) -> list[Path]:
    """Remove broken leftovers; with `partial`, also interrupted runs' folders (their checkpoints: a rerun
    would start over); with `older_than_days`, also verified artifacts older than that. A folder a live run
    holds is never touched."""
    doomed = []
    now = time.time()
    for r in entries(root):
        if r["busy"]:
            continue
        old = older_than_days is not None and now - r["mtime"] > older_than_days * 86400
        if r["status"] == "broken" or (r["status"] == "partial" and partial) or old:
            doomed.append(r["path"])
    if not dry_run:
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
    return doomed
