"""T5 family: parity with Hugging Face's T5ForConditionalGeneration (logits, gradients, export, greedy
decoding), FLOP count against torch's FlopCounterMode, recipes, and training through the one loop
(exact resume, world-size independence, the logged loss as the mean over decoder targets, `trainbox generate`,
`trainbox inspect` of a run)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_cli

from trainbox.config import ModelSection, load_config
from trainbox.model.build import model_vocab_size
from trainbox.model.t5.hf import to_hf
from trainbox.model.t5.model import T5, _Diagonals, relative_position_bucket
from trainbox.train.loop import train

transformers = pytest.importorskip("transformers")

SHAPE = dict(family="t5", n_layer=2, n_head=4, n_embd=32,
             t5=dict(d_ff=48, d_kv=8, num_decoder_layers=3, relative_attention_num_buckets=8,
                     relative_attention_max_distance=20))
VOCAB = 160


def hf_pair(tie: bool = False, seed: int = 0):
    """A random HF T5 from a small T5Config, and ours with its weights loaded by name."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    ours = T5(ModelSection(**SHAPE, tie_embeddings=tie), VOCAB, 64)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=tie,
                   decoder_start_token_id=ours.decoder_start_token_id, pad_token_id=ours.decoder_start_token_id)
    hf = T5ForConditionalGeneration(cfg).eval()
    if not tie:  # transformers 5 always builds the head tied (untied only when a checkpoint says so): untie
        hf.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 32 ** -0.5)
    assert (hf.lm_head.weight is hf.shared.weight) == tie
    assert getattr(hf.config, "scale_decoder_outputs", hf.config.tie_word_embeddings) == tie  # transformers 5 / 4
    hf_state = hf.state_dict()
    assert set(hf_state) == set(ours.state_dict())  # names map 1:1, embed_tokens aliases included
    ours.load_state_dict(hf_state, strict=True)
    return hf, ours.eval()


@pytest.mark.parametrize("tie", [False, True])
def test_logits_and_gradients_match_hugging_face(tie):
    hf, ours = hf_pair(tie)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (3, 45), generator=g)   # longer than max_distance: log-spaced buckets too
    y = torch.randint(0, VOCAB, (3, 17), generator=g)
    ref = hf(input_ids=x, labels=y)
    out = ours(x, y)
    assert (out.logits - ref.logits).abs().max().item() < 1e-4
    ref.loss.backward()
    out.loss.backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        g_ref = hf_grads[name].grad
        rel = ((p.grad - g_ref).norm() / g_ref.norm()).item()
        assert rel < 1e-4, f"{name}: relative gradient difference {rel:.2e}"


def test_relative_position_buckets_match_hugging_face():
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 300)[None, :] - torch.arange(0, 7)[:, None]
    for bidirectional in (True, False):
        for buckets, dist in ((32, 128), (8, 20), (16, 64)):
            ref = T5Attention._relative_position_bucket(rel, bidirectional, buckets, dist)
            assert torch.equal(relative_position_bucket(rel, bidirectional, buckets, dist), ref)


@pytest.mark.parametrize("q_len,k_len", [(6, 6), (3, 8), (1, 9), (64, 64)])
def test_bias_diagonals_and_their_gradient_equal_the_gather(q_len, k_len):
    """The position bias laid along diagonals (its backward sums them without atomics) against indexing the
    per-distance table with key - query, as a decoder with a cache of k_len - q_len positions asks for it."""
    rel = torch.randn(3, q_len + k_len - 1, dtype=torch.float64, requires_grad=True)
    distance = torch.arange(k_len)[None, :] - torch.arange(k_len - q_len, k_len)[:, None]
    ours, ref = _Diagonals.apply(rel, q_len, k_len), rel[:, distance + k_len - 1]
    assert torch.equal(ours, ref) and ours.is_contiguous()
    grad = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(ours, rel, grad)[0], torch.autograd.grad(ref, rel, grad)[0],
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers_with_same_outputs(tmp_path, tie):
    """config.json states the model's own tie (T5 v1.1's untied head: false, as google/t5-v1_1-* say), and
    transformers loads the head as we hold it: tied to `shared` and scaled, or a separate matrix."""
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(3)
    ours = T5(ModelSection(**SHAPE, tie_embeddings=tie), VOCAB, 64).eval()
    out = to_hf(ours, tmp_path / "hf", eos_token_id=5)
    saved = json.loads((out / "config.json").read_text())
    assert saved["tie_word_embeddings"] is tie and saved.get("scale_decoder_outputs", tie) is tie
    hf = T5ForConditionalGeneration.from_pretrained(out).eval()
    assert (hf.lm_head.weight is hf.shared.weight) == tie
    x, y = torch.randint(0, VOCAB, (2, 30)), torch.randint(0, VOCAB, (2, 9))
    ref = hf(input_ids=x, labels=y)
    mine = ours(x, y)
    assert (mine.logits - ref.logits).abs().max().item() < 1e-5
    assert abs(mine.loss.item() - ref.loss.item()) < 1e-5
    assert hf.config.decoder_start_token_id == ours.decoder_start_token_id == VOCAB - 1 - 100


