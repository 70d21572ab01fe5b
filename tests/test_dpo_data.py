"""Preference data (data/preference.py): the row forms users have, the loss mask on the responses' assistant tokens,
the refusals that name the file and line, the truncation rule and its counts, `trainbox prepare` on preference
JSONL, and the batches of pairs the loop gets."""
from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "tests"))
import hf_tiny  # noqa: E402

from trainbox.config import load_config  # noqa: E402
from trainbox.data import pairs, preference  # noqa: E402
from trainbox.data.pairs import open_pair_datasets  # noqa: E402
from trainbox.data.preference import encode_pair, fit, pair_of, pair_template  # noqa: E402
from trainbox.errors import ConfigError, DataError  # noqa: E402
from trainbox.model.build import build_tokenizer, resolve_model  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_tiny.make_model(tmp_path_factory.mktemp("prefs") / "base")


@pytest.fixture(scope="module")
def tok(folder):
    return build_tokenizer(resolve_model(load_config("dpo", [f"model.path={folder}", "train.device=cpu"])))


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


USER = {"role": "user", "content": "what is two plus two"}
GOOD = {"role": "assistant", "content": "two plus two equals four"}
BAD = {"role": "assistant", "content": "it equals five"}


def test_message_forms_give_the_same_pair(tok):
    """TRL's conversational form, the implicit prompt (shared first turns) and UltraFeedback's (a text prompt with
    conversations that repeat it) give one pair; a text prompt with bare responses becomes the user's turn."""
    template = pair_template(tok, None)
    forms = [{"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
             {"chosen": [USER, GOOD], "rejected": [USER, BAD]},
             {"prompt": USER["content"], "chosen": [USER, GOOD], "rejected": [USER, BAD]},
             {"prompt": USER["content"], "chosen": [GOOD], "rejected": [BAD]}]
    pairs = [encode_pair(pair_of(row, f"row {i}"), tok, template, f"row {i}") for i, row in enumerate(forms)]
    assert all(p == pairs[0] for p in pairs)
    prompt, chosen, cmask, rejected, rmask = pairs[0]
    text = tok.decode(prompt)
    assert text.endswith("<|im_start|>assistant\n") and "two plus two" in text
    assert tok.decode(chosen) == "two plus two equals four<|im_end|>\n" and all(cmask)
    assert tok.decode(rejected) == "it equals five<|im_end|>\n" and all(rmask)


def test_only_assistant_tokens_of_a_response_carry_loss(tok):
    """A response of several turns trains on its assistant turns only (a user turn inside it has mask 0)."""
    row = {"prompt": [USER], "chosen": [GOOD, {"role": "user", "content": "and five"}, BAD], "rejected": [BAD]}
    _, chosen, cmask, _, _ = encode_pair(pair_of(row, "r"), tok, pair_template(tok, None), "r")
    trained = tok.decode([t for t, m in zip(chosen, cmask) if m])
    untrained = tok.decode([t for t, m in zip(chosen, cmask) if not m])
    assert trained == "two plus two equals four<|im_end|>\nit equals five<|im_end|>\n"
    assert "and five" in untrained and "two plus two" not in untrained


def test_a_rows_tools_reach_the_prompt_and_its_tool_calls_train(tok):
    """A preference row of function calls: its `tools` are in the prompt (untrained), each response's tool call is
    trained, and the two responses differ only where their calls do."""
    from trainbox.data.chat import ChatTemplate
    call = hf_tiny.TOOL_RECORD["messages"][1]
    wrong = {**call, "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Lyon"}}}]}
    row = {"tools": hf_tiny.TOOL_RECORD["tools"], "prompt": hf_tiny.TOOL_RECORD["messages"][:1], "chosen": [call],
           "rejected": [wrong]}
    template = ChatTemplate(hf_tiny.TOOLS, "tools")
    prompt, chosen, cmask, rejected, rmask = encode_pair(pair_of(row, "r"), tok, template, "r")
    assert "Météo d'une ville" in tok.decode(prompt) and tok.decode(prompt).endswith("<|im_start|>assistant\n")
    assert tok.decode([t for t, m in zip(chosen, cmask) if m]) == \
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    assert '"Lyon"' in tok.decode([t for t, m in zip(rejected, rmask) if m])


