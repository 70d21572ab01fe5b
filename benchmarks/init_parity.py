"""Is gpt2-125m at initialisation the model nanoGPT's model.py builds? Prints one JSON object.

    python benchmarks/init_parity.py --nanogpt .peers/nanoGPT --data /tmp/corpus/nanogpt/val.bin --seeds 12

1. The same weights: nanoGPT's GPT (n_layer 12, 768 wide, no biases, vocab 50,304) is initialised, its state
   dict is loaded into our gpt2-125m (torch paths: no fused kernels) and both losses are taken on one batch.
   They differ only by the GELU (ours: the tanh form of GPT-2; nanoGPT's nn.GELU: the exact one).
2. The initialisation: `--seeds` draws of each side's own initialisation, each loss on that same batch; the
   means, standard deviations and the Welch 95% interval of ours - nanoGPT's (loss_parity.compare).

The loss at initialisation spreads by about 0.3 between draws, so a difference in the initialisation (a
missing residual scaling, another std) shows in 2 but a handful of seeds only shows a large one. CPU, fp32,
no GPU needed: a 12-layer model on 4 x 256 tokens takes seconds per seed. nanoGPT's code is present locally,
never committed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanogpt", required=True, help="path to a nanoGPT checkout (its model.py)")
    ap.add_argument("--data", required=True, help="a uint16 token file, e.g. nanoGPT's val.bin")
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256, help="tokens per row")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.nanogpt).resolve()))
    sys.path.insert(0, str(HERE))
    from loss_parity import compare
    from model import GPT as NanoGPT, GPTConfig   # nanoGPT's model.py
    from step_parity import nanogpt_config, nanogpt_weights

    from trainbox.config import load_config
    from trainbox.model.registry import build_model

    data = np.memmap(args.data, dtype=np.uint16, mode="r")
    starts = np.random.default_rng(0).integers(0, len(data) - args.seq - 1, args.rows)
    rows = np.stack([data[i:i + args.seq + 1] for i in starts]).astype(np.int64)
    x, y = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())
    cfg = load_config("gpt2-125m", ["model.fused_norm=false", "model.fused_mlp=false", "model.fused_loss=false",
                                    f"model.n_layer={args.layers}", f"data.seq_len={args.seq}"])
    vocab = cfg.model.vocab_size
    theirs_cfg = nanogpt_config(GPTConfig, cfg.model, args.seq)
    ours, theirs, same = [], [], {}
    with torch.no_grad():
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            model = build_model(cfg.model, vocab, args.seq).eval()
            ours.append(float(model(x, y).loss))
            torch.manual_seed(10_000 + seed)
            with contextlib.redirect_stdout(sys.stderr):   # its parameter count
                nano = NanoGPT(theirs_cfg).eval()
            theirs.append(float(nano(x, y)[1]))
            if seed == 0:   # 1: nanoGPT's weights in our model
                model.load_state_dict(nanogpt_weights(nano), strict=True)
                same = {"ours": float(model(x, y).loss), "nanogpt": theirs[-1]}
    print(json.dumps({"benchmark": "init_parity", "tokens": args.rows * args.seq, "layers": args.layers,
                      "same_weights": {**same, "difference": same["ours"] - same["nanogpt"]},
                      "seeds": args.seeds, "ours": [round(v, 4) for v in ours],
                      "nanogpt": [round(v, 4) for v in theirs],
                      "stdev_between_draws": round(statistics.stdev(ours + theirs), 4),
                      **{k: v for k, v in compare(ours, theirs).items() if k != "verdict"}}))


if __name__ == "__main__":
    main()
