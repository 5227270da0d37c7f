"""Offline, project-local settings for Prefect and MLflow, applied before either is imported.

The package sets these itself so that a user never has to: telemetry off (these machines have no
internet, and nothing should phone home), Prefect's SQLite database and results inside the project,
and a start-up timeout long enough for the ephemeral server on 2 cores. A user's own environment
variables win.
"""
from __future__ import annotations

import os
from pathlib import Path


def apply(workdir: str | Path | None = None) -> None:
    home = Path(workdir or os.getcwd()).resolve()
    defaults = {
        "PREFECT_HOME": str(home / ".prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