def test_text_rows_end_with_the_end_of_text_token(tok):
    p, c, cm, r, rm = encode_pair(pair_of({"prompt": "Q: two plus two?", "chosen": " four", "rejected": " five"},
                                          "r"), tok, None, "r")
    assert tok.decode(p) == "Q: two plus two?"
    assert c[-1] == r[-1] == tok.eot_id and tok.decode(c[:-1]) == " four" and all(cm) and all(rm)


@pytest.mark.parametrize("row, words", [
    ({"prompt": "q", "rejected": "b"}, "'chosen' is missing"),
    ({"prompt": "q", "chosen": "a"}, "'rejected' is missing"),
    ({"chosen": "a", "rejected": "b"}, "text responses need a text 'prompt'"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "'chosen' equals 'rejected'"),
    ({"chosen": [USER, GOOD], "rejected": [USER, GOOD]}, "'chosen' equals 'rejected'"),
    ({"chosen": [GOOD], "rejected": [BAD]}, "no prompt"),
    ({"prompt": [USER], "chosen": [USER], "rejected": [BAD]}, "no assistant tokens"),
    ({"prompt": "q", "chosen": ["x"], "rejected": "b"}, "both be text or both be message lists"),
])
def test_bad_rows_are_refused_naming_the_file_and_line(tmp_path, folder, tok, row, words):
    rows = [{"prompt": "q", "chosen": "a", "rejected": "b"}] * 2 + [row]
    path = write(tmp_path / "prefs.jsonl", rows)
    with pytest.raises(DataError) as e:
        preference.prepare_pairs([str(path)], str(tmp_path / "out"), tok, str(folder))
    assert f"{path}:3:" in str(e.value) and words in str(e.value)
    assert not list(tmp_path.glob("out*"))   # nothing written


def test_truncation_keeps_the_prompts_end_and_the_responses_start():
    """prompt + the longer response <= seq_len: the prompt loses its start down to max_prompt (half of seq_len by
    default) only as far as needed, then the responses lose their ends."""
    P, C, R = np.array([10, 40, 40, 70, 90]), np.array([5, 50, 10, 50, 5]), np.array([8, 30, 90, 20, 5])
    kept, c, r = fit(P, C, R, 100, None)
    assert kept.tolist() == [10, 40, 40, 50, 90]   # 3rd: under 50, kept whole; 4th: down to 50; 5th: it fits
    assert c.tolist() == [5, 50, 10, 50, 5] and r.tolist() == [8, 30, 60, 20, 5]
    kept, c, r = fit(P, C, R, 100, 30)
    assert kept.tolist() == [10, 40, 30, 50, 90] and r.tolist() == [8, 30, 70, 20, 5]
    assert (kept + np.maximum(c, r) <= 100).all()
    kept, c, r = fit(np.array([70]), np.array([60]), np.array([60]), 100, 30)
    assert (kept.tolist(), c.tolist(), r.tolist()) == ([40], [60], [60])


