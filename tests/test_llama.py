"""model.family=llama against Hugging Face's LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM (transformers
is the reference): logits and gradients after import, Llama 3 RoPE scaling, grouped-query attention, the KV cache,
export loaded back by transformers, a short training run, and full fine-tuning of a Qwen2 folder on chat
data (`trainbox train sft`) with the loss on assistant tokens only."""
from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch
from conftest import run_cli

from trainbox.cli import main
from trainbox.config import build_config, load_config
from trainbox.errors import ConfigError
from trainbox.model.build import build_model, resolve_model
from trainbox.model.llama.config import RopeScalingSection
from trainbox.model.llama.hf import gguf_model, resolve_from_folder, write_hf
from trainbox.model.load import load_init_weights

transformers = pytest.importorskip("transformers")
import hf_tiny  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def hf_model(arch: str, vocab: int = 100, seed: int = 0, **kw):
    """A 2-layer model with 4 query heads sharing 2 key/value heads; every weight random (norms and biases too).
    llama: Llama 3 RoPE scaling over an original 16-token context, untied head; qwen2: q/k/v biases, tied; qwen3:
    q/k norms, heads of 16 (twice hidden / heads), tied; mistral: heads of 16 (as Mistral Nemo's are wider than
    hidden / heads), no sliding window (Mistral 7B v0.2 on), untied."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, **kw)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, rope_scaling=LLAMA3, tie_word_embeddings=False, **shape)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**{"rope_theta": 1e6, "sliding_window": None, "head_dim": 16,
                                            "tie_word_embeddings": False, **shape})
        model = transformers.MistralForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=1000.0, tie_word_embeddings=True, **shape)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(rope_theta=1000.0, tie_word_embeddings=True, head_dim=16, **shape)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def ours_from(folder, **model):
    """Our model as `model.path=FOLDER` builds it: the folder's shape, then its weights."""
    run = resolve_from_folder(build_config({"model": {"family": "llama", "path": str(folder), **model}}))
    m = build_model(run.model, run.model.vocab_size, 64)
    load_init_weights(run.run.init_from, m, run.model)
    return m.eval(), run


def logits(model, idx: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.hidden(idx))


def stop_after(n: int):
    """A Trainer whose stop flag is raised after step `n`, as the SIGTERM handler raises it."""
    from trainbox.train.loop import Trainer

    class StopAfter(Trainer):
        def train_step(self, step: int):
            out = super().train_step(step)
            if step + 1 == n:
                self.stop.signum = signal.SIGTERM
            return out
    return StopAfter


def train_losses(run_dir) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["event"] == "train"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_import_matches_hf_and_export_loads_back(tmp_path, arch):
    hf = hf_model(arch)
    hf.save_pretrained(tmp_path / "in", **({"max_shard_size": "20KB"} if arch == "qwen2" else {}))
    assert (tmp_path / "in" / "model.safetensors.index.json").is_file() == (arch == "qwen2")   # sharded: qwen2
    ours, run = ours_from(tmp_path / "in")
    lc = run.model.llama
    assert (lc.qkv_bias, lc.qk_norm, lc.tie_embeddings) == {
        "llama": (False, False, False), "qwen2": (True, False, True), "qwen3": (False, True, True),
        "mistral": (False, False, False)}[arch]
    assert run.model.head_dim == (16 if arch in ("qwen3", "mistral") else 8)
    idx = torch.randint(0, 100, (2, 40))   # 40 positions > 16: llama3 scaling's stretched frequencies matter
    with torch.no_grad():
        want = hf(idx).logits
        assert (logits(ours, idx) - want).abs().max() < 1e-4
    hf(idx, labels=idx).loss.backward()    # HF shifts the labels itself
    ours(idx[:, :-1], idx[:, 1:]).loss.backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert len(hf_grads) == len(dict(ours.named_parameters()))

    write_hf(ours, run.model, (tmp_path / "out").mkdir() or tmp_path / "out", eot_id=0, block=64)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[arch]
    if arch == "mistral":
        assert back.config.sliding_window is None
    with torch.no_grad():
        assert (back(idx).logits - want).abs().max() < 1e-4
    if arch == "llama":   # GGUF's RoPE factors from transformers' config.json (rope_parameters) and from ours
        theirs, mine = gguf_model(tmp_path / "in").extra, gguf_model(tmp_path / "out").extra
        assert torch.equal(theirs["rope_freqs.weight"], mine["rope_freqs.weight"])
        assert (mine["rope_freqs.weight"] > 1).any()
    again, _ = ours_from(tmp_path / "out")   # our config.json (rope_theta + rope_scaling) read back
    with torch.no_grad():
        assert (logits(again, idx) - want).abs().max() < 1e-4
    if arch == "llama":   # the scaling is what makes the logits agree: plain RoPE does not
        ours.cfg = ours.cfg.model_copy(update={"llama": ours.cfg.llama.model_copy(
            update={"rope_scaling": RopeScalingSection()})})
        with torch.no_grad():
            assert (logits(ours, idx) - want).abs().max() > 1e-3


