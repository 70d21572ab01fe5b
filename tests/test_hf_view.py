"""model/hf/view.py: a LoRA run of a Llama, Mistral, Qwen2 or Qwen3 folder samples through the llama family's decoder
over its own modules. The view's logits equal transformers' with PEFT's adapters (left-padded rows, prefill and
cached decode steps), it holds no weight of its own (an adapter changed in place, or switched off, changes it as it
changes the model), rollouts through it equal rollouts through transformers, and another architecture samples
through transformers."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from trainbox.config import load_config
from trainbox.generate import rollout

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
import hf_tiny  # noqa: E402
from test_llama import hf_model  # noqa: E402
from test_rollout import padded_logits  # noqa: E402

from trainbox.model.hf.model import build_hf  # noqa: E402

PROMPTS = [[5, 17, 3, 9, 44], [8, 2], [31, 7, 7, 12, 60, 1, 19, 23, 4], [50]]


def lora_run(folder, **lora) -> torch.nn.Module:
    """A LoRA run's model of `folder`, every adapter's B moved off zero (as after training), fp32, eval mode."""
    torch.manual_seed(0)
    settings = {"r": 4, "alpha": 8, "dropout": 0, **lora}
    model = build_hf(load_config("lora", [f"model.path={folder}", *[f"lora.{k}={v}" for k, v in settings.items()]]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(len(n)))
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def run(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model(request.param).save_pretrained(folder)
    return lora_run(folder)


def same_logits(got_model, want_model) -> None:
    """Left-padded rows with a real token as the pad, the prefill's logits at every position and three cached
    decode steps: `got_model`'s within 1e-5 of `want_model`'s."""
    want = padded_logits(want_model, PROMPTS, [11, 3, 40], pad=5)
    got = padded_logits(got_model, PROMPTS, [11, 3, 40], pad=5)
    P = max(map(len, PROMPTS))
    for r, prompt in enumerate(PROMPTS):   # padded positions' logits are never read
        torch.testing.assert_close(got[0][r, P - len(prompt):], want[0][r, P - len(prompt):], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_view_computes_what_transformers_computes(run):
    """Left-padded rows with a real token as the pad, the prefill's logits at every position and three cached decode
    steps: the view within 1e-5 of transformers with PEFT's adapters."""
    view = run.rollout_model()
    assert view is not run and view.family == "llama" and view.static_decode
    same_logits(view, run)


@torch.no_grad()
def test_the_view_holds_no_weight_of_its_own(run):
    """Every tensor of the view is one of the model's; an adapter stepped in place moves the view's logits as it
    moves the model's, and with the adapters off the view is the base model."""
    view = run.rollout_model()
    assert {id(p) for p in view.parameters()} <= {id(p) for p in run.parameters()}
    assert view is run.rollout_model()   # built once
    x = torch.tensor([PROMPTS[2]])
    before = view(x, logits_to_keep=0).logits
    with adapter_stepped(run):
        after = view(x, logits_to_keep=0).logits
        assert (after - before).abs().max() > 1e-2
        torch.testing.assert_close(after, run(x, logits_to_keep=0).logits, rtol=1e-5, atol=1e-5)
        with run.adapters_off():
            base = run.peft.get_base_model()(x).logits
            torch.testing.assert_close(view(x, logits_to_keep=0).logits, base, rtol=1e-5, atol=1e-5)
        assert (base - after).abs().max() > 1e-2


@contextmanager
def adapter_stepped(run):
    """One adapter's B moved in place (as an optimizer step moves it), put back afterwards."""
    lora_b = next(p for n, p in run.named_parameters() if "lora_B" in n and "v_proj" in n)
    saved = lora_b.clone()
    try:
        lora_b.add_(0.5)
        yield
    finally:
        lora_b.copy_(saved)


