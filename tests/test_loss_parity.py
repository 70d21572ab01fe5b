"""benchmarks/loss_parity.py's statistics, train_speed.py's seeded nanoGPT copy and profile_step.py's split of
communication time, train_speed.py's MoE drop rate (the GPU runs themselves live in benchmarks/, not in tests)."""
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_welch_interval_against_a_reference():
    """Welch's textbook example (Wikipedia, "Welch's t-test", example 1): scipy.stats.ttest_ind(equal_var=False)
    gives df 24.99 and the 95% interval (-3.9841, -0.3492) of the difference of means; ours rounds df down to
    its t table, so its interval may only be as wide or a little wider."""
    compare = load("loss_parity").compare
    a1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
    a2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]
    r = compare(a1, a2)
    assert r["difference"] == pytest.approx(20.82 - 22.98667, abs=1e-4)
    assert r["welch_df"] == pytest.approx(24.99, abs=0.06)
    lo, hi = r["interval_95"]
    assert lo <= -3.9841 and hi >= -0.3492
    assert (hi - lo) <= 1.03 * (3.9841 - 0.3492)
    assert r["verdict"] == "no worse"


def test_verdicts():
    compare = load("loss_parity").compare
    # measured values, gpt2-125m after 100 steps: ours (FP8 head, 4 seeds) against nanoGPT (3 seeds)
    r = compare([3.6496, 3.7996, 3.6878, 3.6304], [3.6476, 3.6241, 3.7056])
    assert r["verdict"] == "inconclusive" and r["interval_95"][0] < 0 < r["interval_95"][1]
    assert compare([3.90, 3.91, 3.92], [3.60, 3.61, 3.62])["verdict"] == "worse"
    assert compare([3.60, 3.70], [3.65, 3.66])["verdict"] == "no worse"
    with pytest.raises(ValueError, match="at least two runs"):
        compare([3.6], [3.6, 3.7])


def test_seeded_nanogpt_copy(tmp_path):
    """nanoGPT fixes its seed in train.py: the copy changes that line only, and a script without it is
    refused with the line it looked for."""
    train_speed = load("train_speed")
    text = "import torch\nseed_offset = 0\ntorch.manual_seed(1337 + seed_offset)\nprint('train')\n"
    (tmp_path / "train.py").write_text(text)
    name = train_speed.seeded_script(str(tmp_path), 1338)
    assert (tmp_path / name).read_text() == text.replace("1337 + seed_offset", "1338 + seed_offset")
    assert (tmp_path / "train.py").read_text() == text
    (tmp_path / "train.py").write_text("import torch\ntorch.manual_seed(42)\n")
    with pytest.raises(SystemExit, match="no line 'torch.manual_seed"):
        train_speed.seeded_script(str(tmp_path), 7)


