"""Checkpoints that do not fit: the file size limit (`ulimit -f`) and a full disk, said plainly.

Through the real CLI, real `trainbox train` processes with the tiny recipe's settings (as test_faults_signals.py:
its intervals, a smaller model) resume a 150-step run and fail to save step 300: under a file size limit set
in the child (model.safetensors over it, optimizer.pt over it, optimizer.pt reaching it while torch's writer
writes it) and on a small file system (a tmpfs in a private mount namespace, `unshare -rm`, gone with the
process). Every case: exit code 1, one message naming the cause, the checkpoint, the bytes and what to do, no
traceback; the step-150 checkpoint still verifies, `latest` still names it, no staging folder is left; where
the failed save had written files or the run comes back from the small disk, the same command with room
resumes from it and finishes.

Below the CLI: a disk that fills while torch's writer (which loses the errno) writes optimizer.pt, a sharded
(torch.distributed.checkpoint, async) save over the limit or the free space, the cause read from the staged
files when a rank's error arrives without its errno, and failures that are not for want of room keeping their
own message.
"""
from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainbox import checkpoint
from trainbox.checkpoint import room as checkpoint_room
from trainbox.errors import CheckpointError

pytestmark = pytest.mark.faults

# the tiny recipe as shipped, with a smaller model and evaluation (test_faults_signals.py)
SMALL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.seq_len=32", "train.global_batch_size=8",
         "train.micro_batch_size=8", "train.eval_tokens=8192", "train.sample_tokens=0", "monitor.port=0"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
SIZE = r"[\d.]+ KiB \([\d,]+ bytes\)"
KEPT = "; older checkpoints are kept"


def _train(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainbox", "train", "tiny", *SMALL, f"run.dir={run_dir.parent}",
            f"run.name={run_dir.name}", f"data.cache_dir={cache}", "train.threads=1", *extra]


def _run(cmd: list[str], limit: int | None = None) -> subprocess.CompletedProcess:
    def file_size_limit():   # in the child only: Python ignores SIGXFSZ, so a write past it fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300,
                          preexec_fn=file_size_limit if limit else None)


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_cache) -> Path:
    """A run of 150 steps, its checkpoint saved at its end (the recipe's 300 steps resume from it)."""
    run_dir = tmp_path_factory.mktemp("disk") / "base"
    proc = _run(_train(run_dir, data_cache, "train.max_steps=150"))
    assert proc.returncode == 0, proc.stderr
    return run_dir


def _pages(folder: Path) -> int:
    """The bytes `folder`'s files take on a tmpfs (whole 4 KiB pages)."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.rglob("*") if p.is_file())


def _small_fs_script() -> str:
    """sh -c script: SIZE MNT RUN BACK CMD...: mount a tmpfs of SIZE bytes at MNT (private mount namespace), copy
    the run folder RUN onto it, run CMD there and copy the run folder back into BACK; exits with CMD's code."""
    return ('size=$1 mnt=$2 run=$3 back=$4; shift 4; '
            'mount -t tmpfs -o size="$size" tmpfs "$mnt" && cp -a "$run" "$mnt"/ || exit 99; '
            '"$@"; rc=$?; cp -a "$mnt/${run##*/}" "$back"/ || exit 98; exit $rc')


def _in_small_fs(size: int, mnt: Path, run: Path, back: Path, cmd: list[str]) -> subprocess.CompletedProcess:
    mnt.mkdir(exist_ok=True)
    back.mkdir(exist_ok=True)
    return subprocess.run(["unshare", "-rm", "sh", "-c", _small_fs_script(), "sh", str(size), str(mnt), str(run),
                           str(back), *cmd], capture_output=True, text=True, env=ENV, timeout=300)


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory) -> None:
    """Skips when this machine cannot mount a tmpfs in a private namespace (CI runs as root, where it can)."""
    probe = tmp_path_factory.mktemp("probe")
    try:
        proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {probe}"],
                              capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no small file system: unshare (util-linux) is not installed")
    if proc.returncode != 0:
        pytest.skip(f"no small file system: unshare -rm + mount -t tmpfs failed here: {proc.stderr.strip()}")


