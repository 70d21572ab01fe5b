"""`trainbox eval` and lm-eval's adapter (eval/): on tiny gpt and llama runs trained a few steps and exported (and a
LoRA run, merged), our adapter's scores equal lm-eval's own `hf` model's on local tasks of every request type
(multiple choice, loglikelihood, rolling loglikelihood, greedy generation until a stop string); the record the
command writes and where it shows; the inputs refused before any work, each with one message and exit code 2."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import hf_tiny
import lm_eval
import pytest
import torch
from conftest import TINY, run_cli
from eval_tasks import PROMPTS, WORDS, write_tasks
from lm_eval.tasks import TaskManager

from trainbox.config import load_config
from trainbox.eval.adapter import TrainboxLM
from trainbox.export import export
from trainbox.model.load import load_for_inference
from trainbox.model.spec import family as family_of
from trainbox.model.spec import which
from trainbox.train.loop import train

TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl", "tiny_ll"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """Tiny gpt and llama runs (3 steps), their Hugging Face exports, and the local tasks (tiny_ll's continuations:
    where it can, the gpt model's own greedy next token, so both answers of is_greedy occur)."""
    root = tmp_path_factory.mktemp("eval")
    # a slow warm-up keeps the weights near their random start: varied greedy tokens, not one learnt newline
    base = [*TINY, f"run.dir={root / 'runs'}", f"data.cache_dir={data_cache}", "train.max_steps=3",
            "optim.warmup_steps=100", "monitor.enabled=false"]
    train(load_config("tiny", [*base, "run.name=gpt"]))
    train(load_config("tiny", [*base, "run.name=llama", "model.family=llama", "model.llama.n_kv_head=1"]))
    for family in ("gpt", "llama"):
        export(root / "runs" / family, root / f"hf-{family}")
    tasks = write_tasks(root / "tasks", _greedy_continuations(root / "runs" / "gpt"))
    return SimpleNamespace(root=root, tasks=tasks, run=lambda f: root / "runs" / f, hf=lambda f: root / f"hf-{f}")


def _greedy_continuations(run) -> dict[str, str]:
    """Contexts -> continuations for tiny_ll: the model's own greedy next token where it re-tokenises as itself
    after the context, two words otherwise."""
    model, tokenizer, _ = load_for_inference(run)
    out = {}
    for i, prompt in enumerate(f"{p} {w}" for p in PROMPTS for w in WORDS[:6]):
        ids = tokenizer.encode(prompt)
        nxt = int(model(torch.tensor([ids])).logits[0, -1, :tokenizer.vocab_size].argmax())
        text = tokenizer.decode([nxt])
        if i % 2 == 0 and text.strip() and tokenizer.encode(prompt + text) == ids + [nxt]:
            out[prompt] = text
        else:
            out[prompt] = " king queen"
    assert any(v != " king queen" for v in out.values())
    return out


def _samples(results: dict, task: str) -> dict[int, list]:
    """lm-eval's responses per document: [response of each request]."""
    return {s["doc_id"]: [r[0] for r in s["resps"]] for s in results["samples"][task]}


def _assert_equal_scores(ours: dict, ref: dict) -> None:
    """Accuracies exactly equal, every loglikelihood within 1e-4 with the same greedy flag, every generated text
    equal (lm-eval's results with log_samples)."""
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_mc", "acc_norm,none"), ("tiny_ll", "acc,none"),
                         ("tiny_gen", "exact_match,none")):
        assert ours["results"][task][metric] == ref["results"][task][metric], (task, metric)
    for task in ("tiny_mc", "tiny_ll"):
        a, b = _samples(ours, task), _samples(ref, task)
        assert a.keys() == b.keys() and len(a) > 1
        for doc in a:
            for (lp, greedy), (lp_ref, greedy_ref) in zip(a[doc], b[doc], strict=True):
                assert abs(lp - lp_ref) <= 1e-4 and greedy == greedy_ref, (task, doc, lp, lp_ref)
    a, b = _samples(ours, "tiny_ppl"), _samples(ref, "tiny_ppl")
    assert all(abs(a[d][0] - b[d][0]) <= 1e-4 for d in a) and a.keys() == b.keys()
    texts, texts_ref = _samples(ours, "tiny_gen"), _samples(ref, "tiny_gen")
    assert texts == texts_ref and any(t[0] for t in texts.values()), texts


