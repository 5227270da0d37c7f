"""A user's own Python function, named in the params as "FILE.py:NAME" (evaluate.checker).

Naming the file is the user's consent to run it: it is imported in the stage's process, never by default. A
missing file, a syntax error or a missing name is an InputError found before any stage runs; its source is part
of the stage's cache key (an edited checker reruns the evaluation).
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Callable

from hybridcore.errors import InputError


def split(spec: str, field: str) -> tuple[Path, str]:
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise InputError(f"{field}: {spec!r} is not FILE.py:NAME (expected a Python file and a function in it, "
                         f"e.g. checks.py:is_correct)")
    p = Path(path)
    if p.suffix != ".py":
        raise InputError(f"{field}: {path} is not a .py file (expected FILE.py:NAME)")
    if not p.is_file():
        raise InputError(f"{field}: file {path} not found (expected FILE.py:NAME)")
    return p, name


def load(spec: str, field: str) -> Callable:
    """Import FILE.py and return its callable NAME."""
    p, name = split(spec, field)
    module_spec = importlib.util.spec_from_file_location(f"hybrid_rlhf_user_{p.stem}", p)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # a syntax error, an import it lacks: the user's file, named
        raise InputError(f"{field}: importing {p} failed ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = "is not callable" if hasattr(module, name) else "is not defined there"
        raise InputError(f"{field}: {name} {found} in {p} (expected a function NAME in FILE.py:NAME)")
    return fn


def fingerprint(spec: str | None) -> str | None:
    """The source's hash, for the cache key; None when no function is named."""
    if spec is None:
        return None
    p = Path(spec.rpartition(":")[0])
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "missing"
