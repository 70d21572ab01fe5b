"""A reward model with QLoRA on a CUDA GPU: `trainbox train reward model.family=hf quant.load_in_4bit=true` on a tiny
Llama folder (tests/hf_tiny.py), bf16, the score head beside the 4-bit base: the validation accuracy rises, and
`export --merge --force` (the adapters folded into the base reloaded in bf16) writes a LlamaForSequenceClassification
that transformers loads and that still ranks the validation pairs as the run did.

    python -m pytest -q -m gpu tests/test_gpu_reward.py
"""
from __future__ import annotations

import json

import hf_tiny
import pytest
import torch
from conftest import run_cli

pytestmark = pytest.mark.gpu


def test_qlora_reward_model_trains_on_a_gpu_and_exports_merged(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("bitsandbytes", reason="trainbox[quant] (bitsandbytes) is needed")
    transformers = pytest.importorskip("transformers", reason="trainbox[finetune] is needed")
    base = hf_tiny.make_model(tmp_path / "base", seed=3)
    train = hf_tiny.make_preference_file(tmp_path / "train.jsonl", n=256, seed=1)
    val = hf_tiny.make_preference_file(tmp_path / "val.jsonl", n=32, seed=2)
    run_cli("train", "reward", "model.family=hf", f"model.path={base}", "quant.load_in_4bit=true",
            f"data.path={train}", f"data.val_path={val}", "data.seq_len=64", "train.global_batch_size=16",
            "train.max_steps=40", "train.eval_every=20", "optim.lr=2e-3", "optim.warmup_steps=4",
            f"run.dir={tmp_path / 'runs'}", "monitor.port=0", "monitor.plot=false",
            f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path, timeout=900)
    run = tmp_path / "runs" / "reward"
    events = [json.loads(line) for line in open(run / "metrics.jsonl")]
    start = next(e for e in events if e["event"] == "start")
    assert start["layout"]["device"].startswith("cuda"), start["layout"]
    evals = [e for e in events if e["event"] == "eval"]
    assert len(evals) == 2 and evals[-1]["val_reward_accuracy"] >= 0.8, evals

    run_cli("export", str(run), "--format", "hf", "--merge", "--force", "--out", str(tmp_path / "rm"))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32)
    assert model.config.architectures == ["LlamaForSequenceClassification"]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "rm")
    rows = [json.loads(line) for line in open(val)]
    right = 0
    for row in rows:
        texts = [tok.apply_chat_template(row["prompt"] + row[k], tokenize=False) for k in ("chosen", "rejected")]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            chosen, rejected = model.eval()(**enc).logits.squeeze(-1).tolist()
        right += chosen > rejected
    assert right / len(rows) >= 0.8, right   # the merged bf16 model ranks as the 4-bit one learned to
