"""`trainbox chat` and `trainbox export` with the engines that run the result: tiny models fine-tuned on chats
whose answers are short (so they learn to emit <|im_end|>), chatted with through a pipe, exported to Hugging Face
folders that transformers' `generate` stops at the end of a turn, and to GGUF files read back by gguf's
GGUFReader and, where llama-cpp-python is installed, run by llama.cpp itself."""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import run_cli

from trainbox.chat import ChatSession, open_chat
from trainbox.cli import main
from trainbox.config import load_config
from trainbox.data.chat import CHATML, template_for
from trainbox.export import export
from trainbox.train.loop import Trainer

transformers = pytest.importorskip("transformers")
import hf_tiny  # noqa: E402

QUESTIONS = ["what is two plus three", "what is one plus four", "what is zero plus one"]


def sft_args(tmp, base, chats, name: str, *more: str) -> list[str]:
    return [f"model.path={base}", f"data.path={chats}", "data.seq_len=64", f"run.name={name}",
            f"run.dir={tmp / 'runs'}", f"data.cache_dir={tmp / 'cache'}", "train.global_batch_size=8",
            "train.micro_batch_size=8", "train.max_steps=150", "optim.warmup_steps=0", "train.sample_tokens=0",
            "monitor.enabled=false", "train.threads=1", "train.activation_checkpointing=none", *more]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A full fine-tune (llama family, model.path) and a LoRA run (hf family) of one tiny Llama folder on chats
    whose answers are four words and <|im_end|>."""
    tmp = tmp_path_factory.mktemp("chat")
    base = hf_tiny.make_model(tmp / "base", "llama")
    chats = hf_tiny.make_chat_file(tmp / "chat.jsonl", n=96)
    sft = load_config("sft", sft_args(tmp, base, chats, "sft", "optim.lr=3e-3"))
    Trainer(sft).run()
    lora = load_config("lora", sft_args(tmp, base, chats, "lora", "optim.lr=1e-2", "lora.r=16", "lora.dropout=0.0",
                                        "lora.gradient_checkpointing=false"))
    Trainer(lora).run()
    return {"tmp": tmp, "base": base, "sft": sft.run_dir, "lora": lora.run_dir}


def tiny_run(tmp, tiny, name: str, *more: str):
    """A 4-step pretraining run of a family on the embedded corpus (its shakespeare BPE tokenizer)."""
    cfg = load_config(None, [*tiny, f"run.name={name}", "train.max_steps=4", "train.eval_every=0",
                             "monitor.enabled=false", "train.sample_tokens=0", "train.threads=1", *more])
    Trainer(cfg).run()
    return cfg.run_dir


# ----------------------------------------------------------------------------- chat


def test_chat_streams_one_answer_per_line_through_a_pipe(runs):
    """Each line sent is answered (token by token: stdout flushed per piece) before the next one is sent, each
    answer ends at <|im_end|>, /reset clears the history, and EOF ends the command with exit 0."""
    reference = open_chat(runs["sft"], "cpu", temperature=0, max_tokens=24)
    expected = []
    for q in QUESTIONS[:2]:
        pieces = list(reference.turn(q))
        assert len(pieces) > 1 and reference.last.stopped == "end_of_turn", (pieces, reference.last)
        expected.append("".join(pieces))
    reference.reset()
    expected.append("".join(reference.turn(QUESTIONS[2])))
    assert reference.last.stopped == "end_of_turn"

    proc = subprocess.Popen([sys.executable, "-m", "trainbox", "chat", str(runs["sft"]), "--temperature", "0",
                             "--max-tokens", "24"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        answers = []
        for line in [QUESTIONS[0], QUESTIONS[1], "/reset", QUESTIONS[2]]:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            if line == "/reset":
                continue
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready, "no answer within 120 s"
            answers.append(proc.stdout.readline().rstrip("\n"))   # the answer arrives before the next line is sent
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
        rest, err = proc.stdout.read(), proc.stderr.read()
    finally:
        proc.kill()
    assert answers == expected and rest == ""
    assert "answers end at <|im_end|>" in err and "(history cleared)" in err and "--max-tokens" not in err


def test_chat_keeps_the_cache_and_answers_as_a_fresh_encoding_does(runs):
    """Across turns the cache is reused (only the new tokens are fed) and the greedy answers equal those of a
    session that re-encodes the whole conversation every turn; the LoRA (transformers cache) run too."""
    for run in ("sft", "lora"):
        kept = open_chat(runs[run], "cpu", temperature=0, max_tokens=24)
        fresh = open_chat(runs[run], "cpu", temperature=0, max_tokens=24)
        for i, q in enumerate(QUESTIONS[:2]):
            before = len(kept.cached)
            a = "".join(kept.turn(q))
            fresh.cached = []
            b = "".join(fresh.turn(q))
            assert a == b and kept.last.ids == fresh.last.ids, run
            if i:
                assert kept.reused >= before - 1 > 0, (run, kept.reused, before)


def test_chat_goes_on_in_a_template_that_renders_earlier_answers_again(runs):
    """Qwen3's template renders an answer without its reasoning block once a question follows it: each turn's prompt
    is the conversation as the template renders it whole, and the answers are those of a session that encodes
    the whole conversation afresh every turn."""
    from trainbox.data.chat import ChatTemplate
    from trainbox.model.load import load_for_inference
    model, tok, _ = load_for_inference(runs["sft"])
    template = ChatTemplate(hf_tiny.REASONING, "reasoning")
    kept = ChatSession(model, tok, template, temperature=0, max_tokens=12)
    fresh = ChatSession(model, tok, template, temperature=0, max_tokens=12)
    assert kept.end_text == "<|im_end|>"
    for q in QUESTIONS[:2]:
        answer = "".join(kept.turn(q))
        fresh.cached = []
        assert answer == "".join(fresh.turn(q)) and kept.last.ids == fresh.last.ids
    asked = kept.messages[:3]   # the first question and answer, then the second question
    assert tok.decode(kept.prompt_ids(asked)) == template.render(asked, add_generation_prompt=True)
    assert "<think>" not in tok.decode(kept.prompt_ids(asked))   # the first answer, no longer the last, has none


def test_a_model_trained_from_scratch_chats_and_generates_within_its_block_size(tmp_path, tiny, caplog):
    """A model trained from scratch supports data.seq_len positions: a conversation longer drops its oldest turns,
    and generate past it slides its window, each said in a warning."""
    run = tiny_run(tmp_path, tiny, "gpt", "data.seq_len=64")
    session = open_chat(run, "cpu", temperature=0, max_tokens=24)
    assert session.limit == 64
    for q in QUESTIONS:
        "".join(session.turn(q))
        assert len(session.cached) < session.limit
    assert "exceeded the model's 64-token context: dropped its 1 oldest turn(s)" in caplog.text
    asked = [m["content"] for m in session.messages if m["role"] == "user"]
    assert asked == QUESTIONS[-len(asked):] and len(asked) < len(QUESTIONS)
    assert main(["generate", str(run), "--prompt", " ".join(QUESTIONS * 3), "--max-tokens", "8",
                 "--temperature", "0"]) == 0
    assert "the prompt and the text exceed the model's 64-token context" in caplog.text


def test_chat_caches_grow_with_the_conversation_up_to_a_long_context(tmp_path, tiny):
    """A model of a long context (model.block_size=4096) chats in caches as long as its conversation (2,048
    positions at first, then twice as many); a turn that outgrows them feeds the whole conversation again into new
    ones, and the answers equal those of a session that encodes the whole conversation afresh every turn."""
    run = tiny_run(tmp_path, tiny, "long", "model.block_size=4096")
    system = " ".join(["what is the sum of one and two"] * 260)
    kept = open_chat(run, "cpu", system=system, temperature=0, max_tokens=16)
    fresh = open_chat(run, "cpu", system=system, temperature=0, max_tokens=16)
    assert kept.limit == 4096 and kept.room == 0
    rooms, reused = [], []
    for q in QUESTIONS:
        a = "".join(kept.turn(q))
        fresh.cached = []
        assert a == "".join(fresh.turn(q)) and kept.last.ids == fresh.last.ids
        rooms.append(kept.room)
        reused.append(kept.reused)
    assert 2048 < rooms[0] < 4096 and rooms[1:] == [4096, 4096], rooms
    assert reused[1] == 0 and reused[2] > rooms[0], reused   # grown: fed again; then kept


def test_a_fine_tune_of_a_folder_generates_and_chats_in_the_folders_context(runs, sft_hf, caplog, capsys):
    """A run fine-tuned from a Hugging Face folder (data.seq_len=64) supports the folder's 256 positions
    (max_position_embeddings), not its seq_len: `trainbox generate` of a prompt longer than 64 tokens continues it
    as transformers does the exported model, and a conversation past 64 tokens keeps every turn in one cache, its
    answer transformers' over the same ids; the LoRA run's context is the folder's too."""
    tok = transformers.AutoTokenizer.from_pretrained(sft_hf)
    hf = transformers.AutoModelForCausalLM.from_pretrained(sft_hf).eval()
    prompt = tok.apply_chat_template([{"role": r, "content": q} for q in QUESTIONS for r in ("user", "assistant")]
                                     + [{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                     tokenize=False)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert len(ids) > 64
    with torch.no_grad():
        new = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=tok.eos_token_id,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    new = new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
    capsys.readouterr()
    assert main(["generate", str(runs["sft"]), "--prompt", prompt, "--max-tokens", "40", "--temperature", "0"]) == 0
    assert "context" not in caplog.text and capsys.readouterr().out == prompt + tok.decode(new) + "\n"

    for run in ("sft", "lora"):
        assert open_chat(runs[run], "cpu", temperature=0, max_tokens=24).limit == 256
    session = open_chat(runs["sft"], "cpu", temperature=0, max_tokens=24)
    for q in QUESTIONS:
        asked = session.prompt_ids(session.messages + [{"role": "user", "content": q}])
        "".join(session.turn(q))
    assert len(session.cached) > 64 and "dropped" not in caplog.text
    assert [m["content"] for m in session.messages if m["role"] == "user"] == QUESTIONS
    with torch.no_grad():
        full = hf.generate(torch.tensor([asked]), max_new_tokens=24, do_sample=False,
                           attention_mask=torch.ones(1, len(asked), dtype=torch.long))[0, len(asked):].tolist()
    assert session.last.stopped == "end_of_turn" and full == session.last.ids + [session.end_id], (full, session.last)


def test_chat_stops_at_a_marker_of_several_tokens(tmp_path, tiny):
    """gpt2-style tokenizers have no <|im_end|> token: the answer stops where its text appears, which is never
    shown."""
    run = tiny_run(tmp_path, tiny, "gpt", "data.seq_len=96")
    session = open_chat(run, "cpu", temperature=0, max_tokens=40)
    assert session.end_id is None and session.end_text == "<|im_end|>"
    forced = session.tokenizer.encode("hello<|im_end|>")
    session.model.forward = _scripted(session.model, forced)
    pieces = list(session.turn("hi"))
    assert "".join(pieces) == "hello" and session.last.stopped == "end_of_turn"
    assert all("<" not in p for p in pieces)


def _scripted(model, ids: list[int]):
    """A forward whose next-token logits spell `ids`, one per call."""
    real, calls = model.forward, iter(ids)

    def forward(idx, caches=None, pos=0, **kw):
        out = real(idx, caches=caches, pos=pos, **kw)
        logits = torch.full_like(out.logits, -1e4)
        logits[..., next(calls, ids[-1])] = 0
        out.logits = logits
        return out
    return forward


# ----------------------------------------------------------------------------- Hugging Face export


@pytest.fixture(scope="module")
def sft_hf(runs):
    """The sft run exported to a Hugging Face folder (fp32, as `export` writes by default), read by the tests
    that only read it."""
    out = runs["tmp"] / "sft-hf"
    run_cli("export", str(runs["sft"]), "--format", "hf", "--out", str(out))
    return out


@pytest.mark.parametrize("run", ["sft", "lora"])
def test_hf_export_stops_at_the_end_of_a_turn_in_transformers(runs, run, request):
    """generation_config.json lists end-of-text and <|im_end|>; transformers' generate, from the exported
    tokenizer's own chat template, stops at <|im_end|> with our chat's answer."""
    if run == "sft":
        out = request.getfixturevalue("sft_hf")
    else:
        out = runs["tmp"] / f"{run}-hf"
        run_cli("export", str(runs[run]), "--format", "hf", "--out", str(out), "--force", "--merge")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [tok.eos_token_id, end]
    assert tok.chat_template == hf_tiny.CHATML
    ours = open_chat(runs[run], "cpu", temperature=0, max_tokens=24)
    for q in QUESTIONS:
        ours.reset()
        answer = "".join(ours.turn(q))
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            full = model.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1]:].tolist()
        assert full[-1] == end and len(full) < 24, tok.decode(full)
        assert tok.decode(full[:-1]) == answer


