"""`trainbox prepare` and `trainbox inspect`: exact tokens (against a plain tiktoken loop), determinism across
worker counts, whole-document validation split, overwrite safety, atomic outputs, Megatron output,
raw inputs as data.path, and the zero-steps error shared with the training loop."""
from __future__ import annotations

import functools
import gzip
import json
import re

import numpy as np
import pytest
import tiktoken
from conftest import run_check_script, run_cli
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from trainbox.data import embedded, encode, formats, megatron
from trainbox.data import readers as prep
from trainbox.data.prepare import PrepareOptions, prepare
from trainbox.data.tokenizer import GPT2_PATTERN, asset_path, get_tokenizer
from trainbox.errors import DataError

EOT = 50256


def make_docs(n=300, seed=0):
    rng = np.random.default_rng(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "émigré", "naïve", "über", "42", "don't", "\n", "  ", "日本",
             "<|endoftext|>"]
    return [f"Doc {i}: " + " ".join(rng.choice(words, size=int(rng.integers(1, 60)))) for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    docs = make_docs()
    with open(d / "a.jsonl", "w") as f:
        for t in docs[:200]:
            f.write(json.dumps({"text": t, "title": t[:7]}) + "\n")
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        for t in docs[200:]:
            f.write(json.dumps({"text": t}) + "\n")
    return d, docs


def hf_ordinary(spec, text):
    """A fresh `tokenizers` tokenizer with special-token strings encoded as plain text (as encode_ordinary)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(get_tokenizer(spec).tok.to_str())
    tok.encode_special_tokens = True
    return tok.encode(text, add_special_tokens=False).ids


@functools.lru_cache(maxsize=1)
def tiktoken_gpt2() -> tiktoken.Encoding:
    """GPT-2 as tiktoken builds it from the merges (vocab.bpe) and encoder.json: the reference for prepare."""
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(asset_path("vocab.bpe")),
                                            encoder_json_file=str(asset_path("encoder.json")))
    return tiktoken.Encoding(name="gpt2-reference", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=EOT + 1)


def reference(docs):
    """The obviously-correct stream: EOT, then encode_ordinary of each document."""
    enc = tiktoken_gpt2()
    return [[EOT] + enc.encode_ordinary(t) for t in docs]


def test_tokens_exact_and_identical_for_any_worker_count(corpus, tmp_path):
    d, docs = corpus
    outs = []
    for workers in (1, 2, 3):
        st = prepare(PrepareOptions([str(d / "a.jsonl"), str(d / "b.jsonl.gz")], str(tmp_path / f"w{workers}/x"),
                                    workers=workers, shard_tokens=1500, val_fraction=0.1))
        outs.append({f.split("/")[-1]: open(f, "rb").read() for f in st.files})
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) > 3
    ref = reference(docs)
    val_ids = [i for i in range(len(docs)) if int((i + 1) * 0.1) > int(i * 0.1)]
    assert len(val_ids) == 30
    for split, ids in (("val", val_ids), ("train", [i for i in range(len(docs)) if i not in val_ids])):
        files = sorted((tmp_path / "w1").glob(f"x_{split}_*.bin"))
        got = np.concatenate([formats.read_shard(f) for f in files])
        assert np.array_equal(got, np.concatenate([ref[i] for i in ids]))
    assert [f.name for f in sorted((tmp_path / "w1").glob("x_train_*.bin"))][0] == "x_train_000001.bin"
    assert all(len(formats.read_shard(f)) == 1500 for f in sorted((tmp_path / "w1").glob("x_train_*.bin"))[:-1])


def test_prepare_imports_no_torch(corpus, tmp_path):
    """prepare's start-up is part of its time: torch (seconds to import) has no part in tokenizing text."""
    d, _ = corpus
    run_check_script(f"""
import contextlib, io, sys
from trainbox.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["prepare", {str(d / "a.jsonl")!r}, "--out", {str(tmp_path / "x")!r}, "--workers", "2", "--quiet"]) == 0
assert "torch" not in sys.modules, "prepare imported torch"
print("ok")""")


def test_without_fastokens_tiktoken_gives_the_same_tokens_and_says_so(corpus, tmp_path, monkeypatch, caplog):
    d, docs = corpus
    monkeypatch.setattr(encode, "fastokens", None)
    monkeypatch.setattr(encode.FastEncoder, "encoded", False)  # forked workers inherit the missing fastokens
    for workers in (1, 2):
        caplog.clear()
        prepare(PrepareOptions([str(d / "a.jsonl")], str(tmp_path / f"w{workers}" / "x"), workers=workers))
        got = formats.read_shard(tmp_path / f"w{workers}" / "x_train_000001.bin")
        assert np.array_equal(got, np.concatenate(reference(docs[:200]))), workers
        assert [r.getMessage() for r in caplog.records] == [
            "fastokens is not installed (pip install fastokens): the text is encoded through tiktoken, the same "
            "tokens more slowly"]
    assert encode.fast_encoder(get_tokenizer("gpt2"))[0] is None and not encode.FastEncoder.encoded


def test_workers_after_an_encode_in_the_same_process_finish(tmp_path):
    """fastokens spreads a long text over threads; a process forked after that waits for those threads forever
    when it encodes a long text itself. So after a one-worker prepare in this process, the 2 workers come from a
    fork server, and finish."""
    long = tmp_path / "long.jsonl"  # one 5 MB document: long enough for the threads
    long.write_text(json.dumps({"text": "\n\n".join(embedded.works().values())}) + "\n")
    run_check_script(f"""
import os
from pathlib import Path
from trainbox.data.prepare import PrepareOptions, prepare
one = prepare(PrepareOptions([{str(long)!r}], {str(tmp_path / "one" / "x")!r}, val_docs=0))
assert len(os.listdir("/proc/self/task")) > 1, "no threads started: not the case under test"
two = prepare(PrepareOptions([{str(long)!r}], {str(tmp_path / "two" / "x")!r}, val_docs=0, workers=2))
assert [Path(f).read_bytes() for f in one.files if f.endswith(".bin")] == \\
    [Path(f).read_bytes() for f in two.files if f.endswith(".bin")]
print("ok")""", timeout=120)


def test_large_txt_is_read_in_pieces_with_the_same_tokens(tmp_path, monkeypatch):
    text = "\n".join(make_docs(400, seed=1)) + "\n\n  indented\nlast line"
    (tmp_path / "big.txt").write_text(text)
    monkeypatch.setattr(prep, "TXT_PIECE_BYTES", 1000)
    monkeypatch.setattr(prep, "ITEM_BYTES", 3000)
    assert len(list(prep.read_txt(tmp_path / "big.txt"))) > 5
    st = prepare(PrepareOptions([str(tmp_path / "big.txt")], str(tmp_path / "o/x"), workers=2))
    assert st.documents == 1
    got = formats.read_shard(tmp_path / "o/x_train_000001.bin")
    assert np.array_equal(got, reference([text])[0])
    bpe = get_tokenizer("embedded:shakespeare-bpe")  # a `tokenizers` byte-level BPE: pieces are safe too
    assert prep.splits_like_gpt2(bpe)
    prepare(PrepareOptions([str(tmp_path / "big.txt")], str(tmp_path / "h/x"), tokenizer="embedded:shakespeare-bpe"))
    assert np.array_equal(formats.read_shard(tmp_path / "h/x_train_000001.bin"),
                          [bpe.eot_id] + hf_ordinary("embedded:shakespeare-bpe", text))


def test_no_pieces_for_tokenizers_that_add_a_prefix_space(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = get_tokenizer(str(tmp_path / "tokenizer.json"))
    assert not prep.splits_like_gpt2(hf)
    (tmp_path / "t.txt").write_bytes(b"word\nword " * 500)
    entries = list(prep.work_items([tmp_path / "t.txt"], 0))
    assert len(entries) == 1 and len(entries[0][0]) == 1  # one piece: the whole file


def test_txt_folder_megatron_append_eod_and_vocab(tmp_path):
    (tmp_path / "in/sub").mkdir(parents=True)
    docs = make_docs(5, seed=2)
    for i, t in enumerate(docs):
        (tmp_path / "in" / ("sub" if i % 2 else "") / f"{i}.txt").write_text(t)
    order = sorted((tmp_path / "in").rglob("*.txt"))
    st = prepare(PrepareOptions([str(tmp_path / "in")], str(tmp_path / "o/x"), format="megatron",
                                append_eod=True, write_vocab=True, val_docs=1))
    assert st.documents == 5 and st.val_documents == 1
    enc = tiktoken_gpt2()
    ref = [enc.encode_ordinary(p.read_text()) + [EOT] for p in order]
    train = megatron.read_megatron(tmp_path / "o/x_text_document")
    val = megatron.read_megatron(tmp_path / "o/x_val_text_document")
    assert val.lengths.tolist() == [len(ref[0])] and np.array_equal(val.tokens, ref[0])
    assert train.lengths.tolist() == [len(r) for r in ref[1:]] and np.array_equal(train.tokens, np.concatenate(ref[1:]))
    from trainbox.data.tokenizer import asset_path
    assert (tmp_path / "o/gpt2-vocab.json").read_bytes() == asset_path("encoder.json").read_bytes()
    assert (tmp_path / "o/gpt2-merges.txt").read_bytes() == asset_path("vocab.bpe").read_bytes()


def test_several_json_keys_megatron(corpus, tmp_path):
    d, docs = corpus
    prepare(PrepareOptions([str(d / "a.jsonl")], str(tmp_path / "x"), format="megatron", text_keys=["text", "title"]))
    enc = tiktoken_gpt2()
    title = megatron.read_megatron(tmp_path / "x_title_document")
    assert title.lengths.tolist() == [len(enc.encode_ordinary(t[:7])) for t in docs[:200]]
    assert megatron.read_megatron(tmp_path / "x_text_document").num_documents == 200


def test_overwrite_and_atomic_outputs(corpus, tmp_path):
    d, _ = corpus
    out = str(tmp_path / "x")
    prepare(PrepareOptions([str(d / "a.jsonl")], out, shard_tokens=1000))
    n_before = len(list(tmp_path.glob("x_train_*.bin")))
    before = (tmp_path / "x_train_000001.bin").read_bytes()
    with pytest.raises(DataError, match=r"x_train_000001\.bin already exists") as e:
        prepare(PrepareOptions([str(d / "b.jsonl.gz")], out))
    assert "--overwrite" in e.value.hint
    # a broken record half-way: the run fails and leaves neither temporaries nor changed outputs
    bad = tmp_path / "bad.jsonl"
    bad.write_text((d / "a.jsonl").read_text() * 3 + '{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:602: invalid JSON at byte offset"):
        prepare(PrepareOptions([str(bad)], out, overwrite=True, shard_tokens=1000))
    assert (tmp_path / "x_train_000001.bin").read_bytes() == before
    assert not list(tmp_path.glob("*.partial")) and len(list(tmp_path.glob("x_train_*.bin"))) == n_before
    # --overwrite with a smaller input removes the stale shards of the larger one
    prepare(PrepareOptions([str(d / "b.jsonl.gz")], out, overwrite=True))
    assert sorted(p.name for p in tmp_path.glob("x_*")) == ["x_train_000001.bin"]


def test_bad_inputs(tmp_path):
    (tmp_path / "k.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"k\.jsonl:1: no string field 'text' \(fields: body\)"):
        prepare(PrepareOptions([str(tmp_path / "k.jsonl")], str(tmp_path / "o")))
    # a record meant as a preference pair or a chat, not quite one: what it lacks, not --text-key
    for name, row, said in (("p", '{"prompt": "a", "chosen": "b"}', "a preference row needs 'chosen' and 'rejected'; "
                             "'rejected' missing (fields: chosen, prompt)"),
                            ("c", '{"messages": "hi"}', "a chat record's 'messages' is a list of messages, not a str")):
        (tmp_path / f"{name}.jsonl").write_text(row + "\n")
        with pytest.raises(DataError, match=re.escape(f"{name}.jsonl:1: {said}")) as e:
            prepare(PrepareOptions([str(tmp_path / f"{name}.jsonl")], str(tmp_path / "o")))
        assert "row forms" in e.value.hint
    (tmp_path / "u.txt").write_bytes(b"abc\xffdef")
    with pytest.raises(DataError, match=r"u\.txt: invalid UTF-8 at byte offset 3"):
        prepare(PrepareOptions([str(tmp_path / "u.txt")], str(tmp_path / "o")))
    with pytest.raises(DataError, match="does not exist"):
        prepare(PrepareOptions([str(tmp_path / "nope.jsonl")], str(tmp_path / "o")))


def test_lone_surrogate_escapes_become_the_replacement_character(tmp_path):
    """JSON allows a surrogate escape alone (an emoji cut in half); such a string has no UTF-8 form. Each lone
    one is U+FFFD, as in tiktoken's encode_ordinary (the reference), through every tokenizer path; a pair is
    the character it spells."""
    texts = ["cut \ud83d emoji", "low \udc00 alone, upper \ud800", "whole \ud83d\ude00 pair", "plain"]
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts).replace("\\ud800", "\\uD800")
    assert "\\ud83d" in raw and "\\uD800" in raw   # escapes, as they arrive
    (tmp_path / "s.jsonl").write_text(raw)
    for workers in (1, 2):
        prepare(PrepareOptions([str(tmp_path / "s.jsonl")], str(tmp_path / f"w{workers}" / "x"), workers=workers))
        got = formats.read_shard(tmp_path / f"w{workers}" / "x_train_000001.bin")
        assert np.array_equal(got, np.concatenate(reference(texts))), workers
    assert tiktoken_gpt2().decode(reference(texts)[0]) == "<|endoftext|>cut \ufffd emoji"
    bpe = "embedded:shakespeare-bpe"
    prepare(PrepareOptions([str(tmp_path / "s.jsonl")], str(tmp_path / "hf" / "x"), tokenizer=bpe))
    mended = ["cut \ufffd emoji", "low \ufffd alone, upper \ufffd", "whole \U0001f600 pair", "plain"]
    want = [[get_tokenizer(bpe).eot_id, *hf_ordinary(bpe, t)] for t in mended]
    assert np.array_equal(formats.read_shard(tmp_path / "hf" / "x_train_000001.bin"), np.concatenate(want))
    chat = {"messages": [{"role": "user", "content": "hi \ud83d"}, {"role": "assistant", "content": "\udc00 yo"}]}
    (tmp_path / "c.jsonl").write_text(json.dumps(chat) + "\n")
    for tok in ("gpt2", "embedded:shakespeare-bpe"):
        st = prepare(PrepareOptions([str(tmp_path / "c.jsonl")], str(tmp_path / "c" / tok.replace(":", "-")),
                                    tokenizer=tok))
        assert st.documents == 1 and st.tokens > 0, tok
    rows = list(prep.json_objects(tmp_path / "c.jsonl"))  # the SFT and preference readers
    assert rows[0][0]["messages"][1]["content"] == "\ufffd yo"


def test_cli_prepare_inspect_and_zero_steps(corpus, tmp_path, tiny):
    d, docs = corpus
    out = tmp_path / "data/x"
    p = run_cli("prepare", str(d / "a.jsonl"), "--out", str(out), "--workers", "2", "--val-docs", "10",
                "--tokenizer", "embedded:shakespeare-bpe")
    assert "200 documents" in p.stdout and "10 documents" in p.stdout and "docs/s" in p.stderr
    assert "tokens/s" in p.stderr
    again = run_cli("prepare", str(d / "a.jsonl"), "--out", str(out), check=False)
    assert again.returncode == 1 and "--overwrite" in again.stderr
    r = json.loads(run_cli("inspect", str(out), "--seq-len", "32", "--global-batch", "4", "--epochs", "2",
                           "--tokenizer", "embedded:shakespeare-bpe", "--json").stdout)
    tokens = len(formats.read_shard(f"{out}_train_000001.bin"))
    assert r["train"]["tokens"] == tokens and r["train"]["documents"] == 190 and r["val"]["documents"] == 10
    assert r["train"]["samples"] == (tokens - 1) // 32
    assert r["steps_per_epoch"] == r["train"]["samples"] // 4 and r["total_steps"] == 2 * r["steps_per_epoch"]
    big = str(r["train"]["samples"] + 1)
    z = run_cli("inspect", str(out), "--seq-len", "32", "--global-batch", big, check=False)
    assert z.returncode == 1
    msg = z.stderr.split(": ", 1)[1].strip()
    assert f"{r['train']['samples']} samples" in msg and f"global batch of {big}" in msg and "Add more data" in msg
    t = run_cli("train", *tiny, f"data.path={out}", f"train.global_batch_size={big}",
                f"train.micro_batch_size={big}", check=False)
    assert t.returncode == 1 and msg in t.stderr  # the loop gives the very same message


def test_inspect_of_a_run_reads_its_data_as_the_run_did(tmp_path, tiny, capsys):
    """`trainbox inspect RUN` (or a checkpoint of it): the run's data.path with its tokenizer, window and global
    batch, so its samples and steps per epoch are the ones the run's train.log states; an option given overrides
    the run's. A run that reads its data as examples (preference pairs) is refused in one message."""
    from trainbox.cli import main
    from trainbox.config import load_config
    from trainbox.config.load import dump_yaml

    run_cli("train", "tiny", *tiny, "train.max_steps=2", "train.eval_every=0", "train.sample_tokens=0")
    run = tmp_path / "runs" / "tiny"
    log = (run / "train.log").read_text()
    said = re.search(r"([\d,]+) samples of 32; global batch 8 .*; ([\d,]+) steps/epoch", log)
    samples, per_epoch = (int(g.replace(",", "")) for g in said.groups())
    capsys.readouterr()
    assert main(["inspect", str(run), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["path"], r["seq_len"], r["tokenizer"]) == ("embedded:shakespeare", 32, "embedded:shakespeare-bpe")
    assert (r["train"]["samples"], r["steps_per_epoch"], r["global_batch"]) == (samples, per_epoch, 8)
    assert r["run"] == {"path": str(run), "data.path": "embedded:shakespeare", "data.tokenizer":
                        "embedded:shakespeare-bpe", "max_steps": 2, "epochs": round(2 / per_epoch, 4)}
    assert main(["inspect", str(run / "checkpoints" / "step_00000002"), "--global-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {run / 'checkpoints' / 'step_00000002'}: data.path=embedded:shakespeare, "
                          "data.tokenizer=embedded:shakespeare-bpe, whose 2 steps are ")
    assert f"global batch 4: {samples // 4:,} steps per epoch" in out
    pairs = tmp_path / "runs" / "pairs"
    pairs.mkdir()
    (pairs / "config.yaml").write_text(dump_yaml(load_config("tiny", [*tiny, "train.objective=dpo"])))
    (pairs / "status.json").write_text("{}")
    assert main(["inspect", str(pairs)]) == 1   # its pairs, as the run reads them: there are none
    assert capsys.readouterr().err.startswith("trainbox inspect: data.path=embedded:shakespeare holds no preference "
                                              "data")


def test_raw_jsonl_as_data_path_trains(corpus, tmp_path, tiny):
    d, _ = corpus
    cache = tmp_path / "cache"   # its own: the session's cache holds what other tests prepared
    args = [a for a in tiny if not a.startswith("data.cache_dir=")]
    p = run_cli("train", *args, f"data.cache_dir={cache}", f"data.path={d / 'a.jsonl'}", "train.max_steps=2",
                "train.sample_tokens=0")
    assert "run directory" in p.stdout
    prepared = list(cache.glob("prepared-*/data_train_000001.bin"))
    assert len(prepared) == 1 and (prepared[0].parent / "COMPLETE").is_file()


def test_text_with_no_document_held_out_says_so_and_data_val_path_takes_text(corpus, tmp_path, tiny):
    """A text file is one document, and 1% of one document held out is none: the run says it reports no validation
    loss. data.val_path takes text too, tokenized whole into the cache as the validation data; a data.val_path that
    names nothing is refused before training."""
    d, docs = corpus
    (tmp_path / "train.txt").write_text("\n\n".join(docs[:100]))
    held = "To be, or not to be, that is the question.\n" * 5
    (tmp_path / "val.txt").write_text(held)
    base = ["train", *tiny, f"data.path={tmp_path / 'train.txt'}", "train.max_steps=2", "train.sample_tokens=0"]
    p = run_cli(*base)
    assert f"no validation data in data.path={tmp_path / 'train.txt'}: the run reports no validation loss" in p.stderr
    events = [json.loads(e) for e in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2]
    assert not [e for e in events if e["event"] == "eval"] and "validation:" not in p.stdout
    p = run_cli(*base, f"data.val_path={tmp_path / 'val.txt'}", "run.name=val")
    n = len(get_tokenizer("embedded:shakespeare-bpe").encode(held)) + 1   # with the EOT before the document
    assert f"data: 1 documents, {n:,} tokens (all for validation)" in p.stderr, p.stderr
    # evaluated in whole windows of data.seq_len=32 (+1) tokens: all of the held-out text's that fit
    assert "no validation data" not in p.stderr and f"bits/byte ({(n - 1) // 32 * 32} tokens)" in p.stdout
    bad = run_cli(*base, f"data.val_path={tmp_path / 'nope.bin'}", "run.name=bad", check=False)
    assert bad.returncode == 1 and f"data.val_path={tmp_path / 'nope.bin'}: no such file" in bad.stderr
    assert not (tmp_path / "runs" / "bad" / "metrics.jsonl").exists()


def test_trained_tokenizer_output_is_accepted(corpus, tmp_path):
    from trainbox.data.tokenizer import train_bpe

    d, docs = corpus
    tok_file, _ = train_bpe(docs, 300, tmp_path / "tok")
    st = prepare(PrepareOptions([str(d / "a.jsonl")], str(tmp_path / "x"), tokenizer=str(tmp_path / "tok")))
    tok = get_tokenizer(str(tok_file.parent))
    got = formats.read_shard(tmp_path / "x_train_000001.bin")
    want = [[tok.eot_id] + hf_ordinary(str(tok_file.parent), t) for t in docs[:200]]
    assert np.array_equal(got, np.concatenate(want))
    assert int((got == tok.eot_id).sum()) == 200  # a literal "<|endoftext|>" in the text is not a boundary
    assert st.tokens == len(got) and int(got.max()) < 300


def test_tokenizer_train_reads_inputs_as_prepare_does(tmp_path, capsys):
    """`trainbox tokenizer train` learns from the texts prepare would tokenize (a JSONL file's text fields and a
    chat record's messages, never their JSON syntax; a .txt file whole): the tokenizer equals one trained on those
    texts. It says when the text had fewer merges than asked, and refuses a missing input, a record without the
    field, empty text (nothing written) and a vocabulary too small to hold the bytes (a usage error)."""
    from trainbox.cli import main
    from trainbox.data.tokenizer import train_bpe

    rows = [{"text": "the quick brown fox jumps"}, {"text": "over the lazy dog, the end"}]
    chat = {"messages": [{"role": "user", "content": "who jumps?"}, {"role": "assistant", "content": "the fox"}]}
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, chat]))
    (tmp_path / "b.txt").write_text("a plain text file, whole")
    texts = [r["text"] for r in rows] + ["who jumps?", "the fox", "a plain text file, whole"]
    assert main(["tokenizer", "train", str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt"), "--vocab-size", "400",
                 "--out", str(tmp_path / "cli.json")]) == 0
    ref, size = train_bpe(texts, 400, tmp_path / "ref.json")
    assert json.loads((tmp_path / "cli.json").read_text()) == json.loads(ref.read_text())
    assert size < 400 and f"(vocab {size}, fewer than the 400 asked" in capsys.readouterr().out
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "k.jsonl").write_text('{"body": "x"}\n')
    for args, code, said in (([str(tmp_path / "nope.txt")], 1, "input "), ([str(tmp_path / "k.jsonl")], 1,
                             "k.jsonl:1: no string field 'text' (fields: body)"),
                             ([str(tmp_path / "empty.txt")], 2, "no text to learn from"),
                             ([str(tmp_path / "b.txt"), "--vocab-size", "256"], 2, "--vocab-size 256 is too small")):
        size_given = [] if "--vocab-size" in args else ["--vocab-size", "300"]
        assert main(["tokenizer", "train", *args, *size_given, "--out", str(tmp_path / "t.json")]) == code
        assert said in capsys.readouterr().err and not (tmp_path / "t.json").exists()


def test_killed_prepare_leaves_no_final_file(tmp_path):
    """prepare reads a named pipe; once a shard is being written, the process is killed outright.
    (A clean failure removing its temporaries is test_overwrite_and_atomic_outputs.)"""
    import os
    import signal
    import subprocess
    import sys
    import time

    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    cmd = [sys.executable, "-m", "trainbox", "prepare", str(fifo), "--out", str(tmp_path / "x"), "--workers", "2",
           "--shard-tokens", "1000", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = (json.dumps({"text": "some words here " * 40}) + "\n").encode()
    with open(fifo, "wb") as w:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("x_train_*.partial")):  # feed the pipe until a shard is being written
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            w.write(line * 256)
            w.flush()
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert list(tmp_path.glob("x_train_*.partial"))
    assert not list(tmp_path.glob("x_*.bin")) and not list(tmp_path.glob("x_*.idx"))  # no final name, ever


def test_append_eod_reported_count_equals_tokens_written(corpus, tmp_path):
    d, _ = corpus
    for keys in (["text"], ["text", "title"]):
        out = tmp_path / "-".join(keys) / "x"
        st = prepare(PrepareOptions([str(d / "a.jsonl")], str(out), format="megatron", append_eod=True,
                                    val_fraction=0.1, text_keys=keys))
        tag = lambda split: "" if split == "train" else "_val"  # noqa: E731
        written = {s: sum(len(megatron.read_megatron(f"{out}{tag(s)}_{k}_document").tokens) for k in keys)
                   for s in ("train", "val")}
        assert (st.tokens, st.val_tokens) == (written["train"] + written["val"], written["val"])
        eods = sum(int((megatron.read_megatron(f"{out}_{k}_document").tokens == EOT).sum()) for k in keys)
        assert eods >= len(keys) * (st.documents - st.val_documents)


def test_empty_input_is_a_usage_error(tmp_path):
    for name, content in (("empty.txt", b""), ("empty.jsonl", b""), ("blank.jsonl", b"\n\n")):
        (tmp_path / name).write_bytes(content)
        p = run_cli("prepare", str(tmp_path / name), "--out", str(tmp_path / "o/x"), "--quiet", check=False)
        assert p.returncode == 2, p.stdout + p.stderr
        assert f"{tmp_path / name}" in p.stderr and "no tokens" in p.stderr, p.stderr
        assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())
    with pytest.raises(DataError, match="no tokens") as e:
        prepare(PrepareOptions([str(tmp_path / "empty.txt")], str(tmp_path / "o/x")))
    assert e.value.exit_code == 2


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path):
    """`trainbox inspect PREFIX --json | head -1`: far more output than a pipe holds, the reader leaves early."""
    import subprocess
    import sys

    prefix = tmp_path / ("p" * 200)
    for i in range(300):
        formats.write_shard(f"{prefix}_train_{i:06d}.bin", np.arange(20, dtype=np.uint16))
    proc = subprocess.Popen([sys.executable, "-m", "trainbox", "inspect", str(prefix), "--seq-len", "8", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 141) and err == "", err


def test_prepared_set_is_whole_or_refused(corpus, tmp_path):
    """prepare writes OUT.manifest.json last; readers refuse a set with a listed file missing or resized, or an
    unlisted file among its outputs, and --overwrite replaces the set as a whole."""
    from trainbox.config import DataSection
    from trainbox.data.sources import resolve

    d, _ = corpus
    out = tmp_path / "x"
    st = prepare(PrepareOptions([str(d / "a.jsonl")], str(out), shard_tokens=1000, val_docs=5))
    manifest = json.loads((tmp_path / "x.manifest.json").read_text())
    assert manifest["state"] == "complete" and manifest["tokenizer"] == "gpt2"
    names = sorted(f["name"] for f in manifest["files"])
    assert names == sorted(p.name for p in tmp_path.glob("x_*"))
    assert sum(f["tokens"] for f in manifest["files"]) == st.tokens
    assert str(tmp_path / "x.manifest.json") in st.files
    tok = get_tokenizer("gpt2")
    cfg = DataSection(path=str(out))
    train, val = resolve(cfg, tok)
    assert len(train) == len(names) - 1 and len(val) == 1

    last = tmp_path / names[-1]
    saved = last.read_bytes()
    last.unlink()
    with pytest.raises(DataError, match=rf"{last}: listed in .*x\.manifest\.json .* is missing; the prepared set is "
                                        r"not whole"):
        resolve(cfg, tok)
    last.write_bytes(saved[:-2])
    with pytest.raises(DataError, match=rf"{last}: listed in .*x\.manifest\.json with {len(saved)} bytes but has "
                                        rf"{len(saved) - 2}"):
        resolve(cfg, tok)
    last.write_bytes(saved)
    stray = tmp_path / "x_train_000099.bin"
    formats.write_shard(stray, np.arange(10, dtype=np.uint16))
    with pytest.raises(DataError, match=rf"{stray}: not listed in .*x\.manifest\.json"):
        resolve(cfg, tok)
    p = run_cli("inspect", str(out), "--seq-len", "8", check=False)
    assert p.returncode == 1 and "x_train_000099.bin: not listed in" in p.stderr
    prepare(PrepareOptions([str(d / "b.jsonl.gz")], str(out), overwrite=True))
    assert sorted(p.name for p in tmp_path.glob("x*")) == ["x.manifest.json", "x_train_000001.bin"]
    assert len(resolve(cfg, tok)[0]) == 1


def test_write_vocab_replaces_no_file_without_overwrite_and_never_an_input(tmp_path):
    """--write-vocab is refused before any work when gpt2-vocab.json or gpt2-merges.txt is an input (even with
    --overwrite) or another file already there (without --overwrite); a file with the very bytes it would write
    is left as it is."""
    (tmp_path / "a.txt").write_text("some text\n")
    notes = tmp_path / "gpt2-merges.txt"
    notes.write_text("my notes\n")
    for overwrite in (False, True):   # the folder is the input: gpt2-merges.txt is one of its documents
        with pytest.raises(DataError, match=r"gpt2-merges\.txt is an input") as e:
            prepare(PrepareOptions([str(tmp_path)], str(tmp_path / "x"), format="megatron", write_vocab=True,
                                   overwrite=overwrite))
        assert "--out" in e.value.hint
    with pytest.raises(DataError, match=r"gpt2-merges\.txt already exists") as e:
        prepare(PrepareOptions([str(tmp_path / "a.txt")], str(tmp_path / "x"), format="megatron", write_vocab=True))
    assert "--overwrite" in e.value.hint
    assert notes.read_text() == "my notes\n" and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", notes.name]
    prepare(PrepareOptions([str(tmp_path / "a.txt")], str(tmp_path / "x"), format="megatron", write_vocab=True,
                           overwrite=True))
    assert notes.read_bytes() == asset_path("vocab.bpe").read_bytes()
    st = prepare(PrepareOptions([str(tmp_path / "a.txt")], str(tmp_path / "y"), write_vocab=True))  # the same bytes
    assert str(notes) in st.files


def test_no_training_document_is_refused_and_an_empty_validation_split_is_said(tmp_path):
    """--val-docs that holds out every document is refused and leaves the previous outputs as they were; a
    --val-fraction that holds out no document says so, and what would hold one out."""
    for i in range(6):
        (tmp_path / f"d{i}.txt").write_text(" ".join(make_docs(3, seed=i)))
    inputs, out = [str(tmp_path / f"d{i}.txt") for i in range(6)], tmp_path / "o/x"
    prepare(PrepareOptions(inputs, str(out), val_docs=1))
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    for n in (6, 9):
        with pytest.raises(DataError, match=f"--val-docs {n} holds out all 6 documents: none is left for training"
                           ) as e:
            prepare(PrepareOptions(inputs, str(out), val_docs=n, overwrite=True))
        assert "--val-docs 5" in e.value.hint
        assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before
    p = run_cli("prepare", *inputs, "--out", str(tmp_path / "f/x"), "--val-fraction", "0.1", "--quiet")
    assert ("--val-fraction 0.1 held out none of the 6 documents: no validation data was written; hold one out "
            "with --val-fraction 0.17 or --val-docs 1") in p.stderr, p.stderr
    assert "--val-fraction" not in run_cli("prepare", *inputs, "--out", str(tmp_path / "g/x"), "--val-fraction",
                                           "0.17", "--quiet").stderr
