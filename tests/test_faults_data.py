"""Fault injection on the data path: `trainbox prepare` SIGKILLed at seeded random moments and between the renames
of its commit, and damaged token files fed to the reader that `trainbox train` uses (sources.open_datasets).

After every kill a reader sees a whole dataset (the previous one, or the new one when the commit had finished)
or refuses with a message that says what to run; a rerun of prepare with --overwrite gives the complete new set.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from trainbox.config import DataSection
from trainbox.data import formats
from trainbox.data import megatron as mmidx
from trainbox.data.prepare import PrepareOptions, prepare
from trainbox.data.sources import open_datasets
from trainbox.data.tokenizer import get_tokenizer
from trainbox.errors import DataError

pytestmark = pytest.mark.faults

GPT2 = get_tokenizer("gpt2")
PADDED_VOCAB = 50304  # the model's vocab: the reader must check against the tokenizer's 50,257
SHARD_TOKENS = 20_000


def open_for_training(path, fmt: str = "auto"):
    """(train tokens, val tokens) through the reader `trainbox train` uses."""
    train, val = open_datasets(DataSection(path=str(path), seq_len=8, format=fmt), GPT2, PADDED_VOCAB)
    return (np.concatenate([np.asarray(a) for a in train.arrays]),
            np.concatenate([np.asarray(a) for a in val.arrays]) if val is not None else None)


def write_corpus(path, n_docs: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    words = np.array(["alpha", "beta", "gamma", "delta", "river", "stone", "quiet", "north", "7", "über", "naïve",
                      "token", "file", "shard", "header", "magic", "the", "of", "and", "écrit"])
    with open(path, "w") as f:
        for i in range(n_docs):
            f.write(json.dumps({"text": f"{seed}/{i} " + " ".join(rng.choice(words, int(rng.integers(50, 400))))})
                    + "\n")


def prepare_cli(inp, out, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainbox", "prepare", str(inp), "--out", str(out), "--workers", "2",
            "--shard-tokens", str(SHARD_TOKENS), "--val-docs", "20", "--quiet", *extra]


def run_killed(cmd: list[str], after: float) -> int | None:
    """Start cmd in its own process group, SIGKILL the whole group `after` seconds later; its exit code when it
    had already finished, else None."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return proc.wait(timeout=after)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the tokenizer processes too, as a container kill would
        proc.wait(timeout=30)
        return None


# `python -c KILL_AFTER_REPLACE K ARGS...` runs `trainbox ARGS...` and SIGKILLs itself (no clean-up) right after
# its K-th os.replace: with the manifest protocol, replace 1 is the "committing" manifest, 2..N+1 the N outputs
# and N+2 the "complete" manifest. The states a kill inside the commit leaves, made deterministic from outside
# the library.
KILL_AFTER_REPLACE = """
import os, signal, sys
from trainbox.cli import main
real, done, kill_at = os.replace, [], int(sys.argv[1])
def replace(src, dst, *a, **k):
    real(src, dst, *a, **k)
    done.append(dst)
    if len(done) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
sys.exit(main(sys.argv[2:]))
"""


def check_whole_or_refused(out, refs: dict) -> str:
    """Readers (training's and inspect's) see one whole dataset of `refs` or both refuse; -> which."""
    from trainbox.data.inspect import inspect_data

    try:
        train, val = open_for_training(out)
    except DataError as e:
        assert re.search(r"unfinished `trainbox prepare`", e.message), e
        assert "--overwrite" in e.hint, e
        with pytest.raises(DataError, match="unfinished `trainbox prepare`"):
            inspect_data(str(out), 8)
        return "refused"
    for name, (rtrain, rval) in refs.items():
        if np.array_equal(train, rtrain) and np.array_equal(val, rval):
            report = inspect_data(str(out), 8)
            assert report["train"]["tokens"] == len(rtrain) and report["val"]["tokens"] == len(rval)
            return name
    raise AssertionError(f"{out}: readers accepted a dataset that is neither the old nor the new one "
                         f"({len(train)} train tokens; old {len(refs['old'][0])}, new {len(refs['new'][0])})")


