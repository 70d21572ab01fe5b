"""Data verbs: prepare, inspect, data fineweb."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

# ----------------------------------------------------------------------------- prepare, inspect, data


def _prepare_progress(stream=None):
    """Progress for `prepare`: a redrawn line on a TTY, a plain line every 10 s otherwise."""
    import time
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
            from trainbox.monitor.console import fmt_duration
            frac = min(1.0, st.bytes_read / st.total_bytes)
            eta = secs * (1 - frac) / frac if frac > 0 else None
            line = f"[{'#' * int(frac * 24):-<24}] {frac:4.0%} {line}, eta {fmt_duration(eta)}"
        stream.write(f"\r{line}\033[K" if tty else line + "\n")
        stream.flush()
    return show


def cmd_prepare(args) -> int:
    from trainbox.data.prepare import PrepareOptions, prepare

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
          f"{st.tokens / secs:,.0f} tokens/s" + ("; loss mask on assistant tokens" if st.masked else ""))
    for f in st.files:
        print(f"  {f}")
    print(f"train on it with: {train_hint(args.out, args.tokenizer)}")
    return 0


def train_hint(out: str, tokenizer: str) -> str:
    """The `trainbox train` command for data written to `out`: a run of its own, named after `out` (the
    default run, tiny, would resume, or refuse data it was not started on)."""
    import re
    import shlex

    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(out).name).lstrip("._-")[:128] or "data"
    return " ".join(shlex.quote(a) for a in ("trainbox", "train", f"data.path={out}", f"data.tokenizer={tokenizer}",
                                             f"run.name={name}"))


def cmd_inspect(args) -> int:
    from trainbox.data.inspect import format_report, inspect_data

    report = inspect_data(args.path, args.seq_len, args.global_batch, args.epochs, args.tokenizer,
                          data_format=args.format)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def cmd_data(args) -> int:
    from trainbox.data.hub import download_fineweb

    if args.dataset == "download":
        return _download_for_run(args)
    hub = hub_from_env(revision=args.revision)

    def on_file(name: str, status: str) -> None:
        hub.progress.finish()
        print(f"{name}: {status}", flush=True)

    paths = download_fineweb(args.shards, args.out, hub, on_file=on_file)
    print(f"{len(paths)} shard(s) in {args.out}; train on them with: trainbox train "
          f"data.path={Path(args.out) / 'fineweb'} data.tokenizer=gpt2")
    return 0


def _download_for_run(args) -> int:
    """`trainbox data download RECIPE [key=value ...]`: what `trainbox train` with the same arguments downloads."""
    from trainbox.config import load_config

    cfg = load_config(args.recipe, args.overrides)
    paths = fetch_run_data(cfg, args.recipe)
    if paths is None:
        why = ("data.download=false" if not cfg.data.download else
               f"data.path={cfg.data.path} exists and is not a download folder" if cfg.data.source else
               "the config names no data.source")
        print(f"nothing to download: {why}")
        return 0
    print(f"{len(paths)} file(s) in {cfg.data.path}: what `trainbox train {args.recipe or ''}` reads")
    return 0


def fetch_run_data(cfg, recipe: str | None, main: bool = True) -> list[Path] | None:
    """Download data.source into data.path when data.path is missing (data/hub.py ensure_source); None when there
    is nothing to fetch. `main`: this process shows the progress (rank 0)."""
    from trainbox.data.hub import download_target, ensure_source, run_samples
    from trainbox.errors import DataError

    d, t = cfg.data, cfg.train
    if download_target(d.path, d.source, d.download) is None:
        return None
    hub = hub_from_env(show=main)
    from trainbox.train.stop import STOP  # `train` keeps stop signals for its loop: a download ends on them
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
    from trainbox.data.hub import DEFAULT_ENDPOINT, Hub

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
        import time

        from trainbox.monitor.console import fmt_duration
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
