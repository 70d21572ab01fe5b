"""The data against the run's tokenizer and model (data/identity.py, data/sources.py): a prepared set of another
tokenizer is refused, one of the run's own is read wherever it lies, and token ids past a Hugging Face model's
vocabulary (data.tokenizer naming a larger tokenizer) are refused before training in one message."""
from __future__ import annotations

import json
import logging
import shutil

import hf_tiny
import pytest
from conftest import run_cli

from trainbox.config import DataSection
from trainbox.data import embedded, manifest
from trainbox.data.sources import open_datasets
from trainbox.data.tokenizer import get_tokenizer, train_bpe
from trainbox.errors import DataError


@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory):
    """Two byte-level BPEs of 300 ids each, learnt from other texts: one vocabulary size, other tokens."""
    d = tmp_path_factory.mktemp("toks")
    texts = embedded.split("train")[:40]
    a, size_a = train_bpe(texts, 300, d / "a")
    b, size_b = train_bpe([t.upper() for t in texts], 300, d / "b")
    assert size_a == size_b == 300 and a.read_bytes() != b.read_bytes()
    return a.parent, b.parent


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A folder of two plays, one document each."""
    d = tmp_path_factory.mktemp("text") / "plays"
    d.mkdir()
    for i, play in enumerate(embedded.split("val")[:2]):
        (d / f"{i}.txt").write_text(play)
    return d


def _train_tokens(m: dict) -> int:
    return next(e["tokens"] for e in m["files"] if "_train_" in e["name"])


def _open(prefix, tok_spec: str, vocab: int | None = None):
    tok = get_tokenizer(tok_spec)
    return open_datasets(DataSection(path=str(prefix), tokenizer=tok_spec, seq_len=16), tok, vocab or tok.vocab_size)


def test_a_plain_set_is_refused_under_another_tokenizer_of_the_same_size(tmp_path, two_tokenizers, text, tiny):
    """Both tokenizers have 300 ids, so the ids fit either: only the manifest tells. `trainbox train` with the other
    one is refused before training, naming both tokenizers and the prepare command; the set's own tokenizer given by
    another path or a copy of its folder reads it, and so does any tokenizer once no manifest speaks for the files
    (downloaded shards)."""
    a, b = two_tokenizers
    out = tmp_path / "data" / "plays"
    run_cli("prepare", str(text), "--out", str(out), "--tokenizer", str(a), "--val-docs", "1")
    res = run_cli("train", "tiny", *tiny, f"data.path={out}", f"data.tokenizer={b}", "run.name=other", check=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr and "unexpected" not in res.stderr, res.stderr
    msg = res.stderr.strip().splitlines()
    assert msg[0] == (f"trainbox train: data.path={out} was prepared with the tokenizer {a} "
                      f"({manifest.manifest_path(out)}), not with {b / 'tokenizer.json'}: its token ids stand for "
                      f"other text under {b / 'tokenizer.json'}"), msg
    assert (f"trainbox prepare {text} --tokenizer {b / 'tokenizer.json'} --out {out} --val-docs 1 --overwrite"
            in msg[1])
    assert not (tmp_path / "runs" / "other" / "checkpoints").exists()
    m = json.loads(manifest.manifest_path(out).read_text())
    assert m["tokenizer"] == str(a) and len(m["tokenizer_sha256"]) == 64 and m["vocab_size"] == 300
    with pytest.raises(DataError, match="was prepared with the tokenizer"):
        _open(out, str(b))
    copy = shutil.copytree(a, tmp_path / "copy")
    for same in (str(a / "tokenizer.json"), str(copy)):
        assert _open(out, same)[0].num_tokens == _train_tokens(m)
    manifest.manifest_path(out).unlink()
    assert _open(out, str(b))[0].num_tokens > 0


def test_gpt2_matches_itself_wherever_the_set_lies(tmp_path, text, monkeypatch):
    """The built-in gpt2 has no file to hash: it is named gpt2 on every machine, and a set prepared with it is read
    under gpt2 from another folder and another working directory, and refused under a tokenizer of other ids."""
    out = tmp_path / "a" / "plays"
    run_cli("prepare", str(text), "--out", str(out), "--val-docs", "1")
    m = json.loads(manifest.manifest_path(out).read_text())
    assert (m["tokenizer"], m["tokenizer_sha256"]) == ("gpt2", None)
    moved = shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    monkeypatch.chdir(moved)
    assert _open("plays", "gpt2")[0].num_tokens == _train_tokens(m)
    with pytest.raises(DataError, match="prepared with the tokenizer gpt2"):
        _open("plays", "embedded:shakespeare-bpe", 50304)


def test_a_tokenizer_that_cannot_be_compared_is_named_in_a_warning(tmp_path, two_tokenizers, text, caplog):
    """A manifest naming a tokenizer folder that is not here, with no digest: of the run's vocabulary size the set
    is read with a warning naming both; of another size it is refused."""
    a, _ = two_tokenizers
    out = tmp_path / "plays"
    run_cli("prepare", str(text), "--out", str(out), "--tokenizer", str(a), "--val-docs", "1")
    man = manifest.manifest_path(out)
    m = json.loads(man.read_text())
    manifest.write_manifest(man, {**m, "tokenizer": "models/gone", "tokenizer_sha256": None})
    with caplog.at_level(logging.WARNING, logger="trainbox"):
        assert _open(out, str(a))[0].num_tokens > 0
    assert any("prepared with the tokenizer models/gone" in r.message and "cannot be told" in r.message
               for r in caplog.records)
    manifest.write_manifest(man, {**m, "tokenizer": "models/gone", "tokenizer_sha256": None, "vocab_size": 512})
    with pytest.raises(DataError, match="prepared with the tokenizer models/gone"):
        _open(out, str(a))


# ----------------------------------------------------------------------------- ids past the model's vocabulary


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A (346 ids) and B (320 ids): tiny Hugging Face models whose tokenizers share their first ids."""
    d = tmp_path_factory.mktemp("models")
    a, b = hf_tiny.make_model(d / "A", vocab_size=400), hf_tiny.make_model(d / "B", vocab_size=320)
    sizes = [json.loads((m / "config.json").read_text())["vocab_size"] for m in (a, b)]
    assert sizes[0] > sizes[1] == 320
    return a, b