def test_kv_cache_decoding_equals_the_full_forward():
    torch.manual_seed(0)
    cfg = build_config({"model": {"family": "llama", "n_layer": 2, "n_head": 4, "n_embd": 32,
                                  "llama": {"n_kv_head": 1, "intermediate_size": 64}}}).model
    model = build_model(cfg, 64, 32).eval()
    idx = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        full = logits(model, idx)
        caches = model.make_caches(2, 12, torch.float32, "cpu")
        steps = [model(idx[:, :5], caches=caches, pos=0).logits]   # prefill, then one token at a time
        steps += [model(idx[:, t:t + 1], caches=caches, pos=t).logits for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 4:], rtol=1e-5, atol=1e-5)


def test_folder_errors_name_the_setting(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "llama")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)).save_pretrained(
        tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="'gpt2' model; model.family=llama supports model_type llama .* qwen2"):
        ours_from(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="model.n_layer=3 but .* gives 2") as e:
        ours_from(tmp_path / "llama", n_layer=3)
    assert "leave model.n_layer unset" in e.value.hint
    run = build_config({"model": {"family": "llama", "n_layer": 2, "n_head": 4, "n_embd": 32,
                                  "llama": {"n_kv_head": 4, "intermediate_size": 48}}})
    with pytest.raises(ConfigError, match="model.llama.n_kv_head=4 but run.init_from=.* has 2"):
        load_init_weights(tmp_path / "llama", build_model(run.model, 128, 32), run.model)
    sliding = hf_model("qwen3", layer_types=["full_attention", "sliding_attention"], use_sliding_window=True,
                       sliding_window=8)
    sliding.config.use_sliding_window = False   # the layer types alone name the windowed layers
    sliding.save_pretrained(tmp_path / "sliding")
    with pytest.raises(ConfigError, match=r"layer_types \['full_attention', 'sliding_attention'\] \(ours: "):
        ours_from(tmp_path / "sliding")
    hf_model("mistral", sliding_window=32).save_pretrained(tmp_path / "window")   # Mistral 7B v0.1's kind
    with pytest.raises(ConfigError, match=r"has sliding_window=32 \(each position attends to the last 32 only; ours: "
                                          r"the whole context of max_position_embeddings=256\)") as e:
        ours_from(tmp_path / "window")
    assert e.value.hint.startswith("LoRA runs it through transformers: add model.family=hf to this command")
    assert f"trainbox train lora model.path={tmp_path / 'window'}" in e.value.hint
    hf_model("mistral", sliding_window=256).save_pretrained(tmp_path / "wide")   # a window that never binds
    assert ours_from(tmp_path / "wide")[1].model.llama.rope_theta == 1e6
    with pytest.raises(ConfigError, match="qk_norm and model.llama.qkv_bias together match no Hugging Face"):
        build_config({"model": {"family": "llama", "llama": {"qk_norm": True, "qkv_bias": True}}})
    with pytest.raises(ConfigError, match="sft needs model.path"):
        resolve_model(load_config("sft"))
    with pytest.raises(ConfigError, match="'model.nope' is not a config key"):
        build_config({"required": ["model.nope"]})


