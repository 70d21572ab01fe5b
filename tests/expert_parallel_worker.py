"""One rank of tests/test_expert_parallel.py's torchrun job (gloo, CPU, fp32). Not collected by pytest.

For each of CASES whose expert_parallel N in {1, 2, 4} divides the world size (dropless and dropping routing under
the uneven exchange; dropping and capacity-without-drops routing under the padded exchange; selective, full and
experts activation checkpointing; the dense part under ddp or fsdp), every rank builds the model as the trainer does
(train/build.py: shard_experts, then DDP or FSDP) and
the single-process model (no checkpointing) from the same seed, then checks against the single process: an MoE
layer's output (and against test_moe's slow per-token reference), the hidden states, the token and auxiliary losses
of this rank's micro-batch, every gradient after the loop's loss scaling, expert sync and clipping, the clipped
norm, the parameters after an AdamW step, and the checkpoint state (dcp.state_dict: expert shards as DTensors whose
whole is the unsharded weights and optimizer state); on an even world, bf16 expert copies made once a step (bit for
bit a cast in every micro-batch) and the preference objective's frozen reference copy, under ddp (and under fsdp
on 2 ranks). Then, given run overrides after `--train`, it trains that run on the same process group (one torchrun
launch for both); `--no-checks` goes straight to the run.
Prints "ok" on rank 0.
"""
from __future__ import annotations

import logging
import os
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from kept_bytes import Kept  # noqa: E402 - bytes autograd keeps, measured
from test_moe import reference_moe  # noqa: E402 - the slow per-token MoE

from trainbox.config import load_config  # noqa: E402
from trainbox.config.layout import decide_layout  # noqa: E402
from trainbox.model.gpt.memory import gpt_block  # noqa: E402
from trainbox.model.memory import Kernels, Widths  # noqa: E402
from trainbox.model.moe.memory import moe_ffn, padded_rows  # noqa: E402
from trainbox.parallel import expert_state  # noqa: E402
from trainbox.parallel.distributed import Dist  # noqa: E402
from trainbox.parallel.fsdp import gathered  # noqa: E402
from trainbox.plan import local_cpu, make_plan  # noqa: E402
from trainbox.train import recompute  # noqa: E402
from trainbox.train.build import build_model_side  # noqa: E402
from trainbox.train.loop import train  # noqa: E402

VOCAB, B, T, TOL, LR = 128, 2, 16, dict(atol=1e-5, rtol=1e-5), 0.01
# the weights after an AdamW step: gradients equal to ~1e-7 (summed in another order) move a coordinate whose
# gradient is near AdamW's eps by up to ~lr/1000 (3.4e-6 measured here; lr/400 in tests/test_fsdp.py's
# record), where a step from another gradient moves it by ~lr
WEIGHT_TOL = dict(atol=LR / 50, rtol=0)


# (expert_parallel, capacity_factor, exchange, activation checkpointing, the dense part's strategy): capacity 0.5
# drops a share of the assignments, 4.0 none (an expert takes at most one row per token: C = N); the padded exchange
# needs a capacity; under fsdp on 4 processes with expert_parallel 2 each expert shard has 2 replicas
CASES = [*((n, cf, "uneven", "none", "ddp") for n in (1, 2, 4) for cf in (0.0, 0.5)),
         *((n, cf, "padded", "none", "ddp") for n in (2, 4) for cf in (0.5, 4.0)),
         (2, 0.5, "padded", "selective", "ddp"), (2, 0.5, "padded", "full", "ddp"),
         (2, 0.5, "uneven", "full", "ddp"), (2, 0.5, "uneven", "none", "fsdp"), (4, 0.5, "padded", "selective", "fsdp"),
         (2, 0.5, "uneven", "experts", "fsdp"), (2, 0.5, "padded", "experts", "ddp")]


def config(n: int, cf: float, exchange: str = "uneven", checkpointing: str = "none", parallel: str = "ddp",
           *extra: str):
    return load_config("tiny", [
        "model.family=moe", "model.n_layer=3", "model.n_head=2", "model.n_embd=32", "model.moe.num_experts=4",
        "model.moe.every=2", "model.moe.top_k=2", f"model.moe.capacity_factor={cf}", "model.moe.lb_loss_weight=0.5",
        "model.moe.z_loss_weight=0.1", f"model.moe.expert_parallel={n}", f"model.moe.exchange={exchange}",
        f"train.activation_checkpointing={checkpointing}", f"train.parallel={parallel}", "train.device=cpu",
        f"optim.lr={LR}", "optim.grad_clip=0.05", "optim.warmup_steps=0", "optim.name=adamw", *extra])


def loss_of(out, scale: float, accum: int) -> torch.Tensor:
    """The loop's per-micro-batch loss (train/loop.py: train_step)."""
    return out.loss * scale + out.aux_loss / accum


