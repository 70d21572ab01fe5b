"""First-hour affordances: plots in the default install, a readable `config schema`, and a `prepare` hint
whose command trains a new run."""
from __future__ import annotations

import json
import re
import shlex
import sys

import pytest
from conftest import REPO, TINY, run_cli


def test_matplotlib_is_a_core_dependency():
    """loss.png is written by a default install: matplotlib is among the dependencies, and the `plot` extra
    (old install lines) still exists."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"matplotlib\b", d) for d in project["dependencies"])
    assert "plot" in project["optional-dependencies"]


def test_missing_matplotlib_does_not_point_at_the_extra(monkeypatch):
    from trainbox.errors import MissingDependency
    from trainbox.monitor import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependency) as e:
        plot._figure()
    assert "trainbox[plot]" not in e.value.hint and "matplotlib" in e.value.hint


def test_config_schema_lists_keys_readably():
    out = run_cli("config", "schema").stdout
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == ["train.max_steps"])
    assert "int | None" in line and "= null" in line
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == ["train.global_batch_size"])
    assert "int (>=1, <=1048576)" in line and "= 512" in line and "sequences per optimizer step" in line
    assert any(ln.split()[:1] == ["model.moe.top_k"] for ln in out.splitlines())
    assert "\ntrain:\n" in out and len(out.splitlines()) < 300
    schema = json.loads(run_cli("config", "schema", "--json").stdout)
    assert "properties" in schema and "train" in schema["properties"]


def test_prepare_hint_trains_a_new_run(tmp_path, data_cache):
    """The command `prepare` prints trains on the new data as a run of its own (not the default tiny run)."""
    corpus = tmp_path / "texts"
    corpus.mkdir()
    from trainbox.data import embedded
    text = "\n".join(embedded.split("train"))[:60_000]
    for i in range(6):
        (corpus / f"{i}.txt").write_text(text[i * 10_000:(i + 1) * 10_000])
    run_cli("train", "tiny", *TINY, f"data.cache_dir={data_cache}", "train.max_steps=1", cwd=tmp_path)  # runs/tiny
    out = run_cli("prepare", str(corpus), "--out", "data/mine", "--tokenizer", "embedded:shakespeare-bpe",
                  "--val-docs", "1", "--quiet", cwd=tmp_path).stdout
    hint = next(ln for ln in out.splitlines() if ln.startswith("train on it with: "))
    cmd = shlex.split(hint.split(": ", 1)[1])
    assert cmd[:2] == ["trainbox", "train"] and "run.name=mine" in cmd
    small = [o for o in TINY if not o.startswith("data.tokenizer=")]
    proc = run_cli(*cmd[1:], *small, f"data.cache_dir={data_cache}", "train.max_steps=2", "train.eval_every=0",
                   cwd=tmp_path)
    assert "already finished" not in proc.stdout + proc.stderr
    status = json.loads((tmp_path / "runs" / "mine" / "status.json").read_text())
    assert status["phase"] == "finished" and status["step"] == 2


def test_prepare_hint_of_megatron_text_keys_trains(tmp_path, data_cache):
    """`prepare --format megatron --text-key q` prints a command with data.text_key=[q], and it trains; training on
    the set without it names data.text_key=[q]."""
    rows = "".join(json.dumps({"q": f"the king and the queen of day {i}"}) + "\n" for i in range(200))
    (tmp_path / "qa.jsonl").write_text(rows)
    out = run_cli("prepare", "qa.jsonl", "--text-key", "q", "--format", "megatron", "--out", "data/qa",
                  "--tokenizer", "embedded:shakespeare-bpe", "--quiet", cwd=tmp_path).stdout
    cmd = shlex.split(next(ln for ln in out.splitlines() if ln.startswith("train on it with: ")).split(": ", 1)[1])
    assert "data.text_key=[q]" in cmd
    small = [o for o in TINY if not o.startswith("data.tokenizer=")]
    run = [*small, f"data.cache_dir={data_cache}", "train.max_steps=1", "train.eval_every=0", "train.sample_tokens=0"]
    run_cli(*cmd[1:], *run, cwd=tmp_path)
    assert json.loads((tmp_path / "runs" / "qa" / "status.json").read_text())["phase"] == "finished"
    bad = run_cli(*[a for a in cmd[1:] if not a.startswith("data.text_key=")], *run, "run.name=nokey", cwd=tmp_path,
                  check=False)
    assert bad.returncode == 1 and "data/qa_q_document" in bad.stderr and "data.text_key=[q]" in bad.stderr, bad.stderr


@pytest.mark.parametrize("flag,value", [("--global-batch", "0"), ("--global-batch", "-4"), ("--seq-len", "0"),
                                        ("--seq-len", "-5"), ("--epochs", "0"), ("--epochs", "-1")])
def test_inspect_refuses_counts_below_one(tmp_path, capsys, flag, value):
    from trainbox.cli import main
    from trainbox.data.prepare import PrepareOptions, prepare

    (tmp_path / "a.txt").write_text("the king and the queen " * 200)
    prepare(PrepareOptions([str(tmp_path / "a.txt")], str(tmp_path / "x")))
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "x"), flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}: " in err and "must be" in err and "-> " in err, err


def test_data_of_another_tokenizer_than_the_models_says_to_prepare_it_again(tmp_path):
    """Token data prepared with one model folder's tokenizer, trained with model.path of another whose vocabulary
    is smaller: the hint is to prepare it again with this model's tokenizer (the command, from the set's manifest),
    not to set data.tokenizer (which the model's embedding cannot take)."""
    import hf_tiny

    a, b = hf_tiny.make_model(tmp_path / "a", vocab_size=320), hf_tiny.make_model(tmp_path / "b", vocab_size=280)
    (tmp_path / "t.txt").write_text(" ".join(hf_tiny.WORDS * 40))
    run_cli("prepare", "t.txt", "--tokenizer", str(a), "--out", "p", "--quiet", cwd=tmp_path)
    t = run_cli("train", "lora", f"model.path={b}", "data.path=p", "data.seq_len=32", "train.global_batch_size=4",
                "train.micro_batch_size=2", f"run.dir={tmp_path}", "monitor.port=0", "train.max_steps=1",
                "train.sample_tokens=0", "train.threads=1", cwd=tmp_path, check=False)
    assert t.returncode == 1 and "data.tokenizer=" not in t.stderr, t.stderr
    assert f"data.path=p was prepared with the tokenizer {a} (p.manifest.json), not with {b}" in t.stderr, t.stderr
    assert f"trainbox prepare t.txt --tokenizer {b} --out p --overwrite" in t.stderr, t.stderr
