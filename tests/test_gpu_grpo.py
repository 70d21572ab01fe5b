"""GRPO's sampling on a CUDA GPU: generate.py `rollout` replays its token step in a CUDA graph for a llama model,
and for a LoRA run's view of a Llama folder (model/hf/view.py: a bf16 base or a 4-bit one); the completions equal
those of the same step run without the graph (greedy and sampled, bf16 autocast, as a training run samples), also
through the sampling copy (grpo.sampling_copy: the fp32 weights' bf16 copy draws what autocast's casts draw; LoRA's
merged copy computes the view's logits within bf16's rounding), and `trainbox train grpo` on a tiny Llama folder
(bf16, compiled; every weight, and LoRA) raises the validation reward, also with two clipped updates a generation,
resumed in the middle of one.

    python -m pytest -q -m gpu tests/test_gpu_grpo.py
"""
from __future__ import annotations

import importlib.util
import json
import shutil

import hf_tiny
import pytest
import torch
from conftest import run_cli
from test_grpo import make_prompt_file, write_rewards
from test_rollout import PROMPTS, VOCAB, tiny_llama

from trainbox.config import load_config
from trainbox.generate import fused_noise, gumbel_noise, rollout
from trainbox.model.llama.model import Weights

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, None), (0.8, 20)])
def test_graph_replays_equal_the_step_run_eagerly(temperature, top_k):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny_llama().cuda()
    prompts = PROMPTS * 4   # 16 rows
    seeds = list(range(100, 116))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = rollout(model, prompts, seeds, 40, VOCAB, frozenset({3}), temperature, top_k, pad=0, graphs=False)
        graphed = rollout(model, prompts, seeds, 40, VOCAB, frozenset({3}), temperature, top_k, pad=0)
        copied = rollout(model, prompts, seeds, 40, VOCAB, frozenset({3}), temperature, top_k, pad=0,
                         copy_weights=True)   # the fp32 weights' bf16 copy: autocast's casts, made once
    assert graphed == eager == copied
    assert any(len(c) < 40 and c[-1] == 3 for c in eager) and any(len(c) == 40 for c in eager)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_lora_runs_view_replays_in_a_graph_as_it_runs_eagerly(tmp_path, quantized):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if quantized and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("needs bitsandbytes")
    from trainbox.model.hf.model import build_hf
    folder = hf_tiny.make_model(tmp_path / "base", seed=3)
    torch.manual_seed(0)
    model = build_hf(load_config("lora", [f"model.path={folder}", "lora.r=4", "lora.alpha=8", "lora.dropout=0",
                                          *(["quant.load_in_4bit=true"] if quantized else [])]))
    model = model.cuda().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.3)
            elif "lm_head" in n:
                p.mul_(10)   # a random head of std 0.02 gives near-uniform draws: every row would run to the end
    view, vocab = model.rollout_model(), model.hf_config.vocab_size
    assert view is not model and view.static_decode
    prompts, seeds = PROMPTS * 4, list(range(100, 116))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for temperature in (0.0, 1.0):
            eager = rollout(model, prompts, seeds, 40, vocab, frozenset({3}), temperature, pad=0, graphs=False)
            graphed = rollout(model, prompts, seeds, 40, vocab, frozenset({3}), temperature, pad=0)
            assert graphed == eager, temperature
        # the sampling copy: adapters merged into a bf16 copy of the base (dequantized where 4-bit)
        copied = rollout(model, prompts, seeds, 40, vocab, frozenset({3}), 1.0, pad=0, copy_weights=True)
        assert copied == rollout(model, prompts, seeds, 40, vocab, frozenset({3}), 1.0, pad=0, graphs=False,
                                 copy_weights=True)
        copy = model.sampling_model(torch.bfloat16)
        assert isinstance(copy.model.layers[0].mlp.down_proj, Weights)
        assert copy.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
        x = torch.tensor([PROMPTS[2]], device="cuda")
        ours, theirs = view(x, logits_to_keep=0).logits.float(), model(x, logits_to_keep=0).logits.float()
        merged = copy(x, logits_to_keep=0).logits.float()
    torch.testing.assert_close(ours, theirs, atol=0.05 * theirs.std().item(), rtol=0.02)
    torch.testing.assert_close(merged, theirs, atol=0.05 * theirs.std().item(), rtol=0.02)


