"""The experts' grouped matmuls at one MoE layer's shapes, by kernel: ATen's `_grouped_mm` (what the experts run),
Inductor's Triton grouped-matmul template (autotuned, as `max_autotune_gemm` would pick it), a loop of cuBLAS
matmuls over the experts, and one dense matmul of the same FLOPs as the reference rate.

    python benchmarks/grouped_mm_rates.py --experts 8 --rows 98304 --record       # moe-gpt2-125m, micro-batch 48
    python benchmarks/grouped_mm_rates.py --experts 64 --rows 61440 --record      # 128 experts over 2 GPUs, mb 30

For each linear of the expert MLP (hidden -> ffn, ffn -> hidden): the forward y = x @ w[e], the input gradient
dx = g @ w[e]^T and the weight gradient dw[e] = x_e^T @ g_e, over `--rows` rows split unevenly (0.8-1.2x the mean)
over `--experts` experts. Each kernel's output is checked against ATen's first. One GPU (the Triton template needs
a Hopper or newer). `per_layer_ms` sums the six matmuls of one layer and one micro-batch: ATen's, and the fastest
kernel's for each. Each time is the median of --iters calls, each timed alone (common.median_ms). On an H200
Inductor benchmarks 40 Triton configurations for each matmul, up to 26 s each: allow the tool about 3 minutes.
`--device cpu` (small shapes, no Triton template) checks the tool on a CPU.
"""
from __future__ import annotations

import argparse
import json

import common
import torch
import torch.nn.functional as F

GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def uneven_sizes(rows: int, experts: int) -> list[int]:
    """Rows per expert, 0.8-1.2x the mean (seeded), summing to `rows`."""
    share = torch.rand(experts, generator=torch.Generator().manual_seed(1)) * 0.4 + 0.8
    sizes = (share / share.sum() * rows).long()
    sizes[-1] += rows - sizes.sum()
    return sizes.tolist()


def linear_rates(sizes: list[int], k: int, n: int, iters: int, device: str) -> dict:
    """The three matmuls of one expert linear (k -> n) by kernel: ms, TFLOP/s, the Triton one's error."""
    import torch._inductor.config as inductor

    rows, experts = sum(sizes), len(sizes)
    ends = torch.tensor(sizes).cumsum(0)
    offs, bounds = ends.to(torch.int32).to(device), [0, *ends.tolist()]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(experts, k, n, device=device, dtype=torch.bfloat16) * 0.02
    g = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    ops = {"fwd": (lambda x, w, g, o: GMM(x, w, offs=o)),
           "dx": (lambda x, w, g, o: GMM(g, w.transpose(1, 2), offs=o)),
           "dw": (lambda x, w, g, o: GMM(x.t(), g, offs=o))}

    def timed(fn) -> float:
        return common.median_ms(fn, reps=iters, warmup=5, device=device)

    r: dict = {}
    for name, op in ops.items():
        r[f"aten_{name}_ms"] = timed(lambda op=op: op(x, w, g, offs))
    loops = {"fwd": lambda: torch.cat([x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(experts)]),
             "dw": lambda: torch.stack([x[bounds[e]:bounds[e + 1]].t() @ g[bounds[e]:bounds[e + 1]]
                                        for e in range(experts)])}
    for name, loop in loops.items():
        r[f"loop_{name}_maxdiff"] = (loop().float() - ops[name](x, w, g, offs).float()).abs().max().item()
        r[f"loop_{name}_ms"] = timed(loop)
    r["dense_mm_ms"] = timed(lambda: x @ w[0])
    triton = ops if device == "cuda" else {}   # Inductor's template: a Hopper GPU's
    with inductor.patch(max_autotune_gemm=True, max_autotune_gemm_backends="ATEN,TRITON"):
        for name, op in triton.items():
            torch._dynamo.reset()
            compiled = torch.compile(op, dynamic=False)
            try:
                out = compiled(x, w, g, offs)
            except Exception as e:   # a template that does not build here: say so, keep the other figures
                r[f"triton_{name}_error"] = str(e).splitlines()[0][:300]
                continue
            r[f"triton_{name}_maxdiff"] = (out.float() - op(x, w, g, offs).float()).abs().max().item()
            r[f"triton_{name}_ms"] = timed(lambda c=compiled: c(x, w, g, offs))
    flops = 2 * rows * k * n
    for key in [key for key in r if key.endswith("_ms")]:   # each time rounded, its TFLOP/s beside it
        r[key.replace("_ms", "_tflops")] = round(flops / (r[key] * 1e-3) / 1e12, 3)
        r[key] = round(r[key], 4)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8, help="experts on this GPU")
    ap.add_argument("--rows", type=int, default=98304, help="rows the experts take (tokens x top-k)")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    args = ap.parse_args()
    if GMM is None or (args.device == "cuda" and not torch.cuda.is_available()):
        raise SystemExit("grouped_mm_rates.py needs a torch with grouped_mm, and a CUDA GPU (or --device cpu)")
    sizes = uneven_sizes(args.rows, args.experts)
    metrics: dict = {"experts": args.experts, "rows": args.rows, "sizes": sizes}
    aten = best = 0.0
    for k, n in ((args.hidden, args.ffn), (args.ffn, args.hidden)):
        r = linear_rates(sizes, k, n, args.iters, args.device)
        metrics[f"{k}x{n}"] = r
        for op in ("fwd", "dx", "dw"):
            aten += r[f"aten_{op}_ms"]
            best += min(v for key, v in r.items() if key.endswith(f"_{op}_ms"))
    metrics["per_layer_ms"] = {"aten": round(aten, 3), "fastest_each": round(best, 3)}
    print(json.dumps(metrics, indent=1))
    common.emit(common.Result(tool="grouped_mm_rates", what=f"grouped-mm-rates-{args.experts}x-{args.rows}-rows",
                              gpu=common.gpu_info(), metrics=metrics), args.record)


if __name__ == "__main__":
    main()