def test_hf_export_dtype(runs, sft_hf):
    out = runs["tmp"] / "sft-bf16"
    run_cli("export", str(runs["sft"]), "--out", str(out), "--dtype", "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(sft_hf)
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    for (name, a), b in zip(fp32.named_parameters(), model.parameters()):
        assert torch.equal(a.detach().to(torch.bfloat16), b.detach()), name


def _export(run, out, *more: str):
    run_cli("export", str(run), "--out", str(out), "--force", *more)
    return out


# ----------------------------------------------------------------------------- GGUF


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate_half rows -> interleaved RoPE pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LLAMA_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}   # the last two: Qwen3's


def llama_state(tensors: dict, hf: dict) -> dict[str, torch.Tensor]:
    """A llama GGUF file's tensors (read_gguf: dequantized) as a LlamaForCausalLM state dict: expected_tensors'
    naming and q/k permutation undone."""
    heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
           "output_norm.weight": "model.norm.weight"}
    layer = {ours: theirs for theirs, ours in LLAMA_NAMES.items()}
    state = {}
    for name, (_, w) in tensors.items():
        if name in top:
            state[top[name]] = w
            continue
        _, i, kind, suffix = name.split(".")
        if kind in heads:   # interleaved pairs back to the halves of each head
            w = w.reshape(heads[kind], w.shape[0] // heads[kind] // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        state[f"model.layers.{i}.{layer[kind]}.{suffix}"] = w
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}