def _ours_and_lm_evals(run, folder, root) -> tuple[dict, dict]:
    """The four tasks on `run` through our adapter (batches of 3) and on `folder` through lm-eval's hf model (batches
    of 2), fp32 on the CPU."""
    manager = TaskManager(include_path=str(root / "tasks"), include_defaults=False)
    model, tokenizer, _ = load_for_inference(run)
    ours = lm_eval.simple_evaluate(model=TrainboxLM(model, tokenizer, batch_size=3), tasks=TASKS,
                                   task_manager=manager, log_samples=True)
    ref = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(folder), "dtype": "float32"},
                                  tasks=TASKS, task_manager=manager, log_samples=True, batch_size=2, device="cpu")
    return ours, ref


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_scores_equal_lm_evals_own_hf_model(runs, family):
    """Same tasks, our adapter on the run against lm-eval's hf model on its export (_assert_equal_scores)."""
    ours, ref = _ours_and_lm_evals(runs.run(family), runs.hf(family), runs.root)
    _assert_equal_scores(ours, ref)
    if family == "gpt":   # tiny_ll holds the gpt model's own greedy continuations: the flag is true there
        assert any(greedy for resps in _samples(ours, "tiny_ll").values() for _, greedy in resps)


def test_a_lora_run_scores_as_lm_evals_hf_model_on_its_merged_export(runs, tmp_path):
    """The hf family (a LoRA adapter on a Hugging Face model: peft's forward, transformers' KV cache) through the
    adapter, against lm-eval's hf model on the run merged and exported."""
    base = hf_tiny.make_model(tmp_path / "base")
    hf_tiny.make_chat_file(tmp_path / "chat.jsonl")
    train(load_config("lora", [f"model.path={base}", f"data.path={tmp_path / 'chat.jsonl'}", "data.seq_len=48",
                               f"run.dir={tmp_path / 'runs'}", "run.name=lora", f"data.cache_dir={tmp_path / 'cache'}",
                               "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=2",
                               "train.sample_tokens=0", "train.eval_every=0", "monitor.enabled=false", "lora.r=4",
                               "lora.alpha=8", "optim.lr=1e-2", "optim.warmup_steps=0"]))
    run = tmp_path / "runs" / "lora"
    export(run, tmp_path / "merged", merge=True)
    _assert_equal_scores(*_ours_and_lm_evals(run, tmp_path / "merged", runs.root))
    # its sdpa attention takes a mask: continuations of one context share its row, scored as each alone
    model, tokenizer, _ = load_for_inference(run)
    lm = TrainboxLM(model, tokenizer, batch_size=2)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, tokenizer.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    context = ids(9)
    requests = [(None, context, ids(n)) for n in (3, 1, 5, 2)] + [(None, ids(4), ids(3))]
    assert lm.shares and len(lm._rows(requests)) == 2
    shared = lm._loglikelihood_tokens(requests)
    lm.shares = False
    assert len(lm._rows(requests)) == 4
    for (a, greedy), (b, greedy_alone) in zip(shared, lm._loglikelihood_tokens(requests), strict=True):
        assert a == pytest.approx(b, abs=1e-5) and greedy == greedy_alone


def test_eval_command_writes_the_record_and_runs_and_status_show_it(runs, tmp_path):
    run = runs.run("gpt")
    out = run_cli("eval", str(run), "--tasks", f"{runs.tasks['tiny_mc']},{runs.tasks['tiny_gen']}",
                  "--batch-size", "4")
    assert "|tiny_mc" in out.stdout and "|acc" in out.stdout and "|tiny_gen" in out.stdout, out.stdout
    records = sorted((run / "eval").glob("*.json"))
    assert len(records) == 1 and f"wrote {records[0]}" in out.stderr
    record = json.loads(records[0].read_text())
    info = record["trainbox"]
    assert info["step"] == 3 and info["model"] == "trainbox" and info["family"] == "gpt"
    assert len(info["git_commit"] or "") == 40 and info["dtype"] == "float32"
    assert info["scores"]["tiny_mc"]["acc"] == record["results"]["tiny_mc"]["acc,none"]
    assert set(info["scores"]) == {"tiny_mc", "tiny_gen"} and "samples" not in record

    table = run_cli("runs", str(run.parent)).stdout.splitlines()
    task, metrics = next(iter(info["scores"].items()))
    metric, value = next(iter(metrics.items()))   # the first score of the newest record, and how many more
    assert "EVAL" in table[0].split()
    assert f"{task} {metric} {value:.4g} +2" in next(line for line in table if line.startswith("gpt "))
    status = run_cli("status", str(run)).stdout
    assert status.startswith("healthy: finished") and "lm-eval at step 3:" in status
    assert f"tiny_mc acc {info['scores']['tiny_mc']['acc']:.4g}" in status

    # a Hugging Face folder goes through lm-eval's hf model and scores the same
    out = run_cli("eval", str(runs.hf("gpt")), "--tasks", str(runs.tasks["tiny_mc"]), "--out", str(tmp_path))
    hf = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert hf["trainbox"]["model"] == "lm-eval hf" and hf["trainbox"]["step"] is None
    assert hf["trainbox"]["scores"]["tiny_mc"] == info["scores"]["tiny_mc"]