def test_prepare_command_reports_counts_and_training_reads_the_set(tmp_path, folder, tok):
    """`trainbox prepare` on preference JSONL writes the pair files under a manifest, reports pairs, validation
    pairs and what --seq-len cuts; the datasets cut the same pairs the same way, and a prompt longer than a shorter
    data.seq_len keeps its end."""
    long_prompt = " ".join(["one two three four"] * 12)
    long_answer = " " + " ".join(["one two three four five six seven eight nine ten"] * 4)
    rows = [{"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}] * 6 + \
        [{"prompt": long_prompt, "chosen": long_answer, "rejected": " five"}] * 2
    src = write(tmp_path / "prefs.jsonl", rows)
    out = tmp_path / "data" / "prefs"
    res = run_cli("prepare", str(src), "--tokenizer", str(folder), "--out", str(out), "--seq-len", "64",
                  "--max-prompt-len", "40", "--val-docs", "2")
    assert "6 pairs (2 more for validation)" in res.stdout
    assert "2 prompts lose their start, 2 pairs' responses lose their ends" in res.stdout
    assert f"trainbox train dpo model.path=MODEL data.path={out} data.seq_len=64" in res.stdout
    man = json.loads((out.parent / "prefs.manifest.json").read_text())
    assert man["state"] == "complete" and man["format"] == "pairs" and len(man["files"]) == 6
    cfg = load_config("dpo", [f"model.path={folder}", f"data.path={out}", "data.seq_len=64",
                              "dpo.max_prompt_len=40"])
    train, val = open_pair_datasets(cfg.data, cfg.dpo, tok, tok.vocab_size)
    assert (train.num_pairs, val.num_pairs, train.prompts_cut, train.responses_cut) == (6, 2, 2, 2)
    (ci, cm), (ri, rm) = train.sequences(5)
    prompt = tok.encode(long_prompt)
    assert len(prompt) > 40 and len(ci) == 64 and ci[:40].tolist() == prompt[-40:]   # the prompt's end
    assert tok.decode(ri[40:]) == " five<|endoftext|>"
    assert tok.decode(ci[40:]).startswith(" one two three")                # the response's start
    assert not cm[:40].any() and cm[40:].all()
    short = load_config("dpo", [f"model.path={folder}", f"data.path={out}", "data.seq_len=40"])
    (ci, cm), _ = open_pair_datasets(short.data, short.dpo, tok, tok.vocab_size)[0].sequences(5)
    kept = int((cm == 0).sum())
    assert len(prompt) >= 40 and len(ci) == 40 and 20 <= kept and ci[:kept].tolist() == prompt[-kept:]


def test_an_unfinished_prepared_set_is_refused(tmp_path, folder, tok):
    src = hf_tiny.make_preference_file(tmp_path / "prefs.jsonl", n=8)
    out = tmp_path / "prefs"
    preference.prepare_pairs([str(src)], str(out), tok, str(folder))
    man = tmp_path / "prefs.manifest.json"
    man.write_text(man.read_text().replace('"complete"', '"committing"'))
    cfg = load_config("dpo", [f"model.path={folder}", f"data.path={out}", "data.seq_len=64"])
    with pytest.raises(DataError, match="unfinished `trainbox prepare`"):
        open_pair_datasets(cfg.data, cfg.dpo, tok, tok.vocab_size)


def test_batches_put_chosen_then_rejected_rows_padded_with_the_reference(tmp_path, folder, tok):
    """A micro-batch of B pairs is 2B rows: the chosen sequences, then the rejected ones, each the prompt followed by
    the response, padded to data.seq_len with end-of-text tokens that carry no loss; the reference's log-probabilities
    ride along once set. A raw JSONL data.path is prepared into data.cache_dir once."""
    src = hf_tiny.make_preference_file(tmp_path / "prefs.jsonl", n=8)
    cfg = load_config("dpo", [f"model.path={folder}", f"data.path={src}", "data.seq_len=64",
                              f"data.cache_dir={tmp_path / 'cache'}"])
    train, val = open_pair_datasets(cfg.data, cfg.dpo, tok, tok.vocab_size)
    assert val is None and train.num_pairs == 8 and len(list((tmp_path / "cache").glob("pairs-prefs-*"))) == 1
    b = train.batch([3, 5])
    assert b["x"].shape == b["y"].shape == b["loss_mask"].shape == (4, 64) and "ref_logps" not in b
    for row, (i, which) in enumerate([(3, 0), (5, 0), (3, 1), (5, 1)]):
        ids, mask = train.sequences(i)[which]
        n = len(ids)
        assert b["x"][row, :n - 1].tolist() == ids[:-1].tolist() and b["y"][row, :n - 1].tolist() == ids[1:].tolist()
        assert b["loss_mask"][row, :n - 1].tolist() == mask[1:].astype(bool).tolist()
        assert not b["loss_mask"][row, n - 1:].any() and (b["x"][row, n:] == tok.eot_id).all()
    train.reference = np.arange(16, dtype=np.float32).reshape(8, 2)
    assert torch.equal(train.batch([3, 5])["ref_logps"], torch.tensor([6.0, 10.0, 7.0, 11.0]))
    again, _ = open_pair_datasets(cfg.data, cfg.dpo, tok, tok.vocab_size)   # from the cache
    assert again.prefix == train.prefix


def test_ranks_that_prepare_the_same_raw_file_leave_one_complete_set(tmp_path, folder, tok):
    """Every rank of a run that finds a raw JSONL data.path unprepared prepares it in a folder of its own and renames
    that into the cache: a rank whose rename comes second keeps the first set untouched and leaves nothing behind."""
    src = hf_tiny.make_preference_file(tmp_path / "prefs.jsonl", n=8)
    cfg = load_config("dpo", [f"model.path={folder}", f"data.path={src}", "data.seq_len=64",
                              f"data.cache_dir={tmp_path / 'cache'}"])
    first, _ = open_pair_datasets(cfg.data, cfg.dpo, tok, tok.vocab_size)
    done = first.prefix.parent
    before = {f.name: f.stat().st_mtime_ns for f in done.iterdir()}
    pairs._prepare_apart(str(src), done, tok, cfg.data)   # the rank that lost the race
    assert {f.name: f.stat().st_mtime_ns for f in done.iterdir()} == before
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [done.name]   # no folder of the losing rank
    again, _ = open_pair_datasets(cfg.data, cfg.dpo, tok, tok.vocab_size)
    assert torch.equal(again.batch([1, 2])["x"], first.batch([1, 2])["x"])


# ----------------------------------------------------------------------------- packed pairs


def test_packed_pairs_give_each_pair_the_log_probabilities_and_loss_it_has_alone(folder, tmp_path):
    """data.packing=true: pairs packed whole into rows of 2 x seq_len (several a row here), each sequence seeing only
    itself, from position 0. Every slot's summed log-probabilities equal the same pair's unpacked ones (fp32, CPU,
    1e-5), and so do the loss and every gradient of a micro-batch against the unpacked micro-batch of the same pairs,
    with the precomputed reference in both; the empty slots weigh nothing."""
    from trainbox.data.pairs import PackedPairs
    from trainbox.model.build import build_model
    from trainbox.model.load import load_init_weights
    from trainbox.objective import build_objective
    from trainbox.objective.preference import sequence_logps

    src = hf_tiny.make_preference_file(tmp_path / "prefs.jsonl", n=24, form="text", seed=5)
    cfg = resolve_model(load_config("dpo", [f"model.path={folder}", f"data.path={src}", "train.device=cpu",
                                            "data.seq_len=64", "data.packing=true", f"data.cache_dir={tmp_path}"]))
    tok = build_tokenizer(cfg)
    objective = build_objective(cfg)
    train, _ = objective.open_datasets(cfg, tok, tok.vocab_size)
    assert isinstance(train, PackedPairs) and train.per_row >= 3 and train.report["fill"] > 0.6
    assert sorted(train.row_pairs.tolist()) == list(range(24))   # every pair once
    unpacked = train.pairs
    unpacked.reference = np.random.default_rng(0).normal(-30, 5, size=(24, 2)).astype(np.float32)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.vocab_size, 128)
    load_init_weights(cfg.run.init_from, model, cfg.model)
    rows = [0, 1, train.num_samples - 1]
    packed = train.batch(rows)
    ids = np.concatenate([train._pairs_of(r) for r in rows])
    assert train.pairs_in(rows) == len(ids) == int(packed["pair_valid"].sum())
    plain = unpacked.batch(ids)
    logps, n, _ = sequence_logps(model, packed)
    valid = packed["pair_valid"]
    slots = torch.cat([torch.nonzero(valid)[:, 0], len(valid) + torch.nonzero(valid)[:, 0]])
    want, want_n, _ = sequence_logps(model, plain)
    torch.testing.assert_close(logps[slots], want, atol=1e-5, rtol=0)
    assert n[slots].tolist() == want_n.tolist()

    grads = []
    for batch in (packed, plain):
        model.zero_grad()
        part = objective.loss(model, batch, 1.0 / len(ids))
        part.loss.backward()
        grads.append((part.loss.item(), part.stats.tolist(), [p.grad.clone() for p in model.parameters()]))
    (a, sa, ga), (b, sb, gb) = grads
    assert a == pytest.approx(b, abs=1e-6) and sa == pytest.approx(sb, abs=1e-5)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_packed_pairs_train_and_are_refused_where_they_cannot_run(folder, tmp_path):
    """`trainbox train dpo data.packing=true` logs the rows and their fill and trains to the end; kto's examples
    are refused packed, in one message naming the setting."""
    src = hf_tiny.make_preference_file(tmp_path / "prefs.jsonl", n=48, seed=0)
    res = run_cli("train", "dpo", f"model.path={folder}", f"data.path={src}", "data.seq_len=48", "data.packing=true",
                  "train.global_batch_size=4", "train.micro_batch_size=2", f"run.dir={tmp_path}", "run.name=packed",
                  f"data.cache_dir={tmp_path / 'cache'}", "monitor.port=0", "train.sample_tokens=0",
                  "train.max_steps=3", "train.threads=1")
    log = res.stdout + res.stderr
    assert re.search(r"packed by first-fit decreasing into \d+ rows of 96 positions", log), log[-2000:]
    assert json.loads((tmp_path / "packed" / "status.json").read_text())["step"] == 3
    with pytest.raises(ConfigError) as e:
        load_config("dpo", [f"model.path={folder}", "dpo.loss=kto", "data.packing=true"])
    assert "data.packing=false" in e.value.message


def test_inspect_reads_preference_sets_as_training_does(folder, tmp_path, capsys):
    """`trainbox inspect` of a prepared pair set (its manifest's tokenizer), of the same set packed, of an example
    set and of a raw preference JSONL: the pairs or examples, what the truncation at --seq-len cuts, the packed rows
    and their fill, and the steps a global batch gives, each equal to the dataset training opens."""
    from trainbox.cli import main
    from trainbox.data.pairs import PackedPairs, PairDataset, UnpairedDataset

    tok = build_tokenizer(resolve_model(load_config("dpo", [f"model.path={folder}", "train.device=cpu"])))
    src = hf_tiny.make_preference_file(tmp_path / "prefs.jsonl", n=40, form="text", seed=6)
    preference.prepare_pairs([str(src)], str(tmp_path / "pp"), tok, str(folder))
    plain = PairDataset(tmp_path / "pp", "train", 8, None, tok.eot_id, "pp")
    packed = PackedPairs(plain)
    assert plain.responses_cut > 0   # 8 positions cut some
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "pp"), "--seq-len", "8", "--global-batch", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["unit"], r["packed"], r["train"]["pairs"], r["train"]["responses_cut"]) == \
        ("pairs", False, 40, plain.responses_cut)
    assert (r["steps_per_epoch"], r["batch_unit"], r["tokenizer"]) == (5, "pairs", f"{folder}/tokenizer.json")
    assert main(["inspect", str(tmp_path / "pp"), "--seq-len", "8", "--global-batch", "2", "--packing"]) == 0
    out = capsys.readouterr().out
    assert f"into {packed.num_samples} rows of 16 positions" in out
    assert f"global batch 2 packed rows: {packed.num_samples // 2} steps per epoch" in out

    feedback = hf_tiny.make_unpaired_file(tmp_path / "feedback.jsonl", n=12, form="text", seed=2)
    preference.prepare_pairs([str(feedback)], str(tmp_path / "ex"), tok, str(folder))
    examples = UnpairedDataset(tmp_path / "ex", "train", 64, None, tok.eot_id, "ex", "examples")
    assert main(["inspect", str(tmp_path / "ex"), "--seq-len", "64", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["unit"], r["train"]["examples"], r["train"]["desirable"]) == ("examples", 12, examples.desirable)
    assert main(["inspect", str(src), "--tokenizer", str(folder), "--seq-len", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["responses_cut"] == plain.responses_cut


# ----------------------------------------------------------------------------- prompts longer than data.seq_len


def test_a_prompt_longer_than_seq_len_is_cut_as_the_docs_say_by_every_reader(tmp_path, folder, tok):
    """A prompt of data.seq_len tokens or more loses its start as a shorter one does (TRL's keep_end): at most down
    to max_prompt_len (half of data.seq_len by default), its end kept, then the responses' start to fit; so for dpo's
    pairs, kto's examples, reward's pairs and the count of `prepare --seq-len`. Only a budget that leaves no room for
    a response is refused, naming the file and line."""
    prompt = " ".join(["one two three"] * 40)
    src = write(tmp_path / "long.jsonl", [{"prompt": prompt, "chosen": " one plus one", "rejected": " it equals"}] * 4)
    ids = tok.encode(prompt)
    assert len(ids) > 2 * 48
    common = [f"model.path={folder}", f"data.path={src}", "data.seq_len=48", f"data.cache_dir={tmp_path / 'c'}"]
    dpo = load_config("dpo", common)
    kto = load_config("dpo", [*common, "dpo.loss=kto"])
    reward = load_config("reward", common)
    readers = [open_pair_datasets(dpo.data, dpo.dpo, tok, tok.vocab_size)[0],
               open_pair_datasets(kto.data, kto.dpo, tok, tok.vocab_size)[0],
               open_pair_datasets(reward.data, reward.reward, tok, tok.vocab_size)[0]]
    pair, mismatched = (" one plus one", " it equals"), (" one plus one", " one plus one")   # kto: 0's, 4's
    for ds, cut, answers in zip(readers, (4, 8, 4), (pair, mismatched, pair)):
        assert (ds.prompts_cut, ds.responses_cut) == (cut, 0), ds.name
        for (seq, mask), answer in zip(ds.sequences(0), answers):
            kept = int((mask == 0).sum())
            assert 24 <= kept < 48 and len(seq) <= 48
            assert seq[:kept].tolist() == ids[-kept:]                    # the prompt's end
            assert tok.decode(seq[kept:]) == answer + "<|endoftext|>"    # the response whole
    readers[2].score_pad = tok.eot_id   # a reward model scores each sequence's last token before its padding
    ends = [len(seq) - 2 for seq, _ in readers[2].sequences(0)]
    assert readers[2].batch([0])["score_at"].tolist() == ends and max(ends) < 48
    res = run_cli("prepare", str(src), "--tokenizer", str(folder), "--out", str(tmp_path / "p"), "--seq-len", "48")
    assert "4 prompts lose their start, 0 pairs' responses lose their ends" in res.stdout
    with pytest.raises(DataError) as e:
        pairs.PairDataset(tmp_path / "p", "train", 48, 48, tok.eot_id, "p")
    assert f"{src}:1: the prompt has {len(ids)} tokens" in e.value.message and "max_prompt_len=48" in e.value.message
    refused = run_cli("prepare", str(src), "--tokenizer", str(folder), "--out", str(tmp_path / "q"), "--seq-len", "48",
                      "--max-prompt-len", "48", check=False)
    assert refused.returncode == 2 and "--max-prompt-len 48 leaves no room" in refused.stderr


# ----------------------------------------------------------------------------- the tokenizer of a prepared set


def test_a_prepared_set_is_refused_under_another_tokenizer(tmp_path, folder, tok):
    """The Mistral folder's ids fit the vocabulary of a set prepared with another tokenizer, so only the manifest can
    tell: a run with that tokenizer is refused, naming both and the command that prepares the set again (its inputs
    and --val-docs, as its manifest records them). The same tokenizer given by a relative path, a copy of its folder,
    and an older manifest with no digest whose path names the same folder are accepted."""
    import shutil

    from trainbox.data import manifest
    src = hf_tiny.make_preference_file(tmp_path / "prefs.jsonl", n=16)
    out = tmp_path / "p"
    run_cli("prepare", str(src), "--tokenizer", folder.name, "--out", str(out), "--val-docs", "4", cwd=folder.parent)
    cfg = load_config("dpo", [f"model.path={folder}", f"data.path={out}", "data.seq_len=48"])
    assert open_pair_datasets(cfg.data, cfg.dpo, tok, tok.vocab_size)[0].num_pairs == 12
    copy = shutil.copytree(folder, tmp_path / "copy")
    twin = build_tokenizer(resolve_model(load_config("dpo", [f"model.path={copy}", "train.device=cpu"])))
    assert open_pair_datasets(cfg.data, cfg.dpo, twin, twin.vocab_size)[0].num_pairs == 12
    other = hf_tiny.make_model(tmp_path / "mistral", "mistral")
    mistral = build_tokenizer(resolve_model(load_config("dpo", [f"model.path={other}", "train.device=cpu"])))
    with pytest.raises(DataError) as e:
        open_pair_datasets(cfg.data, cfg.dpo, mistral, mistral.vocab_size)
    assert f"prepared with the tokenizer {folder.name}" in e.value.message and str(other) in e.value.message
    assert f"trainbox prepare {src} --tokenizer {other} --out {out} --val-docs 4 --overwrite" in e.value.hint
    man = manifest.manifest_path(out)
    old = {k: v for k, v in json.loads(man.read_text()).items() if k != "tokenizer_sha256"}
    manifest.write_manifest(man, {**old, "tokenizer": str(folder)})
    assert open_pair_datasets(cfg.data, cfg.dpo, tok, tok.vocab_size)[0].num_pairs == 12
    with pytest.raises(DataError, match="prepared with the tokenizer"):
        open_pair_datasets(cfg.data, cfg.dpo, mistral, mistral.vocab_size)