def expected_tensors(folder) -> dict[str, np.ndarray]:
    """The tensors llama.cpp's converter writes for a Hugging Face folder, by its naming, written out here."""
    from safetensors.numpy import load_file
    hf = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    out = {}
    if hf["model_type"] == "gpt2":
        out.update({"token_embd.weight": state["transformer.wte.weight"],
                    "position_embd.weight": state["transformer.wpe.weight"],
                    "output_norm.weight": state["transformer.ln_f.weight"],
                    "output_norm.bias": state["transformer.ln_f.bias"]})
        names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
                 "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
        for i in range(hf["n_layer"]):
            for theirs, ours in names.items():
                for kind in ("weight", "bias"):
                    t = state[f"transformer.h.{i}.{theirs}.{kind}"]
                    out[f"blk.{i}.{ours}.{kind}"] = t.T if kind == "weight" and t.ndim == 2 else t
        return out
    out.update({"token_embd.weight": state["model.embed_tokens.weight"],
                "output_norm.weight": state["model.norm.weight"]})
    if "lm_head.weight" in state:
        out["output.weight"] = state["lm_head.weight"]
    heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}
    for i in range(hf["num_hidden_layers"]):
        for theirs, ours in LLAMA_NAMES.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{theirs}.{kind}"
                if key in state:
                    t = state[key]
                    rotated = hf["model_type"] in ("llama", "mistral") and ours in heads
                    out[f"blk.{i}.{ours}.{kind}"] = permute(t, heads[ours]) if rotated else t
    return out


