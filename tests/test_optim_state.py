"""optim.state_dtype: AdamW's moments in fp32 (torch.optim.AdamW, untouched) or bf16 (optim/adamw.py's
BF16StateAdamW). The bf16 path against a slow per-parameter reference written here with the same rounding, its
stochastic rounding against its definition, the refused values, an exact resume of a bf16 run (a cut run's
losses equal the uninterrupted run's) and a changed state_dtype applied on resume (the plan's count: test_plan.py).
DDP, FSDP2 and expert parallelism resume exactly too: the torchrun cases at the end."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import TINY, run_cli

from trainbox.config import load_config
from trainbox.errors import ConfigError
from trainbox.kernels import adamw as fused_adamw
from trainbox.optim import adamw
from trainbox.optim.adamw import BF16StateAdamW, round_stochastic_
from trainbox.optim.build import build_optimizers
from trainbox.train.loop import Trainer, train

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4))


def _groups(model: torch.nn.Module) -> list[dict]:
    return adamw.adamw_groups(list(model.named_parameters()), 0.1, HYPER["lr"])


def _steps(model: torch.nn.Module, opt, n: int, seed: int = 1) -> None:
    """n steps on batches drawn on the CPU, then moved to the model's device."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(64, 16, generator=gen).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _nearest(dst: torch.Tensor, src: torch.Tensor, generator) -> None:
    dst.copy_(src)


