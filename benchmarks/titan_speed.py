"""torchtitan's own trainer on the shape of one of our recipes, as a side-by-side baseline (one JSON line).

    python benchmarks/titan_speed.py llama-1b --data /tmp/corpus/modded/pyc --ngpu 2 --local-batch 2 --steps 30 \
        --warmup 10 model.llama.tie_embeddings=false model.vocab_size=128256 [--float8 tensorwise] [--ac selective]
    python benchmarks/titan_speed.py moe-gpt2-125m-128x --data /tmp/corpus/modded/pyc --ngpu 2 --ep 2 \
        --local-batch 24 --global-batch 480 --steps 40 --warmup 10
    python benchmarks/titan_speed.py llama-1b ... --dry-run     # write the job config and print it, run nothing

The peer is the installed torchtitan package (`pip install torchtitan==0.2.2`), nothing else: the shape comes from
our recipe (trainbox.config.load_config with the given key=value overrides, so it is exactly the shape our run
used), the run from torchtitan's own Trainer through benchmarks/titan_worker.py under `torchrun`. llama recipes
train torchtitan's llama3 model code, MoE recipes its qwen3 model code with routed experts (SwiGLU experts whose
hidden width is 2/3 of our GELU experts': the same FLOPs and parameters). Both read our token files through
trainbox's readers in the order our run reads them, so the two sides train on the same tokens.

Settings default to the recipe's (micro-batch, global batch, sequence, compile, activation checkpointing, float8,
expert parallelism, optimizer, seed); the flags override them. The figures are parsed from torchtitan's own
per-step log line (torchtitan/components/metrics.py, MetricsProcessor.log): tokens/s per GPU, TFLOP/s, MFU and
max reserved memory; the steps after --warmup count. This file imports without torchtitan (the tests use its
helpers on a machine without it); only the worker imports torchtitan.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "titan_worker.py"

# case names that are a recipe plus overrides (the MoE comparison: 128 experts, top-2)
CASES = {"moe-gpt2-125m-128x": ("moe-gpt2-125m", ["model.moe.num_experts=128", "model.moe.top_k=2"])}
AC_MODES = {"none": ("none", None), "selective": ("selective", "op"), "full": ("full", None)}
SPEC_NAME = "trainbox"   # the flavour and the TrainSpec name prefix the worker registers


# ----------------------------------------------------------------------------------------------- model args

def titan_ffn_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The SwiGLU hidden width torchtitan's llama3 builds for a model of width `dim`: its FeedForward.__init__
    (torchtitan/models/llama3/model/model.py) takes hidden 4 * dim, keeps 2/3 of it, scales it by
    ffn_dim_multiplier and rounds up to a multiple of multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def llama_args(cfg, vocab: int) -> dict:
    """torchtitan TransformerModelArgs (llama3) of our llama model: width, depth, heads, SwiGLU width, RoPE."""
    m, ll = cfg.model, cfg.model.llama
    if ll.tie_embeddings:
        raise SystemExit("torchtitan's llama3 has no tied head: give model.llama.tie_embeddings=false so both "
                         "sides train the same model")
    if m.head_dim not in (None, m.n_embd // m.n_head):
        raise SystemExit(f"torchtitan's llama3 heads are n_embd / n_head wide, not model.head_dim={m.head_dim}")
    hidden = ll.intermediate_size or titan_ffn_hidden(m.n_embd, 256, None)
    base = int(2 * (4 * m.n_embd) / 3)
    # multiple_of = hidden makes the rounding land on exactly `hidden` for any multiplier that gets within it
    args = {"dim": m.n_embd, "n_layers": m.n_layer, "n_heads": m.n_head, "n_kv_heads": ll.n_kv_head or m.n_head,
            "vocab_size": vocab, "multiple_of": hidden, "ffn_dim_multiplier": hidden / base,
            "norm_eps": ll.rms_norm_eps, "rope_theta": ll.rope_theta}
    if titan_ffn_hidden(args["dim"], args["multiple_of"], args["ffn_dim_multiplier"]) != hidden:
        raise SystemExit(f"no torchtitan FFN sizing gives SwiGLU width {hidden}")
    rs = ll.rope_scaling
    if rs.rope_type == "llama3":
        args["rope_scaling_args"] = {"scaling_factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                                     "high_freq_factor": rs.high_freq_factor,
                                     "original_max_position_embeddings": rs.original_max_position_embeddings}
    else:   # torchtitan's llama3 always applies its scaling; with factor 1 every band keeps its frequency
        args["rope_scaling_args"] = {"scaling_factor": 1.0}
    return args


def moe_args(cfg, vocab: int) -> dict:
    """torchtitan Qwen3ModelArgs of our MoE GPT-2: every FFN a routed MoE (softmax router, top-k gates
    renormalised, no shared expert, dropless), SwiGLU experts of 2/3 our GELU experts' width, RoPE in place of the
    learned position table, RMSNorm in place of LayerNorm, no q/k norm, the head tied as ours is."""
    m, moe = cfg.model, cfg.model.moe
    if moe.every != 1:
        raise SystemExit("torchtitan's qwen3 makes every FFN an MoE: model.moe.every must be 1")
    gelu_hidden = 4 * m.n_embd
    if (2 * gelu_hidden) % 3:
        raise SystemExit(f"no SwiGLU width has the FLOPs of GELU experts of {gelu_hidden}")
    head_dim = m.head_dim or m.n_embd // m.n_head
    return {"dim": m.n_embd, "n_layers": m.n_layer, "n_heads": m.n_head, "n_kv_heads": m.n_head,
            "head_dim": head_dim, "vocab_size": vocab, "hidden_dim": gelu_hidden, "norm_eps": 1e-5,
            "qk_norm": False, "enable_weight_tying": bool(m.tie_embeddings), "moe_enabled": True,
            "moe_inter_dim": 2 * gelu_hidden // 3,
            "moe_args": {"num_experts": moe.num_experts, "num_shared_experts": 0, "top_k": moe.top_k,
                         "score_func": "softmax", "route_norm": True, "route_scale": 1.0,
                         "score_before_experts": False}}


def model_args(cfg, vocab: int) -> tuple[str, dict]:
    """(torchtitan model: llama3 or qwen3, its model args as a dict) for our config."""
    if cfg.model.family == "llama":
        return "llama3", llama_args(cfg, vocab)
    if cfg.model.family == "moe":
        return "qwen3", moe_args(cfg, vocab)
    raise SystemExit(f"model.family={cfg.model.family}: torchtitan runs llama and moe recipes here")


def titan_param_count(model: str, a: dict) -> int:
    """The parameters torchtitan's model of these args holds, a tied table once (its llama3 and qwen3 modules:
    Attention, FeedForward / MoE, RMSNorms, embedding and head)."""
    d, L, V = a["dim"], a["n_layers"], a["vocab_size"]
    hd = a.get("head_dim") or d // a["n_heads"]
    attn = d * hd * (2 * a["n_heads"] + 2 * a["n_kv_heads"])     # wq, wo; wk, wv
    if model == "llama3":
        ffn = 3 * d * titan_ffn_hidden(d, a["multiple_of"], a["ffn_dim_multiplier"])
    else:
        e = a["moe_args"]["num_experts"]
        ffn = 3 * d * a["moe_inter_dim"] * e + d * e             # w1, w2, w3 of every expert; the router's gate
        attn += 2 * hd if a.get("qk_norm") else 0
    block = attn + ffn + 2 * d                                   # attention_norm, ffn_norm
    return V * d + L * block + d + (0 if a.get("enable_weight_tying") else V * d)


# ----------------------------------------------------------------------------------------------- job config

def job_config(cfg, args, dump_folder: str, model: str) -> dict:
    """torchtitan's job config (its JobConfig sections) for this run, as a dict of TOML tables."""
    t, o = cfg.train, cfg.optim
    ac = args.ac or t.activation_checkpointing
    mode, option = AC_MODES[ac]
    compile_ = t.compile in (True, "auto") if args.compile is None else args.compile   # auto: compiled on a GPU
    local = args.local_batch or t.micro_batch_size
    global_ = args.global_batch or t.global_batch_size
    ep = args.ep or (cfg.model.moe.expert_parallel if cfg.model.family == "moe" else 1)
    if o.name != "adamw":
        raise SystemExit(f"optim.name={o.name}: torchtitan runs AdamW here")
    job = {
        "job": {"dump_folder": dump_folder, "description": f"trainbox {args.recipe} baseline"},
        "metrics": {"log_freq": 1, "enable_tensorboard": False, "disable_color_printing": True},
        "model": {"name": f"{SPEC_NAME}_{model}", "flavor": SPEC_NAME, "converters": [],
                  "hf_assets_path": dump_folder},   # no tokenizer or Hugging Face weights are read
        "optimizer": {"name": "AdamW", "lr": o.lr, "beta1": o.betas[0], "beta2": o.betas[1], "eps": o.eps,
                      "weight_decay": o.weight_decay, "implementation": "fused"},
        "lr_scheduler": {"warmup_steps": min(o.warmup_steps, args.steps), "decay_type": "cosine",
                         "min_lr_factor": o.min_lr_ratio},
        "training": {"dataset": "trainbox", "local_batch_size": local, "global_batch_size": global_,
                     "seq_len": args.seq_len or cfg.data.seq_len, "steps": args.steps, "max_norm": o.grad_clip,
                     "dtype": "float32", "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"},
        "parallelism": {"data_parallel_shard_degree": -1, "expert_parallel_degree": ep},
        "checkpoint": {"enable": False},
        "activation_checkpoint": {"mode": mode, **({"selective_ac_option": option} if option else {})},
        "compile": {"enable": compile_, "components": ["model", "loss"]},
        "debug": {"seed": cfg.run.seed},
    }
    float8 = args.float8 or ("tensorwise" if t.float8 else None)
    if float8:
        job["model"]["converters"] = ["quantize.linear.float8"]
        # the blocks' linear layers only, as ours (train.float8); tensorwise: float8 all-gathers under FSDP
        f8 = {"filter_fqns": ["output"]}
        if float8 == "tensorwise":
            f8 |= {"enable_fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale_for_fsdp": True}
        else:
            f8["recipe_name"] = float8
        job["quantize"] = {"linear": {"float8": f8}}
    return job


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)   # a JSON string is a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def to_toml(tables: dict, prefix: str = "") -> str:
    """TOML of nested dicts: scalars and lists under [table], sub-dicts as [table.sub]."""
    out = []
    for name, table in tables.items():
        path = f"{prefix}{name}"
        plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
        if plain or not any(isinstance(v, dict) for v in table.values()):
            out.append(f"[{path}]")
            out += [f"{k} = {toml_value(v)}" for k, v in plain.items()]
            out.append("")
        subs = {k: v for k, v in table.items() if isinstance(v, dict)}
        if subs:
            out.append(to_toml(subs, f"{path}."))
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- the log