def _optimizer_bytes(base: Path) -> int:
    return (base / "checkpoints" / "step_00000150" / "optimizer.pt").stat().st_size


# case -> (where the run saves: a file size limit in bytes, or a tmpfs of base + N bytes; the message, a regex;
# whether the same command is run again with room: where the failed save had written files (torch's writer) or
# the run comes back from another file system; a save refused before writing leaves the same folder)
CASES = {
    "ulimit: model.safetensors over it": (
        "limit", lambda base: 200_000,
        rf"file too large: model.safetensors needs at least {SIZE}, and this process may write files of at most "
        rf"195.3 KiB \(200,000 bytes\) \(ulimit -f\)", False),
    "ulimit: optimizer.pt over it": (
        "limit", lambda base: 400_000,
        rf"file too large: optimizer.pt needs at least {SIZE}, and this process may write files of at most "
        rf"390.6 KiB \(400,000 bytes\) \(ulimit -f\)", False),
    # over the bytes of its tensors (the check before a save), under the file: torch's writer fails in the middle
    "ulimit: optimizer.pt reaches it while written": (
        "limit", lambda base: _optimizer_bytes(base) - 4096,
        rf"file too large: optimizer.pt needs more than this process's file size limit of {SIZE} \(ulimit -f\)",
        True),
    "small disk: the checkpoint over the free space": (
        "tmpfs", lambda base: _pages(base) + 640 * 1024,
        rf"no space left on device: the checkpoint needs at least {SIZE} and \S+/checkpoints has {SIZE} free",
        True),
}