def test_greedy_span_filling_matches_hugging_face_generate(tmp_path):
    from transformers import T5ForConditionalGeneration

    from trainbox.generate import decode_seq2seq

    torch.manual_seed(4)
    text_vocab = VOCAB - 101 - 3          # three padding rows between the text ids and the decoder start
    ours = T5(ModelSection(**SHAPE, tie_embeddings=False), VOCAB, 64).eval()
    folder = to_hf(ours, tmp_path / "hf", eos_token_id=2, text_vocab=text_vocab)
    hf = T5ForConditionalGeneration.from_pretrained(folder).eval()
    ids = [7, 9, VOCAB - 1, 11, 12, 3, VOCAB - 2, 2]
    mine = decode_seq2seq(ours, ids, 12, eot_id=2, text_vocab=text_vocab, temperature=0)
    # generation_config.json suppresses the padding ids and the decoder start, and turns the cache off, which
    # transformers 5 sizes by the encoder's depth (3 decoder layers here): generate's defaults decode as ours
    assert json.loads((folder / "generation_config.json").read_text())["use_cache"] is False
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, num_beams=1)[0].tolist()
    assert ref[0] == ours.decoder_start_token_id
    ref = ref[1:]
    assert mine == (ref[:ref.index(2)] if 2 in ref else ref)


def test_export_names_the_t5_ids_a_tokenizer_already_holds_apart_and_says_so():
    """A tokenizer with its own <extra_id_K> or <pad> (ids below the model's) cannot have them at the model's
    sentinels: those slots get names of their own, and the export's note says which names the folder uses."""
    from trainbox.model.t5.hf import t5_token_names

    model = T5(ModelSection(**SHAPE), VOCAB, 64)
    names, notes = t5_token_names(model, 56, {"<extra_id_0>": 3, "<extra_id_1>": 4, "<pad>": 5})
    assert sorted(names) == list(range(56, VOCAB))
    assert [names[i] for i in (56, 58, 59, VOCAB - 1, VOCAB - 2, VOCAB - 3)] == [
        "<unused_56>", "<unused_58>", "<decoder_start>", "<trainbox_extra_id_0>", "<trainbox_extra_id_1>",
        "<extra_id_2>"]
    assert notes == [f"note: the tokenizer has its own <extra_id_0>..<extra_id_1> tokens (ids 3..), which are not the "
                     f"model's sentinels: in this folder the sentinels are <trainbox_extra_id_K> (<extra_id_0> is id "
                     f"{VOCAB - 1}, counting down); write prompts with those names for transformers, or use `trainbox "
                     "generate`, which reads <extra_id_K> as the sentinel"]


def test_cached_decoding_equals_full_decoder_runs():
    torch.manual_seed(5)
    model = T5(ModelSection(**SHAPE), VOCAB, 64).eval()
    memory = model.encode(torch.randint(0, VOCAB, (2, 30)))
    dec = torch.randint(0, VOCAB, (2, 25))          # longer than max_distance: far buckets in the cache too
    full = model.decode(dec, memory)
    caches = model.make_decoder_caches(2, 25, 30, torch.float32, "cpu")
    first = model.decode(dec[:, :4], memory, caches, 0)   # a prefill of 4, then one token at a time
    steps = [first] + [model.decode(dec[:, p:p + 1], memory, caches, p) for p in range(4, 25)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5


def test_flops_per_token_matches_flop_counter():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from trainbox.data.spans import span_lengths

    model = T5(ModelSection(**SHAPE), VOCAB, 64)
    seq = 64
    _, dec = span_lengths(seq, 0.15, 3.0)
    x, y = torch.randint(0, VOCAB, (1, seq)), torch.randint(0, VOCAB, (1, dec))
    # the math backend makes every attention product a counted bmm (fused CPU kernels are not counted)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(x, y).loss.backward()
    assert model.flops_per_token(seq) * seq == counter.get_total_flops()


@pytest.mark.parametrize("recipe,params", [("t5-small", 76_961_152), ("t5-base", 247_577_856)])
def test_recipes_have_the_v1_1_shapes(recipe, params):
    """At T5's own 32,128-token vocabulary the recipes count exactly google/t5-v1_1-{small,base}'s parameters."""
    cfg = load_config(recipe, ["model.vocab_size=32128"])
    with torch.device("meta"):
        model = T5(cfg.model, 32128, cfg.data.seq_len)
    assert model.num_params() == params
    gpt2 = load_config(recipe)
    assert model_vocab_size(gpt2.model, 50257) == 50368  # 50,257 + 100 sentinels + decoder start, padded


# ----------------------------------------------------------------------------- the one training loop

T5_TINY = ["model.family=t5", "model.tie_embeddings=false", "model.t5.d_ff=64", "model.t5.d_kv=16",
           "train.eval_every=3", "train.checkpoint_every=3", "train.keep_last=3", "train.max_steps=6"]


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["event"] == "train"}