class ReferenceAdamW:
    """AdamW one parameter at a time, in fp32, each moment stored through `store` (fp32 -> the stored dtype) and
    read back: what BF16StateAdamW computes, written plainly."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float, store):
        self.groups, self.lr, self.betas, self.eps, self.store = groups, lr, betas, eps, store
        self.state = {id(p): (torch.zeros_like(p), torch.zeros_like(p)) for g in groups for p in g["params"]}
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        for g in self.groups:
            for p in g["params"]:
                m, v = (s.float() for s in self.state[id(p)])
                p.mul_(1 - self.lr * g["weight_decay"])
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                self.state[id(p)] = (self.store(m), self.store(v))
                denom = (v.sqrt() / (1 - b2 ** self.t) ** 0.5).add_(self.eps)
                p.addcdiv_(m, denom, value=-self.lr / (1 - b1 ** self.t))

    def zero_grad(self) -> None:
        for g in self.groups:
            for p in g["params"]:
                p.grad = None


# ----------------------------------------------------------------------------- the optimizer


def test_fp32_state_is_torch_adamw_unchanged():
    """optim.state_dtype=fp32 (the default) builds torch.optim.AdamW as before: bitwise its steps, Muon's AdamW part
    included."""
    for name in ("adamw", "muon"):
        cfg = load_config("tiny", ["model.n_layer=1", f"optim.name={name}"])
        assert cfg.optim.state_dtype == "fp32"
        model = _model()
        opts = build_optimizers(model, cfg.optim, torch.device("cpu"))
        assert type(opts[-1]) is torch.optim.AdamW and not opts[-1].defaults["fused"]
    model, ref = _model(), _model()
    cfg = load_config("tiny", ["optim.name=adamw"]).optim
    ours = build_optimizers(model, cfg, torch.device("cpu"))[0]
    theirs = torch.optim.AdamW(adamw.adamw_groups(list(ref.named_parameters()), cfg.weight_decay, cfg.lr), lr=cfg.lr,
                               betas=tuple(cfg.betas), eps=cfg.eps)
    _steps(model, ours, 5)
    _steps(ref, theirs, 5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("steps", [1, 6])
@pytest.mark.parametrize("chunk", [adamw.CHUNK, 100])   # 100: the 16x32 and 32x4 weights cut into pieces
def test_bf16_state_equals_the_reference_with_the_same_rounding(monkeypatch, steps, chunk):
    """With rounding to nearest on both sides, BF16StateAdamW's foreach steps equal the reference bit for bit: the
    same fp32 arithmetic as torch.optim.AdamW, moments stored in bf16. Its own rounding is checked below."""
    monkeypatch.setattr(adamw, "round_stochastic_", _nearest)
    monkeypatch.setattr(adamw, "CHUNK", chunk)
    model, ref = _model(), _model()
    opt = BF16StateAdamW(_groups(model), **HYPER)
    slow = ReferenceAdamW(_groups(ref), **HYPER, store=lambda t: t.bfloat16())
    _steps(model, opt, steps)
    _steps(ref, slow, steps)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
        assert a.dtype == torch.float32
        st = opt.state[a]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16 and int(st["step"]) == steps
        assert torch.equal(st["exp_avg"], slow.state[id(b)][0]) and torch.equal(st["exp_avg_sq"], slow.state[id(b)][1])


def test_bf16_state_stays_close_to_fp32_adamw():
    """Stochastic rounding moves each stored moment by less than one bf16 spacing (2^-8 of it) a step, and the update
    reads the fp32 moments: after 30 steps at lr 1e-2 the weights lie within 5e-3 of fp32 AdamW's (1.6e-3 to
    1.9e-3 measured over 6 seeds), under a fortieth of the 0.2 they moved. A lost bias correction or a wrong beta
    moves them by 1e-2 or more."""
    model, ref = _model(), _model()
    start = [p.detach().clone() for p in ref.parameters()]
    _steps(model, BF16StateAdamW(_groups(model), **HYPER), 30)
    _steps(ref, torch.optim.AdamW(_groups(ref), **HYPER), 30)
    gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    moved = max((b - s).abs().max().item() for b, s in zip(ref.parameters(), start))
    assert gap < 5e-3 and gap < moved / 40, (gap, moved)


def test_stochastic_rounding_picks_a_neighbour_with_the_right_odds():
    """Each value goes to one of its two bf16 neighbours, up with probability equal to where it lies between them
    (so the mean of many roundings is the value); bf16 values pass unchanged; a seed gives the same bits."""
    lo = torch.tensor([1.0, -3.0, 1e-20, 6.5e4], dtype=torch.bfloat16)
    hi = torch.nextafter(lo, lo * 2)            # the neighbour away from zero
    frac = torch.tensor([0.25, 0.5, 0.9, 0.1])
    x = lo.float() + frac * (hi.float() - lo.float())
    n = 20_000
    src = x.repeat(n, 1)
    dst = torch.empty_like(src, dtype=torch.bfloat16)
    round_stochastic_(dst, src, torch.Generator().manual_seed(0))
    up = dst == hi
    assert ((dst == lo) | up).all()
    # binomial: 5 standard deviations of the frequency over n draws
    assert torch.allclose(up.float().mean(0), frac, atol=5 * 0.5 / n ** 0.5)
    again = torch.empty_like(dst)
    round_stochastic_(again, src, torch.Generator().manual_seed(0))
    assert torch.equal(again, dst)
    # late steps of a large model seed the generator too
    round_stochastic_(again, src, torch.Generator().manual_seed(adamw._seed((10**8, 3, 10**5, 40), 1)))
    exact = lo.float().repeat(100, 1)
    out = torch.empty_like(exact, dtype=torch.bfloat16)
    round_stochastic_(out, exact, torch.Generator().manual_seed(1))
    assert torch.equal(out, lo.repeat(100, 1))


def test_state_dict_round_trip_keeps_bf16_and_continues_exactly():
    """A state dict loads back in bf16 (torch's load would cast it to the parameters' fp32), and the loaded
    optimizer steps as the one that saved it; an fp32 AdamW state loads into it rounded to bf16."""
    model = _model()
    opt = BF16StateAdamW(_groups(model), **HYPER)
    _steps(model, opt, 3)
    saved, twin = copy.deepcopy(opt.state_dict()), copy.deepcopy(model)
    again = BF16StateAdamW(_groups(twin), **HYPER)
    again.load_state_dict(saved)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in again.state.values())
    _steps(model, opt, 3, seed=2)
    _steps(twin, again, 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    fp32 = torch.optim.AdamW(_groups(model), **HYPER)
    _steps(model, fp32, 1)
    again.load_state_dict(fp32.state_dict())
    p = next(model.parameters())
    assert torch.equal(again.state[next(twin.parameters())]["exp_avg"], fp32.state[p]["exp_avg"].bfloat16())


# ----------------------------------------------------------------------------- the CUDA kernel (kernels/adamw.py)

cuda_kernel = pytest.mark.skipif(not torch.cuda.is_available() or fused_adamw.triton is None,
                                 reason="the Triton kernel runs on a CUDA GPU")


@cuda_kernel
def test_the_cuda_kernel_steps_as_the_foreach_path():
    """On a GPU each parameter's step is the Triton kernel: after one step the parameters equal the foreach path's
    to fp32 rounding (both update with the unrounded fp32 moments), and each stored moment is one of the two bf16
    neighbours of the fp32 moment; after 30 steps the weights lie as close to fp32 AdamW's as the foreach path's
    do (test_bf16_state_stays_close_to_fp32_adamw)."""
    model, ref = _model().cuda(), _model().cuda()
    fused, foreach = BF16StateAdamW(_groups(model), **HYPER), BF16StateAdamW(_groups(ref), **HYPER, fused=False)
    x = torch.randn(64, 16, device="cuda")
    for m, opt in ((model, fused), (ref, foreach)):
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
    b1, b2 = HYPER["betas"]
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for stored, exact in ((fused.state[a]["exp_avg"], (1 - b1) * a.grad),
                              (fused.state[a]["exp_avg_sq"], (1 - b2) * (a.grad * a.grad))):
            toward_zero = (exact.view(torch.int32) & -(1 << 16)).view(torch.float32).bfloat16()
            away = torch.nextafter(toward_zero, torch.where(exact < 0, -torch.inf, torch.inf).bfloat16())
            assert ((stored == toward_zero) | (stored == away)).all()
    model, fp32 = _model().cuda(), _model().cuda()
    _steps(model, BF16StateAdamW(_groups(model), **HYPER), 30)
    _steps(fp32, torch.optim.AdamW(_groups(fp32), **HYPER), 30)
    gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), fp32.parameters()))
    assert gap < 5e-3, gap


@cuda_kernel
def test_the_cuda_kernels_rounding_picks_a_neighbour_with_the_right_odds():
    """The kernel's stochastic rounding of the first moment: every element rounds to one of its two bf16 neighbours,
    up as often as the value lies toward the upper one (binomial, 5 standard deviations over 20,000 elements); the
    same seed gives the same moments."""
    lo = torch.tensor([1.0, -3.0, 1e-20, 6.5e4], dtype=torch.bfloat16, device="cuda")
    hi = torch.nextafter(lo, lo * 2)
    frac = torch.tensor([0.25, 0.5, 0.9, 0.1], device="cuda")
    n, beta1 = 20_000, 0.5
    exact = (lo.float() + frac * (hi.float() - lo.float())).repeat(n, 1)
    grad = exact / (1 - beta1)       # from zero moments the kernel's first moment is (1 - beta1) x grad, exactly
    outs = []
    for _ in range(2):
        p, m, v = torch.zeros_like(exact), torch.zeros_like(exact, dtype=torch.bfloat16), torch.zeros_like(
            exact, dtype=torch.bfloat16)
        fused_adamw.adamw_bf16_state_(p, grad, m, v, lr=0.0, beta1=beta1, beta2=0.9, eps=1e-8, weight_decay=0.0,
                                      step=1, seed=adamw._seed((7, 0, 3, 0), 0))
        outs.append(m)
    up = outs[0] == hi
    assert ((outs[0] == lo) | up).all()
    assert torch.allclose(up.float().mean(0), frac, atol=5 * 0.5 / n ** 0.5)
    assert torch.equal(outs[0], outs[1])


@cuda_kernel
def test_the_cuda_kernel_continues_exactly_from_a_state_dict():
    """A state dict saved after 3 steps and loaded into a copy: the next 3 steps equal the uninterrupted optimizer's,
    bit for bit (the kernel's random bits depend on the step and the parameter, not on the process)."""
    model = _model().cuda()
    opt = BF16StateAdamW(_groups(model), **HYPER)
    _steps(model, opt, 3)
    saved, twin = copy.deepcopy(opt.state_dict()), copy.deepcopy(model)
    again = BF16StateAdamW(_groups(twin), **HYPER)
    again.load_state_dict(saved)
    _steps(model, opt, 3, seed=2)
    _steps(twin, again, 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


# ----------------------------------------------------------------------------- the config


def test_state_dtype_takes_fp32_or_bf16_only():
    assert load_config("tiny", ["optim.state_dtype=bf16"]).optim.state_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"optim\.state_dtype") as e:
        load_config("tiny", ["optim.state_dtype=fp16"])
    assert "fp32" in str(e.value) and "bf16" in str(e.value)


# ----------------------------------------------------------------------------- runs


def _losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["event"] == "train"]


