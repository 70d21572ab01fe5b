"""generate.py `rollout`: many prompts of different lengths sampled together, left-padded through the KV caches. A
padded row computes what its prompt computes alone (llama and hf families, prefill and decode), greedy rollouts equal
each prompt's own generation, a row's sampled completion does not depend on its batch, the counter-based Gumbel draws
follow softmax(logits / T) (against a pure-Python reference of the hash), and stop ids end a completion."""
from __future__ import annotations

import math

import pytest
import torch

from trainbox.config import build_config, load_config
from trainbox.errors import BadInput
from trainbox.generate import draw, gumbel_noise, rollout, stream
from trainbox.model.build import build_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
import hf_tiny  # noqa: E402

VOCAB = 64
PROMPTS = [[5, 17, 3, 9, 44], [8, 2], [31, 7, 7, 12, 60, 1, 19, 23, 4], [50]]


def tiny_llama() -> torch.nn.Module:
    """A 2-layer llama, 4 query heads sharing 2 key/value heads, weights large enough that every token matters."""
    torch.manual_seed(0)
    cfg = build_config({"model": {"family": "llama", "n_layer": 2, "n_head": 4, "n_embd": 32,
                                  "llama": {"n_kv_head": 2, "intermediate_size": 64}}}).model
    model = build_model(cfg, VOCAB, 64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """model.family=hf: a tiny transformers Llama with LoRA adapters whose B matrices are moved off zero."""
    from trainbox.model.hf.model import build_hf

    folder = hf_tiny.make_model(tmp_path_factory.mktemp("rollout") / "base", "llama")
    torch.manual_seed(0)
    model = build_hf(load_config("lora", [f"model.path={folder}", "lora.r=4", "lora.alpha=8", "lora.dropout=0"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2, generator=torch.Generator().manual_seed(len(n)))
            elif "lora_A" not in n:   # random weights of std 0.02 hardly depend on the context
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def models(request) -> tuple[torch.nn.Module, int]:
    model = request.getfixturevalue(request.param)
    return model, VOCAB if request.param == "llama" else model.hf_config.vocab_size


@pytest.fixture(params=["llama", "hf"])
def family(request):
    return models(request)


def padded_logits(model, prompts: list[list[int]], fed: list[int], pad: int) -> list[torch.Tensor]:
    """Left-padded rows as `rollout` runs them: the prefill's logits at every position, then those of each decode
    step feeding fed[i] to every row -> [(B, P, V), (B, 1, V), ...]."""
    P, B = max(map(len, prompts)), len(prompts)
    left = torch.tensor([P - len(p) for p in prompts])
    x = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    attend = torch.arange(P + len(fed))[None, :] >= left[:, None]
    caches = model.make_caches(B, P + len(fed), torch.float32, "cpu")
    out, pos = [], 0
    for step in range(len(fed) + 1):
        position_ids = (torch.arange(pos, pos + x.size(1))[None, :] - left[:, None]).clamp(min=0)
        out.append(model(x, caches=caches, pos=pos, position_ids=position_ids, attend=attend,
                         logits_to_keep=0).logits)
        pos += x.size(1)
        x = torch.full((B, 1), fed[step]) if step < len(fed) else x
    return out


def alone_logits(model, prompt: list[int], fed: list[int]) -> list[torch.Tensor]:
    """The same prompt alone (B = 1, no padding, no attend or position_ids): the plain cached path."""
    caches = model.make_caches(1, len(prompt) + len(fed), torch.float32, "cpu")
    out = [model(torch.tensor([prompt]), caches=caches, pos=0, logits_to_keep=0).logits]
    for i, token in enumerate(fed):
        out.append(model(torch.tensor([[token]]), caches=caches, pos=len(prompt) + i, logits_to_keep=0).logits)
    return out


@torch.no_grad()
def test_a_padded_row_computes_what_its_prompt_computes_alone(family):
    """Prefill logits at every real position and two decode steps: a padded row within 1e-5 of its prompt alone, for
    a pad id that is a real token (attending to it, or counting positions from the pad, would change them)."""
    model, _ = family
    fed = [11, 3]
    batched = padded_logits(model, PROMPTS, fed, pad=5)
    P = max(map(len, PROMPTS))
    for r, prompt in enumerate(PROMPTS):
        alone = alone_logits(model, prompt, fed)
        torch.testing.assert_close(batched[0][r, P - len(prompt):], alone[0][0], rtol=1e-5, atol=1e-5)
        for step in (1, 2):
            torch.testing.assert_close(batched[step][r], alone[step][0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_padding_check_is_sharp(llama):
    """The check above fails on a real defect: pads attended (no `attend`), or a decode step whose position counts
    from the padding while the prefill's count from the row's first token, move a padded row's logits by far more
    than its tolerance. (A shift of all of a row's positions alone changes nothing: RoPE scores are relative.)"""
    prompt, P = PROMPTS[1], max(map(len, PROMPTS))
    want = alone_logits(llama, prompt, [11])
    x = torch.tensor([[5] * (P - len(prompt)) + prompt])
    left = torch.tensor([P - len(prompt)])
    position_ids = (torch.arange(P)[None, :] - left[:, None]).clamp(min=0)
    attend = torch.arange(P + 1)[None, :] >= left[:, None]
    caches = llama.make_caches(1, P, torch.float32, "cpu")
    got = llama(x, caches=caches, pos=0, position_ids=position_ids).logits[0, -1]
    assert (got - want[0][0, -1]).abs().max() > 1e-2
    caches = llama.make_caches(1, P + 1, torch.float32, "cpu")
    llama(x, caches=caches, pos=0, position_ids=position_ids, attend=attend)
    got = llama(torch.tensor([[11]]), caches=caches, pos=P, attend=attend).logits[0, -1]
    assert (got - want[1][0, -1]).abs().max() > 1e-2


def greedy_alone(model, prompt: list[int], max_tokens: int, vocab: int, stop: frozenset[int]) -> list[int]:
    caches = model.make_caches(1, len(prompt) + max_tokens, torch.float32, "cpu")
    return list(stream(model, prompt, caches, 0, max_tokens, vocab, torch.Generator(), temperature=0, stop=stop))


def test_batched_greedy_rollout_equals_each_prompt_generated_alone(family):
    """Temperature 0: every row of one batch gives, token for token, its prompt's greedy generation alone; with a
    stop id that ends one row early while the others go on."""
    model, vocab = family
    first = greedy_alone(model, PROMPTS[0], 10, vocab, frozenset())
    stop = frozenset({first[4]})
    want = [greedy_alone(model, p, 10, vocab, stop) for p in PROMPTS]
    assert len(want[0]) <= 5 and max(map(len, want)) == 10
    assert rollout(model, PROMPTS, [0, 1, 2, 3], 10, vocab, stop, temperature=0, pad=5) == want


def test_a_sampled_row_is_the_same_in_any_batch(llama):
    """Temperature 1 with top-k: a row's completion depends on its prompt and seed only, not on the other rows, their
    order or their number; the same prompt with other seeds gives other completions (GRPO's G draws of a prompt)."""
    kw = dict(max_tokens=12, vocab=VOCAB, stop=frozenset(), temperature=1.0, top_k=20)
    a, b, c, d = PROMPTS
    one = rollout(llama, [a, b, c], [11, 12, 13], **kw)
    two = rollout(llama, [d, c, a, d, b], [7, 13, 11, 8, 12], pad=3, **kw)
    alone = [rollout(llama, [p], [s], **kw)[0] for p, s in ((a, 11), (b, 12), (c, 13))]
    assert one == [two[2], two[4], two[1]] == alone
    group = rollout(llama, [c] * 4 + [c], [0, 1, 2, 3, 0], **kw)
    assert group[4] == group[0] and len({tuple(g) for g in group[:4]}) == 4


@pytest.mark.parametrize("tied", [False, True])
def test_the_sampling_copy_under_autocast_draws_what_the_model_draws(tied):
    """fp32 weights sampled under bf16 autocast: `sampling_model`'s linear layers (the projections, and the head,
    tied to the token table or not) are bf16 copies (`Weights`) while the table and the norms stay the model's, and
    a rollout through them draws exactly what one through the model's own weights draws (autocast casts each fp32
    weight to the same bf16 values). The model's weights are left as they were."""
    from trainbox.model.llama.model import Hookless, Weights
    model = tiny_llama()
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    before = {n: p.clone() for n, p in model.state_dict().items()}
    copy = model.sampling_model(torch.bfloat16)
    layer = copy.model.layers[1]
    assert all(isinstance(m, Weights) and m.weight.dtype == torch.bfloat16
               for m in (layer.self_attn.q_proj, layer.mlp.down_proj, copy.lm_head))
    assert isinstance(copy.model.embed_tokens, Hookless) and isinstance(copy.model.norm, Hookless)
    assert model.sampling_model(torch.float32).lm_head.__class__ is Hookless   # fp32 weights in fp32: no copy
    seeds = list(range(8))
    prompts = [PROMPTS[r % 4] for r in seeds]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = rollout(model, prompts, seeds, 12, VOCAB, frozenset({3}), top_k=20, pad=5)
        got = rollout(model, prompts, seeds, 12, VOCAB, frozenset({3}), top_k=20, pad=5, copy_weights=True)
    assert got == want and len(set(map(len, got))) > 1
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())


@pytest.mark.slow   # Inductor compiles the token step on the CPU
def test_a_compiled_token_step_draws_what_the_eager_one_draws_and_compiles_once():
    """rollout(compiled=True): the one-token forward runs through torch.compile over caches rounded up to CACHE_ROUND
    positions, and draws what the eager step draws (fp32). Later rollouts of as many rows (a GRPO run's samplings),
    with prompts of other lengths, another number of tokens and (under autocast) through each sampling's fresh copy
    of the weights, run the code already compiled: no new graph."""
    from torch._dynamo.utils import counters

    from trainbox.generate import CACHE_ROUND
    model = tiny_llama()
    kw = dict(vocab=VOCAB, stop=frozenset({3}), top_k=20, pad=5)
    seeds = list(range(6))
    prompts = [PROMPTS[r % 4] for r in seeds]
    torch._dynamo.reset()
    counters.clear()
    want = rollout(model, prompts, seeds, 12, **kw)
    assert rollout(model, prompts, seeds, 12, compiled=True, **kw) == want and len(set(map(len, want))) > 1
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    later = [PROMPTS[1], PROMPTS[3]] * 3   # as many rows, 2 tokens, not 9: the same rounded caches
    assert 2 + 30 <= CACHE_ROUND
    assert rollout(model, later, seeds, 30, compiled=True, **kw) == rollout(model, later, seeds, 30, **kw)
    assert counters["stats"]["unique_graphs"] == graphs
    with torch.autocast("cpu", dtype=torch.bfloat16):   # each sampling copies the weights into new tensors
        first = rollout(model, prompts, seeds, 12, copy_weights=True, compiled=True, **kw)
        graphs = counters["stats"]["unique_graphs"]
        again = rollout(model, later, seeds, 12, copy_weights=True, compiled=True, **kw)
    assert counters["stats"]["unique_graphs"] == graphs and len(first) == len(again) == 6


def gumbel_reference(seed: int, t: int, v: int) -> float:
    """gumbel_noise's documented formula in Python integers (no int64 arithmetic to overflow)."""
    M = 0xFFFFFFFF

    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & M
        x ^= x >> 15
        x = (x * 0x846CA68B) & M
        return x ^ (x >> 16)

    seed &= (1 << 64) - 1   # the int64's two's-complement bits
    key = mix(mix((seed >> 32) ^ 0x9E3779B9) ^ (seed & M))
    key1 = mix(key ^ t)
    key2 = mix(key1 ^ 0x85EBCA6B)
    h = mix(mix(mix((v + 0x27D4EB2F) & M) ^ key1) ^ key2)
    return -math.log(-math.log((2 * (h >> 9) + 1) / 2 ** 24))


def test_gumbel_noise_equals_its_integer_reference_and_stays_finite():
    seeds = [0, 1, 2, -1, -(2 ** 63), 2 ** 63 - 1, 123456789012345]
    got = gumbel_noise(torch.tensor(seeds), 7, 50, "cpu")
    want = torch.tensor([[gumbel_reference(s, 7, v) for v in range(50)] for s in seeds])
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    big = gumbel_noise(torch.arange(256), 3, 40_000, "cpu")
    assert big.isfinite().all()
    assert abs(big.mean().item() - 0.5772) < 0.01 and abs(big.std().item() - math.pi / math.sqrt(6)) < 0.01


LOGITS = torch.tensor([1.5, 0.2, -0.7, 0.9, -2.0])
N = 20_000


def freqs(ids: torch.Tensor) -> torch.Tensor:
    return torch.bincount(ids, minlength=5).float() / ids.numel()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_softmax_of_the_logits_over_the_temperature(temperature):
    """20k rows (seeds) of the same logits: each id's frequency within 0.015 (over 4 standard errors) of
    softmax(logits / T), which no temperature or uniform draws miss by far more; draws of the next index and of the
    next seed are independent of these (their joint frequencies the product of the marginals)."""
    want = (LOGITS / temperature).softmax(-1)
    logits = LOGITS.expand(N, 5)
    seeds = torch.arange(N)
    first = draw(logits, seeds, 0, 5, temperature, None, None)
    assert (freqs(first) - want).abs().max() < 0.015
    for wrong in (LOGITS.softmax(-1) if temperature != 1 else (LOGITS / 0.6).softmax(-1), torch.full((5,), 0.2)):
        assert (wrong - want).abs().max() > 0.05
    for other in (draw(logits, seeds, 1, 5, temperature, None, None),       # the next token of each row
                  draw(logits, seeds + 1, 0, 5, temperature, None, None)):  # the neighbouring seed
        assert (freqs(other) - want).abs().max() < 0.015
        joint = torch.bincount(first * 5 + other, minlength=25).float().view(5, 5) / N
        assert (joint - want[:, None] * want[None, :]).abs().max() < 0.01


def test_top_k_top_p_and_the_vocabulary_limit_restrict_the_draws():
    logits, seeds = LOGITS.expand(N, 5), torch.arange(N)
    top2 = freqs(draw(logits, seeds, 0, 5, 1.0, 2, None))   # ids 0 and 3
    assert top2[[1, 2, 4]].sum() == 0
    assert (top2[[0, 3]] - LOGITS[[0, 3]].softmax(-1)).abs().max() < 0.015
    nucleus = freqs(draw(logits, seeds, 0, 5, 1.0, None, 0.8))   # ids 0 and 3 hold 0.79 of the mass, id 1 tips it
    assert nucleus[[2, 4]].sum() == 0 and (nucleus[[0, 3, 1]] - LOGITS[[0, 3, 1]].softmax(-1)).abs().max() < 0.015
    limited = freqs(draw(logits, seeds, 0, 3, 1.0, None, None))   # ids from 3 up are padding rows
    assert limited[3:].sum() == 0 and (limited[:3] - LOGITS[:3].softmax(-1)).abs().max() < 0.015
    assert draw(logits[:4], seeds[:4], 0, 3, 0, None, None).tolist() == [0] * 4   # greedy below the limit


def test_a_completion_ends_at_its_first_stop_id_and_runs_to_max_tokens_otherwise(llama):
    stop = frozenset({0, 1, 2, 3, 4})
    seeds = list(range(16))
    outs = rollout(llama, [PROMPTS[r % 4] for r in seeds], seeds, 15, VOCAB, stop)
    stopped = [o for o in outs if o[-1] in stop]
    assert stopped and len(stopped) < len(outs)   # both kinds, for these seeds
    for o in outs:
        assert all(i not in stop for i in o[:-1]) and all(0 <= i < VOCAB for i in o)
        assert len(o) == 15 or o[-1] in stop
    # each stopped row is a prefix of what it draws with no stop ids (the same draws, cut at the stop)
    free = rollout(llama, [PROMPTS[r % 4] for r in seeds], seeds, 15, VOCAB, frozenset())
    assert all(f[:len(o)] == o for f, o in zip(free, outs))


def test_rollout_stops_once_every_row_has_stopped_and_restores_the_mode():
    model = tiny_llama().train()
    calls, head = [], model.lm_head   # the head runs once a forward, in whichever module decodes (rollout_model,
    plain = head.forward              # which calls its forward without its hooks)

    def forward(*args, **kwargs):
        calls.append(head.training)
        return plain(*args, **kwargs)
    head.forward = forward
    outs = rollout(model, PROMPTS, [0, 1, 2, 3], 20, VOCAB, frozenset(range(VOCAB)))   # every id stops
    assert all(len(o) == 1 for o in outs)
    assert calls == [False] and model.training
    assert rollout(model, PROMPTS, [0, 1, 2, 3], 0, VOCAB, frozenset()) == [[]] * 4


def test_rollout_refuses_what_it_cannot_run(llama):
    with pytest.raises(BadInput, match="2 prompts but 1 seeds"):
        rollout(llama, PROMPTS[:2], [0], 4, VOCAB, frozenset())
    with pytest.raises(BadInput, match="prompt 1 is empty"):
        rollout(llama, [[1], []], [0, 1], 4, VOCAB, frozenset())
    with pytest.raises(BadInput, match="exceed the model's 64-token context"):
        rollout(llama, PROMPTS, [0, 1, 2, 3], 60, VOCAB, frozenset())
