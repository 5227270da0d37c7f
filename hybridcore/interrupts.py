"""Stopping a stage: gracefully on request (SIGTERM, Ctrl-C), or abruptly where a test injects a fault.

A stop request only sets a flag; training loops check it after each step, write a checkpoint and
raise `Interrupted`, so a stopped run resumes exactly. `HYBRID_RLHF_FAULT="<stage>:<step>"` makes the
process SIGKILL itself just before that step (`<stage>:checkpoint:<step>` halfway through writing that
step's checkpoint, `<stage>:term:<step>` sends SIGTERM instead): the kill tests use it to stop at chosen points without timing races.
`<stage>:oom:<step>` raises torch.OutOfMemoryError once inside that step (hybridcore/oom.py backs off from it;
in PPO `ppo:oom:<step>` hits the actor's update, `ppo:critic:oom:<step>` the critic's; in DPO `dpo:oom:<step>` a
training step, `dpo:reference:oom:<chunk>` the reference log-probs' pass over a chunk of 256 pairs).
`<stage>:raise:<step>` raises InjectedFault there; `<stage>:nan:<step>` makes that step's loss (PPO: a reward)
non-finite; `<stage>:enospc:<step>` fails that checkpoint's write halfway, as a full disk would. Every hook is
one of fault_point / fault_active / oom_point below; no other code reads the variable. `HYBRID_RLHF_FAULT_RANK=R` restricts every fault to the process
whose RANK is R (one failing rank of a torchrun job).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

FAULT_ENV = "HYBRID_RLHF_FAULT"
FAULT_RANK_ENV = "HYBRID_RLHF_FAULT_RANK"
_stop = threading.Event()


class Interrupted(Exception):
    """A stage stopped on request after writing a checkpoint; running again resumes it."""


class InjectedFault(RuntimeError):
    """An error raised on purpose by a test (HYBRID_RLHF_FAULT="<stage>:raise:<step>")."""


def request_stop(*_) -> None:
    _stop.set()


def stop_requested() -> bool:
    return _stop.is_set()


def clear_stop() -> None:
    _stop.clear()


def _on_int(signum, frame):
    if _stop.is_set():  # a second Ctrl-C: stop now
        raise KeyboardInterrupt
    _stop.set()


def install_handlers() -> None:
    """SIGTERM and SIGINT ask for a graceful stop; a second Ctrl-C interrupts at once."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, _on_int)


@contextlib.contextmanager
def graceful_stop():
    """While a stage trains, SIGTERM/SIGINT only set the stop flag (the loop checkpoints, then raises
    Interrupted), whatever handlers an orchestrator installed around it; those come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    install_handlers()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])


def fault_point(stage: str, *where) -> None:
    """SIGKILL this process if HYBRID_RLHF_FAULT names this point (e.g. "sft:7"); SIGTERM it for
    "<stage>:term:<step>", as an orchestrator cancelling the run would."""
    if fault_active(stage, *where):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault_active(stage, "term", *where):
        os.kill(os.getpid(), signal.SIGTERM)
    if fault_active(stage, "raise", *where):
        raise InjectedFault(f"injected fault at {stage} step {':'.join(map(str, where))} "
                            f"(rank {os.environ.get('RANK', 0)})")


def fault_active(*where) -> bool:
    """True if HYBRID_RLHF_FAULT names this point (for faults other than a kill, e.g. "sft:nan:5")."""
    if os.environ.get(FAULT_RANK_ENV) not in (None, os.environ.get("RANK", "0")):
        return False
    return os.environ.get(FAULT_ENV) == ":".join(str(w) for w in where)


def oom_point(stage: str, step: int) -> None:
    """Raise torch.OutOfMemoryError if HYBRID_RLHF_FAULT is "<stage>:oom:<step>", as a full accelerator would."""
    if fault_active(stage, "oom", step):
        import torch

        raise torch.OutOfMemoryError(f"injected out-of-memory error ({FAULT_ENV}={stage}:oom:{step})")