def test_bf16_run_resumes_exactly_and_a_changed_state_dtype_applies(tiny):
    """0 -> 12 straight against 0 -> 6, then 6 -> 12 from the step-6 checkpoint: the same losses, bit for bit (the
    rounding's random bits depend on the step, not on the process). The checkpoint holds bf16 moments. An fp32 run's
    checkpoint resumes with optim.state_dtype=bf16: the change is applied and named."""
    base = [*tiny, "monitor.enabled=false", "train.sample_tokens=0", "train.eval_every=0", "train.max_steps=12",
            "train.checkpoint_every=6", "optim.state_dtype=bf16"]
    straight = load_config(None, [*base, "run.name=straight"])
    train(straight)
    ckpt = straight.run_dir / "checkpoints" / "step_00000006"
    moments = torch.load(ckpt / "optimizer.pt", weights_only=True)[0]["state"]
    assert {s["exp_avg_sq"].dtype for s in moments.values()} == {torch.bfloat16}
    resumed = load_config(None, [*base, "run.name=resumed", f"run.resume={ckpt}"])
    Trainer(resumed).run()
    assert _losses(resumed.run_dir) == _losses(straight.run_dir)[6:]

    fp32 = load_config(None, [*base[:-1], "run.name=fp32", "optim.state_dtype=fp32"])
    train(fp32)
    saved = fp32.run_dir / "checkpoints" / "step_00000006"
    switched = load_config(None, [*base, "run.name=switched", f"run.resume={saved}"])
    Trainer(switched).run()
    start = [json.loads(x) for x in (switched.run_dir / "metrics.jsonl").read_text().splitlines()][0]
    assert "optim.state_dtype" in json.dumps(start)
    got, ref = _losses(switched.run_dir), _losses(fp32.run_dir)[6:]
    assert [s for s, _ in got] == [s for s, _ in ref] and got[0] == ref[0]   # step 7's loss precedes any bf16 step
    assert [x for _, x in got[1:]] == pytest.approx([x for _, x in ref[1:]], abs=1e-2)