def through_transformers(run):
    """The run sampling as a model without a view does: transformers' forward with its DynamicCache."""
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.run = run

        def forward(self, *args, **kwargs):
            return self.run(*args, **kwargs)

        def make_caches(self, *args):
            return self.run.make_caches(*args)
    return Plain()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollouts_through_the_view_equal_those_through_transformers(run, temperature):
    """Greedy and sampled (each row's seeded draws), with a stop id that ends some rows early: the same completions,
    token for token, and the model gets its mode back."""
    vocab = run.hf_config.vocab_size
    stop = frozenset({7, 19})
    run.train()
    got = rollout(run, PROMPTS, [3, 1, 4, 1], 12, vocab, stop, temperature=temperature, pad=5)
    assert run.training and all(m.training for m in run.peft.modules())
    want = rollout(through_transformers(run).eval(), PROMPTS, [3, 1, 4, 1], 12, vocab, stop,
                   temperature=temperature, pad=5)
    run.eval()
    assert got == want
    assert len(set(map(len, got))) > 1 or temperature == 0   # some rows stopped, others went on


@torch.no_grad()
def test_the_sampling_copy_merges_the_adapters(run):
    """`sampling_model`: every projection a copy (`Weights`) of its LoRA layer's base plus scaling x B @ A, the head
    and the norms the model's own (fp32: nothing to cast). Its logits are the view's within 1e-5, prefill and
    cached steps; an adapter stepped afterwards leaves a copy made before it as it was, and one made with the
    adapters off is the base model."""
    from trainbox.model.llama.model import Hookless, Weights
    view, copy = run.rollout_model(), run.sampling_model(torch.float32)
    layer = copy.model.layers[0]
    projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    assert all(isinstance(m, Weights) and m.weight.dtype == torch.float32 for m in projections)
    assert isinstance(copy.lm_head, Hookless) and isinstance(layer.input_layernorm, Hookless)
    same_logits(copy, view)
    x = torch.tensor([PROMPTS[2]])
    before = copy(x, logits_to_keep=0).logits
    with adapter_stepped(run):
        assert torch.equal(copy(x, logits_to_keep=0).logits, before)   # a copy: made as the weights stood
        torch.testing.assert_close(run.sampling_model(torch.float32)(x, logits_to_keep=0).logits,
                                   run(x, logits_to_keep=0).logits, rtol=1e-5, atol=1e-5)
        with run.adapters_off():
            base = run.peft.get_base_model()(x).logits
            torch.testing.assert_close(run.sampling_model(torch.float32)(x, logits_to_keep=0).logits, base,
                                       rtol=1e-5, atol=1e-5)
        assert (base - before).abs().max() > 1e-2


def test_rollouts_through_the_copy_equal_those_through_the_view(tmp_path):
    """Sampled with a stop id, in fp32, a Qwen2 folder's run (GRPO's usual kind; the logits of every architecture's
    copy are held above): the same completions through the merged copy as through the view."""
    hf_model("qwen2").save_pretrained(tmp_path)
    run = lora_run(tmp_path)
    vocab = run.hf_config.vocab_size
    kw = dict(temperature=1.0, pad=5)
    got = rollout(run, PROMPTS, [3, 1, 4, 1], 12, vocab, frozenset({7, 19}), copy_weights=True, **kw)
    assert got == rollout(run, PROMPTS, [3, 1, 4, 1], 12, vocab, frozenset({7, 19}), **kw)


def test_other_architectures_and_unsupported_options_sample_through_transformers(tmp_path):
    """A GPT-2 folder, and a Mistral folder whose sliding window binds, have no view: the run itself decodes."""
    gpt2 = lora_run(hf_tiny.make_model(tmp_path / "gpt2", "gpt2"))
    assert gpt2.rollout_model() is gpt2 and gpt2.sampling_model(torch.bfloat16) is gpt2
    hf_model("mistral", sliding_window=8).save_pretrained(tmp_path / "window")
    windowed = lora_run(tmp_path / "window")
    assert windowed.rollout_model() is windowed
    out = rollout(gpt2, PROMPTS, [0, 1, 2, 3], 6, gpt2.hf_config.vocab_size, frozenset(), temperature=0)
    assert [len(o) for o in out] == [6] * 4
