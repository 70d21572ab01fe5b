"""benchmarks/make_corpus.py against the recipe its docstring documents, written out again here from the files of a
small generated folder: which files count, their order, the token streams and the shard files."""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import load_benchmark

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
ASSETS = REPO / "src" / "trainbox" / "assets"
EOT = 50256


def gpt2():
    """tiktoken's GPT-2 from the shipped BPE files, built here without trainbox."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(ASSETS / "vocab.bpe"),
                                            encoder_json_file=str(ASSETS / "encoder.json"))
    pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
    return tiktoken.Encoding(name="gpt2-test", pat_str=pat, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)


def source(i: int, lines: int) -> str:
    rng = random.Random(i)
    body = "".join(f"    total += {rng.randint(0, 999)} * value_{i}_{k}  # step {k} of {rng.choice('abcdef')}\n"
                   for k in range(lines))
    return f'"""Module {i}."""\n\n\ndef function_{i}(value):\n    total = 0\n{body}    return total\n'


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A folder of .py files with every case the recipe names: sizes outside 1,000..2,000,000 bytes, skipped
    folders (any case), a duplicate content, a symlink to a counted file, a non-UTF-8 file, a non-.py file."""
    root = tmp_path_factory.mktemp("roots") / "lib"
    for i in range(14):
        d = root / f"pkg{i % 4}" / ("sub" if i % 3 == 0 else "")
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod_{i}.py").write_text(source(i, 24 + 7 * i))
    (root / "pkg1" / "copy_of_mod_2.py").write_text(source(2, 24 + 14))          # same bytes as pkg2/mod_2.py
    os.symlink(root / "pkg0" / "sub" / "mod_0.py", root / "pkg3" / "link.py")    # one real path: counted once
    for skipped in ("tests", "Testing", "__pycache__", "_tests", "test"):
        (root / "pkg0" / skipped).mkdir()
        (root / "pkg0" / skipped / "mod_x.py").write_text(source(100, 40))
    (root / "pkg2" / "small.py").write_text("x = 1\n")                               # under 1,000 bytes
    (root / "pkg2" / "notes.txt").write_text(source(101, 40))
    (root / "pkg2" / "latin1.py").write_bytes(source(102, 40).encode() + b"# caf\xe9\n")  # not UTF-8
    return root


