"""One MoE layer, forward and backward, against MegaBlocks' dropless MoE (`dMoE`) in the same shape, one GPU.

    python benchmarks/megablocks_speed.py --experts 8 --tokens 49152              # the 8-expert recipe's layer
    python benchmarks/megablocks_speed.py --experts 128 --tokens 30720 --record   # the 128-expert model's

MegaBlocks is the peer's installed package, the only input taken from it (`pip install megablocks[gg]` builds its
CUDA ops and grouped_gemm's with nvcc against the torch at hand; MegaBlocks 0.10.0 pins torch 2.7.0, so on another
torch install it with --no-deps --no-build-isolation, and under CUDA 13 its csrc/cumsum.h must drop the
`debug_synchronous` argument that CUB no longer takes). Both layers are dropless top-k routers over GPT-2-sized
experts without biases (d -> 4d, GELU(tanh), 4d -> d), bf16, with the same weights: MegaBlocks' router and its two
grouped weight matrices are copied from ours, and its top-k weights renormalised to sum to 1 as ours are
(moe_normalize_expert_weights=1), so both compute the same function. The outputs must agree within 2% (relative)
over the tokens both route to the same experts, or nothing is timed: the routers differ in precision (ours runs in
fp32, MegaBlocks' in bf16), so a token near a tie may pick another expert. MegaBlocks runs its grouped MLP
(`mlp_impl=grouped`: grouped_gemm's kernels, the split sizes read on the host) eagerly, as Megatron-LM and Composer
run it; ours runs compiled, as trainbox trains it (torch's grouped_mm), and eagerly. The time is forward plus
backward of the layer over --tokens tokens, the mean of --steps after --warmup, by CUDA events. The result record
(common.Result, MegaBlocks its baseline) follows the JSON.
"""
from __future__ import annotations

import argparse
import json

import common
import torch

from trainbox.model.moe.config import MoESection
from trainbox.model.moe.model import MoEFFN


def _megablocks():
    try:
        from megablocks.layers import arguments, dmoe, moe  # optional: the peer under test
    except ImportError as e:
        raise SystemExit(f"MegaBlocks does not import here ({e}): pip install 'megablocks[gg]' (it builds CUDA "
                         "extensions, so it needs nvcc and the torch it runs with)") from None
    return arguments, dmoe, moe


