"""`trainbox data fineweb` against a local HTTP server that answers the hub's resolve URLs (HF_ENDPOINT):
download, skip complete files, header/size verification, and resuming a download killed half-way."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from conftest import run_cli

PREFIX = "/datasets/kjj0/fineweb10B-gpt2/resolve/main/"


def shard_bytes(n: int, seed: int) -> bytes:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, n)
    return header.tobytes() + np.random.default_rng(seed).integers(0, 50257, n).astype(np.uint16).tobytes()


class Hub:
    """Serves `files`; logs (method, name, Range); `stall[name] = k` sends k bytes of the next GET then waits."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.log, self.stall, self.release = files, [], {}, threading.Event()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _head(self, name):
                data = hub.files.get(name)
                rng = self.headers.get("Range")
                hub.log.append((self.command, name, rng))
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
                    if cut is not None:
                        self.wfile.write(data[start:cut])
                        self.wfile.flush()
                        hub.release.wait(60)
                        return
                    self.wfile.write(data[start:])
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
