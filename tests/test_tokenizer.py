"""`kvjax.Tokenizer`: Hugging Face tokenizer directories built here with the `tokenizers`
library (tokenizer.json, tokenizer_config.json, chat_template.jinja / .json,
generation_config.json), chat templates rendered as transformers renders them, streaming
detokenisation that never splits a character, and the built-in byte tokenizer."""
import json

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from kvjax.tokenizer import BUILTIN_SPECIALS, ChatTemplateError, IncrementalDetokenizer, Tokenizer

LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]


def byte_level_backend(with_bos: bool = True) -> Backend:
    """A byte-level BPE (like Llama 3 / GPT-2) with a few merges and Llama-3-style specials."""
    chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(chars))}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    if with_bos:
        bos = backend.token_to_id("<|begin_of_text|>")
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
    return backend


def write_checkpoint(tmp_path, *, config=None, generation=None, jinja=None, template_json=None, smap=None):
    byte_level_backend().save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    if template_json is not None:
        (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template_json}))
    if smap is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(smap))
    return tmp_path


def test_llama3_like_directory(tmp_path):
    path = write_checkpoint(
        tmp_path,
        config={"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>", "special": True},
                "chat_template": LLAMA3_LIKE},
        generation={"eos_token_id": [SPECIALS and 0, 0, 0]},  # replaced below with real ids
    )
    backend = byte_level_backend()
    ids = [backend.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    tok = Tokenizer.from_pretrained(path)
    assert tok.eos_token_ids == frozenset(ids)  # generation_config's three plus the tokenizer's eos (one of them)
    assert tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|eot_id|>" and tok.pad_token is None
    enc = tok.encode("hello world")
    assert enc[0] == tok.bos_token_id and tok.decode(enc) == "hello world"
    assert tok.decode(enc, skip_special_tokens=False) == "<|begin_of_text|>hello world"
    assert tok.encode("hello", add_special_tokens=False) == [backend.token_to_id("hell"), backend.token_to_id("o")]
    msgs = [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids_chat = tok.apply_chat_template(msgs, tokenize=True)
    assert ids_chat == tok.encode(text, add_special_tokens=False)
    assert ids_chat.count(tok.bos_token_id) == 1  # the template's BOS only, not a second one
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant<|end_header_id|>\n\n")


def test_int_eos_and_special_tokens_map(tmp_path):
    backend = byte_level_backend()
    eot = backend.token_to_id("<|eot_id|>")
    path = write_checkpoint(tmp_path, smap={"eos_token": "<|end_of_text|>"}, generation={"eos_token_id": eot})
    tok = Tokenizer.from_pretrained(path)
    assert tok.eos_token == "<|end_of_text|>"
    assert tok.eos_token_ids == {eot, backend.token_to_id("<|end_of_text|>")}
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_file_precedence(tmp_path):
    path = write_checkpoint(tmp_path, config={"chat_template": "config"}, template_json="json")
    assert Tokenizer.from_pretrained(path).apply_chat_template([]) == "json"
    (path / "chat_template.jinja").write_text("jinja {{ messages | length }}")
    assert Tokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "a"}]) == "jinja 1"


def test_named_templates(tmp_path):
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T{{ tools | length }}"}]
    tok = Tokenizer.from_pretrained(write_checkpoint(tmp_path, config={"chat_template": named}))
    assert tok.apply_chat_template([]) == "D"
    assert tok.apply_chat_template([], tools=[{"type": "function"}]) == "T1"
    assert tok.apply_chat_template([], chat_template="tool_use", tools=[]) == "T0"


def test_transformers_rendering_rules(tmp_path):
    template = (
        "{% for m in messages %}\n"
        "{% if m['role'] == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}\n"
        "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "[{{ m['content'] | tojson }}]\n"
        "{% endfor %}\n"
        "{% generation %}G{% endgeneration %}"
        "{{ strftime_now('%Y') | length }}|{{ eos_token }}|{{ unk_token is defined }}|{{ extra }}"
    )
    tok = Tokenizer.from_pretrained(write_checkpoint(tmp_path, config={"eos_token": "<|eot_id|>", "chat_template": template}))
    msgs = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}]
    # lstrip_blocks removes the indentation before a block tag, trim_blocks the newline after one;
    # tojson keeps non-ASCII and HTML characters as they are; break works (loopcontrols)
    assert tok.apply_chat_template(msgs, extra=7) == '["héllo <b>"]\n["ok"]\nG4|<|eot_id|>|False|7'
    with pytest.raises(ChatTemplateError, match="role bad is not allowed"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    with pytest.raises(ChatTemplateError):  # sandboxed: no access to Python internals
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):  # immutable: templates cannot mutate their inputs
        tok.apply_chat_template([{"role": "user", "content": "a"}], chat_template="{{ messages.append(1) }}")


def test_bad_directories(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        Tokenizer.from_pretrained(tmp_path)
    byte_level_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not-there|>"}))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        Tokenizer.from_pretrained(tmp_path)


def test_incremental_detokenizer_never_splits_a_character(tmp_path):
    tok = Tokenizer.from_pretrained(write_checkpoint(tmp_path))
    text = "hello wörld ✓ 日本 🎉!"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    detok = tok.detokenizer(tok.encode("hi"))
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens had to wait for the rest of their character
    # special tokens: skipped or kept
    eot = tok.token_to_id("<|eot_id|>")
    d1, d2 = tok.detokenizer(), tok.detokenizer(skip_special_tokens=False)
    assert d1.push(ids[:5] + [eot]) + d1.flush() == tok.decode(ids[:5])
    assert d2.push(ids[:5] + [eot]) + d2.flush() == tok.decode(ids[:5]) + "<|eot_id|>"
    # an incomplete character at the very end comes out at flush
    cut = tok.encode("✓", add_special_tokens=False)[:2]
    d3 = IncrementalDetokenizer(tok)
    assert d3.push(cut) == "" and d3.flush() == tok.decode(cut)


def test_long_streams_keep_a_short_window():
    tok = Tokenizer.builtin(512)
    d = tok.detokenizer()
    ids = tok.encode("abc def ghi " * 200, add_special_tokens=False)
    out = "".join(d.push([i]) for i in ids) + d.flush()
    assert out == "abc def ghi " * 200 and len(d.ids) < 80


@pytest.mark.parametrize("vocab", [263, 512, 4096, 32000])
def test_builtin_tokenizer(vocab):
    tok = Tokenizer.builtin(vocab)
    assert tok.vocab_size == vocab
    assert [tok.token_to_id(t) for t in BUILTIN_SPECIALS] == list(range(256, 263))
    assert tok.eos_token_ids == {tok.token_to_id("<|eos|>"), tok.token_to_id("<|end|>")}
    text = "Hello, world! héllo ✓\n\ttabs"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256 and tok.decode(ids) == text
    every = tok.decode(list(range(vocab)), skip_special_tokens=True)  # every id decodes
    assert isinstance(every, str) and len(every) >= 256
    chat = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert chat == "<|bos|><|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\n"
    assert tok.apply_chat_template([{"role": "user", "content": "U"}], tokenize=True)[:3] == [256, 260, 10]
    with pytest.raises(ChatTemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match=r"token ids must be in \[0"):
        tok.decode([vocab])
    assert Tokenizer.builtin(vocab).encode(text) == ids  # deterministic


def test_builtin_tokenizer_too_small():
    with pytest.raises(ValueError, match="at least 263"):
        Tokenizer.builtin(100)