DIST = ["train.max_steps=6", "train.checkpoint_every=3", "train.dtype=fp32", "monitor.enabled=false",
        "train.micro_batch_size=2", "train.eval_tokens=512", "train.sample_tokens=0", "optim.state_dtype=bf16",
        "train.pg_timeout_s=60"]
MOE = ["model.family=moe", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.capacity_factor=1.0"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["train.parallel=ddp"], ["train.parallel=fsdp"],
                                    [*MOE, "model.moe.expert_parallel=2"],
                                    [*MOE, "model.moe.expert_parallel=2", "optim.state_dtype=fp32"]],
                         ids=["ddp", "fsdp", "expert-parallel", "expert-parallel-fp32"])
def test_two_process_bf16_state_resumes_exactly(tmp_path, data_cache, layout):
    """2 processes under torchrun (gloo): 6 steps straight against steps 4-6 resumed from the straight run's step-3
    checkpoint: equal losses. DDP's replicas round alike (rank 0's single-file checkpoint); FSDP2's moments are
    DTensors and expert shards DTensors over the expert mesh in sharded checkpoints. The straight run trains on
    after a sharded save, which leaves the optimizer's own state as it was (fp32 too)."""
    base = ["tiny", *TINY, *DIST, *layout, f"run.dir={tmp_path}", f"data.cache_dir={data_cache}"]
    run_cli("train", "--nproc", "2", *base, "run.name=straight")
    ckpt = tmp_path / "straight" / "checkpoints" / "step_00000003"
    sharded = json.loads((ckpt / "COMPLETE").read_text())["layout"] == "sharded"
    assert sharded == ("train.parallel=ddp" not in layout)
    run_cli("train", "--nproc", "2", *base, "run.name=resumed", f"run.resume={ckpt}")
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")[3:]


