"""Prefect flows: the `rlhf` pipeline flow, its stage tasks and cache policy, MLflow wiring, the CLI."""
from flows import settings as _settings

_settings.apply()


def __getattr__(name):
    """`from flows import rlhf` without importing Prefect when only the CLI's argument parsing is needed."""
    if name == "rlhf":
        from flows.pipeline import rlhf
        return rlhf
    raise AttributeError(name)
