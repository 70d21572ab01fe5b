"""What the benchmark tools share: the result record (one schema for every file in benchmarks/records/), reading
run lines back from records or JSON-lines files, the measured-run configuration of the Trainer, the statistics of
the two parity tools, and a CUDA-event timer.

A tool builds a `Result` and calls `emit(result, record=args.record)`: it prints the record as JSON and, when asked,
writes it to benchmarks/records/DATE-HARDWARE-WHAT.json (`hardware` is `cpu`, `h100`, `2xh200`, ...). The tools
import only this module from beside them (`import common`: a script's folder is on its import path).

    python -c "import common; print(common.RESULT_FIELDS)"      # the schema, run from benchmarks/
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECORDS = HERE / "records"

# Optional packages whose presence changes which kernels a run uses: their versions are part of what was measured.
KERNEL_PACKAGES = ("flash-attn-4", "quack-kernels")


# ----------------------------------------------------------------------------------------------- the record

@dataclasses.dataclass(kw_only=True)
class Result:
    """One measurement, as every benchmark writes it. `metrics` and a baseline's `metrics` hold the tool's own
    figures; the other fields say where, with what and how it was measured."""
    date: str = ""                          # ISO date of the measurement (default: today)
    tool: str                               # the benchmark that measured it: its file name without .py
    what: str                               # what was measured, a slug that ends the file name: gpt2-125m-train-speed
    gpu: dict | None = None                 # {"name", "count"}; None on a CPU-only run
    torch: str = ""
    commit: str | None = None               # `git rev-parse HEAD` of the working tree that ran
    dirty: bool | None = None               # the working tree had changes against that commit
    software: dict = dataclasses.field(default_factory=dict)   # versions of KERNEL_PACKAGES and tool-specific ones
    recipe: str | None = None
    overrides: list = dataclasses.field(default_factory=list)
    command: str = ""                       # the command line that produced it
    notes: str = ""
    superseded_by: str | None = None        # file name of the record that measures this again with newer code
    baseline: dict | None = None            # {"name", "command", "metrics"} of a baseline that ran side by side
    metrics: dict

    def __post_init__(self) -> None:
        if not self.date:
            self.date = dt.date.today().isoformat()
        if not self.command:
            self.command = command_line()
        if not self.torch:
            self.torch = torch_version()
        if self.commit is None and self.dirty is None:
            self.commit, self.dirty = git_state()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def file_name(self) -> str:
        return f"{self.date}-{hardware(self.gpu)}-{self.what}.json"


# every field of a record and the JSON types it may hold: `Result` and this table are the schema, and
# tests/test_bench_records.py holds every file in benchmarks/records/ to it
RESULT_FIELDS: dict[str, tuple[type, ...]] = {
    "date": (str,), "tool": (str,), "what": (str,), "gpu": (dict, type(None)), "torch": (str,),
    "commit": (str, type(None)), "dirty": (bool, type(None)), "software": (dict,), "recipe": (str, type(None)),
    "overrides": (list,), "command": (str,), "notes": (str,), "superseded_by": (str, type(None)),
    "baseline": (dict, type(None)), "metrics": (dict,),
}
assert list(RESULT_FIELDS) == [f.name for f in dataclasses.fields(Result)]
BASELINE_FIELDS = {"name": (str,), "command": (str, type(None)), "metrics": (dict,)}
NAME_RE = re.compile(r"^(\d{4}-\d{2}-\d{2})-(cpu|(?:\d+x)?[a-z0-9]+)-([a-z0-9][a-z0-9.-]*)\.json$")
SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


def validate(record: dict, file_name: str | None = None) -> list[str]:
    """What is wrong with `record` (and its file name) against the schema; [] when nothing is."""
    errors = [f"missing field {k!r}" for k in RESULT_FIELDS if k not in record]
    errors += [f"unknown field {k!r}" for k in record if k not in RESULT_FIELDS]
    for k, types in RESULT_FIELDS.items():
        if k in record and not isinstance(record[k], types):
            errors.append(f"{k!r} is {type(record[k]).__name__}, not {' or '.join(t.__name__ for t in types)}")
    if errors:
        return errors
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"]):
        errors.append(f"date {record['date']!r} is not YYYY-MM-DD")
    if not SLUG_RE.match(record["what"]) or "session" in record["what"]:
        errors.append(f"what {record['what']!r} is not a slug of what was measured")
    if record["gpu"] is not None and not (isinstance(record["gpu"].get("name"), str) and
                                          isinstance(record["gpu"].get("count"), int) and record["gpu"]["count"] > 0):
        errors.append(f"gpu {record['gpu']!r} is not {{'name': str, 'count': int > 0}}")
    if not all(isinstance(o, str) and "=" in o for o in record["overrides"]):
        errors.append("overrides are not all key=value strings")
    if record["commit"] is not None and not re.fullmatch(r"[0-9a-f]{40}", record["commit"]):
        errors.append(f"commit {record['commit']!r} is not a full 40-hex commit")
    if record["baseline"] is not None:
        base = record["baseline"]
        errors += [f"baseline.{k} missing or not {types[0].__name__}" for k, types in BASELINE_FIELDS.items()
                   if not isinstance(base.get(k, ...), types)]
        errors += [f"unknown field baseline.{k}" for k in base if k not in BASELINE_FIELDS]
    if file_name is not None:
        m = NAME_RE.match(file_name)
        if not m:
            errors.append(f"file name {file_name!r} is not DATE-HARDWARE-WHAT.json")
        elif (m.group(1), m.group(2)) != (record["date"], hardware(record["gpu"])) or \
                not m.group(3).startswith(record["what"]):
            errors.append(f"file name {file_name!r} does not say {record['date']}-{hardware(record['gpu'])}-"
                          f"{record['what']}")
    return errors


# ----------------------------------------------------------------------------------------------- where it ran

def hardware(gpu: dict | None) -> str:
    """The file name's hardware part: cpu, h100, 2xh200, ..."""
    if gpu is None:
        return "cpu"
    words = [w for w in re.split(r"[\s_]+", gpu["name"]) if w.upper() not in ("NVIDIA", "AMD", "GEFORCE", "RTX")]
    model = next((w for w in words if re.search(r"\d", w)), words[0] if words else "gpu")
    model = re.sub(r"[^a-z0-9]", "", model.split("-")[0].lower()) or "gpu"
    return f"{gpu['count']}x{model}" if gpu["count"] > 1 else model


