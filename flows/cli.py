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
from stages.params import STAGES

HEADLINE = {
    "sft": ("train_loss", "heldout_loss", "heldout_token_accuracy"),
    "reward": ("heldout_accuracy", "heldout_margin"),
    "ppo": ("reward_first", "reward_last", "kl_last"),
    "dpo": ("heldout_accuracy", "heldout_margin"),
    "evaluate": tuple(f"{who}_{what}" for what in ("accuracy", "exact_match", "reward") for who in ("sft", "ppo", "dpo")),
}


def policy_of(ev: dict) -> str:
    """The trained policy an evaluation compared with SFT (its metrics are named after it)."""
    return next((name for name in ("ppo", "dpo") if f"{name}_ended" in ev), "ppo")


def summary_table(summary: dict) -> str:
    lines = [f"{'stage':<9} {'cached':<7} {'key':<21} headline metrics"]
    for stage, r in summary["stages"].items():
        shown = "  ".join(f"{k}={r['metrics'][k]:.4g}" for k in HEADLINE.get(stage, ()) if k in r["metrics"])
        lines.append(f"{stage:<9} {'yes' if r['cached'] else 'no':<7} {r['key']:<21} {shown}")
    ev = summary["stages"].get("evaluate", {}).get("metrics", {})
    if ev:
        name = policy_of(ev)
        parts = [f"{label} SFT {ev[f'sft_{what}']:{fmt}} -> {name.upper()} {ev[f'{name}_{what}']:{fmt}}"
                 for what, label, fmt in (("reward", "reward", ".3f"), ("accuracy", "task accuracy", ".1%"))
                 if f"sft_{what}" in ev]
        lines.append("; ".join([f"held-out prompts: {int(ev['prompts'])}", *parts]))
    lines += warnings(summary)
    lines.append(f"artifacts: {Path(next(iter(summary['stages'].values()))['artifact']).parent.parent}"
                 if summary["stages"] else "")
    if summary.get("mlflow_run_id"):
        lines.append(f"MLflow run: {summary['mlflow_run_id']}")
    return "\n".join(lines)


def warnings(summary: dict) -> list[str]:
    """What the run got wrong quietly: rollouts or answers cut at max_new_tokens before they ended."""
    out = []
    ppo = summary["stages"].get("ppo", {}).get("metrics", {})
    if ppo.get("truncated_iterations", 0) > 0:
        out.append(f"warning: ppo: {int(ppo['truncated_iterations'])} of {int(ppo['steps'])} iterations cut more "
                   f"than 10% of their responses at max_new_tokens={int(ppo['max_new_tokens'])} (last tenth: "
                   f"{ppo['truncated_fraction_last']:.0%}); the reward scored unfinished text: raise "
                   f"ppo.max_new_tokens")
    ev = summary["stages"].get("evaluate", {}).get("metrics", {})
    for name in ("sft", "ppo", "dpo"):
        if ev.get(f"{name}_ended", 1.0) < 0.9:
            out.append(f"warning: evaluate: only {ev[f'{name}_ended']:.0%} of {name.upper()}'s answers ended within "
                       f"max_new_tokens={int(ev['max_new_tokens'])}: raise evaluate.max_new_tokens")
    return out


