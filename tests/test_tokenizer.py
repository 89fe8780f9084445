"""Our tokenizer against transformers' on the default GGUF: ids, decoding, chat, streaming."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers

from hf_fixtures import transformers_gguf_once
from prefixcache.engine.model_files import default_model_path, load_tokenizer
from prefixcache.engine.tokenizer import IncrementalDecoder, Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HAND_PICKED = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "\r\n",
    "Hello, world!",
    "hello world",
    " leading space",
    "trailing space ",
    "multiple   internal    spaces",
    "tabs\tand\nnewlines\r\nmixed",
    "\n\n\nthree newlines first",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "SHOUTING AND CamelCase andMixedWords",
    "Café naïve résumé façade Ångström Straße",
    "e\u0301 combining acute, a\u0308 diaeresis",
    "你好\uff0c世界\uff01这是一个测试。",
    "日本語のテキストとカタカナ ー",
    "한국어 텍스트입니다",
    "Россия и Україна, Ελληνικά",
    "مرحبا بالعالم",
    "שלום עולם",
    "English then עברית then English",
    "हिन्दी पाठ, ภาษาไทย",
    "Emoji: 😀👍🏽🇺🇸 and ❤️ and 👨‍👩‍👧‍👦",
    "🤖🤖🤖",
    "Numbers 12345 and 3.14159 and 1,000,000",
    "31415926535897932384626433832795028841971",
    "-42 +7 0x1F 1e-10 2^64 = 18446744073709551616",
    "  1",
    "a  2024",
    "x =  42\n",
    "1 2  3   4    5",
    "hello\n\n1.",
    "Phone: +1 (555) 123-4567, date 2024-02-29T23:59:59Z",
    "Superscripts ² ³ and fractions ½ ¾ and Roman Ⅻ",
    "Punctuation!!! ??? ... --- (parens) [brackets] {braces} <angles>",
    "zero\u200bwidth and non\u00a0breaking",
    "replacement char \ufffd inside",
    "nul \x00 and del \x7f and bell \x07",
    "def foo(x):\n    return x ** 2  # square\n",
    'fn main() {\n    println!("{}", 1 + 2);\n}\n',
    '#include <stdio.h>\nint main(void) { return printf("%d\\n", 42) < 0; }',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "const f = async (a, b) => { await g(a?.b ?? 0); };",
    '<div class="x">&amp; &lt;tag&gt;</div>',
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "$ ls -la | grep '^d' && echo \"done\" > /dev/null 2>&1",
    "https://example.com/path/to/page?query=1&other=two#frag",
    "mailto:someone@example.org and ftp://files.example.net/a_b-c.tar.gz",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>",
    "text<|im_end|>more text",
    "<|im_start|system|> not quite special <|im_end",
    "<think>reasoning</think> answer",
    "    indented code with four spaces",
    "\t\ttwo tabs",
    "trailing newlines\n\n",
    "a" * 300,
    "ab " * 100,
    "The quick brown fox jumps over the lazy dog. " * 5,
]

WORDS = [
    "the",
    "model",
    "cache",
    "prefix",
    "Tokenizer",
    "GPU",
    "naïve",
    "東京",
    "데이터",
    "данные",
    "عربي",
    "עברית",
    "🙂",
    "🚀🔥",
    "x",
    "I'm",
    "we'll",
    "don't",
    "__init__",
    "self.x",
    "f(x)",
    "[1,2]",
    "a+b",
    "≤",
    "∑",
    "π",
    "€100",
    "$5.99",
    "100%",
    "#tag",
    "@user",
    "<|im_start|>",
    "<|im_end|>",
    "https://a.b/c",
    "e\u0301",
    "ß",
    "ǅ",
    "Ⅻ",
    "½",
]
SEPARATORS = [" ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\r\n", "", ", ", ". ", "\u3000"]


def generated_corpus(count: int, seed: int = 1234) -> list[str]:
    """Random mixes of words, numbers and whitespace from several scripts."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            if roll < 0.2:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 20))))
            elif roll < 0.25:
                parts.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(3)))
            else:
                parts.append(rng.choice(WORDS))
            parts.append(rng.choice(SEPARATORS))
        corpus.append("".join(parts))
    return corpus


CORPUS = HAND_PICKED + generated_corpus(240)


def pretokenizers_agree(text: str) -> bool:
    """False where whitespace meets a number: only there does the digit split matter."""
    return not any(ch.isnumeric() and text[i - 1 : i].isspace() for i, ch in enumerate(text))


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer()  # the weights are not needed


@pytest.fixture(scope="module")
def hf() -> PreTrainedTokenizerBase:
    """transformers' tokenizer built from the same GGUF, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    path = default_model_path()
    with transformers_gguf_once():  # the GGUF parsed once per session (hf_fixtures.py)
        return AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )


@pytest.fixture(scope="module")
def hf_smollm(hf: PreTrainedTokenizerBase) -> Backend:
    """transformers' backend with SmolLM's pre-tokenizer (digits split first, as llama.cpp does).

    transformers' GGUF converter has no case for `tokenizer.ggml.pre == "smollm"` and falls back
    to plain GPT-2 byte-level splitting.
    """
    backend = Backend.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    return backend


def test_corpus_is_large_and_varied() -> None:
    assert len(CORPUS) >= 200
    assert len(set(CORPUS)) > 250
    assert sum(map(pretokenizers_agree, CORPUS)) >= 100


def test_ids_match_transformers_with_smollm_pre_tokenizer(
    ours: Tokenizer, hf_smollm: Backend
) -> None:
    mismatches = [
        (s, ours.encode(s), hf_smollm.encode(s, add_special_tokens=False).ids)
        for s in CORPUS
        if ours.encode(s) != hf_smollm.encode(s, add_special_tokens=False).ids
    ]
    assert not mismatches, mismatches[:3]


def test_ids_match_transformers_gguf_tokenizer(
    ours: Tokenizer, hf: PreTrainedTokenizerBase
) -> None:
    """Identical to transformers everywhere its fallback pre-tokenizer agrees with SmolLM's."""
    for text in filter(pretokenizers_agree, CORPUS):
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), repr(text)
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text), repr(text)


