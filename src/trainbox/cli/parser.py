"""The command line's parser: one subcommand per verb, each handled by a function of cli/train.py, cli/model.py,
cli/configure.py, cli/data.py, cli/runs.py, cli/ops.py or cli/evaluate.py (cli/app.py runs them)."""
from __future__ import annotations

import argparse
import textwrap

import trainbox
from trainbox.cli.data import cmd_data, cmd_inspect, cmd_prepare, cmd_tokenizer
from trainbox.cli.epilogs import EPILOGS
from trainbox.cli.evaluate import cmd_eval
from trainbox.cli.model import cmd_chat, cmd_export, cmd_generate
from trainbox.cli.runs import cmd_attach, cmd_logs, cmd_plot, cmd_runs, cmd_status, cmd_stop


class _Parser(argparse.ArgumentParser):
    """argparse, with a pointer to the dotted config key when an unknown --option names one (--max-steps 5 ->
    train.max_steps=5)."""

    def error(self, message: str):
        if "unrecognized arguments:" in message:
            words = message.split("unrecognized arguments:", 1)[1].split()
            hints = [_config_key_for(w, words[i + 1] if i + 1 < len(words) else None) for i, w in enumerate(words)]
            hints = [h for h in hints if h]
            if hints:
                message += "; config settings are dotted key=value arguments: " + " ".join(hints)
        super().error(message)


def _config_key_for(option: str, value: str | None) -> str | None:
    if not option.startswith("--"):
        return None
    from trainbox.config import RunConfig  # heavy: the config schema (pydantic), only for this message
    name, _, inline = option[2:].partition("=")
    name = name.replace("-", "_")
    for section, field in RunConfig.model_fields.items():
        fields = getattr(field.annotation, "model_fields", {})
        if name in fields:
            v = inline or (value if value is not None and not value.startswith("--") else "VALUE")
            return f"{section}.{name}={v}"
    return None


# The verbs that read a config (cli/train.py, cli/configure.py, cli/ops.py) are imported when they run: the config
# schema and what those modules bring (launchers, the monitor's server) are 0.2 s of every start that `prepare`,
# `inspect`, `generate`, `chat`, `runs`, `logs`, `stop` or `status` do not need.


def cmd_train(args) -> int:
    from trainbox.cli.train import cmd_train as run  # heavy: the config schema (pydantic)
    return run(args)


def cmd_config(args) -> int:
    from trainbox.cli.configure import cmd_config as run  # heavy: the config schema (pydantic)
    return run(args)