# the first case in the fast tier, the others in the slow one
@pytest.mark.parametrize("case", [c if c == next(iter(CASES)) else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_a_save_that_does_not_fit_says_why_and_the_same_command_resumes(base, data_cache, tmp_path, case, request):
    where, amount, said, resumes = CASES[case]
    run_dir = tmp_path / "run"
    if where == "limit":
        shutil.copytree(base, run_dir)
        proc = _run(_train(run_dir, data_cache), limit=amount(base))
    else:
        request.getfixturevalue("small_fs")
        mnt = tmp_path / "mnt"
        shutil.copytree(base, tmp_path / "stage" / "run")
        proc = _in_small_fs(amount(base), mnt, tmp_path / "stage" / "run", tmp_path,
                            _train(mnt / "run", data_cache))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Traceback" not in out and "unexpected error" not in out, out
    messages = [line for line in proc.stderr.splitlines() if line.startswith("trainbox train:")]
    assert len(messages) == 1, out
    message, hint = messages[0], proc.stderr.split(messages[0], 1)[1].strip()
    assert re.search(rf"saving checkpoint \S+/run/checkpoints/step_00000300 failed: {said}{KEPT}$", message), message
    if where == "limit":
        assert hint == "-> raise the limit (ulimit -f unlimited; in a container, its fsize ulimit), then resume " \
                       "with the same command", hint
    else:
        assert re.fullmatch(rf"-> free at least {SIZE} on that disk \(df -h \S+/checkpoints; delete old runs or lower "
                            r"train.keep_last\), then resume with the same command", hint), hint
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000150"], "a staging folder was left"
    assert (root / "latest").read_text().strip() == "step_00000150"
    checkpoint.verify(root / "step_00000150")
    if not resumes:
        return
    again = _run(_train(run_dir, data_cache))   # with room: the same command
    assert again.returncode == 0, again.stderr
    assert f"resuming from {root / 'step_00000150'} at step 150" in again.stderr
    assert checkpoint.latest(root) == root / "step_00000300"
    checkpoint.verify(root / "step_00000300")


# ----------------------------------------------------------------------------- below the CLI

SAVE = r"""
import sys
from pathlib import Path
import torch
from trainbox import checkpoint
from trainbox.checkpoint import room as checkpoint_room
from trainbox.errors import CheckpointError
root = Path(sys.argv[1])
weights = {"w": torch.ones(1000)}
state = {"state": {}, "param_groups": [], "blob": list(range(400_000))}   # pickled, not tensors: MiBs
checkpoint.save(root, 1, weights, [{"state": {}, "param_groups": []}], {"step": 1}, [{}], 2)
try:
    checkpoint.save(root, 2, weights, [state], {"step": 2}, [{}], 2)
except CheckpointError as e:
    print(e)
"""


def test_a_disk_that_fills_while_torch_writes_optimizer_pt_is_named(small_fs, tmp_path):
    """The check before the save counts tensors only, so a save of pickled values gets past it; torch's writer
    then fails on the full disk without an errno ("unexpected pos ..."), and the cause is read from the disk."""
    mnt = tmp_path / "mnt"
    stage = tmp_path / "stage" / "checkpoints"
    stage.mkdir(parents=True)
    proc = _in_small_fs(1 << 20, mnt, stage, tmp_path, [sys.executable, "-c", SAVE, str(mnt / "checkpoints")])
    assert proc.returncode == 0, proc.stderr
    message = proc.stdout.strip()
    assert re.match(rf"saving checkpoint \S+/step_00000002 failed writing optimizer.pt: no space left on device: the "
                    rf"checkpoint needs more than {SIZE} and \S+ has {SIZE} free{KEPT}\n"
                    rf"  -> free space on that disk", message), message
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"], "a staging folder was left"
    checkpoint.verify(root / "step_00000001")


SHARDED = r"""
import resource, sys
from pathlib import Path
import torch
from trainbox.errors import CheckpointError
from trainbox.parallel.dcp import AsyncSaver
from trainbox.parallel.distributed import Dist
root, limit = Path(sys.argv[1]), int(sys.argv[2])
model = torch.nn.Linear(256, 256)
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 256)).sum().backward()
opt.step()
saver = AsyncSaver(root, Dist(), 2, None)
saver.start(1, model, [opt], {"step": 1}, [{}])
saver.wait()
if limit:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    saver.start(2, model, [opt], {"step": 2}, [{}])   # the shards are written in the background
    print("started")
    saver.wait()                                      # where a failed write surfaces
except CheckpointError as e:
    print(e)
"""


@pytest.mark.parametrize("where", ["ulimit", "small disk"])
def test_a_sharded_save_that_does_not_fit_says_the_same(where, tmp_path, request):
    """An asynchronous torch.distributed.checkpoint save, one process: over the file size limit, the shards' write
    fails in the background and wait() says so; on a disk without room for the shards, start() refuses."""
    root = tmp_path / "checkpoints"
    if where == "ulimit":
        proc = subprocess.run([sys.executable, "-c", SHARDED, str(root), "100000"], capture_output=True, text=True,
                              env=ENV, timeout=300)
        said = (r"started\nsaving checkpoint \S+/step_00000002 failed: file too large: state/__0_\d.distcp needs "
                rf"more than this process's file size limit of 97.7 KiB \(100,000 bytes\) \(ulimit -f\){KEPT}")
    else:
        request.getfixturevalue("small_fs")
        stage = tmp_path / "stage" / "checkpoints"
        stage.mkdir(parents=True)
        # the first save (~0.8 MiB of shards) fits, the second not beside it
        proc = _in_small_fs(1200 * 1024, tmp_path / "mnt", stage, tmp_path,
                            [sys.executable, "-c", SHARDED, str(tmp_path / "mnt" / "checkpoints"), "0"])
        said = (rf"saving checkpoint \S+/step_00000002 failed: no space left on device: the checkpoint needs at least "
                rf"{SIZE} and \S+ has {SIZE} free{KEPT}")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr   # DCP's writer threads print nothing of their own
    assert re.match(said, proc.stdout.strip()), proc.stdout
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"], "a staging folder was left"
    checkpoint.verify(root / "step_00000001")


def test_a_ranks_error_without_its_errno_is_read_from_the_staged_files(tmp_path):
    """Under several ranks, DCP hands rank 0 another rank's error pickled: torch's "unexpected pos", its errno
    gone. A staged shard at the file size limit says why."""
    tmp = tmp_path / ".tmp-step_00000002"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "__1_0.distcp").write_bytes(b"\0" * 100_000)
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 100032 vs 99920")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        cause = checkpoint_room.disk_cause(error, tmp, tmp_path, need=10_000_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert cause == checkpoint_room.NoRoom("size", 0, "state/__1_0.distcp")


@pytest.mark.parametrize("error, said", [
    (PermissionError(errno.EACCES, "Permission denied"), "Permission denied"),
    (OSError(errno.EROFS, "Read-only file system"), "Read-only file system"),
    (RuntimeError("File /x/optimizer.pt cannot be opened."), "File /x/optimizer.pt cannot be opened."),
])
def test_a_failure_not_for_want_of_room_keeps_its_own_message(tmp_path, monkeypatch, error, said):
    """Permission denied, a read-only file system or torch's own words on a disk with room: its own message, and
    the hint to check the folder, not to free space."""
    def refuse(*args, **kwargs):
        raise error
    monkeypatch.setattr(torch, "save", refuse)
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError) as err:
        checkpoint.save(root, 1, {"w": torch.ones(4)}, [{"state": {}, "param_groups": []}], {"step": 1}, [{}], 2)
    assert err.value.message == f"saving checkpoint {root / 'step_00000001'} failed: {said}{KEPT}"
    assert err.value.hint == f"check that {root} is writable, then resume with the same command"
    assert not list(root.iterdir()), "the staging folder is removed"


