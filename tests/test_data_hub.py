"""Downloads against a local HTTP server that answers the hub's resolve URLs (HF_ENDPOINT): `trainbox data
fineweb` (download, skip complete files, header/size verification, resuming a download killed half-way) and
`trainbox train` with data.source (exactly the shards its steps read, a dropped connection resumed by Range,
a top-up for a longer run, a refused connection failing fast without leaving a folder, data.download=false)."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from conftest import TINY, run_cli

PREFIX = "/datasets/kjj0/fineweb10B-gpt2/resolve/main/"


def shard_bytes(n: int, seed: int) -> bytes:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, n)
    return header.tobytes() + np.random.default_rng(seed).integers(0, 50257, n).astype(np.uint16).tobytes()


class Hub:
    """Serves `files`; logs (method, name, Range) and the Authorization headers; `stall[name] = k` sends k bytes
    of the next GET then waits; `drop[name] = k` sends k bytes of it then closes the connection; `rate[name] = r`
    sends it at r bytes a second (in 16 KiB pieces)."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.log, self.stall, self.release = files, [], {}, threading.Event()
        self.drop, self.auth, self.rate = {}, [], {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _head(self, name):
                data = hub.files.get(name)
                rng = self.headers.get("Range")
                hub.log.append((self.command, name, rng))
                hub.auth.append(self.headers.get("Authorization"))
                if data is None:
                    self.send_error(404)
                    return None, 0
                start = int(rng.split("=")[1].split("-")[0]) if rng else 0
                self.send_response(206 if rng else 200)
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("ETag", f'"{hash(data) & 0xffffffff:08x}"')
                self.send_header("X-Repo-Commit", "0" * 40)
                self.send_header("Accept-Ranges", "bytes")
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                return data, start

            def do_HEAD(self):
                self._head(self.path.removeprefix(PREFIX))

            def do_GET(self):
                name = self.path.removeprefix(PREFIX)
                data, start = self._head(name)
                if data is None:
                    return
                cut = hub.stall.pop(name, None)
                try:
                    if name in hub.drop:
                        self.wfile.write(data[start:hub.drop.pop(name)])
                        return
                    if cut is not None:
                        self.wfile.write(data[start:cut])
                        self.wfile.flush()
                        hub.release.wait(60)
                        return
                    piece = 16 << 10 if name in hub.rate else max(len(data), 1)
                    for at in range(start, len(data), piece):
                        self.wfile.write(data[at:at + piece])
                        if name in hub.rate:
                            self.wfile.flush()
                            time.sleep(piece / hub.rate[name])
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gets(self):
        return [(n, r) for m, n, r in self.log if m == "GET"]


@pytest.fixture
def hub():
    h = Hub({"fineweb_val_000000.bin": shard_bytes(3000, 0), "fineweb_train_000001.bin": shard_bytes(5000, 1),
             "fineweb_train_000002.bin": shard_bytes(4000, 2)})
    yield h
    h.release.set()
    h.server.shutdown()


def env(hub):
    return {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}


def test_download_skip_and_verify(hub, tmp_path):
    out = tmp_path / "fw"
    p = run_cli("data", "fineweb", "--shards", "2", "--out", str(out), env=env(hub))
    for name, data in hub.files.items():
        assert (out / name).read_bytes() == data
        assert f"{name}: downloaded" in p.stdout
    assert sorted(n for n, _ in hub.gets()) == sorted(hub.files)
    hub.log.clear()
    (out / "fineweb_train_000002.bin").write_bytes(hub.files["fineweb_train_000002.bin"][:-10])  # truncated
    p = run_cli("data", "fineweb", "--shards", "2", "--out", str(out), env=env(hub))
    assert "fineweb_val_000000.bin: complete, skipped" in p.stdout
    assert "fineweb_train_000001.bin: complete, skipped" in p.stdout
    assert hub.gets() == [("fineweb_train_000002.bin", None)]  # only the broken file is fetched again
    assert (out / "fineweb_train_000002.bin").read_bytes() == hub.files["fineweb_train_000002.bin"]
    assert not list(out.glob(".*.part"))


def test_bad_shard_from_hub_is_rejected(hub, tmp_path):
    hub.files["fineweb_val_000000.bin"] = b"\x00" * 1024 + b"\x01\x02"
    p = run_cli("data", "fineweb", "--shards", "1", "--out", str(tmp_path), env=env(hub), check=False)
    assert p.returncode == 1
    assert "fineweb_val_000000.bin" in p.stderr and "not a valid shard" in p.stderr and "bad magic 0" in p.stderr
    assert not (tmp_path / "fineweb_val_000000.bin").exists()
    hub.files["fineweb_val_000000.bin"] = shard_bytes(100, 0)
    p = run_cli("data", "fineweb", "--shards", "3", "--out", str(tmp_path), env=env(hub), check=False)
    assert p.returncode == 1 and "cannot fetch fineweb_train_000003.bin" in p.stderr and "404" in p.stderr
    assert (tmp_path / "fineweb_train_000002.bin").read_bytes() == hub.files["fineweb_train_000002.bin"]


def test_killed_download_resumes_with_range(hub, tmp_path):
    big = shard_bytes(6_000_000, 3)  # 12 MB: more than huggingface_hub's 10 MiB write chunk
    hub.files["fineweb_val_000000.bin"] = big
    cut = 11 << 20
    hub.stall["fineweb_val_000000.bin"] = cut
    part = tmp_path / ".fineweb_val_000000.bin.part"
    cmd = [sys.executable, "-m", "trainbox", "data", "fineweb", "--shards", "1", "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, env={**os.environ, **env(hub)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (part.exists() and part.stat().st_size >= 10 << 20):  # wait for the first chunk on disk
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    have = part.stat().st_size
    assert not (tmp_path / "fineweb_val_000000.bin").exists()
    hub.release.set()
    hub.log.clear()
    run_cli("data", "fineweb", "--shards", "1", "--out", str(tmp_path), env=env(hub))
    assert ("fineweb_val_000000.bin", f"bytes={have}-") in hub.gets()
    assert (tmp_path / "fineweb_val_000000.bin").read_bytes() == big
    assert not part.exists()


@pytest.mark.parametrize("verb,sig,code", [("fineweb", signal.SIGINT, 130), ("download", signal.SIGTERM, 143),
                                           ("train", signal.SIGTERM, 0)])
def test_signal_stops_download_and_keeps_part(hub, tmp_path, verb, sig, code):
    """SIGINT or SIGTERM mid-file (the server sends 1 MB/s, so the 3 MB val shard takes 3 s) ends the command at
    once with one line saying what was kept and the command that continues; that command resumes by Range.
    `trainbox train`, stopped in the download it starts, has stopped before its first step: exit 0."""
    big = shard_bytes(1_500_000, 4)
    hub.files["fineweb_val_000000.bin"] = big
    hub.rate["fineweb_val_000000.bin"] = 1_000_000
    out = tmp_path / "fw"
    args = {"fineweb": ["data", "fineweb", "--shards", "1", "--out", str(out)],
            "download": ["data", "download", *TINY_GPT2, f"data.path={out}", "train.max_steps=1"],
            "train": ["train", *TINY_GPT2, f"data.path={out}", "train.max_steps=1", f"run.dir={tmp_path}"]}[verb]
    part = out / ".fineweb_val_000000.bin.part"
    proc = subprocess.Popen([sys.executable, "-m", "trainbox", *args], env={**os.environ, **env(hub)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (part.exists() and part.stat().st_size > 0):   # the first bytes on disk
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    have = part.stat().st_size
    assert 0 < have < len(big) and not (out / "fineweb_val_000000.bin").exists()
    assert big.startswith(part.read_bytes())
    again = shlex.join(["trainbox", *args])
    line = (f"trainbox data {verb}: stopped by {sig.name}; kept {have:,} bytes of fineweb_val_000000.bin in {part}; "
            f"continue with: {again}") if verb != "train" else (
        f"stopped before the first step; nothing to save; kept {have:,} bytes of fineweb_val_000000.bin in {part}, "
        "which the same command continues")
    assert err.splitlines()[-1] == line, err
    assert "Traceback" not in err and "interrupted" not in err
    hub.rate.clear()
    hub.log.clear()
    if verb == "train":   # the same command: the download resumes, the run trains its one step
        hub.files.update({"fineweb_train_000001.bin": shard_bytes(1000, 1)})
    run_cli(*args, env=env(hub))
    assert hub.gets()[0] == ("fineweb_val_000000.bin", f"bytes={have}-")
    assert (out / "fineweb_val_000000.bin").read_bytes() == big
    assert not part.exists()


# ----------------------------------------------------------------------------- train with data.source

TINY_GPT2 = [a for a in TINY if not a.startswith("data.tokenizer=")] + [
    "data.tokenizer=gpt2", "data.source=fineweb10B-gpt2", "train.eval_tokens=256"]


def test_train_downloads_the_shards_its_steps_read(hub, tmp_path):
    """seq_len 32, global batch 8, 6 steps: 48 windows. Shard 1 (1,000 tokens) gives 31, so shard 2 (800: 24) is
    needed too, and shard 3 is not: the plan follows the headers, not the nominal 100M tokens. Shard 1's
    connection drops after 700 bytes and the download continues from there with a Range request."""
    hub.files.update({"fineweb_train_000001.bin": shard_bytes(1000, 1), "fineweb_train_000002.bin": shard_bytes(800, 2),
                      "fineweb_train_000003.bin": shard_bytes(1200, 3)})
    hub.drop["fineweb_train_000001.bin"] = 700
    data = tmp_path / "data" / "fw"
    args = [*TINY_GPT2, f"data.path={data}", f"run.dir={tmp_path / 'runs'}"]
    p = run_cli("train", *args, "train.max_steps=6", env={**env(hub), "HF_TOKEN": "tok"})
    names = ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert hub.gets() == [(names[0], None), (names[1], None), (names[1], "bytes=700-"), (names[2], None)]
    assert hub.auth == ["Bearer tok"] * 4
    assert sorted(f.name for f in data.iterdir()) == sorted([".trainbox-source", *names])
    for n in names:
        assert (data / n).read_bytes() == hub.files[n]
    assert f"data: {data} holds 0 of the 2 files this run reads" in p.stderr   # the nominal plan: 1 shard
    assert "MB/s" in p.stderr and "validation:" in p.stdout
    # a longer run on the same folder fetches only what it adds: 9 steps read 72 windows, 31 + 24 + 37
    hub.log.clear()
    p = run_cli("data", "download", *args, "train.max_steps=9", env=env(hub))
    assert hub.gets() == [("fineweb_train_000003.bin", None)]
    assert "4 file(s) in" in p.stdout


def test_no_network_fails_fast_and_leaves_no_folder(hub, tmp_path):
    """A refused connection (a closed port) ends `train` at once with what, where and what to do, and removes the
    folders it made; with data.download=false nothing is fetched and the missing path is the usual error."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # closed once the block ends: connections are refused
    args = ["gpt2-125m", "train.device=cpu", f"data.path={tmp_path / 'data' / 'fineweb'}",
            f"run.dir={tmp_path / 'runs'}"]
    start = time.monotonic()
    p = run_cli("train", *args, env={"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_OFFLINE": "0"}, check=False)
    assert time.monotonic() - start < 30
    assert p.returncode == 1, p.stderr
    assert (f"data.path={tmp_path / 'data' / 'fineweb'}: downloading data.source=fineweb10B-gpt2 into it failed: "
            f"cannot fetch fineweb_val_000000.bin from http://127.0.0.1:{port}/datasets/kjj0/"
            "fineweb10B-gpt2/resolve/main/fineweb_val_000000.bin: ConnectionRefusedError") in p.stderr
    assert "trainbox data download gpt2-125m" in p.stderr and "data.download=false" in p.stderr
    assert list(tmp_path.iterdir()) == []   # neither data/fineweb nor data/, nor a run directory
    p = run_cli("train", *args, "data.download=false", env=env(hub), check=False)
    assert p.returncode == 1 and "no token files" in p.stderr and hub.log == []
    assert not (tmp_path / "data").exists()
    if not torch.cuda.is_available():   # a GPU recipe on this CPU is refused before its download, not after it
        p = run_cli("train", *[a for a in args if a != "train.device=cpu"], env=env(hub), check=False)
        assert p.returncode == 2 and "made for a GPU" in p.stderr and hub.log == []