@pytest.mark.slow
def test_a_sharded_checkpoint_is_scored_as_its_export(runs, tmp_path, data_cache):
    """An fsdp run on two processes (gloo) leaves sharded checkpoints: `trainbox eval` reads one and scores it as
    lm-eval's hf model scores the run's export."""
    run_cli("train", "--nproc", "2", "tiny", *TINY, f"run.dir={tmp_path}", f"data.cache_dir={data_cache}",
            "run.name=fsdp", "train.parallel=fsdp", "train.max_steps=2", "monitor.enabled=false",
            "train.sample_tokens=0")
    run = tmp_path / "fsdp"
    assert json.loads(next(run.glob("checkpoints/step_*/COMPLETE")).read_text())["layout"] == "sharded"
    run_cli("eval", str(run), "--tasks", str(runs.tasks["tiny_mc"]))
    export(run, tmp_path / "hf")
    run_cli("eval", str(tmp_path / "hf"), "--tasks", str(runs.tasks["tiny_mc"]), "--out", str(tmp_path / "ref"))
    ours = json.loads(next((run / "eval").glob("*.json")).read_text())["results"]["tiny_mc"]
    ref = json.loads(next((tmp_path / "ref").glob("*.json")).read_text())["results"]["tiny_mc"]
    assert ours["acc,none"] == ref["acc,none"] and ours["acc_norm,none"] == ref["acc_norm,none"]


# ----------------------------------------------------------------------------- refused before any work


def _refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2, one message (and its hint line), no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[0].startswith("trainbox eval: "), proc.stderr
    assert len(lines) <= 2 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)


def test_an_unknown_task_is_refused(runs, tmp_path):
    run = tmp_path / "gpt"
    shutil.copytree(runs.run("gpt"), run)
    shutil.rmtree(run / "eval", ignore_errors=True)
    proc = run_cli("eval", str(run), "--tasks", f"{runs.tasks['tiny_mc']},hellaswagg", check=False)
    _refused(proc, "no task 'hellaswagg'", "did you mean", "hellaswag")
    proc = run_cli("eval", str(run), "--tasks", str(tmp_path / "missing.yaml"), check=False)
    _refused(proc, "missing.yaml does not exist")
    assert not (run / "eval").exists()


def test_generation_on_a_model_without_a_causal_decoder_is_refused(runs, tmp_path, data_cache):
    train(load_config("tiny", [*TINY, f"run.dir={tmp_path}", f"data.cache_dir={data_cache}", "run.name=t5",
                               "model.family=t5", "model.tie_embeddings=false", "model.t5.d_ff=64",
                               "model.t5.d_kv=16", "train.max_steps=1", "monitor.enabled=false",
                               "train.sample_tokens=0"]))
    proc = run_cli("eval", str(tmp_path / "t5"), "--tasks", str(runs.tasks["tiny_gen"]), check=False)
    _refused(proc, "task tiny_gen generates text (generate_until)", "model.family=t5 has none", "backend=seq2seq")
    assert not (tmp_path / "t5" / "eval").exists()


def test_a_checkpoint_that_fails_verification_is_refused(runs, tmp_path):
    run = tmp_path / "gpt"
    shutil.copytree(runs.run("gpt"), run)
    shutil.rmtree(run / "eval", ignore_errors=True)
    step = next((run / "checkpoints").glob("step_*"))
    weights = step / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    proc = run_cli("eval", str(step), "--tasks", str(runs.tasks["tiny_mc"]), check=False)
    _refused(proc, "model.safetensors differs from what was saved")
    proc = run_cli("eval", str(run), "--tasks", str(runs.tasks["tiny_mc"]), check=False)
    _refused(proc, "none of the 1 checkpoints", "verifies")
    assert not (run / "eval").exists()