@pytest.mark.slow
def test_prepare_killed_at_random_moments_and_between_renames(tmp_path):
    write_corpus(tmp_path / "old.jsonl", 1500, seed=1)
    write_corpus(tmp_path / "new.jsonl", 2000, seed=2)
    out = tmp_path / "data" / "x"
    refs = {}
    for name in ("old", "new"):  # the reference token streams, prepared in-process elsewhere
        prepare(PrepareOptions([str(tmp_path / f"{name}.jsonl")], str(tmp_path / name / "x"),
                               shard_tokens=SHARD_TOKENS, val_docs=20))
        refs[name] = open_for_training(tmp_path / name / "x")
    assert len(refs["new"][0]) > 10 * SHARD_TOKENS

    subprocess.run(prepare_cli(tmp_path / "old.jsonl", out), check=True, capture_output=True)
    assert check_whole_or_refused(out, refs) == "old"

    # kills inside the commit: after the "committing" manifest, between two renames, after the last rename
    n_files = len(list((tmp_path / "new").glob("x_*")))
    for kill_at in (1, 3, n_files + 1):
        cmd = [sys.executable, "-c", KILL_AFTER_REPLACE, str(kill_at),
               *prepare_cli(tmp_path / "new.jsonl", out, "--overwrite")[3:]]
        rc = subprocess.run(cmd, capture_output=True).returncode
        assert rc == -signal.SIGKILL
        assert check_whole_or_refused(out, refs) == "refused", kill_at
        p = subprocess.run(prepare_cli(tmp_path / "new.jsonl", out), capture_output=True, text=True)
        assert p.returncode == 1 and "--overwrite" in p.stderr  # the interrupted set is still an existing output
        t0 = time.monotonic()
        subprocess.run(prepare_cli(tmp_path / "new.jsonl", out, "--overwrite"), check=True, capture_output=True)
        full = time.monotonic() - t0  # how long a whole prepare of the new dataset takes here
        assert check_whole_or_refused(out, refs) == "new"
        subprocess.run(prepare_cli(tmp_path / "old.jsonl", out, "--overwrite"), check=True, capture_output=True)
        assert check_whole_or_refused(out, refs) == "old"

    # kills at seeded random moments of prepares of the new dataset over the old one
    rng = random.Random(20240520)
    seen = []
    for i in range(6):  # one seeded moment in each sixth of 0.2 .. 1.1 x the time of a whole prepare
        at = (0.2 + 0.15 * (i + rng.random())) * full
        rc = run_killed(prepare_cli(tmp_path / "new.jsonl", out, "--overwrite"), at)
        assert rc in (None, 0)
        seen.append((rc, check_whole_or_refused(out, refs)))
        assert seen[-1][1] != "old" or rc is None
    print(f"prepare takes {full:.2f}s; (exit code or None if killed, what readers saw): {seen}")
    assert any(rc is None for rc, _ in seen), seen  # at least one real kill
    subprocess.run(prepare_cli(tmp_path / "new.jsonl", out, "--overwrite"), check=True, capture_output=True)
    assert check_whole_or_refused(out, refs) == "new"
    assert not list(out.parent.glob("*.partial"))
    assert json.loads((out.parent / "x.manifest.json").read_text())["state"] == "complete"


# ----------------------------------------------------------------------------- damaged token files


def shard_bytes(tokens, magic=formats.SHARD_MAGIC, version=1, count=None, dtype=np.uint16) -> bytes:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (magic, version, len(tokens) if count is None else count)
    return header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes()


TOKENS = np.arange(100, 140, dtype=np.uint16)


def megatron(tmp_path, tokens=TOKENS, dtype=np.uint16):
    w = mmidx.MegatronWriter(tmp_path / "d", dtype, ".partial")
    w.add_document(tokens[:15])
    w.add_document(tokens[15:])
    w.close()
    for tmp, final in w.outputs():
        tmp.rename(final)
    return tmp_path / "d"


def case_shard(tmp_path, raw: bytes, name="x.bin"):
    (tmp_path / name).write_bytes(raw)
    return tmp_path / name


def with_mask(tmp_path, mask_raw: bytes):
    case_shard(tmp_path, mask_raw, "x.mask")
    return case_shard(tmp_path, shard_bytes(TOKENS))


def zero_byte_shard(tmp_path):
    case_shard(tmp_path, shard_bytes(TOKENS), "x_train_000001.bin")
    case_shard(tmp_path, b"", "x_train_000002.bin")
    return tmp_path / "x"


