"""LoRA / QLoRA fine-tuning of Hugging Face models, on tiny random HF models built here.

References: the saved base folder (frozen weights), PEFT's own PeftModel.from_pretrained, transformers'
own greedy `generate`, and an uninterrupted run (exact resume).
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from conftest import run_cli  # noqa: E402

from trainbox import checkpoint  # noqa: E402
from trainbox.config import load_config  # noqa: E402
from trainbox.errors import ConfigError  # noqa: E402

STEPS = 12


def lora_args(root: Path, model: Path, name: str, *extra: str) -> list[str]:
    return [f"model.path={model}", f"data.path={root / 'chat.jsonl'}", "data.seq_len=48",
            f"run.dir={root / 'runs'}", f"run.name={name}", f"data.cache_dir={root / 'cache'}",
            "train.global_batch_size=8", "train.micro_batch_size=4", f"train.max_steps={STEPS}",
            "train.checkpoint_every=6", "train.keep_last=3", "train.sample_tokens=0", "monitor.port=0",
            "monitor.log_every=1", "lora.r=4", "lora.alpha=8", "lora.dropout=0.1", "optim.lr=1e-2",
            "optim.warmup_steps=2", "train.threads=1", *extra]


def checkpointing(model: torch.nn.Module) -> bool:
    """Whether transformers checkpoints a layer of `model` (its flag, under either version's name for the property)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def losses(run_dir: Path) -> dict[int, float]:
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if e["event"] == "train"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 12-step LoRA run on a 2-layer Llama; returns (root, model folder, Trainer)."""
    from trainbox.train.loop import Trainer

    root = tmp_path_factory.mktemp("lora")
    model = hf_tiny.make_model(root / "base")
    hf_tiny.make_chat_file(root / "chat.jsonl")
    trainer = Trainer(load_config("lora", lora_args(root, model, "a")))
    trainer.run()
    return root, model, trainer


def test_only_adapters_train_and_are_checkpointed(trained):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, model_dir, trainer = trained
    fresh = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    peft = trainer.model.peft
    base = {k.replace("base_layer.", ""): v for k, v in peft.get_base_model().state_dict().items() if "lora_" not in k}
    assert set(base) == set(fresh)
    for k, v in fresh.items():  # the frozen base is bit-identical to the folder it came from
        assert torch.equal(base[k], v), k
    trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # PEFT starts lora_B at zero: every B moved, i.e. every adapter received gradient
    assert all(p.abs().sum() > 0 for n, p in trainable.items() if "lora_B" in n)
    loss = losses(root / "runs" / "a")
    assert sum(loss[s] for s in (10, 11, 12)) < sum(loss[s] for s in (1, 2, 3)) - 0.1
    ckpt = load_file(str(root / "runs" / "a" / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors"))
    assert set(ckpt) == set(trainable)  # adapters only, never the frozen base
    for n, p in trainable.items():
        assert torch.equal(ckpt[n], p.detach())


def test_resume_reproduces_the_uninterrupted_losses(trained):
    from trainbox.train.loop import train

    root, model_dir, _ = trained
    half = root / "runs" / "a" / "checkpoints" / "step_00000006"
    train(load_config("lora", lora_args(root, model_dir, "b", f"run.resume={half}")))
    a, b = losses(root / "runs" / "a"), losses(root / "runs" / "b")
    assert sorted(b) == list(range(7, STEPS + 1))
    assert [b[s] for s in sorted(b)] == [a[s] for s in sorted(b)]  # bit-identical on CPU


def test_chat_masks_cover_assistant_turns_only(tmp_path, trained):
    from trainbox.data.sft import encode_row, load_hf_tokenizer

    tok = load_hf_tokenizer(str(trained[1]))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus one"},
            {"role": "assistant", "content": "three"}, {"role": "user", "content": "and one plus one"},
            {"role": "assistant", "content": "two"}]
    for template in (None, "chatml"):  # the tokenizer's own jinja template, then the built-in one
        ids, mask = encode_row({"messages": msgs}, tok, template, ["text"], "row 1")
        assert tok.decode(ids) == tok.hf.apply_chat_template(msgs, tokenize=False)
        trained_text = tok.decode([i for i, m in zip(ids, mask) if m])
        assert trained_text == "three<|im_end|>\ntwo<|im_end|>\n"
    text_ids, text_mask = encode_row({"text": "one plus two"}, tok, None, ["text"], "row 2")
    assert text_ids[-1] == tok.eot_id and all(text_mask)


def test_unpacked_examples_get_one_row_each():
    from trainbox.data.packing import ExampleDataset
    from trainbox.data.sft import build_examples

    examples = [([5, 6, 7], [0, 1, 1]), ([8, 9, 10, 11, 12, 13], [0, 0, 1, 1, 1, 1]), ([14, 15], [0, 1])]
    ids, mask, starts, stats = build_examples(examples, seq_len=4)
    b = ExampleDataset(ids, mask, starts, 4, pad_id=0, packed=False).batch([0, 1, 2])
    assert b["x"].tolist() == [[5, 6, 0, 0], [8, 9, 10, 11], [14, 0, 0, 0]]  # truncated to 5 tokens / padded
    assert b["y"].tolist() == [[6, 7, 0, 0], [9, 10, 11, 12], [15, 0, 0, 0]]
    # loss only on each example's own trained tokens: never on padding or another example's tokens
    assert b["loss_mask"].tolist() == [[True, True, False, False], [False, True, True, True],
                                       [True, False, False, False]]
    assert stats == {"examples": 3, "truncated": 1, "truncated_tokens": 1, "dropped": 0, "trained_tokens": 6}


def test_chat_data_without_template_names_the_fix(tmp_path):
    from trainbox.data.sft import encode_row, load_hf_tokenizer
    from trainbox.errors import DataError

    hf_tiny.make_tokenizer(tmp_path, chat_template=None)
    tok = load_hf_tokenizer(str(tmp_path))
    with pytest.raises(DataError, match="data.chat_template=chatml"):
        encode_row({"messages": [{"role": "user", "content": "hi"}]}, tok, None, ["text"], "x.jsonl:1")


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_adapter_and_merge_match_base_plus_adapter(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainbox.generate import sample
    from trainbox.model.hf.hf import export_lora_hf
    from trainbox.model.load import load_for_inference

    root, model_dir, _ = trained
    ours, tok, _ = load_for_inference(root / "runs" / "a")  # base + adapter from the checkpoint
    ours.eval()
    ids = torch.tensor([tok.encode("what is two plus three")])
    want = _logits(ours.peft, ids)

    export_lora_hf(root / "runs" / "a", tmp_path / "adapter")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter").eval()
    assert torch.allclose(_logits(peft, ids), want, atol=1e-6)
    base_only = _logits(AutoModelForCausalLM.from_pretrained(model_dir), ids)
    assert not torch.allclose(base_only, want, atol=1e-3)  # the adapter does change the function

    out = run_cli("export", str(root / "runs" / "a"), "--format", "hf", "--merge", "--out", str(tmp_path / "merged"))
    assert "merged model (float32)" in out.stdout
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in k for k in merged.state_dict())
    assert torch.allclose(_logits(merged, ids), want, atol=1e-5)

    # generate: our sampler over base + adapter (HF KV cache) equals transformers' greedy decode
    text = sample(ours, tok, "what is two plus three", max_tokens=10, temperature=0, stop_at_eot=False)
    ref = merged.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=tok.eot_id)
    assert text == tok.decode(ref[0, ids.size(1):].tolist())


def test_building_and_generating_use_the_names_the_installed_transformers_has(trained):
    """transformers 5.x renamed the KV cache's argument (`cache`) and checkpointing (`activation_checkpointing_enable`)
    and drops the old names in a later release: a LoRA model built with checkpointing, then sampled with its cache,
    asks for nothing deprecated (a FutureWarning here), and samples what it sampled before."""
    from trainbox.generate import sample
    from trainbox.model.load import load_for_inference

    root, _, _ = trained
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        ours, tok, _ = load_for_inference(root / "runs" / "a")
        assert checkpointing(ours.peft.get_base_model())
        text = sample(ours.eval(), tok, "what is two plus three", max_tokens=10, temperature=0, stop_at_eot=False)
    ids = torch.tensor([tok.encode("what is two plus three")])
    with torch.no_grad():   # the same greedy tokens from full forwards, no cache
        for _ in range(10):
            ids = torch.cat([ids, ours.peft(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert text == tok.decode(ids[0, -10:].tolist())


def test_merge_into_quantized_base_needs_force(trained, tmp_path):
    """The refusal comes from the CLI (exit 2, names --force); --force merges into a bf16 base."""
    root, _, _ = trained
    run = tmp_path / "qrun"
    shutil.copytree(root / "runs" / "a" / "checkpoints" / f"step_{STEPS:08d}", run / "checkpoints" / "step_00000012")
    meta = run / "checkpoints" / "step_00000012" / "trainer.json"
    state = json.loads(meta.read_text())
    state["config"]["quant"]["load_in_4bit"] = True  # as if trained with QLoRA
    meta.write_text(json.dumps(state))
    checkpoint.write_manifest(meta.parent, STEPS)   # the edited files are the checkpoint now
    refused = run_cli("export", str(run), "--merge", "--out", str(tmp_path / "m"), check=False)
    assert refused.returncode == 2 and "4-bit" in refused.stderr and "--force" in refused.stderr
    assert not (tmp_path / "m").exists()
    from trainbox.model.hf.hf import export_lora_hf
    assert export_lora_hf(run, tmp_path / "m", merge=True, force=True)["dtype"] == "bfloat16"
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_qlora_without_cuda_fails_before_loading(trained, tmp_path):
    root, model_dir, _ = trained
    args = lora_args(root, model_dir, "q", "quant.load_in_4bit=true")
    proc = run_cli("train", "lora", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "quant.load_in_4bit" in proc.stderr and "CUDA" in proc.stderr
    assert "bitsandbytes" in proc.stderr or __import__("importlib").util.find_spec("bitsandbytes")
    assert not (root / "runs" / "q" / "checkpoints").exists()
    from trainbox.model.hf.model import build_hf  # the builder refuses too, before reading any weights
    with pytest.raises(ConfigError, match="CUDA"):
        build_hf(load_config("lora", [*args[:1], "model.path=/nonexistent", "quant.load_in_8bit=true"]))


TA_JSON = {"model_name": "MODEL", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
           "num_train_epochs": 1, "max_steps": 3, "learning_rate": 3e-3, "max_seq_length": 48, "lora_r": 4,
           "lora_alpha": 8, "lora_dropout": 0.0, "use_4bit": False, "logging_steps": 1, "save_steps": 3,
           "output_dir": "OUT"}


def test_training_arguments_json_is_mapped_printed_and_trains(trained, tmp_path):
    root, model_dir, _ = trained
    cfg_file = tmp_path / "sft.json"
    cfg_file.write_text(json.dumps({**TA_JSON, "model_name": str(model_dir),
                                    "output_dir": str(tmp_path / "out" / "ta")}))
    cfg = load_config(str(cfg_file))
    assert (cfg.model.family, cfg.model.path) == ("hf", str(model_dir))
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.max_steps) == (4, 8, 3)
    assert (cfg.optim.lr, cfg.data.seq_len, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout) == (3e-3, 48, 4, 8.0, 0.0)
    assert (cfg.monitor.log_every, cfg.train.checkpoint_every, cfg.quant.load_in_4bit) == (1, 3, False)
    assert cfg.run_dir == tmp_path / "out" / "ta"
    # the keys the file leaves out mean what they mean in TrainingArguments
    assert (cfg.optim.betas, cfg.optim.weight_decay, cfg.optim.schedule, cfg.optim.min_lr_ratio) == (
        (0.9, 0.999), 0.0, "linear", 0.0)
    out = run_cli("train", str(cfg_file), f"data.path={root / 'chat.jsonl'}", f"data.cache_dir={root / 'cache'}",
                  "monitor.port=0", "train.sample_tokens=0", cwd=tmp_path)
    assert "per_device_train_batch_size = 4" in out.stderr and "-> train.micro_batch_size = 4" in out.stderr
    assert "gradient_accumulation_steps = 2" in out.stderr and "-> train.global_batch_size = 8" in out.stderr
    assert sorted(losses(tmp_path / "out" / "ta")) == [1, 2, 3]


def test_training_arguments_unknown_key_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**TA_JSON, "learning_rat": 1e-4}))
    proc = run_cli("config", "validate", str(bad), check=False)
    assert proc.returncode == 2
    assert "unknown TrainingArguments key 'learning_rat'" in proc.stderr and "learning_rate" in proc.stderr


def test_end_to_end_from_a_pretrained_trainbox_gpt(tmp_path, tiny):
    """Pretrain a tiny trainbox GPT, export it to HF, LoRA it, merge, generate."""
    from transformers import AutoModelForCausalLM

    from trainbox.generate import sample
    from trainbox.model.gpt.hf import export_hf as exporter
    from trainbox.model.hf.hf import export_lora_hf
    from trainbox.model.load import load_for_inference
    from trainbox.train.loop import train

    # positions must cover the fine-tuning windows (data.seq_len=48 in lora_args)
    train(load_config("tiny", [*tiny, "data.seq_len=64", "train.max_steps=4", "train.sample_tokens=0",
                               "train.eval_every=0"]))
    exporter(tmp_path / "runs" / "tiny", tmp_path / "gpt-hf")
    hf_tiny.make_chat_file(tmp_path / "chat.jsonl")
    root = tmp_path
    train(load_config("lora", lora_args(root, tmp_path / "gpt-hf", "ft", "data.chat_template=chatml")))
    export_lora_hf(root / "runs" / "ft", tmp_path / "merged", merge=True)
    ours, tok, _ = load_for_inference(root / "runs" / "ft")
    ours.eval()
    ids = torch.tensor([tok.encode("ROMEO:")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert torch.allclose(_logits(merged, ids), _logits(ours.peft, ids), atol=1e-5)
    assert sample(ours, tok, "ROMEO:", max_tokens=5, temperature=0, stop_at_eot=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["", "quant.load_in_4bit=true", "quant.load_in_8bit=true"])
def test_lora_and_qlora_train_on_gpu(tmp_path, mode):
    pytest.importorskip("bitsandbytes") if mode else None
    from trainbox.train.loop import Trainer

    model = hf_tiny.make_model(tmp_path / "base")
    hf_tiny.make_chat_file(tmp_path / "chat.jsonl")
    trainer = Trainer(load_config("lora", lora_args(tmp_path, model, "g", *([mode] if mode else []))))
    result = trainer.run()
    loss = losses(tmp_path / "runs" / "g")
    assert {1, 2, 3, 10, 11, 12} <= loss.keys(), (result, loss)
    assert sum(loss[s] for s in (10, 11, 12)) < sum(loss[s] for s in (1, 2, 3))
    if mode:
        assert trainer.model.quantized



def test_training_runs_in_train_mode_with_gradient_checkpointing(tmp_path):
    """from_pretrained returns models in eval mode; unless the loop switches to train mode, LoRA dropout
    and gradient checkpointing (both gated on `module.training` in transformers) silently do nothing,
    which on the GPU cost 4x the activation memory of a Trainer run."""
    from trainbox.train.loop import Trainer

    model = hf_tiny.make_model(tmp_path / "base")
    hf_tiny.make_chat_file(tmp_path / "chat.jsonl")
    trainer = Trainer(load_config("lora", lora_args(tmp_path, model, "m", "train.max_steps=1", "train.eval_every=0",
                                                    "train.checkpoint_every=0")))
    trainer.run()
    base = trainer.model.peft.get_base_model()
    assert checkpointing(base)
    assert base.training and all(m.training for m in base.modules())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fused_loss_equals_the_logits_path_in_loss_and_adapter_gradients(tmp_path, arch):
    """model.fused_loss on a Hugging Face model: the decoder's hidden states and the head's weight through
    kernels/fused_ce.py give the logits path's per-token losses and LoRA gradients (fp32, CPU); a tied head
    (gpt2) and an untied one (llama)."""
    from trainbox.model.hf.model import build_hf

    folder = hf_tiny.make_model(tmp_path / "base", arch)
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 300, (2, 2, 24), generator=g)
    mask = torch.rand(2, 24, generator=g) > 0.3
    runs = {}
    for fused in (False, True):
        cfg = load_config("lora", [f"model.path={folder}", f"model.fused_loss={str(fused).lower()}",
                                   "lora.r=4", "lora.alpha=8", "lora.dropout=0"])
        torch.manual_seed(1)
        model = build_hf(cfg)
        assert model.fused_loss is fused
        for n, p in model.named_parameters():   # B starts at zero: move it so the adapters change the logits
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(len(n)))
        loss = model(idx, targets, loss_mask=mask, reduction="none").loss
        loss.sum().backward()
        runs[fused] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    (a, ga), (b, gb) = runs[False], runs[True]
    assert (a[~mask] == 0).all() and (b[~mask] == 0).all()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("quantized", [False, True])
def test_compiled_4bit_model_lets_the_partitioner_recompute_custom_ops(tmp_path, monkeypatch, quantized):
    """Compiled QLoRA: bitsandbytes' 4-bit matmuls are custom ops off the partitioner's recompute allow-list, so
    their outputs were saved for the backward despite gradient checkpointing (a 0.5B model's peak 6.80 GiB against
    2.48 with recompute allowed, H200, benchmarks/records/2026-11-29-h200-lora-0.5b-speed-2.json). The run's forward
    of a 4-bit model, where graphs are compiled and partitioned, lifts the ban; outside it, and for any other model,
    torch's default holds. bitsandbytes needs a GPU, so here the loop builds the tiny model as a quantized one is
    wrapped (HFCausalLM(quantized=True)), and torch.compile is left out (Inductor on a CPU takes long): what is
    checked is the setting the compiler would see inside the forward."""
    import torch._functorch.config as functorch_config

    import trainbox.train.build as build
    from trainbox.config.layout import decide_layout
    from trainbox.model.hf.model import HFCausalLM
    from trainbox.parallel.distributed import Dist

    real = build.build_model

    def as_quantized(*args, **kwargs):
        built = real(*args, **kwargs)
        return HFCausalLM(built.peft, built.path, quantized=quantized)

    monkeypatch.setattr(functorch_config, "ban_recompute_not_in_allowlist", True)   # torch's default, restored after
    monkeypatch.setattr(build, "build_model", as_quantized)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    model = hf_tiny.make_model(tmp_path / "base")
    hf_tiny.make_chat_file(tmp_path / "chat.jsonl")
    cfg = load_config("lora", lora_args(tmp_path, model, "q", "train.max_steps=1", "train.compile=true"))
    built = build.build_model_side(cfg, decide_layout(cfg, 1, "cpu"), 0, torch.device("cpu"), Dist(),
                                   init_weights=True)
    assert built.model.quantized is quantized
    seen = []
    built.model.register_forward_pre_hook(lambda *_: seen.append(functorch_config.ban_recompute_not_in_allowlist))
    ids = torch.randint(0, 300, (2, 16))
    loss = built.parallel.forward(ids, ids, reduction="sum").loss
    assert seen == [not quantized] and torch.isfinite(loss)
    assert functorch_config.ban_recompute_not_in_allowlist is True


@torch.library.custom_op("trainbox_test::widen", mutates_args=())
def _widen(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x (N, C) times a weight stored small (int8, (F, C)) and made large inside the op, as a 4-bit matmul does."""
    return x @ (q.float() * 0.5).t()


@_widen.register_fake
def _(x, q):
    return x.new_empty(x.shape[0], q.shape[0])


@pytest.mark.parametrize("recompute", [False, True])
def test_recomputing_custom_ops_saves_the_small_inputs_not_the_large_product(recompute):
    """The mechanism behind the test above, compiled for real (AOTAutograd's min-cut partitioner, without Inductor's
    code generation): by default the partitioner saves the custom op's large output for the backward; inside the
    run's forward wrapped by `recomputing_custom_ops` it saves the op's small inputs and runs the op again in the
    backward. The gradient is the same either way."""
    import torch._functorch.config as functorch_config

    from trainbox.train.build import recomputing_custom_ops

    torch.manual_seed(0)
    q = torch.randint(-8, 8, (256, 16), dtype=torch.int8)
    w = torch.randn(256, requires_grad=True)

    def step(x):
        return (torch.relu(_widen(x, q)) * w).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager_decomp_partition", fullgraph=True)
    forward = recomputing_custom_ops(compiled) if recompute else compiled
    x, saved = torch.randn(32, 16), []
    with functorch_config.patch(ban_recompute_not_in_allowlist=True):   # torch's default
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            loss = forward(x)
        loss.backward()
    torch._dynamo.reset()
    assert sorted(saved) == ([(32, 16), (256, 16)] if recompute else [(32, 256)])
    want = torch.relu(x @ (q.float() * 0.5).t()).sum(0)
    torch.testing.assert_close(w.grad, want)
