"""Muon: orthogonalisation quality, the update against a slow reference, AdamW groups against
torch.optim.AdamW, one process == two (gloo), convergence, and an end-to-end speedrun + muon CLI run."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.multiprocessing as mp
from conftest import run_cli

from trainbox.config import ModelSection, OptimSection
from trainbox.errors import ConfigError
from trainbox.model.build import build_model
from trainbox.optim.build import build_optimizers
from trainbox.optim.muon import ZEROPOWER, Muon, momentum_at

# singular values of the orthogonalised update for well-conditioned inputs (rectangular Gaussians)
BANDS = {"newton_schulz5": (0.6, 1.25), "polar_express": (0.8, 1.2), "svd": (1 - 1e-4, 1 + 1e-4)}


@pytest.mark.parametrize("name", sorted(ZEROPOWER))
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (3, 48, 96)])
def test_singular_values_in_band(name, shape):
    torch.manual_seed(0)
    G = torch.randn(*shape) * 1e-3  # the scale of the input does not matter
    O = ZEROPOWER[name](G, 5).float()
    assert O.shape == G.shape
    s = torch.linalg.svdvals(O)
    lo, hi = BANDS[name]
    assert s.min() >= lo and s.max() <= hi, (s.min().item(), s.max().item())
    # same singular vectors as the exact polar factor: O is close in direction to U V^T
    exact = ZEROPOWER["svd"](G, 0)
    cos = (O * exact).sum() / (O.norm() * exact.norm())
    assert cos > 0.97


def test_unknown_zeropower_is_a_config_error():
    with pytest.raises(ConfigError, match="muon_zeropower"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], zeropower="nope")


def test_update_matches_slow_reference():
    """Two steps of Muon (svd zeropower, momentum warm-up, weight decay) against the formula by hand."""
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(24, 8))
    grads = [torch.randn(24, 8) for _ in range(2)]
    lr, wd, m_final, m0, warm = 0.05, 0.1, 0.95, 0.85, 4
    opt = Muon([W], lr=lr, momentum=m_final, momentum_start=m0, momentum_warmup_steps=warm, weight_decay=wd,
               zeropower="svd")
    ref, buf = W.detach().clone().double(), torch.zeros(24, 8, dtype=torch.double)
    for step, g in enumerate(grads):
        W.grad = g.clone()
        opt.step()
        m = (1 - step / warm) * m0 + step / warm * m_final
        buf = m * buf + (1 - m) * g.double()
        u = (1 - m) * g.double() + m * buf                    # Nesterov
        U, _, Vh = torch.linalg.svd(u, full_matrices=False)
        ref = ref * (1 - lr * wd) - lr * math.sqrt(24 / 8) * (U @ Vh)
    torch.testing.assert_close(W.detach().double(), ref, rtol=0, atol=1e-5)
    assert momentum_at(10, m0, m_final, warm) == m_final


def tiny_speedrun():
    torch.manual_seed(0)
    cfg = ModelSection(family="speedrun", n_layer=2, n_head=2, n_embd=32, head_dim=16, eot_id=0, window=16)
    return build_model(cfg, 64, 32)


def test_param_split_and_adamw_groups_equal_torch_adamw():
    model = tiny_speedrun()
    cfg = OptimSection(name="muon", lr=1e-3, embed_lr=0.3, head_lr=0.01, scalar_lr=0.05, weight_decay=0.1)
    muon, adamw = build_optimizers(model, cfg, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    assert muon_names == {f"blocks.{i}.{m}.weight" for i in range(2)
                          for m in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert len({tuple(p.shape) for g in muon.param_groups for p in g["params"]}) == len(muon.param_groups)
    got = {g["name"]: (sorted(names[id(p)] for p in g["params"]), g["lr"], g["weight_decay"])
           for g in adamw.param_groups}
    assert got["embed"] == (["embed.weight", "value_embeds.0.weight"], 0.3, 0.1)
    assert got["head"] == (["lm_head.weight"], 0.01, 0.1)
    assert got["scalar"][1:] == (0.05, 0.0)
    assert len(got["scalar"][0]) == 2 * 2 + 1  # per block: lambdas and attention lambdas; skip weights

    # the AdamW half steps exactly like torch.optim.AdamW built by hand with those groups
    ref_model = copy.deepcopy(model)
    ref_params = dict(ref_model.named_parameters())
    ref = torch.optim.AdamW([dict(params=[ref_params[n] for n in ns], lr=lr, weight_decay=wd)
                             for ns, lr, wd in got.values()], betas=cfg.betas, eps=cfg.eps)
    torch.manual_seed(1)
    for _ in range(3):
        for (n, p) in model.named_parameters():
            p.grad = torch.randn_like(p)
            ref_params[n].grad = p.grad.clone()
        adamw.step()
        ref.step()
    for n, p in model.named_parameters():
        if n not in muon_names:
            torch.testing.assert_close(p, ref_params[n], rtol=0, atol=0)


def _muon_run(rank: int, world: int, init_file: str, out_file: str) -> None:
    """Three Muon steps on 5 matrices of two shapes (5 is not a multiple of 2: padding is exercised)."""
    import torch.distributed as dist
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import trainbox.optim.muon as muon_module
    calls, ns5 = [], muon_module.ZEROPOWER["newton_schulz5"]

    def counting_ns5(G, steps):
        calls.append(G.size(0))  # one batched call per group: how many matrices it orthogonalises
        return ns5(G, steps)

    muon_module.ZEROPOWER["newton_schulz5"] = counting_ns5
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(16, 8)] * 3 + [(8, 24)] * 2]
    opt = Muon([dict(params=params[:3]), dict(params=params[3:])], lr=0.02, weight_decay=0.01,
               momentum_warmup_steps=2)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)  # the same (already averaged) grads on every rank
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    torch.save(([p.detach() for p in params], calls), f"{out_file}.rank{rank}")
    if world > 1:
        dist.destroy_process_group()


def test_one_process_equals_two(tmp_path):
    _muon_run(0, 1, "", str(tmp_path / "one.pt"))
    mp.start_processes(_muon_run, args=(2, str(tmp_path / "init"), str(tmp_path / "two.pt")), nprocs=2, join=True,
                       start_method="fork")  # fork: no re-import of torch in the children
    one, calls_one = torch.load(tmp_path / "one.pt.rank0")
    calls_two = []
    for rank in range(2):  # every rank applied the update one process computes, bit for bit
        two, calls = torch.load(tmp_path / f"two.pt.rank{rank}")
        calls_two.append(calls)
        for a, b in zip(one, two):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    # the work was divided: per step and shape, one batched call; one process orthogonalises all 3 + 2
    # matrices, each of two ranks a slice of ceil(3/2) = 2 (rank 1's second is zero padding) and of 1
    assert calls_one == [3, 2] * 3 and calls_two == [[2, 1] * 3] * 2


@pytest.mark.parametrize("zeropower", ["newton_schulz5", "polar_express"])
def test_toy_regression_converges(zeropower):
    torch.manual_seed(0)
    X = torch.randn(256, 32)
    A = torch.randn(16, 32) / 32 ** 0.5
    Y = X @ A.T
    W = torch.nn.Parameter(torch.zeros(16, 32))
    opt = Muon([W], lr=0.05, momentum_warmup_steps=0, zeropower=zeropower)
    losses = []
    for step in range(150):
        for g in opt.param_groups:
            g["lr"] = 0.05 * (1 - step / 150)  # Muon steps have a fixed size: converge by decaying lr
        loss = ((X @ W.T - Y) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 1e-3 * losses[0], (losses[0], losses[-1])


def test_cli_speedrun_with_muon_trains_and_generates(tiny, tmp_path):
    run_cli("train", "tiny", *tiny, "model.family=speedrun", "model.head_dim=16", "model.window=24",
            "model.window_warmup_steps=10", "optim.name=muon", "optim.muon_lr=0.02", "optim.lr=0.01",
            "optim.embed_lr=0.05", "optim.weight_decay=0", "train.max_steps=30", "train.eval_every=0",
            "run.name=sr", cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "runs" / "sr" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("kind", r.get("event")) == "train" and "loss" in r]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    out = run_cli("generate", str(tmp_path / "runs" / "sr"), "--prompt", "ROMEO:", "--max-tokens", "16",
                  "--temperature", "0", cwd=tmp_path)
    # the CLI's KV-cached greedy decode equals greedy decoding by full forward passes without a cache
    from trainbox.model.load import load_for_inference
    model, tok, _ = load_for_inference(tmp_path / "runs" / "sr")
    ids = tok.encode("ROMEO:")
    with torch.no_grad():
        for _ in range(16):
            logits = model.logits(model.hidden(torch.tensor([ids])))[0, -1, :tok.vocab_size]
            nxt = int(logits.argmax())
            if nxt == tok.eot_id:
                break
            ids.append(nxt)
    assert out.stdout == "ROMEO:" + tok.decode(ids[len(tok.encode("ROMEO:")):]) + "\n"


SOCKET_ERRORS = ("EADDRINUSE", "Address already in use", "DistNetworkError", "RendezvousConnectionError")


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(tiny, tmp_path):
    """The whole loop (DDP + distributed Muon) under `torchrun --nproc_per_node 2` gives one process's losses."""
    import os
    import shutil
    import subprocess
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    args = [*tiny, "model.family=speedrun", "model.head_dim=16", "optim.name=muon", "optim.muon_lr=0.05",
            "optim.lr=0.02", "optim.warmup_steps=0", "train.micro_batch_size=2", "train.max_steps=4",
            "train.eval_every=0", "train.sample_tokens=0", "monitor.enabled=false", "train.threads=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(2):
        # --standalone rendezvous picks free ports; another process may take one in between. Only that
        # (a socket error before training) earns one more try: any other failure fails the test.
        proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "trainbox", "train", "tiny",
                               *args, f"run.name=two{attempt}"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 or not any(e in out for e in SOCKET_ERRORS):
            break
    assert proc.returncode == 0, out[-6000:]
    from trainbox.config import load_config
    from trainbox.train.loop import train
    train(load_config("tiny", [*args, "run.name=one"]))

    def losses(name):
        rows = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r.get("kind", r.get("event")) == "train" and "loss" in r]
    one, two = losses("one"), losses(f"two{attempt}")
    assert len(one) == 4 and one[-1] < one[0] - 0.01
    # DDP sums gradients in another order than accumulation does; Muon's iteration passes those
    # last-bit differences on, so the runs agree to ~1e-5 rather than bit for bit
    assert two == pytest.approx(one, rel=1e-4, abs=0)


