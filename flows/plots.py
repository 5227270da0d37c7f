"""PNG curves of one stage run's metric histories, logged as artifacts so a run can be judged at a glance.

Uses matplotlib's Figure directly (no pyplot): no display, no global state, safe in Prefect's threads.
"""
from __future__ import annotations

from pathlib import Path

Curves = dict[str, list[tuple[int, float]]]   # metric -> [(step, value)]

# file name -> (metrics drawn together, y label, stacked)
PANELS = {
    "loss": (("loss", "value_loss"), "loss", False),
    "reward": (("reward",), "RM score of the response", False),
    "kl": (("kl",), "KL to the reference (per response)", False),
    "response_length": (("response_length",), "tokens", False),
    "accuracy": (("accuracy",), "pairwise accuracy", False),
    "entropy": (("entropy",), "nats per token", False),
    "lr": (("lr",), "learning rate", False),
    "grad_norm": (("grad_norm",), "gradient norm", False),
    "tokens_per_s": (("tokens_per_s",), "tokens/s", False),
    "step_time": (("step_s",), "seconds per step", False),
    "time_split": (("rollout_s", "scoring_s", "update_s"), "seconds per iteration", True),
}


def memory_metrics(names) -> tuple[str, ...]:
    return tuple(sorted(n for n in names if n == "rss_mib" or (n.startswith("peak_") and n.endswith("_mib"))))


def draw(curves: Curves, names: tuple[str, ...], title: str, ylabel: str, path: Path, stacked: bool) -> bool:
    """One PNG with the named curves that have at least two points; False if none has."""
    from matplotlib.figure import Figure

    shown = [n for n in names if len(curves.get(n, ())) >= 2]
    if not shown:
        return False
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.subplots()
    if stacked:
        steps = [s for s, _ in sorted(curves[shown[0]])]
        ys = [[dict(curves[n]).get(s, 0.0) for s in steps] for n in shown]
        ax.stackplot(steps, ys, labels=shown, alpha=0.8)
    else:
        for n in shown:
            pts = sorted(curves[n])
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=n, linewidth=1.2)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(shown) > 1:
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    return True


def stage_plots(curves: Curves, stage: str, out: Path) -> list[Path]:
    """Every panel the stage's metrics can fill, plus memory; returns the PNGs written."""
    out.mkdir(parents=True, exist_ok=True)
    panels = dict(PANELS, memory=(memory_metrics(curves), "MiB", False))
    written = []
    for name, (names, ylabel, stacked) in panels.items():
        path = out / f"{name}.png"
        if draw(curves, names, f"{stage}: {name.replace('_', ' ')}", ylabel, path, stacked):
            written.append(path)
    return written


def wanted(names) -> set[str]:
    """The metric names stage_plots can draw, out of `names`."""
    return {n for names_, _, _ in PANELS.values() for n in names_} & set(names) | set(memory_metrics(names))
