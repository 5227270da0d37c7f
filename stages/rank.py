"""One rank of a stage's torchrun job (started by stages/launch.py): `python -m stages.rank JOB_FILE`.

Every rank joins the process group of engine.layout and runs the stage function into the shared staging folder;
rank 0 alone exports the model, writes its step metrics to `launch/metrics.jsonl` (the parent forwards them to
its sink) and its final metrics to `launch/result.json`. A rank that fails writes `launch/error-rank-R.json`
(its error as one line, and when) so the parent can report the first failure rather than its echoes.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path


class FileSink:
    """Step metrics as JSON lines, flushed per step so the parent can forward them while the stage runs."""

    def __init__(self, path: Path):
        self.f = open(path, "a")

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, "metrics": {k: float(v) for k, v in metrics.items() if v is not None}}
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def kind_of(error: BaseException) -> tuple[str, int]:
    """(kind the parent re-raises as, this process's exit code): input 2, interrupted 130, fault/other 1."""
    from hybridcore.errors import InputError, TrainingFault
    from hybridcore.interrupts import Interrupted
    if isinstance(error, InputError):
        return "input", 2
    if isinstance(error, (Interrupted, KeyboardInterrupt)):
        return "interrupted", 130
    if isinstance(error, TrainingFault):
        return "fault", 1
    return "other", 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_file = Path(argv[0])
    job_dir = job_file.parent
    from hybridcore import parallel
    from hybridcore.errors import one_line
    rank, world, _ = parallel.env_world()
    sink, ok = None, False
    try:
        import torch

        from hybridcore.interrupts import install_handlers
        from stages.params import Params
        from stages.runner import NullSink

        job = json.loads(job_file.read_text())
        install_handlers()  # SIGTERM from the parent: checkpoint after this step, then stop
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        params = Params.model_validate(job["params"])
        parallel.init(params.engine.layout)
        sink = FileSink(job_dir / "metrics.jsonl") if rank == 0 else NullSink()
        module = importlib.import_module(f"stages.{job['stage']}")
        metrics = module.run(params, {k: Path(v) for k, v in job["inputs"].items()}, Path(job["out"]), sink)
        parallel.barrier()  # rank 0's export is complete before anyone reports success
        if rank == 0:
            part = job_dir / "result.json.tmp"
            part.write_text(json.dumps({k: float(v) for k, v in metrics.items() if v is not None}))
            part.replace(job_dir / "result.json")
        ok = True
        return 0
    except BaseException as e:  # noqa: BLE001 -- every failure is reported to the parent, then exits non-zero
        kind, code = kind_of(e)
        report = {"rank": rank, "world": world, "kind": kind, "type": type(e).__name__,
                  "message": one_line(str(e) or type(e).__name__), "time": time.time()}
        (job_dir / f"error-rank-{rank}.json").write_text(json.dumps(report))
        if kind in ("fault", "other"):  # into this rank's stderr log; an input error or a stop is its one line
            traceback.print_exc()
        return code
    finally:
        if sink is not None and hasattr(sink, "close"):
            sink.close()
        if ok:  # after a failure the peers may be gone or stuck in a collective: destroying the group could hang
            parallel.shutdown()


if __name__ == "__main__":
    code = main()
    if code:  # a failed rank leaves at once: tearing down a process group whose peers are gone can hang
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