@pytest.mark.parametrize("verb, args, named, hint", [
    ("prepare", ["{jsonl}", "--out", "{file}/x"], "{file}: File exists", "a file is where a folder is needed"),
    ("tokenizer", ["train", "{jsonl}", "--vocab-size", "300", "--out", "{file}/tok.json"], "{file}: File exists",
     "a file is where a folder is needed"),
    ("train", ["tiny", *SMALL, "train.max_steps=1", "run.dir={file}"], "{file}/tiny: Not a directory",
     "a folder on this path is a file"),
    ("train", ["tiny", *SMALL, "train.max_steps=1", "run.dir={tmp}/runs", "data.cache_dir={file}"],
     "{file}/shakespeare-", "a folder on this path is a file"),
    ("prepare", ["{jsonl}", "--out", "{ro}/x"], "{ro}/x_train_000001.bin.partial: Read-only file system",
     "the file system is read-only: choose a location on a writable one"),
])
def test_a_location_that_cannot_be_written_is_named_in_one_line(tmp_path, verb, args, named, hint):
    """An output path the user chose (a run directory, a cache folder, --out) under a file, or on a read-only file
    system (a tmpfs mounted read-only in a private namespace): exit 1, one line naming the path and the cause, one
    saying what to do; no traceback, nothing called unexpected."""
    (tmp_path / "a.jsonl").write_text('{"text": "to be or not to be"}\n{"text": "that is the question"}\n')
    (tmp_path / "file").write_text("in the way\n")
    (tmp_path / "ro").mkdir()
    where = {"jsonl": tmp_path / "a.jsonl", "file": tmp_path / "file", "ro": tmp_path / "ro", "tmp": tmp_path}
    cmd = [sys.executable, "-m", "trainbox", verb, *(a.format(**where) for a in args)]
    if "{ro}" in " ".join(args):
        if shutil.which("unshare") is None:
            pytest.skip("no read-only file system: unshare (util-linux) is not installed")
        cmd = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o ro none {where["ro"]} && exec "$@"', "sh", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    if "{ro}" in " ".join(args) and "mount:" in proc.stderr:
        pytest.skip(f"no read-only file system here: {proc.stderr.strip()}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 2, proc.stderr
    assert lines[0].startswith(f"trainbox {verb}: {named.format(**where)}") and lines[1].startswith(f"  -> {hint}")