def check_sentencepiece(meta: dict, tok: dict, rows: int, space_prefix: bool) -> None:
    """A BPE with byte fallback as llama.cpp's SentencePiece tokenizer: its kind, the types of the unknown, byte and
    special tokens, each piece's score minus the rank of the first merge that makes it (0 where none does), no
    merges, and whether a word marker goes before each text."""
    from gguf import TokenType
    assert meta["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in meta
    assert meta["tokenizer.ggml.add_space_prefix"] is space_prefix
    types = [TokenType(t) for t in meta["tokenizer.ggml.token_type"]]
    tokens = meta["tokenizer.ggml.tokens"]
    assert types[:3] == [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] and tokens[:3] == ["<unk>", "<s>",
                                                                                                      "</s>"]
    assert types[3:259] == [TokenType.BYTE] * 256 and tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(types[259:rows]) <= {TokenType.NORMAL, TokenType.UNUSED}
    first: dict[str, int] = {}
    for r, (a, b) in enumerate(m if isinstance(m, list) else m.split(" ") for m in tok["model"]["merges"]):
        first.setdefault(a + b, r)
    assert meta["tokenizer.ggml.scores"] == [-float(first[t]) if t in first else 0.0 for t in tokens]
    assert sum(t in first for t in tokens) > 50
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"],
            meta["tokenizer.ggml.unknown_token_id"]) == (1, 2, 0)


def read_gguf(path):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    reader = GGUFReader(path)
    tensors = {t.name: (t.tensor_type.name, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
                        .reshape(list(reversed(t.shape.tolist())))) for t in reader.tensors}
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return tensors, meta


def check_values(name: str, qtype: str, got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if qtype == "F32":
        assert np.array_equal(got, want), name
    elif qtype == "F16":
        assert np.array_equal(got, want.astype(np.float16).astype(np.float32)), name
    elif qtype == "BF16":
        assert np.allclose(got, want, rtol=2 ** -8, atol=0), name
    elif qtype == "Q8_0":   # blocks of 32 values, each a multiple of its block's scale amax / 127 (an f16): half a
        g, w = got.reshape(-1, 32), want.reshape(-1, 32)   # step off, plus up to 127 times the scale's rounding (2^-11)
        step = np.abs(w).max(axis=1, keepdims=True) / 127
        assert (np.abs(g - w) <= step * (0.5 + 127 * 2 ** -11) + 1e-7).all(), name
    else:   # 4 and 5 bits: 16 or 32 levels a block, over [-amax, amax] (Q4_0, Q5_0) or [min, max] (Q4_1, Q5_1); the
        g, w = got.reshape(-1, 32), want.reshape(-1, 32)   # end level is clamped: at most one step off
        levels = {"Q4_0": 8, "Q5_0": 16, "Q4_1": 15, "Q5_1": 31}[qtype]
        span = np.abs(w).max(axis=1, keepdims=True) if qtype.endswith("_0") else \
            w.max(axis=1, keepdims=True) - w.min(axis=1, keepdims=True)
        assert (np.abs(g - w) <= span / levels * (1 + 2 ** -8) + 1e-3 * np.abs(w).max(axis=1, keepdims=True)).all(), \
            name


@pytest.fixture(scope="module")
def gguf_runs(runs, tmp_path_factory):
    """The four GGUF architectures: llama (the sft run), qwen2 (llama family with q/k/v biases), qwen3 (with q/k
    norms, and heads wider than n_embd / n_head) and gpt2; a Mistral folder's sft run, whose tokenizer is
    SentencePiece's kind (written as llama.cpp's `llama` tokenizer); and the LoRA run (merged into its Llama base)."""
    pytest.importorskip("gguf")
    from conftest import TINY
    tmp = tmp_path_factory.mktemp("gguf")
    tiny = [*TINY, f"run.dir={tmp / 'runs'}", f"data.cache_dir={tmp / 'cache'}"]
    mistral = load_config("sft", sft_args(tmp, hf_tiny.make_model(tmp / "mistral", "mistral"), runs["tmp"] /
                                          "chat.jsonl", "mistral", "optim.lr=3e-3", "train.max_steps=40"))
    Trainer(mistral).run()
    return {"llama": runs["sft"], "mistral": mistral.run_dir, "lora": runs["lora"],
            "qwen2": tiny_run(tmp, tiny, "qwen2", "model.family=llama", "model.llama.qkv_bias=true",
                              "model.n_head=4", "model.llama.n_kv_head=2", "model.llama.intermediate_size=64",
                              "model.llama.rope_theta=10000"),
            "qwen3": tiny_run(tmp, tiny, "qwen3", "model.family=llama", "model.llama.qk_norm=true",
                              "model.n_head=4", "model.head_dim=16", "model.llama.n_kv_head=2",
                              "model.llama.intermediate_size=64", "model.llama.rope_theta=10000"),
            "gpt2": tiny_run(tmp, tiny, "gpt2"), "tmp": tmp}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2", "mistral",
                                  pytest.param("lora", marks=pytest.mark.slow)])