def test_t5_trains_resumes_exactly_runs_under_torchrun_and_fills_spans(tmp_path, tiny):
    import shutil

    args = [*tiny, *T5_TINY]
    train(load_config(None, [*args, "run.name=a"]))
    run_a = tmp_path / "runs" / "a"
    status = json.loads((run_a / "status.json").read_text())
    assert status["phase"] == "finished" and status["step"] == 6 and status["mfu"] is None  # no GPU peak on CPU
    # interrupted at step 3: a copy of the run without its last checkpoint continues from step 3
    run_b = tmp_path / "runs" / "b"
    shutil.copytree(run_a, run_b)
    shutil.rmtree(run_b / "checkpoints" / "step_00000006")
    (run_b / "metrics.jsonl").write_text("")
    train(load_config(None, [*args, "run.name=b"]))
    a, b = _losses(run_a), _losses(run_b)
    assert sorted(b) == [4, 5, 6] and all(a[s] == b[s] for s in b)  # bit-identical on CPU
    # two gloo processes through torchrun (each half of every global batch) follow the same losses
    run_cli("train", "--nproc", "2", *args, "run.name=two", cwd=tmp_path)
    two = _losses(tmp_path / "runs" / "two")
    assert sorted(two) == sorted(a) and all(abs(a[s] - two[s]) < 1e-5 for s in a)
    trainer = json.loads((run_a / "checkpoints" / "step_00000006" / "trainer.json").read_text())
    assert trainer["config"]["model"]["t5"]["sentinel_tokens"] == 100
    # `trainbox export` writes a folder transformers loads with the same outputs, and the run's tokenizer with T5's
    # ids: AutoTokenizer encodes a prompt to the ids trainbox feeds the encoder, and generate decodes what ours does
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    from trainbox.data.spans import encode_with_sentinels
    from trainbox.export import export
    from trainbox.generate import decode_seq2seq
    from trainbox.model.load import load_for_inference
    model, tok, _ = load_for_inference(run_a)
    lines = export(run_a, tmp_path / "hf")
    assert lines == [f"wrote {tmp_path / 'hf'} (Hugging Face T5ForConditionalGeneration: config.json, "
                     "model.safetensors, generation_config.json, the run's tokenizer with the sentinels <extra_id_N> "
                     "and <pad> at the model's ids)"]
    hf = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    x, y = torch.randint(0, tok.vocab_size, (2, 32)), torch.randint(0, tok.vocab_size, (2, 9))
    assert (hf(input_ids=x, labels=y).logits - model.eval()(x, y).logits).abs().max().item() < 1e-4
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    V, S = model.vocab_size, model.sentinel_tokens
    assert (len(hf_tok), hf_tok.eos_token_id, hf_tok.pad_token_id) == (V, tok.eot_id, model.decoder_start_token_id)
    assert hf_tok.convert_tokens_to_ids(["<extra_id_0>", "<extra_id_99>"]) == [V - 1, V - S]
    prompt = "ROMEO: What <extra_id_0> lord <extra_id_1>."
    ids = encode_with_sentinels(tok, prompt, V, S) + [tok.eot_id]
    assert hf_tok(prompt).input_ids == ids
    mine = decode_seq2seq(model, ids, 12, tok.eot_id, tok.vocab_size, temperature=0)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, num_beams=1)[0].tolist()
    assert ref[0] == model.decoder_start_token_id and ref[1:1 + len(mine)] == mine
    out = run_cli("generate", str(run_a), "--prompt", prompt, "--temperature", "0", "--max-tokens", "12",
                  cwd=tmp_path).stdout
    lines = out.splitlines()
    assert lines[0].startswith("<extra_id_") and "--- filled ---" in lines
    printed = out.split("--- filled ---")[0]   # each sentinel and its span, a line each, as the folder decodes them
    assert hf_tok.decode(ref[1:1 + len(mine)]).replace("\n", "").endswith(printed.replace("\n", ""))


