"""Console: a redrawn progress bar on a TTY; plain log lines every monitor.log_every without one."""
from __future__ import annotations

import os
import pty
import re
import subprocess
import sys

from conftest import run_cli


def test_plain_lines_without_tty(tmp_path, tiny):
    proc = run_cli("train", "tiny", *tiny, "train.max_steps=6", "monitor.log_every=2", "train.eval_every=0",
                   cwd=tmp_path)
    steps = re.findall(r"step (\d+)/6 loss [\d.]+ .*tok/s [\d,]+ eta", proc.stderr)
    assert steps == ["2", "4", "6"], proc.stderr
    assert "\r" not in proc.stderr


def test_progress_bar_on_tty(tmp_path, tiny):
    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", "trainbox", "train", "tiny", *tiny, "train.max_steps=6", "train.eval_every=0"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(master)
    tty = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, tty
    assert re.search(r"\r\[#+\] 6/6 loss [\d.]+ tok/s [\d.]+k eta 00:00", tty), tty
    assert not re.search(r"\d \bstep \d+/6 loss", tty)  # step lines go to train.log, not over the bar
    log = (tmp_path / "runs" / "tiny" / "train.log").read_text()
    assert "step 6/6 loss" in log and "\r" not in log
