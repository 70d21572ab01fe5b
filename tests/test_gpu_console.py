"""What a compiled run prints at its start holds none of torch's notices about our own set-up:

- Dynamo's "Profiler record function ... will be ignored", from compiling DistributedDataParallel's forward (it runs
  inside torch.autograd.profiler.record_function), on every rank; dropped in parallel/ddp.py. Checked on CPU with
  two gloo processes, and on GPUs.
- Inductor's "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled", from the
  float32 matmuls a bf16 run leaves outside autocast; train/device.py sets them to TF32 ("high"), train.dtype=fp32
  keeps IEEE float32 ("highest"). Inductor warns only on a CUDA GPU; on CPU the choice and its filter are checked.

    python -m pytest -q tests/test_gpu_console.py               # the CPU tests
    python -m pytest -q -m gpu tests/test_gpu_console.py        # on the GPU machine
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import TINY, run_cli

from trainbox.train.device import TF32_ADVICE, set_float32_matmuls

NOTICES = ("will be ignored", "TensorFloat32")


def _console(p) -> str:
    return p.stdout + p.stderr


@pytest.mark.slow
def test_compiled_ddp_start_is_quiet_on_cpu(tmp_path, data_cache):
    args = [*TINY, "train.device=cpu", "train.compile=true", "train.max_steps=2", "train.eval_tokens=256",
            "train.sample_tokens=0", f"run.dir={tmp_path}", "run.name=ddp", f"data.cache_dir={data_cache}"]
    p = run_cli("train", "--nproc", "2", *args, timeout=600)
    assert "process group:" in p.stderr   # two ranks under DDP, so DDP's forward was compiled
    assert not [n for n in NOTICES if n in _console(p)], _console(p)
    assert json.loads((tmp_path / "ddp" / "env.json").read_text())["float32_matmul_precision"] == "highest"


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    with warnings.catch_warnings():   # set_float32_matmuls' filter ends with the test
        yield
    torch.set_float32_matmul_precision(before)


def test_float32_matmul_choice(matmul_precision):
    """bf16 runs: TF32, the state Inductor checks before it warns (torch._inductor.compile_fx._warn_tf32_disabled);
    fp32 runs: IEEE float32, and Inductor's advice, only Inductor's, is filtered."""
    for dtype in (torch.bfloat16, torch.float16):
        set_float32_matmuls(dtype)
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
    set_float32_matmuls(torch.float32)
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        set_float32_matmuls(torch.float32)   # its filter goes in front of "always"
        for module in ("torch._inductor.compile_fx", "torch._inductor.fx_passes.fuse_attention", "elsewhere"):
            warnings.warn_explicit(f"{TF32_ADVICE}. Consider setting ...", UserWarning, "x.py", 1, module=module)
    assert [w.message.args[0] for w in seen] == [f"{TF32_ADVICE}. Consider setting ..."]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("nproc", [1, 2])
def test_compiled_gpu_start_is_quiet(tmp_path, data_cache, nproc):
    """gpt2-125m's settings (bf16, compiled, fused kernels) on a 2-layer model, a few steps on 1 GPU and on 2."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    args = ["gpt2-125m", "data.path=embedded:shakespeare", "model.n_layer=2", "model.n_head=2", "model.n_embd=128",
            "data.seq_len=128", "train.global_batch_size=16", "train.micro_batch_size=4", "train.max_steps=5",
            "train.eval_every=5", "train.eval_tokens=4096", "train.sample_tokens=0", "monitor.port=0",
            f"run.dir={tmp_path}", "run.name=gpu", f"data.cache_dir={data_cache}"]
    p = run_cli("train", *(["--nproc", str(nproc)] if nproc > 1 else []), *args, timeout=900)
    assert "device cuda:0 (bfloat16)" in p.stderr and "step 5/5" in p.stderr, _console(p)
    assert not [n for n in NOTICES if n in _console(p)], _console(p)
    assert json.loads((tmp_path / "gpu" / "env.json").read_text())["float32_matmul_precision"] == "high"