def _mixed_group_run(rank: int, init_file: str, out_file: str) -> None:
    """One rank: a model whose first Linear is FSDP2-style DTensors (over a 1-rank mesh) and the rest plain
    tensors, as the dense part and the experts are under expert parallelism with fsdp; 3 steps of make_adamw's
    optimizer with torch's fused kernel (CPU has one too: the CUDA path's single-list op)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    torch.set_num_threads(1)
    model, ref = _model(), _model()
    mesh = init_device_mesh("cpu", (1,))
    for name, p in list(model[0].named_parameters()):
        setattr(model[0], name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    cfg = load_config("tiny", ["optim.name=adamw"]).optim
    groups = adamw.adamw_groups(list(model.named_parameters()), cfg.weight_decay, cfg.lr)
    plain = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    raised = None
    try:   # what torch's own optimizer does with such a group
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        plain.step()
    except RuntimeError as e:
        raised = str(e)
    for p in model.parameters():
        plain.state.pop(p, None)
        p.grad = None
    ours = adamw.make_adamw(groups, cfg, torch.device("cpu"))
    ours.defaults["fused"] = True
    for g in ours.param_groups:
        g["fused"] = True   # make_adamw fuses on CUDA only: take that path here
    theirs = torch.optim.AdamW(adamw.adamw_groups(list(ref.named_parameters()), cfg.weight_decay, cfg.lr),
                               lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for (_, p), q in zip(model.named_parameters(), ref.parameters()):
            q.grad = torch.randn(q.shape, generator=gen)
            p.grad = distribute_tensor(q.grad, mesh, [Shard(0)]) if hasattr(p, "to_local") else q.grad.clone()
        ours.step()
        theirs.step()
    got = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    torch.save((type(ours).__name__, [len(g["params"]) for g in ours.param_groups], raised,
                [t.detach() for t in got], [q.detach() for q in ref.parameters()]), out_file)
    dist.destroy_process_group()


def test_a_group_of_dtensors_and_plain_tensors_steps_as_torch_adamw(tmp_path):
    """Under expert parallelism with fsdp one AdamW group holds FSDP2's DTensors and the experts' plain tensors.
    torch's fused AdamW (the CUDA path) refuses such a list; make_adamw's optimizer steps it as torch's AdamW steps
    the same parameters all plain, and keeps the groups as built (checkpoints see the same groups)."""
    import torch.multiprocessing as mp
    mp.start_processes(_mixed_group_run, args=(str(tmp_path / "init"), str(tmp_path / "out.pt")), nprocs=1,
                       join=True, start_method="fork")
    kind, sizes, raised, got, want = torch.load(tmp_path / "out.pt")
    assert raised is not None and "DTensor" in raised    # the failure the split avoids
    assert kind == "SplitAdamW" and sizes == [2, 4]      # groups as built: 2 matrices; 2 biases + norm's 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
