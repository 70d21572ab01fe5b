"""Input errors of `trainbox prepare` and `trainbox inspect` (data/readers.py, data/tokenizer.py), run as a user runs
them: each names the file and line (or the tokenizer path), says what is wrong, and gives a next step that the
verb at hand accepts."""
from __future__ import annotations

import json
import re

import pytest
from conftest import run_cli

from trainbox.cli.parser import build_parser
from trainbox.data.readers import first_record_is_chat, first_row_is_preference
from trainbox.data.tokenizer import HFTokenizer, get_tokenizer
from trainbox.errors import DataError


def _error(proc) -> tuple[str, str]:
    """(message, hint) of a failed CLI run; the hint is the `  -> ` line."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "unexpected error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    hints = [ln.split("-> ", 1)[1] for ln in lines if ln.lstrip().startswith("-> ")]
    return lines[0], hints[0] if hints else ""


@pytest.mark.parametrize("blank_lines", [0, 2])
def test_bad_utf8_on_the_first_line_names_file_line_and_offset(tmp_path, blank_lines):
    """The first record is read in the main process (is it chat? preference?) before the workers read the rest: its
    bad bytes get the same message as any other line's."""
    f = tmp_path / "l1.jsonl"
    f.write_bytes(b"\n" * blank_lines + b'{"text":"caf\xe9"}\n{"text":"ok"}\n')
    msg, hint = _error(run_cli("prepare", str(f), "--out", str(tmp_path / "out"), "--quiet", check=False))
    line, offset = 1 + blank_lines, blank_lines + len(b'{"text":"caf')
    assert msg.endswith(f"{f}:{line}: invalid UTF-8 at byte offset {offset}"), msg
    assert "UTF-8" in hint
    for peek in (first_row_is_preference, first_record_is_chat):
        with pytest.raises(DataError, match=re.escape(f"{f}:{line}: invalid UTF-8 at byte offset {offset}")):
            peek(f)


def test_bad_utf8_on_a_later_line_reads_as_on_the_first(tmp_path):
    f = tmp_path / "l3.jsonl"
    f.write_bytes(b'{"text":"a"}\n{"text":"b"}\n{"text":"caf\xe9"}\n')
    msg, hint = _error(run_cli("prepare", str(f), "--out", str(tmp_path / "out"), "--quiet", check=False))
    offset = len(b'{"text":"a"}\n{"text":"b"}\n{"text":"caf')
    assert msg.endswith(f"{f}:3: invalid UTF-8 at byte offset {offset}"), msg
    assert "UTF-8" in hint


@pytest.mark.parametrize("content, reason", [
    ('{"a": 1}\n', "no 'model' section (its keys: a)"),
    ('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}\n', "no 'model' section"),
    ("[1, 2]\n", "no 'model' section (it is a JSON list)"),
    ('{"model": \n', "not valid JSON"),
])
def test_a_json_file_that_is_not_a_tokenizer_says_so(tmp_path, content, reason):
    t = tmp_path / "config.json"
    t.write_text(content)
    with pytest.raises(DataError) as err:
        HFTokenizer(t)
    assert err.value.message.startswith(f"{t} is not a tokenizer.json (a Hugging Face tokenizers file): {reason}")
    assert err.value.hint == "give a model folder with tokenizer.json, or gpt2"


def test_prepare_with_a_tokenizer_path_that_is_not_a_tokenizer(tmp_path):
    t = tmp_path / "t.json"
    t.write_text('{"a":1}\n')
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "d.txt").write_text("the king and the queen " * 50)
    msg, hint = _error(run_cli("prepare", str(tmp_path / "c"), "--out", str(tmp_path / "out"), "--tokenizer", str(t),
                               "--quiet", check=False))
    assert f"{t} is not a tokenizer.json" in msg and "expected" not in msg, msg
    assert hint == "give a model folder with tokenizer.json, or gpt2"
    get_tokenizer.cache_clear()


def test_a_chat_record_in_a_plain_text_file_is_named_as_one(tmp_path):
    f = tmp_path / "tc.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    f.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps(chat) + "\n")
    msg, hint = _error(run_cli("prepare", str(f), "--out", str(tmp_path / "out"), "--quiet", check=False))
    assert f"{f}:2: a chat record" in msg and "read as plain text" in msg, msg
    assert "not a list" not in msg
    assert "separate files" in hint


