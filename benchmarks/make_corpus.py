"""The benchmark corpus: GPT-2 tokens of the Python source files already on the machine, for offline GPU runs.

    python benchmarks/make_corpus.py --out /tmp/corpus                           # 300M train / 10.6M val tokens
    python benchmarks/make_corpus.py --out /tmp/corpus --max-doc-tokens 2048     # the speedrun recipes' corpus
    python benchmarks/make_corpus.py --out /tmp/c2 --train-tokens 2000000 --val-tokens 200000 \
        --check-against /tmp/c1 --record       # same streams as another build of the recipe? (sha256, a record)

The recipe, a pure function of the files under the roots:
  1. roots: the interpreter's site-packages folders, its stdlib and purelib folders (real paths; a root inside
     another is dropped), or --roots.
  2. every *.py file under them, not descending into folders named test, tests, testing, _tests or __pycache__
     (any case), of 1,000 to 2,000,000 bytes; by real path, each once, sorted; a file whose bytes equal an
     earlier one's (SHA-1) is dropped.
  3. the list is shuffled with random.Random(1337), whole files, so train is stationary and val a random sample.
  4. a file that is not UTF-8 is skipped; any other becomes EOT (50256) followed by its GPT-2 tokens
     (tiktoken's encode_ordinary, the BPE shipped in trainbox/assets). With --max-doc-tokens M > 1 the tokens are
     cut into pieces of M - 1, each behind its own EOT.
  5. in shuffled order, documents go to val until it holds --val-tokens, then to train until it holds
     --train-tokens (the document that crosses a cap is kept whole).
  6. OUT/modded/pyc_val_000000.bin and OUT/modded/pyc_train_00000N.bin (shard format: 256 int32 header with
     magic 20240520, version 1 and the token count, then uint16 tokens; train in shards of --shard-tokens, the
     last holding the remainder), OUT/nanogpt/{train,val}.bin (the same streams as plain uint16), and
     OUT/stats.json (counts, the streams' sha256, timings). A folder that already has stats.json is left as it is.

The streams' sha256 identify a corpus: two builds with the same roots and caps give the same ones.

Tokenizing runs in --workers processes (default: the CPUs this process may use, at most MAX_WORKERS), started
with "spawn" (a fork of this process would copy its threads' locks: numpy's BLAS pool, the pool's own threads) and
fed at most two tasks each ahead of the writer. When the caps are reached the tasks in flight finish before the
pool shuts down, so no worker is stopped while it sends a result: multiprocessing.Pool.terminate() with a dozen
workers still sending waits forever on the result pipe's lock. A worker that dies (out of memory) or sends nothing
for TASK_TIMEOUT_S ends the build with an error naming its files.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import multiprocessing
import os
import random
import site
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import common
import numpy as np

EOT = 50256
SEED = 1337
MIN_BYTES, MAX_BYTES = 1000, 2_000_000
SKIP_DIRS = frozenset({"test", "tests", "testing", "_tests", "__pycache__"})
FILES_PER_TASK = 64
MAX_WORKERS = 16       # more only add start-up and memory: the tokenizing is over in seconds
TASK_TIMEOUT_S = 600   # a task is 64 files of at most 2 MB each, seconds of work: one silent this long is stuck


def default_workers() -> int:
    """The CPUs this process may run on (os.cpu_count() counts the host's, whatever the container gets), at most
    MAX_WORKERS."""
    usable = os.process_cpu_count() if hasattr(os, "process_cpu_count") else (  # Python 3.13+
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    return max(1, min(usable or 1, MAX_WORKERS))


def default_roots() -> list[str]:
    """The interpreter's site-packages, stdlib and purelib folders, as real paths, without one inside another."""
    paths = sysconfig.get_paths()
    found = {os.path.realpath(p) for p in [*site.getsitepackages(), paths["stdlib"], paths["purelib"]]
             if p and os.path.isdir(p)}
    return sorted(r for r in found if not any(r != o and r.startswith(o + os.sep) for o in found))


def source_files(roots: list[str]) -> list[str]:
    """Real paths of the *.py files under `roots` in the size range, outside skipped folders, sorted."""
    found = set()
    for root in roots:
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [d for d in subfolders if d.lower() not in SKIP_DIRS]
            for name in names:
                if not name.endswith(".py"):
                    continue
                try:
                    real = os.path.realpath(os.path.join(folder, name))
                    size = os.path.getsize(real)
                except OSError:
                    continue
                if MIN_BYTES <= size <= MAX_BYTES:
                    found.add(real)
    return sorted(found)


def unique_contents(paths: list[str]) -> list[str]:
    """`paths` without files whose bytes equal an earlier path's (unreadable files dropped)."""
    seen, kept = set(), []
    for path in paths:
        try:
            digest = hashlib.sha1(Path(path).read_bytes()).digest()
        except OSError:
            continue
        if digest not in seen:
            seen.add(digest)
            kept.append(path)
    return kept


_tokenizer = None


def _load_tokenizer() -> None:
    global _tokenizer
    from trainbox.data.tokenizer import get_tokenizer
    _tokenizer = get_tokenizer("gpt2")


def documents(paths: list[str], max_doc_tokens: int) -> list[tuple[np.ndarray | None, int]]:
    """Each file as (uint16 tokens with EOT in front of every piece, its size in bytes); (None, 0) when it cannot
    be read as UTF-8 text."""
    out = []
    for path in paths:
        try:
            raw = Path(path).read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            out.append((None, 0))
            continue
        ids = np.asarray(_tokenizer.encode(text), dtype=np.uint16)
        piece = max_doc_tokens - 1 if max_doc_tokens > 1 else max(len(ids), 1)
        parts = []
        for start in range(0, max(len(ids), 1), piece):
            parts += [np.array([EOT], dtype=np.uint16), ids[start:start + piece]]
        out.append((np.concatenate(parts), len(raw)))
    return out


def _documents_task(task: tuple[list[str], int]):
    return documents(*task)


def tokenized(tasks: list[tuple[list[str], int]], workers: int):
    """documents() of each task, in order: in this process for workers <= 1, else in `workers` spawned processes
    with at most 2 x workers tasks submitted ahead. Closing the generator early lets the tasks in flight finish.
    The tokenizer loads here first, so that one which cannot load (trainbox not importable) fails with its own
    error instead of killing every worker as it starts."""
    _load_tokenizer()
    if workers <= 1:
        yield from map(_documents_task, tasks)
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_load_tokenizer)
    ahead = collections.deque()
    try:
        for i, task in enumerate(tasks):
            ahead.append((i, pool.submit(_documents_task, task)))
            if len(ahead) >= 2 * workers:
                yield _result(*ahead.popleft(), tasks, workers)
        while ahead:
            yield _result(*ahead.popleft(), tasks, workers)
    except GeneratorExit:   # the caps are reached
        for _, future in ahead:
            future.cancel()
        pool.shutdown(wait=True)
        raise
    except BaseException:   # a stuck or dead worker, or Ctrl-C: stop them all now
        if hasattr(pool, "kill_workers"):   # Python 3.14+; before it, only the executor's own table of them
            pool.kill_workers()
        else:
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _result(index: int, future, tasks: list[tuple[list[str], int]], workers: int):
    """The future's documents, or an error that names the task's files."""
    files = tasks[index][0]
    where = f"task {index} of {len(tasks)} ({len(files)} files, the first {files[0]})"
    try:
        return future.result(timeout=TASK_TIMEOUT_S)
    except FutureTimeout:
        raise RuntimeError(f"make_corpus: {where} gave no result in {TASK_TIMEOUT_S} s ({workers} worker processes); "
                           "rerun with --workers 1 to tokenize in this process") from None
    except BrokenProcessPool as e:
        raise RuntimeError(f"make_corpus: a worker process died during {where} ({e}; {workers} workers: out of "
                           "memory?); rerun with fewer --workers") from None


