"""vLLM serves an exported fine-tune unchanged and stops at the end of a turn (GPU machine, vLLM carried as wheels).

    python -m pytest -q -m gpu tests/test_gpu_vllm.py

The GPU machine has no network: vLLM comes as wheels (vllm 0.33.0 is a 336 MB wheel that pins its own torch,
2.14.0, and flashinfer-python; carry them with `pip download vllm -d wheels` on a machine with the same Python, and
`pip install --no-index --find-links wheels vllm` there). Serving the exported sft folder:

    trainbox export runs/sft --format hf --dtype bf16 --out tuned
    vllm serve tuned --dtype bfloat16 --served-model-name sft --generation-config auto --port 8000
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
      -d '{"model": "sft", "messages": [{"role": "user", "content": "what is two plus three"}], "temperature": 0}'

A tiny Llama folder (head size 64, which vLLM's attention kernels take) is fine-tuned with `trainbox train sft`
on short chats, exported with `trainbox export --format hf --dtype bf16`, and served by vLLM's offline engine,
whose chat must end with finish_reason "stop" on <|im_end|> (from generation_config.json's eos_token_id list and
the chat template in tokenizer_config.json), as trainbox's own chat does.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli

pytestmark = pytest.mark.gpu

QUESTIONS = ["what is two plus three", "what is one plus four"]


def test_vllm_serves_the_sft_export_and_stops_at_end_of_turn(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed: carry its wheels to the GPU machine")
    transformers = pytest.importorskip("transformers")
    import hf_tiny

    from trainbox.chat import open_chat

    base = tmp_path / "base"
    tok = hf_tiny.make_tokenizer(base)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(base)
    chats = hf_tiny.make_chat_file(tmp_path / "chat.jsonl", n=96)
    run_cli("train", "sft", f"model.path={base}", f"data.path={chats}", "data.seq_len=64", "run.name=sft",
            f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}", "train.global_batch_size=8",
            "train.micro_batch_size=8", "train.max_steps=200", "optim.lr=3e-3", "optim.warmup_steps=0",
            "train.sample_tokens=0", "monitor.enabled=false")
    out = tmp_path / "tuned"
    run_cli("export", str(tmp_path / "runs" / "sft"), "--format", "hf", "--dtype", "bf16", "--out", str(out))
    end = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert isinstance(end, list) and len(end) == 2

    ours = open_chat(tmp_path / "runs" / "sft", "cuda", temperature=0, max_tokens=24)
    llm = vllm.LLM(model=str(out), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=256,
                   enforce_eager=True)
    params = vllm.SamplingParams(temperature=0, max_tokens=24)
    for q in QUESTIONS:
        ours.reset()
        answer = "".join(ours.turn(q))
        assert ours.last.stopped == "end_of_turn"
        done = llm.chat([{"role": "user", "content": q}], params)[0].outputs[0]
        # bf16 weights may pick other words than our fp32 chat; the turn must end the same way, on <|im_end|>
        assert done.finish_reason == "stop" and len(done.token_ids) < 24, (done, answer)
        assert done.stop_reason in (None, end[1]) and "<|im_end|>" not in done.text, done