def test_without_lm_eval_the_extra_to_install_is_named(runs, tmp_path):
    code = ("import sys; sys.modules['lm_eval'] = None; from trainbox.cli import main; "
            f"sys.exit(main(['eval', {str(runs.run('gpt'))!r}, '--tasks', 'hellaswag']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    _refused(proc, "needs lm-eval", "pip install 'trainbox[eval]'")


def test_under_autocast_the_kv_cache_takes_the_compute_dtype(runs):
    """bf16 autocast over fp32 weights (as `trainbox eval` runs on a GPU and the loop evaluates), here on the CPU:
    generation feeds its bf16 keys and values through caches of that dtype; scores stay near fp32's."""
    requests = [SimpleNamespace(args=(p, {"until": ["\n\n"], "max_gen_toks": 6})) for p in PROMPTS[:4]]
    pairs = [SimpleNamespace(args=(p, " king queen")) for p in PROMPTS[:4]]
    for family in ("gpt", "llama"):
        model, tokenizer, _ = load_for_inference(runs.run(family))
        fp32 = TrainboxLM(model, tokenizer, batch_size=3)
        bf16 = TrainboxLM(model, tokenizer, batch_size=3, autocast=lambda: torch.autocast("cpu", torch.bfloat16))
        made: list = []
        model.make_caches = lambda *a, made=made, make=model.make_caches: made.append(a[2]) or make(*a)
        texts = bf16.generate_until(requests)
        assert made and set(made) == {torch.bfloat16} and all(isinstance(t, str) for t in texts)
        for (a, _), (b, _) in zip(fp32.loglikelihood(pairs), bf16.loglikelihood(pairs)):
            assert abs(a - b) < 0.05 * max(1.0, abs(a)), (family, a, b)


@pytest.mark.parametrize("name", [n for n in which(lambda f: f.generate == "causal") if n != "hf"])
def test_every_causal_family_scores_as_its_own_token_losses(name):
    """The adapter's batched, right-padded path against the slow reference: each pair alone through the family's
    training forward (per-token losses, reduction="none") and its full logits for the greedy flag. Several
    continuations of one context share its rows where the forward takes a mask (gpt, llama). Families built
    from a Hugging Face folder (hf: LoRA) are scored through that folder by lm-eval's hf model instead."""
    from trainbox.config import load_config
    from trainbox.model.build import build_model, build_tokenizer, model_vocab_size

    cfg = load_config("tiny", [*TINY, f"model.family={name}", "data.seq_len=64"])
    tokenizer = build_tokenizer(cfg)
    if family_of(name).supports("eot_id"):   # documents split at the tokenizer's EOT, as train resolves it
        cfg = load_config("tiny", [*TINY, f"model.family={name}", "data.seq_len=64",
                                   f"model.eot_id={tokenizer.eot_id}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, model_vocab_size(cfg.model, tokenizer.vocab_size), 64, run=cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, tokenizer.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    pairs = [(ids(n), ids(k)) for n, k in ((5, 1), (30, 3), (12, 7), (60, 10), (1, 2), (20, 1))]
    pairs.append((pairs[1][0] + pairs[1][1][:2], ids(1)))   # the same model input as the second pair: one row
    shared = ids(20)   # one context, continuations of 4 + 9 + 30 + 25 tokens: more than one row of 64 holds
    conts = [ids(4), ids(9), ids(1), ids(30), ids(25)]
    pairs += [(shared, c) for c in conts] + [(shared, conts[0])]
    lm = TrainboxLM(model, tokenizer, batch_size=3)
    requests = [(None, c, t) for c, t in pairs]
    if name in ("gpt", "llama"):   # their forward takes a mask: the continuations share the context's rows
        assert lm.shares and len(lm._rows(requests)) == len(pairs) - len(conts) - 1 + 2
    got = lm._loglikelihood_tokens(requests)
    with torch.no_grad():
        for (context, continuation), (lp, greedy) in zip(pairs, got, strict=True):
            whole = torch.tensor([(context + continuation)[-65:]])
            x, y = whole[:, :-1], whole[:, 1:]
            nll = model(x, y, reduction="none").loss[0, -len(continuation):]
            assert lp == pytest.approx(-nll.sum().item(), rel=2e-6, abs=1e-4), (name, len(context), len(continuation))
            best = model(x, logits_to_keep=len(continuation)).logits[0].argmax(-1)
            assert greedy == bool((best == torch.tensor(continuation)).all())
