"""Pre-tokenized datasets on the Hugging Face Hub, fetched over plain HTTP (no dependency beyond the standard library).

SOURCES names what `data.source` may be. fineweb10B-gpt2 is modded-nanogpt's GPT-2 FineWeb (dataset
kjj0/fineweb10B-gpt2): fineweb_val_000000.bin and fineweb_train_000001.bin ... fineweb_train_000103.bin,
shards of formats.py's layout holding 100M tokens each.

- A file is fetched from `{endpoint}/datasets/{repo}/resolve/{revision}/{name}` with the token, when given, as
  a Bearer header (kept on redirects within the host, dropped on one to another host, as huggingface_hub does).
- Complete files are skipped without touching the network: a file counts as complete when its header is valid
  and its size equals 1024 + 2 x token count.
- A download goes to `.NAME.part` beside the final name and continues from that file's size with an HTTP Range
  request, in this process when the connection drops after some bytes arrived (up to RETRIES times) and in the
  next one otherwise. The finished file must have the size the server announced (Content-Length, or the total
  of Content-Range) and a valid shard header; then it is fsynced and renamed to its final name.
- A connection that cannot be made, or that is silent for TIMEOUT_S seconds, fails at once with a DataError.

`ensure_source` is what `trainbox train` calls: when data.path does not exist it downloads, into the folder
data.path, the validation shard and the training shards that the run's steps read. The folder gets a marker
file (MARKER) first, which also serialises the processes of one machine (an flock), so a later start tops the
folder up (a longer run, a download cut short) while a folder of the user's own is never written into.
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from trainbox.data import formats
from trainbox.errors import DataError

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 10.0   # connect, and each read: a host that cannot be reached fails well within 30 s
RETRIES = 5        # reconnections within one file, each after a connection that delivered bytes
CHUNK = 1 << 20
MARKER = ".trainbox-source"


@dataclass(frozen=True)
class Source:
    """A dataset of llm.c shards on the hub: `{prefix}_val_000000.bin`, `{prefix}_train_{i:06d}.bin` for i >= 1."""

    name: str
    repo: str
    prefix: str
    train_shards: int
    tokens_per_shard: int   # nominal: what a training shard holds until its header says otherwise

    @property
    def val_files(self) -> list[str]:
        return [f"{self.prefix}_val_000000.bin"]

    def train_file(self, i: int) -> str:
        return f"{self.prefix}_train_{i:06d}.bin"


SOURCES = {"fineweb10B-gpt2": Source("fineweb10B-gpt2", "kjj0/fineweb10B-gpt2", "fineweb", 103, 100_000_000)}
FINEWEB = SOURCES["fineweb10B-gpt2"]
FINEWEB_REPO = FINEWEB.repo
FINEWEB_TRAIN_SHARDS = FINEWEB.train_shards


@dataclass
class Progress:
    """One update of a download, for the CLI's progress line."""

    name: str
    done: int           # bytes of this file on disk
    total: int | None   # its size, once the server said
    resumed: int        # bytes it had when this connection started (the rate counts from there)
    started: float      # time.monotonic() when this connection started
    index: int          # 1-based position of the file in this call's list
    count: int | None   # files in the list (None: decided as shards arrive)


def fineweb_files(shards: int) -> list[str]:
    """The validation shard and the first `shards` training shards."""
    if not 1 <= shards <= FINEWEB_TRAIN_SHARDS:
        raise DataError(f"--shards {shards}: the dataset has training shards 1..{FINEWEB_TRAIN_SHARDS}")
    return FINEWEB.val_files + [FINEWEB.train_file(i) for i in range(1, shards + 1)]


def verify_shard(path: Path, expected_size: int | None = None) -> int:
    """The token count of `path`; DataError unless it is a complete shard (header, size, and the server's size)."""
    tokens = len(formats.read_shard(path))  # checks magic, version and header-vs-file size
    size = path.stat().st_size
    if expected_size is not None and size != expected_size:
        raise DataError(f"{path}: {size} bytes but the server announced {expected_size}",
                        hint="delete the file and download it again")
    return tokens


