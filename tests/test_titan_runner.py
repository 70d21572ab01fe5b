"""benchmarks/titan_speed.py's pure parts, on a machine without torchtitan: the parse of torchtitan's step log, the
model args it derives from our recipes (parameter counts equal to our models'), the job config it writes, and
train_speed.py's --titan baseline. The torchtitan runs themselves are GPU benchmarks (benchmarks/README.md).
The tests marked by importorskip also check the helpers against an installed torchtitan where there is one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
from conftest import load_benchmark

from trainbox.config import load_config
from trainbox.plan import run_vocab
from trainbox.plan.count import count_parameters

LLAMA_1B = ["model.llama.tie_embeddings=false", "model.vocab_size=128256"]


@pytest.fixture(scope="module")
def titan():
    return load_benchmark("titan_speed")


# torchtitan 0.2.2's console line of a step: components/metrics.py, MetricsProcessor.log, with its colours off
# (metrics.disable_color_printing: utils.NoColor, every colour ""), behind the prefix of tools/logging.py's
# init_logger ("[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s").
def titan_line(step, loss, grad_norm, gib, pct, tps, tflops, mfu, colour=""):
    c, reset = colour, "\x1b[39m" if colour else ""
    return ("[titan] 2026-11-27 10:00:00,000 - root - INFO - "
            f"{c}step: {step:2}  "
            f"{c}loss: {loss:8.5f}  "
            f"{c}grad_norm: {grad_norm:7.4f}  "
            f"{c}memory: {gib:5.2f}GiB"
            f"({pct:.2f}%)  "
            f"{c}tps: {round(tps):,}  "
            f"{c}tflops: {tflops:,.2f}  "
            f"{c}mfu: {mfu:.2f}%{reset}")


def test_the_step_log_parses_and_the_warm_up_is_left_out(titan):
    tps = [900.0, 1500.4, 47100.2, 46900.0, 47300.0, 46000.0]
    lines = ["[titan] ... - INFO - Training starts at step 1", "validate step:  3  loss: 9.1000  memory: 1.00GiB"]
    for i, t in enumerate(tps, 1):
        lines.append(titan_line(i, 12.5 - i * 0.1, 3.25, 20.0 + i, 14.3, t, t * 10636111872 / 1e12,
                                100 * t * 10636111872 / 989e12, colour="\x1b[31m" if i % 2 else ""))
    steps = titan.parse_steps("\n".join(lines))
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert [s["tps"] for s in steps] == [900, 1500, 47100, 46900, 47300, 46000]   # "47,100" read whole
    assert steps[2]["tflops"] == pytest.approx(500.96, abs=0.01)
    assert steps[0]["loss"] == pytest.approx(12.4) and steps[0]["mem_gib"] == 21.0

    got = titan.summarise(steps, warmup=2, tokens_per_step_per_gpu=2 * 8192)
    assert got["tokens_per_s_per_gpu"] == pytest.approx((47100 + 46900 + 47300 + 46000) / 4)
    assert got["tokens_per_s_per_gpu_median"] == 47000                          # (46900 + 47100) / 2
    assert got["median_step_ms"] == pytest.approx(16384 / 47000 * 1e3, abs=0.05)
    assert got["mfu"] == pytest.approx(sum(t * 10636111872 / 989e12 for t in tps[2:]) / 4, abs=1e-4)
    assert got["peak_memory_reserved_gib"] == 26.0                               # over every step, warm-up too
    assert (got["loss_first"], got["loss_last"], got["first_measured_step"]) == (12.4, pytest.approx(11.9), 3)
    with pytest.raises(SystemExit, match="logged 6 steps"):
        titan.summarise(steps, warmup=6, tokens_per_step_per_gpu=1)


def test_llama_args_have_our_parameter_count_and_ffn_width(titan):
    for recipe, overrides, expected in [("llama-1b", LLAMA_1B, 1_498_482_688),
                                        ("llama-8b", ["model.vocab_size=128256"], 8_030_261_248)]:
        cfg = load_config(recipe, overrides)
        vocab = run_vocab(cfg)
        model, args = titan.model_args(cfg, vocab)
        assert model == "llama3"
        assert titan.titan_ffn_hidden(args["dim"], args["multiple_of"], args["ffn_dim_multiplier"]) == \
            cfg.model.llama.intermediate_size
        ours = count_parameters(cfg, vocab).total
        assert titan.titan_param_count(model, args) == ours == expected   # the records' torchtitan counts
    # torchtitan's own Llama 3 8B flavour (models/llama3/__init__.py: multiplier 1.3, multiple of 1024) sizes alike
    assert titan.titan_ffn_hidden(4096, 1024, 1.3) == 14336
    with pytest.raises(SystemExit, match="tied head"):
        titan.model_args(load_config("llama-1b", []), 50304)


def test_moe_args_have_our_parameter_count_less_the_position_table(titan):
    cfg = load_config("moe-gpt2-125m", ["model.moe.num_experts=128", "model.moe.top_k=2"])
    vocab = run_vocab(cfg)
    model, args = titan.model_args(cfg, vocab)
    assert model == "qwen3" and args["enable_weight_tying"] and args["moe_inter_dim"] == 2048
    assert args["moe_args"]["num_experts"] == 128 and args["moe_args"]["top_k"] == 2
    ours = count_parameters(cfg, vocab)
    # SwiGLU experts of 2,048 hold what GELU experts of 3,072 hold; RoPE replaces our learned position table
    assert 3 * 768 * 2048 == 2 * 768 * 3072
    assert titan.titan_param_count(model, args) == ours.total - 1024 * 768 == 7_315_901_184
    # torchtitan logs its tied count less the embedding (models/utils.py): the record's 7,277,267,712
    assert titan.titan_param_count(model, args) - vocab * 768 == 7_277_267_712


def job_for(titan, argv):
    args = titan.parser().parse_intermixed_args(argv)
    recipe, extra = titan.CASES.get(args.recipe, (args.recipe, []))
    cfg = load_config(recipe, [*extra, *args.overrides])
    model, _ = titan.model_args(cfg, run_vocab(cfg))
    return tomllib.loads(titan.to_toml(titan.job_config(cfg, args, "/tmp/dump", model)))


def test_the_llama_float8_job_config_holds_what_was_asked(titan):
    job = job_for(titan, ["llama-1b", "--data", "/x/pyc", "--ngpu", "2", "--local-batch", "2", "--steps", "30",
                          "--float8", "tensorwise", *LLAMA_1B, "train.global_batch_size=4", "optim.warmup_steps=10"])
    assert job["model"] == {"name": "trainbox_llama3", "flavor": "trainbox", "converters": ["quantize.linear.float8"],
                            "hf_assets_path": "/tmp/dump"}
    assert job["training"]["local_batch_size"] == 2 and job["training"]["global_batch_size"] == 4
    assert job["training"]["seq_len"] == 8192 and job["training"]["steps"] == 30
    assert job["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert job["compile"]["enable"] is True and job["metrics"]["log_freq"] == 1
    assert job["quantize"]["linear"]["float8"] == {"filter_fqns": ["output"], "enable_fsdp_float8_all_gather": True,
                                                   "precompute_float8_dynamic_scale_for_fsdp": True}
    assert job["lr_scheduler"]["warmup_steps"] == 10 and job["optimizer"]["lr"] == 3e-4
    assert job["checkpoint"]["enable"] is False and job["debug"]["seed"] == 1337


def test_the_moe_job_config_holds_what_was_asked(titan):
    job = job_for(titan, ["moe-gpt2-125m-128x", "--data", "/x/pyc", "--ngpu", "2", "--ep", "2", "--local-batch", "24",
                          "--global-batch", "480", "--steps", "40", "--no-compile", "--ac", "full"])
    assert job["model"]["name"] == "trainbox_qwen3" and "quantize" not in job
    assert job["parallelism"] == {"data_parallel_shard_degree": -1, "expert_parallel_degree": 2}
    assert (job["training"]["local_batch_size"], job["training"]["global_batch_size"]) == (24, 480)
    assert job["training"]["seq_len"] == 1024 and job["compile"]["enable"] is False
    assert job["activation_checkpoint"] == {"mode": "full"}
    # without flags the recipe's settings: compiled, no activation checkpointing, its micro-batch
    job = job_for(titan, ["moe-gpt2-125m", "--data", "/x/pyc", "model.moe.expert_parallel=2"])
    assert job["compile"]["enable"] is True and job["activation_checkpoint"] == {"mode": "none"}
    assert job["parallelism"]["expert_parallel_degree"] == 2 and job["training"]["local_batch_size"] == 48


RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "records"


@pytest.mark.parametrize("argv, record, name", [
    (["moe-gpt2-125m-128x", "--ep", "2", "--local-batch", "24", "--global-batch", "480"],
     "2026-11-28-2xh200-moe-gpt2-125m-128x-ep2-vs-torchtitan.json", "torchtitan 0.2.2 MoE (qwen3 model code), EP2"),
    (["llama-1b", "--local-batch", "2", "--float8", "tensorwise", *LLAMA_1B, "train.global_batch_size=4"],
     "2026-11-27-2xh200-llama-1b-fsdp-2gpu-float8-200-seed1.json",
     "torchtitan 0.2.2 torchtitan.train, float8 tensorwise"),
])
def test_the_json_line_has_the_records_baseline_fields(titan, tmp_path, monkeypatch, argv, record, name):
    """prepare() writes the worker's spec and a TOML that reads back as the job config; figures() turns a run's log
    into a line with the name, version, command and every metric the records' torchtitan baselines carry."""
    monkeypatch.setattr(titan.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    args = titan.parser().parse_intermixed_args([*argv, "--data", "/x/pyc", "--ngpu", "2", "--steps", "4",
                                                 "--warmup", "2", "train.memory_limit_gib=80"])
    spec, job = titan.prepare(args)
    assert spec["memory_limit_gib"] == 80   # train_speed's --memory-gib caps torchtitan's processes too
    assert tomllib.loads((tmp_path / "job.toml").read_text()) == job
    assert json.loads((tmp_path / "spec.json").read_text())["tie_unit"] is (spec["model"] == "qwen3")
    own = {"params": 1, "flops_per_token": 969785856, **({"flops_per_token_with_head": 2} if spec["tie_unit"] else {})}
    log = "\n".join(["trainbox-titan: " + json.dumps(own),
                     "[titan] ... - INFO - Model trainbox_x trainbox size: 7,277,267,712 total parameters",
                     *(titan_line(i, 11.3 - i / 10, 1.0, 77.64, 55.5, t, 91.6, 9.3)
                       for i, t in enumerate([1000, 2000, 94000, 95000], 1))])
    out = titan.figures(log, spec, job, args, "0.2.2")
    expected = json.loads((RECORDS / record).read_text())["baseline"]["metrics"]
    assert out["name"] == name and out["version"] == "0.2.2" and "titan_speed.py" in out["command"]
    assert set(expected) - set(out) == set()
    tokens = job["training"]["global_batch_size"] // 2 * job["training"]["seq_len"]   # per GPU per step
    assert out["median_step_ms"] == pytest.approx(tokens / 94500 * 1e3, abs=0.05)
    assert out["params"] == 7_277_267_712 and out["local_batch"] == expected["local_batch"]


def test_train_speed_runs_titan_with_our_run_and_records_it_as_the_baseline():
    train_speed = load_benchmark("train_speed")
    args = type("Args", (), {"recipe": "llama-1b", "data": "/x/pyc", "nproc": 2, "steps": 30, "warmup": 10,
                             "overrides": ["train.parallel=fsdp", *LLAMA_1B], "titan": "--local-batch 2 --steps 20",
                             "baseline_overrides": None, "nanogpt_args": ""})()
    cmd = train_speed.titan_command(args)
    assert cmd[1].endswith("benchmarks/titan_speed.py")
    assert cmd[2:] == ["llama-1b", "--data", "/x/pyc", "--ngpu", "2", "--steps", "30", "--warmup", "10",
                       "train.parallel=fsdp", *LLAMA_1B, "--local-batch", "2", "--steps", "20"]
    base = {"who": "torchtitan", "name": "torchtitan 0.2.2 torchtitan.train", "version": "0.2.2",
            "command": "python benchmarks/titan_speed.py llama-1b", "tokens_per_s_per_gpu": 47085.2}
    got = train_speed.baseline(args, base)
    assert got == {"name": "torchtitan 0.2.2 torchtitan.train", "command": "python benchmarks/titan_speed.py llama-1b",
                   "metrics": {"version": "0.2.2", "tokens_per_s_per_gpu": 47085.2}}
    common = load_benchmark("common")
    record = common.Result(tool="train_speed", what="x", metrics={}, baseline=got, commit="0" * 40, dirty=False)
    assert common.validate(json.loads(json.dumps(record.to_dict()))) == []


def test_titan_speed_imports_no_torchtitan():
    import ast
    from pathlib import Path
    tree = ast.parse((Path(__file__).resolve().parents[1] / "benchmarks" / "titan_speed.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n and n.startswith("torchtitan")]


# ----------------------------------------------------------------------------------------------- with torchtitan

def test_the_log_format_is_the_installed_torchtitans():
    """Where torchtitan is installed: its MetricsProcessor.log formats the line the parser reads."""
    pytest.importorskip("torchtitan")
    import inspect

    from torchtitan.components.metrics import MetricsProcessor
    source = inspect.getsource(MetricsProcessor.log)
    for piece in ['step: {step:2}  "', 'loss: {global_avg_loss:8.5f}  "', 'memory: {device_mem_stats.max_reserved_gib'
                  ':5.2f}GiB"', 'tps: {round(tps):,}  "', 'tflops: {tflops:,.2f}  "', 'mfu: {mfu:.2f}%']:
        assert piece in source, piece


def test_the_installed_torchtitan_builds_the_counted_models(titan):
    """Where torchtitan is installed: its llama3 / qwen3 modules of the derived args (meta device) hold the counted
    parameters, and its own count and FLOPs are the records'."""
    pytest.importorskip("torchtitan")
    worker = load_benchmark("titan_worker")
    import torch
    from torchtitan.protocols.train_spec import get_train_spec
    for recipe, overrides, flops in [("llama-1b", LLAMA_1B, 10_636_111_872),
                                     ("moe-gpt2-125m", ["model.moe.num_experts=128"], 969_785_856)]:
        cfg = load_config(recipe, overrides)
        model, args = titan.model_args(cfg, run_vocab(cfg))
        spec = {"model": model, "model_args": args}
        margs = worker.model_args(spec)
        with torch.device("meta"):
            built = get_train_spec(model).model_cls(margs)
        assert sum(p.numel() for p in built.parameters()) == titan.titan_param_count(model, args)
        assert worker.flops_line(spec, cfg.data.seq_len)["flops_per_token"] == flops


TIE_CHECK = r'''
import json, os, sys
sys.path.insert(0, os.environ["BENCH"])
import torch, torch.distributed as dist
import torchtitan.distributed.parallel_dims as parallel_dims
parallel_dims.device_type = "cpu"   # torchtitan meshes on CUDA; this check runs on 2 CPU ranks over gloo
import titan_worker
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import get_train_spec
dist.init_process_group("gloo")
cfg = ConfigManager().parse_args(["--job.config_file", sys.argv[1]])
spec = {"model": "qwen3", "model_args": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16,
        "vocab_size": 256, "hidden_dim": 256, "qk_norm": False, "enable_weight_tying": True}}
args = titan_worker.model_args({**spec, "model_args": {**spec["model_args"], "moe_args": {}}})
args.update_from_config(cfg)
base = get_train_spec("qwen3")
with torch.device("meta"):
    model = base.model_cls(args)
model = titan_worker.tied_unit(base.parallelize_fn)(model, ParallelDims(1, -1, 1, 1, 1, 1, 1, 2), cfg)
for m in model.modules():   # gloo has no PREMUL_SUM: plain sums (torchtitan's divide factor is 1)
    if isinstance(m, FSDPModule):
        m.set_force_sum_reduction_for_comms(True)
model.to_empty(device="cpu")
torch.manual_seed(0)
with torch.no_grad():
    model.init_weights()
x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))   # the same batch on both ranks
model(x).float().logsumexp(-1).mean().backward()
ref = base.model_cls(args)    # unsharded, from the same weights
ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
ref.rope_cache = model.rope_cache
ref(x).float().logsumexp(-1).mean().backward()
print(json.dumps({"tied": model.output.weight is model.tok_embeddings.weight,
                  "grad": float(model.tok_embeddings.weight.grad.full_tensor().norm()),
                  "ref_grad": float(ref.tok_embeddings.weight.grad.norm())}), flush=True)
dist.destroy_process_group()
'''


def test_the_tied_unit_keeps_the_tie_under_fsdp(tmp_path):
    """Where torchtitan is installed: titan_worker.tied_unit around torchtitan's parallelize_qwen3 shards the tied
    embedding and head as one parameter (2 CPU ranks, gloo), whose gradient sums both uses on both ranks (twice an
    unsharded model's on the same batch). Without it torch refuses the shared parameter in two FSDP groups."""
    pytest.importorskip("torchtitan")
    import os
    import subprocess
    import sys
    from pathlib import Path
    (tmp_path / "check.py").write_text(TIE_CHECK)
    (tmp_path / "job.toml").write_text('[training]\nseq_len = 32\n[activation_checkpoint]\nmode = "none"\n')
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp_path / "check.py"), str(tmp_path / "job.toml")], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path,
                          env={**os.environ, "BENCH": str(Path(__file__).resolve().parents[1] / "benchmarks")})
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    for got in lines:
        assert got["tied"] and got["grad"] == pytest.approx(2 * got["ref_grad"], rel=1e-3)
