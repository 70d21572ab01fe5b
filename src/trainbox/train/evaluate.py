"""Validation loss (nats/token) and bits per byte on a fixed slice of held-out data; end-of-run samples.

Bits per byte is tokenizer-independent: the summed cross-entropy of every target token that stands for
text, in bits, over the UTF-8 bytes those tokens decode to (special tokens such as EOT count neither
loss nor bytes). Two tokenizers are compared honestly as long as they are scored on the same text.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from trainbox.data.loader import TokenDataset, eval_batches
from trainbox.data.packing import packed_inputs
from trainbox.parallel.distributed import Dist


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


def autocast_context(device: torch.device, dtype: torch.dtype):
    """A fresh autocast context (bf16/fp16 on GPU); a no-op in fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