def test_t5_batches_do_not_depend_on_world_size(tiny):
    from trainbox.data.loader import BatchOrder
    from trainbox.data.sources import open_datasets
    from trainbox.data.tokenizer import get_tokenizer
    from trainbox.model.build import adapt_datasets

    cfg = load_config("tiny", [*tiny, *T5_TINY, "train.global_batch_size=4"])
    tok = get_tokenizer(cfg.data.tokenizer)
    vocab = model_vocab_size(cfg.model, tok.vocab_size)
    train, _ = adapt_datasets(cfg, tok, vocab, *open_datasets(cfg.data, tok, vocab))
    one = BatchOrder(train, 4, 2, world=1, rank=0, seed=7).micro_batches(5)
    two = [BatchOrder(train, 4, 1, world=2, rank=r, seed=7).micro_batches(5) for r in (0, 1)]
    for key in ("x", "y"):
        whole = torch.cat([b[key] for b in one])
        assert torch.equal(whole, torch.cat([b[key] for rank in two for b in rank]))
    assert one[0]["x"].shape[1] == cfg.data.seq_len and np.all(one[0]["x"][:, -1].numpy() == tok.eot_id)


def test_t5_logged_loss_is_the_mean_cross_entropy_over_decoder_targets(tmp_path, tiny):
    """The loss the loop logs for step 1 (two micro-batches) is the mean cross-entropy over every decoder target
    of its global batch, computed here by hand from the model's logits; lr 1e-12 keeps the checkpoint's weights
    those of step 1's forward."""
    import torch.nn.functional as F

    from trainbox.data.loader import BatchOrder
    from trainbox.data.sources import open_datasets
    from trainbox.model.build import adapt_datasets
    from trainbox.model.load import load_for_inference

    train(load_config("tiny", [*tiny, *T5_TINY, "train.max_steps=1", "train.eval_every=0", "optim.lr=1e-12",
                               "optim.warmup_steps=0", "run.name=m"]))
    logged = _losses(tmp_path / "runs" / "m")[1]
    model, tok, cfg = load_for_inference(tmp_path / "runs" / "m")
    assert cfg.train.global_batch_size == 2 * cfg.train.micro_batch_size
    vocab = model_vocab_size(cfg.model, tok.vocab_size)
    data, _ = adapt_datasets(cfg, tok, vocab, *open_datasets(cfg.data, tok, vocab))
    glob = cfg.train.global_batch_size
    batch = BatchOrder(data, glob, glob, seed=cfg.run.seed).micro_batches(0)[0]   # step 1's whole global batch
    x, y = batch["x"], batch["y"]
    start = torch.full((len(y), 1), model.decoder_start_token_id)
    with torch.no_grad():
        logits = model.eval()(x, decoder_input_ids=torch.cat([start, y[:, :-1]], dim=1)).logits
    by_hand = F.cross_entropy(logits.double().flatten(0, 1), y.flatten()).item()
    assert y.shape[1] < x.shape[1] < data.seq_len      # targets, encoder input and raw window: three lengths
    assert logged == pytest.approx(by_hand, rel=1e-5)