def test_results_from_several_files(tmp_path):
    """--results: the run lines of separate GPU calls (measured, gpt2-125m after 200 steps), mixed with other
    output, give the comparison of the whole; a run line without a validation loss is refused by file and
    line; running needs its paths unless --results is given."""
    import json
    import subprocess

    script = str(BENCH / "loss_parity.py")
    ours = [{"who": "trainbox", "seed": s, "val_loss": v} for s, v in ((1337, 2.9797), (1, 3.2165), (2, 3.1406))]
    nano = [{"who": "nanogpt", "seed": s, "val_loss": v} for s, v in ((1337, 3.0435), (1338, 2.9353))]
    (tmp_path / "a.jsonl").write_text("installed\n" + "\n".join(json.dumps(r) for r in ours[:2]) + "\n{not json\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(ours[2]) + "\n" + "\n".join(json.dumps(r) for r in nano) + "\n")
    out = subprocess.run([sys.executable, script, "--results", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
                         capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    assert [x["seed"] for x in r["runs"]] == [1337, 1, 2, 1337, 1338]
    assert r["mean"] == {"ours": 3.1123, "nanogpt": 2.9894} and r["verdict"] == "inconclusive"
    assert r == {**r, **load("loss_parity").compare([x["val_loss"] for x in ours], [x["val_loss"] for x in nano])}

    (tmp_path / "c.jsonl").write_text(json.dumps({"who": "nanogpt", "seed": 7, "error": "CUDA OOM"}) + "\n")
    bad = subprocess.run([sys.executable, script, "--results", str(tmp_path / "b.jsonl"), str(tmp_path / "c.jsonl")],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "c.jsonl:1: a nanogpt run without a validation loss" in bad.stderr
    few = subprocess.run([sys.executable, script, "--results", str(tmp_path / "a.jsonl")],
                         capture_output=True, text=True)
    assert few.returncode != 0 and "need at least two runs a side, got 2 of ours and 0 of nanoGPT's" in few.stderr
    usage = subprocess.run([sys.executable, script, "gpt2-125m", "--only", "nanogpt"], capture_output=True, text=True)
    assert usage.returncode == 2 and "--nanogpt, --nanogpt-data required" in usage.stderr


def test_val_coverage(tmp_path):
    """Our evaluation reads the first train.eval_tokens of validation, nanoGPT random windows of all of it:
    the share our runs covered is checked (a short prefix of a corpus can be far harder or easier than the
    whole, enough to fake a gap between the two)."""
    import numpy as np

    val_coverage = load("loss_parity").val_coverage
    np.zeros(1000, dtype=np.uint16).tofile(tmp_path / "val.bin")
    runs = [{"who": "trainbox", "val_tokens": 960}, {"who": "trainbox", "val_tokens": 500}, {"who": "nanogpt"}]
    assert val_coverage(runs, str(tmp_path)) == 0.5
    assert val_coverage(runs[:1], str(tmp_path)) == 0.96


def test_gpu_pool_runs_one_job_per_gpu_at_once():
    """--gpus: as many jobs at once as GPUs, never two on one GPU, results in job order. The barrier needs two
    jobs running at the same time: run one after another, it breaks (after its timeout) and the test fails.
    Without GPUs the jobs get the environment as it is."""
    import os
    import threading

    run_on_gpus = load("loss_parity").run_on_gpus
    barrier, lock, held = threading.Barrier(2, timeout=60), threading.Lock(), set()

    def job(i):
        def run(env):
            gpu = env["CUDA_VISIBLE_DEVICES"]
            with lock:
                assert gpu not in held
                held.add(gpu)
            barrier.wait()
            with lock:
                held.discard(gpu)
            return i, gpu
        return run

    out = run_on_gpus([job(i) for i in range(4)], ["0", "1"])
    assert [i for i, _ in out] == [0, 1, 2, 3] and {g for _, g in out} == {"0", "1"}
    assert run_on_gpus([lambda env: env.get("CUDA_VISIBLE_DEVICES")], []) == [os.environ.get("CUDA_VISIBLE_DEVICES")]


FAKE_NANOGPT = '''import os, pathlib, sys, time
class torch:  # stands in for torch: this train.py only checks run_nanogpt's plumbing
    @staticmethod
    def manual_seed(s):
        global SEED
        SEED = s
seed_offset = 0
torch.manual_seed(1337 + seed_offset)
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
val = pathlib.Path("data") / args["dataset"] / "val.bin"
before = val.read_bytes()
marks = pathlib.Path(os.environ["MARKS"])
(marks / str(SEED)).write_text(args["dataset"] + " " + os.environ.get("CUDA_VISIBLE_DEVICES", "-"))
pathlib.Path(args["out_dir"]).joinpath("ckpt.pt").write_bytes(b"checkpoint")
(marks.parent / f"out_{SEED}").write_text(args["out_dir"])
deadline = time.time() + 60
while len(list(marks.iterdir())) < 2 and time.time() < deadline:  # wait for the other run to start
    time.sleep(0.02)
assert val.read_bytes() == before, "data link changed under a running job"
for i in range(int(args["max_iters"]) + 1):
    print(f"iter {i}: loss {10 - i}.0, time 100.0ms, mfu 40.00%")
print(f"step {args['max_iters']}: train loss 3.0, val loss {SEED / 1000:.4f}")
'''


def seen_out_dirs(marks):
    return [f.read_text() for f in marks.parent.glob("out_*")]


def test_nanogpt_runs_share_a_checkout_at_once(tmp_path):
    """Two seeds of nanoGPT at once from one checkout (as --gpus runs them): each run links the data under a
    name of its own, so neither link is replaced under the other; links and seeded copies are gone after."""
    import os

    train_speed, run_on_gpus = load("train_speed"), load("loss_parity").run_on_gpus
    repo, data, marks = tmp_path / "nanoGPT", tmp_path / "data", tmp_path / "marks"
    for d in (repo / "data", data, marks):
        d.mkdir(parents=True)
    (repo / "train.py").write_text(FAKE_NANOGPT)
    (data / "val.bin").write_bytes(b"\x01\x00" * 8)
    os.environ["MARKS"] = str(marks)
    try:
        jobs = [lambda env, s=s: train_speed.run_nanogpt(str(repo), str(data), 3, 1, [], s, env=env)
                for s in (1337, 1338)]
        res = run_on_gpus(jobs, ["0", "1"])
    finally:
        del os.environ["MARKS"]
    assert [r["val_loss"] for r in res] == [1.337, 1.338]
    names, gpus = zip(*(f.read_text().split() for f in sorted(marks.iterdir())))
    assert len(set(names)) == 2 and set(gpus) == {"0", "1"}  # a data link and a GPU of its own
    assert [r["losses"] for r in res] == [[10.0, 9.0, 8.0, 7.0]] * 2
    assert sorted(p.name for p in repo.iterdir()) == ["data", "train.py"] and not list((repo / "data").iterdir())
    out_dirs = seen_out_dirs(marks)
    assert len(out_dirs) == 2 and not any(Path(d).exists() for d in out_dirs)  # nanoGPT's checkpoints are gone


def test_step_parity_pairs_runs_by_seed():
    """benchmarks/step_parity.py's summary: each arm's per-step loss minus nanoGPT's on the same seeds, and the
    validation losses paired by seed (same weights, same batches) with a t interval: for diffs 0.01, 0.03,
    0.05 the mean is 0.03 and the half-width t(2) * 0.02 / sqrt(3) = 4.303 * 0.011547 = 0.0497. A seed that
    only one arm ran is left out of the pairs."""
    summary = load("step_parity").summary
    runs = [{"arm": "nanogpt", "seed": s, "losses": [10.0, 8.0 + s], "val_loss": 3.0 + s} for s in (1, 2, 3)]
    runs += [{"arm": "trainer", "seed": s, "losses": [10.0, 8.0 + s + d], "val_loss": 3.0 + s + d}
             for s, d in ((1, 0.01), (2, 0.03), (3, 0.05), (4, 9.0))]
    r = summary(runs)
    assert r["minus_nanogpt"]["trainer"] == [0.0, 0.03]
    p = r["val_minus_nanogpt"]["trainer"]
    assert p["n"] == 3 and p["mean"] == 0.03 and p["diffs"] == [0.01, 0.03, 0.05]
    assert p["interval_95"] == [pytest.approx(0.03 - 0.0497, abs=1e-4), pytest.approx(0.03 + 0.0497, abs=1e-4)]
    assert p["verdict"] == "inconclusive"
    better = summary([*runs[:3], *[{**x, "arm": "ours", "val_loss": x["val_loss"] - 0.02} for x in runs[:3]]])
    assert better["val_minus_nanogpt"]["ours"]["verdict"] == "no worse"
    worse = summary([*runs[:3], *[{**x, "arm": "ours", "val_loss": x["val_loss"] + 0.1 + 0.01 * x["seed"]}
                                  for x in runs[:3]]])
    assert worse["val_minus_nanogpt"]["ours"]["verdict"] == "worse"


def test_profile_splits_communication_into_hidden_and_exposed():
    """profile_step.py's overlap arithmetic on a hand-made timeline (microseconds): an all-gather 0-10 under a
    matmul 5-8 and an attention kernel 9-20 is hidden for 3 + 1 and exposed for 6; a reduce-scatter 25-30 with
    nothing beside it is exposed whole; overlapping kernels of one kind count once."""
    split = load("profile_step").communication_overlap([
        (0, 10, "ncclDevKernel_AllGather_RING_LL"), (5, 8, "sm90_xmma_gemm_bf16"), (9, 20, "flash_fwd_kernel"),
        (6, 7, "triton_poi_fused_add"), (25, 30, "ncclDevKernel_ReduceScatter_RING_LL")])
    assert split == {"compute_us": 14, "comm_us": 15, "comm_hidden_us": 4, "comm_exposed_us": 11}


def test_train_speed_reports_the_moe_drop_rate_per_step():
    """train_speed's `moe_dropped_frac`: each logged step's dropped share averaged over the MoE layers; nothing
    for a dropless or dense run."""
    dropped = load("train_speed").dropped
    train = [{"step": 1, "loss": 9.0, "moe.0.dropped_frac": 0.30, "moe.2.dropped_frac": 0.10},
             {"step": 2, "loss": 8.0, "moe.0.dropped_frac": 0.05, "moe.2.dropped_frac": 0.0}]
    assert dropped(train) == {"moe_dropped_frac": [0.2, 0.025]}
    assert dropped([{"step": 1, "loss": 9.0, "moe.0.dropped_frac": 0.0}]) == {}
    assert dropped([{"step": 1, "loss": 9.0, "grad_norm": 1.0}]) == {}


def test_train_speed_reports_the_settled_steps_of_a_dropping_router():
    """train_speed's settled median: the steps after the warm-up whose router dropped at most 10% of the
    assignments (expert parallelism computes only the kept ones, so the earlier, dropping steps run faster)."""
    settled = load("train_speed").settled
    drops = [0.6, 0.5, 0.4, 0.2, 0.08, 0.05, 0.04]   # steps 1-7
    every_step = [0.8, 0.85, 0.9, 1.1, 1.2, 1.15]    # steps 2-7
    got = settled(drops, every_step, 1, 0.27)
    # steps 5, 6, 7 (drops 0.08, 0.05, 0.04): 1.1, 1.2, 1.15 s; the dropping steps 3 and 4 are left out
    assert got == {"settled_steps": 3, "settled_median_step_ms": 1150.0, "settled_mfu": pytest.approx(0.27 / 1.15,
                                                                                                       abs=1e-4)}
    assert settled(drops[:4], every_step[:3], 1, 0.27) == {"settled_steps": 0}
    assert settled(None, [], 0, 0.27) == {}   # dense or dropless
    assert settled(drops[:3], every_step, 1, 0.27) == {}   # not every step logged


def test_profile_counts_kernels_once_and_never_the_annotations_around_them():
    """profile_step.py's time by kind: a reduce-scatter kernel and the "nccl:_reduce_scatter_base" range c10d
    records around it on the GPU, or FSDP's "FSDP::all_gather (...)": the kernel counts, the annotations do not;
    the CPU side of an op is left out; an optimizer's annotated GPU span is reported apart."""
    from types import SimpleNamespace as Row

    import torch
    gpu, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def row(key, us, device=gpu, count=2, note=False):
        return Row(key=key, device_type=device, self_device_time_total=us, count=count, is_user_annotation=note)
    rows = [row("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 4000), row("nccl:_reduce_scatter_base", 4000, note=True),
            row("FSDP::all_gather (model.layers.0)", 600, note=True), row("nvjet_sm90_tst_128x256", 10000, count=8),
            row("aten::mm", 10000, device=cpu), row("Optimizer.step#AdamW.step", 3000, note=True),
            row("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata", 2400)]
    per_kind, kernels, optimizer = load("profile_step").kernel_times(rows, 2, cuda=True)
    assert dict(per_kind) == {"communication": 2.0, "matmul": 5.0, "optimizer": 1.2}
    assert kernels == [(2.0, 1, "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"), (5.0, 4, "nvjet_sm90_tst_128x256"),
                       (1.2, 1, "multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata")]
    assert optimizer == {"AdamW": 1.5}