# torchtitan 0.2.2's per-step line (components/metrics.py, MetricsProcessor.log), colours off:
#   step: {step:2}  loss: {loss:8.5f}  grad_norm: {grad_norm:7.4f}  memory: {gib:5.2f}GiB({pct:.2f}%)
#   tps: {round(tps):,}  tflops: {tflops:,.2f}  mfu: {mfu:.2f}%
STEP_RE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+\d.naif]+)\s+grad_norm:\s*(?P<grad_norm>[-+\d.naif]+)\s+"
    r"memory:\s*(?P<mem>[\d.]+)GiB\((?P<mem_pct>[\d.]+)%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+)%")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
PARAMS_RE = re.compile(r"size: ([\d,]+) total parameters")      # train.py, Trainer.__init__
WORKER_RE = re.compile(r"trainbox-titan: (\{.*\})")               # the worker's own line: flops per token


def parse_steps(log: str) -> list[dict]:
    """Every step line of a torchtitan log, in order (the last line of a step wins)."""
    steps = {}
    for m in STEP_RE.finditer(ANSI_RE.sub("", log)):
        steps[int(m["step"])] = {"step": int(m["step"]), "loss": float(m["loss"]), "mem_gib": float(m["mem"]),
                                 "tps": int(m["tps"].replace(",", "")),
                                 "tflops": float(m["tflops"].replace(",", "")), "mfu_pct": float(m["mfu"])}
    return [steps[k] for k in sorted(steps)]