def _ops(name: str):
    """The verb `name` of cli/ops.py, imported when it runs."""
    def call(args) -> int:
        from trainbox.cli import ops  # heavy: the config schema (pydantic)
        return getattr(ops, name)(args)
    call.__name__ = name
    return call


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="trainbox", description="Train language models: data, pretraining, "
                                "fine-tuning, monitoring, deployment.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=textwrap.dedent(EPILOGS.get(name, "")),
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    t = verb("train", "train a model (no arguments: recipe tiny on the embedded corpus)")
    t.add_argument("recipe", nargs="?", help="recipe name or config file (.yaml/.json); default tiny")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=50")
    t.add_argument("--nproc", type=int, default=None, help="start N processes through torchrun (per node)")
    t.add_argument("--nnodes", type=int, default=1, help="nodes of the job: start the same command on each, with "
                   "its --node-rank and one --rdzv-endpoint (c10d rendezvous)")
    t.add_argument("--node-rank", type=int, default=0, help="this node's number, 0..nnodes-1 (0 hosts the "
                   "rendezvous)")
    t.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="where the nodes meet: node 0's address and a free "
                   "port")
    t.add_argument("--rdzv-id", default=None, help="the job's rendezvous id (default: the run name)")
    t.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts the workers this often after a "
                   "failure (with several nodes: once every node is back); each restart resumes from the newest "
                   "checkpoint")
    t.add_argument("--detach", action="store_true", help="run in the background, in its own session (output in "
                   "RUN/train.log and RUN/console.log); prints the run directory, monitor URL and how to stop it")
    t.set_defaults(func=cmd_train)

    g = verb("generate", "sample text from a run or checkpoint")
    g.add_argument("path", help="run directory or checkpoint folder")
    g.add_argument("--prompt", default="\n")
    g.add_argument("--max-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.8)
    _sampling(g)
    g.set_defaults(func=cmd_generate)

    ev = verb("eval", "lm-eval tasks on a run, a checkpoint or a Hugging Face folder (needs trainbox[eval]); "
                      "prints lm-eval's table and writes RUN/eval/<time>.json")
    ev.add_argument("path", help="run directory, checkpoint folder (step_*) or Hugging Face model folder")
    ev.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (wildcards as lm-eval's) "
                    "or task YAML files")
    ev.add_argument("--include-path", action="append", help="a folder of task YAML files (repeatable)")
    ev.add_argument("--limit", type=float, default=None, help="documents per task (below 1: a fraction of them)")
    ev.add_argument("--batch-size", type=int, default=32, help="sequences per forward (default 32)")
    ev.add_argument("--num-fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    ev.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when there is one)")
    ev.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                    help="compute dtype: autocast over fp32 weights (a Hugging Face folder: its weights in it); "
                    "auto: bf16 on a GPU that has it, else fp32")
    ev.add_argument("--out", default=None, help="folder for the record (default RUN/eval)")
    ev.set_defaults(func=cmd_eval)

    ch = verb("chat", "chat with a run in its chat template, streaming; one answer per line of standard input")
    ch.add_argument("path", help="run directory or checkpoint folder")
    ch.add_argument("--system", default=None, help="a system message that opens the conversation")
    ch.add_argument("--max-tokens", type=int, default=256, help="most tokens an answer may have (default 256)")
    ch.add_argument("--temperature", type=float, default=0.7, help="0: greedy (default 0.7)")
    _sampling(ch)
    ch.set_defaults(func=cmd_chat)

    e = verb("export", "write a run or checkpoint in Hugging Face format (LoRA: adapter, or merged with --merge) "
                       "or as a GGUF file")
    e.add_argument("path", help="run directory or checkpoint folder")
    e.add_argument("--format", choices=["hf", "gguf"], default="hf",
                   help="hf: safetensors model folder (or PEFT adapter); gguf: one file for llama.cpp")
    e.add_argument("--out", default=None, help="output folder, or file for gguf (default: RUN-hf, RUN-merged with "
                   "--merge, RUN-TYPE.gguf)")
    e.add_argument("--dtype", default=None, help="hf: the weights' dtype, bf16, fp16 or fp32 (default: fp32; a "
                   "merged LoRA: the base's own)")
    e.add_argument("--gguf-type", default=None, help="gguf: f16 (default), bf16, q8_0, q5_1, q5_0, q4_1 or q4_0 (the "
                                                      "output matrix of the last four in q8_0)")
    e.add_argument("--merge", action="store_true", help="LoRA: fold the adapter into the base and save the model")
    e.add_argument("--force", action="store_true",
                   help="replace an existing --out; LoRA: merge even into a 4/8-bit base (reloaded in bf16)")
    e.set_defaults(func=cmd_export)

    c = verb("config", "show, validate or describe the config")
    c.add_argument("action", choices=["show", "schema", "validate"])
    c.add_argument("--json", action="store_true", help="schema: the JSON Schema instead of the list of keys")
    c.add_argument("--nproc", type=int, default=1, help="validate: every check `train --nproc N` makes before any "
                   "work, for a run on N processes (default 1)")
    c.add_argument("source", nargs="?", help="recipe name or config file")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(func=cmd_config)

    pr = verb("prepare", "tokenize text / JSONL / chat JSONL into shard or Megatron token files, preference JSONL "
                         "into pair (or, unpaired, example) files")
    pr.add_argument("inputs", nargs="+", help=".txt (one document each), .jsonl, .jsonl.gz, or folders of them")
    pr.add_argument("--out", required=True, help="output prefix, e.g. data/corpus")
    pr.add_argument("--tokenizer", default="gpt2", help="gpt2, embedded:shakespeare-bpe, tokenizer.json or folder")
    pr.add_argument("--format", choices=["shard", "megatron"], default="shard")
    pr.add_argument("--text-key", action="append", help="JSONL field(s) holding text (repeatable; default text)")
    pr.add_argument("--chat-template", default=None, help="chatml or a .jinja file (default: the tokenizer's, "
                    "else chatml)")
    pr.add_argument("--workers", type=int, default=1, help="tokenizer processes (output identical for any N; "
                    "with gpt2, one process already encodes on several threads)")
    pr.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard")
    pr.add_argument("--val-docs", type=int, default=0, help="hold out the first N documents for validation")
    pr.add_argument("--val-fraction", type=float, default=0.0, help="hold out this fraction of documents")
    pr.add_argument("--append-eod", action="store_true", help="megatron: end-of-document token after each document")
    pr.add_argument("--write-vocab", action="store_true", help="write gpt2-vocab.json and gpt2-merges.txt beside")
    pr.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    pr.add_argument("--quiet", action="store_true", help="no progress line")
    pr.add_argument("--seq-len", type=int, default=None, help="preference pairs: count the pairs that training "
                    "at this data.seq_len cuts (a prompt loses its start down to --max-prompt-len), and refuse "
                    "those that even the cut leaves no room for a response")
    pr.add_argument("--max-prompt-len", type=int, default=None, help="preference pairs: dpo.max_prompt_len for "
                    "that count (default half of --seq-len)")
    pr.set_defaults(func=cmd_prepare)

    ins = verb("inspect", "documents, tokens, samples and steps of a token dataset, or of the data a run trains on")
    ins.add_argument("path", help="token file, Megatron prefix, shard prefix or folder; or a run directory or "
                                  "checkpoint: its data, with its settings")
    ins.add_argument("--seq-len", type=int, default=None, help="default 1024, or the run's data.seq_len")
    ins.add_argument("--global-batch", type=int, default=None, help="sequences per step: prints steps per epoch "
                                                                    "(default: the run's train.global_batch_size)")
    ins.add_argument("--epochs", type=float, default=None, help="default 1, or the run's train.epochs")
    ins.add_argument("--tokenizer", default=None, help="count documents by its EOT and check ids against its vocab "
                                                       "(default: the run's data.tokenizer)")
    ins.add_argument("--format", choices=["auto", "shard", "megatron", "flat"], default=None,
                     help="which token file format to accept, as data.format (default auto: detected by content; "
                          "or the run's data.format)")
    ins.add_argument("--chat-template", default=None, help="chat and preference JSONL: chatml or a .jinja file, as "
                     "data.chat_template renders them (default: the tokenizer's, or the run's data.chat_template)")
    ins.add_argument("--packing", action=argparse.BooleanOptionalAction, default=None,
                     help="preference pairs: packed into rows of 2 x seq_len, as data.packing=true trains them "
                          "(default: off, or the run's data.packing)")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.set_defaults(func=cmd_inspect)

    da = verb("data", "download datasets (HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE apply; downloads resume)")
    das = da.add_subparsers(dest="dataset", required=True, metavar="DATASET")
    fw = das.add_parser("fineweb", help="kjj0/fineweb10B-gpt2 GPT-2 shards into a folder",
                        description="the validation shard and N training shards of kjj0/fineweb10B-gpt2")
    fw.add_argument("--shards", type=int, required=True, help="training shards (100M tokens each) + the val shard")
    fw.add_argument("--out", default="data/fineweb", help="output folder")
    fw.add_argument("--revision", default=None, help="dataset revision (branch, tag or commit)")
    dd = das.add_parser("download", help="what `trainbox train RECIPE ...` would download (its data.source)",
                        description="download the data.source files a run reads into its data.path, as `trainbox "
                        "train` does when data.path is missing (for a cluster: before the job starts)")
    dd.add_argument("recipe", nargs="?", help="recipe name or config file")
    dd.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=50")
    da.set_defaults(func=cmd_data)

    k = verb("tokenizer", "train a byte-level BPE tokenizer")
    k.add_argument("action", choices=["train"])
    k.add_argument("files", nargs="+", help=".txt and JSONL files or folders, as prepare reads them (or "
                   "embedded:shakespeare)")
    k.add_argument("--vocab-size", type=int, required=True)
    k.add_argument("--text-key", action="append", help="JSONL field(s) holding text (repeatable; default text)")
    k.add_argument("--out", required=True, help="output folder (tokenizer.json) or .json path")
    k.set_defaults(func=cmd_tokenizer)

    la = verb("launch", "render (and apply) Docker Compose, Kubernetes, Slurm or SkyPilot files for a run; build "
                        "images and push them to every region's registry")
    la.add_argument("target", choices=["compose", "k8s", "slurm", "sky", "image"])
    la.add_argument("recipe", nargs="?", help="recipe name (or, for slurm, a config file on a shared filesystem)")
    la.add_argument("overrides", nargs="*", help="dotted overrides passed to trainbox train")
    la.add_argument("--image", help="container image (compose, k8s; slurm: run in it through pyxis; sky: "
                    "image_id); with --registries its name:tag only")
    la.add_argument("--nodes", type=int, default=1)
    la.add_argument("--min-nodes", type=int, help="k8s: elastic job (elasticPolicy) on min-nodes..nodes nodes")
    la.add_argument("--gpus-per-node", type=int, default=1, help="processes (GPUs) per node")
    la.add_argument("--gpus", metavar="NAME:COUNT", help="sky: accelerators per node, e.g. H100:8")
    la.add_argument("--region", help="the cluster's region: picks the image's registry from --registries FILE "
                    "(k8s, sky); sky: also resources.region")
    la.add_argument("--registries", metavar="FILE", help="YAML/JSON mapping region -> registry; image: push to "
                    "every one; k8s/sky: pull from --region's")
    la.add_argument("--bucket", help="sky: the bucket holding the run directory (default trainbox-RUN)")
    la.add_argument("--store", help="sky: the bucket's store (s3, gcs, azure, r2, ...; default: the cloud's)")
    la.add_argument("--gpu-vendor", choices=["nvidia", "amd"], default="nvidia")
    la.add_argument("--out", help="folder for the files (default deploy/RUN-TARGET)")
    la.add_argument("--apply", action="store_true", help="run docker compose up / kubectl apply / sbatch")
    la.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    la.add_argument("--workspace", action="store_true", help="k8s: a dev-workspace Pod instead of a PyTorchJob")
    la.add_argument("--api", choices=["pytorchjob", "trainer"], default="pytorchjob",
                    help="k8s: a Kubeflow PyTorchJob (training operator) or a Kubeflow Trainer v2 TrainJob with "
                         "its ClusterTrainingRuntime")
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
    la.add_argument("--registry", action="append", default=[], help="image: registry prefix, e.g. ghcr.io/me; "
                    "repeat it to push one image (one digest) to several")
    la.add_argument("--tag", help="image: an extra tag besides the stack tag")
    la.add_argument("--rocm", action="store_true", help="image: build docker/Dockerfile.rocm")
    la.add_argument("--push", action="store_true", help="image: push after building")
    la.add_argument("--build-arg", action="append", default=[], help="image: NAME=VALUE (e.g. TORCH_VERSION=2.9.0)")
    la.add_argument("--platform", default="linux/amd64", help="image: target platform")
    la.add_argument("--context", default=".", help="image: repository root (build context)")
    la.set_defaults(func=_ops("cmd_launch"))

    pn = verb("plan", "memory per GPU of a run (parameters, gradients, optimizer state, activations, "
                      "communication, overhead), whether it fits, and what would; exit 1 when it does not fit")
    pn.add_argument("recipe", nargs="?", help="recipe name or config file (.yaml/.json); default tiny")
    pn.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.micro_batch_size=32")
    pn.add_argument("--nproc", type=int, default=1, help="GPUs the run is spread over (default 1)")
    pn.add_argument("--gpu", default=None, help="the GPU to plan for: H100, H200, A100-80GB, A100-40GB, L40S, "
                    "MI300X, ... (default: this machine's)")
    pn.add_argument("--gpu-mem", type=float, default=None, help="or the memory of one GPU, in GiB")
    pn.add_argument("--flash", action="store_true", help="with --gpu: trainbox[flash] is installed there "
                    "(FlashAttention-4 and QuACK's kernels on Hopper and Blackwell GPUs)")
    pn.add_argument("--json", action="store_true", help="the plan as JSON")
    pn.set_defaults(func=_ops("cmd_plan"))

    d = verb("doctor", "report the environment: torch, CUDA/ROCm, GPUs, bf16, FlexAttention, caches, disk")
    d.add_argument("recipe", nargs="?", help="also check what this recipe or config file needs")
    d.add_argument("overrides", nargs="*")
    d.add_argument("--json", action="store_true", help="machine-readable report")
    d.set_defaults(func=_ops("cmd_doctor"))
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

    at = verb("attach", "follow a run's log until the run ends (Ctrl-C detaches; the run goes on)")
    at.add_argument("run", help="run directory, or run name under --root")
    at.add_argument("-n", "--tail", type=int, default=None, help="start with only the last N lines")
    at.add_argument("--root", default="runs", help="folder holding run directories (default runs)")
    at.set_defaults(func=cmd_attach)

    sp = verb("stop", "stop a run gracefully: SIGTERM, a checkpoint at the next step, wait for the exit")
    sp.add_argument("run", help="run directory, or run name under --root")
    sp.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the exit (default 600)")
    sp.add_argument("--now", action="store_true", help="SIGKILL when --timeout passes (at once with --timeout 0)")
    sp.add_argument("--root", default="runs", help="folder holding run directories (default runs)")
    sp.set_defaults(func=cmd_stop)

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

    db = verb("dashboard", "serve a run's dashboard from its files (a finished run, or one on another machine)")
    db.add_argument("run", help="run directory, or run name under --root")
    db.add_argument("--port", type=int, default=None, help="port (default 8080, or a free one when it is busy; "
                    "0: a free one)")
    db.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    db.add_argument("--token", default=None, help="bearer token every endpoint but /health asks for, as monitor.token "
                    "does for a live run (default: monitor.token=... in TRAINBOX_OVERRIDES); required for a run "
                    "trained with monitor.token")
    db.add_argument("--root", default="runs", help="folder holding run directories (default runs)")
    db.set_defaults(func=_ops("cmd_dashboard"))
    return p


def _sampling(p: argparse.ArgumentParser) -> None:
    """The sampling options `generate` and `chat` share (each sets its own --max-tokens and --temperature)."""
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)


def _version() -> str:
    return f"trainbox {trainbox.__version__}"
