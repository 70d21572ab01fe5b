"""Data verbs: prepare, inspect, data fineweb."""
from __future__ import annotations

import json
import os
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

    def on_file(name: str, status: str) -> None:
        print(f"{name}: {status}", flush=True)

    # huggingface_hub reads HF_ENDPOINT itself too; passing it keeps the library free of env reads
    paths = download_fineweb(args.shards, args.out, endpoint=os.environ.get("HF_ENDPOINT") or None,
                             revision=args.revision, token=os.environ.get("HF_TOKEN") or None, on_file=on_file)
    print(f"{len(paths)} shard(s) in {args.out}; train on them with: trainbox train "
          f"data.path={Path(args.out) / 'fineweb'} data.tokenizer=gpt2")