def test_lora_with_a_larger_data_tokenizer_is_refused_before_training(tmp_path, models):
    """`trainbox train lora model.path=B data.tokenizer=A`: the chat file tokenized with A reaches ids that B's
    embedding does not have; the run stops before its first step, saying how far the ids reach, B's vocabulary and
    the command that prepares the data with B's tokenizer."""
    a, b = models
    chat = hf_tiny.make_chat_file(tmp_path / "chat.jsonl")
    res = run_cli("train", "lora", f"model.path={b}", f"data.tokenizer={a}", f"data.path={chat}", "data.seq_len=64",
                  "train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=2", "lora.r=4",
                  f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}", "monitor.port=0",
                  "monitor.plot=false", check=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr and "unexpected" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("trainbox train:") or ln.lstrip().startswith("->")]
    assert lines[0].startswith(f"trainbox train: {chat}: the data's token ids reach ")
    assert "but the model's vocabulary is 320 ids (0 to 319): it was tokenized with" in lines[0]
    assert f"trainbox prepare {chat} --tokenizer MODEL --out PREFIX" in lines[1]
    assert "leave data.tokenizer unset" in lines[1]
    assert not list((tmp_path / "runs").glob("*/checkpoints/step_*"))


def test_prepared_tokens_past_the_models_vocabulary_name_the_model_and_the_command(tmp_path, models):
    """A set prepared with A's tokenizer and opened for B (320 ids): the same message, its command from the set's
    manifest."""
    a, _ = models
    chat = hf_tiny.make_chat_file(tmp_path / "chat.jsonl")
    out = tmp_path / "chat"
    run_cli("prepare", str(chat), "--out", str(out), "--tokenizer", str(a))
    with pytest.raises(DataError) as e:
        _open(out, str(a), 320)
    top = max(int(t.max()) for t in _open(out, str(a))[0].arrays)
    assert e.value.message.startswith(f"{out}_train_000001.bin: the data's token ids reach {top}, but the model's "
                                      "vocabulary is 320 ids (0 to 319; the first id past it at token ")
    assert f"trainbox prepare {chat} --tokenizer MODEL --out PREFIX" in e.value.hint
