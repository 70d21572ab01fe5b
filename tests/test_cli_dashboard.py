"""`trainbox dashboard RUN`: a finished run's dashboard, served from its files by the live run's server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
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


def _serve(run_dir, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`trainbox dashboard RUN --port 0 ARGS` -> (the process, its first line: the URL, or '' when it exited)."""
    proc = subprocess.Popen([sys.executable, "-m", "trainbox", "dashboard", str(run_dir), "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return proc, proc.stdout.readline()


def _stop(proc: subprocess.Popen) -> str:
    """End the dashboard (it serves until stopped); -> its stderr."""
    if proc.poll() is None:
        proc.terminate()
    proc.wait(timeout=10)
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    return err


def _request(url: str, headers: dict | None = None) -> tuple[int, dict]:
    """GET `url` without following a redirect -> (status, headers)."""
    class Keep(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args):
            return None

    try:
        with urllib.request.build_opener(Keep).open(urllib.request.Request(url, headers=headers or {}),
                                                    timeout=10) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def test_dashboard_of_a_token_protected_run_asks_for_a_token(tiny, tmp_path):
    """A run trained with monitor.token (config.yaml holds it masked) is served only with a token, on loopback as on
    every interface; the token given (TRAINBOX_OVERRIDES' monitor.token, as for `trainbox train`, or --token) guards
    every endpoint but /health as the live server's does."""
    train(load_config("tiny", [*tiny, "run.name=guarded", "train.max_steps=2", "monitor.token=run-secret"]))
    run_dir = tmp_path / "runs" / "guarded"
    assert "run-secret" not in (run_dir / "config.yaml").read_text()
    for host in ("127.0.0.1", "0.0.0.0"):
        proc, line = _serve(run_dir, "--host", host)
        err = _stop(proc)
        assert line == "" and proc.returncode == 2, f"served without a token on {host}: {line}"
        assert "trained with monitor.token" in err and "TRAINBOX_OVERRIDES='monitor.token=TOKEN'" in err, err

    proc, line = _serve(run_dir, env={"TRAINBOX_OVERRIDES": "monitor.token=served-secret"})
    try:
        assert "http://" in line and "token required" in line and "served-secret" not in line, line
        url = line[line.index("http://"):].split()[0].rstrip("/")
        assert _request(url + "/health")[0] == 200
        for path in ("/status", "/metrics", "/history", "/"):
            assert _request(url + path)[0] == 401, path
            assert _request(url + path, {"Authorization": "Bearer run-secret"})[0] == 401, path
            assert _request(url + path, {"Authorization": "Bearer served-secret"})[0] == 200, path
        status = json.loads(urllib.request.urlopen(urllib.request.Request(
            url + "/status", headers={"Authorization": "Bearer served-secret"}), timeout=10).read())
        assert status["phase"] == "finished" and status["step"] == 2
        code, headers = _request(url + "/?token=served-secret")   # a browser: the cookie, and the token dropped
        assert code == 303 and headers["Location"] == "/" and "HttpOnly" in headers["Set-Cookie"]
        cookie = headers["Set-Cookie"].split(";")[0]
        assert _request(url + "/status", {"Cookie": cookie})[0] == 200
    finally:
        _stop(proc)

    proc, line = _serve(run_dir, "--token", "flag-secret")
    try:
        url = line[line.index("http://"):].split()[0].rstrip("/")
        assert _request(url + "/status")[0] == 401
        assert _request(url + "/status", {"Authorization": "Bearer flag-secret"})[0] == 200
    finally:
        _stop(proc)
