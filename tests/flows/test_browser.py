"""The MLflow UI served by `hybrid-rlhf ui`, in headless Chromium: the runs comparison page (the link that
`hybrid-rlhf compare` prints) shows both pipeline runs, their names, ids and the PPO params that differ."""
from __future__ import annotations

import contextlib
import html
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from PIL import Image

from flows.compare import compare_url

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--virtual-time-budget=15000", "--window-size=1400,900"]


def chromium(args: list[str], profile: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium in its own process group, which is killed afterwards by its id (the group we made)."""
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    assert os.path.exists(exe), "chromium is not installed (.ci/run installs it: apt-get install -y chromium)"
    proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def page_text(dom: str) -> str:
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", text)))


def test_compare_page_shows_both_runs(mlflow_ui, two_runs, tmp_path):
    """DOM: both run ids and names, the differing params' values; screenshot: a real, non-blank page."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{two_runs.workdir / 'mlruns' / 'mlflow.db'}")
    runs = [client.get_run(s["mlflow_run_id"]) for s in (two_runs.a, two_runs.b)]
    url = compare_url([r.info.run_id for r in runs], [r.info.experiment_id for r in runs], mlflow_ui.port)

    dom = chromium(["--dump-dom", url], tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = page_text(dom.stdout)
    assert "Comparing 2 Runs" in text, text[:2000]
    for r in runs:
        assert r.info.run_id in text, r.info.run_id
        assert r.info.run_name in text, r.info.run_name
    assert re.search(r"ppo\.iterations 40 3\b", text), text[:4000]
    assert re.search(r"ppo\.kl_coef 0\.2 0\.1\b", text), text[:4000]

    shot = tmp_path / "compare.png"
    proc = chromium([f"--screenshot={shot}", url], tmp_path / "profile-shot")
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 900)
    colours = image.getcolors(maxcolors=1 << 20)
    assert len(colours) > 200, "the screenshot is (nearly) blank"
    assert max(n for n, _ in colours) < 0.95 * 1400 * 900, "one colour fills the screenshot"
    keep = os.environ.get("HYBRID_RLHF_KEEP_SCREENSHOT")
    if keep:  # to look at it yourself
        shutil.copy(shot, keep)
