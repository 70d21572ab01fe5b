"""Chat data: templates (ChatML; a Hugging Face tokenizer's own template, checked against transformers),
loss masks on assistant tokens only, ShareGPT records, and the mask reaching the loss and gradients."""
from __future__ import annotations

import json
import shutil

import hf_tiny
import numpy as np
import pytest
import torch

from trainbox.data import megatron
from trainbox.data.chat import CHATML, ChatTemplate, encode_chat, load_template, messages_of
from trainbox.data.loader import TokenDataset, open_tokens
from trainbox.data.prepare import PrepareOptions, prepare
from trainbox.data.tokenizer import asset_path, get_tokenizer
from trainbox.errors import NoData

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Green, or perhaps red."}]
SHAREGPT = {"conversations": [{"from": "system", "value": "You are terse."},
                              {"from": "human", "value": "Name a colour."},
                              {"from": "gpt", "value": "Blue."}, {"from": "human", "value": "Another?"},
                              {"from": "gpt", "value": "Green, or perhaps red."}]}
ZEPHYR = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
          "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def split_by_mask(tok, ids, mask):
    return (tok.decode([i for i, m in zip(ids, mask) if m]), tok.decode([i for i, m in zip(ids, mask) if not m]))


def test_chatml_mask_is_assistant_only():
    tok = get_tokenizer("gpt2")
    tpl = load_template("gpt2")
    ids, mask = encode_chat(tpl, tok, MESSAGES)
    assert tok.decode(ids) == tpl.render(MESSAGES)
    assert tpl.render(MESSAGES).startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    trained, untrained = split_by_mask(tok, ids, mask)
    assert trained == "Blue.<|im_end|>\nGreen, or perhaps red.<|im_end|>\n"
    assert "Name a colour." in untrained and "<|im_start|>assistant\n" in untrained and "Blue" not in untrained
    # ShareGPT `conversations` is the same conversation
    assert messages_of(SHAREGPT, "x") == MESSAGES


# what transformers' template environment has beyond Jinja's: loop controls, generation blocks, today's date, and a
# tojson that keeps non-ASCII text and the keys' order
TRANSFORMERS_ONLY = ("{%- for m in messages %}{%- if loop.index0 == 4 %}{%- break %}{%- endif %}"
                     "{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}"
                     "{%- else %}{{ m | tojson }}{%- endif %}{%- endfor %}{{ strftime_now('%Y') }}")


def test_templates_render_as_transformers_renders_them():
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(asset_path("shakespeare-bpe.json")),
                                               eos_token="<|endoftext|>")
    messages = [{"role": "system", "content": "Réponds en français."}, *MESSAGES[1:]]
    for source in (TRANSFORMERS_ONLY, hf_tiny.REASONING, ZEPHYR):
        ref.chat_template = source
        tpl = ChatTemplate(source, "t", eos_token="<|endoftext|>")
        assert tpl.render(messages) == ref.apply_chat_template(messages, tokenize=False)
        assert tpl.render(messages[:2], True) == ref.apply_chat_template(messages[:2], tokenize=False,
                                                                         add_generation_prompt=True)
    assert '{"role": "system", "content": "Réponds' in ChatTemplate(TRANSFORMERS_ONLY).render(messages)


