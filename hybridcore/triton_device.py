"""Where the project's Triton kernels (sampling, decode attention, the NF4 decode, RMSNorm) can run: one rule."""
from __future__ import annotations

import os

import torch


def runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on `device`: CUDA, or any device under Triton's interpreter (TRITON_INTERPRET=1
    set before triton is first imported: the tests)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