def test_inspect_of_a_t5_run_counts_the_samples_and_steps_its_log_states(tmp_path, tiny, capsys):
    """`trainbox inspect RUN` of a t5 run counts samples of its span-corruption windows (longer than data.seq_len),
    as the run's loader does: the samples and steps per epoch of the run's train.log `data:` line."""
    import re

    from trainbox.cli import main

    run_cli("train", "tiny", *tiny, *T5_TINY, "train.max_steps=1", "train.eval_every=0", "run.name=i")
    run = tmp_path / "runs" / "i"
    said = re.search(r"data: .* ([\d,]+) samples of 32; global batch 8 .*; ([\d,]+) steps/epoch",
                     (run / "train.log").read_text())
    samples, per_epoch = (int(g.replace(",", "")) for g in said.groups())
    capsys.readouterr()
    assert main(["inspect", str(run), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["seq_len"], r["global_batch"]) == (32, 8)
    assert (r["train"]["samples"], r["steps_per_epoch"]) == (samples, per_epoch)
    assert r["run"]["epochs"] == round(1 / per_epoch, 4)


def test_too_little_data_for_a_t5_run_is_counted_in_span_corruption_samples(tmp_path, tiny):
    """The zero-steps error of a t5 run speaks of data.seq_len, each sample read from the longer raw window of span
    corruption, and its advice is what the t5 loader counts: at the data.seq_len it names, one sample; above it, none.
    With a sample but not a global batch of them, the samples are of data.seq_len, read from that window."""
    from trainbox.data.formats import write_shard
    from trainbox.data.loader import BatchOrder
    from trainbox.data.sources import open_datasets
    from trainbox.data.spans import span_lengths
    from trainbox.data.tokenizer import get_tokenizer
    from trainbox.errors import DataError
    from trainbox.model.build import adapt_datasets

    raw = span_lengths(32)[0]
    assert raw > 33   # longer than a next-token window of data.seq_len=32
    write_shard(tmp_path / "d_train_000001.bin", np.arange(raw - 4, dtype=np.uint16))   # short of raw + 1 tokens
    write_shard(tmp_path / "d_val_000000.bin", np.arange(4 * raw, dtype=np.uint16))
    res = run_cli("train", "tiny", *tiny, *T5_TINY, f"data.path={tmp_path / 'd'}", "run.name=few", check=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr and "unexpected" not in res.stderr, res.stderr
    fits = max(s for s in range(8, 33) if span_lengths(s)[0] <= raw - 5)
    assert (f"fewer than one sample of data.seq_len=32 tokens (each read from a window of {raw} (+1) tokens), so an "
            f"epoch has 0 steps. Lower data.seq_len (at most {fits} here)") in res.stderr, res.stderr

    def t5_train(seq_len: int):
        cfg = load_config("tiny", [*tiny, *T5_TINY, f"data.path={tmp_path / 'd'}", f"data.seq_len={seq_len}"])
        tok = get_tokenizer(cfg.data.tokenizer)
        vocab = model_vocab_size(cfg.model, tok.vocab_size)
        return adapt_datasets(cfg, tok, vocab, *open_datasets(cfg.data, tok, vocab))[0]

    assert (t5_train(fits).num_samples, t5_train(fits + 1).num_samples) == (1, 0)
    with pytest.raises(DataError) as e:
        BatchOrder(t5_train(fits), global_batch=8, micro_batch=4).check_nonempty()
    assert e.value.message == (f"{tmp_path / 'd'} (train): 1 samples of data.seq_len={fits} tokens (each read from a "
                               f"window of {span_lengths(fits)[0]}) is fewer than one global batch of 8 sequences, so "
                               "an epoch has 0 steps. Add more data, or lower train.global_batch_size (at most 1) or "
                               "data.seq_len")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_runs_on_the_fused_kernel_and_matches_hugging_face_in_bf16():
    """On the GPU the position bias goes through the memory-efficient SDPA kernel (forward and the
    bias gradient), and bf16 training losses track transformers' within bf16 noise."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hf, ours = hf_pair(tie=False)
    hf, ours = hf.cuda().train(), ours.cuda().train()
    x = torch.randint(0, VOCAB, (4, 200), device="cuda")
    y = torch.randint(0, VOCAB, (4, 45), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # raises if the fused kernel cannot take the bias
            loss = ours(x, y).loss
            loss.backward()
        ref = hf(input_ids=x, labels=y).loss
    assert abs(loss.item() - ref.item()) < 2e-2 * ref.item()
    bias = ours.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert bias.grad is not None and bias.grad.abs().sum() > 0



def test_explicit_vocab_without_room_for_sentinels_is_a_config_error(tiny):
    from trainbox.data.tokenizer import get_tokenizer
    from trainbox.errors import ConfigError
    from trainbox.model.build import check_vocab_size

    cfg = load_config("tiny", [*tiny, *T5_TINY, "model.vocab_size=2048"])
    tok = get_tokenizer(cfg.data.tokenizer)
    with pytest.raises(ConfigError, match="model.vocab_size=2048") as e:
        check_vocab_size(cfg.model, tok)   # the pre-flight check (train/preflight.py)
    assert f"plus {cfg.model.t5.sentinel_tokens + 1} t5 extra ids" in e.value.message
