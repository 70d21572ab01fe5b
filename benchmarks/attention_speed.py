"""Speedrun attention alone: FlashAttention-4 (model.attention=flash) against FlexAttention, on corpus rows.

    PYTHONPATH=src python benchmarks/attention_speed.py --data /tmp/corpus/modded/pyc [--rows 2] [--seq-len 65536]

For each of `--rows` rows of the training shards (documents as the loader packs them: each starts at an
EOT) and for the long and the short window of speedrun-124m, it times forward and forward+backward of
one attention call (6 heads of 128, bf16) through the model's own paths: `flash_attention` with the
row's cu_seqlens, and compiled flex_attention with `flex_block_mask` at window_block 1 (the same maths)
and 128 (block-wise windows). Before timing, the flash path's output and gradients are checked against
FlexAttention's at window_block 1. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import glob
import json
import time

import numpy as np
import torch

from trainbox.data.formats import read_shard
from trainbox.data.tokenizer import GPT2_EOT as EOT
from trainbox.model.flash import doc_seqlens, flash_attention, flash_available
from trainbox.model.speedrun import ATTN_SCALE, _compiled_flex, flex_block_mask

def bench(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="token-file prefix (PREFIX_train_*.bin)")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--windows", type=int, nargs="+", default=[1792, 896])
    args = ap.parse_args()
    dev = torch.device("cuda")
    if not flash_available(dev):
        print(json.dumps({"ok": False, "error": "needs flash-attn-4 on a Hopper or Blackwell GPU"}))
        return 1
    T, H, D = args.seq_len, 6, 128
    shard = sorted(glob.glob(f"{args.data}_train_*.bin"))[0]
    tokens = np.asarray(read_shard(shard)[: T * args.rows], dtype=np.int64)
    flex = _compiled_flex()
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, seq_len=T, heads=H, head_dim=D, rows=[])
    ok = True
    torch.manual_seed(0)
    for r in range(args.rows):
        idx = torch.from_numpy(tokens[r * T:(r + 1) * T]).to(dev)[None]
        docs = (idx == EOT).cumsum(dim=1)
        cu = doc_seqlens(docs)
        lens = (cu[1:] - cu[:-1]).float()
        row = dict(documents=len(lens), longest=int(lens.max()), mean=round(lens.mean().item(), 1), windows={})
        q, k, v = (torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        go = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
        qf, kf, vf = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        gof = go.transpose(1, 2).contiguous()
        for window in args.windows:
            w = torch.tensor(window)
            masks = {u: flex_block_mask(docs, w.to(dev), u) for u in (1, 128)}

            def fa():
                return flash_attention(q, k, v, cu, w, 1, ATTN_SCALE)

            def fx(unit):
                return flex(qf, kf, vf, block_mask=masks[unit], scale=ATTN_SCALE)

            # the same maths: FlashAttention against FlexAttention at window_block 1 (fresh gradients)
            for t in (q, k, v, qf, kf, vf):
                t.grad = None
            o = fa()
            o.backward(go)
            of = fx(1)
            of.backward(gof)
            err = dict(out=rel(o, of.transpose(1, 2)), dq=rel(q.grad, qf.grad.transpose(1, 2)),
                       dk=rel(k.grad, kf.grad.transpose(1, 2)), dv=rel(v.grad, vf.grad.transpose(1, 2)))
            ok &= max(err.values()) < 2e-2
            res = dict(rel_err_vs_flex=err)
            res["flash_fwd_ms"] = bench(fa)
            res["flash_fwd_bwd_ms"] = bench(lambda: fa().backward(go))
            for unit in (1, 128):
                res[f"flex_block{unit}_fwd_ms"] = bench(lambda: fx(unit))
                res[f"flex_block{unit}_fwd_bwd_ms"] = bench(lambda: fx(unit).backward(gof))
            row["windows"][window] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}
        out["rows"].append(row)
    out["ok"] = bool(ok)
    print(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
