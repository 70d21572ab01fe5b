"""train.objective=grpo, online reinforcement learning from reward functions, against its references: TRL's
GRPOTrainer (its own _compute_loss on the same prompts, completions and advantages, a transformers LlamaForCausalLM:
the loss and every gradient of a tiny Llama in fp32, for each loss, with and without the KL term and at a
temperature), TRL's advantages (its nanstd), and `trainbox train grpo` end to end: the reward rises, a resumed run
continues exactly, two processes equal one, and what it refuses."""
from __future__ import annotations

import copy
import json
import random
import shutil
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli
from safetensors.torch import load_file

sys.path.insert(0, str(REPO / "tests"))
import hf_tiny  # noqa: E402

from trainbox.config import load_config  # noqa: E402
from trainbox.model.build import build_model, build_tokenizer, resolve_model  # noqa: E402
from trainbox.model.load import load_init_weights  # noqa: E402
from trainbox.objective import Runtime, build_objective  # noqa: E402
from trainbox.objective.grpo import ROW_STATS, group_advantages, row_seed, training_rows  # noqa: E402
from trainbox.parallel.distributed import Dist  # noqa: E402

transformers = pytest.importorskip("transformers")

REWARDS = '''
def low_ids(prompts, completions, completion_ids, **rows):
    """The share of a completion's tokens in the lower half of the vocabulary (a reward a policy can learn)."""
    return [sum(i < 160 for i in c) / len(c) for c in completion_ids]


def has_answer(prompts, completions, answer, **rows):
    """1 where the completion's text holds the row's answer; None for a row without one (not scored)."""
    return [None if a is None else float(a in c[0]["content"]) for c, a in zip(completions, answer)]


SEEN = []


def record(prompts, completions, completion_ids, **rows):
    SEEN.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **rows})
    return [0.0] * len(prompts)


def broken(prompts, completions, **rows):
    return [1.0]
'''


def write_rewards(folder: Path) -> Path:
    path = folder / "rewards.py"
    path.write_text(REWARDS)
    return path


def make_prompt_file(path: Path, n: int = 32, seed: int = 0, answers: bool = True) -> Path:
    """Arithmetic questions as message prompts, each with its answer (a field the reward functions read)."""
    rng = random.Random(seed)
    names = hf_tiny.WORDS[:10]
    with open(path, "w") as f:
        for k in range(n):
            a, b = rng.randrange(5), rng.randrange(5)
            row = {"prompt": [{"role": "user", "content": f"what is {names[a]} plus {names[b]}"}],
                   "answer": names[a + b] if answers or k % 2 else None}
            f.write(json.dumps(row) + "\n")
    return path


def ours(folder, rewards, *overrides):
    cfg = resolve_model(load_config("grpo", [f"model.path={folder}", "train.device=cpu", "data.seq_len=64",
                                             "grpo.max_completion_len=16", f"grpo.rewards=[{rewards}:low_ids]",
                                             *overrides]))
    tok = build_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.vocab_size, 64, run=cfg)
    if cfg.run.init_from:
        load_init_weights(cfg.run.init_from, model, cfg.model)
    return cfg, tok, model


def runtime(cfg, model, reference, train, tok) -> Runtime:
    return Runtime(cfg, model, model, reference, torch.device("cpu"), nullcontext, Dist(), train, None, tok,
                   tok.vocab_size)


CLIPS = {   # a later step of a generation: our settings, TRL's
    "high": (["grpo.epsilon_high=0.28"], {"epsilon_high": 0.28}),
    "delta": (["grpo.epsilon=0.1", "grpo.delta=1.2"], {"epsilon": 0.1, "delta": 1.2}),
    "cispo": (["grpo.epsilon_high=1.1"], {"epsilon_high": 1.1}),   # a cap that binds at some tokens
    "sapo": (["grpo.sapo_temperature_pos=0.8"], {"sapo_temperature_pos": 0.8}),   # a soft gate: nothing clipped
}


@pytest.mark.parametrize("loss, beta, temperature, level, clip", [
    ("dapo", 0.0, 1.0, "token", None), ("grpo", 0.0, 1.0, "token", None), ("dapo", 0.0, 0.7, "token", None),
    ("dapo", 0.04, 1.0, "token", None), ("grpo", 0.04, 0.7, "token", None), ("dr_grpo", 0.1, 1.3, "token", None),
    ("dapo", 0.0, 1.0, "sequence", None), ("grpo", 0.04, 0.7, "sequence", None),
    ("dapo", 0.0, 1.0, "token", "high"), ("grpo", 0.04, 0.7, "token", "delta"),
    ("dapo", 0.04, 1.0, "sequence", "high"), ("cispo", 0.04, 1.0, "token", "cispo"),
    ("sapo", 0.0, 0.7, "token", "sapo"), ("sapo", 0.04, 1.0, "sequence", None)])