def complete_tokens(path: Path) -> int | None:
    """The token count of a complete shard at `path`, None when it is missing or incomplete (no network)."""
    try:
        return verify_shard(path)
    except DataError:
        return None


class _Redirect(urllib.request.HTTPRedirectHandler):
    """Follows redirects, keeping the Authorization header only while the host stays the same."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        auth = req.unredirected_hdrs.get("Authorization")
        if new is not None and auth and urlsplit(newurl).netloc == urlsplit(req.full_url).netloc:
            new.add_unredirected_header("Authorization", auth)
        return new


@dataclass
class Hub:
    """Where files come from: the endpoint (a mirror, or a test's local server), revision, token and timeout."""

    endpoint: str = DEFAULT_ENDPOINT
    revision: str = "main"
    token: str | None = None
    timeout: float = TIMEOUT_S
    offline: bool = False
    progress: Callable[[Progress], None] | None = None
    stopped: Callable[[], str | None] | None = None   # why to stop now (a stop signal's name), checked per chunk

    def url(self, repo: str, name: str) -> str:
        return f"{self.endpoint.rstrip('/')}/datasets/{repo}/resolve/{self.revision}/{name}"

    def fetch(self, repo: str, name: str, out: Path, index: int = 1, count: int | None = 1) -> Path:
        """Download `name` of `repo` into the folder `out`, continuing a `.part` file; the verified final path."""
        url = self.url(repo, name)
        if self.offline:
            raise DataError(f"cannot fetch {name} from {url}: HF_HUB_OFFLINE is set (no downloads)",
                            hint="unset HF_HUB_OFFLINE, or put the files there yourself")
        final, part = out / name, out / f".{name}.part"
        for _attempt in range(RETRIES + 1):
            have = part.stat().st_size if part.exists() else 0
            got, total, ended = self._get(url, name, part, have, index, count)
            size = part.stat().st_size if part.exists() else 0
            if total is not None and size > total:   # not a part of this file: start again next time
                part.unlink()
                raise DataError(f"{part} holds {size:,} bytes, more than the {total:,} of {url}",
                                hint="run the command again to download it afresh")
            if (total is not None and size == total) or (total is None and ended and got):
                break
            if got == 0:   # a connection that delivers nothing is not retried: the next command resumes
                raise DataError(f"download of {name} from {url} stopped at byte {size:,} of {total or '?'}",
                                hint="run the command again: it resumes from where it stopped")
        else:
            raise DataError(f"download of {name} from {url} broke off {RETRIES + 1} times (last at byte "
                            f"{part.stat().st_size:,})", hint="run the command again: it resumes where it stopped")
        try:
            verify_shard(part, total)
        except DataError as e:
            part.unlink(missing_ok=True)
            raise DataError(f"downloaded {name} from {url} is not a valid shard: {e.message}",
                            hint="run the command again to download it afresh") from None
        os.replace(part, final)
        formats.fsync_dir(out)
        return final

    def _get(self, url: str, name: str, part: Path, have: int, index: int,
             count: int | None) -> tuple[int, int | None, bool]:
        """One GET from byte `have` on, appended to `part`: (bytes received, the file's full size or None, whether
        the body ended without an error)."""
        req = urllib.request.Request(url, headers={"User-Agent": "trainbox"})
        if have:
            req.add_header("Range", f"bytes={have}-")
        if self.token:
            req.add_unredirected_header("Authorization", f"Bearer {self.token}")
        opener = urllib.request.build_opener(_Redirect)
        try:
            resp = opener.open(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:   # nothing after byte `have`: the part is the whole file
                return 0, _range_total(e.headers.get("Content-Range")), True
            hint = ("set HF_TOKEN to a token that may read the dataset" if e.code in (401, 403) else
                    "check HF_ENDPOINT and the file name")
            raise DataError(f"cannot fetch {name} from {url}: HTTP {e.code} {e.reason}", hint=hint) from None
        except (urllib.error.URLError, OSError, HTTPException) as e:
            reason = getattr(e, "reason", e)
            raise DataError(f"cannot fetch {name} from {url}: {type(reason).__name__}: {reason}",
                            hint="check the network (or HF_ENDPOINT) and run the command again; complete files "
                                 "are kept") from None
        with resp:
            if resp.status == 206:
                total = _range_total(resp.headers.get("Content-Range"))
                start = int(resp.headers.get("Content-Range", "bytes 0-").split()[1].split("-")[0])
                if start != have:
                    raise DataError(f"{url}: asked for bytes from {have}, the server sent from {start}")
            else:   # 200: the whole file (a server without Range support): start the part again
                length = resp.headers.get("Content-Length")
                total = int(length) if length is not None else None
                have = 0
            got, started, ended = 0, time.monotonic(), False
            with open(part, "ab" if have else "wb") as f:
                try:
                    while True:
                        chunk = resp.read1(CHUNK)   # what has arrived, up to CHUNK: the part grows as it comes
                        if not chunk:
                            ended = True
                            break
                        f.write(chunk)
                        got += len(chunk)
                        why = self.stopped() if self.stopped else None
                        if why:
                            f.flush()
                            raise DataError(f"download of {name} stopped by {why} at byte {have + got:,} of "
                                            f"{total or '?'}", hint="the same command resumes it")
                        if self.progress:
                            self.progress(Progress(name, have + got, total, have, started, index, count))
                except (OSError, HTTPException):   # dropped or silent connection: keep what arrived
                    pass
                f.flush()
                os.fsync(f.fileno())
            if have + got == 0:
                part.unlink(missing_ok=True)
            return got, total, ended


def _range_total(content_range: str | None) -> int | None:
    """The full size in `bytes a-b/TOTAL` or `bytes */TOTAL`."""
    if not content_range or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


def download_fineweb(shards: int, out: str | Path, hub: Hub,
                     on_file: Callable[[str, str], None] | None = None) -> list[Path]:
    """Fetch the val shard and `shards` train shards into `out`; complete files are skipped."""
    out = Path(out)
    names = fineweb_files(shards)
    with _Folder(out, FINEWEB) as folder:
        paths = []
        for i, name in enumerate(names, 1):
            status = folder.fetch(hub, name, i, len(names))
            if on_file:
                on_file(name, status)
            paths.append(out / name)
    return paths


def run_samples(global_batch: int, seq_len: int, max_steps: int | None, max_tokens: int | None) -> int | None:
    """Training samples (windows of seq_len + 1 tokens) a run reads: steps x global batch; None when the run is
    as long as its data (train.epochs, or no length given)."""
    if max_steps is not None:
        return max_steps * global_batch
    if max_tokens is not None:
        return max(1, max_tokens // (global_batch * seq_len)) * global_batch
    return None


def samples_in(tokens: int, seq_len: int) -> int:
    """Windows a shard of `tokens` tokens gives (the loader's rule: data/loader.py TokenDataset)."""
    return max(0, (tokens - 1) // seq_len)


def plan_shards(source: Source, samples: int | None, seq_len: int, known: dict[int, int]) -> int:
    """How many training shards hold `samples` windows: `known` token counts (from the headers of complete
    files), the nominal count for the others; all of them when `samples` is None."""
    if samples is None:
        return source.train_shards
    total = 0
    for i in range(1, source.train_shards + 1):
        total += samples_in(known.get(i, source.tokens_per_shard), seq_len)
        if total >= samples:
            return i
    raise DataError(f"the run reads {samples:,} samples of {seq_len + 1} tokens; {source.name} holds about "
                    f"{total:,}", hint="lower train.max_steps (or train.max_tokens), or give data.path")


def is_missing(path: str) -> bool:
    """Whether data.path names nothing: no file or folder, and no files with it as their prefix."""
    return not os.path.exists(path) and not glob.glob(glob.escape(path) + "_*")


def download_target(path: str, source: str | None, download: bool) -> Path | None:
    """The folder `ensure_source` would download into: data.path when it is missing or a folder of an earlier
    download of the same source; None when there is nothing to fetch."""
    if not source or not download or path.startswith("embedded:"):
        return None
    folder = Path(path)
    if is_missing(path) or (folder.is_dir() and not any(folder.iterdir())):
        return folder
    marker = folder / MARKER
    if marker.is_file():
        try:
            earlier = json.loads(marker.read_text() or "{}").get("source")
        except ValueError:
            earlier = None
        if earlier not in (None, source):
            raise DataError(f"data.path={path} holds a download of {earlier}, but data.source={source}",
                            hint="give another data.path for this source")
        return folder
    return None


def ensure_source(path: str, source_name: str | None, download: bool, samples: int | None, seq_len: int,
                  hub: Hub, on_plan: Callable[[str], None] | None = None) -> list[Path] | None:
    """Download what a run needs into data.path (see the module docstring); None when data.path is the user's.

    `samples` is run_samples(...) of the run; the training shards are added one by one until their windows of
    seq_len + 1 tokens cover it, by each downloaded shard's header count."""
    folder = download_target(path, source_name, download)
    if folder is None:
        return None
    source = SOURCES[source_name]
    with _Folder(folder, source) as f:
        known = {i: n for i in range(1, source.train_shards + 1)
                 if (n := complete_tokens(folder / source.train_file(i))) is not None}
        planned = plan_shards(source, samples, seq_len, known)
        missing = [n for n in source.val_files + [source.train_file(i) for i in range(1, planned + 1)]
                   if complete_tokens(folder / n) is None]
        if missing and on_plan:
            on_plan(f"data: {path} holds {len(source.val_files) + planned - len(missing)} of the "
                    f"{len(source.val_files) + planned} files this run reads; downloading about "
                    f"{len(missing) * 2 * source.tokens_per_shard / 1e9:.1f} GB of {source.repo} from {hub.endpoint}")
        paths = [folder / n for n in source.val_files]
        for n in source.val_files:
            f.fetch(hub, n, 1, len(source.val_files) + planned)
        i = 0
        while i < planned:   # planned again after each shard, from its header's token count
            i += 1
            name = source.train_file(i)
            f.fetch(hub, name, len(paths) + 1, len(source.val_files) + planned)
            known[i] = verify_shard(folder / name)
            paths.append(folder / name)
            planned = plan_shards(source, samples, seq_len, known)
    return paths


class _Folder:
    """The download folder for the duration of a download: created with its marker, locked (flock on the marker,
    so one process per machine downloads and the others then find complete files), and removed again, with any
    parents it created, when a failure leaves nothing in it."""

    def __init__(self, folder: Path, source: Source):
        self.folder, self.source, self.created, self.fd = folder, source, [], None

    def __enter__(self) -> "_Folder":
        p = self.folder.absolute()
        while not p.exists():
            self.created.append(p)
            p = p.parent
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.folder / MARKER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self._remove_created()
            raise DataError(f"cannot create the download folder {self.folder}: {e.strerror}",
                            hint="give data.path (or --out) a writable place") from None
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        if os.fstat(self.fd).st_size == 0:
            os.write(self.fd, (json.dumps({"source": self.source.name, "repo": self.source.repo}) + "\n").encode())
        return self

    def fetch(self, hub: Hub, name: str, index: int, count: int | None) -> str:
        final = self.folder / name
        if complete_tokens(final) is not None:
            return "complete, skipped"
        final.unlink(missing_ok=True)   # corrupt or truncated under the final name: fetch it again
        hub.fetch(self.source.repo, name, self.folder, index, count)
        return "downloaded"

    def __exit__(self, kind, value, tb) -> None:
        os.close(self.fd)
        if kind is None:
            return
        left = [p for p in self.folder.iterdir() if p.name != MARKER] if self.folder.is_dir() else []
        if left:   # a .part to continue from, or complete files: kept
            return
        (self.folder / MARKER).unlink(missing_ok=True)
        self._remove_created()

    def _remove_created(self) -> None:
        for p in self.created:   # the folder itself first when this download made it, then its new parents
            try:
                p.rmdir()
            except OSError:
                break
