"""trainbox command line: one function per verb.

This is the only module that reads environment variables, prints for humans, or exits. Library code
raises typed errors (trainbox.errors); `main` turns each into one short message and an exit code, with a
traceback only when TRAINBOX_DEBUG=1.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
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
          torchrun --nproc_per_node 8 --signals-to-handle SIGTERM,SIGINT,SIGUSR1 -m trainbox train gpt2-125m
                                                           # SIGUSR1 (Slurm --signal) also stops cleanly
        """,
    "generate": """
        examples:
          trainbox generate runs/tiny --prompt "ROMEO:" --max-tokens 100 --temperature 0.8 --top-k 50 --seed 1
          trainbox generate runs/tiny/checkpoints/step_00000300 --prompt "To be" --top-p 0.9
          trainbox generate runs/t5-tiny --prompt "To be, or <extra_id_0> to be" --temperature 0   # t5: fills spans
        """,
    "export": """
        examples:
          trainbox export runs/gpt2-125m --format hf --out hf/gpt2-125m   # newest checkpoint of the run
          trainbox export runs/tiny/checkpoints/step_00000400 --format hf --out hf/tiny --force
          # then: GPT2LMHeadModel.from_pretrained("hf/gpt2-125m"), AutoTokenizer.from_pretrained(...)
          trainbox export runs/lora --format hf --out lora-adapter       # PEFT adapter (PeftModel.from_pretrained)
          trainbox export runs/lora --format hf --merge --out lora-merged  # base + adapter, base precision
          trainbox export runs/qlora --format hf --merge --force --out merged  # QLoRA: merge into a bf16 base
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
    "launch": """
        examples:
          trainbox launch compose gpt2-125m --image ghcr.io/me/trainbox:0.1.0-cu128-torch2.8.0 --gpus-per-node 8
          trainbox launch k8s gpt2-125m train.max_steps=5000 --image IMG --nodes 2 --gpus-per-node 8 --apply
          trainbox launch slurm gpt2-125m --nodes 4 --gpus-per-node 8 --partition gpu --time 48:00:00
          trainbox launch image --registry ghcr.io/me --tag latest --push --dry-run
        """,
    "doctor": """
        examples:
          trainbox doctor                                  # this machine: torch, GPUs, bf16, caches, disk
          trainbox doctor speedrun-124m                    # exit 1 if something that recipe needs is missing
          trainbox doctor gpt2-125m data.path=/data/fineweb --json
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
    if args.recipe and args.recipe.endswith(".json") and "LOCAL_RANK" not in os.environ:
        from trainbox.hfargs import mapping_report
        report = mapping_report(args.recipe)
        if report:
            print(report, file=sys.stderr)
    if args.nproc and args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _launch_torchrun(args, cfg)
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


def _launch_torchrun(args, cfg) -> int:
    """`trainbox train --nproc N ...` re-runs itself under torchrun (standalone rendezvous).

    torchrun runs in its own session, so a terminal Ctrl-C reaches only this launcher, which forwards
    SIGTERM / SIGINT / SIGUSR1 exactly once; torchrun (told to handle SIGUSR1 too) passes it to every
    worker, the workers agree on a step boundary, save and exit 0. torchrun itself then exits non-zero
    (it re-raises the signal), so a stop that left the run "preempted" is reported as success."""
    import signal
    import subprocess
    import time

    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    from torch.distributed.run import get_args_parser

    known = {o for action in get_args_parser()._actions for o in action.option_strings}
    extra = []  # flags of newer torchruns (older ones pass SIGTERM/SIGINT only, and wait 30 s before SIGKILL)
    if "--signals-to-handle" in known:
        extra.append("--signals-to-handle=" + ",".join(s.name for s in (*stops, signal.SIGHUP, signal.SIGQUIT)))
    if "--shutdown-timeout" in known:
        extra.append(f"--shutdown-timeout={cfg.train.pg_timeout_s}")  # time for the ranks to save before SIGKILL
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", *extra,
           "-m", "trainbox", "train", *([args.recipe] if args.recipe else []), *args.overrides]
    print("launching: " + " ".join(cmd), file=sys.stderr)
    started = time.time()
    proc = subprocess.Popen(cmd, start_new_session=True)
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in stops}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if forwarded and code != 0:
        status = cfg.run_dir / "status.json"
        try:   # written by this launch's rank 0, not left over from an earlier one
            phase = json.loads(status.read_text()).get("phase") if status.stat().st_mtime >= started else None
        except (OSError, ValueError):
            phase = None
        if phase == "preempted":
            print(f"stopped on {signal.Signals(forwarded[0]).name} with a checkpoint; run the same command "
                  "to continue", file=sys.stderr)
            return 0
    return code


