"""`trainbox doctor` reports this machine's facts (checked against the sources they come from) and exits
non-zero exactly when something the given recipe needs is missing."""
from __future__ import annotations

import json
import platform
import shutil
import sys

import pytest
import torch
from conftest import run_cli


def test_doctor_reports_facts(tmp_path, monkeypatch, capsys):
    """`trainbox doctor --json` (in process: cli.main reads the environment like the console script)."""
    from trainbox.cli import main

    (tmp_path / "inductor").mkdir()
    (tmp_path / "inductor" / "kernel.so").write_bytes(b"x" * 3 * 1024 * 1024)  # 3.0 MiB of "compiled kernels"
    hf = tmp_path / "hf"
    for k, v in {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1",
                 "TRITON_CACHE_DIR": str(tmp_path / "triton")}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    rc = main(["doctor", "--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert rc == 0
    assert checks["python"]["value"] == platform.python_version()
    assert checks["torch"]["value"] == torch.__version__
    assert checks["encoder"]["status"] == "ok" and checks["encoder"]["value"].startswith("fastokens ")
    assert checks["inductor_cache"]["value"] == f"{tmp_path / 'inductor'} (3.0 MiB)"
    assert checks["triton_cache"]["value"].startswith(str(tmp_path / "triton"))
    assert checks["hf_cache"]["value"] == f"{hf / 'hub'} (0 B)"
    assert checks["hf_offline"]["value"].startswith("on")
    shm = shutil.disk_usage("/dev/shm").total / 2**30
    assert checks["shm"]["value"] == f"{shm:.1f} GiB"
    if not torch.cuda.is_available():
        assert checks["gpus"]["status"] == "warn" and "CPU" in checks["gpus"]["value"]
    else:
        assert checks["gpu0"]["value"].startswith(torch.cuda.get_device_name(0))


def test_doctor_fails_when_the_recipe_needs_what_is_missing(tmp_path, monkeypatch):
    from trainbox.config import load_config
    from trainbox.doctor import run_checks

    monkeypatch.chdir(tmp_path)

    def checks(*args):
        return {c.name: c for c in run_checks({}, load_config(args[0], args[1:]))}

    assert checks("tiny")["recipe"].status == "ok"  # embedded corpus: everything is here
    fetched = checks("gpt2-125m")["data"]  # data/fineweb does not exist in tmp_path: train downloads it
    assert fetched.status == "ok" and "1 validation + 94 training shards" in fetched.value
    missing = checks("gpt2-125m", "data.download=false")["needs_data"]
    assert missing.status == "fail" and "trainbox data fineweb" in missing.fix
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "fineweb_train_000001.bin").write_bytes(b"")
    assert "needs_data" not in checks("gpt2-125m")
    if not torch.cuda.is_available():
        assert checks("tiny", "train.device=cuda")["needs_gpu"].status == "fail"
        fp8 = checks("tiny", "model.fp8_mlp=down", "model.fp8_head=true")["needs_fp8"]
        assert fp8.status == "fail" and "drop model.fp8_head and model.fp8_mlp" in fp8.fix
        # the recipes that turn FP8 on fall back to plain matmuls without it: a warning, not a failure
        checked = checks("speedrun-124m", "train.device=cpu")
        assert "needs_fp8" not in checked and checked["fp8"].status == "warn"
        assert "model.fp8_head and model.fp8_mlp run as plain matmuls" in checked["fp8"].value
        flash = checks("speedrun-124m", "model.attention=flash")["needs_flash_attention"]
        assert flash.status == "fail" and "Hopper" in flash.value and "trainbox[flash]" in flash.fix
        assert "needs_flash_attention" not in checks("speedrun-124m")  # auto: FlexAttention or SDPA instead
    assert "needs_fp8" not in checks("tiny")
    # the CLI exits 1 and names the missing piece and its fix
    proc = run_cli("doctor", "gpt2-125m", "data.path=nowhere/x", "data.download=false", cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "FAIL  needs_data" in proc.stdout and "-> trainbox data fineweb" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="what doctor says of FP8 on a machine without a GPU")
def test_fp8_on_a_cpu_only_machine_is_said_to_need_a_cuda_gpu(tmp_path):
    """`trainbox doctor` without a GPU: FP8 is not this machine's to offer, and each line that names it says what it
    needs (a CUDA GPU of compute capability 8.9+) and that there is none here, in the words of the other CPU lines; the
    fallback is float32, the CPU's dtype. A GPU recipe (already a failure here) says nothing of its FP8."""
    gpus = "a CUDA GPU of compute capability 8.9+ (L4, L40S, H100, H200)"
    none = "no GPU is visible here"

    def doctor(*args: str) -> tuple[int, dict[str, tuple[str, str, str]]]:
        """-> (exit code, {check: (status, value, fix)}) of the lines that name FP8, as printed."""
        proc = run_cli("doctor", *args, cwd=tmp_path, check=False)
        checks, name = {}, None
        for line in proc.stdout.splitlines():
            if line.startswith(" ") and name:
                checks[name] = (*checks[name][:2], line.strip().removeprefix("-> "))
                continue
            status, name, value = line.split(None, 2)
            checks[name] = (status, value, "")
        return proc.returncode, {k: v for k, v in checks.items() if "fp8" in k or "float8" in k}

    assert doctor() == (0, {})   # no GPU line names FP8 when there is no GPU
    assert doctor("tiny", "model.fp8_head=true") == (1, {"needs_fp8": (
        "FAIL", f"model.fp8_head needs {gpus} for FP8 matmuls, and {none}",
        "drop model.fp8_head (the matmuls then run in float32 on the CPU), or set model.fp8_fallback=true")})
    assert doctor("tiny", "model.fp8_head=true", "model.fp8_mlp=down", "model.fp8_fallback=true") == (0, {"fp8": (
        "WARN", f"model.fp8_head and model.fp8_mlp run as plain matmuls, in float32 on the CPU (model.fp8_fallback): "
        f"FP8 needs {gpus}, and {none}", "")})
    assert doctor("tiny", "train.float8=true") == (1, {"needs_float8": (
        "FAIL", f"train.float8=true needs {gpus} for FP8 matmuls, and {none}",
        "drop train.float8 (the matmuls then run in float32 on the CPU)")})
    assert doctor("speedrun-124m") == (1, {})


def test_flash_extra_advice_names_its_cost_and_records():
    """The decision is a function of (compute capability, what stops the extra); its figures are the records'."""
    from conftest import REPO

    from trainbox.doctor import FLASH_SPEED, PLAIN_SPEED, flash_check

    for cap in ((9, 0), (10, 0)):
        warn = flash_check(cap, "flash-attn-4 is not installed")
        assert warn.status == "warn" and warn.fix.startswith("pip install 'trainbox[flash]'")
        assert f"capability {cap[0]}.{cap[1]} GPU (flash-attn-4 is not installed)" in warn.value
        assert (f"runs at {PLAIN_SPEED[0]} nanoGPT's speed on an H100 without it ({PLAIN_SPEED[1]}) and "
                f"{FLASH_SPEED[0]} with it ({FLASH_SPEED[1]})") in warn.value
        broken = flash_check(cap, "quack-kernels is installed but `import quack` fails: ImportError: x")
        assert broken.fix.startswith("repair the install") and "import quack` fails" in broken.value
        # QuACK 0.6.5 with the CUTLASS DSL installed by `pip install --target /tmp/fx`, as it failed on an H200
        outside = flash_check(cap, "quack-kernels is installed but does not load: TypeError: epilogue fn depends on "
                                   "<ContextVar name='_LOC_TRANSFORMS'> (type _contextvars.ContextVar), which has no "
                                   "fail-closed semantic key.")
        assert outside.status == "warn" and outside.fix.startswith("install the extra into the environment's "
                                                                   "site-packages")
        assert flash_check(cap, None).status == "ok"
    for cap in ((8, 0), (8, 9), (7, 5), (12, 0)):   # no FlashAttention-4 kernels there: nothing to say
        assert flash_check(cap, "flash-attn-4 is not installed") is None
    # the figures are the records' own: gpt2-125m on one H100 against the same nanoGPT step time
    fast = json.loads((REPO / FLASH_SPEED[1]).read_text())
    plain = json.loads((REPO / PLAIN_SPEED[1]).read_text())
    nanogpt_ms = fast["baseline"]["metrics"]["median_step_ms"]
    assert fast["recipe"] == plain["recipe"] == "gpt2-125m"
    assert fast["gpu"] == plain["gpu"] == {"name": "NVIDIA H100 80GB HBM3", "count": 1}
    assert "flash-attn-4" in fast["software"] and "did not import" in plain["notes"]
    assert f"{nanogpt_ms / fast['metrics']['median_step_ms']:.2f}x" == FLASH_SPEED[0]
    assert f"{nanogpt_ms / plain['metrics']['median_step_ms']:.2f}x" == PLAIN_SPEED[0]


def test_encoder_advice_names_the_records_figures():
    """With fastokens or without it, the speeds named are the prepare record's: ours and the tiktoken build's."""
    from conftest import REPO

    from trainbox.doctor import PREPARE_SPEED, encoder_check

    record = json.loads((REPO / PREPARE_SPEED[2]).read_text())
    assert f"{record['metrics']['ratio_2_workers_vs_plain']:.2f}x" == PREPARE_SPEED[0]
    assert f"with 2 workers, 3.36M with 1, against the plain loop's 3.84M: {PREPARE_SPEED[1]}" in record["notes"]
    assert record["software"]["fastokens"] and f"{PREPARE_SPEED[0]} a plain" in encoder_check(True).value
    slow = encoder_check(False)
    assert slow.status == "warn" and slow.fix == "pip install fastokens" and PREPARE_SPEED[1] in slow.value


def test_flash_problem_tells_missing_from_installed_but_broken(tmp_path, monkeypatch):
    """An installed flash-attn-4 whose import fails (its CUTLASS DSL libraries missing, as a CUDA 12 wheel set on a
    CUDA 13 torch) is named with the error the kernels' loader met, not mistaken for a missing package. Real
    distributions on sys.path."""
    import importlib

    from trainbox.doctor import flash_problem
    from trainbox.kernels.flash import _interface

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    assert flash_problem() == "flash-attn-4 is not installed"
    (tmp_path / "flash_attn_4-4.0.0.dist-info").mkdir()
    (tmp_path / "flash_attn_4-4.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn-4\n"
                                                                        "Version: 4.0.0\n")
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "interface.py").write_text("import cutlass_dsl_absent_here  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _interface.cache_clear()   # the loader's answer for this sys.path, not one cached before it
    try:
        assert flash_problem() == ("flash-attn-4 is installed but does not load: "
                                   "ModuleNotFoundError: No module named 'cutlass_dsl_absent_here'")
    finally:
        for name in ("flash_attn.cute.interface", "flash_attn.cute", "flash_attn"):
            sys.modules.pop(name, None)
        _interface.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_doctor_on_gpu():
    """On an H100: every GPU listed with its name, memory and capability; bf16, FlexAttention and NCCL work."""
    from trainbox.doctor import run_checks

    checks = {c.name: c for c in run_checks({})}
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        assert checks[f"gpu{i}"].value.startswith(p.name) and f"{p.major}.{p.minor}" in checks[f"gpu{i}"].value
    if torch.cuda.get_device_capability(0) >= (8, 0):
        assert checks["bf16"].status == "ok"
        assert checks["flex_attention"].status == "ok", checks["flex_attention"].value
    fp8 = torch.version.cuda is not None and torch.cuda.get_device_capability(0) >= (8, 9)
    assert checks["fp8"].value.startswith("yes" if fp8 else "no")
    assert checks["nccl"].status == "ok"
    from trainbox.doctor import flash_problem
    if torch.cuda.get_device_capability(0)[0] in (9, 10):   # Hopper, Blackwell: the flash extra, said either way
        assert checks["flash"].status == ("ok" if flash_problem() is None else "warn")