def summarise(steps: list[dict], warmup: int, tokens_per_step_per_gpu: int) -> dict:
    """The measured figures over the steps after `warmup`: mean and median tokens/s per GPU, the median step
    time that the median gives, mean TFLOP/s and MFU, the largest max reserved memory, the first and last loss."""
    if len(steps) <= warmup:
        raise SystemExit(f"torchtitan logged {len(steps)} steps, not more than the {warmup} of warm-up")
    kept = steps[warmup:]
    tps = [s["tps"] for s in kept]
    median = statistics.median(tps)
    return {"tokens_per_s_per_gpu": round(statistics.mean(tps), 1), "tokens_per_s_per_gpu_median": median,
            "median_step_ms": round(tokens_per_step_per_gpu / median * 1e3, 1),
            "tflops_per_gpu": round(statistics.mean(s["tflops"] for s in kept), 2),
            "mfu": round(statistics.mean(s["mfu_pct"] for s in kept) / 100, 4),
            "peak_memory_reserved_gib": max(s["mem_gib"] for s in steps),
            "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"],
            "steps": len(steps), "first_measured_step": kept[0]["step"]}


# ----------------------------------------------------------------------------------------------- running it

def titan_version() -> str | None:
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


def prepare(args) -> tuple[dict, dict]:
    """(the worker's spec, torchtitan's job config) for these arguments, both written to a new folder."""
    from trainbox.config import load_config
    from trainbox.plan import run_vocab

    recipe, extra = CASES.get(args.recipe, (args.recipe, []))
    overrides = [*extra, f"data.path={args.data}", *args.overrides]
    if args.seq_len:
        overrides.append(f"data.seq_len={args.seq_len}")
    cfg = load_config(recipe, overrides)
    model, margs = model_args(cfg, run_vocab(cfg))
    dump = tempfile.mkdtemp(prefix="titan-")
    job = job_config(cfg, args, dump, model)
    tr = job["training"]
    if tr["global_batch_size"] % (tr["local_batch_size"] * args.ngpu):
        raise SystemExit(f"global batch {tr['global_batch_size']} is no multiple of local batch "
                         f"{tr['local_batch_size']} x {args.ngpu} GPUs")
    spec = {"model": model, "model_args": margs, "recipe": recipe, "overrides": overrides, "dump": dump,
            "toml": str(Path(dump) / "job.toml"),
            # torchtitan 0.2.2 shards a tied embedding and head as two FSDP units (titan_worker.tied_unit)
            "tie_unit": bool(margs.get("enable_weight_tying")),
            "memory_limit_gib": cfg.train.memory_limit_gib}   # train.memory_limit_gib (--memory-gib): both sides
    Path(spec["toml"]).write_text(to_toml(job))
    (Path(dump) / "spec.json").write_text(json.dumps(spec, indent=1))
    return spec, job