# ----------------------------------------------------------------------------- generate


def cmd_generate(args) -> int:
    import torch

    from trainbox.generate import load_for_inference, sample

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, cfg = load_for_inference(args.path, device)
    if cfg.model.family == "t5":  # encoder-decoder: print what the model fills in for each sentinel
        from trainbox.data.spans import fill_prompt
        from trainbox.generate import fill_spans
        spans = fill_spans(model, tokenizer, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, device=device)
        for k, text in spans:
            print(f"<extra_id_{k}>{text}")
        print(f"--- filled ---\n{fill_prompt(args.prompt, spans)}")
        return 0
    text = sample(model, tokenizer, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, device=device)
    print(args.prompt + text)
    return 0


# ----------------------------------------------------------------------------- export


def cmd_export(args) -> int:
    from trainbox import checkpoint
    from trainbox.config import build_config

    ckpt = checkpoint.resolve(args.path)
    family = build_config(checkpoint.load_trainer(ckpt)["config"]).model.family
    if family == "hf":  # LoRA / QLoRA runs: PEFT adapter, or the merged model with --merge
        from trainbox.export_lora import export_lora_hf
        out = args.out or str(Path(args.path.rstrip("/")).name + ("-merged" if args.merge else "-hf"))
        res = export_lora_hf(ckpt, out, merge=args.merge, force=args.force)
        print(f"wrote {res['kind']} ({res['dtype']}) to {res['out']} from {res['checkpoint']}")
        if not res["merged"]:
            print(f"load it with: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({res['base']!r}), "
                  f"{res['out']!r})")
        return 0
    if args.merge:
        raise ConfigError(f"--merge applies to LoRA runs; {ckpt} is a model.family={family} run")
    if family == "t5":  # T5ForConditionalGeneration folder
        from trainbox.generate import load_for_inference
        from trainbox.model.t5 import to_hf

        model, tok, _ = load_for_inference(ckpt)
        out = Path(args.out or str(Path(args.path.rstrip("/")).name + "-hf"))
        if out.exists() and any(out.iterdir()) and not args.force:
            raise ConfigError(f"{out} exists and is not empty", hint="choose another --out or pass --force")
        to_hf(model, out, eos_token_id=tok.eot_id)
        print(f"wrote {out} (Hugging Face T5ForConditionalGeneration: config.json, model.safetensors)")
        return 0
    from trainbox.export import export_hf

    out = export_hf(args.path, args.out or str(Path(args.path.rstrip("/")).name + "-hf"), force=args.force)
    print(f"wrote {out} (Hugging Face format: config.json, model.safetensors, tokenizer)")
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


# ----------------------------------------------------------------------------- launch


def cmd_launch(args) -> int:
    from trainbox.launch.apply import run_commands

    if args.target == "image":
        return _launch_image(args)
    from trainbox.launch import LaunchSpec, render, write_rendered

    spec = LaunchSpec(target=args.target, recipe=args.recipe, overrides=args.overrides, image=args.image,
                      nodes=args.nodes, min_nodes=args.min_nodes, gpus_per_node=args.gpus_per_node, gpu_vendor=args.gpu_vendor,
                      workspace=args.workspace, namespace=args.namespace, runs_pvc=args.runs_pvc,
                      data_pvc=args.data_pvc, storage=args.storage, storage_class=args.storage_class,
                      cpus=args.cpus, memory=args.memory, shm=args.shm, time=args.time, partition=args.partition,
                      account=args.account, host_port=args.port)
    rendered = render(spec)
    out = Path(args.out or f"deploy/{spec.config().run_name}-{args.target}")
    for path in write_rendered(rendered, out):
        print(f"wrote {path}")
    commands = rendered.apply_commands(out)
    for cmd in commands:
        print(f"{'apply' if args.apply else 'to apply'}: {' '.join(cmd)}")
    for note in rendered.notes:
        print(note)
    if args.apply and not args.dry_run:
        return run_commands(commands, Path.cwd())
    return 0


def _launch_image(args) -> int:
    from trainbox.launch.apply import run_commands
    from trainbox.launch.image import build_commands

    context = Path(args.context)
    commands = build_commands(context, args.registry, args.tag, rocm=args.rocm, push=args.push,
                              build_args=args.build_arg, platform=args.platform)
    for cmd in commands:
        print(" ".join(cmd))
    return 0 if args.dry_run else run_commands(commands, context)


# ----------------------------------------------------------------------------- doctor


