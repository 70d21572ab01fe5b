"""`trainbox dashboard RUN`: a finished run's dashboard, served from its files by the live run's server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

from conftest import run_cli

from trainbox.config import load_config
from trainbox.train.loop import train


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read()


def test_dashboard_serves_a_finished_run(tiny, tmp_path):
    train(load_config("tiny", [*tiny, "run.name=done", "train.max_steps=3", "train.eval_every=2"]))
    run_dir = tmp_path / "runs" / "done"
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_losses = {e["step"]: e["loss"] for e in events if e.get("event") == "train"}
    val_losses = {e["step"]: e["val_loss"] for e in events if e.get("event") == "eval"}
    assert sorted(train_losses) == [1, 2, 3] and val_losses

    proc = subprocess.Popen([sys.executable, "-m", "trainbox", "dashboard", str(run_dir), "--port", "0"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert "http://" in line, line + proc.stderr.read() if proc.poll() is not None else line
        url = line[line.index("http://"):].split()[0].rstrip("/")
        status = json.loads(_get(url + "/status"))
        assert status["phase"] == "finished" and status["step"] == 3 and status["total_steps"] == 3
        assert status["healthy"] and status["loss"] == train_losses[3] and status["run_name"] == "done"
        history = json.loads(_get(url + "/history"))
        assert {p["step"]: p["loss"] for p in history if "loss" in p} == train_losses
        assert {p["step"]: p["val_loss"] for p in history if "val_loss" in p} == val_losses
        assert [p["step"] for p in json.loads(_get(url + "/history?since=3"))] == [3] * (1 + (3 in val_losses))
        page = _get(url + "/").decode()
        assert page.lstrip().lower().startswith("<!doctype html") and "/history" in page
        assert json.loads(_get(url + "/metrics"))["current_step"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def test_dashboard_of_a_missing_run_is_an_error(tmp_path):
    proc = run_cli("dashboard", "nope", "--root", str(tmp_path), check=False)
    assert proc.returncode != 0 and "no run 'nope'" in proc.stderr
