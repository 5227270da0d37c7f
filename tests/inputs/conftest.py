"""Session fixtures of the input corpus: one verified SFT artifact (the thing a bad input must not cost)
and one micro model folder that model cases copy and break."""
from __future__ import annotations

from pathlib import Path

import pytest

from hybridcore.artifacts import read_verified
from tests.inputs.helpers import Built


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Built:
    """SFT on params/test.yaml, run once by stages.runner.run_stage into a fresh artifact store (~5 s)."""
    from stages.keys import stage_keys
    from stages.params import load_params
    from stages.runner import run_stage

    root = tmp_path_factory.mktemp("artifacts")
    params = load_params("test", {"pipeline": {"artifacts_dir": str(root)}})
    result = run_stage(params, "sft", stage_keys(params))
    artifact = Path(result.artifact)
    manifest = read_verified(artifact)
    assert manifest is not None and not result.cached
    return Built(root, artifact, manifest)


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory):
    """A micro Llama folder (safetensors, config, tokenizer of 384 tokens) built without any training."""
    from hybridcore.models import build_preset, save_model, train_tokenizer
    from stages import data
    from stages.params import load_params

    tok = train_tokenizer(data.corpus(load_params("test")), 384)
    folder = tmp_path_factory.mktemp("micro") / "model"
    save_model(build_preset("micro", tok, seed=0), tok, folder)
    return folder
