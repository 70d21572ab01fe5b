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
