"""Packing that respects examples (data.packing; data/packing.py, kernels/packed.py).

The reference is each example run alone: inside a packed row, every example's logits must equal those (fp32,
CPU, within 1e-4) for the llama, gpt and hf families, and the row's summed loss the examples' summed losses. The
same check on a row without its example ids and positions (a stream cut into windows, where attention crosses
examples) must fail, so the check has teeth. Then the pieces: first-fit decreasing against a plain reference,
the rows a batch carries, the kernel choice, the refusal of a family that cannot pack, and an end-to-end
`trainbox train sft ... data.packing=true` that trains and resumes to the uninterrupted run's losses.
GPU checks (FlexAttention and FlashAttention-4 against SDPA; transformers' flash_attention_2) are marked `gpu`.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from trainbox.config import load_config
from trainbox.data.packing import ExampleDataset, first_fit_decreasing, packed_inputs
from trainbox.data.sft import build_examples
from trainbox.errors import ConfigError
from trainbox.kernels.choice import choose
from trainbox.model.build import build_model
from trainbox.model.spec import family

VOCAB, SEQ = 96, 32


def examples(n: int = 7, seed: int = 0) -> list[list[int]]:
    """Token lists of 2 to SEQ + 1 tokens, a few of them short, one of the full length."""
    rng = random.Random(seed)
    lengths = [SEQ + 1, 2, 3] + [rng.randint(2, SEQ // 2) for _ in range(n - 3)]
    return [[rng.randrange(VOCAB) for _ in range(k)] for k in lengths]


def dataset(exs: list[list[int]], packed: bool = True, seq_len: int = SEQ) -> ExampleDataset:
    masks = [[int(i % 3 != 0) for i in range(len(e))] for e in exs]
    tokens, mask, starts, stats = build_examples(zip(exs, masks), seq_len)
    return ExampleDataset(tokens, mask, starts, seq_len, pad_id=0, packed=packed, report=stats)


def tiny(family_name: str, **over):
    args = [f"model.family={family_name}", "model.n_layer=2", "model.n_embd=32", "model.n_head=4",
            *(f"{k}={v}" for k, v in over.items())]
    torch.manual_seed(0)
    model = build_model(load_config("tiny", args).model, VOCAB, SEQ)
    with torch.no_grad():   # every weight random, norms and biases included (zeros and ones hide mistakes)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


MODELS = {"llama": lambda: tiny("llama", **{"model.llama.n_kv_head": 2, "model.llama.rope_theta": 100.0}),
          "gpt": lambda: tiny("gpt"),
          "gpt-fused-norm": lambda: tiny("gpt", **{"model.fused_norm": "true"})}   # the blocks' fused path


def row_logits(model, batch: dict) -> torch.Tensor:
    return model.lm_head(model.hidden(batch["x"], **packed_inputs(batch)))


def check_rows_match_alone(logits_of, ds: ExampleDataset, exs: list[list[int]], alone_of) -> float:
    """The largest difference between an example's logits in its packed row and alone, over every example."""
    worst, seen = 0.0, 0
    for r in range(ds.num_samples):
        batch = ds.batch([r])
        with torch.no_grad():
            got = logits_of(batch)[0]
        docs = batch["doc_ids"][0]
        for k, e in enumerate(ds.row_examples[ds.row_offsets[r]:ds.row_offsets[r + 1]].tolist()):
            ids = torch.tensor(exs[e][:-1])[None]
            with torch.no_grad():
                want = alone_of(ids)[0]
            worst = max(worst, float((got[docs == k] - want).abs().max()))
            seen += 1
    assert seen == len(exs)
    return worst


