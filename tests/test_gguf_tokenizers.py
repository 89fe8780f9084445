"""Tokenizers built from GGUF vocabularies, checked two ways on the same files: against
transformers' GGUF tokenizer (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``), and
against llama.cpp's algorithms written out plainly here (SentencePiece's score-ordered pair
merging with byte fallback; BPE after llama.cpp's regex splits, run by the `regex` module).

Files: Gemma 3 270M's real SentencePiece vocabulary, and tiny files this test writes with
gguf-py: SentencePiece vocabularies with byte tokens (with and without ``add_space_prefix``),
and one byte-level BPE vocabulary under each pre-tokenizer name. Where transformers and
llama.cpp are known to differ, the tests say so and hold us to llama.cpp.
"""

from __future__ import annotations

import heapq
import os
import random
from collections import Counter
from collections.abc import Callable
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import pytest
import regex

from gemma_fixtures import gemma_file, gemma_tokenizer
from hf_fixtures import gguf_reader, transformers_gguf_once
from prefixcache.engine.gguf_vocab import bytes_to_unicode
from prefixcache.engine.model_files import ModelFileError, load_tokenizer
from prefixcache.engine.tokenizer import Tokenizer
from test_tokenizer import CORPUS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EXTRA = [
    "<start_of_turn>user\nWrite a haiku<end_of_turn>\n<start_of_turn>model\n",
    "<bos><bos>twice <eos> mid<end_of_turn>",
    "a  b   c    d     e\t\tf\n\n\ng",
    "   leading spaces and trailing   ",
    "\u3000ideographic space, NBSP\u00a0here, thin\u2009space",
    "if (x == 10) {\n\treturn arr[i] * 2;  // ok\n}\n",
    "Ελληνικά, עִבְרִית, हिन्दी, ไทย, 한국어, 日本語, 中文, Русский",
    "🧑🏽‍💻 wrote 𓀀𓁐 and 🫨 at 12:30, 2024-01-01, 1234567890",
    "0.5 + 0.25 = 0.75; 1e10; ١٢٣ ٤٥٦; ½ ⅓",
    "<think>\nstep by step\n</think>\nanswer",
    "<|im_start|>system\nok<|im_end|>\n<|endoftext|>",
    "I'M SHOUTING, you're whispering; they'd've known",
]
TEXTS = CORPUS + EXTRA


def hf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer built from the GGUF at ``path``, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    with transformers_gguf_once():
        return AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )


# --- llama.cpp's algorithms, written out -------------------------------------------------


class Vocab:
    """What llama.cpp reads from a file: texts, scores, types, merges and flags."""

    def __init__(self, meta: dict) -> None:
        self.tokens: list[str] = meta["tokenizer.ggml.tokens"]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(self.tokens)
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(self.tokens)
        special = [t for t, k in zip(self.tokens, types, strict=True) if k in (2, 3, 4)]
        self.special = sorted(special, key=len, reverse=True)  # llama.cpp: longest first
        ranks = meta.get("tokenizer.ggml.merges") or []
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(ranks)}
        self.add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)


def partition(text: str, vocab: Vocab) -> list[str | int]:
    """llama.cpp's special-token partition: each special text (longest first) cut out of
    every stretch of raw text, left to right."""
    pieces: list[str | int] = [text] if text else []
    for special in vocab.special:
        cut: list[str | int] = []
        for piece in pieces:
            if not isinstance(piece, str):
                cut.append(piece)
                continue
            for k, part in enumerate(piece.split(special)):
                cut += ([vocab.ids[special]] if k else []) + ([part] if part else [])
        pieces = cut
    return pieces