def cmd_doctor(args) -> int:
    from trainbox.config import load_config
    from trainbox.doctor import as_json, run_checks

    cfg = load_config(args.recipe, args.overrides) if (args.recipe or args.overrides) else None
    checks = run_checks(dict(os.environ), cfg)
    if args.json:
        print(json.dumps(as_json(checks), indent=1))
    else:
        for c in checks:
            print(f"{c.status.upper() if c.status != 'ok' else 'ok':<5} {c.name:<15} {c.value}")
            if c.fix:
                print(f"{'':<22}-> {c.fix}")
    failed = [c.name for c in checks if c.status == "fail"]
    if failed and not args.json:
        print(f"missing for {cfg.recipe if cfg else 'this run'}: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


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

    e = verb("export", "write a run or checkpoint in Hugging Face format (LoRA: adapter, or merged with --merge)")
    e.add_argument("path", help="run directory or checkpoint folder")
    e.add_argument("--format", choices=["hf"], default="hf", help="hf: safetensors model folder (or PEFT adapter)")
    e.add_argument("--out", default=None, help="output folder (default: RUN-hf, or RUN-merged with --merge)")
    e.add_argument("--merge", action="store_true", help="LoRA: fold the adapter into the base and save the model")
    e.add_argument("--force", action="store_true",
                   help="replace an existing --out; LoRA: merge even into a 4/8-bit base (reloaded in bf16)")
    e.set_defaults(func=cmd_export)

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

    la = verb("launch", "render (and apply) Docker Compose, Kubernetes or Slurm files for a run; build images")
    la.add_argument("target", choices=["compose", "k8s", "slurm", "image"])
    la.add_argument("recipe", nargs="?", help="recipe name (or, for slurm, a config file on a shared filesystem)")
    la.add_argument("overrides", nargs="*", help="dotted overrides passed to trainbox train")
    la.add_argument("--image", help="container image (compose, k8s; slurm: run in it through pyxis)")
    la.add_argument("--nodes", type=int, default=1)
    la.add_argument("--min-nodes", type=int, help="k8s: elastic job (elasticPolicy) on min-nodes..nodes nodes")
    la.add_argument("--gpus-per-node", type=int, default=1, help="processes (GPUs) per node")
    la.add_argument("--gpu-vendor", choices=["nvidia", "amd"], default="nvidia")
    la.add_argument("--out", help="folder for the files (default deploy/RUN-TARGET)")
    la.add_argument("--apply", action="store_true", help="run docker compose up / kubectl apply / sbatch")
    la.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    la.add_argument("--workspace", action="store_true", help="k8s: a dev-workspace Pod instead of a PyTorchJob")
    la.add_argument("--namespace", help="k8s namespace")
    la.add_argument("--runs-pvc", default="trainbox-runs", help="k8s claim for runs and caches")
    la.add_argument("--data-pvc", default="trainbox-data", help="k8s claim for token files")
    la.add_argument("--storage", default="100Gi", help="k8s size of each claim")
    la.add_argument("--storage-class", help="k8s storage class (must offer ReadWriteMany for several nodes)")
    la.add_argument("--cpus", type=int, default=16, help="CPU cores per node")
    la.add_argument("--memory", default="64Gi", help="memory per node")
    la.add_argument("--shm", default="16Gi", help="/dev/shm size")
    la.add_argument("--time", default="24:00:00", help="slurm time limit")
    la.add_argument("--partition", help="slurm partition")
    la.add_argument("--account", help="slurm account")
    la.add_argument("--port", type=int, default=8080, help="compose: host port (127.0.0.1 only) of the dashboard")
    la.add_argument("--registry", help="image: registry prefix, e.g. ghcr.io/me")
    la.add_argument("--tag", help="image: an extra tag besides the stack tag")
    la.add_argument("--rocm", action="store_true", help="image: build docker/Dockerfile.rocm")
    la.add_argument("--push", action="store_true", help="image: push after building")
    la.add_argument("--build-arg", action="append", default=[], help="image: NAME=VALUE (e.g. TORCH_VERSION=2.9.0)")
    la.add_argument("--platform", default="linux/amd64", help="image: target platform")
    la.add_argument("--context", default=".", help="image: repository root (build context)")
    la.set_defaults(func=cmd_launch)

    d = verb("doctor", "report the environment: torch, CUDA/ROCm, GPUs, bf16, FlexAttention, caches, disk")
    d.add_argument("recipe", nargs="?", help="also check what this recipe or config file needs")
    d.add_argument("overrides", nargs="*")
    d.add_argument("--json", action="store_true", help="machine-readable report")
    d.set_defaults(func=cmd_doctor)
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
    # TRAINBOX_OVERRIDES (set by the container images: monitor.host=0.0.0.0) come before the command line's
    env_overrides = shlex.split(os.environ.get("TRAINBOX_OVERRIDES", ""))
    if env_overrides and hasattr(args, "overrides"):
        args.overrides = [*env_overrides, *args.overrides]
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