@pytest.mark.parametrize("name", list(MODELS))
def test_examples_in_a_packed_row_compute_what_they_compute_alone(name):
    model, exs = MODELS[name](), examples()
    ds = dataset(exs)
    assert ds.num_samples < len(exs)          # several examples share rows
    worst = check_rows_match_alone(lambda b: row_logits(model, b), ds, exs,
                                   lambda ids: model.lm_head(model.hidden(ids)))
    assert worst < 1e-4, worst
    # the loss of a packed batch is the examples' losses summed, each computed alone
    batch = ds.batch(range(ds.num_samples))
    with torch.no_grad():
        packed = model(batch["x"], batch["y"], batch["loss_mask"], reduction="sum", **packed_inputs(batch)).loss
        alone = dataset(exs, packed=False).batch(range(len(exs)))
        padded = model(alone["x"], alone["y"], alone["loss_mask"], reduction="sum").loss
    assert abs(float(packed) - float(padded)) < 1e-4 * float(padded)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_check_fails_on_rows_whose_attention_crosses_examples(name):
    """A packed row forwarded without its example ids and positions is a window of a stream: the examples after
    the first see the ones before them, and the check above catches it."""
    model, exs = MODELS[name](), examples()
    ds = dataset(exs)
    worst = check_rows_match_alone(lambda b: model.lm_head(model.hidden(b["x"])), ds, exs,
                                   lambda ids: model.lm_head(model.hidden(ids)))
    assert worst > 1e-2, worst