def test_a_messages_field_that_is_not_a_list_still_says_what_it_should_be(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"messages": "hi"}) + "\n")
    msg, _ = _error(run_cli("prepare", str(f), "--out", str(tmp_path / "out"), "--quiet", check=False))
    assert "a chat record's 'messages' is a list of messages, not a str" in msg, msg


def _options(verb: str) -> set[str]:
    sub = next(a for a in build_parser()._subparsers._group_actions if a.choices and verb in a.choices)
    return {o for a in sub.choices[verb]._actions for o in a.option_strings}


@pytest.mark.parametrize("verb", ["prepare", "inspect"])
def test_a_missing_text_field_hint_names_options_the_verbs_have(tmp_path, verb):
    """The hint is made where the record is read, for every verb: each option it names is given with the verbs that
    have it, and following it for prepare works."""
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}) + "\n"
                         for _ in range(8)))
    args = ["--out", str(tmp_path / "out"), "--quiet"] if verb == "prepare" else []
    msg, hint = _error(run_cli(verb, str(f), *args, check=False))
    assert "no string field 'text' (fields: answer, prompt)" in msg, msg
    named = re.findall(r"`(prepare|inspect|train|tokenizer train) (--[a-z-]+)", hint)
    assert named, hint
    for where, option in named:
        assert option in _options(where.split()[0]), f"{hint!r}: {where} has no {option}"
    assert "--text-key" not in hint.replace("`prepare --text-key", "").replace("`tokenizer train --text-key", "")
    assert "data.text_key=[answer]" in hint
    run_cli("prepare", str(f), "--text-key", "answer", "--out", str(tmp_path / "followed"), "--quiet")


@pytest.mark.parametrize("row", [{"text": "a plain line"}, {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}])
def test_a_gz_name_on_a_plain_file_says_it_is_not_gzip(tmp_path, row):
    """A plain JSONL file renamed x.jsonl.gz: one message naming it, for prepare, train and every reader of JSONL;
    renamed back as the hint says, it is read."""
    from trainbox.data.readers import json_objects

    f = tmp_path / "x.jsonl.gz"
    f.write_text(json.dumps(row) + "\n")
    said = f"{f}: not gzip-compressed, though its name ends in .gz (its first bytes are 7b 22, a gzip file's 1f 8b)"
    msg, hint = _error(run_cli("prepare", str(f), "--out", str(tmp_path / "out"), "--quiet", check=False))
    assert msg == f"trainbox prepare: {said}", msg
    assert f"mv {f} {tmp_path / 'x.jsonl'}" in hint and "gzip" in hint
    train = run_cli("train", "tiny", f"data.path={f}", f"run.dir={tmp_path / 'runs'}",
                    f"data.cache_dir={tmp_path / 'cache'}", check=False)
    _error(train)
    assert [ln for ln in train.stderr.splitlines() if ln.startswith("trainbox train:")] == [f"trainbox train: {said}"]
    with pytest.raises(DataError) as e:
        list(json_objects(f))
    assert e.value.message == said
    f.rename(tmp_path / "x.jsonl")
    run_cli("prepare", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "out"), "--quiet")


@pytest.mark.parametrize("form", ["messages", "implicit"])
def test_inspect_of_chat_preferences_without_a_template_names_its_own_option(tmp_path, form):
    """Preference rows of messages under a tokenizer with no chat template (gpt2, inspect's default): the hint names
    --chat-template for inspect, and inspect run with it counts the pairs."""
    import hf_tiny

    f = hf_tiny.make_preference_file(tmp_path / "prefs.jsonl", n=12, form=form)
    env = {"HOME": str(tmp_path)}   # raw preference JSONL is prepared into ~/.cache/trainbox, as training does
    msg, hint = _error(run_cli("inspect", str(f), env=env, check=False))
    assert msg == f"trainbox inspect: {f}:1: message rows, but the tokenizer gpt2 has no chat template", msg
    named = re.search(r"--chat-template (\S+) \(([^)]*)\)", hint)
    assert named and "inspect" in named.group(2).split(", "), hint
    assert "--chat-template" in _options("inspect")
    r = json.loads(run_cli("inspect", str(f), "--chat-template", named.group(1), "--json", env=env).stdout)
    assert (r["unit"], r["train"]["pairs"]) == ("pairs", 12)
