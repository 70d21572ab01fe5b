"""Full fine-tuning (recipe sft) of a Hugging Face Llama folder under FSDP on two GPUs, and of a Qwen3 and a Mistral
folder on one, compiled in bf16: the assistant-only loss falls, and the run exports a folder that transformers loads
and that computes our logits.

The folder is a Llama 3.2 1B-shaped model (width 2048, 32 query and 8 key/value heads, SwiGLU 8192, Llama 3
RoPE scaling, untied head) with 4 layers and random weights, and a small offline BPE tokenizer with a ChatML
template (tests/hf_tiny.py): nothing is downloaded. The Qwen3 folder is Qwen3-0.6B-shaped (width 1024, 16 query
and 8 key/value heads of 128, wider than width / heads, per-head q/k norms, SwiGLU 3072, tied head) with 4 layers.
The Mistral folder is Mistral-7B-v0.3-shaped (width 4096, 32 query and 8 key/value heads, SwiGLU 14336, no sliding
window, untied head) with 4 layers, and a SentencePiece kind of tokenizer (byte fallback) with Mistral's template.
The chats are arithmetic (the answer is a function of the question), so the loss can fall within a few dozen steps.

    python -m pytest -q -m gpu tests/test_gpu_sft.py          # Qwen3 and Mistral on 1 GPU, the FSDP case on 2
"""
from __future__ import annotations

import json
import statistics

import hf_tiny
import pytest
import torch
from conftest import run_cli

# slow: a fine-tune under fsdp and an export that transformers loads, minutes on 2 GPUs
pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
             rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}, tie_word_embeddings=False)


QWEN3 = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
             rope_theta=1000000.0, tie_word_embeddings=True)


MISTRAL = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
               sliding_window=None, tie_word_embeddings=False)


def hf_folder(folder, arch: str = "llama", vocab: int = 512):
    transformers = pytest.importorskip("transformers", reason="trainbox[hf] (transformers) is needed")
    tok = hf_tiny.make_sentencepiece_tokenizer(folder) if arch == "mistral" else hf_tiny.make_tokenizer(folder, vocab)
    torch.manual_seed(0)
    config, model, shape = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, SHAPE),
                            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, QWEN3),
                            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, MISTRAL)}[arch]
    bos = tok.bos_token_id if arch == "mistral" else tok.eos_token_id
    model(config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=bos, **shape)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch, nproc", [("llama", 2), ("qwen3", 1), ("mistral", 1)])
def test_full_fine_tuning_on_gpus_exports_what_transformers_loads(tmp_path, arch, nproc):
    transformers = pytest.importorskip("transformers", reason="trainbox[hf] (transformers) is needed")
    from trainbox.cli import main
    from trainbox.model.load import load_for_inference

    if torch.cuda.device_count() < nproc:
        pytest.skip("needs a CUDA GPU" if nproc == 1 else f"needs {nproc} CUDA GPUs")
    base = hf_folder(tmp_path / "base", arch)
    chats = hf_tiny.make_chat_file(tmp_path / "chat.jsonl", n=4000)
    layout = ["--nproc", "2", "sft", "train.parallel=fsdp"] if nproc == 2 else ["sft"]
    run_cli("train", *layout, f"model.path={base}", f"data.path={chats}",
            "data.seq_len=512", "train.global_batch_size=16", "train.micro_batch_size=4", "train.max_steps=40",
            "optim.lr=3e-4", "optim.warmup_steps=5", "train.dtype=bf16", "train.compile=true",
            "train.checkpoint_every=20", "train.sample_tokens=0", "monitor.enabled=false", "monitor.log_every=1",
            f"run.dir={tmp_path / 'runs'}", "run.name=sft", f"data.cache_dir={tmp_path / 'cache'}", timeout=1200)
    run = tmp_path / "runs" / "sft"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("event") == "train"]
    assert len(losses) == 40, losses
    assert statistics.mean(losses[-5:]) < statistics.mean(losses[:5]) - 0.5, losses

    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "tuned")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned", dtype=torch.float32)
    assert type(theirs).__name__ == {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                     "mistral": "MistralForCausalLM"}[arch]
    ours, _, _ = load_for_inference(run, device="cuda")
    theirs = theirs.cuda().eval()
    idx = torch.randint(0, theirs.config.vocab_size, (2, 64), device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        want = theirs(idx).logits
        got = ours.lm_head(ours.hidden(idx))
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    fresh = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).cuda()
    with torch.no_grad():   # and the export is the tuned model, not the folder it started from
        assert (fresh(idx).logits - want).abs().max() > 10 * (got - want).abs().max()
