"""Document-causal attention, optionally in sliding windows, as one predicate (`allowed`) and the two masks built
from it, a dense one for SDPA and a block-sparse one for FlexAttention. The speedrun family's rule (documents split
at EOT, windows that grow during training); packed rows (kernels/packed.py) use it with a window as long as the row."""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from trainbox.kernels.ops import eager


def allowed(q_pos, kv_pos, q_doc, kv_doc, window, unit: int = 1):
    """Document-causal sliding-window rule, shared by the FlexAttention mask_mod and the SDPA mask.

    The window is counted in blocks of `unit` tokens (model.window_block): a query sees the keys of its
    own block and of the blocks that start fewer than `window` tokens before its block does. unit=1 is
    the exact rule (the last `window` tokens); unit=128, modded-nanogpt's block-wise windows, leaves
    FlexAttention no partial block at the window's edge."""
    return (kv_pos <= q_pos) & in_window(q_pos, kv_pos, window, unit) & (q_doc == kv_doc)


def in_window(q_pos, kv_pos, window, unit: int = 1):
    """The window part of `allowed`. Its distance, (q // unit - kv // unit) * unit, grows with q and falls
    with kv, so flex_block_mask can judge a whole block pair by two of its corners."""
    return (q_pos - kv_pos < window) if unit == 1 else ((q_pos // unit - kv_pos // unit) * unit < window)


def sdpa_mask(q_docs: torch.Tensor, kv_docs: torch.Tensor, pos: int, window: torch.Tensor,
              unit: int = 1) -> torch.Tensor:
    """(B, 1, T, S) boolean mask for queries at pos..pos+T-1 over keys at 0..S-1."""
    q_pos = torch.arange(pos, pos + q_docs.size(1), device=q_docs.device)[:, None]
    kv_pos = torch.arange(kv_docs.size(1), device=q_docs.device)[None, :]
    return allowed(q_pos, kv_pos, q_docs[:, :, None], kv_docs[:, None, :], window, unit)[:, None]


@eager
def flex_block_mask(docs: torch.Tensor, window: torch.Tensor, unit: int = 1, block: int = 128):
    """FlexAttention BlockMask for a (B, T) batch of document ids (training: queries == keys).

    Built outside any torch.compile graph (one cheap graph break at the top of the model): traced
    into the model's graph, torch 2.11 computes the backward's transposed block indices wrongly and
    the value gradients come out 10^5 times too large; built eagerly and passed in, flex's compiled
    forward and backward match SDPA.

    Built at the level of 128 x 128 blocks from each block's first/last position and document, so it
    costs O((T/128)^2) and never materialises the T x T mask (modded-nanogpt trains on 64K-token rows).
    A block pair is skipped when no pair in it is allowed, "full" (no mask_mod call) when every pair is.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed(q_idx, kv_idx, docs[b, q_idx], docs[b, kv_idx], window, unit)

    B, T = docs.shape
    if T % block:  # short or ragged rows: let torch evaluate mask_mod densely
        return create_block_mask(mask_mod, B, None, T, T, device=docs.device)
    first = torch.arange(0, T, block, device=docs.device)  # (N,) first position of each block
    last = first + block - 1
    blocks = docs.view(B, -1, block)
    lo, hi = blocks[:, :, 0], blocks[:, :, -1]             # docs are non-decreasing along a row
    q_first, q_last, kv_first, kv_last = first[:, None], last[:, None], first[None, :], last[None, :]
    q_lo, q_hi, kv_lo, kv_hi = lo[:, :, None], hi[:, :, None], lo[:, None, :], hi[:, None, :]
    # the window's distance is smallest at (first query, last key), largest at (last query, first key)
    any_pair = (kv_first <= q_last) & in_window(q_first, kv_last, window, unit) & (q_lo <= kv_hi) & (kv_lo <= q_hi)
    one_doc = (q_lo == q_hi) & (q_hi == kv_lo) & (kv_lo == kv_hi)
    all_pairs = (kv_last <= q_first) & in_window(q_last, kv_first, window, unit) & one_doc
    partial = any_pair & ~all_pairs

    def ordered(dense):  # (B, N, N) bool -> (B, 1, N) counts and (B, 1, N, N) kv indices, allowed ones first
        counts = dense.sum(dim=-1, dtype=torch.int32)
        indices = dense.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[:, None].contiguous(), indices[:, None].contiguous()

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(all_pairs), BLOCK_SIZE=block, mask_mod=mask_mod)
