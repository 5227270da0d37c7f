"""What every corpus case shares: a verified SFT artifact built once, and `refuse`, which runs one bad input
through the real check, asserts the one-line message and that the artifact still verifies."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from hybridcore.artifacts import read_verified
from hybridcore.errors import InputError
from stages.checks import preflight
from stages.params import deep_merge, load_params


@dataclass
class Built:
    root: Path          # pipeline.artifacts_dir of every corpus case
    artifact: Path      # <root>/sft/<key>/, built by run_stage on params/test.yaml
    manifest: dict      # what read_verified returned right after it was built


def refuse(built: Built, action: Callable[[], object], *expected: str) -> str:
    """`action` raises InputError whose message is one line holding every `expected` text; the artifact
    built before is still complete and verified. Returns the message."""
    with pytest.raises(InputError) as exc:
        action()
    msg = str(exc.value)
    assert msg.strip() and len(msg.splitlines()) == 1, repr(msg)
    for text in expected:
        assert text in msg, f"{text!r} not in {msg!r}"
    assert read_verified(built.artifact) == built.manifest, "a previously built artifact no longer verifies"
    return msg


def params_for(built: Built, overrides: dict | None = None, preset: str = "test"):
    """The micro preset writing into the corpus' artifact store, with `overrides` merged on."""
    return load_params(preset, deep_merge({"pipeline": {"artifacts_dir": str(built.root)}}, overrides or {}))


def check(built: Built, overrides: dict | None = None, preset: str = "test") -> Callable[[], None]:
    """The CLI's own order: load and validate the params, then the pre-flight checks."""
    return lambda: preflight(params_for(built, overrides, preset))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