def run(args) -> dict:
    spec, job = prepare(args)
    # rank 0's lines only, as torchtitan's run_train.sh shows them: its figures and memory are rank 0's
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={args.ngpu}", "--local-ranks-filter=0", str(WORKER),
           str(Path(spec["dump"]) / "spec.json")]
    if args.dry_run:
        print(Path(spec["toml"]).read_text())
        print(shlex.join(cmd))
        return {}
    version = titan_version()
    if version is None:
        raise SystemExit("torchtitan is not installed here: pip install torchtitan==0.2.2 (see benchmarks/README.md)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(HERE.parent / "src"),
                                                                    os.environ.get("PYTHONPATH")) if p)}
    log = stream(cmd, env, Path(spec["dump"], "log.txt"))
    return figures(log, spec, job, args, version)


def figures(log: str, spec: dict, job: dict, args, version: str) -> dict:
    """The JSON line of a finished run: what ran (name, version, command, settings) and its figures."""
    tr, par = job["training"], job["parallelism"]
    steps, own = parse_steps(log), WORKER_RE.search(log)
    if not steps or not own:
        raise SystemExit(f"torchtitan logged {len(steps)} steps; its log: {spec['dump']}/log.txt")
    own = json.loads(own[1])
    name = f"torchtitan {version} torchtitan.train"
    if spec["model"] == "qwen3":
        name = f"torchtitan {version} MoE (qwen3 model code), EP{par['expert_parallel_degree']}"
    f8 = job.get("quantize", {}).get("linear", {}).get("float8")
    if f8:
        name += f", float8 {f8.get('recipe_name', 'tensorwise')}"
    accum = tr["global_batch_size"] // (tr["local_batch_size"] * args.ngpu)
    params = PARAMS_RE.search(ANSI_RE.sub("", log))   # torchtitan's logged count (a tied table subtracted)
    ac = job["activation_checkpoint"]
    out = {"who": "torchtitan", "name": name, "version": version, "command": command_line(),
           **summarise(steps, args.warmup, tr["local_batch_size"] * tr["seq_len"] * accum),
           "flops_per_token": own["flops_per_token"],
           "params": int(params[1].replace(",", "")) if params else own["params"],
           "local_batch": tr["local_batch_size"], "seq_len": tr["seq_len"], "compile": job["compile"]["enable"],
           "ac": "selective-op" if ac.get("selective_ac_option") == "op" else ac["mode"],
           "global_batch": tr["global_batch_size"], "ngpu": args.ngpu}
    if spec["model"] == "qwen3":
        out["ep"] = par["expert_parallel_degree"]
    if "flops_per_token_with_head" in own:   # torchtitan's FLOPs leave a tied head's matmul out
        out["flops_per_token_with_head"] = own["flops_per_token_with_head"]
    if f8:
        out["fp8"] = f8.get("recipe_name", "tensorwise")
    return out