@pytest.mark.parametrize("arch,impl", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa")])
def test_hf_family_packed_rows_match_examples_alone(tmp_path, arch, impl):
    """A transformers model under PEFT (tests/hf_tiny.py): transformers' own position_ids and a 4D mask."""
    pytest.importorskip("peft")
    import hf_tiny

    from trainbox.model.hf.model import build_hf
    folder = hf_tiny.make_model(tmp_path / "m", arch=arch)
    run = load_config("lora", [f"model.path={folder}", "train.device=cpu", "lora.dropout=0.0"])
    model = build_hf(run).eval()
    base = model.peft.get_base_model()
    base.set_attn_implementation(impl)
    assert model.hf_config._attn_implementation == impl
    with torch.no_grad():   # LoRA starts as the identity (B = 0): give the adapters weight so they count too
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    exs = examples()
    ds = dataset(exs)

    def alone(ids):
        return model.peft(input_ids=ids).logits
    worst = check_rows_match_alone(lambda b: model.packed_logits(b["x"], b["doc_ids"], b["position_ids"]), ds, exs,
                                   alone)
    assert worst < 1e-4, worst
    crossing = check_rows_match_alone(lambda b: model.peft(input_ids=b["x"]).logits, ds, exs, alone)
    assert crossing > 1e-2, crossing


def test_first_fit_decreasing_matches_the_plain_algorithm():
    def plain(lengths, capacity):   # the textbook form: scan the bins in order for each item, longest first
        bins, room = [], []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            b = next((j for j, r in enumerate(room) if r >= lengths[i]), None)
            if b is None:
                bins.append([])
                room.append(capacity)
                b = len(bins) - 1
            bins[b].append(i)
            room[b] -= lengths[i]
        return bins

    rng = random.Random(1)
    for n, capacity in ((1, 8), (37, 16), (500, 2048)):
        lengths = [rng.randint(1, capacity) if rng.random() < 0.2 else rng.randint(1, capacity // 8 + 1)
                   for _ in range(n)]
        got = first_fit_decreasing(np.array(lengths), capacity)
        assert got == plain(lengths, capacity)
        assert all(sum(lengths[i] for i in b) <= capacity for b in got)
    assert first_fit_decreasing(np.array([5, 3, 4, 4]), 8) == [[0, 1], [2, 3]]


def test_rows_carry_whole_examples_their_ids_and_positions():
    exs = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], list(range(20, 31))]   # the last is longer than seq_len + 1
    masks = [[0, 1, 1], [0, 0, 1, 1, 1, 1], [0, 1], [1] * 11]
    tokens, mask, starts, stats = build_examples(zip(exs + [[7, 7]], masks + [[1, 0]]), seq_len=8)
    assert stats == {"examples": 5, "truncated": 1, "truncated_tokens": 2, "dropped": 1, "trained_tokens": 15}
    ds = ExampleDataset(tokens, mask, starts, 8, pad_id=0, packed=True, report=stats)
    # lengths in positions 2, 5, 1, 8: first-fit decreasing puts [8], [5, 2, 1]
    assert ds.num_samples == 2 and ds.report["fill"] == 1.0
    b = ds.batch([1])
    assert b["x"].tolist() == [[4, 5, 6, 7, 8, 1, 2, 10]]
    assert b["y"].tolist() == [[5, 6, 7, 8, 9, 2, 3, 11]]
    assert b["loss_mask"].tolist() == [[False, True, True, True, True, True, True, True]]
    assert b["doc_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 2]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 0]]
    assert ds.batch([0])["x"].tolist() == [list(range(20, 28))]     # the first seq_len + 1 tokens of the long one
    assert ds.target_count([0, 1]) == int(ds.batch([0, 1])["loss_mask"].sum()) == 15
    line = ds.describe()
    assert "4 examples packed by first-fit decreasing into 2 rows of 8" in line and "1 longer than" in line \
        and "2 tokens cut" in line and "1 without a trained token" in line
    # unpacked: one example per row, padded and masked, no ids (plain causal attention)
    padded = ExampleDataset(tokens, mask, starts, 8, pad_id=0, packed=False)
    b = padded.batch([0, 2])
    assert set(b) == {"x", "y", "loss_mask"} and padded.num_samples == 4
    assert b["x"].tolist() == [[1, 2, 0, 0, 0, 0, 0, 0], [10, 0, 0, 0, 0, 0, 0, 0]]
    assert b["loss_mask"].tolist() == [[True, True] + [False] * 6, [True] + [False] * 7]


def test_the_kernel_for_packed_rows_is_chosen_once_and_recorded():
    cpu = torch.device("cpu")
    model = load_config("tiny", ["model.family=llama"]).model
    assert choose(model, cpu, family("llama"), packed=True).packed == "sdpa"
    assert choose(model, cpu, family("llama")).packed == "off"
    assert choose(load_config("tiny").model, cpu, family("gpt"), packed=True).packed == "sdpa"
    assert choose(load_config("lora").model, cpu, family("hf"), packed=True).packed == "hf"
    assert "packed sdpa" in choose(model, cpu, family("llama"), packed=True).describe()
    # the model asks the same function when it meets packed rows
    m = MODELS["llama"]()
    m.hidden(*(lambda b: (b["x"], None, 0, b["doc_ids"], b["position_ids"]))(dataset(examples()).batch([0])))
    assert m.packed_kernel == "sdpa"


def test_a_family_that_cannot_pack_is_refused_naming_data_packing(tmp_path, monkeypatch):
    import toy_family

    from trainbox.model import spec
    from trainbox.train.preflight import preflight
    with pytest.raises(ConfigError, match="data.packing") as e:
        family("moe").check_packing()
    assert "data.packing=false" in e.value.hint and "gpt" in e.value.hint
    # a family that reads examples (its reads_examples hook) but declares no packed attention: refused before work
    monkeypatch.setitem(spec.families(), "toy", toy_family.FAMILY)
    monkeypatch.setattr(toy_family, "reads_examples", lambda run: True, raising=False)
    chats = tmp_path / "chat.jsonl"
    chats.write_text('{"text": "one two"}\n')
    cfg = load_config("tiny", ["model.family=toy", f"data.path={chats}", "train.device=cpu"])
    with pytest.raises(ConfigError, match="data.packing=true .* model.family=toy cannot"):
        preflight(cfg, world=1)
    preflight(load_config("tiny", ["model.family=toy", f"data.path={chats}", "train.device=cpu",
                                   "data.packing=false"]), world=1)


def test_train_sft_packed_trains_and_resumes_exactly(tmp_path):
    """The sft recipe with model.path=FOLDER data.path=chat.jsonl data.packing=true, cut at step 3 and run again:
    the uninterrupted run's losses bit for bit; the rows are packed and the run says so."""
    pytest.importorskip("transformers")
    import hf_tiny

    from trainbox.train.loop import train
    base = hf_tiny.make_model(tmp_path / "base", arch="llama")
    chats = hf_tiny.make_chat_file(tmp_path / "chat.jsonl", n=64)

    def args(name: str, steps: int) -> list[str]:
        return ["sft", f"model.path={base}", f"data.path={chats}", "data.packing=true", "data.seq_len=64",
                f"run.name={name}", f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",
                "train.global_batch_size=4", "train.micro_batch_size=2", f"train.max_steps={steps}",
                "optim.lr=3e-3", "optim.warmup_steps=0", "optim.schedule=constant", "train.sample_tokens=0",
                "train.checkpoint_every=3", "monitor.enabled=false", "train.threads=1", "monitor.log_every=1"]

    def events(name: str) -> list[dict]:
        return [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]

    for name, steps in (("straight", 6), ("cut", 3), ("cut", 6)):
        recipe, *overrides = args(name, steps)
        train(load_config(recipe, overrides))
    straight = [e["loss"] for e in events("straight") if e["event"] == "train"]
    cut = [e["loss"] for e in events("cut") if e["event"] == "train"]
    assert len(straight) == 6 and cut == straight
    assert straight[-1] < straight[0]
    start = next(e for e in events("straight") if e["event"] == "start")
    report = start["examples"]
    assert report["packed"] and report["examples_in_rows"] == 64 and report["rows"] < 64 and report["fill"] > 0.5
    assert start["kernels"]["packed"] == "sdpa"
    env = json.loads((tmp_path / "runs" / "straight" / "env.json").read_text())
    assert env["kernels"]["packed"] == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["flex", "flash"])
