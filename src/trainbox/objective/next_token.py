"""The next-token objective (train.objective=next_token): pretraining and SFT.

A step's loss is the mean token cross-entropy over the target tokens of the whole global batch that carry loss
(all of them, or those of the data's loss mask: SFT's assistant tokens). Each micro-batch contributes the sum of
its token losses over that count, which the batch order gives on the host (a pure function of the step), so a
token weighs the same whatever the micro-batch size or the number of processes.

Validation: loss in nats per token and bits per byte on a fixed slice of held-out data. Bits per byte is
tokenizer-independent: the summed cross-entropy of every target token that stands for text, in bits, over the
UTF-8 bytes those tokens decode to (special tokens such as EOT count neither loss nor bytes), so two tokenizers
are compared honestly as long as they are scored on the same text.
"""
from __future__ import annotations

import math

import torch

from trainbox.data.loader import TokenDataset, eval_batches
from trainbox.data.packing import packed_inputs
from trainbox.model.build import adapt_datasets, open_datasets
from trainbox.objective.base import Objective, Part, Runtime
from trainbox.parallel.distributed import Dist


class NextToken(Objective):
    name = "next_token"

    def __init__(self, cfg=None, device: torch.device | None = None, dtype: torch.dtype | None = None):
        self.token_bytes = None   # per-token UTF-8 lengths for bits per byte, built at the first evaluation

    def open_datasets(self, cfg, tokenizer, vocab: int):
        """data.path's token windows (or the family's own examples: SFT JSONL, t5 span corruption)."""
        return adapt_datasets(cfg, tokenizer, vocab, *open_datasets(cfg, tokenizer, vocab))

    def denominator(self, batches, step: int) -> int:
        return batches.target_tokens(step)

    def loss(self, forward, batch: dict, scale: float) -> Part:
        out = forward(batch["x"], batch["y"], loss_mask=batch.get("loss_mask"), reduction="sum",
                      **packed_inputs(batch))   # packed rows: each example's positions and attention
        return Part(out.loss.float() * scale, out.aux_loss, None, out.stats)

    def evaluate(self, run: Runtime) -> dict:
        if self.token_bytes is None:
            pad = [0] * (run.vocab - run.tokenizer.vocab_size)
            self.token_bytes = torch.tensor(run.tokenizer.token_bytes() + pad, dtype=torch.int32, device=run.device)
        forward = run.forward if not run.cfg.train.compile else run.model
        return evaluate(forward, run.val, run.cfg.train.eval_tokens, run.cfg.train.micro_batch_size,
                        self.token_bytes, run.device, run.autocast, run.dist)

    def eval_line(self, res: dict) -> str:
        return f"val loss {res['val_loss']:.4f} nats/token, {res['val_bpb']:.4f} bits/byte"


@torch.no_grad()
def evaluate(model, dataset: TokenDataset, eval_tokens: int, micro_batch: int, token_bytes: torch.Tensor,
             device: torch.device, autocast, dist: Dist) -> dict:
    """-> {val_loss (nats/token), val_bpb, val_tokens}; identical on every rank."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, tokens, loss sum over text, bytes
    for batch in eval_batches(dataset, eval_tokens, micro_batch, dist.world, dist.rank):
        x, y = batch["x"].to(device), batch["y"].to(device)
        mask = batch.get("loss_mask")
        mask = mask.to(device) if mask is not None else torch.ones_like(y, dtype=torch.bool)
        packed = {k: v.to(device) for k, v in packed_inputs(batch).items()}
        with autocast():
            loss = model(x, y, loss_mask=mask, reduction="none", **packed).loss.double()
        nbytes = token_bytes[y] * mask
        text = nbytes > 0
        sums += torch.stack([loss[mask].sum(), mask.sum().double(), loss[text].sum(), nbytes.sum().double()])
    dist.all_reduce_sum(sums)
    model.train(was_training)
    loss_sum, n, text_loss, nbytes = sums.tolist()
    return {"val_loss": loss_sum / max(n, 1), "val_bpb": text_loss / math.log(2) / max(nbytes, 1),
            "val_tokens": int(n)}