@pytest.mark.parametrize("shape", [(16, 8), (4, 16, 8)])  # matrices, and MoE-style stacks of expert matrices
def test_batched_group_equals_one_optimizer_per_matrix(shape):
    """A group is orthogonalised as one batch; each matrix must get exactly the update it gets alone."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(shape)) for _ in range(3)]
    qs = [copy.deepcopy(p) for p in ps]
    batched = Muon([dict(params=ps)], lr=0.02, weight_decay=0.01, momentum_warmup_steps=2)
    alone = [Muon([q], lr=0.02, weight_decay=0.01, momentum_warmup_steps=2) for q in qs]
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        batched.step()
        for opt in alone:
            opt.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert not torch.equal(ps[0], ps[1])


def test_state_dict_round_trip_resumes_exactly():
    """Momentum buffers and the warm-up step counter survive state_dict -> load_state_dict (checkpoints)."""
    def run(split: bool) -> torch.Tensor:
        torch.manual_seed(0)
        W = torch.nn.Parameter(torch.randn(12, 20))
        opt = Muon([W], lr=0.03, momentum_warmup_steps=3, weight_decay=0.1)
        gen = torch.Generator().manual_seed(7)
        for step in range(5):
            if split and step == 2:  # "restart": a fresh optimizer loaded from the saved state
                saved = copy.deepcopy(opt.state_dict())
                opt = Muon([W], lr=0.03, momentum_warmup_steps=3, weight_decay=0.1)
                opt.load_state_dict(saved)
            W.grad = torch.randn(12, 20, generator=gen)
            opt.step()
        return W.detach()
    torch.testing.assert_close(run(split=True), run(split=False), rtol=0, atol=0)