def test_a_vocabulary_too_small_for_the_tokenizer_is_said_as_the_user_set_it(tmp_path, data_cache, capsys):
    """model.path with another data.tokenizer of more ids than the folder's vocab_size: the refusal names the
    folder's vocab_size, never tells to drop a model.vocab_size the user did not give, nor one whose default (the
    folder's) has too few ids too; the fix it names (model.vocab_size=NEED) trains. A from-scratch run's own
    model.vocab_size is still the one to drop."""
    base = hf_tiny.make_model(tmp_path / "base", "llama")
    need = len(hf_tiny.make_tokenizer(tmp_path / "bigger", vocab_size=400))   # more ids than base's 320
    chats = hf_tiny.make_chat_file(tmp_path / "chat.jsonl", n=16)
    args = ["train", "sft", f"model.path={base}", f"data.path={chats}", f"data.tokenizer={tmp_path / 'bigger'}",
            "data.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=4", "train.max_steps=1",
            "train.sample_tokens=0", "monitor.enabled=false", "train.activation_checkpointing=none",
            "train.threads=1", f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={data_cache}"]

    def refused(argv: list[str]) -> str:
        capsys.readouterr()
        assert main(argv) != 0
        return capsys.readouterr().err

    unset, given = refused(args), refused([*args, "model.vocab_size=330"])
    assert f"the model's 320 ids (model.path={base}'s vocab_size) are fewer than the {need} ids of the tokenizer" \
        in unset, unset
    assert f"model.vocab_size=330 is smaller than the {need} ids" in given, given
    for said in (unset, given):
        assert "drop model.vocab_size" not in said and f"set model.vocab_size to at least {need}" in said, said
        assert f"drop data.tokenizer to use model.path={base}'s own tokenizer" in said, said
    assert f"(without it, model.path={base}'s vocab_size: 320, fewer too)" in given
    assert main([*args, f"model.vocab_size={need}", "run.name=wider"]) == 0   # the fix named: the folder's rows
    scratch = refused(["config", "validate", "tiny", "model.vocab_size=64"])
    assert "model.vocab_size=64 is smaller" in scratch and "drop model.vocab_size (the default is 2,048" in scratch, \
        scratch


def test_recipes_have_the_llama_shapes():
    """Llama 3.2 1B and Llama 3.1 8B have 1,235,814,400 and 8,030,261,248 parameters with Llama 3's vocabulary."""
    for recipe, count in (("llama-1b", 1_235_814_400), ("llama-8b", 8_030_261_248)):
        cfg = load_config(recipe)
        assert cfg.requires_gpu and cfg.data.seq_len == 8192 and cfg.train.compile
        assert cfg.train.activation_checkpointing == "selective"
        with torch.device("meta"):
            model = build_model(cfg.model, 128_256, cfg.data.seq_len)
        assert model.num_params() == count
        attention = 12 * cfg.model.n_layer * cfg.model.n_embd * 8192
        assert model.flops_per_token(8192) == 6 * (count - 128_256 * cfg.model.n_embd) + attention


def test_trains_generates_and_exports(tiny, tmp_path, capsys):
    from trainbox.data.tokenizer import get_tokenizer
    from trainbox.model.load import load_for_inference
    from trainbox.train.loop import train

    cfg = load_config(None, [*tiny, "model.family=llama", "model.n_head=4", "model.llama.n_kv_head=2",
                             "model.llama.intermediate_size=64", "model.llama.rope_theta=10000", "optim.lr=3e-3",
                             "train.max_steps=24", "train.eval_every=0", "monitor.enabled=false", "run.name=llama",
                             "train.activation_checkpointing=selective", "train.threads=1"])
    result = train(cfg)
    loss = train_losses(cfg.run_dir)
    assert len(loss) == 24 and sum(loss[-4:]) < sum(loss[:4]) - 1.0
    assert result["sample"] is not None and (cfg.run_dir / "samples.txt").is_file()
    capsys.readouterr()
    assert main(["generate", str(cfg.run_dir), "--prompt", "ROMEO:", "--max-tokens", "12", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:\n")

    assert main(["export", str(cfg.run_dir), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ours, tok, _ = load_for_inference(cfg.run_dir)
    idx = torch.randint(0, tok.vocab_size, (2, 32))
    with torch.no_grad():
        assert (hf(idx).logits - logits(ours, idx)).abs().max() < 1e-4
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    line = "ROMEO:\nWhat light through yonder window breaks?"
    assert hf_tok(line)["input_ids"] == get_tokenizer("embedded:shakespeare-bpe").encode(line)


def test_a_gpt2_folder_in_a_dpo_run_is_refused_with_the_key_that_runs_it(tmp_path):
    """The dpo recipe is the llama family's: a GPT-2 folder is refused with the hint to add model.family=hf, and
    with it the same command resolves (LoRA through transformers)."""
    from trainbox.model.build import resolve_model
    folder = hf_tiny.make_model(tmp_path / "gpt2", "gpt2")
    with pytest.raises(ConfigError, match="holds a 'gpt2' model") as e:
        resolve_model(load_config("dpo", [f"model.path={folder}"]))
    assert "add model.family=hf to this command" in e.value.hint
    assert resolve_model(load_config("dpo", [f"model.path={folder}", "model.family=hf"])).model.family == "hf"


def test_export_of_a_gpt2_tokenized_run_writes_gpt2s_tokenizer_wherever_it_runs(tmp_path):
    """data.tokenizer=gpt2 is the built-in GPT-2 tokenizer in every path: an export run next to a folder named
    gpt2 (a Hugging Face tokenizer of its own) still writes GPT-2's, which encodes as the run trained."""
    from trainbox.data.tokenizer import get_tokenizer
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("the king and the queen of the night\n" * 200)
    run_cli("prepare", "c", "--out", "data/c", "--quiet", cwd=tmp_path)
    run_cli("train", "tiny", "data.path=data/c", "data.tokenizer=gpt2", "model.family=llama", "model.n_layer=1",
            "model.n_head=2", "model.n_embd=32", "model.llama.n_kv_head=1", "model.llama.intermediate_size=64",
            "data.seq_len=32", "train.max_steps=1", "train.global_batch_size=2", "train.micro_batch_size=2",
            "train.sample_tokens=0", "train.eval_every=0", "monitor.port=0", "monitor.plot=false", "run.name=ll",
            cwd=tmp_path)
    hf_tiny.make_tokenizer(tmp_path / "gpt2")   # another tokenizer, in a folder named as the built-in one
    run_cli("export", "runs/ll", "--format", "hf", "--out", "ll-hf", cwd=tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "ll-hf")
    line = "the king and the queen"
    assert theirs(line)["input_ids"] == get_tokenizer("gpt2").encode(line) and len(theirs) == 50257


def test_sft_fine_tunes_every_weight_of_a_qwen2_folder(tmp_path, capsys):
    """`trainbox train sft model.path=FOLDER data.path=chat.jsonl`, then export: transformers loads the result."""
    from trainbox.model.load import load_for_inference
    from trainbox.train.loop import Trainer

    base = tmp_path / "base"
    tok = hf_tiny.make_tokenizer(base)
    hf = hf_model("qwen2", vocab=len(tok))
    hf.config.eos_token_id = tok.eos_token_id
    hf.save_pretrained(base)
    chats = hf_tiny.make_chat_file(tmp_path / "chat.jsonl", n=24)
    def args(name: str) -> list[str]:
        return [f"model.path={base}", f"data.path={chats}", "data.seq_len=48", f"run.name={name}",
                f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",
                "train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=4",
                "optim.lr=1e-3", "optim.warmup_steps=0", "train.sample_tokens=0",
                "monitor.enabled=false", "train.threads=1"]

    def sft(name: str):
        return load_config("sft", args(name))

    cfg = sft("sft")
    trainer = Trainer(cfg)
    trainer.run()
    # cut after step 2 (as SIGTERM does) and resumed with the same command: the straight run's losses exactly
    cut = sft("cut")
    assert stop_after(2)(cut).run()["step"] == 2
    Trainer(cut).run()
    assert train_losses(cut.run_dir) == train_losses(cfg.run_dir) and len(train_losses(cfg.run_dir)) == 4
    # under FSDP on 2 processes (gloo): the same losses, and its sharded checkpoint exports the same model
    run_cli("train", "--nproc", "2", "sft", *args("fsdp"), "train.parallel=fsdp", "train.dtype=fp32")
    sharded = train_losses(tmp_path / "runs" / "fsdp")
    assert len(sharded) == 4 and all(abs(a - b) < 1e-5 for a, b in zip(sharded, train_losses(cfg.run_dir)))
    # the loss mask covers the assistant answers and their end-of-turn marker, nothing else
    ids, mask = np.asarray(trainer.train_data.arrays[0]), np.asarray(trainer.train_data.masks[0]).astype(bool)
    cuts = [0, *(np.flatnonzero(np.diff(mask.astype(np.int8))) + 1), len(ids)]
    trained = [tok.decode(ids[a:b].tolist()) for a, b in zip(cuts, cuts[1:]) if mask[a]]
    answers = [json.loads(x)["messages"][-1]["content"] for x in chats.read_text().splitlines()]
    assert trained == [f"{a}<|im_end|>\n" for a in answers]
    # every weight moved away from the folder's
    fresh = dict(hf.named_parameters())
    for name, p in trainer.model.named_parameters():
        assert not torch.allclose(p.detach(), fresh[name].detach(), atol=1e-5), name

    assert main(["export", str(cfg.run_dir), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(out).__name__ == "Qwen2ForCausalLM"
    ours, _, _ = load_for_inference(cfg.run_dir)
    idx = torch.randint(0, len(tok), (2, 32))
    with torch.no_grad():
        assert (out(idx).logits - logits(ours, idx)).abs().max() < 1e-4
    assert main(["export", str(tmp_path / "runs" / "fsdp"), "--format", "hf", "--out", str(tmp_path / "hf2")]) == 0
    out2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    with torch.no_grad():
        assert (out2(idx).logits - out(idx).logits).abs().max() < 1e-4
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.chat_template == tok.chat_template and exported.eos_token == tok.eos_token