def stream(cmd: list[str], env: dict, log_path: Path) -> str:
    """Run `cmd`, its output shown on stderr as it comes (compiling takes minutes) and kept in `log_path`;
    -> the output. SystemExit when it fails."""
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc, \
            open(log_path, "w") as log:
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            sys.stderr.write(line)
    if proc.returncode:
        raise SystemExit(f"torchrun exited {proc.returncode}; its log: {log_path}")
    return "".join(lines)


def command_line() -> str:
    return shlex.join(["python", "benchmarks/titan_speed.py", *sys.argv[1:]])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", help=f"a recipe, or one of {', '.join(CASES)}")
    ap.add_argument("overrides", nargs="*", help="trainbox key=value overrides: the shape our run used")
    ap.add_argument("--data", required=True, help="token-file prefix (benchmarks/make_corpus.py's)")
    ap.add_argument("--ngpu", type=int, default=1)
    ap.add_argument("--ep", type=int, help="expert parallel degree (default: model.moe.expert_parallel)")
    ap.add_argument("--local-batch", type=int, help="sequences per GPU per micro-batch (default: the recipe's)")
    ap.add_argument("--global-batch", type=int, help="sequences per step (default: the recipe's)")
    ap.add_argument("--seq-len", type=int, help="default: the recipe's data.seq_len")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="logged steps left out of the figures")
    ap.add_argument("--float8", choices=["tensorwise", "rowwise"], help="default: tensorwise under train.float8")
    ap.add_argument("--ac", choices=list(AC_MODES), help="activation checkpointing (default: the recipe's; "
                                                         "selective is torchtitan's per-op selective)")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--dry-run", action="store_true", help="print the job config and the command, run nothing")
    return ap


def main() -> None:
    args = parser().parse_intermixed_args()
    out = run(args)
    if out:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