class _ShortInputErrors(logging.Filter):
    """Prefect logs a failing task's traceback and repeats its message in state lines; for a user's input
    error, a requested stop or a fault the stage detected itself, the CLI's own one line says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        ours = _our_errors()
        if record.exc_info and isinstance(record.exc_info[1], ours):
            record.exc_info, record.exc_text = None, None
        if record.name.startswith("prefect"):
            message = record.getMessage()
            if any(f"{cls.__name__}:" in message or f"{cls.__name__}(" in message for cls in _subclasses(ours)):
                return False  # "Task run 'sft' - Finished in state Failed('... NonFinite: ...')" and the like
        return True


def _our_errors() -> tuple[type, ...]:
    from hybridcore.errors import InputError, TrainingFault
    from hybridcore.interrupts import Interrupted
    return InputError, Interrupted, TrainingFault


def _subclasses(roots) -> set[type]:
    seen, todo = set(), list(roots)
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            todo.extend(cls.__subclasses__())
    return seen


def cmd_run(args) -> int:
    from stages.checks import preflight
    from stages.params import load_params, parse_sets

    from hybridcore.interrupts import install_handlers

    overrides = parse_sets(args.set or [])
    if args.no_cache:
        args.force_stage = list(STAGES)
    params = load_params(args.params, overrides)
    from flows.server import api_server
    t0 = time.time()
    with api_server(meanwhile=lambda: preflight(params)):  # the checks (and their imports) while Prefect starts
        from flows.pipeline import rlhf
        if not args.debug:
            for handler in logging.getLogger("prefect").handlers + logging.getLogger().handlers:
                handler.addFilter(_ShortInputErrors())
        install_handlers()
        summary = rlhf(preset=args.params, overrides=overrides or None, force=args.force_stage or None)
    print(summary_table(summary))
    print(f"wall time: {time.time() - t0:.1f} s")
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    return 0


def cmd_ui(args) -> int:
    from flows.ui import serve
    return serve(Path(args.store), args.port)


def cmd_compare(args) -> int:
    from flows.compare import compare
    print(compare(Path(args.store), args.run_a, args.run_b, HEADLINE, all_metrics=args.all))
    return 0


def cmd_cache(args) -> int:
    from flows import cache
    root = Path(args.artifacts_dir)
    if args.action == "ls":
        print(cache.ls(root))
        return 0
    removed = cache.gc(root, args.older_than_days, args.partial, args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print("\n".join(f"{verb} {p}" for p in removed) or "nothing to remove")
    return 0


def cmd_example_data(args) -> int:
    from stages import example_files
    from stages.params import load_params
    paths = example_files.write(Path(args.out), load_params(args.params), args.conversational)
    for kind, path in paths.items():
        print(f"data.{kind}.path: {path}")
    print(f"ppo.reward_function: {Path(args.out) / 'reward.py'}:correct   (a verifier of the answers: critic-free "
          f"RL without a reward model)")
    return 0


def cmd_serve(args) -> int:
    from flows.serve import serve
    return serve(args.port)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybrid-rlhf", description="SFT -> reward model -> PPO, cached and tracked.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline on a params file")
    run.add_argument("params", help="a params YAML file, or a preset name in params/ (e.g. tiny)")
    run.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override one field (repeatable)")
    run.add_argument("--summary-json", metavar="PATH", help="write stages' artifacts, keys, cache status, metrics")
    run.add_argument("--force-stage", action="append", metavar="STAGE", choices=list(STAGES),
                     help="run this stage even if its artifact is cached (repeatable)")
    run.add_argument("--no-cache", action="store_true", help="run every stage, ignoring cached artifacts")
    run.add_argument("--debug", action="store_true", help="show full tracebacks")
    run.set_defaults(fn=cmd_run)
    ui = sub.add_parser("ui", help="serve the MLflow UI over mlruns/ on 127.0.0.1 (Ctrl-C stops it)")
    ui.add_argument("--port", type=int, default=5000, help="port on 127.0.0.1 (0: any free one; default 5000)")
    ui.add_argument("--store", default="mlruns", help="the folder holding mlflow.db and artifacts/ (default mlruns)")
    ui.add_argument("--debug", action="store_true", help="show full tracebacks")
    ui.set_defaults(fn=cmd_ui)
    cmp = sub.add_parser("compare", help="params that differ and headline metrics of two pipeline runs")
    cmp.add_argument("run_a", metavar="RUN_A", help="an MLflow pipeline (parent) run id")
    cmp.add_argument("run_b", metavar="RUN_B", help="another one")
    cmp.add_argument("--store", default="mlruns", help="the folder holding mlflow.db (default mlruns)")
    cmp.add_argument("--all", action="store_true", help="every metric of the parent runs, not only the headline")
    cmp.add_argument("--debug", action="store_true", help="show full tracebacks")
    cmp.set_defaults(fn=cmd_compare)
    cache = sub.add_parser("cache", help="list or clean the artifact store")
    cache.add_argument("action", choices=["ls", "gc"])
    cache.add_argument("--artifacts-dir", default="artifacts", help="the store (pipeline.artifacts_dir)")
    cache.add_argument("--older-than-days", type=float, help="gc: also remove verified artifacts older than this")
    cache.add_argument("--partial", action="store_true", help="gc: also remove interrupted runs' checkpoints")
    cache.add_argument("--dry-run", action="store_true", help="gc: only list what would go")
    cache.add_argument("--debug", action="store_true", help="show full tracebacks")
    cache.set_defaults(fn=cmd_cache)
    ex = sub.add_parser("example-data", help="write the built-in task as users' files (sft, preferences, prompts "
                                             "JSONL), standard or conversational: examples of each format")
    ex.add_argument("out", help="folder to write sft.jsonl, preferences.jsonl and prompts.jsonl into")
    ex.add_argument("--conversational", action="store_true", help="chat turns (TRL's conversational format)")
    ex.add_argument("--params", default="tiny", help="the params whose data.synthetic settings to use (default tiny)")
    ex.add_argument("--debug", action="store_true", help="show full tracebacks")
    ex.set_defaults(fn=cmd_example_data)
    serve = sub.add_parser("serve", help="Prefect server on 127.0.0.1 + one deployment per params preset")
    serve.add_argument("--port", type=int, default=4200)
    serve.add_argument("--debug", action="store_true", help="show full tracebacks")
    serve.set_defaults(fn=cmd_serve)
    return ap


def main(argv=None) -> int:
    settings.apply()
    args = parser().parse_args(argv)
    from hybridcore.errors import InputError, TrainingFault, say
    from hybridcore.interrupts import Interrupted
    try:
        return args.fn(args)
    except InputError as e:
        if args.debug:
            raise
        say(f"error: {e}")
        return 2
    except (KeyboardInterrupt, Interrupted) as e:
        say(f"interrupted: {e or 'by the user'}")
        return 130
    except TrainingFault as e:  # NaN/inf, a checkpoint that could not be written: what happened, what was kept
        if args.debug:
            raise
        say(f"error: {e}")
        return 1
    except Exception as e:  # anything else is our bug or the machine's: say what, and how to see more
        if args.debug:
            raise
        say(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
