"""Shared test helpers: tiny configs (2 layers, width 32), a CLI runner in a temp directory, and a runner
for check scripts that need a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Under pytest-xdist with a worker per core, one thread per worker and per process a test starts (their
# environment): more threads than cores leave OpenMP's threads spinning on each other, which slows a tiny model's
# step several times over. A user's own OMP_NUM_THREADS is kept for the processes the tests start.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(_THREADS)

# Where the environment asks for no bytecode files (PYTHONDONTWRITEBYTECODE, as containers often set), every Python
# process a test starts compiles trainbox's modules from source again: a quarter of a second each, over several
# hundred processes a pass. The processes the tests start write them, as Python does by default (__pycache__ is
# ignored by git); installed packages have theirs already.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

REPO = Path(__file__).resolve().parents[1]

# A model and batch small enough that a step takes milliseconds on a 2-core CPU. AdamW, which every family and
# parallelism takes (the tiny recipe's Muon is refused under fsdp and expert parallelism; tests/test_muon.py and
# the recipe's own tests run Muon). No loss.png (matplotlib's half second a process): the runs that check it
# (tests/test_runs.py, test_monitor.py, test_dpo_train.py, test_readme_tour.py) and the fault tests write it.
TINY = [
    "data.tokenizer=embedded:shakespeare-bpe", "data.seq_len=32",
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
    "train.global_batch_size=8", "train.micro_batch_size=4",
    "train.eval_tokens=2048", "train.sample_tokens=8",
    "monitor.port=0", "monitor.log_every=1", "monitor.plot=false", "optim.warmup_steps=2", "optim.name=adamw",
]


# Seconds each slow test module takes on one worker of `python -m pytest -n 2` on the 2-core machine (its tests'
# setup, call and teardown summed, `--durations=0`); the modules not listed take under ~8. Under pytest-xdist the
# workers take whole modules, the costliest first: a module's shared runs (its module-scoped fixtures) are made once,
# and the pass ends on short modules, not with one worker running a long one while the other idles. Only the order
# matters: a rough figure is enough, and a module that grows slow is simply started later until it is listed.
MODULE_SECONDS = {
    "test_faults_signals.py": 292, "test_expert_parallel.py": 150, "test_dpo_train.py": 116, "test_fsdp.py": 112,
    "test_reward.py": 110, "test_grpo.py": 95,
    "test_faults_disk.py": 93, "test_data_identity.py": 45, "test_optim_state.py": 81, "test_chat_export.py": 79,
    "test_eval.py": 71,
    "test_multinode.py": 69, "test_faults_nodes.py": 58, "test_run_management.py": 50, "test_readme_tour.py": 34,
    "test_eval_training.py": 33, "test_compile_cache.py": 33, "test_distributed.py": 32, "test_deploy_run.py": 32,
    "test_cli_train.py": 26, "test_lora.py": 26, "test_data_hub.py": 23, "test_fused_norm.py": 18, "test_runs.py": 17,
    "test_architecture.py": 17, "test_data_prepare.py": 16, "test_faults.py": 15, "test_biased_attention.py": 15,
    "test_llama.py": 15, "test_hf_parity.py": 14, "test_gpu_console.py": 14, "test_monitor.py": 13, "test_muon.py": 12,
    "test_monitor_sinks.py": 12, "test_plan_time.py": 12, "test_plan.py": 11, "test_t5.py": 11, "test_config.py": 10,
    "test_faults_data.py": 9, "test_moe.py": 8, "test_rollout.py": 8, "test_hf_view.py": 8,
}


def pytest_collection_modifyitems(config, items):
    """Modules in the order of MODULE_SECONDS, costliest first; each module's tests in their own order."""
    rank = {}
    for item in items:
        rank.setdefault(item.path.name, len(rank))
    items.sort(key=lambda item: (-MODULE_SECONDS.get(item.path.name, 0), rank[item.path.name]))


try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:   # pytest-xdist is in the test extra; without it the tests run in one process
    pass
else:
    def pytest_xdist_make_scheduler(config, log):
        """`-n N` (xdist's `--dist load`): whole modules to each worker, in the order collected (see MODULE_SECONDS).
        Another --dist given on the command line is kept."""
        if config.getvalue("dist") != "load":
            return None
        config.option.loadscopereorder = False   # xdist would order the modules by their number of tests
        return LoadFileScheduling(config, log)


@pytest.fixture(autouse=True)
def _trainbox_logger_as_found():
    """A test that runs `trainbox train` in this process gets the CLI's console handlers on the trainbox logger,
    which then stops propagating: put it back, so caplog sees the next test's records."""
    import logging
    log = logging.getLogger("trainbox")
    level, handlers = log.level, list(log.handlers)
    yield
    for h in list(log.handlers):
        if h not in handlers:
            log.removeHandler(h)
            h.close()
    log.propagate, log.level = True, level


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenized copy of the embedded corpus for the whole test session."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tiny(tmp_path, data_cache) -> list[str]:
    """Overrides for a tiny run whose run directory lives in tmp_path."""
    return [*TINY, f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={data_cache}"]


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m trainbox ARGS` as a user would; returns the completed process."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "trainbox", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainbox {' '.join(args)} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def run_check_script(code: str, env: dict | None = None, timeout: float = 300) -> None:
    """Run `code` in a fresh Python process (with `env` added to the environment); it must exit 0 and print
    exactly "ok". For checks that need a clean process or interpreter settings (TRITON_INTERPRET=1)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# Triton's interpreter turns a runtime loop bound into an index with int(array of shape (1,)), which numpy >= 2.3
# refuses; the scripts run by run_in_triton_interpreter give it the scalar
INTERPRETER_PATCH = r"""
import triton.runtime.interpreter as ti
_patch = ti._patch_lang_tensor
def _patched(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
ti._patch_lang_tensor = _patched
"""


def run_in_triton_interpreter(code: str) -> None:
    """run_check_script(code) with TRITON_INTERPRET=1: Triton kernels on the CPU (skipped where Triton is missing)."""
    import pytest
    pytest.importorskip("triton")
    run_check_script(INTERPRETER_PATCH + code, {"TRITON_INTERPRET": "1"})


def load_benchmark(name: str):
    """Import benchmarks/NAME.py (with benchmarks/ on sys.path, for its `common` module)."""
    import importlib.util
    bench = REPO / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def model_section(family: str, **options):
    """A ModelSection of `family` with the generic options it reads among `options` (the others left out, as a
    recipe for that family would), so one test can build several families from one set of settings."""
    from trainbox.config import ModelSection
    from trainbox.model.spec import OPTIONS
    from trainbox.model.spec import family as family_spec
    spec = family_spec(family)
    return ModelSection(family=family, **{k: v for k, v in options.items() if k not in OPTIONS or spec.supports(k)})
