"""Speedrun family on the SDPA path: masking rules, cache, window warm-up, and parity with a slow reference."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from trainbox.config import ModelSection
from trainbox.model.build import build_model

EOT = 0
VOCAB = 64


def make(window: int = 64, n_layer: int = 4, block_size: int = 64, **kw):
    torch.manual_seed(0)
    cfg = ModelSection(family="speedrun", n_layer=n_layer, n_head=2, n_embd=32, head_dim=16, window=window,
                       eot_id=EOT, **kw)
    model = build_model(cfg, VOCAB, block_size)
    # output projections and head start at zero (every block is the identity); perturb them so that
    # every path (attention across positions included) influences the logits in these tests
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight") or name == "lm_head.weight":
                p.normal_(std=0.3)
            if name.endswith("lambdas"):
                p.add_(0.3)
    return model.eval()


def logits_all(model, idx):
    """(B, T, V) logits at every position (forward with targets returns only the loss)."""
    return model.logits(model.hidden(idx))


def tokens(T=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (2, T), generator=g)  # no EOT unless a test puts one


def test_zero_init_outputs_and_softcap():
    torch.manual_seed(0)
    cfg = ModelSection(family="speedrun", n_layer=2, n_head=2, n_embd=32, eot_id=EOT, logit_softcap=15.0)
    model = build_model(cfg, VOCAB, 64)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            assert p.abs().max() == 0, name
    x = torch.randn(3, VOCAB) * 100
    assert model.logits(x @ torch.zeros(VOCAB, 32)).abs().max() == 0
    with torch.no_grad():
        model.lm_head.weight.normal_(std=100.0)
    assert logits_all(model, tokens()).abs().max() <= 15.0


def test_causality():
    model = make()
    idx = tokens()
    base = logits_all(model, idx)
    changed = idx.clone()
    changed[:, 25:] = (changed[:, 25:] + 7) % (VOCAB - 1) + 1
    out = logits_all(model, changed)
    torch.testing.assert_close(out[:, :25], base[:, :25], rtol=0, atol=1e-6)
    assert (out[:, 25:] - base[:, 25:]).abs().max() > 1e-3  # the later positions do change


def test_document_masking():
    model = make()
    idx = tokens()
    idx[:, 20] = EOT  # document 2 starts at position 20 (EOT opens a document)
    base = logits_all(model, idx)
    changed = idx.clone()
    changed[:, 3:20] = (changed[:, 3:20] + 5) % (VOCAB - 1) + 1  # rewrite document 1 only
    out = logits_all(model, changed)
    torch.testing.assert_close(out[:, 20:], base[:, 20:], rtol=0, atol=1e-6)
    assert (out[:, 3:20] - base[:, 3:20]).abs().max() > 1e-3
    # without the EOT the same edit does reach the later positions
    plain, plain_changed = idx.clone(), changed.clone()
    plain[:, 20] = plain_changed[:, 20] = 9
    assert (logits_all(model, plain_changed)[:, 20:] - logits_all(model, plain)[:, 20:]).abs().max() > 1e-3


def test_window_limit():
    # with one layer, position t sees exactly tokens t-window+1..t (deeper models compose windows)
    model = make(window=8, n_layer=1)
    idx = tokens()
    base = logits_all(model, idx)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 3) % (VOCAB - 1) + 1
    diff = (logits_all(model, changed) - base).abs().amax(dim=(0, 2))
    assert diff[:10].max() == 0 and diff[18:].max() == 0    # before it, and 8+ tokens after it
    assert (diff[10:18] > 1e-4).all()                        # inside the window


def test_window_counts_blocks():
    # model.window_block=4, window 8: a query sees its own 4-token block and the one before it, so a
    # change at position 10 (block 8..11) reaches 10..15 and not 16 (two blocks on), where an exact
    # 8-token window would reach 17
    model = make(window=8, n_layer=1, window_block=4)
    idx = tokens()
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 3) % (VOCAB - 1) + 1
    diff = (logits_all(model, changed) - logits_all(model, idx)).abs().amax(dim=(0, 2))
    assert diff[:10].max() == 0 and diff[16:].max() == 0
    assert (diff[10:16] > 1e-4).all()


def test_window_warmup_schedule():
    model = make(window=1024, window_warmup_steps=100)
    assert [model.window_at(s) for s in (0, 50, 100, 500)] == [128, 576, 1024, 1024]
    model.set_step(0)
    assert int(model.window) == 128
    model.set_step(100)
    assert int(model.window) == 1024
    whole_run = make(window=1024, window_warmup_steps=None)   # null: over the run's total steps
    assert [whole_run.window_at(s, 200) for s in (0, 100, 200)] == [128, 576, 1024]
    whole_run.set_step(50, 100)
    assert int(whole_run.window) == 576


@pytest.mark.parametrize("unit", [1, 5])
def test_generation_with_cache_equals_without(unit):
    model = make(window=12, window_block=unit)   # block-wise windows count blocks of absolute positions
    idx = tokens(T=30)
    idx[:, 7] = EOT
    idx[1, 22] = EOT
    full = logits_all(model, idx)
    caches = model.make_caches(2, 30, torch.float32, "cpu")
    prompt = 10
    step_logits = [model(idx[:, :prompt], caches=caches, pos=0).logits]
    for t in range(prompt, 30):
        step_logits.append(model(idx[:, t:t + 1], caches=caches, pos=t).logits)
    cached = torch.cat(step_logits, dim=1)
    torch.testing.assert_close(cached, full[:, prompt - 1:], rtol=1e-5, atol=1e-5)


def reference_attention_logits(model, idx):
    """Slow oracle: every query attends by an explicit Python loop over the allowed keys."""
    B, T = idx.shape
    eot = model.eot_id
    docs = (idx == eot).cumsum(1)
    u = model.cfg.window_block  # the window counts blocks of u tokens

    def attend(q, k, v, window):  # (B, T, H, D) in and out, as the model's attention calls
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.zeros_like(q)
        for b in range(B):
            for t in range(T):
                keys = [s for s in range(T) if s <= t and (t // u - s // u) * u < window and docs[b, s] == docs[b, t]]
                scores = (q[b, :, t:t + 1] @ k[b, :, keys].transpose(-1, -2)) * 0.12
                out[b, :, t] = (scores.softmax(-1) @ v[b, :, keys])[:, 0]
        return out.transpose(1, 2)

    long = int(model.window)
    model._attend_fns = lambda *a: {"L": lambda q, k, v: attend(q, k, v, long),
                                    "S": lambda q, k, v: attend(q, k, v, max(1, long // 2))}
    try:
        return logits_all(model, idx)
    finally:
        del model._attend_fns


@pytest.mark.parametrize("pattern, unit", [(None, 1), ("LS-", 1), ("SLS", 1), ("LS-", 4), ("SLS", 3)])
def test_matches_slow_reference(pattern, unit):
    model = make(window=6, n_layer=3, window_pattern=pattern, window_block=unit)
    idx = tokens(T=16)
    idx[0, 5] = EOT
    idx[1, 11] = EOT
    torch.testing.assert_close(logits_all(model, idx), reference_attention_logits(model, idx), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("letter, sees", [("L", 8), ("S", 4)])
def test_window_pattern_long_and_short_windows(letter, sees):
    # one layer: an L layer sees the last 8 tokens, an S layer the last 4 (half the window)
    model = make(window=8, n_layer=1, window_pattern=letter)
    idx = tokens()
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 3) % (VOCAB - 1) + 1
    diff = (logits_all(model, changed) - logits_all(model, idx)).abs().amax(dim=(0, 2))
    assert diff[:10].max() == 0 and diff[10 + sees:].max() == 0
    assert (diff[10:10 + sees] > 1e-4).all()


def test_window_pattern_without_attention_layers():
    full, holed = make(n_layer=4), make(n_layer=4, window_pattern="LL-L")
    assert holed.blocks[2].attn is None and all(holed.blocks[i].attn is not None for i in (0, 1, 3))
    attn_params = sum(p.numel() for p in full.blocks[2].attn.parameters())
    assert attn_params == 4 * 32 * 32 + 2
    assert holed.num_params() == full.num_params() - attn_params
    assert holed.flops_per_token(32) == 6 * holed.num_params() + 12 * 3 * 2 * 16 * 32
    short = make(n_layer=4, window=16, window_pattern="LSSL")
    assert short.flops_per_token(64) == 6 * short.num_params() + 12 * 2 * 16 * (16 + 8 + 8 + 16)
    idx = tokens(T=30)  # the KV-cached decode holds no cache for the layer without attention
    idx[:, 7] = EOT
    caches = holed.make_caches(2, 30, torch.float32, "cpu")
    assert caches[2] is None
    steps = [holed(idx[:, :10], caches=caches, pos=0).logits]
    steps += [holed(idx[:, t:t + 1], caches=caches, pos=t).logits for t in range(10, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), logits_all(holed, idx)[:, 9:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw, match", [
    (dict(family="speedrun", n_layer=3, window_pattern="LL"), "one letter per layer"),
    (dict(family="speedrun", n_layer=2, window_pattern="LX"), "one letter per layer"),
    (dict(family="gpt", n_layer=2, window_pattern="LL"), "applies to model.family=speedrun")])
def test_window_pattern_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelSection(n_head=2, n_embd=32, **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(family="speedrun", attention="flash", window_block=128), "counts the window in tokens"),
    (dict(family="gpt", attention="flex"), "applies to model.family=speedrun")])
def test_attention_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelSection(n_head=2, n_embd=32, **kw)


def test_attention_backend_on_cpu():
    """auto falls back to SDPA on a CPU; asking for FlashAttention there is refused with the reason."""
    from trainbox.errors import ConfigError
    model = make()
    model.set_step(0)
    assert model.backend == "sdpa"
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        make(attention="flash").set_step(0)


def test_doc_seqlens_are_the_document_offsets():
    """cu_seqlens for FlashAttention: every document start in the flattened batch (each row starts one,
    documents never cross rows), then B*T; the windows reach no further than `allowed` lets them."""
    from trainbox.kernels.flash import doc_seqlens
    idx = tokens(T=40)
    idx[0, [0, 7, 8, 30]] = EOT
    idx[1, [39]] = EOT
    docs = (idx == EOT).cumsum(dim=1)
    assert doc_seqlens(docs).tolist() == [0, 7, 8, 30, 40, 79, 80]
    assert doc_seqlens(docs).dtype == torch.int32
    # the same sequences as the SDPA mask's document rule: a pair is in one sequence iff same row and doc
    cu = doc_seqlens(docs)
    seq = torch.bucketize(torch.arange(80), cu[1:], right=True)
    same = seq[:, None] == seq[None, :]
    flat_doc = (docs + torch.arange(2)[:, None] * 1000).flatten()
    assert torch.equal(same, flat_doc[:, None] == flat_doc[None, :])


def test_flash_runs_only_in_half_precision():
    """FlashAttention has bf16/fp16 kernels only: half_precision() is what routes an fp32 forward to
    FlexAttention, and it must also hold inside a compiled graph (autocast state is a guard there)."""
    from trainbox.kernels.flash import half_precision
    cpu = torch.device("cpu")
    assert not half_precision(cpu, torch.float32) and half_precision(cpu, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert half_precision(cpu, torch.float32)
    f = torch.compile(lambda x: x * 2 if half_precision(x.device, torch.float32) else x * 3, fullgraph=True)
    assert f(torch.ones(2)).tolist() == [3, 3]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert f(torch.ones(2)).tolist() == [2, 2]


def test_window_pattern_keeps_every_value_embedding_read():
    # 4 layers share 2 value embeddings: layers 0 and 2 read the first, 1 and 3 the second
    with pytest.raises(Exception, match="value embeddings"):
        make(n_layer=4, window_pattern="L-L-")


def test_shifted_softcap_is_the_same_loss():
    model = make()
    x = torch.randn(2, 5, 32) * 3
    torch.testing.assert_close(model.logits(x, shifted=True), model.logits(x) + 15.0, rtol=0, atol=2e-5)
    idx = tokens()
    loss = model(idx, idx).loss  # the training loss uses the shifted (sigmoid) form
    ref = torch.nn.functional.cross_entropy(logits_all(model, idx).flatten(0, 1), idx.flatten())
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)


def fp32_norm(norm, x, *args, **kwargs):
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return norm(x.float(), *args, **kwargs)
    return norm(x, *args, **kwargs)


@pytest.mark.parametrize("family, lowp, want", [
    ("speedrun", None, torch.bfloat16), ("speedrun", False, torch.float32),
    ("gpt", None, torch.float32), ("gpt", True, torch.bfloat16), ("moe", True, torch.bfloat16)])
def test_residual_stream_dtype(family, lowp, want, monkeypatch):
    """model.lowp_residual: the residual stream in the autocast dtype (speedrun's default) or fp32 (gpt's)."""
    if family == "speedrun":
        model = make(n_layer=2, lowp_residual=lowp)
        blocks = model.blocks
    else:
        torch.manual_seed(0)
        model = build_model(ModelSection(family=family, n_layer=2, n_head=2, n_embd=32, lowp_residual=lowp), VOCAB, 64)
        blocks = model.transformer.h
    seen = []
    blocks[1].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    idx = tokens()
    # CUDA autocast runs norms in fp32 and returns fp32 (CPU autocast does not): play the GPU's rule here, or
    # a stream that turns fp32 after the first norm on the GPU would pass on CPU
    monkeypatch.setattr(F, "rms_norm", functools.partial(fp32_norm, F.rms_norm))
    monkeypatch.setattr(F, "layer_norm", functools.partial(fp32_norm, F.layer_norm))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(idx[:, :-1], idx[:, 1:]).loss
    exact = model(idx[:, :-1], idx[:, 1:]).loss
    assert seen == [want, torch.float32]            # without autocast the stream stays in the weights' dtype
    assert abs(low.item() - exact.item()) < 0.02 * exact.item()


def test_lowp_residual_is_refused_for_other_families():
    with pytest.raises(ValueError, match="model.lowp_residual applies to"):
        ModelSection(family="t5", lowp_residual=True)


def test_interface_counts():
    model = make()
    n_total = sum(p.numel() for p in model.parameters())
    n_tables = model.embed.weight.numel() + sum(e.weight.numel() for e in model.value_embeds)
    assert model.num_params() == n_total - n_tables
    assert model.flops_per_token(32) == 6 * model.num_params() + 12 * 4 * 2 * 16 * 32
    # window 20 in blocks of 8: a query sees 2 whole blocks and, on average, 4.5 keys of its own
    blocks = make(window=20, window_block=8, window_pattern="LLLS")
    assert blocks.flops_per_token(64) == 6 * blocks.num_params() + 12 * 2 * 16 * (3 * 20.5 + 12.5)
    with pytest.raises(Exception, match="eot_id"):
        build_model(ModelSection(family="speedrun", n_layer=2, n_head=2, n_embd=32), VOCAB, 64)


@pytest.mark.parametrize("window, unit", [(1, 1), (100, 1), (128, 1), (300, 1), (5000, 1), (1, 128), (300, 128),
                                          (640, 128), (100, 48)])
def test_flex_block_mask_matches_dense_mask_mod(window, unit):
    """Our O((T/128)^2) block mask equals torch's create_block_mask (which evaluates mask_mod densely)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from trainbox.kernels.doc_mask import allowed, flex_block_mask
    idx = tokens(T=768)
    idx[0, [300, 700]] = EOT          # documents crossing block edges
    idx[1, [129, 256, 257]] = EOT     # a one-token document, and one that starts on a block edge
    docs = (idx == EOT).cumsum(1)
    w = torch.tensor(window, dtype=torch.int32)
    ours = flex_block_mask(docs, w, unit)
    ref = create_block_mask(lambda b, h, q, k: allowed(q, k, docs[b, q], docs[b, k], w, unit), 2, None, 768, 768,
                            device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks)