def idx_edit(tmp_path, edit):
    prefix = megatron(tmp_path)
    idx = prefix.with_suffix(".idx")
    idx.write_bytes(edit(idx.read_bytes()))
    return prefix


def cut_bin(prefix, nbytes: int):
    binf = prefix.with_suffix(".bin")
    binf.write_bytes(binf.read_bytes()[:-nbytes])
    return prefix


def oov(tokens, at, value, dtype=np.uint16):
    t = np.array(tokens, dtype=dtype)
    t[at] = value
    return t


# name, build(tmp_path) -> data.path, data.format, the file the message must name, byte offset it must give
DAMAGED = [
    ("shard wrong magic", lambda t: case_shard(t, b"\x07" + shard_bytes(TOKENS)[1:]), "auto", "x.bin", 0),
    ("shard wrong magic, format=shard", lambda t: case_shard(t, shard_bytes(TOKENS, magic=7)), "shard", "x.bin", 0),
    ("shard wrong version", lambda t: case_shard(t, shard_bytes(TOKENS, version=2)), "auto", "x.bin", 4),
    ("shard count vs size", lambda t: case_shard(t, shard_bytes(TOKENS, count=50)), "auto", "x.bin", 1024 + 80),
    ("shard truncated", lambda t: case_shard(t, shard_bytes(TOKENS)[:-3]), "auto", "x.bin", 1024 + 80 - 3),
    ("shard trailing bytes", lambda t: case_shard(t, shard_bytes(TOKENS) + b"\0\0"), "auto", "x.bin", 1024 + 80),
    ("shard header cut short", lambda t: case_shard(t, shard_bytes(TOKENS)[:600]), "auto", "x.bin", 600),
    ("0-byte shard", zero_byte_shard, "auto", "x_train_000002.bin", 0),
    ("out-of-vocab token (shard)", lambda t: case_shard(t, shard_bytes(oov(TOKENS, 7, 50257))), "auto", "x.bin",
     1024 + 14),
    ("out-of-vocab token (flat)", lambda t: case_shard(t, oov(TOKENS, 3, 50300).tobytes(), "f.bin"), "flat",
     "f.bin", 6),
    ("out-of-vocab token (megatron int32)", lambda t: megatron(t, oov(TOKENS, 20, 70000, np.int32), np.int32),
     "auto", "d.bin", 80),
    ("mask wrong magic", lambda t: with_mask(t, shard_bytes(np.ones(40), magic=20240520, dtype=np.uint8)), "auto",
     "x.mask", 0),
    ("mask wrong length", lambda t: with_mask(t, shard_bytes(np.ones(39), magic=20240521, dtype=np.uint8)), "auto",
     "x.mask", None),
    ("idx wrong magic", lambda t: idx_edit(t, lambda b: b"MMIDIDY" + b[7:]), "auto", "d.idx", 0),
    ("idx wrong version", lambda t: idx_edit(t, lambda b: b[:9] + struct.pack("<Q", 3) + b[17:]), "megatron", "d.idx",
     9),
    ("idx counts vs size", lambda t: idx_edit(t, lambda b: b + b"\0" * 8), "auto", "d.idx", 34 + 2 * 12 + 3 * 8),
    ("idx pointer", lambda t: idx_edit(t, lambda b: b[:34 + 8 + 8] + struct.pack("<q", 4) + b[34 + 8 + 16:]), "auto",
     "d.idx", 34 + 8 + 8),
    ("bin shorter than idx says", lambda t: cut_bin(megatron(t), 4), "auto", "d.bin", 76),
    ("idx alone given as data", lambda t: (megatron(t), (t / "d.bin").unlink())[0].with_suffix(".idx"), "auto",
     "d.bin", None),
]


@pytest.mark.parametrize("name, build, fmt, bad, offset", DAMAGED, ids=[c[0] for c in DAMAGED])
def test_damaged_token_files_are_refused(tmp_path, name, build, fmt, bad, offset):
    path = build(tmp_path)
    with pytest.raises(DataError) as e:
        open_for_training(path, fmt)
    msg = e.value.message
    assert str(tmp_path / bad) in msg, msg
    if offset is not None:
        assert re.search(rf"(byte offset|from byte offset|the file ends at byte offset) {offset}\b", msg), msg
    assert e.value.hint, msg
