"""`trainbox doctor`: what this machine offers for training, what is wrong, and what to do about it.

Each check gives a status (ok / warn / fail), the value found and, for problems, the fix. `fail` is kept
for what the given recipe needs and this machine lacks (a GPU for train.device=cuda, a C compiler for
train.compile, the data files, an optional package); without a recipe nothing fails, it only warns.
The environment (cache locations, offline flags) is passed in by the CLI (trainbox.cli), the only reader of env vars.
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import platform
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from trainbox.config import RunConfig
from trainbox.data.hub import SOURCES, download_target, plan_shards, run_samples
from trainbox.errors import DataError, TrainboxError
from trainbox.kernels.choice import attention_on, choose
from trainbox.kernels.flash import EXTRA, MIN_MAJOR, _interface
from trainbox.kernels.fp8 import fp8_supported
from trainbox.kernels.fused_mlp import _quack
from trainbox.kernels.ops import LOAD_ERRORS, compile_cache_dir
from trainbox.model.build import packs_examples
from trainbox.model.spec import family
from trainbox.plan import plan_run

GiB = 2**30


@dataclass
class Check:
    name: str
    status: str          # ok, warn, fail
    value: str
    fix: str = ""


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def platform_checks() -> list[Check]:
    py = platform.python_version()
    good = tuple(int(x) for x in py.split(".")[:2]) >= (3, 10)
    out = [Check("python", "ok" if good else "fail", py, "" if good else "trainbox needs Python >= 3.10")]
    tv = torch.__version__.split("+")[0]
    major_minor = tuple(int(x) for x in tv.split(".")[:2])
    out.append(Check("torch", "ok" if major_minor >= (2, 5) else "warn", torch.__version__,
                     "" if major_minor >= (2, 5)
                     else "FlexAttention and compile need torch >= 2.5: pip install -U torch"))
    out.append(encoder_check(importlib.util.find_spec("fastokens") is not None))
    if torch.version.hip:
        out.append(Check("rocm", "ok", torch.version.hip))
    elif torch.version.cuda:
        out.append(Check("cuda", "ok", torch.version.cuda))
    else:
        out.append(Check("cuda", "warn", "none (CPU-only torch build)",
                         "for GPUs install a CUDA or ROCm build: https://pytorch.org/get-started/locally/"))
    return out


# `trainbox prepare` with 2 workers against a plain tiktoken loop, on a 2-core CPU
PREPARE_SPEED = ("2.70x", "1.50x", "benchmarks/records/2026-12-01-cpu-prepare-speed-2.json")


def encoder_check(fast: bool) -> Check:
    """Which encoder `prepare` runs GPT-2 text through (`fast`: fastokens imports here)."""
    if fast:
        return Check("encoder", "ok", f"fastokens {importlib.metadata.version('fastokens')}: prepare encodes GPT-2 "
                     f"and byte-level BPE tokenizer.json text through it, GPT-2 at {PREPARE_SPEED[0]} a plain tiktoken "
                     f"loop's speed (2 workers, 2 cores: {PREPARE_SPEED[2]})")
    return Check("encoder", "warn", f"fastokens is not installed: prepare encodes tokenizer.json text through "
                 f"`tokenizers`, and GPT-2 text through tiktoken "
                 f"({PREPARE_SPEED[1]} a plain tiktoken loop's speed, against {PREPARE_SPEED[0]} with fastokens; 2 "
                 f"workers, 2 cores: {PREPARE_SPEED[2]}); the tokens are the same", "pip install fastokens")


def gpu_checks() -> list[Check]:
    if not torch.cuda.is_available():
        hint = ("the driver or the device is not visible: check nvidia-smi / rocm-smi, and --gpus all "
                "(docker) or the GPU resource limit (Kubernetes)") if (torch.version.cuda or torch.version.hip) else ""
        return [Check("gpus", "warn", "none; training runs on the CPU", hint)]
    out = []
    caps = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        caps.append((p.major, p.minor))
        out.append(Check(f"gpu{i}", "ok", f"{p.name}, {_fmt(p.total_memory)}, compute capability {p.major}.{p.minor}"))
    bf16 = torch.cuda.is_bf16_supported()
    out.append(Check("bf16", "ok" if bf16 else "warn", "yes" if bf16 else "no",
                     "" if bf16 else "this GPU has no bf16: use train.dtype=fp16 (loss scaling) or fp32"))
    fp8 = all(fp8_supported(torch.device("cuda", i)) for i in range(len(caps)))
    out.append(Check("fp8", "ok", "yes (model.fp8_head, model.fp8_mlp, train.float8)" if fp8 else
                     f"no: model.fp8_head, model.fp8_mlp and train.float8 need {FP8_GPUS}"))
    fast = flash_check(min(caps), flash_problem())
    if fast is not None:
        out.append(fast)
    flex, why = flex_attention_status(min(caps))
    out.append(Check("flex_attention", "ok" if flex else "warn", "yes" if flex else f"no ({why})",
                     "" if flex else "attention falls back to SDPA (slower for sliding windows)"))
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else "missing"
    out.append(Check("nccl", "ok" if nccl else "warn", version,
                     "" if nccl else "multi-GPU runs need NCCL (RCCL on ROCm): use an official torch build"))
    return out


# gpt2-125m on one H100 against nanoGPT's train.py (1,053.8 ms per step): with the `flash` extra, and with neither
# of its packages loading (SDPA attention, the Triton fused loss, an unfused MLP)
FLASH_SPEED = ("1.30x", "benchmarks/records/2026-11-27-h100-gpt2-125m-train-speed.json")
PLAIN_SPEED = ("1.15x", "benchmarks/records/2026-11-27-h100-gpt2-125m-step-time-vs-70ca097.json")


def flash_problem() -> str | None:
    """None when the `flash` extra loads here (FlashAttention-4 and QuACK, both, as the recipes use them, through the
    kernels' own loaders); else what stops it: a package that is not installed, or one that is installed and does
    not load, with the reason its loader recorded."""
    for dist_name, loader in (("flash-attn-4", _interface), ("quack-kernels", _quack)):
        try:
            importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            return f"{dist_name} is not installed"
        if loader() is None:
            return f"{dist_name} is installed but does not load: {LOAD_ERRORS.get(dist_name, 'no reason recorded')}"
    return None


def flash_check(capability: tuple[int, int], problem: str | None) -> Check | None:
    """The `flash` extra on a GPU of `capability` (`problem`: flash_problem's answer): on Hopper (9.x) and Blackwell
    (10.x), where its kernels run, ok when it loads and otherwise a warning with what stops it and what it costs;
    None on other GPUs."""
    if capability[0] not in (9, 10):
        return None
    if problem is None:
        return Check("flash", "ok", f"flash-attn-4 and quack-kernels load: attention, MLP and loss run their kernels "
                     f"(gpt2-125m on an H100: {FLASH_SPEED[0]} nanoGPT's speed, {FLASH_SPEED[1]})")
    installed = "is installed but" in problem
    fix = (f"repair the install: the error names the missing piece; {EXTRA}" if installed else EXTRA)
    if installed and "semantic key" in problem:   # QuACK fingerprints the code an epilogue calls, and reads only
        # packages under a site-packages (or dist-packages) folder as installed ones: `pip install --target` elsewhere,
        # or a PYTHONPATH checkout, of the CUTLASS DSL fails so
        fix = ("install the extra into the environment's site-packages (not `pip install --target` elsewhere or a "
               f"PYTHONPATH folder: QuACK refuses the CUTLASS DSL from outside one); {EXTRA}")
    return Check("flash", "warn", f"the `flash` extra does not load on this compute capability {capability[0]}."
                 f"{capability[1]} GPU ({problem}): gpt2-125m runs at {PLAIN_SPEED[0]} nanoGPT's speed on an H100 "
                 f"without it ({PLAIN_SPEED[1]}) and {FLASH_SPEED[0]} with it ({FLASH_SPEED[1]})", fix)


def flex_attention_status(capability: tuple[int, int]) -> tuple[bool, str]:
    """FlexAttention runs through Triton-generated kernels: it needs triton and an sm_80+ class GPU. When
    those are there, compile and run one small causal call on GPU 0 and compare it with SDPA."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # optional: newer torch
    except ImportError:
        return False, f"torch {torch.__version__} has no FlexAttention"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    if not torch.version.hip and capability < (8, 0):
        return False, f"compute capability {capability[0]}.{capability[1]} < 8.0"
    try:
        q, k, v = torch.randn(3, 1, 2, 256, 64, device="cuda", dtype=torch.bfloat16).unbind(0)
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 256, 256, device="cuda")
        got = torch.compile(flex_attention)(q, k, v, block_mask=mask)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        err = (got.float() - want.float()).abs().max().item()
    except Exception as e:  # any failure here is exactly what the user needs to see
        return False, f"a test call failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if err > 5e-2:
        return False, f"a test call differs from SDPA by {err:.3g}"
    return True, ""


def storage_checks(env: Mapping[str, str], run_dir: Path) -> list[Check]:
    out = []
    for name, path in (("inductor_cache", Path(env.get("TORCHINDUCTOR_CACHE_DIR") or compile_cache_dir())),
                       ("triton_cache", Path(env.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache"))):
        size = _size(path) if path.is_dir() else 0
        writable = os.access(path if path.exists() else _existing_parent(path), os.W_OK)
        out.append(Check(name, "ok" if writable else "warn", f"{path} ({_fmt(size)})",
                         "" if writable else f"not writable: compiled kernels are not kept; chown it or set "
                         f"{'TORCHINDUCTOR_CACHE_DIR' if name == 'inductor_cache' else 'TRITON_CACHE_DIR'}"))
    if Path("/dev/shm").is_dir():
        shm = shutil.disk_usage("/dev/shm").total
        small = shm < GiB
        out.append(Check("shm", "warn" if small else "ok", _fmt(shm),
                         "DataLoader workers and NCCL need more: docker --shm-size=16g, compose shm_size, "
                         "or a Memory emptyDir at /dev/shm (Kubernetes)" if small else ""))
    where = _existing_parent(run_dir)
    free = shutil.disk_usage(where).free
    out.append(Check("disk", "warn" if free < 20 * GiB else "ok", f"{_fmt(free)} free at {where}",
                     "checkpoints of a 124M model take ~1.5 GiB each (keep_last of them): free space or "
                     "move run.dir" if free < 20 * GiB else ""))
    return out


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def hf_checks(env: Mapping[str, str]) -> list[Check]:
    home = Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    hub = Path(env.get("HF_HUB_CACHE") or home / "hub")
    size = _size(hub) if hub.is_dir() else 0
    offline = any(env.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return [Check("hf_cache", "ok", f"{hub} ({_fmt(size)})"),
            Check("hf_offline", "ok", "on (no downloads; models must be in the cache)" if offline else "off")]


def recipe_checks(cfg: RunConfig) -> list[Check]:
    """What this run needs; `fail` when it is missing here."""
    out = []
    gpu = torch.cuda.is_available()
    if cfg.requires_gpu and cfg.train.device == "auto" and not gpu:
        name = cfg.recipe or "this config"
        out.append(Check("needs_gpu", "fail", f"{name} is made for a GPU (requires_gpu) and no GPU is visible",
                         f"run on a GPU machine, or try it small on this CPU: trainbox train {name} train.device=cpu "
                         "train.compile=false train.micro_batch_size=4 data.seq_len=256"))
    if cfg.train.device.startswith("cuda") and not gpu:
        out.append(Check("needs_gpu", "fail", f"train.device={cfg.train.device} but no GPU is visible",
                         "run on a GPU machine, or set train.device=auto"))
    if cfg.train.dtype == "bf16" and gpu and not torch.cuda.is_bf16_supported():
        out.append(Check("needs_bf16", "fail", "train.dtype=bf16 on a GPU without bf16", "set train.dtype=fp16"))
    if not any(c.name == "needs_gpu" for c in out):   # a GPU recipe with no GPU here: FP8 is not this machine's
        out += fp8_checks(cfg, gpu)
    spec = family(cfg.model.family)
    eligible = "flash" in spec.attention and (spec.flash_eligible is None or spec.flash_eligible(cfg.model))
    if cfg.model.attention == "flash" or (cfg.model.attention == "auto" and eligible):
        hopper = gpu and torch.cuda.get_device_capability()[0] >= MIN_MAJOR
        missing = importlib.util.find_spec("flash_attn") is None
        if cfg.model.attention == "flash" and (missing or not hopper):
            out.append(Check("needs_flash_attention", "fail",
                             "model.attention=flash needs FlashAttention-4 on a Hopper or Blackwell GPU: "
                             + ("it is not installed" if missing else "this machine has none"),
                             EXTRA if missing else "set model.attention=auto"))
        elif hopper and missing:
            instead = attention_on(spec, cfg.model, flash=False, flex=True)
            out.append(Check("flash_attention", "warn", f"flash-attn-4 is not installed: attention runs in {instead} "
                             "(FlashAttention-4 is faster on this GPU: docs/performance.md)", EXTRA))
    if cfg.train.compiled(gpu) and shutil.which("cc") is None and shutil.which("gcc") is None:
        out.append(Check("needs_compiler", "fail", "train.compile=true but no C compiler (cc/gcc) is on PATH",
                         "apt-get install gcc python3-dev, or set train.compile=false"))
    if cfg.train.compiled(gpu) and gpu and importlib.util.find_spec("triton") is None:
        out.append(Check("needs_triton", "fail", "train.compile=true on GPU but triton is missing",
                         "pip install triton (it comes with the official torch wheels)"))
    packages = [*((pkg, extra, True) for pkg, extra in spec.packages),
                ("transformers", "finetune", bool(cfg.model.path)),   # a Hugging Face folder: its tokenizer
                ("bitsandbytes", "quant", cfg.quant.quantized), ("torchao", "float8", cfg.train.float8),
                ("tensorboard", "tracking", cfg.monitor.tensorboard), ("wandb", "tracking", cfg.monitor.wandb)]
    for pkg, extra in dict.fromkeys((pkg, extra) for pkg, extra, needed in packages if needed):
        if importlib.util.find_spec(pkg) is None:
            out.append(Check(f"needs_{pkg}", "fail", f"{pkg} is not installed", f"pip install 'trainbox[{extra}]'"))
    out += data_checks(cfg)
    out += parallel_checks(cfg, torch.cuda.device_count() if gpu else 0)
    memory = memory_check(cfg)
    if memory is not None and memory.status == "fail":
        out.append(memory)
    if all(c.status == "ok" for c in out):
        out.append(Check("recipe", "ok", f"{cfg.recipe or 'config'}: everything it needs is here"))
    out.append(kernel_check(cfg))
    return out + ([memory] if memory is not None and memory.status == "ok" else [])


FP8_GPUS = "a CUDA GPU of compute capability 8.9+ (L4, L40S, H100, H200)"


def fp8_checks(cfg: RunConfig, gpu: bool) -> list[Check]:
    """The run's FP8 matmuls (model.fp8_head, model.fp8_mlp, train.float8) where this machine has no FP8: a GPU
    without FP8 tensor cores, or no GPU at all (a run on the CPU is in float32). model.fp8_fallback runs the
    model's as plain matmuls (a warning); otherwise each is a failure, as `trainbox train` refuses it."""
    if gpu and fp8_supported(torch.device("cuda")):
        return []
    model = [o.split("=")[0] for o in cfg.model.fp8_options]
    where, plain = ("this GPU is not one", "bf16") if gpu else ("no GPU is visible here", "float32 on the CPU")
    out = []
    if model:
        names = " and ".join(model)
        if cfg.model.fp8_fallback:
            out.append(Check("fp8", "warn", f"{names} run as plain matmuls, in {plain} (model.fp8_fallback): FP8 "
                             f"needs {FP8_GPUS}, and {where}", "an L4, L40S, H100 or H200 runs them in FP8"
                             if gpu else ""))
        else:
            out.append(Check("needs_fp8", "fail", f"{names} {'need' if len(model) > 1 else 'needs'} {FP8_GPUS} for "
                             f"FP8 matmuls, and {where}", f"drop {names} (the matmuls then run in {plain}), or set "
                             "model.fp8_fallback=true"))
    if cfg.train.float8:
        out.append(Check("needs_float8", "fail", f"train.float8=true needs {FP8_GPUS} for FP8 matmuls, and {where}",
                         f"drop train.float8 (the matmuls then run in {plain})"))
    return out


def data_checks(cfg: RunConfig) -> list[Check]:
    """A missing data.path fails, unless `train` downloads it (data.source, data.download)."""
    d, t = cfg.data, cfg.train
    if d.path.startswith("embedded:") or glob.glob(glob.escape(d.path) + "*"):
        return []
    if download_target(d.path, d.source, d.download) is not None:
        source = SOURCES[d.source]
        try:
            shards = plan_shards(source, run_samples(t.global_batch_size, d.seq_len, t.max_steps, t.max_tokens),
                                 d.seq_len, {})
        except DataError as e:  # the run reads more than the dataset holds
            return [Check("needs_data", "fail", e.message, e.hint or "")]
        size = (shards + len(source.val_files)) * 2 * source.tokens_per_shard
        return [Check("data", "ok", f"data.path={d.path} is missing: `trainbox train` downloads {d.source} into it "
                      f"({len(source.val_files)} validation + {shards} training shards, about {_fmt(size)})")]
    return [Check("needs_data", "fail", f"data.path={d.path}: no such file or token-file prefix",
                  "trainbox data fineweb --shards N (pre-tokenized FineWeb), or trainbox prepare INPUT --out "
                  f"{d.path}, or set data.path" + ("" if d.download or not d.source else
                                                   f" (data.download=true fetches {d.source})"))]


def parallel_checks(cfg: RunConfig, gpus: int, nccl: bool | None = None) -> list[Check]:
    """What train.parallel needs: FSDP2 and torch.distributed.checkpoint in this torch, a backend, several GPUs."""
    if not dist.is_available():
        return [Check("needs_distributed", "fail", "this torch build has no torch.distributed",
                      "install an official torch wheel")] if cfg.train.parallel == "fsdp" else []
    if gpus and not (dist.is_nccl_available() if nccl is None else nccl):
        return [Check("needs_nccl", "fail", "torch has no NCCL backend for the GPUs", "install a CUDA torch wheel")]
    if cfg.train.parallel != "fsdp":
        return []
    try:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: F401 - optional: a feature this torch may lack
        from torch.distributed.fsdp import fully_shard  # noqa: F401 - optional: a feature this torch may lack
    except ImportError:
        return [Check("needs_fsdp2", "fail", f"train.parallel=fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard); "
                      f"torch {torch.__version__} lacks it", "pip install 'torch>=2.6'")]
    if gpus == 1:
        return [Check("parallel", "warn", "train.parallel=fsdp on one GPU shards nothing (the whole model, its "
                      "gradients and optimizer state stay on it)", "launch on several GPUs: trainbox train --nproc N "
                      "..., or use train.parallel=ddp")]
    where = f"{gpus} GPUs here: --nproc {gpus}" if gpus else "CPU processes under gloo: --nproc N"
    return [Check("parallel", "ok", f"train.parallel=fsdp: parameters, gradients and optimizer state are split over "
                  f"the processes of each node (HSDP across nodes), checkpoints are sharded and written in the "
                  f"background ({where})")]


def kernel_check(cfg: RunConfig) -> Check:
    """The kernels the recipe's model runs here: the choice the trainer makes and records (kernels.choice)."""
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.train.device != "cpu" else "cpu")
    try:
        return Check("kernels", "ok", choose(cfg.model, device, family(cfg.model.family),
                                             packed=packs_examples(cfg)).describe())
    except TrainboxError as e:
        return Check("kernels", "fail", e.message, e.hint or "")


def memory_check(cfg: RunConfig) -> Check | None:
    """The run's memory plan on this machine's GPU (or its RAM for a CPU run); `trainbox plan` prints it whole.
    None where there is nothing to plan for: a GPU recipe without a GPU (needs_gpu says so), a Hugging Face model
    (its size is in its folder, read by `trainbox plan`)."""
    if family(cfg.model.family).hook("build_meta") is not None:
        return None
    try:
        plan = plan_run(cfg)
    except TrainboxError:
        return None
    per = f" per GPU ({plan.target.name})" if plan.target.cuda else " of RAM"
    value = (f"{plan.memory.needed / GiB:.1f} of {plan.target.gib:.1f} GiB{per} at micro-batch {plan.micro_batch}: "
             f"{'fits' if plan.fits else 'does not fit'} (trainbox plan {cfg.recipe or 'CONFIG'} shows the plan)")
    fix = plan.suggestions[0].command(cfg.recipe) if plan.suggestions else ""
    return Check("memory", "ok" if plan.fits else "fail", value, fix)


def run_checks(env: Mapping[str, str], cfg: RunConfig | None = None) -> list[Check]:
    """Every check, in report order; `cfg` adds the recipe's requirements."""
    run_dir = cfg.run_dir if cfg else Path("runs")
    checks = [*platform_checks(), *gpu_checks(), *storage_checks(env, run_dir), *hf_checks(env)]
    return checks + (recipe_checks(cfg) if cfg else [])


def as_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