def test_gguf_reads_back_with_every_tensor_and_the_metadata(gguf_runs, arch, request):
    """The LoRA run's file holds the weights of its --merge export (the adapters folded into the base)."""
    tmp, run = gguf_runs["tmp"], gguf_runs[arch]
    folder = request.getfixturevalue("sft_hf") if arch == "llama" else \
        _export(run, tmp / f"{arch}-hf", *(["--merge"] if arch == "lora" else []))
    hf = json.loads((folder / "config.json").read_text())
    if arch == "mistral":
        assert hf["architectures"] == ["MistralForCausalLM"]
    kind = "llama" if arch in ("mistral", "lora") else arch   # llama.cpp runs Mistral as its llama architecture
    want = expected_tensors(folder)
    low_bits = {"llama": ("q5_1", "q5_0", "q4_1", "q4_0"), "qwen2": ("q4_0",)}.get(arch, ())   # qwen2: a tied head
    for gguf_type in ("f16", "bf16", "q8_0", *low_bits):
        out = tmp / f"{arch}-{gguf_type}.gguf"
        if gguf_type == "f16":   # the command a user types; the other types through the same function, in process
            run_cli("export", str(run), "--format", "gguf", "--gguf-type", gguf_type, "--out", str(out))
        else:
            export(run, out, format="gguf", gguf_type=gguf_type)
        tensors, meta = read_gguf(out)
        assert sorted(tensors) == sorted(want), arch
        head = "output.weight" if "output.weight" in tensors else "token_embd.weight"   # llama-quantize's rule:
        for name, (qtype, got) in tensors.items():                                     # the head in q8_0
            assert qtype == ("F32" if got.ndim == 1 or name == "position_embd.weight" else "Q8_0"
                             if gguf_type in low_bits and name == head else gguf_type.upper()), name
            check_values(name, qtype, got, want[name])
        assert meta["general.architecture"] == kind and meta["general.file_type"] == \
            {"f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9}[gguf_type]
        assert meta[f"{kind}.block_count"] == 2 and meta[f"{kind}.embedding_length"] == 32
        tok = json.loads((folder / "tokenizer.json").read_text())
        vocab = {i: t for t, i in tok["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tok["added_tokens"]}
        rows = len(want["token_embd.weight"])
        assert meta["tokenizer.ggml.tokens"] == [vocab.get(i, f"[PAD{i}]") for i in range(rows)]
        assert len(meta["tokenizer.ggml.token_type"]) == rows
        if arch == "mistral":
            check_sentencepiece(meta, tok, rows, space_prefix=True)
        else:
            assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
            assert len(meta["tokenizer.ggml.merges"]) > 0
        eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
        eos = [eos] if isinstance(eos, int) else eos
        assert meta["tokenizer.ggml.eos_token_id"] == eos[0] and meta["tokenizer.ggml.add_bos_token"] is False
        assert meta["tokenizer.chat_template"] == json.loads((folder / "tokenizer_config.json").read_text())[
            "chat_template"]
        if arch == "gpt2":
            assert meta["gpt2.context_length"] == hf["n_positions"] and meta["gpt2.attention.head_count"] == 2
            assert meta["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
        else:
            assert meta[f"{kind}.context_length"] == hf["max_position_embeddings"]
            assert meta[f"{kind}.attention.head_count_kv"] == hf["num_key_value_heads"]
            assert meta[f"{kind}.attention.key_length"] == hf["head_dim"]
            if arch in ("qwen3", "mistral"):   # heads wider than hidden / heads: llama.cpp reads key_length
                assert hf["head_dim"] == 16 != hf["hidden_size"] // hf["num_attention_heads"]
            assert meta[f"{kind}.rope.freq_base"] == (hf.get("rope_parameters") or hf)["rope_theta"]
            assert meta[f"{kind}.attention.layer_norm_rms_epsilon"] == pytest.approx(hf["rms_norm_eps"])
    if arch in ("llama", "lora"):   # the chat runs: <|im_end|> is the end-of-turn token llama.cpp stops at
        assert meta["tokenizer.chat_template"] == hf_tiny.CHATML
        assert meta["tokenizer.ggml.tokens"][meta["tokenizer.ggml.eot_token_id"]] == "<|im_end|>" == vocab[eos[1]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2", "mistral", "lora"])
def test_llama_cpp_runs_the_gguf_with_our_logits(gguf_runs, arch):
    """llama.cpp (llama-cpp-python) loads the f16 file, tokenizes as we do, and its logits are ours within f16
    rounding (the LoRA run's: its base with the adapters); the chat runs' answers, through llama.cpp's own chat, are
    our words (the llama and LoRA runs' stop at <|im_end|>)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                                    "llama-cpp-python compiles llama.cpp: about 8 minutes on 2 cores)")
    from trainbox.model.load import load_for_inference
    tmp, run = gguf_runs["tmp"], gguf_runs[arch]
    out = tmp / f"{arch}-cpp.gguf"
    run_cli("export", str(run), "--format", "gguf", "--out", str(out))
    ours, tok, _ = load_for_inference(run)
    chatml = "<|im_start|>user\nwhat is two plus three<|im_end|>\n<|im_start|>assistant\n"
    text = {"llama": chatml, "lora": chatml,
            "mistral": "<s>[INST] what is two plus three [/INST]four</s><s>[INST] and  one\nplus été? [/INST]"}.get(
        arch, "ROMEO:\nWhat light through yonder window breaks?")
    ids = tok.encode(text)
    model = llama_cpp.Llama(model_path=str(out), n_ctx=len(ids) + 8, logits_all=True, verbose=False, n_threads=1)
    try:
        assert model.tokenize(text.encode(), add_bos=False, special=True) == ids
        model.eval(ids)
        theirs = np.array(model.scores[:len(ids)])[:, :tok.vocab_size]
        mine = _all_logits(ours, ids)[:, :tok.vocab_size]
        assert np.abs(theirs - mine).max() < 2e-2 * max(1.0, np.abs(mine).max()), np.abs(theirs - mine).max()
        assert (theirs.argmax(-1) == mine.argmax(-1)).mean() > 0.9
        if arch in ("llama", "mistral", "lora"):
            model.reset()
            chat = model.create_chat_completion(messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                temperature=0, max_tokens=24)["choices"][0]
            session = open_chat(run, "cpu", temperature=0, max_tokens=24)
            assert chat["message"]["content"] == "".join(session.turn(QUESTIONS[0]))
            if arch != "mistral":   # the short Mistral run has not learnt to stop
                assert chat["finish_reason"] == "stop"
    finally:
        model.close()


def test_the_space_prefix_is_the_tokenizers_a_run_encodes_with(tmp_path, monkeypatch):
    """add_space_prefix follows the tokenizer that encoded the run's text: transformers', which marks only the first
    word of a Llama folder without legacy: true (no prefix after a special token), and `tokenizers`' where
    transformers is not installed, which applies tokenizer.json's normalizer to every text between special tokens."""
    from trainbox.model.gguf_file import _space_prefix
    folder = hf_tiny.make_model(tmp_path / "hf", "mistral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert _space_prefix(folder) is False
    monkeypatch.setitem(sys.modules, "transformers", None)   # `from transformers import ...` raises ImportError
    assert _space_prefix(folder) is True


@pytest.mark.parametrize("gguf_type", ["q5_1", "q4_0"])
def test_llama_cpp_computes_a_low_bit_file_as_its_weights_say(runs, sft_hf, gguf_type):
    """llama.cpp runs a 5- or 4-bit file as the model its dequantized weights make (those weights loaded into
    transformers' model of the exported folder), within its own 8-bit rounding of the activations; and the file is
    a real quantisation: several times further from the full-precision model."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    out = runs["tmp"] / f"sft-{gguf_type}.gguf"
    run_cli("export", str(runs["sft"]), "--format", "gguf", "--gguf-type", gguf_type, "--out", str(out), "--force")
    tensors, _ = read_gguf(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(sft_hf).eval()
    tok = transformers.AutoTokenizer.from_pretrained(sft_hf)
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0].numpy()
        model.load_state_dict(llama_state(tensors, model.config.to_dict()), strict=True)
        quantized = model(torch.tensor([ids])).logits[0].numpy()
    cpp = llama_cpp.Llama(model_path=str(out), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    try:
        cpp.eval(ids)
        theirs = np.array(cpp.scores[:len(ids)])
    finally:
        cpp.close()
    near, far = np.abs(theirs - quantized).max(), np.abs(theirs - full).max()
    assert near < 1e-2 * max(1.0, np.abs(quantized).max()) and far > 3 * near, (near, far)


@pytest.mark.parametrize("kind", ["mistral", "llama", "llama-legacy"])
def test_a_sentencepiece_folder_converts_to_what_llama_cpp_tokenizes_as_transformers(tmp_path, kind):
    """A Llama 2 / Mistral folder (a BPE with byte fallback, converted from SentencePiece) straight to GGUF: the word
    marker goes before each text where transformers puts it after a special token (a Mistral folder; a Llama folder
    with legacy: true), not where it marks a text's first word only (a Llama folder without). Where llama-cpp-python
    is installed, llama.cpp tokenizes chat text and text after a special token as transformers does, plain text too
    but for that first word, and computes transformers' logits."""
    pytest.importorskip("gguf")
    from trainbox.model.gguf_file import write
    from trainbox.model.llama.hf import gguf_model
    folder = hf_tiny.make_model(tmp_path / "hf", "mistral", legacy=True if kind == "llama-legacy" else None)
    if kind != "mistral":   # the same weights as a LlamaForCausalLM: transformers loads its LlamaTokenizer
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama",
                                                        "architectures": ["LlamaForCausalLM"]}))
    out = tmp_path / "m.gguf"
    write(folder, out, "f16", gguf_model(folder), "m")
    _, meta = read_gguf(out)
    check_sentencepiece(meta, json.loads((folder / "tokenizer.json").read_text()), len(meta["tokenizer.ggml.tokens"]),
                        space_prefix=kind != "llama")
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    chat = tok.apply_chat_template([{"role": "user", "content": "what is two plus three"},
                                    {"role": "assistant", "content": "four"},
                                    {"role": "user", "content": "and  one\nplus été ☃?"}], tokenize=False)
    plain = "what is one plus two\n\n  Météo ☃"
    model = llama_cpp.Llama(model_path=str(out), n_ctx=128, logits_all=True, verbose=False, n_threads=1)
    try:
        def cpp(text: str) -> list[int]:
            return model.tokenize(text.encode(), add_bos=False, special=True)

        def hf(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)
        assert chat.startswith("<s>[INST]") and cpp(chat) == hf(chat) and cpp("</s>" + plain) == hf("</s>" + plain)
        assert (cpp(plain) == hf(plain)) is (kind != "llama")
        assert cpp(plain) == hf("</s>" + plain)[1:]   # llama, first word only: no marker before it in llama.cpp
        ids = hf(chat)
        model.eval(ids)
        theirs = np.array(model.scores[:len(ids)])
        with torch.no_grad():
            want = transformers.AutoModelForCausalLM.from_pretrained(folder)(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(theirs - want).max() < 2e-2 * max(1.0, np.abs(want).max())
    finally:
        model.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "tekken"])
def test_llama_cpp_splits_text_as_the_tokenizers_regex_does(tmp_path, pre):
    """A byte-level BPE whose Split regex is Llama 3's, Qwen2's or Mistral's tekken (Mistral Nemo) goes into GGUF
    under llama.cpp's name for that regex, and llama.cpp tokenizes text of mixed case, digits, punctuation and
    spacing as `tokenizers` does."""
    pytest.importorskip("gguf")
    from trainbox.model.gguf_file import LLAMA3_NUMBERS, PRE_TOKENIZERS, QWEN2_NUMBERS, SPLIT_REGEX, TEKKEN_REGEX, write
    from trainbox.model.llama.hf import gguf_model
    regex = {"llama-bpe": SPLIT_REGEX.replace("NUMBERS", LLAMA3_NUMBERS), "tekken": TEKKEN_REGEX,
             "qwen2": SPLIT_REGEX.replace("NUMBERS", QWEN2_NUMBERS)}[pre]
    assert PRE_TOKENIZERS[regex] == pre
    folder = tmp_path / "hf"
    tok = hf_tiny.make_tokenizer(folder, 400, split=regex)
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=None, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id)).save_pretrained(folder)
    out = tmp_path / "m.gguf"
    write(folder, out, "f16", gguf_model(folder), "m")
    assert read_gguf(out)[1]["tokenizer.ggml.pre"] == pre
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    model = llama_cpp.Llama(model_path=str(out), n_ctx=256, verbose=False, n_threads=1, vocab_only=True)
    try:
        for text in (hf_tiny.MIXED, hf_tiny.MIXED.upper(), "one TWO three45 six" * 3, "a\n\n\n b  \n c"):
            assert model.tokenize(text.encode(), add_bos=False, special=True) == \
                tok.encode(text, add_special_tokens=False), text
    finally:
        model.close()