def ours(d: int, experts: int, top_k: int, device: torch.device) -> MoEFFN:
    """Our MoE FFN, initialised as GPT-2 initialises its linears (normal, std 0.02)."""
    moe = MoESection(num_experts=experts, top_k=top_k, capacity_factor=0.0)
    layer = MoEFFN(d, moe, bias=False, dropout=0.0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer.to(device).train()


def theirs(layer: MoEFFN, d: int, device: torch.device):
    """MegaBlocks' dMoE with `layer`'s weights, in bf16."""
    arguments, dmoe, _ = _megablocks()
    E, k = layer.moe.num_experts, layer.moe.top_k
    args = arguments.Arguments(hidden_size=d, ffn_hidden_size=4 * d, moe_num_experts=E, moe_top_k=k, bias=False,
                               return_bias=False, mlp_impl="grouped", fp16=False, bf16=True, device=device,
                               moe_normalize_expert_weights=1, moe_loss_weight=0.01)
    m = dmoe.dMoE(args).to(device)
    router, w1, w2 = megablocks_weights(layer)
    with torch.no_grad():
        m.router.layer.weight.copy_(router)
        m.experts.mlp.w1.copy_(w1)
        m.experts.mlp.w2.copy_(w2)
    return m.train()


def megablocks_weights(layer: MoEFFN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layer`'s weights in MegaBlocks' layout: the router's (E, d); w1 and w2, each (E * 4d, d), which MegaBlocks
    views as (E, 4d, d) and uses as GELU(x @ w1[e].T) @ w2[e]. Ours are stored (E, in, out) and used as x @ w[e]."""
    E, d = layer.moe.num_experts, layer.c_fc.weight.size(1)
    return (layer.router.weight.detach(), layer.c_fc.weight.detach().transpose(1, 2).reshape(E * 4 * d, d),
            layer.c_proj.weight.detach().reshape(E * 4 * d, d))


def timed(fn, steps: int, warmup: int) -> float:
    """Mean milliseconds of fn() over `steps` calls after `warmup`, back to back: the layer as a training step runs it,
    its host work overlapping the GPU's (common.median_ms synchronises after every call, which would charge each
    call its launch time)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d", type=int, default=768, help="model width (the experts are 4x wider inside)")
    ap.add_argument("--tokens", type=int, default=49152, help="tokens per call (a micro-batch: 48 x 1,024)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--what", default=None)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("megablocks_speed needs a CUDA GPU (MegaBlocks' kernels are CUDA only)")
    _, _, mb_moe = _megablocks()
    device = torch.device("cuda")
    torch.manual_seed(0)
    layer = ours(args.d, args.experts, args.top_k, device)
    peer = theirs(layer, args.d, device)
    x = torch.randn(args.tokens, args.d, device=device, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    compiled = torch.compile(layer)

    def step_ours(module) -> torch.Tensor:
        xi = x.view(1, -1, args.d).detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(xi)
        y.backward(g.view_as(y))
        layer.zero_grad(set_to_none=True)
        return y

    def step_theirs() -> torch.Tensor:
        xi = x.view(-1, 1, args.d).detach().requires_grad_()   # MegaBlocks takes (sequence, batch, width)
        y = peer(xi)
        y.backward(g.view_as(y))
        peer.zero_grad(set_to_none=True)
        mb_moe.clear_load_balancing_loss()
        return y

    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y_ours = layer(x.view(1, -1, args.d)).float().view(-1, args.d)
        y_theirs = peer(x.view(-1, 1, args.d)).float().view(-1, args.d)
        mb_moe.clear_load_balancing_loss()
        # the tokens both routers send to the same experts (a bf16 router breaks near-ties otherwise)
        _, ids_ours, _ = layer.route(x.float())
        _, _, ids_theirs = peer.router(x.view(-1, 1, args.d))
        same = (ids_ours.sort(-1).values == ids_theirs.view_as(ids_ours).sort(-1).values).all(-1)
    agree = same.float().mean().item()
    rel = ((y_theirs - y_ours)[same].norm() / y_ours[same].norm()).item()
    if not (rel < 0.02 and agree > 0.5):   # not the same function: the times would compare different work
        raise SystemExit(f"MegaBlocks' output differs from ours by {rel:.3g} (relative) on the {agree:.1%} of tokens "
                         "both route alike: the layers do not match")
    torch.cuda.reset_peak_memory_stats()
    ms_compiled = timed(lambda: step_ours(compiled), args.steps, args.warmup)
    peak_ours = torch.cuda.max_memory_allocated() / 2**30
    ms_eager = timed(lambda: step_ours(layer), args.steps, args.warmup)
    torch.cuda.reset_peak_memory_stats()
    ms_theirs = timed(step_theirs, args.steps, args.warmup)
    peak_theirs = torch.cuda.max_memory_allocated() / 2**30
    flops = 12 * args.top_k * args.d * 4 * args.d * args.tokens   # forward + backward of the two expert matmuls
    software = common.software("megablocks", "grouped_gemm", "stanford-stk")
    version = software["megablocks"]
    result = {
        "experts": args.experts, "top_k": args.top_k, "d": args.d, "tokens": args.tokens, "steps": args.steps,
        "ms_compiled": round(ms_compiled, 3), "ms_eager": round(ms_eager, 3), "ms_megablocks": round(ms_theirs, 3),
        "speedup_compiled_vs_megablocks": round(ms_theirs / ms_compiled, 3),
        "speedup_eager_vs_megablocks": round(ms_theirs / ms_eager, 3),
        "expert_tflops_compiled": round(flops / ms_compiled / 1e9, 1),
        "expert_tflops_megablocks": round(flops / ms_theirs / 1e9, 1),
        "peak_gib_compiled": round(peak_ours, 2), "peak_gib_megablocks": round(peak_theirs, 2),
        "output_relative_difference": round(rel, 5), "tokens_routed_alike": round(agree, 4), "megablocks": version,
    }
    print(json.dumps(result, indent=1))
    what = args.what or f"moe-layer-{args.experts}x-vs-megablocks"
    common.emit(common.Result(
        tool="megablocks_speed", what=what, gpu=common.gpu_info(), software=software,
        metrics={"ms": result["ms_compiled"], **result},
        baseline={"name": f"MegaBlocks {version} dMoE (grouped)", "command": None,
                  "metrics": {"ms": result["ms_megablocks"], "peak_gib": result["peak_gib_megablocks"]}}),
        args.record)


if __name__ == "__main__":
    main()