def check_case(d: Dist, n: int, cf: float, exchange: str, checkpointing: str, parallel: str,
               batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    cpu = torch.device("cpu")
    cfg, W, r = config(n, cf, exchange, checkpointing, parallel), d.world, d.rank
    layout = decide_layout(cfg, W, "cpu", adapt_micro_batch=True)
    assert layout.expert_exchange == (exchange if n > 1 else "none") and layout.strategy == parallel
    ep = build_model_side(cfg, layout, VOCAB, cpu, d, init_weights=True)
    one = config(1, cf)   # the single process: no checkpointing
    ref = build_model_side(one, decide_layout(one, 1, "cpu", adapt_micro_batch=True), VOCAB, cpu, Dist(),
                           init_weights=True)
    model, opt, ref_model, ref_opt = ep.model, ep.optimizers[0], ref.model, ref.optimizers[0]
    shard = getattr(model, "expert_shard", None)
    assert (shard is not None) == (n > 1) and (n == 1 or shard.params)
    own = {k: v for k, v in ref_model.named_parameters()}
    for name, p in model.named_parameters():   # the same initial weights; experts cut to this rank's shard
        want = shard.cut(own[name]) if shard and name in shard.params else own[name]
        assert torch.equal(whole(p), want), name
    if parallel == "fsdp":   # FSDP shards the dense parameters only: the experts stay this rank's plain tensors
        assert all(isinstance(p, DTensor) != (name in shard.params) for name, p in model.named_parameters())
        register_fsdp_forward_method(model, "hidden")   # a forward of the root, as FSDP sees it
    from trainbox.parallel import dcp, staging
    # what a sharded save reserves host buffers for before the first step (AsyncSaver.reserve): the bytes the
    # state is laid out in after it (checked below)
    foreseen = staging.expected_bytes(dcp.state_dict(model, None)["model"], ep.optimizers)
    model.train(), ref_model.train()
    if shard is not None and exchange == "padded":   # training under the padded exchange never takes the uneven one
        shard._uneven = _refuse
    tokens = W * B * T
    x, y = batches[r]

    # one MoE layer against the vectorised single process and the slow per-token reference (under fsdp with the
    # dense weights gathered, as the block's forward gathers them)
    layer, ref_layer = model.transformer.h[0].mlp, ref_model.transformer.h[0].mlp
    h = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(r))
    with torch.no_grad(), gathered(model), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
            as prof:
        got = layer(h)
    # expert parallelism reads one thing on the host per layer, the split sizes: the kept rows are picked by that
    # read, not by a nonzero whose size the GPU would have to report first
    assert shard is None or not any(e.name == "aten::nonzero" for e in prof.events()), (exchange, cf)
    with torch.no_grad():
        want = ref_layer(h)
        slow, balance, z, counts, dropped = reference_moe(ref_layer, h)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got, slow, **TOL)
    torch.testing.assert_close(layer.aux["balance"], balance, **TOL)
    assert layer.aux["tokens_per_expert"].tolist() == counts.tolist()
    assert abs(float(layer.aux["dropped"]) - dropped) < 1e-6
    if cf == 0.5:
        assert dropped > 0.05, "the capacity case must drop assignments"
    elif cf:
        assert dropped == 0, "capacity N drops nothing"
    with torch.no_grad(), gathered(model):
        torch.testing.assert_close(model.hidden(x), ref_model.hidden(x), **TOL)
    if shard is not None and exchange == "padded" and checkpointing != "full" and parallel == "ddp":
        # the plan's formula (model/moe/memory.py) for what an MoE block keeps, pad rows included, to the byte
        m, kern = cfg.model, Kernels("sdpa", "off", "unfused", "off")
        w = Widths(a=4, r=4, cuda=False, expert_parallel=n)
        block = gpt_block(32, m.n_head, w, kern, m.bias, ffn=partial(moe_ffn, d=32, moe=m.moe, w=w, kern=kern,
                                                                     bias=m.bias, padded=padded_rows(m.moe, B * T)))
        saved = saved_bytes(model.transformer.h[0], h, list(model.parameters()))
        assert saved == pytest.approx(block.bytes(checkpointing) * B * T, rel=1e-3), (checkpointing, saved)
    if shard is not None and exchange == "padded" and checkpointing == "none" and cf == 0.5 and parallel == "ddp":
        # nothing read on the host: torch.compile captures the whole layer, exchanges included, as one graph
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer)(h)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        torch._dynamo.reset()

    # a training step as the loop takes it: W ranks of one micro-batch each, against one process over all W
    out = ep.parallel.forward(x, y, reduction="sum")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_of(out, W / tokens, 1).backward()
    if shard is not None:   # the backward's exchanges: one per row exchange; selective recomputes none of the forward's
        exchanged = sum(e.name == "gloo:all_to_all" for e in prof.events())
        per_layer = 2 if exchange == "padded" else 3
        assert exchanged == len(model.moe_layers) * (2 + (per_layer if checkpointing == "full" else 0)), exchanged
    norm = ep.parallel.clip(cfg.optim.grad_clip, ep.optimizers)   # the loop's call: expert shards reduced, then clipped
    for i, (xi, yi) in enumerate(batches):
        ref_out = ref_model(xi, yi, reduction="sum")
        loss_of(ref_out, 1 / tokens, W).backward()
        if i == r:
            torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
            torch.testing.assert_close(out.aux_loss, ref_out.aux_loss, **TOL)
    ref_norm = torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), cfg.optim.grad_clip)
    torch.testing.assert_close(norm, ref_norm, **TOL)
    assert float(norm) > cfg.optim.grad_clip, "the case must clip"
    ref_grads = {k: v.grad for k, v in ref_model.named_parameters()}
    for name, p in model.named_parameters():
        want = shard.cut(ref_grads[name]) if shard and name in shard.params else ref_grads[name]
        torch.testing.assert_close(whole(p.grad), want, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    opt.step(), ref_opt.step()
    for name, p in model.named_parameters():
        want = shard.cut(own[name]) if shard and name in shard.params else own[name]
        torch.testing.assert_close(whole(p), want, **WEIGHT_TOL, msg=lambda m, name=name: f"{name}: {m}")

    # the checkpoint's view (parallel/dcp.py): every expert tensor a DTensor whose whole is the unsharded model's
    # the host memory a save stages on this rank (logged with the pinned buffers): its own expert shards, not
    # their global size, and the dense tensors whole (counted before state_dict(), which makes them DTensors)
    own_bytes = sum(local(t).nbytes for t in model.state_dict().values()) + sum(
        local(v).nbytes for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    state = dcp.state_dict(model, ep.optimizers)
    assert staging.host_bytes(state) == own_bytes, (n, staging.host_bytes(state), own_bytes)
    assert sum(staging.laid_out(state).values()) == foreseen, (n, sum(staging.laid_out(state).values()), foreseen)
    ref_state = ref_opt.state_dict()["state"]
    index = {name: expert_state._indices(ref_opt)[id(p)] for name, p in ref_model.named_parameters()}
    for name, t in ref_model.state_dict().items():
        got = state["model"][name]
        if shard is not None and name in shard.params:
            assert got.placements and tuple(got.shape) == tuple(t.shape), name
        got = whole(got)
        torch.testing.assert_close(got, t, **TOL)
    for name, st in state["optim"]["state"].items():
        for key, v in ref_state[index[name]].items():
            got = st[key].full_tensor() if hasattr(st[key], "full_tensor") else st[key]
            torch.testing.assert_close(got, v, **TOL, msg=lambda m, name=name, key=key: f"{name} {key}: {m}")
    expert_state.as_local(model, state)   # and back: this rank's shards, the optimizer's own tensors
    if shard is not None:
        for name, p in shard.params.items():
            assert state["optim"]["state"][name]["exp_avg"].shape == p.shape


def check_casts(d: Dist, batches: list[tuple[torch.Tensor, torch.Tensor]], parallel: str) -> None:
    """bf16 autocast: the experts' bf16 copies made once per step (expert.keep_casts) give bit for bit the gradients
    and weights of a cast in every micro-batch, over 2 steps of 2 micro-batches (the second step reads copies the
    first step's after_step refreshed), with the dense part under `parallel` (ddp or fsdp)."""
    cpu, W, r = torch.device("cpu"), d.world, d.rank
    cfg = config(2, 0.5, parallel=parallel)
    layout = decide_layout(cfg, W, "cpu", adapt_micro_batch=True)
    arms = []
    for keep in (True, False):
        built = build_model_side(cfg, layout, VOCAB, cpu, d, init_weights=True, dtype=torch.bfloat16)
        if not keep:
            built.model.expert_shard.cast_dtype = None
        built.model.train()
        arms.append(built)
    x, y = batches[r]
    for step in range(2):
        grads = []
        for built in arms:
            for k in range(2):
                with built.parallel.micro_batch(k, 2), torch.autocast("cpu", dtype=torch.bfloat16):
                    out = built.parallel.forward(x[k:k + 1], y[k:k + 1], reduction="sum")
                    loss_of(out, 1 / (W * B * T), 2).backward()
            built.parallel.clip(cfg.optim.grad_clip, built.optimizers)
            grads.append({n: whole(p.grad).clone() for n, p in built.model.named_parameters()})
            built.optimizers[0].step()
            built.parallel.after_step()
            built.optimizers[0].zero_grad(set_to_none=True)
        assert grads[0].keys() == grads[1].keys()
        for name, g in grads[0].items():
            assert torch.equal(g, grads[1][name]), (step, name)
        for (name, p), q in zip(arms[0].model.named_parameters(), arms[1].model.parameters()):
            assert torch.equal(whole(p), whole(q)), (step, name)
    lins = arms[0].model.expert_shard.linears
    assert lins and all(lin.cast is not None and lin.cast.dtype == torch.bfloat16 and lin.cast.grad is None
                        and torch.equal(lin.cast, lin.weight.to(torch.bfloat16)) for lin in lins)
    assert all(lin.cast is None for lin in arms[1].model.expert_shard.linears)


def check_reference(d: Dist, batches: list[tuple[torch.Tensor, torch.Tensor]], parallel: str) -> None:
    """The preference objective's frozen copy of the model (build_model_side(reference=True)) under expert parallelism:
    its own expert shard over the same process groups, spread like the model; at the start its loss equals the
    model's, and a step of the model leaves it as it was."""
    cpu, r = torch.device("cpu"), d.rank
    cfg = config(2, 0.5, parallel=parallel)
    built = build_model_side(cfg, decide_layout(cfg, d.world, "cpu", adapt_micro_batch=True), VOCAB, cpu, d,
                             init_weights=True, reference=True)
    model, ref = built.model, built.reference
    assert ref.expert_shard is not model.expert_shard and ref.expert_shard.group is model.expert_shard.group
    assert {id(p) for p in ref.expert_shard.params.values()} == {id(p) for n, p in ref.named_parameters()
                                                                  if n in ref.expert_shard.params}
    # what it holds on this rank is what the memory plan counts for a preference run's frozen copy (plan/memory.py)
    dpo = config(2, 0.5, "uneven", "none", parallel, "train.objective=dpo", "dpo.reference=model")
    dpo = decide_layout(dpo, d.world, "cpu", adapt_micro_batch=True).applied(dpo)   # as `trainbox plan --nproc N`
    held = sum(local(p).numel() * p.element_size() for p in ref.parameters())
    assert held == make_plan(dpo, VOCAB, local_cpu(), nproc=d.world).memory.reference, held
    x, y = batches[r]
    model.eval()
    with torch.no_grad():
        before = ref(x, y).loss
        torch.testing.assert_close(before, built.parallel.forward(x, y).loss, **TOL)
    model.train()
    loss_of(built.parallel.forward(x, y, reduction="sum"), 1 / (d.world * B * T), 1).backward()
    built.parallel.clip(cfg.optim.grad_clip, built.optimizers)
    built.optimizers[0].step()
    built.parallel.after_step()
    with torch.no_grad():
        assert torch.equal(ref(x, y).loss, before)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP's shard of a dense parameter or gradient) as the whole tensor; a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's own shard."""
    return t.to_local() if isinstance(t, DTensor) else t


def saved_bytes(block: torch.nn.Module, h: torch.Tensor, params: list[torch.Tensor]) -> int:
    """Bytes kept for the backward of one training forward of `block`: what the saved-tensor hooks see and what the
    selective-checkpointing policy caches, `params` left out."""
    kept = Kept(params)
    CACHES.clear()
    with kept.hooks():
        block(h.detach().requires_grad_())
    kept.add_caches(CACHES)
    return kept.total


CACHES: list = []   # the selective policy's caches, observed (the real contexts are returned)
_contexts = recompute.create_selective_checkpoint_contexts


def _recording(policy, *args, **kwargs):
    forward, recomputing = _contexts(policy, *args, **kwargs)
    CACHES.append(forward.storage)
    return forward, recomputing


recompute.create_selective_checkpoint_contexts = _recording   # before any model is wrapped


def _refuse(*args):
    raise AssertionError("the uneven exchange ran under model.moe.exchange=padded")


def main() -> None:
    torch.set_num_threads(1)
    d = Dist(rank=int(os.environ["RANK"]), world=int(os.environ["WORLD_SIZE"]))
    d.init(torch.device("cpu"), 120)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g))
               for _ in range(d.world)]
    checks = "--no-checks" not in sys.argv
    for n, cf, exchange, checkpointing, parallel in CASES if checks else ():
        if d.world % n == 0 and (parallel == "ddp" or d.world > 1):
            check_case(d, n, cf, exchange, checkpointing, parallel, batches)
    if d.world % 2 == 0 and checks:
        for parallel in ("ddp", "fsdp") if d.world == 2 else ("ddp",):
            check_casts(d, batches, parallel)
            check_reference(d, batches, parallel)
    if "--train" in sys.argv:
        logging.basicConfig(level=logging.INFO, format="%(message)s")   # the library's log on stderr
        train(load_config(None, sys.argv[sys.argv.index("--train") + 1:]), d)   # shuts the process group down
    else:
        d.shutdown()
    if d.rank == 0:
        print("ok")


if __name__ == "__main__":
    main()