def test_loss_and_gradients_equal_trl(tmp_path, loss, beta, temperature, level, clip):
    """TRL's GRPOTrainer._compute_loss on prompts left-padded and completions right-padded as its generation leaves
    them (some ended by end of text, some cut at max_completion_length), with the same advantages, and with beta > 0
    the log-probabilities of a perturbed reference; our objective on its training rows of the same tokens: the loss
    and every parameter's gradient agree (fp32, CPU), with token-level importance ratios and GSPO's sequence-level
    ones (which change the gradient only through the KL term's correction: the case with beta > 0 fails with
    token-level ratios in their place); and TRL's cispo and sapo losses. `clip`: a later step of a generation
    (grpo.num_iterations=2), pi_old the log-probabilities of another perturbed copy, so that the clip binds at some
    tokens (the test checks it does), with DAPO's higher upper clip, with TRL's two-sided delta, cispo's cap; sapo's
    soft gate, which clips nothing."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import GRPOConfig, GRPOTrainer

    folder = hf_tiny.make_model(tmp_path / "base", seed=3)
    rewards = write_rewards(tmp_path)
    prompts_file = make_prompt_file(tmp_path / "p.jsonl", n=4)
    cfg, tok, model = ours(folder, rewards, f"data.path={prompts_file}", f"grpo.loss={loss}", f"grpo.beta={beta}",
                           f"grpo.temperature={temperature}", "grpo.num_generations=3",
                           f"grpo.importance_sampling_level={level}",
                           *(["grpo.num_iterations=2", *CLIPS[clip][0]] if clip else []))
    C, G = cfg.grpo.max_completion_len, 3
    objective = build_objective(cfg)
    train, _ = objective.open_datasets(cfg, tok, tok.vocab_size)
    reference = None
    if beta:
        reference = copy.deepcopy(model)
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    objective.attach(runtime(cfg, model, reference, train, tok))

    gen = torch.Generator().manual_seed(1)
    prompts = [train.ids[i] for i in (0, 0, 0, 1, 1, 1)]
    eot = tok.eot_id
    completions = []
    for k in range(6):
        n = int(torch.randint(3, C + 1, (1,), generator=gen))
        ids = torch.randint(0, 300, (n,), generator=gen).tolist()
        ids = [i if i != eot else 5 for i in ids]
        completions.append(ids[:-1] + [eot] if k % 3 != 2 else ids + [7] * (C - n))   # every third one cut
    truncated = torch.tensor([k % 3 == 2 for k in range(6)])
    advantages = torch.randn(6, generator=gen)
    b = objective.micro_batch(prompts, completions, advantages, truncated)
    tokens = int(b["loss_mask"].sum())
    b["row_stats"] = torch.zeros(len(ROW_STATS) + 2)
    b["token_count"] = torch.tensor(float(tokens))
    if clip:   # pi_old: the log-probabilities of a copy moved as a few updates would move it
        moved = copy.deepcopy(model)
        with torch.no_grad():
            for p in moved.parameters():
                p.add_(torch.randn_like(p) * (0.05 if level == "token" else 0.2))   # a sequence's mean moves less
            b["old_logps"] = objective._token_logps(moved, b)[0]
    denominator = {"dapo": tokens, "cispo": tokens, "grpo": 6, "sapo": 6, "dr_grpo": 6 * C}[loss]
    part = objective.loss(model, b, 1.0 / denominator)
    part.loss.backward()
    clipped = part.stats[objective.stat_names.index("clipped")].item()
    assert (clipped > 0) == (clip in ("high", "delta", "cispo")), clipped   # at some tokens of a later step

    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=6, num_generations=G,
                      max_completion_length=C, temperature=temperature, beta=beta, loss_type=loss, report_to=[],
                      importance_sampling_level=level, num_iterations=2 if clip else 1,
                      **(CLIPS[clip][1] if clip else {}),
                      use_cpu=True, bf16=False, fp16=False, seed=0)
    rows = [{"prompt": json.loads(line)["prompt"]} for line in open(prompts_file)]
    trainer = GRPOTrainer(model=str(folder), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=hf_tok)
    trainer.current_gradient_accumulation_steps = 1
    pad = hf_tok.pad_token_id
    P = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (C - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in completions])
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "num_items_in_batch": torch.tensor(float(tokens))}
    if clip:   # the same pi_old in TRL's completion layout
        inputs["old_per_token_logps"] = torch.stack([
            torch.nn.functional.pad(b["old_logps"][r, len(p) - 1:len(p) - 1 + len(c)], (0, C - len(c)))
            for r, (p, c) in enumerate(zip(prompts, completions))])
    if beta:   # the reference's log-probabilities of the completions at the temperature, by transformers
        ref_hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ref_hf.load_state_dict({k: v for k, v in reference.state_dict().items()}, strict=False)
        with torch.no_grad():
            ids = torch.cat([prompt_ids, completion_ids], 1)
            logits = ref_hf(input_ids=ids, attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits
            logps = (logits[:, P - 1:-1].float() / temperature).log_softmax(-1)
            inputs["ref_per_token_logps"] = logps.gather(-1, completion_ids[..., None]).squeeze(-1)
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()

    assert part.loss.item() == pytest.approx(theirs.item(), abs=1e-6)
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    mine = dict(model.named_parameters())
    assert set(mine) == set(grads)
    for name, p in mine.items():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(scale):
    """group_advantages against TRL's own formula and nanstd: a group of identical rewards, a reward left out
    (None), a group with one scored completion, a completion no function scored."""
    from trl.trainer.utils import nanstd

    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, float("nan"), 1.0, 3.0, float("nan"), float("nan"), 4.0],
                     dtype=torch.float64)
    G = 3
    mean = torch.nanmean(r.view(-1, G), dim=1).repeat_interleave(G)
    std = nanstd(r.view(-1, G), dim=1).repeat_interleave(G) if scale != "batch" else nanstd(r).expand_as(r)
    want = r - mean
    if scale != "none":
        want = want / (std + 1e-4)
    want = want.nan_to_num(0.0)
    batch = float(nanstd(r)) if scale == "batch" else None
    got, _ = group_advantages(r, G, scale, batch)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("together", [None, 6])
def test_the_plan_counts_the_caches_that_sampling_makes(tmp_path, together):
    """The memory plan of a grpo run counts KV caches that are, to the byte, those that rollout makes for the rows a
    process samples together (a step's 4 prompts x 4 completions, or grpo.generation_batch_size of them), at
    data.seq_len positions. (The whole sampling's peak against an H200's: tests/test_plan.py.)"""
    from trainbox.model.build import model_vocab_size
    from trainbox.plan import local_cpu, make_plan
    folder = hf_tiny.make_model(tmp_path / "base", seed=3)
    rewards = write_rewards(tmp_path)
    prompts_file = make_prompt_file(tmp_path / "p.jsonl", n=8)
    extra = [f"grpo.generation_batch_size={together}"] if together else []
    cfg, tok, model = ours(folder, rewards, f"data.path={prompts_file}", "grpo.num_generations=4",
                           "train.global_batch_size=4", "train.micro_batch_size=1", *extra)
    vocab = model_vocab_size(cfg.model, tok.vocab_size)
    plan = make_plan(cfg, vocab, local_cpu(), suggest=False)
    rows = together or 16
    caches = model.make_caches(rows, cfg.data.seq_len, torch.float32, torch.device("cpu"))
    made = sum(b.numel() * b.element_size() for c in caches for b in c.buffers())
    assert plan.memory.kv_cache == made > 0


def test_training_rows_mark_the_completions():
    rows = training_rows([[5, 6, 7], [8]], [[1, 2, 0], [3]], 64, 99)
    assert rows["x"].shape == (2, 64)
    assert rows["x"][0, :5].tolist() == [5, 6, 7, 1, 2] and rows["y"][0, :5].tolist() == [6, 7, 1, 2, 0]
    assert rows["loss_mask"][0].nonzero().flatten().tolist() == [2, 3, 4]   # the targets 1, 2, 0
    assert rows["loss_mask"][1].nonzero().flatten().tolist() == [0]
    assert rows["x"][1, 1:].eq(99).all() and rows["y"][1, 1:].eq(99).all()


def test_seeds_are_a_pure_function_and_differ():
    seeds = {row_seed(1337, s, i, j) for s in range(3) for i in range(20) for j in range(8)}
    assert len(seeds) == 3 * 20 * 8 and row_seed(1337, 2, 5, 3) == row_seed(1337, 2, 5, 3)
    assert all(0 <= s < 2**63 for s in seeds)


def test_rewards_get_the_rows_fields_and_chat_completions(tmp_path):
    """A reward function is called as TRL calls it: prompts (the rows' message lists), completions as assistant
    messages holding the text without its end, completion_ids with it, and each other field, one item a
    completion; a function that returns the wrong count is named in one message."""
    folder = hf_tiny.make_model(tmp_path / "base", seed=3)
    rewards = write_rewards(tmp_path)
    prompts_file = make_prompt_file(tmp_path / "p.jsonl", n=4, answers=False)
    cfg, tok, model = ours(folder, rewards, f"data.path={prompts_file}",
                           f"grpo.rewards=[{rewards}:record,{rewards}:has_answer]", "grpo.reward_weights=[1,2]")
    objective = build_objective(cfg)
    train, _ = objective.open_datasets(cfg, tok, tok.vocab_size)
    objective.attach(runtime(cfg, model, None, train, tok))
    module = sys.modules[objective.functions[0].__module__]
    module.SEEN.clear()
    answer = train.rows[1]["answer"]
    completions = [tok.encode(f"it is {answer}") + [tok.eot_id], tok.encode("no idea"), tok.encode("x")]
    scores = objective._score(train, [1, 1, 0], completions)
    seen = module.SEEN[0]
    assert seen["prompts"] == [train.rows[1]["prompt"]] * 2 + [train.rows[0]["prompt"]]
    assert seen["completions"][0] == [{"role": "assistant", "content": f"it is {answer}"}]
    assert seen["completion_ids"] == completions and seen["answer"] == [answer, answer, None]
    assert scores[:2].tolist() == [[0.0, 1.0], [0.0, 0.0]] and scores[2, 1].isnan()
    assert objective._rewards(scores).tolist()[:2] == [2.0, 0.0]

    cfg, tok, model = ours(folder, rewards, f"data.path={prompts_file}", f"grpo.rewards=[{rewards}:broken]")
    objective = build_objective(cfg)
    train, _ = objective.open_datasets(cfg, tok, tok.vocab_size)
    objective.attach(runtime(cfg, model, None, train, tok))
    from trainbox.errors import TrainingFailed
    with pytest.raises(TrainingFailed, match=r"rewards.py:broken returned 1 value\(s\) for 3 completions"):
        objective._score(train, [1, 1, 0], completions)


def test_a_step_no_reward_function_scored_logs_no_reward_and_warns_once(tmp_path, caplog):
    """Every function returned None for every completion: the step's reward is None (logged empty, not a mean of
    0), and one warning names the functions; a scored step's reward is the mean over its scored completions."""
    folder = hf_tiny.make_model(tmp_path / "base", seed=3)
    rewards = write_rewards(tmp_path)
    prompts_file = make_prompt_file(tmp_path / "p.jsonl", n=4, answers=False)
    cfg, tok, model = ours(folder, rewards, f"data.path={prompts_file}", f"grpo.rewards=[{rewards}:has_answer]")
    objective = build_objective(cfg)
    train, _ = objective.open_datasets(cfg, tok, tok.vocab_size)
    objective.attach(runtime(cfg, model, None, train, tok))
    values = dict.fromkeys(objective.stat_names, 0.0) | {"completions": 16.0, "completion_len": 64.0}
    with caplog.at_level("WARNING", logger="trainbox"):
        assert objective.step_stats(values)["reward"] is None
        assert objective.step_stats(values)["reward"] is None
    warned = [r.getMessage() for r in caplog.records if "no reward function scored" in r.getMessage()]
    assert len(warned) == 1 and "16 completions" in warned[0] and "rewards.py:has_answer" in warned[0], warned
    assert objective.step_stats(values | {"reward": 3.0, "scored": 4.0})["reward"] == 0.75


VARY = ("time", "tokens_per_s", "mfu", "step_time", "eta", "sample_s")   # the clock's readings


def _metrics(run) -> dict[int, dict]:
    return {e["step"]: e for e in map(json.loads, open(run / "metrics.jsonl")) if e["event"] == "train"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`trainbox train grpo` on a tiny Llama folder: 24 steps of 4 prompts x 4 completions (16 steps an epoch),
    checkpoints every 12 and at the epoch's end, validation prompts every 8 steps."""
    root = tmp_path_factory.mktemp("grpo-run")
    base = hf_tiny.make_model(root / "base", seed=3)
    rewards = write_rewards(root)
    make_prompt_file(root / "train.jsonl", n=64, seed=1)
    make_prompt_file(root / "val.jsonl", n=16, seed=2)
    args = [f"model.path={base}", f"data.path={root / 'train.jsonl'}", f"data.val_path={root / 'val.jsonl'}",
            "data.seq_len=64", "grpo.max_completion_len=8", "grpo.num_generations=4",
            f"grpo.rewards=[{rewards}:low_ids,{rewards}:has_answer]", "train.global_batch_size=4",
            "train.max_steps=24", "train.checkpoint_every=12", "train.eval_every=8", "train.eval_tokens=1024",
            "optim.lr=3e-2", f"run.dir={root / 'runs'}", "monitor.port=0", "monitor.plot=false"]
    proc = run_cli("train", "grpo", *args, cwd=root)
    return root, args, proc


def test_train_grpo_raises_the_reward(run):
    """The validation reward (one completion of each of 16 prompts, drawn with the same seeds at every evaluation)
    rises to 0.8 or more, where the first policy scores about one half (its draws: half the vocabulary is low), as the
    policy learns to draw low ids; the logged figures are consistent with one another. (CPU: 0.59, 0.85, 0.91; an
    H200 in bf16: 0.67 to 0.95.)"""
    root, _, proc = run
    out = root / "runs" / "grpo"
    events = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [8, 16, 24] and all(e["val_prompts"] == 16 for e in evals)
    assert evals[-1]["val_reward"] >= 0.8 and evals[-1]["val_reward"] > evals[0]["val_reward"] + 0.15, evals
    logged = [e for e in events if e["event"] == "train" and "reward" in e]
    assert logged and logged[-1]["reward_low_ids"] > 0.7, logged[-1]
    for e in logged:
        assert 0 < e["completion_len"] <= 8 and 0 <= e["truncated"] <= 1 and 0 <= e["zero_std"] <= 1
        assert e["reward"] == pytest.approx(e["reward_low_ids"] + e.get("reward_has_answer", 0), abs=1e-5)
    assert "val reward" in proc.stdout + proc.stderr
    assert not (out / "samples.txt").exists()


def test_a_lora_grpo_run_raises_the_reward(tmp_path):
    """`model.family=hf`: LoRA adapters on a frozen base, sampled through the llama family's decoder over the run's
    own modules (model/hf/view.py). The base's head is scaled up, as a trained model's is: the frozen head of random
    weights of std 0.02 gives logits too flat for any adapter to move. (CPU: 0.60, 0.82, 0.86.)"""
    from transformers import AutoModelForCausalLM
    base = hf_tiny.make_model(tmp_path / "base", seed=3)
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    model.save_pretrained(base)
    rewards = write_rewards(tmp_path)
    make_prompt_file(tmp_path / "train.jsonl", n=64, seed=1)
    make_prompt_file(tmp_path / "val.jsonl", n=16, seed=2)
    run_cli("train", "grpo", "model.family=hf", f"model.path={base}", f"data.path={tmp_path / 'train.jsonl'}",
            f"data.val_path={tmp_path / 'val.jsonl'}", "data.seq_len=64", "grpo.max_completion_len=8",
            "grpo.num_generations=4", f"grpo.rewards=[{rewards}:low_ids]", "train.global_batch_size=4",
            "train.max_steps=24", "train.eval_every=8", "train.eval_tokens=1024", "optim.lr=1e-2",
            f"run.dir={tmp_path / 'runs'}", "monitor.port=0", "monitor.plot=false", cwd=tmp_path)
    out = tmp_path / "runs" / "grpo"
    evals = [e["val_reward"] for e in map(json.loads, open(out / "metrics.jsonl")) if e["event"] == "eval"]
    assert len(evals) == 3 and evals[-1] >= 0.8 and evals[-1] > evals[0] + 0.15, evals
    saved = load_file(out / "checkpoints" / "step_00000024" / "model.safetensors")
    assert saved and all("lora_" in k for k in saved)   # the adapters alone trained and were kept


def test_a_resumed_grpo_run_continues_exactly(run):
    """The checkpoint at step 16 (the end of the first epoch) resumed to the end: steps 17 to 24 sample the same
    completions and lose what the uninterrupted run lost, bit for bit (CPU); so does the validation at step 24."""
    root, args, _ = run
    whole = root / "runs" / "grpo"
    cut = root / "cut" / "grpo"
    shutil.copytree(whole, cut, ignore=shutil.ignore_patterns("step_00000024", "metrics.jsonl"))
    (cut / "checkpoints" / "latest").write_text("step_00000016")
    run_cli("train", "grpo", *[a for a in args if not a.startswith("run.dir=")], f"run.dir={root / 'cut'}", cwd=root)
    want, got = _metrics(whole), _metrics(cut)
    assert sorted(got) == list(range(17, 25))
    for s in got:
        assert {k: v for k, v in got[s].items() if k not in VARY} == {k: v for k, v in want[s].items()
                                                                     if k not in VARY}, s
    evals = [[e for e in map(json.loads, open(d / "metrics.jsonl")) if e["event"] == "eval" and e["step"] > 16]
             for d in (whole, cut)]
    assert [{k: v for k, v in e.items() if k != "time"} for e in evals[0]] == \
        [{k: v for k, v in e.items() if k != "time"} for e in evals[1]]


@pytest.fixture(scope="module")
def updates_run(run, tmp_path_factory):
    """The fixture's run with grpo.num_iterations=2, the KL term and DAPO's upper clip, 10 steps, a checkpoint every 5
    and a validation every 6 (the steps logged in full: 5, 6, 10)."""
    root, args, _ = run
    args = [a for a in args if not a.startswith(("run.dir=", "train.max_steps=", "train.checkpoint_every=",
                                                 "train.eval_every="))] + [
        "grpo.num_iterations=2", "grpo.epsilon_high=0.28", "grpo.beta=0.04", "train.checkpoint_every=5",
        "train.eval_every=6", "train.max_steps=10"]
    out = tmp_path_factory.mktemp("updates")
    run_cli("train", "grpo", *args, f"run.dir={out / 'whole'}", cwd=root)
    return root, args, out / "whole" / "grpo"


def test_several_updates_a_generation_resume_exactly(updates_run, tmp_path):
    """Steps 5 and 6 train one generation, the same completions (their rewards and lengths logged twice, sampled
    once), the clip binding at the second only; an epoch takes twice the steps. The checkpoint at step 5, in the
    middle of a generation, holds it (pi_old included), and resumed it continues bit for bit; the one at step 10
    needs none."""
    root, args, whole = updates_run
    want = _metrics(whole)
    assert sorted(want) == list(range(1, 11)) and all("reward" in want[s] for s in (5, 6, 10))
    first, second = want[5], want[6]
    assert first["sample_s"] > 0 and second["sample_s"] == 0 and want[10]["sample_s"] == 0
    assert first["clipped"] == 0 and second["clipped"] > 0, (first, second)
    for key in ("reward", "reward_low_ids", "reward_std", "completion_len", "truncated", "zero_std"):
        assert first[key] == second[key], key
    ckpts = whole / "checkpoints"
    assert (ckpts / "step_00000005" / "objective.pt").is_file()
    assert not (ckpts / "step_00000010" / "objective.pt").exists()
    report = json.loads(run_cli("inspect", str(whole), "--json", cwd=root).stdout)
    assert report["steps_per_epoch"] == 2 * 64 // 4

    cut = tmp_path / "cut" / "grpo"
    shutil.copytree(whole, cut, ignore=shutil.ignore_patterns("step_00000010", "metrics.jsonl"))
    (cut / "checkpoints" / "latest").write_text("step_00000005")
    run_cli("train", "grpo", *args, f"run.dir={tmp_path / 'cut'}", cwd=root)
    got = _metrics(cut)
    assert sorted(got) == list(range(6, 11))
    for s in got:
        assert {k: v for k, v in got[s].items() if k not in VARY} == {k: v for k, v in want[s].items()
                                                                     if k not in VARY}, s


@pytest.mark.slow
def test_several_updates_a_generation_in_any_micro_batch(updates_run, tmp_path):
    """The same run at a micro-batch of 4 prompts (one a step, not two): the same losses, kl (a mean over the step's
    trained tokens, whatever the accumulation) and clipped share."""
    root, args, whole = updates_run
    run_cli("train", "grpo", *args, "train.micro_batch_size=4", "train.checkpoints=false",
            f"run.dir={tmp_path / 'one'}", cwd=root)
    want, one = _metrics(whole), _metrics(tmp_path / "one" / "grpo")
    assert sorted(one) == list(range(1, 11)) and one[6]["kl"] > 0 and one[10]["kl"] > 0
    for s in range(1, 11):
        for key in ("loss", "kl", "clipped", "reward"):
            if key in one[s]:
                assert one[s][key] == pytest.approx(want[s][key], abs=1e-5), (s, key)


@pytest.mark.slow
@pytest.mark.parametrize("parallel, extra", [("ddp", []), ("fsdp", ["grpo.beta=0.04"]),
                                             ("ddp", ["grpo.num_iterations=2", "grpo.beta=0.04"])])
def test_two_processes_equal_one(run, tmp_path, parallel, extra):
    """The run's first 8 steps (its own settings otherwise) over 2 processes (gloo), and on one: each process samples
    its prompts' completions with the same seeds, so every step's reward and completion length are the one-process
    run's, its loss within 1e-5 and its gradient norm within 1e-4. (Further on, Adam grows the rounding of gradients
    summed in another order: an element near 0 moves by about the learning rate either way.) Under fsdp each rank
    samples from the gathered units, outside FSDP's hooks, and the KL term's reference is sharded too."""
    root, args, _ = run
    args = [a for a in args if not a.startswith(("run.dir=", "train.max_steps="))] + ["train.max_steps=8", *extra]
    run_cli("train", "grpo", *args, f"run.dir={tmp_path / 'one'}", cwd=root)
    run_cli("train", "grpo", "--nproc", "2", *args, f"run.dir={tmp_path / 'two'}", "train.micro_batch_size=1",
            f"train.parallel={parallel}", cwd=root, timeout=600)
    want, got = _metrics(tmp_path / "one" / "grpo"), _metrics(tmp_path / "two" / "grpo")
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for s in want:
        for key in ("loss", "reward", "reward_low_ids", "completion_len", "kl"):
            if key in want[s]:
                assert got[s][key] == pytest.approx(want[s][key], abs=1e-5), (s, key)
    assert "reward" in want[8] and got[8]["grad_norm"] == pytest.approx(want[8]["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_a_generation_saved_by_two_processes_resumes_on_one(run, tmp_path):
    """grpo.num_iterations=2 over 2 processes (gloo), a checkpoint at step 3, in the middle of the second
    generation: each rank saves its own completions, and one process resuming it takes them all, so steps 4 to 8
    lose what the two processes lost (within 1e-5) and log their rewards."""
    root, args, _ = run
    args = [a for a in args if not a.startswith(("run.dir=", "train.max_steps=", "train.checkpoint_every="))] + [
        "train.max_steps=8", "train.checkpoint_every=3", "train.keep_last=3", "grpo.num_iterations=2"]
    run_cli("train", "grpo", "--nproc", "2", *args, f"run.dir={tmp_path / 'two'}", "train.micro_batch_size=1",
            cwd=root, timeout=600)
    two = tmp_path / "two" / "grpo"
    saved = torch.load(two / "checkpoints" / "step_00000003" / "objective.pt", weights_only=True)
    assert len(saved) == 2 and all(len(s["rows"]) == 2 * 4 for s in saved)   # 2 prompts x 4 completions a rank
    cut = tmp_path / "one" / "grpo"
    shutil.copytree(two, cut, ignore=shutil.ignore_patterns("step_0000000[68]", "metrics.jsonl"))
    (cut / "checkpoints" / "latest").write_text("step_00000003")
    run_cli("train", "grpo", *args, f"run.dir={tmp_path / 'one'}", cwd=root)
    want, got = _metrics(two), _metrics(cut)
    assert sorted(got) == list(range(4, 9))
    for s in got:
        for key in ("loss", "reward", "completion_len", "clipped"):
            if key in want[s]:
                assert got[s][key] == pytest.approx(want[s][key], abs=1e-5), (s, key)
    assert "reward" in got[8]


@pytest.mark.parametrize("overrides, says", [
    (["model.family=gpt", "model.path=null"], "model.family=gpt does not give"),
    (["data.packing=true"], "each sampled completion in a row of its own"),
    (["grpo.max_completion_len=64"], "leaves no room for a prompt"),
    (["grpo.reward_weights=[1,2]"], "2 weight(s) for 1 reward function"),
    (["grpo.loss=cispo"], "ScaleRL's choice: grpo.epsilon_high=5.0"),
    (["train.objective=dpo", "grpo.beta=0.1"], "applies to train.objective=grpo, not dpo"),
])
def test_refused_settings_name_the_key(overrides, says):
    from trainbox.errors import ConfigError
    with pytest.raises((ConfigError, ValueError)) as e:
        load_config("grpo", ["model.path=/nowhere", "data.seq_len=64", "grpo.max_completion_len=16",
                             "grpo.rewards=[x.py:f]", *overrides])
    assert says in str(e.value)


@pytest.mark.parametrize("spec, says", [("nowhere.py:f", "no file"), ("{rewards}:missing", "has no function missing"),
                                        ("no_such_module_x:f", "cannot import"), ("justaname", "is not 'module")])
def test_bad_reward_functions_are_named(tmp_path, spec, says):
    from trainbox.errors import ConfigError
    from trainbox.objective.rewards import load_reward
    rewards = write_rewards(tmp_path)
    with pytest.raises(ConfigError, match=says):
        load_reward(spec.format(rewards=rewards))


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    """A tiny reward model, `trainbox train reward` on arithmetic preference pairs (its recipe's settings)."""
    root = tmp_path_factory.mktemp("grpo-reward")
    base = hf_tiny.make_model(root / "base", seed=3)
    prefs = hf_tiny.make_preference_file(root / "prefs.jsonl", n=48, seed=1)
    run_cli("train", "reward", f"model.path={base}", f"data.path={prefs}", "data.seq_len=64",
            "train.global_batch_size=8", "train.max_steps=6", "optim.lr=2e-3", f"run.dir={root / 'runs'}",
            "monitor.port=0", "monitor.plot=false", f"data.cache_dir={root / 'cache'}", cwd=root)
    return root, base, root / "runs" / "reward"


def test_a_reward_run_scores_completions_as_transformers_scores_its_export(reward_run):
    """grpo.rewards=[a reward run's directory]: each completion (after its message prompt) scores what transformers'
    LlamaForSequenceClassification of the run's export gives the same conversation, within 1e-5."""
    root, base, run = reward_run
    run_cli("export", str(run), "--format", "hf", "--out", str(root / "rm"))
    prompts_file = make_prompt_file(root / "prompts.jsonl", n=8)
    cfg, tok, model = ours(base, write_rewards(root), f"data.path={prompts_file}", f"grpo.rewards=[{run}]")
    objective = build_objective(cfg)
    train, _ = objective.open_datasets(cfg, tok, tok.vocab_size)
    objective.attach(runtime(cfg, model, None, train, tok))
    answers = ["one plus two equals three", "it equals seven", "two plus two equals four"]
    completions = [tok.encode(a) + [tok.eot_id] for a in answers[:2]] + [tok.encode(answers[2])]   # the last cut
    indices = [0, 0, 1]
    scores = objective._score(train, indices, completions)[:, 0]

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(root / "rm", dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(root / "rm")
    chats = [train.rows[i]["prompt"] + [{"role": "assistant", "content": a}] for i, a in zip(indices, answers)]
    enc = hf_tok([hf_tok.apply_chat_template(c, tokenize=False) for c in chats], return_tensors="pt", padding=True,
                 add_special_tokens=False)
    with torch.no_grad():
        want = hf(**enc).logits.squeeze(-1).double()
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_grpo_run_trains_on_a_reward_runs_scores(reward_run):
    """`trainbox train grpo grpo.rewards=[a reward run]`: the steps are scored by it (logged as reward_reward), with
    scores that differ within a group."""
    root, base, run = reward_run
    prompts_file = make_prompt_file(root / "prompts-run.jsonl", n=8)
    run_cli("train", "grpo", f"model.path={base}", f"data.path={prompts_file}", "data.seq_len=64",
            "grpo.max_completion_len=8", "grpo.num_generations=4", f"grpo.rewards=[{run}]",
            "train.global_batch_size=4", "train.max_steps=2", f"run.dir={root / 'grpo'}",
            "monitor.port=0", "monitor.plot=false", cwd=root)
    logged = _metrics(root / "grpo" / "grpo")
    scored = [e for e in logged.values() if "reward" in e]   # the recipe's log cadence: the last step at least
    assert sorted(logged) == [1, 2] and scored and all(e["reward"] == e["reward_reward"] for e in scored)
    assert all(e["reward_std"] > 0 for e in scored)


def test_loss_png_of_a_grpo_run_draws_its_rewards_without_warnings(tmp_path):
    """monitor/plot.py on a grpo run's metrics (reward each step, val_reward at validations, no KL: beta 0): the
    rewards are curves of the preference row, and no panel without a curve asks for a legend (matplotlib's
    warning, here an error)."""
    import warnings

    from trainbox.monitor.plot import load_curves, plot_curves
    run = tmp_path / "grpo"
    run.mkdir()
    events = [{"event": "train", "step": s, "loss": 0.1, "reward": 0.5 + s / 100} for s in range(1, 9)]
    events += [{"event": "eval", "step": s, "val_loss": 0.2, "val_reward": 0.6} for s in (4, 8)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    curves = load_curves(run)
    assert [v for _, v in curves.prefs["reward"]] == [0.5 + s / 100 for s in range(1, 9)]
    assert curves.prefs["val_reward"] == [(4, 0.6), (8, 0.6)] and "kl" not in curves.prefs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = plot_curves([curves], tmp_path / "loss.png")
    assert out.stat().st_size > 10_000
