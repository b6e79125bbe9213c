"""`Tokenizer`: text <-> token ids, chat templates and streaming detokenisation.

`Tokenizer.from_pretrained(directory)` reads what Hugging Face checkpoints ship:
`tokenizer.json` (the `tokenizers` library's format: normaliser, pre-tokeniser, model, added
tokens, post-processor), `tokenizer_config.json` (special tokens, `chat_template`),
`special_tokens_map.json`, a separate `chat_template.jinja` / `chat_template.json` as recent
transformers versions save them (they take precedence), and `generation_config.json`, whose
`eos_token_id` (an int or a list: Llama 3.1 Instruct lists three) joins the tokenizer's own EOS
in `eos_token_ids`. Chat templates render the way transformers renders them: a sandboxed,
immutable Jinja2 environment with `trim_blocks` and `lstrip_blocks`, `raise_exception`,
`strftime_now`, a `tojson` filter that keeps non-ASCII text as is, the loop-control extension
and `{% generation %}` blocks; the special tokens (`bos_token`, `eos_token`, ...) are template
variables, and the rendered chat is encoded without adding special tokens again.

`Tokenizer.builtin(vocab_size)` is the deterministic tokenizer of kvjax's built-in random-weight
models, which ship no tokenizer files: byte-level BPE (256 byte tokens, 7 special tokens, then
letter-pair merges up to `vocab_size`, so every id a model samples decodes to text) with a small
chat template (`<|role|>` headers, `<|end|>` after each message).

`IncrementalDetokenizer` turns a stream of token ids into text pieces that never split a UTF-8
character: text is released only once decoding it no longer ends in a replacement character.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvjax.errors import KVCacheError

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

BUILTIN_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BUILTIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + ': use system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class ChatTemplateError(KVCacheError, ValueError):
    """A chat could not be rendered: no template, or the template rejected the messages."""


# ---------------------------------------------------------------------- chat templates
@lru_cache(maxsize=32)
def _compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers uses the
        markers to find assistant tokens for training masks; serving only needs the text)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"cannot read a special token from {value!r}")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


# ---------------------------------------------------------------------- the tokenizer
_GIL_FREE_CHARS = 8192  # texts this long are encoded without holding the GIL (`Tokenizer.encode`)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus special tokens, EOS ids and a chat template."""

    def __init__(
        self,
        backend,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        additional_special_tokens: Sequence[str] = (),
        chat_template: str | Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        name: str = "",
    ) -> None:
        self.backend = backend
        self.name = name
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        unknown = sorted(set(self.special_tokens) - set(_SPECIAL_NAMES))
        if unknown:
            raise ValueError(f"unknown special token name {unknown[0]!r} (known: {', '.join(_SPECIAL_NAMES)})")
        self.additional_special_tokens = list(additional_special_tokens)
        self.chat_template = chat_template
        ids = set()
        for i in eos_token_ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"eos token ids must be ints >= 0, got {i!r}")
            ids.add(i)
        eos = self.special_tokens.get("eos_token")
        if eos is not None:
            eos_id = backend.token_to_id(eos)
            if eos_id is None:
                raise ValueError(f"eos_token {eos!r} is not in the vocabulary")
            ids.add(eos_id)
        self.eos_token_ids = frozenset(ids)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer directory (see the module docstring for the files)."""
        from tokenizers import Tokenizer as Backend

        root = Path(path)
        if not root.is_dir():
            raise ValueError(f"{root}: not a directory")
        tj = root / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"{root}: no tokenizer.json (kvjax reads the fast-tokenizer format)")
        try:
            backend = Backend.from_file(str(tj))
        except Exception as e:  # the Rust library raises its own exception type
            raise ValueError(f"{tj}: cannot load ({e})") from None
        config = _read_json(root / "tokenizer_config.json") if (root / "tokenizer_config.json").is_file() else {}
        smap = _read_json(root / "special_tokens_map.json") if (root / "special_tokens_map.json").is_file() else {}
        specials = {}
        for k in _SPECIAL_NAMES:
            value = config.get(k, smap.get(k))
            specials[k] = _token_content(value)
        extra = config.get("additional_special_tokens", smap.get("additional_special_tokens")) or []
        extra = [_token_content(t) for t in extra]
        template: Any = config.get("chat_template")
        if (root / "chat_template.json").is_file():
            template = _read_json(root / "chat_template.json").get("chat_template", template)
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}
        eos_ids: list[int] = []
        if (root / "generation_config.json").is_file():
            value = _read_json(root / "generation_config.json").get("eos_token_id")
            if value is not None:
                eos_ids = [value] if isinstance(value, int) else list(value)
        return cls(backend, special_tokens=specials, additional_special_tokens=extra, chat_template=template,
                   eos_token_ids=eos_ids, name=str(root))

    @classmethod
    def builtin(cls, vocab_size: int) -> Tokenizer:
        """The built-in models' byte-level tokenizer with exactly `vocab_size` tokens."""
        return cls(
            _builtin_backend(vocab_size),
            special_tokens={"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"},
            additional_special_tokens=BUILTIN_SPECIALS[3:],
            chat_template=BUILTIN_CHAT_TEMPLATE,
            eos_token_ids=[BUILTIN_SPECIALS.index("<|end|>") + 256],
            name=f"kvjax-bytes-{vocab_size}",
        )

    # ------------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def fingerprint(self) -> str:
        """A hex digest of everything that decides token ids: the backend's serialised model,
        the special tokens and the chat template. Two processes (a replica and a router) that
        agree on it tokenise every prompt and chat alike."""
        import hashlib

        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            h = hashlib.sha256(self.backend.to_str().encode("utf-8"))
            h.update(json.dumps([sorted(self.special_tokens.items()), self.additional_special_tokens,
                                 self.chat_template, sorted(self.eos_token_ids)], sort_keys=True).encode("utf-8"))
            cached = self.__dict__["_fingerprint"] = h.hexdigest()[:32]
        return cached

    def max_chars_per_token(self) -> int | None:
        """The most characters of input text one token can stand for, so that a text of n
        characters has at least ceil(n / this) tokens and a server can refuse a text that can
        never fit before tokenising it. None when no such bound is known: a model other than
        BPE, unknown characters fused into one token, or a normalizer or pre-tokenizer that
        may delete text."""
        if "_max_chars" not in self.__dict__:
            self.__dict__["_max_chars"] = _max_chars_per_token(self.backend)
        return self.__dict__["_max_chars"]

    def __getattr__(self, name: str):
        if name in _SPECIAL_NAMES:  # bos_token, eos_token, ...: None when the tokenizer has none
            return self.__dict__.get("special_tokens", {}).get(name)
        raise AttributeError(name)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.backend.token_to_id(bos)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a BOS).
        A long text is encoded as a batch of one: the same ids, but the backend releases the
        GIL while it works, so a server's other threads (its event loop) keep running."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a string, got {type(text).__name__}")
        if len(text) >= _GIL_FREE_CHARS:
            return list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`. Ids outside the vocabulary raise ValueError."""
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {min(ids)}..{max(ids)}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A streaming decoder for the tokens generated after `prompt_ids`."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def _template(self, chat_template: str | None, tools) -> str:
        template = self.chat_template
        if isinstance(template, Mapping):
            if chat_template is not None and chat_template in template:
                return template[chat_template]
            if tools and "tool_use" in template:
                return template["tool_use"]
            if "default" in template:
                return template["default"]
            raise ChatTemplateError(f"no default chat template among {sorted(template)}")
        if chat_template is not None:
            return chat_template  # a template given as source text
        if template is None:
            raise ChatTemplateError(f"tokenizer {self.name!r} has no chat template")
        return template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template;
        `tokenize=True` returns the token ids (encoded without adding special tokens again:
        the template writes them). Extra keyword arguments become template variables."""
        import jinja2

        compiled = _compile_template(self._template(chat_template, tools))
        variables = {**self.special_tokens, "additional_special_tokens": self.additional_special_tokens, **kwargs}
        try:
            text = compiled.render(messages=list(messages), tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        return self.encode(text, add_special_tokens=False) if tokenize else text


# ---------------------------------------------------------------------- length bounds
# normalizers that never delete text; the NF*C forms compose at most 4 code points into one
_NORMALIZER_SHRINK = {"Prepend": 1, "NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Lowercase": 1}
# pre-tokenizers that only split (or map characters one to one), never drop any
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "CharDelimiterSplit"}


def _normalizer_shrink(spec) -> int | None:
    """How many characters of input at most become one normalised character (None: unknown)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # a fixed string replaced by one at least as long
        pattern = spec.get("pattern", {})
        if "String" in pattern and len(spec.get("content", "")) >= len(pattern["String"]) > 0:
            return 1
        return None
    return _NORMALIZER_SHRINK.get(kind)


def _pre_tokenizer_keeps(spec) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(p) for p in spec.get("pretokenizers", []))
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    if kind == "Punctuation":
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _has_pre_tokenizer(spec, kind: str) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_pre_tokenizer(p, kind) for p in spec.get("pretokenizers", []))
    return spec.get("type") == kind


def _max_chars_per_token(backend) -> int | None:
    from tokenizers import pre_tokenizers

    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    if not model.get("byte_fallback"):  # what becomes of a character outside the vocabulary?
        if model.get("unk_token") is not None:
            if model.get("fuse_unk"):  # a run of them is one token
                return None
        elif not (_has_pre_tokenizer(spec.get("pre_tokenizer"), "ByteLevel")
                  and set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)):
            return None  # dropped without a trace
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps(spec.get("pre_tokenizer")):
        return None
    longest = max(map(len, vocab), default=1)
    return max(1, longest) * shrink


# ---------------------------------------------------------------------- streaming
class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, each a stable piece of the final text.

    Decoding a window of recent ids (starting a few tokens before the unread ones, so
    tokenisers that merge spaces or bytes across tokens see their context) gives the new text;
    it is released only when it does not end in U+FFFD, i.e. when no multi-byte character is
    still incomplete. `flush()` releases whatever is left at the end. The id window is trimmed
    as it advances, so memory stays bounded however long the output.
    """

    _CONTEXT = 5  # prompt tokens kept as decoding context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = [int(i) for i in prompt_ids[-(self._CONTEXT + 1):]]
        self.prefix = max(len(self.ids) - self._CONTEXT, 0)  # start of the decoding window
        self.read = len(self.ids)  # ids before this are already released as text

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; returns the newly stable text (possibly empty)."""
        self.ids.extend(int(i) for i in new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The rest of the text (the end of the output: incomplete characters included)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        ids = self.ids
        before = self._decode(ids[self.prefix : self.read])
        after = self._decode(ids[self.prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        delta = after[len(before):]
        self.prefix, self.read = self.read, len(ids)
        if self.prefix > 64:  # keep the window short
            del ids[: self.prefix]
            self.read -= self.prefix
            self.prefix = 0
        return delta


# ---------------------------------------------------------------------- the built-in tokenizer
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenisers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _builtin_merges(count: int) -> list[tuple[str, str]]:
    """`count` letter merges in a fixed order: " a".." z", then for each length L = 2, 3, ...
    every lower-case word of L letters, and the same word after a space (each merge's two
    parts exist before it)."""
    space = _bytes_to_unicode()[ord(" ")]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]

    def pairs():
        yield from ((space, a) for a in letters)
        length = 2
        while True:
            words = ["".join(w) for w in itertools.product(letters, repeat=length - 1)]
            yield from ((w, a) for w in words for a in letters)
            yield from ((space + w, a) for w in words for a in letters)
            length += 1

    return list(itertools.islice(pairs(), count))


@lru_cache(maxsize=8)
def _builtin_json(vocab_size: int) -> str:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    base = 256 + len(BUILTIN_SPECIALS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < base:
        raise ValueError(f"the built-in tokenizer needs a vocabulary of at least {base} tokens, got {vocab_size!r}")
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for i, tok in enumerate(BUILTIN_SPECIALS):
        vocab[tok] = 256 + i
    merges = _builtin_merges(vocab_size - base)
    for i, (a, b) in enumerate(merges):
        vocab[a + b] = base + i
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BUILTIN_SPECIALS])
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", 256)]
    )
    return backend.to_str()


def _builtin_backend(vocab_size: int):
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(_builtin_json(vocab_size))
    if backend.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError("built-in tokenizer size mismatch")
    return backend