@pytest.mark.parametrize("autocast", [False, True])
def test_flex_path_forward_equals_sdpa_path(autocast):
    """Forward through flex_attention (eager: CPU has no FlexAttention backward) equals the SDPA path,
    in fp32 and under bf16 autocast (flex_attention, unlike SDPA, needs q, k, v in one dtype)."""
    import contextlib
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    import trainbox.model.speedrun.model as speedrun
    model = make(window=200, n_layer=2, block_size=384)
    idx = tokens(T=384)
    idx[0, 150] = idx[1, 300] = EOT
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        sdpa = logits_all(model, idx)
        model.backend = "flex"
        compiled = speedrun._compiled_flex
        speedrun._compiled_flex = lambda: flex_attention  # compiling on CPU takes too long for a unit test
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "flex_attention called without torch.compile" (expected here)
                flex = logits_all(model, idx)
        finally:
            speedrun._compiled_flex, model.backend = compiled, "sdpa"
    if autocast:
        assert ((flex - sdpa).norm() / sdpa.norm()) < 2e-2
    else:
        torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe, layers, width, heads, non_embedding", [
    ("speedrun-124m", 12, 768, 6, 121.2e6), ("speedrun-350m", 16, 1024, 8, 252.9e6)])
def test_recipes_build(recipe, layers, width, heads, non_embedding):
    from trainbox.config import load_config
    cfg = load_config(recipe, ["model.eot_id=50256"])
    assert (cfg.model.family, cfg.optim.name, cfg.model.vocab_size) == ("speedrun", "muon", 50304)
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len)
    assert (len(model.blocks), model.embed.embedding_dim, model.blocks[0].attn.n_head, model.head_dim) == \
        (layers, width, heads, 128)
    assert abs(model.num_params() - non_embedding) < 0.5e6


def test_rotary_is_relative_and_offset_consistent():
    from trainbox.model.layers import Rotary
    rot = Rotary(16)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    dots = [(rot(q, m) * rot(k, n)).sum() for m, n in [(7, 3), (12, 8), (104, 100)]]
    torch.testing.assert_close(torch.stack(dots), dots[0].expand(3), rtol=1e-5, atol=1e-5)  # depends on m - n only
    assert not torch.allclose((rot(q, 7) * rot(k, 3)).sum(), (rot(q, 7) * rot(k, 5)).sum())
    x = torch.randn(2, 10, 3, 16)
    torch.testing.assert_close(rot(x).norm(dim=-1), x.norm(dim=-1))              # a rotation
    torch.testing.assert_close(rot(x[:, 4:], pos=4), rot(x)[:, 4:])              # cached decode positions
    table = Rotary(16, max_len=16)           # x has 10 positions: pos 0 and 4 read the tables, pos 7 runs past them
    for pos in (0, 4, 7):
        torch.testing.assert_close(table(x, pos=pos), rot(x, pos=pos), rtol=0, atol=0)
