"""trainbox command line: one function per verb.

This is the only module that reads environment variables, prints for humans, or exits. Library code
raises typed errors (trainbox.errors); `main` turns each into one short message and an exit code, with a
traceback only when TRAINBOX_DEBUG=1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

from trainbox.errors import ConfigError, TrainboxError

EPILOGS = {
    "train": """
        examples:
          trainbox train                                   # recipe tiny on the embedded Shakespeare corpus
          trainbox train gpt2-125m data.path=data/fineweb train.max_steps=5000
          trainbox train --nproc 2 tiny train.max_steps=50 # two processes through torchrun
        """,
    "generate": """
        examples:
          trainbox generate runs/tiny --prompt "ROMEO:" --max-tokens 100 --temperature 0.8 --top-k 50 --seed 1
          trainbox generate runs/tiny/checkpoints/step_00000300 --prompt "To be" --top-p 0.9
        """,
    "config": """
        examples:
          trainbox config show tiny train.max_steps=50     # the resolved config as YAML
          trainbox config schema                           # JSON schema of every key
          trainbox config validate my_run.yaml             # exit 2 with the offending key if invalid
        """,
    "prepare": """
        examples:
          trainbox prepare corpus/ --out data/corpus --workers 4 --val-fraction 0.01
          trainbox prepare pile.jsonl.gz --text-key text --format megatron --append-eod --write-vocab --out data/pile
          trainbox prepare chats.jsonl --tokenizer tok/ --out data/sft --val-docs 100   # loss on assistant tokens only
        """,
    "inspect": """
        examples:
          trainbox inspect data/corpus --seq-len 1024 --global-batch 512 --epochs 2
          trainbox inspect data/pile_text_document --seq-len 2048
          trainbox inspect data/fineweb/fineweb_val_000000.bin --json
        """,
    "data": """
        examples:
          trainbox data fineweb --shards 8 --out data/fineweb       # 800M GPT-2 tokens + the val shard
          trainbox data fineweb --shards 1 --out data/fineweb       # re-run: complete files are skipped
          HF_ENDPOINT=http://mirror:8080 trainbox data fineweb --shards 2 --out data/fineweb
        """,
    "tokenizer": """
        examples:
          trainbox tokenizer train corpus/*.txt --vocab-size 4096 --out tok/
          trainbox tokenizer train embedded:shakespeare --vocab-size 2048 --out tok/
        """,
}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


# ----------------------------------------------------------------------------- train


def cmd_train(args) -> int:
    from trainbox.config import load_config

    cfg = load_config(args.recipe, args.overrides)
    if args.nproc and args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _launch_torchrun(args)
    from trainbox.monitor.console import ProgressBar, setup_logging
    from trainbox.train.distributed import Dist
    from trainbox.train.loop import train

    dist = Dist(rank=_env_int("RANK", 0), world=_env_int("WORLD_SIZE", 1), local_rank=_env_int("LOCAL_RANK", 0))
    mode = cfg.monitor.progress
    bar = dist.is_main and (mode == "bar" or (mode == "auto" and sys.stderr.isatty()))
    log_file = None
    if dist.is_main:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        log_file = cfg.run_dir / "train.log"
    setup_logging(log_file, console=dist.is_main, bar=bar)
    result = train(cfg, dist, argv=["trainbox", "train", *sys.argv[2:]], progress=ProgressBar(enabled=bar))
    if dist.is_main:
        if result.get("val_loss") is not None:
            print(f"validation: {result['val_loss']:.4f} nats/token, {result['val_bpb']:.4f} bits/byte "
                  f"({result['val_tokens']:,} tokens)")
        if result.get("sample"):
            print(f"--- sample ---\n{cfg.train.sample_prompt}{result['sample']}")
        print(f"run directory: {result['run_dir']}")
    return 0


def _launch_torchrun(args) -> int:
    """`trainbox train --nproc N ...` re-runs itself under torchrun (standalone rendezvous)."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "trainbox", "train", *([args.recipe] if args.recipe else []), *args.overrides]
    print("launching: " + " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return proc.wait()


# ----------------------------------------------------------------------------- generate


def cmd_generate(args) -> int:
    import torch

    from trainbox.generate import load_for_inference, sample

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, _ = load_for_inference(args.path, device)
    text = sample(model, tokenizer, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, device=device)
    print(args.prompt + text)
    return 0


# ----------------------------------------------------------------------------- config


def cmd_config(args) -> int:
    from trainbox.config import RunConfig, dump_yaml, load_config

    if args.action == "schema":
        print(json.dumps(RunConfig.model_json_schema(), indent=1))
        return 0
    cfg = load_config(args.source, args.overrides)
    if args.action == "show":
        print(dump_yaml(cfg), end="")
    else:
        print(f"{args.source or 'tiny'}: valid")
    return 0


# ----------------------------------------------------------------------------- tokenizer


def cmd_tokenizer(args) -> int:
    from trainbox.data.tokenizer import train_bpe

    def texts():
        for f in args.files:
            if f.startswith("embedded:"):
                from trainbox.data import embedded
                yield from embedded.split("train")
                continue
            p = Path(f)
            for path in sorted(p.rglob("*")) if p.is_dir() else [p]:
                if path.is_file():
                    yield path.read_text(encoding="utf-8", errors="replace")

    out = train_bpe(texts(), args.vocab_size, args.out)
    print(f"wrote {out} (vocab {args.vocab_size}); use it with data.tokenizer={out}")
    return 0


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
    print(f"train on it with: trainbox train data.path={args.out} data.tokenizer={args.tokenizer}")
    return 0


def cmd_inspect(args) -> int:
    from trainbox.data.inspect import format_report, inspect_data

    report = inspect_data(args.path, args.seq_len, args.global_batch, args.epochs, args.tokenizer)
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
    return 0


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainbox", description="Train language models: data, pretraining, "
                                "fine-tuning, monitoring, deployment.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=textwrap.dedent(EPILOGS.get(name, "")),
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    t = verb("train", "train a model (no arguments: recipe tiny on the embedded corpus)")
    t.add_argument("recipe", nargs="?", help="recipe name or config file (.yaml/.json); default tiny")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=50")
    t.add_argument("--nproc", type=int, default=None, help="start N processes through torchrun")
    t.set_defaults(func=cmd_train)

    g = verb("generate", "sample text from a run or checkpoint")
    g.add_argument("path", help="run directory or checkpoint folder")
    g.add_argument("--prompt", default="\n")
    g.add_argument("--max-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=None)
    g.set_defaults(func=cmd_generate)

    c = verb("config", "show, validate or describe the config")
    c.add_argument("action", choices=["show", "schema", "validate"])
    c.add_argument("source", nargs="?", help="recipe name or config file")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(func=cmd_config)

    pr = verb("prepare", "tokenize text / JSONL / chat JSONL into shard or Megatron token files")
    pr.add_argument("inputs", nargs="+", help=".txt (one document each), .jsonl, .jsonl.gz, or folders of them")
    pr.add_argument("--out", required=True, help="output prefix, e.g. data/corpus")
    pr.add_argument("--tokenizer", default="gpt2", help="gpt2, embedded:shakespeare-bpe, tokenizer.json or folder")
    pr.add_argument("--format", choices=["shard", "megatron"], default="shard")
    pr.add_argument("--text-key", action="append", help="JSONL field(s) holding text (repeatable; default text)")
    pr.add_argument("--chat-template", default=None, help="chatml or a .jinja file (default: the tokenizer's, "
                    "else chatml)")
    pr.add_argument("--workers", type=int, default=1, help="tokenizer processes (output identical for any N)")
    pr.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard")
    pr.add_argument("--val-docs", type=int, default=0, help="hold out the first N documents for validation")
    pr.add_argument("--val-fraction", type=float, default=0.0, help="hold out this fraction of documents")
    pr.add_argument("--append-eod", action="store_true", help="megatron: end-of-document token after each document")
    pr.add_argument("--write-vocab", action="store_true", help="write gpt2-vocab.json and gpt2-merges.txt beside")
    pr.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    pr.add_argument("--quiet", action="store_true", help="no progress line")
    pr.set_defaults(func=cmd_prepare)

    ins = verb("inspect", "documents, tokens, samples and steps of a token dataset")
    ins.add_argument("path", help="token file, Megatron prefix, shard prefix or folder")
    ins.add_argument("--seq-len", type=int, default=1024)
    ins.add_argument("--global-batch", type=int, default=None, help="sequences per step: prints steps per epoch")
    ins.add_argument("--epochs", type=float, default=1.0)
    ins.add_argument("--tokenizer", default=None, help="count documents by its EOT and check ids against its vocab")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.set_defaults(func=cmd_inspect)

    da = verb("data", "download datasets")
    da.add_argument("dataset", choices=["fineweb"], help="fineweb: kjj0/fineweb10B-gpt2 GPT-2 shards")
    da.add_argument("--shards", type=int, required=True, help="training shards (100M tokens each) + the val shard")
    da.add_argument("--out", default="data/fineweb", help="output folder")
    da.add_argument("--revision", default=None, help="dataset revision (branch, tag or commit)")
    da.set_defaults(func=cmd_data)

    k = verb("tokenizer", "train a byte-level BPE tokenizer")
    k.add_argument("action", choices=["train"])
    k.add_argument("files", nargs="+", help="text files or folders (or embedded:shakespeare)")
    k.add_argument("--vocab-size", type=int, required=True)
    k.add_argument("--out", required=True, help="output folder (tokenizer.json) or .json path")
    k.set_defaults(func=cmd_tokenizer)
    return p


def _version() -> str:
    import trainbox
    return f"trainbox {trainbox.__version__}"


def _split_overrides(args) -> None:
    """`trainbox train train.max_steps=5` : a first positional with '=' is an override, not a recipe."""
    rec = getattr(args, "recipe", None) if hasattr(args, "recipe") else None
    if rec and "=" in rec:
        args.overrides = [rec, *args.overrides]
        args.recipe = None
    src = getattr(args, "source", None)
    if src and "=" in src:
        args.overrides = [src, *args.overrides]
        args.source = None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _split_overrides(args)
    debug = os.environ.get("TRAINBOX_DEBUG", "") not in ("", "0")
    try:
        return args.func(args) or 0
    except TrainboxError as e:
        if debug:
            raise
        print(f"trainbox {args.verb}: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"  -> {e.hint}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an unexpected bug: one line, and how to see the traceback
        if debug:
            raise
        print(f"trainbox {args.verb}: unexpected error: {type(e).__name__}: {e}\n"
              f"  -> run again with TRAINBOX_DEBUG=1 for the traceback", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