def test_hf_tokenizer_template_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(asset_path("shakespeare-bpe.json"), folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": ZEPHYR, "eos_token": "<|endoftext|>"}))
    tpl = load_template(str(folder))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|endoftext|>")
    ref.chat_template = ZEPHYR
    assert tpl.render(MESSAGES) == ref.apply_chat_template(MESSAGES, tokenize=False)
    assert tpl.render(MESSAGES[:2], True) == ref.apply_chat_template(MESSAGES[:2], tokenize=False,
                                                                     add_generation_prompt=True)
    tok = get_tokenizer(str(folder))
    ids, mask = encode_chat(tpl, tok, MESSAGES)
    trained, _ = split_by_mask(tok, ids, mask)
    assert trained == "Blue.<|endoftext|>\nGreen, or perhaps red.<|endoftext|>\n"
    assert tok.eot_id in [i for i, m in zip(ids, mask) if m]  # eos is one special token, and trained


def test_a_template_that_renders_earlier_answers_again_is_masked_in_its_whole_rendering():
    """Qwen3's template renders an answer once it is followed by a question without the reasoning block it had as
    the last one, so no growing prefixes exist: the conversation is rendered whole, as at inference, and each
    answer trains from its generation prompt's end to its <|im_end|>. Where both ways apply (ChatML, Zephyr),
    they train the same text."""
    from trainbox.errors import DataError
    tok = get_tokenizer("gpt2")
    reasoning = ChatTemplate(hf_tiny.REASONING, "reasoning")
    assert reasoning.grown_spans(MESSAGES) is None
    ids, mask = encode_chat(reasoning, tok, MESSAGES)
    assert tok.decode(ids) == reasoning.render(MESSAGES)
    trained, untrained = split_by_mask(tok, ids, mask)
    assert trained == "Blue.<|im_end|>\n<think>\n\n</think>\n\nGreen, or perhaps red.<|im_end|>\n"
    assert untrained.count("<|im_start|>assistant\n") == 2 and "Blue" not in untrained
    # an earlier answer whose text the template rewrites (its reasoning dropped) is not in the rendering
    thought = [*MESSAGES[:2], {"role": "assistant", "content": "<think>sky</think>Blue."}, *MESSAGES[3:]]
    with pytest.raises(DataError, match="assistant message 3 is not in its rendering") as e:
        encode_chat(reasoning, tok, thought)
    assert "reasoning_content" in e.value.hint
    for source in (CHATML, ZEPHYR):
        tpl = ChatTemplate(source, "t", eos_token="<|endoftext|>")
        grown, located = tpl.grown_spans(MESSAGES), tpl.located_spans(MESSAGES)
        assert grown is not None and [t for t, on in located if on] == [t for t, on in grown if on]
        assert "".join(t for t, _ in located) == "".join(t for t, _ in grown) == tpl.render(MESSAGES)


def test_tool_calls_and_function_schemas_reach_the_template_and_the_calls_train(tmp_path):
    """A record's `tools` and an assistant's `tool_calls` render as transformers renders them (schemas untrained,
    calls trained), through prepare's workers too; a template that writes no tool calls is refused, where the
    turn would otherwise train as nothing."""
    from trainbox.data.chat import tools_of
    from trainbox.errors import DataError
    transformers = pytest.importorskip("transformers")
    tok = get_tokenizer("gpt2")
    tpl = ChatTemplate(hf_tiny.TOOLS, "tools")
    messages, tools = messages_of(hf_tiny.TOOL_RECORD, "x"), tools_of(hf_tiny.TOOL_RECORD, "x")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(asset_path("shakespeare-bpe.json")))
    ref.chat_template = hf_tiny.TOOLS
    assert tpl.render(messages, tools=tools) == ref.apply_chat_template(messages, tools=tools, tokenize=False)
    assert messages[1]["content"] == ""
    assert messages[1]["tool_calls"] == hf_tiny.TOOL_RECORD["messages"][1]["tool_calls"]
    ids, mask = encode_chat(tpl, tok, messages, "x", tools)
    trained, untrained = split_by_mask(tok, ids, mask)
    assert trained == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
                       "21 degrees.<|im_end|>\n")
    assert "Météo d'une ville" in untrained and '{"temp": 21}' in untrained
    (tmp_path / "tools.jinja").write_text(hf_tiny.TOOLS)
    (tmp_path / "t.jsonl").write_text(json.dumps(hf_tiny.TOOL_RECORD) + "\n")
    prepare(PrepareOptions([str(tmp_path / "t.jsonl")], str(tmp_path / "m" / "x"), format="megatron", workers=2,
                           chat_template=str(tmp_path / "tools.jinja")))
    tokens, m = open_tokens(tmp_path / "m" / "x_text_document")
    assert np.array_equal(tokens, ids) and np.array_equal(m, mask)
    # the fine-tuning path (sft, lora): the tokenizer folder's own template, spans mapped to tokens by offsets
    from trainbox.data.sft import encode_row, load_hf_tokenizer
    hf_tiny.make_tokenizer(tmp_path / "tok", chat_template=hf_tiny.TOOLS)
    hf_tok = load_hf_tokenizer(str(tmp_path / "tok"))
    ids, mask = encode_row(hf_tiny.TOOL_RECORD, hf_tok, None, ["text"], "x")
    assert hf_tok.decode(ids) == tpl.render(messages, tools=tools)
    assert split_by_mask(hf_tok, ids, mask)[0] == trained
    with pytest.raises(DataError, match="message 2's tool call 'get_weather' is not in what chat template chatml"):
        encode_chat(ChatTemplate(CHATML), tok, messages, "x", tools)
    with pytest.raises(DataError, match="`tools` must be a list of function schemas"):
        tools_of({"tools": "get_weather"}, "x")


def test_template_whose_answer_is_no_prefix_of_its_question_is_refused():
    from trainbox.errors import DataError
    bad = ChatTemplate("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}", "bad")
    with pytest.raises(DataError, match="renders a question and its answer as no prefix"):
        encode_chat(bad, get_tokenizer("gpt2"), MESSAGES)
    with pytest.raises(DataError, match="chat template broken.jinja: line 2: Expected an expression"):
        ChatTemplate("{{ bos_token }}\n{% if %}", "broken.jinja")