def expected(root: Path, train_cap: int, val_cap: int, max_doc: int) -> tuple[np.ndarray, np.ndarray]:
    """The recipe written out: sorted real paths, duplicates by content dropped, Random(1337) shuffle, EOT +
    encode_ordinary per document (cut into pieces of max_doc - 1 behind their own EOT), val first, then train."""
    paths, skip = set(), {"test", "tests", "testing", "_tests", "__pycache__"}
    for p in root.rglob("*.py"):
        if any(part.lower() in skip for part in p.relative_to(root).parts):
            continue
        if 1000 <= p.resolve().stat().st_size <= 2_000_000:
            paths.add(str(p.resolve()))
    kept, seen = [], set()
    for p in sorted(paths):
        h = hashlib.sha1(Path(p).read_bytes()).hexdigest()
        if h not in seen:
            seen.add(h)
            kept.append(p)
    random.Random(1337).shuffle(kept)
    enc = gpt2()
    val, train = [], []
    for p in kept:
        try:
            ids = enc.encode_ordinary(Path(p).read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue
        step = max_doc - 1 if max_doc > 1 else max(len(ids), 1)
        doc = [t for i in range(0, max(len(ids), 1), step) for t in [EOT, *ids[i:i + step]]]
        if len(val) < val_cap:
            val += doc
        elif len(train) < train_cap:
            train += doc
    return np.array(val, dtype=np.uint16), np.array(train, dtype=np.uint16)


def read_shard(path: Path) -> np.ndarray:
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520 and header[1] == 1
    tokens = np.fromfile(path, dtype=np.uint16, offset=1024)
    assert len(tokens) == header[2]
    return tokens


@pytest.mark.parametrize("train_cap, max_doc", [(2500, 0), (2500, 64), (10**9, 0)])
def test_build_follows_the_recipe(tree, tmp_path, train_cap, max_doc):
    """val then train from the shuffled unique files, each document EOT-first, the train stream stopped after the
    document that reaches its cap (or at the last file), shards of shard_tokens with the remainder in the last,
    the same streams as nanoGPT's flat files, and their sha256 in stats.json."""
    make_corpus = load_benchmark("make_corpus")
    want_val, want_train = expected(tree, train_cap=train_cap, val_cap=1500, max_doc=max_doc)
    stats = make_corpus.build(tmp_path, [str(tree)], train_tokens=train_cap, val_tokens=1500, shard_tokens=1000,
                              max_doc_tokens=max_doc, workers=1)
    assert stats["files_listed"] == 16 and stats["files_unique"] == 15   # 14 modules, the copy, the latin-1 file
    if train_cap > 10**6:   # every file consumed: the latin-1 one is skipped
        assert stats["files_consumed"] == 15 and stats["files_skipped_non_utf8"] == 1
    val = read_shard(tmp_path / "modded" / "pyc_val_000000.bin")
    shards = sorted((tmp_path / "modded").glob("pyc_train_*.bin"))
    train = np.concatenate([read_shard(s) for s in shards])
    assert len(want_val) >= 1500 and len(want_train) >= 2500 and len(shards) == len(want_train) // 1000
    assert [len(read_shard(s)) for s in shards[:-1]] == [1000] * (len(shards) - 1)
    assert np.array_equal(val, want_val) and np.array_equal(train, want_train)
    assert np.array_equal(np.fromfile(tmp_path / "nanogpt" / "val.bin", dtype=np.uint16), want_val)
    assert np.array_equal(np.fromfile(tmp_path / "nanogpt" / "train.bin", dtype=np.uint16), want_train)
    assert stats["sha256_train"] == hashlib.sha256(want_train.tobytes()).hexdigest()
    assert stats["sha256_val"] == hashlib.sha256(want_val.tobytes()).hexdigest()
    assert stats == json.loads((tmp_path / "stats.json").read_text())
    if max_doc:
        starts = np.flatnonzero(train == EOT)
        assert np.diff(np.append(starts, len(train))).max() <= max_doc


def test_cli_checks_another_build(tree, tmp_path):
    """The command line with --roots and two workers builds the same streams as build() in one process, and
    --check-against prints a record saying so (exit 0)."""
    make_corpus = load_benchmark("make_corpus")
    make_corpus.build(tmp_path / "a", [str(tree)], 2500, 1500, 1000, 0, 1)
    proc = subprocess.run([sys.executable, str(BENCH / "make_corpus.py"), "--roots", str(tree), "--out",
                           str(tmp_path / "b"), "--train-tokens", "2500", "--val-tokens", "1500", "--shard-tokens",
                           "1000", "--workers", "2", "--check-against", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["tool"] == "make_corpus" and record["metrics"]["identical_streams"] is True
    assert record["metrics"]["sha256_train"] == record["baseline"]["metrics"]["sha256_train"]


# Runs build() with more workers than this machine has CPUs, one file a task, caps reached after the first few
# tasks (so the others are in flight when the build stops), and reports how each worker process was started and
# whether anything stopped one: multiprocessing.Pool.terminate() did, and with workers still sending their results
# it deadlocked on the result pipe's lock (the build that never ended on a 64-core host).
EARLY_STOP = """
import json, sys
from multiprocessing import process
sys.path.insert(0, sys.argv[1])
import make_corpus
started, stopped = [], []
start, terminate, kill = process.BaseProcess.start, process.BaseProcess.terminate, process.BaseProcess.kill
process.BaseProcess.start = lambda self: (started.append(self._start_method), start(self))[1]
process.BaseProcess.terminate = lambda self: (stopped.append(self.pid), terminate(self))[1]
process.BaseProcess.kill = lambda self: (stopped.append(self.pid), kill(self))[1]
make_corpus.FILES_PER_TASK = 1
stats = make_corpus.build(__import__("pathlib").Path(sys.argv[3]), [sys.argv[2]], train_tokens=2500, val_tokens=1500,
                          shard_tokens=1000, workers=int(sys.argv[4]))
print(json.dumps({"started": started, "stopped": stopped, "sha256_train": stats["sha256_train"],
                  "files_consumed": stats["files_consumed"]}))
"""


def test_early_stop_with_many_workers_lets_them_finish(tree, tmp_path):
    """8 spawned workers on 2 CPUs: the build ends (within the timeout) with the streams of a build in one process,
    having stopped none of its workers."""
    make_corpus = load_benchmark("make_corpus")
    one = make_corpus.build(tmp_path / "one", [str(tree)], 2500, 1500, 1000, 0, 1)
    proc = subprocess.run([sys.executable, "-c", EARLY_STOP, str(BENCH), str(tree), str(tmp_path / "many"), "8"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["started"] == ["spawn"] * 8 and report["stopped"] == [], report   # no fork, nothing killed
    assert report["files_consumed"] < 15   # stopped at the caps, with files left
    assert report["sha256_train"] == one["sha256_train"]


def test_default_workers_are_the_usable_cpus_at_most_16(monkeypatch):
    """os.cpu_count() is the host's; a container may get a few of them."""
    make_corpus = load_benchmark("make_corpus")
    monkeypatch.setattr(os, "cpu_count", lambda: 256)
    for usable, want in ((2, 2), (64, 16), (1, 1)):
        if hasattr(os, "process_cpu_count"):   # Python 3.13+
            monkeypatch.setattr(os, "process_cpu_count", lambda n=usable: n)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=usable: set(range(n)))
        assert make_corpus.default_workers() == want


def test_a_stuck_or_dead_worker_names_its_files():
    from concurrent.futures import Future
    from concurrent.futures import TimeoutError as FutureTimeout
    from concurrent.futures.process import BrokenProcessPool

    make_corpus = load_benchmark("make_corpus")
    tasks = [(["/lib/a.py", "/lib/b.py"], 0), (["/lib/c.py"], 0)]
    for error, says in ((FutureTimeout(), f"gave no result in {make_corpus.TASK_TIMEOUT_S} s (4 worker processes)"),
                        (BrokenProcessPool("terminated abruptly"), "a worker process died during")):
        future = Future()
        future.set_exception(error)
        with pytest.raises(RuntimeError, match="task 1 of 2 \\(1 files, the first /lib/c.py\\)") as e:
            make_corpus._result(1, future, tasks, 4)
        assert says in str(e.value)


def test_a_tokenizer_that_cannot_load_fails_with_its_own_error(monkeypatch):
    """Without trainbox importable, every spawned worker's initializer fails; the build must say that, not that a
    worker died (out of memory?)."""
    make_corpus = load_benchmark("make_corpus")

    def missing():
        raise ModuleNotFoundError("No module named 'trainbox'")

    monkeypatch.setattr(make_corpus, "_load_tokenizer", missing)
    with pytest.raises(ModuleNotFoundError, match="trainbox"):
        next(make_corpus.tokenized([(["/lib/a.py"], 0)], 2))