def spm_reference(text: str, vocab: Vocab) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm), without BOS."""
    out: list[int] = []
    after_special = True
    for piece in partition(text, vocab):
        if isinstance(piece, int):
            out.append(piece)
            after_special = True
            continue
        prefix = " " if vocab.add_space_prefix and after_special else ""
        out += spm_merge((prefix + piece).replace(" ", "\u2581"), vocab)
        after_special = False
    return out


def spm_spelled(text: str, vocab: Vocab) -> str:
    """What llama-server's pieces of ``text`` join to: the text, with the space llama.cpp
    prepends to each stretch of raw text when the vocabulary has ``add_space_prefix``."""
    prefix = " " if vocab.add_space_prefix else ""
    parts = partition(text, vocab)
    return "".join(vocab.tokens[p] if isinstance(p, int) else prefix + p for p in parts)


def spm_merge(text: str, vocab: Vocab) -> list[int]:
    """Merge the adjacent pair whose union scores highest (leftmost on a tie) until none is
    in the vocabulary; a symbol that is no entry becomes its bytes' <0xNN> tokens."""
    symbols: list[str | None] = list(text)
    after = [*range(1, len(symbols)), -1]
    before = list(range(-1, len(symbols) - 1))
    queue: list[tuple[float, int, int, str]] = []

    def offer(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            joined = f"{symbols[left]}{symbols[right]}"
            if joined in vocab.ids:
                heapq.heappush(queue, (-vocab.scores[vocab.ids[joined]], left, right, joined))

    for i in range(1, len(symbols)):
        offer(i - 1, i)
    while queue:
        _, left, right, joined = heapq.heappop(queue)
        if symbols[left] is None or symbols[right] is None:
            continue
        if f"{symbols[left]}{symbols[right]}" != joined:
            continue
        symbols[left], symbols[right] = joined, None
        after[left] = after[right]
        if after[right] >= 0:
            before[after[right]] = left
        offer(before[left], left)
        offer(left, after[left])
    out = []
    for symbol in symbols:
        if symbol is None:
            continue
        if symbol in vocab.ids:
            out.append(vocab.ids[symbol])
        else:
            out += [vocab.ids[f"<0x{b:02X}>"] for b in symbol.encode()]
    return out


# llama.cpp's regexes per pre-tokenizer (src/llama-vocab.cpp), as it writes them.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
LLAMA_CPP_SPLITS = {
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"], False),
    "llama-bpe": ([LLAMA3], True),
    "qwen2": ([QWEN2], False),
    "smollm": ([r"\p{N}", GPT2], False),
    "gpt-2": ([GPT2], False),
}


def regex_split(text: str, patterns: list[str]) -> list[str]:
    """Each pattern splits every piece into its matches and the text between them."""
    pieces = [text] if text else []
    for pattern in patterns:
        cut = []
        for piece in pieces:
            at = 0
            for match in regex.finditer(pattern, piece):
                if match.start() > at:
                    cut.append(piece[at : match.start()])
                if match.end() > match.start():
                    cut.append(match.group())
                at = match.end()
            if at < len(piece):
                cut.append(piece[at:])
        pieces = cut
    return pieces


BYTE_CHARS = bytes_to_unicode()


def bpe_reference(text: str, vocab: Vocab, pre: str) -> list[int]:
    """llama.cpp's BPE tokenizer (llm_tokenizer_bpe): split, spell bytes, merge by rank."""
    patterns, whole_words = LLAMA_CPP_SPLITS[pre]
    out: list[int] = []
    for piece in partition(text, vocab):
        if isinstance(piece, int):
            out.append(piece)
            continue
        for word in regex_split(piece, patterns):
            spelled = "".join(BYTE_CHARS[b] for b in word.encode())
            if whole_words and spelled in vocab.ids:
                out.append(vocab.ids[spelled])
                continue
            out += [vocab.ids[s] for s in bpe_merge(list(spelled), vocab.ranks)]
    return out


def bpe_merge(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    while len(symbols) > 1:
        pairs = [(ranks.get(p, 1 << 30), i) for i, p in enumerate(pairwise(symbols))]
        rank, i = min(pairs)
        if rank == 1 << 30:
            break
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


# --- tiny files written with gguf-py ----------------------------------------------------

TRAINING = " ".join(TEXTS[:120]) * 2


def train_pairs(words: list[list[str]], count: int) -> list[tuple[str, str]]:
    """A few merges learned from ``words`` (most frequent pair first), enough for real use."""
    merges: list[tuple[str, str]] = []
    for _ in range(count):
        pairs = Counter(p for w in words for p in pairwise(w))
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        joined = best[0] + best[1]
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i : i + 2] = [joined]
                i += 1
    return merges


def write_gguf(path: Path, arch: str, fields: Callable[[gguf.GGUFWriter], None]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.feed_forward_length", 8)
    writer.add_uint32(f"{arch}.attention.head_count", 1)
    fields(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Gemma's names and ids for the first five (transformers' Gemma tokenizer adds them if absent).
SPM_SPECIALS = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<mask>", 3)]
SPM_SPECIALS += [("<start_of_turn>", 3), ("<end_of_turn>", 3), ("<think>", 4), ("\n\n", 4)]
PAD, EOS, BOS, UNK = 0, 1, 2, 3


@cache
def spm_vocab(shuffle: bool) -> tuple[list[str], list[float], list[int]]:
    """Specials, the 256 byte tokens, the training text's characters (some left out, so they
    fall back to bytes) and learned pieces; scores -rank. ``shuffle``: ids out of score order."""
    rng = random.Random(7)
    text = TRAINING.replace(" ", "\u2581")
    chars = sorted(set(text))
    dropped = set(rng.sample([c for c in chars if ord(c) > 0x2FF], 12))
    chars = [c for c in chars if c not in dropped]
    words = [list(w) for w in regex.findall(r"\u2581?[^\u2581]+|\u2581+", text)]
    words = [[c for c in w if c not in dropped] for w in words]
    pieces = chars + [a + b for a, b in train_pairs(words, 400)]
    pieces = list(dict.fromkeys(p for p in pieces if p not in dict(SPM_SPECIALS)))
    normal = [(p, -float(rank)) for rank, p in enumerate(pieces)]
    if shuffle:
        rng.shuffle(normal)
    tokens = [t for t, _ in SPM_SPECIALS] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(tokens)
    types = [k for _, k in SPM_SPECIALS] + [6] * 256
    tokens += [t for t, _ in normal]
    scores += [s for _, s in normal]
    types += [1] * len(normal)
    return tokens, scores, types


def spm_file(folder: Path, arch: str, space_prefix: bool, shuffle: bool) -> Path:
    tokens, scores, types = spm_vocab(shuffle)

    def fields(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(UNK)
        w.add_bos_token_id(BOS)
        w.add_eos_token_id(EOS)
        w.add_pad_token_id(PAD)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(space_prefix)

    return write_gguf(folder / f"spm-{arch}-{space_prefix}.gguf", arch, fields)


BPE_SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4)]
UNREACHABLE = "\u0120zqxw"  # an entry no merge builds: only llama-bpe's whole-word rule finds it


@cache
def bpe_vocab() -> tuple[list[str], list[str]]:
    """Byte-level: the 256 byte characters, pieces learned on GPT-2-split words, specials."""
    words = [
        list("".join(BYTE_CHARS[b] for b in w.encode()))
        for w in regex.findall(GPT2, TRAINING + " zqx zq")
    ]
    merges = train_pairs(words, 600)
    tokens = list(BYTE_CHARS.values()) + [a + b for a, b in merges]
    tokens = list(dict.fromkeys(tokens)) + [UNREACHABLE] + [t for t, _ in BPE_SPECIALS]
    return tokens, [f"{a} {b}" for a, b in merges]


def bpe_file(folder: Path, pre: str) -> Path:
    tokens, merges = bpe_vocab()
    types = [1] * (len(tokens) - len(BPE_SPECIALS)) + [k for _, k in BPE_SPECIALS]

    def fields(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)

    return write_gguf(folder / f"bpe-{pre}.gguf", "qwen2" if pre == "qwen2" else "llama", fields)


def metadata_arch(path: Path) -> str:
    return gguf.GGUFReader(path).fields["general.architecture"].contents()


def metadata(path: Path, reader: gguf.GGUFReader | None = None) -> dict:
    reader = reader or gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf_tokenizers")


# --- SentencePiece ------------------------------------------------------------------------

SPM_CASES = {  # (architecture, add_space_prefix, ids out of score order)
    "gemma3-no-prefix": ("gemma3", False, False),
    "llama-prefix-shuffled": ("llama", True, True),
    "llama-no-prefix-shuffled": ("llama", False, True),
}


@pytest.fixture(scope="module", params=sorted(SPM_CASES))
def spm(request: pytest.FixtureRequest, folder: Path) -> tuple[Path, Tokenizer, Vocab]:
    path = spm_file(folder, *SPM_CASES[request.param])
    return path, load_tokenizer(path), Vocab(metadata(path))


def test_tiny_spm_matches_llama_cpp_algorithm(spm: tuple[Path, Tokenizer, Vocab]) -> None:
    _, ours, vocab = spm
    assert ours.vocab_size == len(vocab.tokens)
    fallbacks = 0
    for text in TEXTS:
        expected = spm_reference(text, vocab)
        assert ours.encode(text) == expected, repr(text)
        assert ours.encode(text, add_special_tokens=True) == [BOS, *expected], repr(text)
        fallbacks += any(vocab.tokens[i].startswith("<0x") for i in expected)
    assert fallbacks > 20  # the byte tokens were exercised


def as_transformers_reads(text: str, arch: str, space_prefix: bool) -> str | None:
    """The text whose llama.cpp ids transformers gives for ``text``, or None where the two
    knowingly differ. For a `llama` file transformers always prepends one space, to the text's
    start only and not before a space already there (Metaspace, prepend_scheme "first"),
    whatever `add_space_prefix` says; llama.cpp prepends one to each stretch after a special
    token, only when the flag is set. A `gemma3` file gets no prefix in either."""
    if arch == "gemma3":
        return text
    if not text or text.startswith(" ") or any(mark in text for mark, _ in SPM_SPECIALS):
        return None
    return text if space_prefix else " " + text


def test_tiny_spm_matches_transformers(spm: tuple[Path, Tokenizer, Vocab]) -> None:
    path, ours, vocab = spm
    hf = hf_tokenizer(path)
    arch = metadata_arch(path)
    checked = 0
    for text in TEXTS:
        ours_text = as_transformers_reads(text, arch, vocab.add_space_prefix)
        if ours_text is not None:
            assert ours.encode(ours_text) == hf.encode(text, add_special_tokens=False), repr(text)
            assert ours.encode(ours_text, add_special_tokens=True) == hf.encode(text), repr(text)
            checked += 1
    assert checked > 150


def test_space_prefix_follows_llama_cpp_where_transformers_differs(
    spm: tuple[Path, Tokenizer, Vocab],
) -> None:
    path, ours, vocab = spm
    hf = hf_tokenizer(path)
    texts = [" x", "x<end_of_turn>y"] if vocab.add_space_prefix else ["x"]
    for text in texts:
        assert ours.encode(text) == spm_reference(text, vocab)
        assert ours.decode(ours.encode(text), False) == spm_spelled(text, vocab)
        if metadata_arch(path) == "llama":
            assert hf.encode(text, add_special_tokens=False) != ours.encode(text)
        else:
            assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    if vocab.add_space_prefix:  # decoding: llama-server's pieces keep the prefix space,
        ids = ours.encode("x")  # transformers strips it
        assert (ours.decode(ids), hf.decode(ids)) == (" x", "x")


def test_tiny_spm_decodes_and_streams(spm: tuple[Path, Tokenizer, Vocab]) -> None:
    _, ours, vocab = spm
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == spm_spelled(text, vocab), repr(text)
        decoder = ours.incremental_decoder(skip_special_tokens=False)
        pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
        assert "".join(pieces) == ours.decode(ids, skip_special_tokens=False), repr(text)
        assert b"".join(ours.token_bytes(i) for i in ids).decode() == ours.decode(
            ids, skip_special_tokens=False
        ), repr(text)


# --- Gemma 3's real vocabulary ------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return gemma_tokenizer()


@pytest.fixture(scope="module")
def gemma_hf() -> PreTrainedTokenizerBase:
    return hf_tokenizer(gemma_file())


def test_gemma_flags_and_specials(gemma: Tokenizer, gemma_hf: PreTrainedTokenizerBase) -> None:
    assert gemma.vocab_size == len(gemma_hf) == 262144
    assert gemma.bos_token_id == gemma_hf.bos_token_id == 2
    assert gemma.eos_token_ids[:2] == (1, gemma.token_to_id("<end_of_turn>"))
    assert gemma.chat_template is None  # a base model
    assert gemma.encode("hi", add_special_tokens=True)[0] == 2


def test_gemma_ids_match_transformers(gemma: Tokenizer, gemma_hf: PreTrainedTokenizerBase) -> None:
    for text in TEXTS:
        assert gemma.encode(text) == gemma_hf.encode(text, add_special_tokens=False), repr(text)
        assert gemma.encode(text, add_special_tokens=True) == gemma_hf.encode(text), repr(text)


def test_gemma_ids_match_llama_cpp_algorithm(gemma: Tokenizer) -> None:
    vocab = Vocab(metadata(gemma_file(), gguf_reader(gemma_file())))  # parsed once (gemma_hf)
    for text in TEXTS:
        assert gemma.encode(text) == spm_reference(text, vocab), repr(text)


@pytest.mark.parametrize("skip", [True, False])
def test_gemma_decode_matches_transformers(
    gemma: Tokenizer, gemma_hf: PreTrainedTokenizerBase, skip: bool
) -> None:
    for text in TEXTS:
        ids = gemma.encode(text)
        expected = gemma_hf.decode(ids, skip_special_tokens=skip)
        assert gemma.decode(ids, skip_special_tokens=skip) == expected, repr(text)
        if not skip:
            assert expected == text, repr(text)  # a round trip


def rare_characters(tokenizer: Tokenizer) -> str:
    """Characters Gemma's vocabulary lacks: each is spelled in <0xNN> byte tokens."""
    candidates = "𓀀𓁐𓂀𐎀𐎁𒀀𒀁🫨🪿𝌆"
    return "".join(c for c in candidates if tokenizer.token_to_id(c) is None)


def test_gemma_byte_fallback_streams_whole_characters(gemma: Tokenizer) -> None:
    rare = rare_characters(gemma)
    assert len(rare) >= 3
    text = f"a{rare}b é {rare[0]}"
    ids = gemma.encode(text)
    bytes_used = [i for i in ids if gemma.backend.id_to_token(i).startswith("<0x")]
    assert len(bytes_used) == 4 * (len(rare) + 1)  # four UTF-8 bytes each
    decoder = gemma.incremental_decoder()
    pieces = [decoder.push(i) for i in ids]
    assert decoder.flush() == ""
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert all(len(p) <= 3 for p in pieces)  # no piece holds more than one token's text
    assert b"".join(gemma.token_bytes(i) for i in ids) == text.encode()
    assert gemma.token_bytes(bytes_used[0]) == text.encode()[1:2]


# --- byte-level BPE, each pre-tokenizer --------------------------------------------------

PRE_NAMES = ("llama-bpe", "qwen2", "smollm", "default", "gpt-2")
# transformers' GGUF converter splits llama-bpe and qwen2 by their regexes; for the others
# it uses GPT-2's regex (no digit split for smollm, none of llama.cpp's "default" steps).
HF_SPLITS = {"llama-bpe": [LLAMA3], "qwen2": [QWEN2]}


@pytest.fixture(scope="module", params=PRE_NAMES)
def bpe(request: pytest.FixtureRequest, folder: Path) -> tuple[str, Path, Tokenizer, Vocab]:
    path = bpe_file(folder, request.param)
    return request.param, path, load_tokenizer(path), Vocab(metadata(path))


def test_bpe_matches_llama_cpp_algorithm(bpe: tuple[str, Path, Tokenizer, Vocab]) -> None:
    pre, _, ours, vocab = bpe
    for text in [*TEXTS, "zqxw zqxw"]:
        assert ours.encode(text) == bpe_reference(text, vocab, pre), repr(text)


def test_bpe_matches_transformers(bpe: tuple[str, Path, Tokenizer, Vocab]) -> None:
    """Equal wherever transformers splits the text as llama.cpp does (all of it for llama-bpe
    and qwen2, but for whole-word entries no merge builds, which llama-bpe takes whole)."""
    pre, path, ours, _ = bpe
    hf = hf_tokenizer(path)
    patterns = LLAMA_CPP_SPLITS[pre][0]
    checked = 0
    for text in TEXTS:
        if regex_split(text, patterns) != regex_split(text, HF_SPLITS.get(pre, [GPT2])):
            continue
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), repr(text)
        checked += 1
    assert checked >= (len(TEXTS) if pre in HF_SPLITS else 60)
    whole = ours.encode(" zqxw")
    if pre == "llama-bpe":
        assert whole == [ours.token_to_id(UNREACHABLE)]
        assert hf.encode(" zqxw", add_special_tokens=False) != whole  # no ignore_merges there
    else:
        assert whole == hf.encode(" zqxw", add_special_tokens=False)