def test_gpu_kernels_match_sdpa_on_packed_rows(kernel):
    from trainbox.kernels.flash import flash_available
    from trainbox.kernels.packed import doc_attention, doc_mask
    if kernel == "flash" and not flash_available(torch.device("cuda")):
        pytest.skip("FlashAttention-4 (trainbox[flash]) is not installed or this GPU is not Hopper/Blackwell")
    exs = examples(40, seed=3)
    ds = dataset([e * 8 for e in exs], seq_len=256)     # examples of 16 to 257 tokens
    docs = ds.batch(range(ds.num_samples))["doc_ids"].cuda()
    B, T = docs.shape
    torch.manual_seed(0)
    q = torch.randn(B, 8, T, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, 2, T, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    got = doc_attention(q, k, v, doc_mask(docs, kernel))
    want = doc_attention(q.float(), k.float(), v.float(), doc_mask(docs, "sdpa"))
    assert (got.float() - want).abs().max() < 2e-2
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), g)
    ref = torch.autograd.grad(want, (q, k, v), g.float())
    for a, b in zip(grads, ref):
        assert (a.float() - b).abs().max() < 5e-2 * b.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_hf_flash_attention_2_packed_rows(tmp_path):
    pytest.importorskip("flash_attn", reason="transformers' flash_attention_2 needs the flash-attn package")
    pytest.importorskip("peft")
    import hf_tiny

    from trainbox.model.hf.model import build_hf
    folder = hf_tiny.make_model(tmp_path / "m", arch="llama")
    model = build_hf(load_config("lora", [f"model.path={folder}", "lora.dropout=0.0"])).cuda().eval()
    base = model.peft.get_base_model().to(torch.bfloat16)
    if hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation("flash_attention_2")
    else:   # transformers before 4.48
        base.config._attn_implementation = "flash_attention_2"
    exs = examples()
    ds = dataset(exs)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        worst = check_rows_match_alone(
            lambda b: model.packed_logits(b["x"].cuda(), b["doc_ids"].cuda(), b["position_ids"].cuda()).float().cpu(),
            ds, exs, lambda ids: model.peft(input_ids=ids.cuda()).logits.float().cpu())
    assert worst < 5e-2, worst
