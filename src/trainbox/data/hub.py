"""Pre-tokenized FineWeb shards from the Hugging Face Hub (dataset kjj0/fineweb10B-gpt2).

The files are modded-nanogpt's GPT-2 shards (the shard format of formats.py): fineweb_val_000000.bin and
fineweb_train_000001.bin ... fineweb_train_000103.bin, 100M tokens each.

- Complete files are skipped without touching the network: a file counts as complete when its header
  is valid and its size equals 1024 + 2 x token count.
- A download goes to `.NAME.part` in the output folder and is resumed from its current size with an
  HTTP Range request (huggingface_hub's http_get), so an interrupted run continues where it stopped.
  Only a verified file is renamed to its final name.
- URLs and metadata come from huggingface_hub (hf_hub_url, get_hf_file_metadata), so an endpoint other
  than huggingface.co (a mirror, or the local server of the tests) is passed as `endpoint`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from trainbox.data import formats
from trainbox.errors import DataError, MissingDependency

FINEWEB_REPO = "kjj0/fineweb10B-gpt2"
FINEWEB_TRAIN_SHARDS = 103


def fineweb_files(shards: int) -> list[str]:
    """The validation shard and the first `shards` training shards."""
    if not 1 <= shards <= FINEWEB_TRAIN_SHARDS:
        raise DataError(f"--shards {shards}: the dataset has training shards 1..{FINEWEB_TRAIN_SHARDS}")
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, shards + 1)]


def verify_shard(path: Path, expected_size: int | None = None) -> None:
    """DataError unless `path` is a complete shard (header, size, and the hub's size when known)."""
    formats.read_shard(path)  # checks magic, version and header-vs-file size
    size = path.stat().st_size
    if expected_size is not None and size != expected_size:
        raise DataError(f"{path}: {size} bytes but the hub lists {expected_size}",
                        hint="delete the file and download it again")


def _is_complete(path: Path) -> bool:
    try:
        verify_shard(path)
        return True
    except DataError:
        return False


def download_file(filename: str, out: Path, repo: str = FINEWEB_REPO, revision: str | None = None,
                  endpoint: str | None = None, token: str | bool | None = None) -> Path:
    """Download one shard into `out`, resuming a partial download; returns the verified final path."""
    try:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.file_download import http_get
    except ImportError:
        raise MissingDependency("huggingface_hub", "hf", "downloading FineWeb shards") from None
    final = out / filename
    part = out / f".{filename}.part"
    url = hf_hub_url(repo, filename, repo_type="dataset", revision=revision, endpoint=endpoint)
    try:
        meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
    except Exception as e:  # httpx / HfHubHTTPError / offline mode: one clear message
        raise DataError(f"cannot fetch {filename} from {url}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                        hint="check the network (or HF_ENDPOINT / HF_HUB_OFFLINE) and run the command again; "
                             "complete files are kept") from None
    size = meta.size
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:  # a different file was there before: start again
        part.unlink()
        have = 0
    headers = {"authorization": f"Bearer {token}"} if isinstance(token, str) else None
    with open(part, "ab") as f:
        try:
            http_get(meta.location, f, resume_size=have, expected_size=size, headers=headers,
                     displayed_filename=filename, tqdm_class=_quiet_tqdm())
        except Exception as e:
            raise DataError(f"download of {filename} stopped at byte {f.tell():,} of {size or '?'}: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                            hint="run the command again: it resumes from where it stopped") from None
        f.flush()
        os.fsync(f.fileno())
    try:
        verify_shard(part, size)
    except DataError as e:
        part.unlink(missing_ok=True)
        raise DataError(f"downloaded {filename} from {url} is not a valid shard: {e.message}",
                        hint="run the command again to download it afresh") from None
    os.replace(part, final)
    formats.fsync_dir(out)
    return final


def download_fineweb(shards: int, out: str | Path, endpoint: str | None = None, revision: str | None = None,
                     token: str | bool | None = None,
                     on_file: Callable[[str, str], None] | None = None) -> list[Path]:
    """Fetch the val shard and `shards` train shards into `out`; complete files are skipped."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in fineweb_files(shards):
        final = out / name
        if final.exists() and _is_complete(final):
            status = "complete, skipped"
        else:
            if final.exists():  # corrupt or truncated under the final name: fetch it again
                final.unlink()
            download_file(name, out, revision=revision, endpoint=endpoint, token=token)
            status = "downloaded"
        if on_file:
            on_file(name, status)
        paths.append(final)
    return paths


def _quiet_tqdm():
    """A tqdm class that draws nothing: library code does not print; the CLI reports file by file."""
    from tqdm.auto import tqdm

    class Quiet(tqdm):
        def __init__(self, *a, **k):
            k["disable"] = True
            super().__init__(*a, **k)
    return Quiet
