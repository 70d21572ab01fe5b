"""Data verbs: prepare, inspect, data fineweb, data download, tokenizer (a BPE trained on text files).

SIGINT and SIGTERM end `data fineweb` and `data download` at once, mid-read included, with one line naming what was
kept (complete files, and the `.part` file the same command continues by HTTP Range) and that command; the exit
code is 128 + the signal's number, as a shell reports a process ended by it: 130 for SIGINT, 143 for SIGTERM.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from trainbox.data.readers import first_row_is_preference, list_input_files, tokenizer_texts
from trainbox.data.tokenizer import get_tokenizer, train_bpe
from trainbox.errors import BadInput, DataError
from trainbox.model.spec import family
from trainbox.monitor.console import fmt_duration
from trainbox.train.stop import STOP  # `train` keeps stop signals for its loop: a download ends on them

# ----------------------------------------------------------------------------- prepare, inspect, data


def _prepare_progress(stream=None):
    """Progress for `prepare`: a redrawn line on a TTY, a plain line every 10 s otherwise."""
    stream = stream or sys.stderr
    tty, last = stream.isatty(), [0.0]

    def show(st) -> None:
        now = time.time()
        if not tty and now - last[0] < 10:
            return
        last[0] = now
        secs = max(st.seconds, 1e-9)
        line = (f"{st.documents:,} docs ({st.documents / secs:,.0f} docs/s), {st.tokens:,} tokens "
                f"({st.tokens / secs / 1e3:,.0f}k tokens/s), {st.bytes_read / 2**20:,.1f} MiB read")
        if st.total_bytes:
            frac = min(1.0, st.bytes_read / st.total_bytes)
            eta = secs * (1 - frac) / frac if frac > 0 else None
            line = f"[{'#' * int(frac * 24):-<24}] {frac:4.0%} {line}, eta {fmt_duration(eta)}"
        stream.write(f"\r{line}\033[K" if tty else line + "\n")
        stream.flush()
    return show


def cmd_prepare(args) -> int:
    from trainbox.data.prepare import PrepareOptions, prepare  # heavy: numpy

    if any(first_row_is_preference(f) for f in list_input_files(args.inputs)):
        return _prepare_pairs(args)

    opts = PrepareOptions(inputs=args.inputs, out=args.out, tokenizer=args.tokenizer, format=args.format,
                          text_keys=args.text_key or ["text"], chat_template=args.chat_template,
                          workers=args.workers, shard_tokens=args.shard_tokens, val_docs=args.val_docs,
                          val_fraction=args.val_fraction, append_eod=args.append_eod,
                          write_vocab=args.write_vocab, overwrite=args.overwrite)
    st = prepare(opts, progress=None if args.quiet else _prepare_progress())
    if not args.quiet and sys.stderr.isatty():
        sys.stderr.write("\n")
    secs = max(st.seconds, 1e-9)
    print(f"{st.documents:,} documents, {st.tokens:,} tokens ({st.val_documents:,} documents, {st.val_tokens:,} "
          f"tokens for validation) in {st.seconds:.1f}s: {st.documents / secs:,.0f} docs/s, "
          f"{st.tokens / secs:,.0f} tokens/s" + st.mask_summary())
    for f in st.files:
        print(f"  {f}")
    if opts.val_fraction and not st.val_documents:
        print(f"trainbox prepare: warning: {_no_validation(opts.val_fraction, st.documents)}", file=sys.stderr)
    keys = opts.text_keys if opts.format == "megatron" else None   # shards are named by split, not by key
    print(f"train on it with: {train_hint(args.out, args.tokenizer, keys)}")
    return 0


def _no_validation(fraction: float, documents: int) -> str:
    """What a --val-fraction that held out no document left, and what holds one out (fraction f of n documents
    holds one out when f >= 1/n)."""
    said = f"--val-fraction {fraction:g} held out none of the {documents:,} documents: no validation data was written"
    if documents < 2:
        return f"{said}; one document is not split: give validation data with data.val_path when training"
    return f"{said}; hold one out with --val-fraction {math.ceil(100 / documents) / 100:g} or --val-docs 1"


def _prepare_pairs(args) -> int:
    """`prepare` of preference JSONL: pair files for train.objective=dpo (rows with chosen and rejected), or example
    files for dpo.loss=kto (unpaired rows: completion and label)."""
    from trainbox.data.preference import describe, prepare_pairs  # heavy: numpy, torch

    if args.format != "shard" or args.append_eod or args.write_vocab or args.workers != 1:
        raise DataError("preference data is written as pair or example files by one process: --format, --append-eod, "
                        "--write-vocab and --workers do not apply", hint="drop those options")
    st = prepare_pairs(args.inputs, args.out, get_tokenizer(args.tokenizer), args.tokenizer, args.chat_template,
                       val_docs=args.val_docs, val_fraction=args.val_fraction, seq_len=args.seq_len,
                       max_prompt_len=args.max_prompt_len, overwrite=args.overwrite)
    print(describe(st))
    for f in st.files:
        print(f"  {f}")
    print(f"train on it with: trainbox train dpo model.path=MODEL data.path={shlex.quote(args.out)}"
          + (f" data.seq_len={args.seq_len}" if args.seq_len else "")
          + (" dpo.loss=kto" if st.kind == "examples" else ""))
    return 0


def train_hint(out: str, tokenizer: str, text_keys: list[str] | None = None) -> str:
    """The `trainbox train` command for data written to `out`: a run of its own, named after `out` (the
    default run, tiny, would resume, or refuse data it was not started on). `text_keys`: those of a Megatron set,
    whose `{out}_{key}_document` files training finds by data.text_key."""

    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(out).name).lstrip("._-")[:128] or "data"
    keys = [f"data.text_key=[{','.join(text_keys)}]"] if text_keys and list(text_keys) != ["text"] else []
    return " ".join(shlex.quote(a) for a in ("trainbox", "train", f"data.path={out}", f"data.tokenizer={tokenizer}",
                                             *keys, f"run.name={name}"))


def cmd_inspect(args) -> int:
    from trainbox.data import inspect as inspection  # heavy: numpy, torch

    _check_counts(args)
    run = _run_config(Path(args.path))
    if run is None and inspection.is_preference_data(args.path):
        report = _inspect_preferences(args)
    elif run is None:
        report = inspection.inspect_data(args.path, args.seq_len or 1024, args.global_batch, args.epochs or 1.0,
                                         args.tokenizer, data_format=args.format or "auto",
                                         chat_template=args.chat_template)
    elif run.train.objective in ("dpo", "reward"):   # its pairs (or examples) as the run reads them, its tokenizer
        from trainbox.model.build import build_tokenizer, resolve_model  # heavy: torch

        data = run.data.model_copy(update={k: v for k, v in (("seq_len", args.seq_len), ("packing", args.packing),
                                                             ("chat_template", args.chat_template)) if v is not None})
        tok = get_tokenizer(args.tokenizer) if args.tokenizer else build_tokenizer(resolve_model(run))
        pairs = run.dpo if run.train.objective == "dpo" else \
            run.dpo.model_copy(update={"max_prompt_len": run.reward.max_prompt_len})   # the reward's truncation
        report = inspection.inspect_preferences(data, pairs, tok, args.global_batch or run.train.global_batch_size,
                                                args.epochs or run.train.epochs or 1.0)
        report["run"] = {"path": args.path, "data.path": run.data.path}
    elif run.train.objective == "grpo":   # its prompts, as the run reads them
        from trainbox.model.build import build_tokenizer, resolve_model  # heavy: torch

        data = run.data.model_copy(update={"seq_len": args.seq_len} if args.seq_len else {})
        tok = get_tokenizer(args.tokenizer) if args.tokenizer else build_tokenizer(resolve_model(run))
        report = inspection.inspect_prompts(data, run.grpo, tok, args.global_batch or run.train.global_batch_size,
                                            args.epochs or run.train.epochs or 1.0)
        report["run"] = {"path": args.path, "data.path": run.data.path}
    else:   # the run's data with its settings; an option given on the command line overrides the run's
        from trainbox.model.build import adapt_datasets, model_vocab_size  # heavy: torch

        _refuse_examples(args.path, run)
        seq_len, batch = args.seq_len or run.data.seq_len, args.global_batch or run.train.global_batch_size
        tok = get_tokenizer(args.tokenizer or run.data.tokenizer)
        windows = run.model_copy(update={"data": run.data.model_copy(update={"seq_len": seq_len})})
        adapt = partial(adapt_datasets, windows, tok, model_vocab_size(run.model, tok.vocab_size))  # t5: its spans
        report = inspection.inspect_data(run.data.path, seq_len, batch, args.epochs or run.train.epochs or 1.0,
                                         args.tokenizer or run.data.tokenizer, run.data.cache_dir,
                                         args.format or run.data.format, adapt=adapt,
                                         chat_template=args.chat_template or run.data.chat_template)
        steps = run.train.max_steps or (run.train.max_tokens // (batch * seq_len) if run.train.max_tokens else None)
        report["run"] = {"path": args.path, "data.path": run.data.path, "data.tokenizer": run.data.tokenizer,
                         "max_steps": steps, "epochs": round(steps / report["steps_per_epoch"], 4) if steps else None}
    print(json.dumps(report, indent=1) if args.json else inspection.format_report(report))
    return 0


def _check_counts(args) -> None:
    """Refuse an `inspect` option that counts nothing (a usage error, as argparse's): --seq-len or --global-batch
    below 1, --epochs at or below 0."""
    default = "or leave it out for the default (a run directory's own setting)"
    for flag, value in (("--seq-len", args.seq_len), ("--global-batch", args.global_batch)):
        if value is not None and value < 1:
            raise BadInput(f"{flag} {value}: must be at least 1", hint=f"give {flag} 1 or more, {default}")
    if args.epochs is not None and args.epochs <= 0:
        raise BadInput(f"--epochs {args.epochs:g}: must be above 0", hint=f"give --epochs 1 (or 0.5, 2 ...), {default}")


def _inspect_preferences(args) -> dict:
    """`inspect` of a prepared preference set (its manifest's tokenizer unless --tokenizer) or preference JSONL."""
    from trainbox.config import DataSection, DpoSection  # heavy: the config schema (pydantic)
    from trainbox.data.inspect import inspect_preferences, preference_tokenizer  # heavy: numpy, torch

    spec = args.tokenizer or preference_tokenizer(args.path) or "gpt2"
    data = DataSection(path=args.path, tokenizer=spec, seq_len=args.seq_len or 1024, packing=bool(args.packing),
                       chat_template=args.chat_template)
    return inspect_preferences(data, DpoSection(), get_tokenizer(spec), args.global_batch, args.epochs or 1.0)


def _run_config(path: Path):
    """The config of a run directory or a checkpoint (step folder) at `path`; None for anything else."""
    from trainbox.config import build_config, load_config  # heavy: the config schema (pydantic)

    if (path / "config.yaml").is_file() and any((path / f).exists() for f in ("checkpoints", "status.json",
                                                                              "metrics.jsonl")):
        return load_config(str(path / "config.yaml"))
    if (path / "COMPLETE").is_file() and (path / "trainer.json").is_file():
        from trainbox.checkpoint import load_trainer  # heavy: torch

        return build_config(load_trainer(path)["config"])
    return None


def _refuse_examples(path: str, run) -> None:
    """`inspect` reads windows of a token dataset: a run that reads its data as examples is refused."""
    reads = family(run.model.family).hook("reads_examples")
    if reads is not None and reads(run):
        what = "fine-tuning examples"
        raise DataError(f"{path} trains on {run.data.path} as {what}, not as windows of a token dataset, "
                        f"which is what `trainbox inspect` reads",
                        hint=f"the run's train.log names the {what} and tokens it read: trainbox logs {path}")


def cmd_data(args) -> int:
    if args.dataset == "download":
        again = ["trainbox", "data", "download", *([args.recipe] if args.recipe else []), *args.overrides]
    else:
        again = ["trainbox", "data", "fineweb", "--shards", str(args.shards), "--out", args.out,
                 *(["--revision", args.revision] if args.revision else [])]
    folder = None   # until the download's folder is known
    try:
        with _stop_on_signals():
            if args.dataset == "fineweb":
                folder = args.out
                return _download_fineweb(args)
            from trainbox.config import load_config  # heavy: the config schema (pydantic), for a recipe's data
            cfg = load_config(args.recipe, args.overrides)
            folder = cfg.data.path
            return _download_for_run(cfg, args.recipe)
    except _Stopped as e:
        print(_stopped_line(f"trainbox data {args.dataset}", e.signum, folder, again), file=sys.stderr, flush=True)
        return 128 + e.signum


def _download_fineweb(args) -> int:
    from trainbox.data.hub import download_fineweb  # heavy: numpy

    hub = hub_from_env(revision=args.revision)

    def on_file(name: str, status: str) -> None:
        hub.progress.finish()
        print(f"{name}: {status}", flush=True)

    try:
        paths = download_fineweb(args.shards, args.out, hub, on_file=on_file)
    finally:
        hub.progress.finish()
    print(f"{len(paths)} shard(s) in {args.out}; train on them with: trainbox train "
          f"data.path={Path(args.out) / 'fineweb'} data.tokenizer=gpt2")
    return 0


def _download_for_run(cfg, recipe: str | None) -> int:
    """`trainbox data download RECIPE [key=value ...]`: what `trainbox train` with the same arguments downloads."""
    paths = fetch_run_data(cfg, recipe)
    if paths is None:
        why = ("data.download=false" if not cfg.data.download else
               f"data.path={cfg.data.path} exists and is not a download folder" if cfg.data.source else
               "the config names no data.source")
        print(f"nothing to download: {why}")
        return 0
    print(f"{len(paths)} file(s) in {cfg.data.path}: what `trainbox train {recipe or ''}` reads")
    return 0


class _Stopped(BaseException):
    """Raised by the handler of SIGINT/SIGTERM in a download verb; a BaseException, as KeyboardInterrupt is, so no
    `except Exception` on the way catches it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _stop_on_signals():
    """While the block runs, the first SIGINT or SIGTERM raises _Stopped wherever the download is (a blocking read
    included: it ends at once, not at the next chunk); later ones are ignored while it unwinds. What reached the
    `.part` file stays there: it is only ever appended to, so it is always a prefix of the file."""
    def handle(signum, frame) -> None:
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        raise _Stopped(signum)

    old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stopped_line(verb: str, signum: int, folder: str | None, again: list[str]) -> str:
    """What a download ended by `signum` leaves in `folder` (complete files, `.part` files and their sizes) and
    the command that continues it."""
    from trainbox.data.hub import MARKER  # heavy: numpy

    files = sorted(p for p in Path(folder).iterdir() if p.name != MARKER) if folder and Path(folder).is_dir() else []
    parts = [p for p in files if p.name.endswith(".part")]
    kept = [f"{len(files) - len(parts)} complete file(s)"] if len(files) > len(parts) else []
    kept += [f"{p.stat().st_size:,} bytes of {p.name[1:-len('.part')]} in {p}" for p in parts]
    what = "kept " + " and ".join(kept) if kept else "nothing was downloaded yet"
    return f"{verb}: stopped by {signal.Signals(signum).name}; {what}; continue with: {shlex.join(again)}"


def fetch_run_data(cfg, recipe: str | None, main: bool = True) -> list[Path] | None:
    """Download data.source into data.path when data.path is missing (data/hub.py ensure_source); None when there
    is nothing to fetch. `main`: this process shows the progress (rank 0)."""
    from trainbox.data.hub import download_target, ensure_source, run_samples  # heavy: numpy

    d, t = cfg.data, cfg.train
    if download_target(d.path, d.source, d.download) is None:
        return None
    hub = hub_from_env(show=main)
    hub.stopped = lambda: signal.Signals(STOP.signum).name if STOP.signum is not None else None
    samples = run_samples(t.global_batch_size, d.seq_len, t.max_steps, t.max_tokens)
    try:
        paths = ensure_source(d.path, d.source, d.download, samples, d.seq_len, hub,
                              on_plan=(lambda line: print(line, file=sys.stderr, flush=True)) if main else None)
    except DataError as e:
        raise DataError(f"data.path={d.path}: downloading data.source={d.source} into it failed: {e.message}",
                        hint=(f"{e.hint}; or " if e.hint else "") + "point data.path at local token shards, fetch "
                             f"them ahead with `trainbox data download {recipe or 'RECIPE'} [key=value ...]`, or set "
                             "data.download=false") from None
    finally:
        hub.progress.finish()
    return paths


def hub_from_env(revision: str | None = None, show: bool = True):
    """The hub endpoint, token and offline flag from HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE, with a progress
    line on stderr."""
    from trainbox.data.hub import DEFAULT_ENDPOINT, Hub  # heavy: numpy

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return Hub(endpoint=os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT, revision=revision or "main",
               token=os.environ.get("HF_TOKEN") or None, offline=offline, progress=DownloadLine(enabled=show))


class DownloadLine:
    """The download's progress on stderr: one line redrawn on a TTY (file, percent, bytes, rate, ETA), a plain line
    every 10 s otherwise."""

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled, self.tty, self.last, self.drawn = enabled, self.stream.isatty(), 0.0, False

    def __call__(self, p) -> None:

        now = time.monotonic()
        if not self.enabled or now - self.last < (0.2 if self.tty else 10.0):
            return
        self.last = now
        rate = (p.done - p.resumed) / max(now - p.started, 1e-6)
        files = f"file {p.index} of {p.count}" if p.count else f"file {p.index}"
        if p.total:
            eta = (p.total - p.done) / rate if rate > 0 else None
            where = f"{p.done / p.total:4.0%} {p.done / 1e6:,.1f} of {p.total / 1e6:,.1f} MB, eta {fmt_duration(eta)}"
        else:
            where = f"{p.done / 1e6:,.1f} MB"
        line = f"{p.name} ({files}): {where}, {rate / 1e6:,.1f} MB/s"
        self.stream.write(f"\r{line}\033[K" if self.tty else line + "\n")
        self.stream.flush()
        self.drawn = True

    def finish(self) -> None:
        """End the redrawn line (before other output)."""
        if self.drawn and self.tty:
            self.stream.write("\n")
            self.stream.flush()
        self.drawn, self.last = False, 0.0


# ----------------------------------------------------------------------------- tokenizer


def cmd_tokenizer(args) -> int:
    out, size = train_bpe(tokenizer_texts(args.files, args.text_key or ["text"]), args.vocab_size, args.out)
    fewer = f", fewer than the {args.vocab_size:,} asked: the text has no more merges" if size < args.vocab_size else ""
    print(f"wrote {out} (vocab {size:,}{fewer}); use it with data.tokenizer={out}")
    return 0
