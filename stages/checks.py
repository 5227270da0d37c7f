"""Checks that run before any heavy work: a mistake in the inputs should cost seconds, not a stage."""
from __future__ import annotations

from pathlib import Path

from hybridcore.errors import InputError
from hybridcore.models import check_model_folder
from stages import data
from stages.params import Params


def preflight(p: Params) -> None:
    """Model and tokenizer folders exist and hold safetensors; users' data files load with their columns."""
    if p.model.path is not None:
        check_model_folder(p.model.path, "model.path")
    if p.model.tokenizer is not None and not Path(p.model.tokenizer).is_dir():
        raise InputError(f"model.tokenizer: folder {p.model.tokenizer} not found (expected a tokenizer folder)")
    for kind in data.COLUMNS:
        path = getattr(p.data, kind).path
        if path is not None:
            data.read_table(path, kind)
