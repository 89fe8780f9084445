"""Text <-> token ids, the chat template and streaming detokenization for Llama-family models.

Built with the `tokenizers` library from a GGUF file's metadata (byte-level BPE or SentencePiece,
tokenizing as llama.cpp does: `engine/gguf_vocab.py`) or from a Hugging Face `tokenizer.json`;
chat templates render in a Jinja2 sandbox the way transformers renders them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as Backend
from tokenizers import decoders

from prefixcache.engine import chat_template as templates
from prefixcache.engine import gguf_vocab

# Texts of special tokens that end a turn in common chat formats; llama.cpp stops on these too.
_END_OF_GENERATION = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's special tokens and chat template."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = _end_of_generation_ids(backend, eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token etc., for the template
        self._template: jinja2.Template | None = None
        self._token_bytes: dict[int, bytes] = {}
        self._byte_fallback = bool(getattr(backend.model, "byte_fallback", False))

    def __getstate__(self) -> dict:
        """Pickled without its caches (the compiled template cannot be): for worker processes."""
        return {**self.__dict__, "_template": None, "_token_bytes": {}}

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`tokenizer.ggml.*` keys, values as python objects);
        ValueError naming the key and value of a vocabulary kind we cannot build."""
        meta = gguf_vocab.with_defaults(meta)
        backend = gguf_vocab.gguf_backend(meta)
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in _GGUF_SPECIALS.items()}
        ids = {n: i for n, i in ids.items() if isinstance(i, int) and 0 <= i < len(tokens)}
        names = {n: tokens[i] for n, i in ids.items()}
        eot = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls(
            backend,
            bos_token_id=ids.get("bos_token"),
            eos_token_ids=[i for i in eot if isinstance(i, int) and 0 <= i < len(tokens)],
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens=names,
        )

    @classmethod
    def from_hf_folder(cls, folder: Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """Build from `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`)."""
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else {}
        names = {k: _token_text(config.get(k)) for k in _GGUF_SPECIALS}
        names = {k: v for k, v in names.items() if v is not None}
        eos = [backend.token_to_id(names["eos_token"])] if "eos_token" in names else []
        bos = backend.token_to_id(names["bos_token"]) if "bos_token" in names else None
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=[i for i in [*eos, *extra_eos_ids] if i is not None],
            chat_template=_hf_chat_template(folder, config),
            special_tokens=names,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the model's EOS first, then end-of-turn tokens."""
        return self._eos_token_ids

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token markup in the text becomes its special id.

        tokenizers' ``encode`` holds the GIL (a 1M-character prompt stalls every thread for
        a second); ``encode_batch`` releases it and gives the same ids.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_tool_section(self) -> bool:
        """Whether the chat template renders tool definitions itself (it reads ``tools``)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The conversation as the model's chat template writes it (as transformers renders it);
        ``tools`` (OpenAI function tools) go to a template that has a tool section.

        NoChatTemplate if there is none; TemplateFailed (one line) if the template fails, is
        refused by the sandbox or goes past a bound (``engine/chat_template.py``)."""
        _check_messages(messages)
        context = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            **({"tools": tools} if tools else {}),
            **self.special_tokens,
        }
        return templates.render(self._compiled_template(), context)

    def use_chat_template(self, source: str) -> None:
        """Render with ``source`` from now on (``--chat-template``), once it passes the check."""
        compiled = templates.compile_template(source)
        templates.check_template(compiled, self.special_tokens)
        self.chat_template, self._template = source, compiled

    def check_chat_template(self) -> None:
        """TemplateFailed unless the template renders a sample conversation within bounds
        (nothing to check without a template: chat is then refused per request)."""
        if self.chat_template:
            templates.check_template(self._compiled_template(), self.special_tokens)

    def _compiled_template(self) -> jinja2.Template:
        if self._template is None:
            if not self.chat_template:
                raise templates.NoChatTemplate()
            self._template = templates.compile_template(self.chat_template)
        return self._template

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (the template writes any BOS itself)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a byte-level token may be half a character)."""
        found = self._token_bytes.get(token_id)
        if found is None:
            piece = self.backend.id_to_token(token_id) or ""
            if (
                isinstance(self.backend.decoder, decoders.ByteLevel)
                and set(piece) <= _BYTE_OF.keys()
            ):
                found = bytes(_BYTE_OF[c] for c in piece)
            elif gguf_vocab.BYTE_PIECE.fullmatch(piece) and self._byte_fallback:
                found = bytes([int(piece[3:5], 16)])  # a SentencePiece byte token
            else:
                found = self.decode([token_id], skip_special_tokens=False).encode("utf-8")
            self._token_bytes[token_id] = found
        return found

    def token_text(self, token_id: int) -> str:
        """One token as text (an incomplete UTF-8 sequence shows as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def save_hf(self, folder: Path, model_max_length: int | None = None) -> list[Path]:
        """Write a Hugging Face tokenizer folder (what ``AutoTokenizer`` loads); the paths."""
        folder.mkdir(parents=True, exist_ok=True)
        written = [folder / "tokenizer.json", folder / "tokenizer_config.json"]
        self.backend.save(str(written[0]))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            **{name: text for name, text in self.special_tokens.items()},
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        if model_max_length:
            config["model_max_length"] = model_max_length
        written[1].write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
        return written


class IncrementalDecoder:
    """Streams text token by token; never returns half a UTF-8 character.

    Each push decodes a short window of recent ids (so context-dependent decoders, like a
    sentencepiece leading space, see their neighbour) and returns what the new id added once
    the window no longer ends in an incomplete character. The pieces concatenate to `decode()`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids before it are already emitted text
        self._read = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        done = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        done = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(done) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


_GGUF_SPECIALS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


_BYTE_OF = {char: byte for byte, char in gguf_vocab.bytes_to_unicode().items()}


def _end_of_generation_ids(backend: Backend, eos_ids: Iterable[int]) -> tuple[int, ...]:
    """The given EOS ids, then any special end-of-turn token the vocabulary has."""
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    turn_ends = [backend.token_to_id(text) for text in _END_OF_GENERATION]
    found = [i for i in turn_ends if i is not None and i in special]
    return tuple(dict.fromkeys([*eos_ids, *found]))


def _token_text(value: object) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The template from `chat_template.jinja`, else from tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text("utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _check_messages(messages: object) -> None:
    """Raise ValueError unless `messages` is a non-empty list of {role, content} string dicts."""
    if not isinstance(messages, list | tuple):
        raise ValueError(f"messages must be a list of dicts, not {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, not {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{i}] has no {key!r}")
            if not isinstance(message[key], str):
                kind = type(message[key]).__name__
                raise ValueError(f"messages[{i}][{key!r}] must be a str, not {kind}")
        if not message["role"]:
            raise ValueError(f"messages[{i}]['role'] is empty")