def test_prepare_chat_jsonl_writes_masks_the_loader_serves(tmp_path):
    with open(tmp_path / "c.jsonl", "w") as f:
        f.write(json.dumps({"messages": MESSAGES}) + "\n")
        f.write(json.dumps(SHAREGPT) + "\n")
    for fmt, src in (("shard", tmp_path / "s/x_train_000001.bin"), ("megatron", tmp_path / "m/x_text_document")):
        out = tmp_path / ("s" if fmt == "shard" else "m") / "x"
        st = prepare(PrepareOptions([str(tmp_path / "c.jsonl")], str(out), format=fmt, workers=2))
        assert st.masked and st.documents == 2
        tokens, mask = open_tokens(src)
        assert st.trained == int(np.count_nonzero(mask)) > 0 and st.unanswered == 0
        tok = get_tokenizer("gpt2")
        ids, m = encode_chat(load_template("gpt2"), tok, MESSAGES)
        if fmt == "shard":  # EOT (untrained) before each conversation
            assert np.array_equal(tokens, [tok.eot_id] + ids + [tok.eot_id] + ids)
            assert np.array_equal(mask, [0] + m + [0] + m)
        else:
            assert np.array_equal(tokens, ids + ids) and np.array_equal(mask, m + m)
            assert megatron.read_megatron(f"{out}_text_document_mask").lengths.tolist() == [len(ids)] * 2
        batch = TokenDataset([tokens], 16, masks=[mask]).batch([0, 1])
        want = np.stack([np.asarray(mask[1:17]), np.asarray(mask[17:33])]).astype(bool)
        assert np.array_equal(batch["loss_mask"].numpy(), want)


def test_chat_records_without_an_assistant_turn_are_counted_and_a_set_of_only_those_refused(tmp_path, caplog):
    """A conversation with no assistant turn (a role spelt otherwise, a prompt alone) trains nothing: prepare says how
    many such records there are; when no record has one, the set would train at loss 0, so nothing is written."""
    asked = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "model", "content": "Blue."}]}
    (tmp_path / "some.jsonl").write_text(json.dumps({"messages": MESSAGES}) + "\n" + json.dumps(asked) + "\n")
    with caplog.at_level("WARNING", logger="trainbox"):
        st = prepare(PrepareOptions([str(tmp_path / "some.jsonl")], str(tmp_path / "a" / "x")))
    assert st.unanswered == 1 and st.trained == sum(encode_chat(load_template("gpt2"), get_tokenizer("gpt2"),
                                                               MESSAGES)[1])
    assert "1 of 2 chat records have no assistant turn" in caplog.text
    assert st.mask_summary() == f"; the loss on {st.trained:,} assistant tokens ({st.trained / st.tokens:.1%})"
    (tmp_path / "none.jsonl").write_text(json.dumps(asked) + "\n" + json.dumps(asked) + "\n")
    with pytest.raises(NoData, match="none.jsonl: no assistant tokens to train on in 2 chat record") as e:
        prepare(PrepareOptions([str(tmp_path / "none.jsonl")], str(tmp_path / "b" / "x")))
    assert "role 'assistant'" in e.value.hint and not list((tmp_path / "b").glob("*"))


def test_masked_targets_do_not_reach_loss_or_gradients():
    from trainbox.config import ModelSection
    from trainbox.model.build import build_model

    torch.manual_seed(0)
    model = build_model(ModelSection(n_layer=2, n_head=2, n_embd=32), 64, 16)
    tokens = np.random.default_rng(0).integers(0, 64, size=65).astype(np.uint16)
    mask = (np.arange(65) % 3 == 0).astype(np.uint8)
    batch = TokenDataset([tokens], 16, masks=[mask]).batch([0, 1, 2, 3])
    x, y, lm = batch["x"], batch["y"], batch["loss_mask"]
    assert 0 < lm.sum() < lm.numel()

    def loss_and_grads(targets):
        model.zero_grad()
        loss = model(x, targets, loss_mask=lm).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads(y)
    other = torch.where(lm, y, (y + 7) % 64)  # change only the masked-out targets
    loss2, grads2 = loss_and_grads(other)
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    with torch.no_grad():  # and the loss is the mean over trained targets only
        ce = model(x, y, reduction="none").loss  # per-token, unmasked
        assert torch.allclose(loss, ce[lm].mean(), atol=1e-6)
    loss3, _ = loss_and_grads(torch.where(lm, (y + 7) % 64, y))  # changing a trained target does matter
    assert not torch.equal(loss, loss3)
