"""`hybrid-rlhf`: the command line.

Exit codes: 0 done; 2 a user's input error (one line on stderr; the traceback only with --debug);
1 anything else. Params and input files are checked before Prefect or torch start, so a typo costs
about a second.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from flows import settings

HEADLINE = {
    "sft": ("train_loss", "heldout_loss", "heldout_token_accuracy"),
    "reward": ("heldout_accuracy", "heldout_margin"),
    "ppo": ("reward_first", "reward_last", "kl_last"),
    "evaluate": ("sft_accuracy", "ppo_accuracy", "sft_reward", "ppo_reward"),
}


def summary_table(summary: dict) -> str:
    lines = [f"{'stage':<9} {'cached':<7} {'key':<21} headline metrics"]
    for stage, r in summary["stages"].items():
        shown = "  ".join(f"{k}={r['metrics'][k]:.4g}" for k in HEADLINE.get(stage, ()) if k in r["metrics"])
        lines.append(f"{stage:<9} {'yes' if r['cached'] else 'no':<7} {r['key']:<21} {shown}")
    ev = summary["stages"].get("evaluate", {}).get("metrics", {})
    if ev:
        lines.append(f"held-out prompts: {int(ev['prompts'])}; reward SFT {ev['sft_reward']:.3f} -> PPO "
                     f"{ev['ppo_reward']:.3f}" + (f"; task accuracy SFT {ev['sft_accuracy']:.1%} -> PPO "
                                                 f"{ev['ppo_accuracy']:.1%}" if "sft_accuracy" in ev else ""))
    lines.append(f"artifacts: {Path(next(iter(summary['stages'].values()))['artifact']).parent.parent}"
                 if summary["stages"] else "")
    if summary.get("mlflow_run_id"):
        lines.append(f"MLflow run: {summary['mlflow_run_id']}")
    return "\n".join(lines)


class _ShortInputErrors(logging.Filter):
    """Prefect logs a failing task's traceback; for a user's input error one line says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        from hybridcore.errors import InputError
        if record.exc_info and isinstance(record.exc_info[1], InputError):
            record.exc_info, record.exc_text = None, None
        return True


def cmd_run(args) -> int:
    from stages.checks import preflight
    from stages.params import load_params, parse_sets

    overrides = parse_sets(args.set or [])
    params = load_params(args.params, overrides)
    preflight(params)
    from flows.pipeline import rlhf  # Prefect, torch and MLflow load only now that the inputs are known good
    if not args.debug:
        for handler in logging.getLogger("prefect").handlers + logging.getLogger().handlers:
            handler.addFilter(_ShortInputErrors())
    t0 = time.time()
    summary = rlhf(preset=args.params, overrides=overrides or None)
    print(summary_table(summary))
    print(f"wall time: {time.time() - t0:.1f} s")
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybrid-rlhf", description="SFT -> reward model -> PPO, cached and tracked.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline on a params file")
    run.add_argument("params", help="a params YAML file, or a preset name in params/ (e.g. tiny)")
    run.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override one field (repeatable)")
    run.add_argument("--summary-json", metavar="PATH", help="write stages' artifacts, keys, cache status, metrics")
    run.add_argument("--debug", action="store_true", help="show full tracebacks")
    run.set_defaults(fn=cmd_run)
    return ap


def main(argv=None) -> int:
    settings.apply()
    args = parser().parse_args(argv)
    from hybridcore.errors import InputError
    try:
        return args.fn(args)
    except InputError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # anything else is our bug or the machine's: say what, and how to see more
        if args.debug:
            raise
        print(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