@pytest.mark.parametrize("family", ["llama", "hf"])
def test_train_grpo_on_a_gpu_raises_the_reward(tmp_path, family):
    """Every weight (llama) from 0.67 at step 8 to 0.95 (H200); LoRA (hf) from the first policy's reward, about one
    half (CPU: 0.50), evaluated every 2 steps: its scaled head learns fast (CPU: 0.58 at step 2, 0.95 at 8)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    base = hf_tiny.make_model(tmp_path / "base", seed=3)
    settings = ["train.eval_every=8", "optim.lr=3e-2"]
    if family == "hf":   # the frozen head scaled up, as in test_grpo.py's LoRA run (further: bf16 learns slower)
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(base)
        with torch.no_grad():
            model.lm_head.weight.mul_(20)
        model.save_pretrained(base)
        settings = ["model.family=hf", "train.eval_every=2", "optim.lr=1e-2"]
    rewards = write_rewards(tmp_path)
    make_prompt_file(tmp_path / "train.jsonl", n=64, seed=1)
    make_prompt_file(tmp_path / "val.jsonl", n=16, seed=2)
    run_cli("train", "grpo", f"model.path={base}", f"data.path={tmp_path / 'train.jsonl'}",
            f"data.val_path={tmp_path / 'val.jsonl'}", "data.seq_len=64", "grpo.max_completion_len=8",
            "grpo.num_generations=4", f"grpo.rewards=[{rewards}:low_ids]", "train.global_batch_size=4",
            "train.max_steps=24", "train.eval_tokens=1024", *settings,
            f"run.dir={tmp_path / 'runs'}", "monitor.port=0", "monitor.plot=false", cwd=tmp_path, timeout=900)
    events = [json.loads(line) for line in open(tmp_path / "runs" / "grpo" / "metrics.jsonl")]
    start = next(e for e in events if e["event"] == "start")
    assert start["layout"]["device"].startswith("cuda"), start["layout"]
    evals = [e["val_reward"] for e in events if e["event"] == "eval"]
    if family == "llama":
        assert len(evals) == 3 and evals[-1] > 0.75 and evals[-1] > evals[0], evals
    else:
        assert len(evals) == 12 and evals[-1] > 0.75 and evals[-1] > evals[0] + 0.15, evals


def test_several_updates_a_generation_on_a_gpu(tmp_path):
    """grpo.num_iterations=2 with the KL term and DAPO's upper clip, compiled and sampled through the CUDA graph: the
    reward rises, the clip binds at the second step of a generation only, and a resume from the checkpoint in the
    middle of one (step 5) trains step 6 on the completions it saved: the same rewards, the loss within 1e-3 (bf16)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    base = hf_tiny.make_model(tmp_path / "base", seed=3)
    rewards = write_rewards(tmp_path)
    make_prompt_file(tmp_path / "train.jsonl", n=64, seed=1)
    make_prompt_file(tmp_path / "val.jsonl", n=16, seed=2)
    args = [f"model.path={base}", f"data.path={tmp_path / 'train.jsonl'}", f"data.val_path={tmp_path / 'val.jsonl'}",
            "data.seq_len=64", "grpo.max_completion_len=8", "grpo.num_generations=4",
            f"grpo.rewards=[{rewards}:low_ids]", "train.global_batch_size=4", "train.max_steps=24",
            "train.eval_tokens=1024", "train.eval_every=6", "train.checkpoint_every=5", "train.keep_last=10",
            "optim.lr=3e-2", "grpo.num_iterations=2", "grpo.beta=0.04", "grpo.epsilon_high=0.28", "monitor.port=0",
            "monitor.plot=false"]
    run_cli("train", "grpo", *args, f"run.dir={tmp_path / 'whole'}", cwd=tmp_path, timeout=900)
    whole = tmp_path / "whole" / "grpo"
    events = [json.loads(line) for line in open(whole / "metrics.jsonl")]
    assert next(e for e in events if e["event"] == "start")["layout"]["device"].startswith("cuda")
    evals = [e["val_reward"] for e in events if e["event"] == "eval"]
    assert len(evals) == 4 and evals[-1] > 0.75 and evals[-1] > evals[0], evals
    train = {e["step"]: e for e in events if e["event"] == "train" and "reward" in e}
    assert train[5]["clipped"] == 0 and train[6]["clipped"] > 0 and train[6]["sample_s"] == 0, (train[5], train[6])
    cut = tmp_path / "cut" / "grpo"
    shutil.copytree(whole, cut, ignore=shutil.ignore_patterns("metrics.jsonl"))
    (cut / "checkpoints" / "latest").write_text("step_00000005")
    for later in cut.glob("checkpoints/step_000000[12]*"):
        shutil.rmtree(later)
    run_cli("train", "grpo", *args, "train.max_steps=6", f"run.dir={tmp_path / 'cut'}", cwd=tmp_path, timeout=900)
    step6 = next(e for e in map(json.loads, open(cut / "metrics.jsonl")) if e["event"] == "train" and e["step"] == 6)
    for key in ("reward", "reward_low_ids", "completion_len", "truncated"):
        assert step6[key] == train[6][key], key
    assert step6["loss"] == pytest.approx(train[6]["loss"], abs=1e-3)


def test_the_fused_noise_is_the_eager_hash():
    """fused_noise (gumbel_noise compiled, as rollout draws on a CUDA GPU) gives the eager function's noise at every
    id of a 151,936-id vocabulary (its integers exactly: the same argmax in every row), from a device index."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seeds = torch.tensor([0, 1, 2**40 + 5, -3, 123456789], device="cuda")
    got = fused_noise(seeds, torch.tensor(7, device="cuda"), 151936, seeds.device).cpu()
    want = gumbel_noise(seeds.cpu(), 7, 151936, "cpu")
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