def write_shard(path: Path, tokens: np.ndarray) -> None:
    from trainbox.data.formats import write_shard as write
    write(path, tokens)


def build(out: Path, roots: list[str], train_tokens: int, val_tokens: int, shard_tokens: int,
          max_doc_tokens: int = 0, workers: int = 1) -> dict:
    """Build the corpus into `out` (see the module docstring) and return its stats.json."""
    t0 = time.time()
    listed = source_files(roots)
    files = unique_contents(listed)
    random.Random(SEED).shuffle(files)
    t_list = time.time() - t0
    print(f"roots={roots} listed={len(listed)} unique={len(files)} list_time={t_list:.1f}s", file=sys.stderr,
          flush=True)
    streams = {"val": [], "train": []}
    counts = {"val": 0, "train": 0}
    docs = {"val": 0, "train": 0}
    nbytes = {"val": 0, "train": 0}
    caps = {"val": val_tokens, "train": train_tokens}
    used = skipped = 0
    tasks = [(files[i:i + FILES_PER_TASK], max_doc_tokens) for i in range(0, len(files), FILES_PER_TASK)]
    results = tokenized(tasks, workers)
    try:
        for batch in results:
            for tokens, size in batch:
                split = "val" if counts["val"] < caps["val"] else "train"
                if counts["train"] >= caps["train"]:
                    break
                used += 1
                if tokens is None:
                    skipped += 1
                    continue
                streams[split].append(tokens)
                counts[split] += len(tokens)
                docs[split] += 1
                nbytes[split] += size
            if counts["train"] >= caps["train"]:
                break
    finally:
        results.close()   # the tasks in flight finish, then the workers exit
    t_tok = time.time() - t0
    val, train = (np.concatenate(streams[s]) if streams[s] else np.zeros(0, np.uint16) for s in ("val", "train"))
    (out / "modded").mkdir(parents=True, exist_ok=True)
    (out / "nanogpt").mkdir(parents=True, exist_ok=True)
    write_shard(out / "modded" / "pyc_val_000000.bin", val)
    n_shards = max(1, len(train) // shard_tokens)
    bounds = [i * shard_tokens for i in range(n_shards)] + [len(train)]
    for i in range(n_shards):
        write_shard(out / "modded" / f"pyc_train_{i + 1:06d}.bin", train[bounds[i]:bounds[i + 1]])
    train.tofile(out / "nanogpt" / "train.bin")
    val.tofile(out / "nanogpt" / "val.bin")
    stats = {
        "roots": roots, "files_listed": len(listed), "files_unique": len(files), "files_consumed": used,
        "files_skipped_non_utf8": skipped, "val_docs": docs["val"], "train_docs": docs["train"],
        "val_tokens": int(len(val)), "train_tokens": int(len(train)), "val_bytes": nbytes["val"],
        "train_bytes": nbytes["train"], "train_shard_tokens": [b - a for a, b in zip(bounds, bounds[1:])],
        "eot_count_val": int((val == EOT).sum()), "eot_count_train": int((train == EOT).sum()),
        "sha256_val": hashlib.sha256(val.tobytes()).hexdigest(),
        "sha256_train": hashlib.sha256(train.tobytes()).hexdigest(),
        "min_bytes": MIN_BYTES, "max_bytes": MAX_BYTES, "seed": SEED, "max_doc_tokens": max_doc_tokens,
        "nproc": workers, "time_tokenize_s": round(t_tok, 1), "time_total_s": round(time.time() - t0, 1),
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/corpus"), help="output folder")
    ap.add_argument("--train-tokens", type=int, default=300_000_000, help="train stream cap")
    ap.add_argument("--val-tokens", type=int, default=10_600_000, help="val stream size")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per train shard")
    ap.add_argument("--max-doc-tokens", type=int, default=0,
                    help="cut documents into pieces of this many tokens, each behind an EOT (0: never)")
    ap.add_argument("--roots", nargs="+", help="folders to read *.py files from (default: this Python's)")
    ap.add_argument("--workers", type=int, default=default_workers(),
                    help=f"tokenizing processes (default: the usable CPUs, at most {MAX_WORKERS})")
    ap.add_argument("--check-against", type=Path, metavar="DIR",
                    help="another build's folder (its stats.json): are the two streams the same? (sha256)")
    ap.add_argument("--check-command", help="the command that made the --check-against build (for the record)")
    ap.add_argument("--record", action="store_true", help="write the result to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: corpus, or corpus-builder-parity with --check-against)")
    args = ap.parse_args()
    roots = [os.path.realpath(r) for r in args.roots] if args.roots else default_roots()
    done = args.out / "stats.json"
    if done.exists():
        print(f"corpus already present: {done}", file=sys.stderr)
        stats = json.loads(done.read_text())
    else:
        stats = build(args.out, roots, args.train_tokens, args.val_tokens, args.shard_tokens, args.max_doc_tokens,
                      args.workers)
    options = [f"--train-tokens={args.train_tokens}", f"--val-tokens={args.val_tokens}",
               f"--shard-tokens={args.shard_tokens}", f"--max-doc-tokens={args.max_doc_tokens}"]
    if args.check_against is None:
        common.emit(common.Result(tool="make_corpus", what=args.what or "corpus", overrides=options, metrics=stats),
                    args.record)
        return
    other = json.loads((args.check_against / "stats.json").read_text())
    keys = ("sha256_train", "sha256_val", "train_tokens", "val_tokens", "train_shard_tokens")
    same = all(stats[k] == other[k] for k in keys)
    common.emit(common.Result(
        tool="make_corpus", what=args.what or "corpus-builder-parity", overrides=options,
        metrics={"identical_streams": same, **{k: stats[k] for k in (*keys, "train_docs", "val_docs")}},
        baseline={"name": next((w for w in (args.check_command or "").split() if w.endswith(".py")),
                               f"the build in {args.check_against}"),
                  "command": args.check_command,
                  "metrics": {k: other.get(k) for k in (*keys, "train_docs", "val_docs")}},
        notes="identical_streams: the sha256 of the train and val token streams, their token counts and the train "
              "shard sizes equal the other build's"), args.record)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