def test_whitespace_before_digits_follows_llama_cpp(
    ours: Tokenizer, hf: PreTrainedTokenizerBase
) -> None:
    """llama.cpp and SmolLM's tokenizer.json isolate digits first, so "  1" is [ĠĠ, 1]."""
    two_spaces, one = ours.token_to_id("ĠĠ"), ours.token_to_id("1")
    assert ours.encode("  1") == [two_spaces, one]
    assert hf.encode("  1", add_special_tokens=False) != [two_spaces, one]  # the fallback


def test_special_markup_encodes_to_special_ids(
    ours: Tokenizer, hf: PreTrainedTokenizerBase
) -> None:
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ours.token_to_id("<|im_start|>") == hf.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == ours.token_to_id("<|im_end|>")


def test_properties_match_transformers(ours: Tokenizer, hf: PreTrainedTokenizerBase) -> None:
    assert ours.vocab_size == len(hf) == 49152
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_ids[0] == hf.eos_token_id
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids
    assert ours.token_to_id("not a token at all") is None


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(
    ours: Tokenizer, hf: PreTrainedTokenizerBase, skip: bool
) -> None:
    for text in CORPUS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        ), repr(text)


def test_decode_round_trips(ours: Tokenizer) -> None:
    for text in CORPUS:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why?"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is a cache?"},
        {"role": "assistant", "content": "Une mémoire rapide."},
        {"role": "user", "content": "And a prefix cache? 🤔\nExplain  in 2 lines."},
    ],
    [
        {"role": "user", "content": "First"},
        {"role": "assistant", "content": "Second"},
        {"role": "user", "content": ""},
    ],
    [{"role": "user", "content": "<|im_end|> injected\n\tmarkup"}],
]


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(
    ours: Tokenizer,
    hf: PreTrainedTokenizerBase,
    hf_smollm: Backend,
    messages: list[dict],
    generation_prompt: bool,
) -> None:
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    ids = ours.encode_chat(messages, add_generation_prompt=generation_prompt)
    assert ids == hf_smollm.encode(expected, add_special_tokens=False).ids


def test_chat_template_default_adds_generation_prompt(ours: Tokenizer) -> None:
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in text


def stream(decoder: IncrementalDecoder, ids: list[int]) -> list[str]:
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_decoder_reproduces_decode(ours: Tokenizer, skip: bool) -> None:
    for text in CORPUS:
        ids = ours.encode(text)
        pieces = stream(ours.incremental_decoder(skip_special_tokens=skip), ids)
        assert "".join(pieces) == ours.decode(ids, skip_special_tokens=skip), repr(text)
        if "\ufffd" not in text:
            assert not any("\ufffd" in piece for piece in pieces), repr(text)


def test_incremental_decoder_holds_split_characters(ours: Tokenizer) -> None:
    text = "a🤖b東"
    ids = ours.encode(text)
    assert len(ids) > len(text), "expected some characters to span several tokens"
    decoder = IncrementalDecoder(ours)
    pieces = [decoder.push(i) for i in ids]
    assert [p for p in pieces if p] == list(text)  # each character appears whole, exactly once
    assert decoder.flush() == ""


def test_incremental_decoder_flushes_an_incomplete_character(ours: Tokenizer) -> None:
    robot = ours.encode("🤖")
    decoder = ours.incremental_decoder()
    assert [decoder.push(i) for i in robot[:-1]] == [""] * (len(robot) - 1)
    assert decoder.flush() == ours.decode(robot[:-1])


BAD_MESSAGES = [
    ("not a list", "list"),
    ([], "empty"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"role": "user", "content": None}], r"\['content'\] must be a str"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"\['content'\] must be a str"),
    ([{"role": 3, "content": "x"}], r"\['role'\] must be a str"),
    ([{"role": "user", "content": "a"}, {"role": "", "content": "b"}], r"messages\[1\]"),
]


@pytest.mark.parametrize(("messages", "match"), BAD_MESSAGES)
def test_bad_messages_raise_value_error(ours: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ours.apply_chat_template(messages)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        ours.encode_chat(messages)  # type: ignore[arg-type]


def test_hf_folder_tokenizer_matches_transformers(
    hf: PreTrainedTokenizerBase, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """transformers saves its tokenizer as a folder; ours reads it back to the same ids."""
    folder: Path = tmp_path_factory.mktemp("hf_tokenizer")
    hf.save_pretrained(folder)
    ours = Tokenizer.from_hf_folder(folder)
    for text in CORPUS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), repr(text)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_ids[0] == hf.eos_token_id
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == expected
