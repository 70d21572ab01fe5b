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
    "tokenizer": """
        examples:
          trainbox tokenizer train corpus/*.txt --vocab-size 4096 --out tok/
          trainbox tokenizer train embedded:shakespeare --vocab-size 2048 --out tok/
        """,
    "runs": """
        examples:
          trainbox runs                                    # every run under ./runs, newest first
          trainbox runs /data/experiments --json           # machine-readable, one object per run
        """,
    "logs": """
        examples:
          trainbox logs tiny                               # runs/tiny/train.log
          trainbox logs runs/gpt2-125m -f                  # follow until the run ends
          trainbox logs tiny --tail 20
        """,
    "status": """
        exit status 0 when healthy (running with fresh progress, or finished), 1 otherwise, with one
        line saying why: Docker HEALTHCHECK and Kubernetes exec probes call it.
        examples:
          trainbox status tiny                             # from runs/tiny/status.json (+ pid check)
          trainbox status http://127.0.0.1:8080            # asks the run's /health endpoint
          HEALTHCHECK CMD ["trainbox", "status", "http://127.0.0.1:8080"]
        """,
    "plot": """
        examples:
          trainbox plot runs/tiny                          # writes loss.png in the current folder
          trainbox plot runs/a runs/b --out compare.png    # train and val loss vs steps and vs tokens
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


# ----------------------------------------------------------------------------- runs, logs, status, plot


def cmd_runs(args) -> int:
    from trainbox.runs import list_runs, runs_table

    infos = list_runs(Path(args.dir))
    if args.json:
        print(json.dumps(infos, default=str, indent=1))
        return 0
    if not infos:
        print(f"no runs under {args.dir}", file=sys.stderr)
        return 0
    rows = runs_table(infos)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_logs(args) -> int:
    from trainbox.runs import follow_log, resolve_run

    run_dir = resolve_run(args.run, Path(args.root))
    try:
        for line in follow_log(run_dir, args.follow, args.tail):
            sys.stdout.write(line)
            sys.stdout.flush()
    except (KeyboardInterrupt, BrokenPipeError):
        pass
    return 0


def cmd_status(args) -> int:
    from trainbox.runs import resolve_run, run_info, url_health

    try:
        if "://" in args.target:
            ok, reason = url_health(args.target, args.timeout)
        else:
            info = run_info(resolve_run(args.target, Path(args.root)))
            ok, reason = info["healthy"], info["reason"]
    except TrainboxError as e:  # a probe answers 0 or 1 only (Docker reserves 2)
        ok, reason = False, e.message
    print(("healthy: " if ok else "unhealthy: ") + reason)
    return 0 if ok else 1


def cmd_plot(args) -> int:
    from trainbox.plot import plot_runs
    from trainbox.runs import resolve_run

    out = plot_runs([resolve_run(r, Path(args.root)) for r in args.runs], Path(args.out))
    print(f"wrote {out}")
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

    k = verb("tokenizer", "train a byte-level BPE tokenizer")
    k.add_argument("action", choices=["train"])
    k.add_argument("files", nargs="+", help="text files or folders (or embedded:shakespeare)")
    k.add_argument("--vocab-size", type=int, required=True)
    k.add_argument("--out", required=True, help="output folder (tokenizer.json) or .json path")
    k.set_defaults(func=cmd_tokenizer)

    r = verb("runs", "list runs and their state, like docker ps")
    r.add_argument("dir", nargs="?", default="runs", help="folder holding run directories (default runs)")
    r.add_argument("--json", action="store_true", help="print JSON instead of a table")
    r.set_defaults(func=cmd_runs)

    lg = verb("logs", "print or follow a run's train.log")
    lg.add_argument("run", help="run directory, or run name under --root")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the run ends")
    lg.add_argument("-n", "--tail", type=int, default=None, help="only the last N lines")
    lg.add_argument("--root", default="runs", help="folder holding run directories (default runs)")
    lg.set_defaults(func=cmd_logs)

    st = verb("status", "health check of a run or a monitor URL (exit 0 healthy, 1 not)")
    st.add_argument("target", help="run directory, run name under --root, or http://HOST:PORT")
    st.add_argument("--root", default="runs", help="folder holding run directories (default runs)")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a URL (default 5)")
    st.set_defaults(func=cmd_status)

    pl = verb("plot", "plot runs' train and validation loss against steps and tokens (PNG)")
    pl.add_argument("runs", nargs="+", help="run directories or names under --root")
    pl.add_argument("--out", default="loss.png", help="PNG to write (default loss.png)")
    pl.add_argument("--root", default="runs", help="folder holding run directories (default runs)")
    pl.set_defaults(func=cmd_plot)
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