def test_bpe_decodes_and_streams(bpe: tuple[str, Path, Tokenizer, Vocab]) -> None:
    _, _, ours, _ = bpe
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text, repr(text)
        decoder = ours.incremental_decoder(skip_special_tokens=False)
        assert "".join([decoder.push(i) for i in ids] + [decoder.flush()]) == text


def test_llama_bpe_adds_bos_unless_the_file_says_not(folder: Path) -> None:
    tokens, merges = bpe_vocab()

    def fields(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))

    ours = load_tokenizer(write_gguf(folder / "bos-default.gguf", "llama", fields))
    assert ours.encode("hi", add_special_tokens=True)[0] == tokens.index("<|endoftext|>")


# --- files we refuse ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "pre", "named"),
    [
        ("bert", "default", "tokenizer.ggml.model 'bert'"),
        ("t5", "default", "tokenizer.ggml.model 't5'"),
        ("gpt2", "deepseek-coder", "tokenizer.ggml.pre 'deepseek-coder'"),
        ("gpt2", "tekken", "tokenizer.ggml.pre 'tekken'"),
    ],
)
def test_unsupported_vocabulary_is_one_line_naming_file_and_value(
    folder: Path, model: str, pre: str, named: str
) -> None:
    tokens, merges = bpe_vocab()

    def fields(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(model)
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)

    path = write_gguf(folder / f"bad-{model}-{pre}.gguf", "llama", fields)
    with pytest.raises(ModelFileError) as caught:
        load_tokenizer(path)
    message = str(caught.value)
    assert str(path) in message and named in message
    assert "\n" not in message


def test_sentencepiece_without_scores_is_refused(folder: Path) -> None:
    tokens, _, types = spm_vocab(False)

    def fields(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)

    path = write_gguf(folder / "spm-no-scores.gguf", "llama", fields)
    with pytest.raises(ModelFileError, match=r"tokenizer\.ggml\.scores"):
        load_tokenizer(path)