def _all_logits(model, ids: list[int]) -> np.ndarray:
    """Every position's logits of one of our models (their forward returns only the last one's)."""
    with torch.no_grad():
        caches = model.make_caches(1, len(ids), torch.float32, "cpu")
        return torch.cat([model(torch.tensor([[i]]), caches=caches, pos=p).logits[0, -1:] for p, i in
                          enumerate(ids)]).numpy()


# ----------------------------------------------------------------------------- refused before any work


def test_bad_exports_are_refused_in_one_message_before_any_work(gguf_runs, tmp_path, tiny):
    run = gguf_runs["llama"]
    t5 = tiny_run(tmp_path, tiny, "t5", "model.family=t5", "train.micro_batch_size=4")
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(gguf_runs["gpt2"]), str(damaged)], check=True)
    ckpt = sorted((damaged / "checkpoints").glob("step_*"))[-1]
    blob = bytearray((ckpt / "model.safetensors").read_bytes())
    blob[-5] ^= 0xFF
    (ckpt / "model.safetensors").write_bytes(bytes(blob))
    cases = [
        (["export", str(run), "--format", "gguf", "--gguf-type", "q4_k"], "--gguf-type q4_k is not one "
         "model.family=llama writes: f16, bf16, q8_0"),
        (["export", str(t5), "--format", "gguf"], "model.family=t5 has no GGUF mapping"),
        (["export", str(damaged), "--format", "gguf"], "verifies"),
        (["export", str(damaged), "--format", "hf"], "verifies"),
        (["chat", str(damaged)], "verifies"),
        (["chat", str(t5)], "fills spans"),
        (["export", str(run), "--format", "gguf", "--dtype", "bf16"], "--dtype bf16 applies to --format hf"),
        (["export", str(run), "--gguf-type", "q8_0"], "--gguf-type q8_0 applies to --format gguf"),
    ]
    for args, message in cases:
        out = tmp_path / "out.gguf"
        proc = run_cli(*args, "--out", str(out), check=False) if args[0] == "export" else \
            subprocess.run([sys.executable, "-m", "trainbox", *args], input="hi\n", capture_output=True, text=True,
                           timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and message in lines[0] and len(lines) <= 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stdout == "" and not out.exists()


def test_gguf_of_a_lora_run_refuses_a_base_it_does_not_convert(tmp_path):
    """Before any weights are read: a base whose architecture trainbox writes no GGUF for, and a Mistral base whose
    sliding window binds (the llama family's rule); a Llama base passes."""
    from trainbox.config import build_config
    from trainbox.errors import ConfigError
    from trainbox.model.hf.hf import check_gguf

    def run(folder):
        return build_config({"model": {"family": "hf", "path": str(folder)}})
    transformers.GPTNeoXConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path / "neox")
    with pytest.raises(ConfigError, match=r"is a 'gpt_neox' model; trainbox writes GGUF for gpt2, llama, mistral, "
                                          r"qwen2, qwen3 bases") as e:
        check_gguf(run(tmp_path / "neox"))
    assert "convert_hf_to_gguf.py" in e.value.hint
    transformers.MistralConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, sliding_window=32,
                               max_position_embeddings=256).save_pretrained(tmp_path / "window")
    with pytest.raises(ConfigError, match="has sliding_window=32"):
        check_gguf(run(tmp_path / "window"))
    transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path / "llama")
    check_gguf(run(tmp_path / "llama"))