def gpu_info() -> dict | None:
    """{"name", "count"} of this machine's CUDA GPUs, None without any."""
    import torch
    if not torch.cuda.is_available():
        return None
    return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}


def torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def git_state(repo: Path = REPO) -> tuple[str | None, bool | None]:
    """(HEAD of the working tree the benchmarks run from, whether that tree has changes); (None, None) outside git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode or status.returncode:
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip())


def software(*extra: str) -> dict:
    """Installed versions of KERNEL_PACKAGES and of `extra` packages (absent ones are left out)."""
    out = {}
    for name in (*KERNEL_PACKAGES, *extra):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def command_line(argv: list[str] | None = None, cwd: Path | None = None) -> str:
    """This process's command line, from the repository root: `python benchmarks/x.py ...`, or `cd DIR && python
    ...` when it ran from another folder."""
    line = shlex.join(["python", *(sys.argv if argv is None else argv)])
    cwd = (cwd or Path.cwd()).resolve()
    if cwd == REPO:
        return line
    return f"cd {shlex.quote(str(cwd.relative_to(REPO)) if cwd.is_relative_to(REPO) else str(cwd))} && {line}"


# ----------------------------------------------------------------------------------------------- writing, reading

def dumps(obj, indent: int = 0) -> str:
    """JSON with one key per line and lists of plain values on one line (per-step losses stay readable)."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(f"{inner}{dumps(v, indent + 1)}" for v in obj) + f"\n{pad}]"
    return json.dumps(obj)


def write(result: Result, directory: Path = RECORDS) -> Path:
    """Write the record to DIRECTORY/DATE-HARDWARE-WHAT.json (never over another: -2, -3, ... are added)."""
    problems = validate(result.to_dict())
    if problems:
        raise ValueError(f"record {result.what!r} does not fit the schema: {'; '.join(problems)}")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / result.file_name()
    n = 1
    while path.exists():
        n += 1
        path = directory / f"{result.date}-{hardware(result.gpu)}-{result.what}-{n}.json"
    path.write_text(dumps(result.to_dict()) + "\n")
    return path


def emit(result: Result, record: bool = False, directory: Path = RECORDS) -> Path | None:
    """Print the record as JSON; with `record`, also write it under `directory` and say where."""
    print(dumps(result.to_dict()), flush=True)
    if not record:
        return None
    path = write(result, directory)
    print(f"record: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", file=sys.stderr)
    return path


def load_records(directory: Path = RECORDS) -> list[tuple[Path, dict]]:
    """Every record (*.json) in `directory`, by file name."""
    return [(p, json.loads(p.read_text())) for p in sorted(directory.glob("*.json"))]


def is_record(obj) -> bool:
    return isinstance(obj, dict) and "tool" in obj and "metrics" in obj and "what" in obj


def read_runs(paths: list[str]) -> list[tuple[str, dict]]:
    """The run lines in these files, in order, each with where it stands ("FILE:LINE" or "FILE:runs[i]"): a record
    contributes its metrics["runs"], any other file its lines that parse as JSON objects (others are skipped)."""
    runs = []
    for path in paths:
        text = Path(path).read_text()
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if is_record(whole):
            runs += [(f"{path}:runs[{i}]", r) for i, r in enumerate(whole["metrics"].get("runs", []))]
            continue
        for n, line in enumerate(text.splitlines(), 1):
            try:
                run = json.loads(line) if line.startswith("{") else None
            except json.JSONDecodeError:
                run = None
            if isinstance(run, dict):
                runs.append((f"{path}:{n}", run))
    return runs


def measured_where(paths: list[str]) -> dict:
    """Result fields (date, gpu, torch, commit, dirty, software) for a record that combines the runs in `paths`:
    from the records among them (the newest for date, torch and commit; the most GPUs), else the GPU that the
    run lines name; {} when neither says (the record then describes this machine)."""
    records = [r for r in (json.loads(Path(p).read_text()) if p.endswith(".json") else None for p in paths)
               if is_record(r)]
    if records:
        newest = max(records, key=lambda r: r["date"])
        gpus = [r["gpu"] for r in records if r["gpu"]]
        return {"date": newest["date"], "gpu": max(gpus, key=lambda g: g["count"]) if gpus else None,
                "torch": newest["torch"], "commit": newest["commit"], "dirty": newest["dirty"],
                "software": newest["software"]}
    runs = [r for _, r in read_runs(paths)]
    names = [n for n in (r.get("gpu") or r.get("device") for r in runs) if isinstance(n, str) and n != "cpu"]
    commits = [c for c in (r.get("commit") for r in runs) if isinstance(c, str) and re.fullmatch(r"[0-9a-f]{40}", c)]
    if not names:
        return {}
    return {"gpu": {"name": max(set(names), key=names.count), "count": 1}, "software": {},
            **({"commit": max(set(commits), key=commits.count), "dirty": None} if commits else {})}


# ----------------------------------------------------------------------------------------------- measured runs

def bench_config(recipe: str, steps: int, overrides: list[str], prefix: str = "speed-"):
    """The recipe for a measured run of `steps` steps in a temporary run directory: every step logged (one
    host sync each, so consecutive metrics.jsonl timestamps are step times), no evaluation, checkpoint or
    sample before the end, the monitor on a free port."""
    from trainbox.config import load_config
    return load_config(recipe, bench_overrides(steps, tempfile.mkdtemp(prefix=prefix), overrides))


def bench_overrides(steps: int, run_dir: str, overrides: list[str]) -> list[str]:
    """bench_config's overrides, for a run launched as a command (`trainbox train --nproc N`)."""
    return [f"train.max_steps={steps}", "monitor.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
            "train.sample_tokens=0", f"run.dir={run_dir}", "monitor.port=0", *overrides]


def run_events(cfg) -> tuple[dict, list[dict]]:
    """A finished run's start event and its train events (one per step), from its metrics.jsonl."""
    events = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(e for e in events if e["event"] == "start"), [e for e in events if e["event"] == "train"]


NANOGPT_SEED = "torch.manual_seed(1337 + seed_offset)"  # nanoGPT's train.py fixes its seed in this line


def seeded_script(repo: str, seed: int) -> str:
    """A copy of nanoGPT's train.py beside it with the seed `seed` (its config has no seed key); -> its name.
    It stays in the local peer checkout, which is never committed."""
    text = (Path(repo) / "train.py").read_text()
    if NANOGPT_SEED not in text:
        raise SystemExit(f"{repo}/train.py has no line {NANOGPT_SEED!r}: cannot set nanoGPT's seed")
    name = f"train_seed{seed}_{os.getpid()}.py"
    (Path(repo) / name).write_text(text.replace(NANOGPT_SEED, f"torch.manual_seed({seed} + seed_offset)"))
    return name


def run_nanogpt(repo: str, data_dir: str, steps: int, warmup: int, extra: list[str], seed: int = 1337,
                env: dict | None = None) -> dict:
    """nanoGPT's train.py on DATA_DIR/{train,val}.bin (GPT-2 124M defaults), parsed from its log; a seed
    other than its own 1337 runs from a copy with that seed (seeded_script). `env` (default: this process's)
    is the run's environment, e.g. with CUDA_VISIBLE_DEVICES; several runs may share one checkout at once."""
    out_dir = tempfile.mkdtemp(prefix="nanogpt-out-")
    # nanoGPT reads data/<dataset>/ relative to its own folder: point it at ours through a symlink of this
    # run's own (a shared name would be replaced under a run that is reading it)
    dataset = f"bench-{os.getpid()}-{seed}"
    link = Path(repo) / "data" / dataset
    link.unlink(missing_ok=True)
    link.symlink_to(Path(data_dir).resolve())
    script = "train.py" if seed == 1337 else seeded_script(repo, seed)
    args = [sys.executable, script, f"--dataset={dataset}", f"--max_iters={steps}", "--eval_interval=100000",
            "--log_interval=1", "--eval_iters=1", "--always_save_checkpoint=False", f"--out_dir={out_dir}",
            *extra]
    t0 = time.time()
    try:
        proc = subprocess.run(args, cwd=repo, env=env or {**os.environ}, capture_output=True, text=True)
    finally:
        link.unlink(missing_ok=True)
        shutil.rmtree(out_dir, ignore_errors=True)  # nanoGPT's checkpoint of the final eval (1.5 GB for 124M)
        if script != "train.py":
            (Path(repo) / script).unlink(missing_ok=True)
    out = proc.stdout + proc.stderr
    iters = [(int(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4)))
             for m in re.finditer(r"iter (\d+): loss ([\d.]+), time ([\d.]+)ms, mfu (-?[\d.]+)%", out)]
    if not iters:
        return {"who": "nanogpt", "seed": seed, "error": out[-2000:]}
    times = [t for _, _, t, _ in iters][warmup:]
    evals = {int(m.group(1)): float(m.group(2))
             for m in re.finditer(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", out)}
    return {"who": "nanogpt", "seed": seed, "median_step_ms": statistics.median(times), "final_loss": iters[-1][1],
            "mfu_reported": iters[-1][3], "first_step_ms": iters[0][2], "wall_s": round(time.time() - t0, 1),
            "val_loss": evals.get(steps), "evals": evals, "losses": [loss for _, loss, _, _ in iters]}


# ----------------------------------------------------------------------------------------------- statistics

# two-sided 95% quantiles of Student's t by degrees of freedom (a table: no scipy needed on the GPU machine)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def t975(df: float) -> float:
    """The 97.5% quantile of t with `df` degrees of freedom, rounded down to the table (a wider interval)."""
    if df >= 120:
        return 1.96
    return T975[max(d for d in T975 if d <= max(1.0, df))]


def verdict(diff: float, half: float) -> str:
    """ours - nanoGPT with the half-width of its 95% interval -> "no worse", "worse" or "inconclusive"."""
    return "no worse" if diff <= 0 else "worse" if diff - half > 0 else "inconclusive"


def paired(diffs: list[float]) -> dict:
    """Mean of paired differences (same seed: same weights and batches) with its 95% t interval and the verdict:
    "no worse" (mean <= 0), "worse" (the interval above 0) or "inconclusive"."""
    mean = statistics.mean(diffs)
    out = {"n": len(diffs), "diffs": [round(d, 4) for d in diffs], "mean": round(mean, 4)}
    if len(diffs) > 1:
        half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
        out["interval_95"] = [round(mean - half, 4), round(mean + half, 4)]
        out["verdict"] = verdict(mean, half)
    return out


# ----------------------------------------------------------------------------------------------- GPU timing

def median_ms(f, reps: int = 30, warmup: int = 3, device: str = "cuda") -> float:
    """Median over `reps` of one call of f, each timed alone between CUDA events (L2 left warm), in ms; on
    device="cpu" between two clock reads."""
    import torch
    for _ in range(warmup):
        f()
    if device == "cpu":
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[len(ts) // 2]
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


TEMPLATE_KINDS = ("grouped", "mlp")


def inductor_templates(kind: str, backends: str = "TRITON", width: int = 3072):
    """From now on in this process, lower `kind`'s matmuls with Inductor's GEMM autotuning over `backends`; returns a
    function that puts Inductor back as it was. The experiment switch behind train_speed.py's and profile_step.py's
    `--templates`, not a product setting.

    Autotuning every matmul of moe-gpt2-125m (`TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1`) crashed with torch 2.11 on an
    H200: an illegal memory access while it benchmarked Triton choices for the loss head's weight gradient
    (50304 x 49152 @ 49152 x 768), which poisons the process. This switch turns autotuning on for one kind only:

        grouped  the MoE experts' grouped matmuls (aten._grouped_mm): Inductor's Triton grouped template, autotuned
        mlp      the plain matmuls with an operand dimension of `width` (gpt2-125m's 4 * n_embd = 3072: the MLP's)

    Inductor then fuses the neighbouring elementwise work (the GELU, its derivative, casts) into the chosen Triton
    template's epilogue as it does under max-autotune. `backends` as Inductor's max_autotune_gemm_backends: TRITON
    (the templates only) or ATEN,TRITON (the faster of the library kernel and the templates, each matmul)."""
    import torch
    import torch._inductor.config as inductor
    import torch._inductor.kernel.mm  # noqa: F401 - registers the matmul lowerings wrapped below
    import torch._inductor.kernel.mm_grouped  # noqa: F401
    from torch._inductor import lowering

    if kind not in TEMPLATE_KINDS:
        raise ValueError(f"--templates {kind}: one of {', '.join(TEMPLATE_KINDS)}")
    # graphs compiled before the switch (a baseline run in this process) are dropped: Dynamo would otherwise reuse
    # them for the next model of the same code and shapes, which would then never be lowered again
    torch._dynamo.reset()
    # nor are graphs compiled and cached on disk: their cache keys know Inductor's settings, not this switch
    from torch._functorch import config as functorch
    before = (inductor.fx_graph_cache, functorch.enable_autograd_cache)
    inductor.fx_graph_cache = functorch.enable_autograd_cache = False
    aten = torch.ops.aten
    ops = [aten._grouped_mm.default] if kind == "grouped" else [aten.mm.default, aten.addmm.default]

    def chosen(args) -> bool:
        if kind == "grouped":
            return True
        dims = [str(d) for a in args if hasattr(a, "get_size") for d in a.get_size()]
        return str(width) in dims

    def wrap(op):
        base = lowering.lowerings[op]

        def tuned(*args, **kwargs):
            if not chosen(args):
                return base(*args, **kwargs)
            print(f"templates: autotuning {op} over {backends}", file=sys.stderr, flush=True)
            with inductor.patch(max_autotune_gemm=True, max_autotune_gemm_backends=backends,
                                benchmark_epilogue_fusion=False):
                return base(*args, **kwargs)

        lowering.lowerings[op] = tuned

    originals = {op: lowering.lowerings[op] for op in ops}
    for op in ops:
        wrap(op)

    def restore() -> None:
        lowering.lowerings.update(originals)
        inductor.fx_graph_cache, functorch.enable_autograd_cache = before
        torch._dynamo.reset()

    return restore


# ---------------------------------------------------------------- Hugging Face peers (TRL): the model, a process a side

HF_SIZES = {  # Qwen2 / Llama configs
    "0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "1b": dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=5e5),
    "tiny": dict(arch="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True, rope_theta=1e6),
}
POSITIONS = 131072           # max_position_embeddings of every folder (Llama 3.2's), so one folder serves all lengths
H100_BYTES = 85_045_149_696  # torch.cuda.get_device_properties(0).total_memory of an H100 80GB HBM3


def hf_model_folder(root: Path, size: str) -> Path:
    """The model (random weights drawn on the GPU where there is one, bf16 files), built once and read by every run
    of both sides, and, in a folder of its own (transformers 5 would read a tokenizer beside a Qwen2 config.json as
    Qwen2's BPE), a word-level tokenizer: id i is the word `w{i}`, 0 end-of-text."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder = root / f"model-{size}"
    if (folder / "config.json").is_file():
        return folder
    spec = dict(HF_SIZES[size])
    arch = spec.pop("arch")
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, spec["vocab_size"])}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    config, model = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = config(**spec, max_position_embeddings=POSITIONS, eos_token_id=0, bos_token_id=0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        built = model(cfg)
    built.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(tokenizer_folder(root, size))
    return folder


def tokenizer_folder(root: Path, size: str) -> Path:
    return root / f"tokenizer-{size}"


def planned_peak_gib(trainer) -> float:
    """Our memory plan's peak_allocated (what torch.cuda.max_memory_allocated reports) for the run `trainer` made,
    with the kernels it chose, as the pre-flight check plans it."""
    from trainbox.train.memory import device_plan
    plan = device_plan(trainer.cfg, trainer.vocab, trainer.device, trainer.dtype, H100_BYTES)
    return plan.memory.peak_allocated / 2**30


def peak_gib() -> float:
    import torch
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def cap_to_h100() -> float | None:
    """On a GPU larger than an H100 (an H200), cap this process's allocator at an H100's memory, so that what fits
    is what fits one H100; -> the cap in GiB (None: no cap)."""
    import torch
    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    if total <= H100_BYTES:
        return None
    torch.cuda.set_per_process_memory_fraction(H100_BYTES / total)
    return round(H100_BYTES / 2**30, 2)


def spawn_side(script: str, side: str, mode: str, extra: list[str], timeout: float) -> dict:
    """One (side, mode) run of `script` in a process of its own -> its result, with the seconds it took (start-up
    included)."""
    cmd = [sys.executable, script, "--worker", side, "--mode", mode, *extra]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s", "wall_s": round(time.perf_counter() - start, 1)}
    wall = round(time.perf_counter() - start, 1)
    line = next((x for x in proc.stdout.splitlines()[::-1] if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        oom = "out of memory" in proc.stderr.lower() or "outofmemoryerror" in proc.stderr.lower()
        tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
        return {"error": "out of memory" if oom else tail, "wall_s": wall}
    return {**json.loads(line[7:]), "wall_s": wall}
