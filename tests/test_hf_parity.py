"""Dense GPT <-> Hugging Face GPT2LMHeadModel: same logits both ways (transformers is the reference)."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import run_cli

from trainbox.config import load_config
from trainbox.errors import ConfigError
from trainbox.model.build import build_model
from trainbox.model.hf_folder import write_tokenizer
from trainbox.model.load import load_init_weights

transformers = pytest.importorskip("transformers")


def _hf_model(vocab: int = 100, n_positions: int = 64, n_layer: int = 2, seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=32, n_layer=n_layer, n_head=2,
                                  bos_token_id=0, eos_token_id=0, **kw)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # random biases and norms too, so every tensor's mapping is exercised
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _ours(*overrides: str, vocab: int = 128, block: int = 32):
    cfg = load_config("tiny", ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", *overrides])
    return build_model(cfg.model, vocab, block).eval(), cfg


def _logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.lm_head(model.hidden(idx))


@pytest.mark.parametrize("fmt", ["safetensors", "bin-without-prefix"])
def test_init_from_hf_folder_gives_hf_logits(tmp_path, fmt):
    hf = _hf_model()
    if fmt == "safetensors":
        hf.save_pretrained(tmp_path)
    else:  # GPT2Model-style keys in a pytorch_model.bin, as OpenAI's original upload
        hf.config.save_pretrained(tmp_path)
        state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
        torch.save(state, tmp_path / "pytorch_model.bin")
    ours, cfg = _ours()  # vocab 100 padded to 128, 32 of the folder's 64 positions
    load_init_weights(tmp_path, ours, cfg.model)
    idx = torch.randint(0, 100, (2, 32))
    with torch.no_grad():
        want = hf(idx).logits
    got = _logits(ours, idx)
    assert (got[..., :100] - want).abs().max() < 1e-4
    assert torch.equal(ours.transformer.wte.weight[100:], torch.zeros(28, 32))  # pad rows


def test_init_from_hf_folder_checks_the_model_section(tmp_path):
    _hf_model(n_layer=3).save_pretrained(tmp_path)
    ours, cfg = _ours()
    with pytest.raises(ConfigError, match=r"model.n_layer=2 .* n_layer=3"):
        load_init_weights(tmp_path, ours, cfg.model)
    ours, cfg = _ours("model.n_layer=3", "model.tie_embeddings=false")
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        load_init_weights(tmp_path, ours, cfg.model)
    ours, cfg = _ours("model.n_layer=3", block=128)
    with pytest.raises(ConfigError, match="n_positions=64"):
        load_init_weights(tmp_path, ours, cfg.model)


def test_hf_to_train_to_export_round_trip(tiny, tmp_path):
    """HF folder -> `train run.init_from` -> `export --format hf` -> transformers: same logits throughout."""
    from trainbox.data.tokenizer import get_tokenizer
    from trainbox.model.load import load_for_inference

    hf_in = _hf_model(vocab=2048, seed=1)  # the tiny fixture's embedded tokenizer has 2,048 ids
    hf_in.save_pretrained(tmp_path / "hf_in")
    run_cli("train", *tiny, f"run.init_from={tmp_path / 'hf_in'}", "optim.lr=1e-9", "train.max_steps=2",
            "train.eval_every=0", "run.name=parity")
    run = tmp_path / "runs" / "parity"
    run_cli("export", str(run), "--format", "hf", "--out", str(tmp_path / "hf_out"))
    umask = os.umask(0)
    os.umask(umask)   # an exported folder is for others: files get the umask's mode, not safetensors' 0600
    assert {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf_out").iterdir()} == \
        {f.name: 0o666 & ~umask for f in (tmp_path / "hf_out").iterdir()}
    hf_out = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf_out").eval()
    ours, tok, _ = load_for_inference(run)
    idx = torch.randint(0, 2048, (2, 32))
    with torch.no_grad():
        exported, original = hf_out(idx).logits, hf_in(idx).logits
    assert (_logits(ours, idx)[..., :2048] - exported).abs().max() < 1e-4
    assert (exported - original).abs().max() < 1e-4  # init_from loaded the folder; lr 1e-9 kept it
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf_out")
    text = "ROMEO:\nWhat light through yonder window breaks?"
    assert hf_tok(text)["input_ids"] == get_tokenizer("embedded:shakespeare-bpe").encode(text)
    again = run_cli("export", str(run), "--out", str(tmp_path / "hf_out"), check=False)
    assert again.returncode == 2 and "--force" in again.stderr


def test_gpt2_tokenizer_export_matches_ours(tmp_path):
    from trainbox.data.tokenizer import get_tokenizer

    ours = get_tokenizer("gpt2")
    write_tokenizer(ours, "gpt2", tmp_path, 1024)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello world!  It's 2024,\n\n  café naïve\ttabs    end"
    assert hf_tok(text)["input_ids"] == ours.encode(text)
    assert hf_tok.eos_token_id == 50256 and hf_tok.decode(ours.encode(text)) == text


def test_gpt2_125m_recipe_shape():
    cfg = load_config("gpt2-125m")
    model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len)
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.data.seq_len) == (12, 12, 768, 1024)
    assert model.transformer.wte.weight.shape == (50304, 768)
    # GPT-2 small has 124,439,808 parameters (HF's count); padding adds 47 rows of 768. The recipe leaves
    # out the biases, as nanoGPT's reference run does: 12 layers of 2304 + 768 + 3072 + 768 + 2 * 768, and ln_f's
    assert not cfg.model.bias
    assert model.num_params(exclude_positions=False) == 124_439_808 + 47 * 768 - 12 * 8448 - 768
    cfg = load_config("gpt2-125m", ["model.bias=true"])
    model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len)
    assert model.num_params(exclude_positions=False) == 124_439_808 + 47 * 768