def test_an_out_that_is_holds_or_lies_in_the_checkpoint_is_refused_even_with_force(gguf_runs, tmp_path):
    """--force replaces --out: an --out that is the run (or holds it, or lies inside its checkpoint) would delete the
    checkpoint being exported. It is refused in one message, and the run is left as it was."""
    from trainbox.errors import ConfigError

    run = tmp_path / "runs" / "mine"
    shutil.copytree(gguf_runs["gpt2"], run)
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    proc = run_cli("export", str(run), "--out", str(run), "--force", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"trainbox export: --out {run} holds the checkpoint it exports, {ckpt}: the export "
                                  "would write over what it reads\n  -> choose an --out outside it, e.g. the default "
                                  "mine-hf"), proc.stderr
    for out, fmt, where in ((tmp_path / "runs", "hf", "holds"), (ckpt, "hf", "is"),
                            (ckpt / "model.gguf", "gguf", "is inside")):
        with pytest.raises(ConfigError, match=f"--out {out} {where} the checkpoint it exports"):
            export(run, out, force=True, format=fmt)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert export(run, run / "hf", force=True)[0].startswith(f"wrote {run / 'hf'}")   # beside it is fine


def test_a_missing_gguf_package_names_the_extra(gguf_runs, monkeypatch):
    import importlib.util

    from trainbox.errors import MissingDependency
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find(name, *a))
    with pytest.raises(MissingDependency, match=r"needs the Python package 'gguf'") as e:
        export(gguf_runs["llama"], gguf_runs["tmp"] / "none.gguf", format="gguf")
    assert e.value.hint == "pip install 'trainbox[gguf]'"


def test_session_without_a_template_of_its_own_uses_chatml(tmp_path, tiny):
    from trainbox.model.load import load_for_inference
    model, tok, cfg = load_for_inference(tiny_run(tmp_path, tiny, "plain"))
    session = ChatSession(model, tok, template_for(tok))
    assert session.template.source == CHATML and session.end_text == "<|im_end|>"
