"""A `tokenizers` backend built from a GGUF's vocabulary, tokenizing as llama.cpp does.

Two vocabulary kinds (`tokenizer.ggml.model`):

- ``gpt2``: byte-level BPE with the file's merges, split first by the regexes llama.cpp uses
  for the file's `tokenizer.ggml.pre` (Llama 3, Qwen 2, SmolLM, GPT-2, llama.cpp's default).
- ``llama``: SentencePiece BPE. llama.cpp merges the text's characters pairwise, always the
  adjacent pair whose union is the vocabulary entry of highest score, and spells a character
  the vocabulary lacks as its UTF-8 bytes (`<0xNN>` tokens). That is a BPE model whose merges
  are every (left, right) split of every entry whose halves are entries too, ranked by the
  entry's score, with byte fallback; spaces become "▁" first (and one is prepended to each
  stretch of text after a special token when `add_space_prefix` is set).

In both, control tokens are special added tokens and user-defined ones plain added tokens:
matched whole in the raw text before anything else, as llama.cpp partitions its input.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

# llama.cpp's token types (`tokenizer.ggml.token_type`).
CONTROL, USER_DEFINED, BYTE = 3, 4, 6
SPACE = "\u2581"  # SentencePiece's spelling of a space
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values by how llama.cpp splits their text before merging.
_GPT2_NAMES = frozenset(("gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais"))
_DIGIT_NAMES = frozenset(  # every digit apart, then GPT-2's regex
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
)
_REGEXES = {  # the regexes in order, each splitting the pieces the one before left
    # llama.cpp's "default" (also what a file without the key gets): punctuation runs apart,
    # then GPT-2's regex, then digit runs, then digits in threes.
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3_SPLIT,)
    ),
    **dict.fromkeys(("qwen2", "stablelm2", "megrez", "deepseek-r1-qwen"), (_QWEN2_SPLIT,)),
}  # fmt: skip
# Names whose pieces that are vocabulary entries are taken whole, unmerged (`ignore_merges`);
# llama.cpp also adds BOS for them when the file does not say.
_WHOLE_WORDS = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3"))
SUPPORTED_PRE = tuple(sorted(_GPT2_NAMES | _DIGIT_NAMES | _REGEXES.keys()))
SUPPORTED_MODELS = ("gpt2", "llama")

# llama.cpp's defaults for a SentencePiece file that leaves a key out.
_SPM_DEFAULTS = {
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.ggml.unknown_token_id": 0,
    "tokenizer.ggml.add_bos_token": True,
    "tokenizer.ggml.add_eos_token": False,
    "tokenizer.ggml.add_space_prefix": True,
}


def with_defaults(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata with llama.cpp's defaults for the keys this vocabulary kind may omit;
    ValueError naming the key and value for a kind or pre-tokenizer it does not support."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise ValueError(
            f"tokenizer.ggml.model {kind!r} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )
    if not isinstance(meta.get("tokenizer.ggml.tokens"), list) or not meta["tokenizer.ggml.tokens"]:
        raise ValueError("no tokenizer.ggml.tokens list in the metadata")
    if kind == "llama":
        return {**_SPM_DEFAULTS, **meta}
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in SUPPORTED_PRE:
        raise ValueError(
            f"tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE)})"
        )
    defaults = {"tokenizer.ggml.add_bos_token": True} if pre in _WHOLE_WORDS else {}
    return {**defaults, **meta, "tokenizer.ggml.pre": pre}


def gguf_backend(meta: Mapping[str, Any]) -> Backend:
    """The backend for metadata already passed through ``with_defaults``."""
    spm = meta["tokenizer.ggml.model"] == "llama"
    backend = _sentencepiece(meta) if spm else _byte_level(meta)
    _add_special_tokens(backend, meta)
    _set_post_processor(backend, meta)
    return backend


def _token_texts(meta: Mapping[str, Any]) -> list[str]:
    """The vocabulary; an empty entry renamed as llama.cpp names it."""
    return [t or f"[EMPTY_{i}]" for i, t in enumerate(meta["tokenizer.ggml.tokens"])]


def _byte_level(meta: Mapping[str, Any]) -> Backend:
    """Byte-level BPE from the vocabulary and merges, split as the pre-tokenizer says."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token stored as raw text, not in the byte alphabet, is respelled (as transformers does).
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(_token_texts(meta))
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    pre = meta["tokenizer.ggml.pre"]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _WHOLE_WORDS))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's splitting for ``pre``, then the bytes spelled (GPT-2's regex and the digit
    split use `tokenizers`' own equivalents: one pass instead of two, twice as fast)."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_NAMES:
        return gpt2
    if pre in _DIGIT_NAMES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _REGEXES[pre]]
    raw = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, raw])


def _sentencepiece(meta: Mapping[str, Any]) -> Backend:
    """SentencePiece as llama.cpp runs it: score-ranked merges over characters, byte fallback."""
    tokens = _token_texts(meta)
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ValueError("a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated text: the last id, as llama.cpp
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=vocab,
        merges=merges_by_score(vocab, scores),
        byte_fallback=True,
        unk_token=tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None,
    )
    backend = Backend(model)
    steps = [normalizers.Prepend(SPACE)] if meta["tokenizer.ggml.add_space_prefix"] else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def merges_by_score(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of every entry into two entries, the entry of highest score first.

    BPE then merges, among adjacent pairs, the one whose union scores highest, as llama.cpp's
    SentencePiece tokenizer does. Equal scores go by token id, then by split point (llama.cpp
    takes the leftmost pair instead; the two differ only for two overlapping pairs that
    make different entries of exactly equal score).
    """
    ranked = [
        (-float(scores[i]), i, cut)
        for text, i in vocab.items()
        for cut in range(1, len(text))
        if text[:cut] in vocab and text[cut:] in vocab
    ]
    ranked.sort()
    texts = {i: text for text, i in vocab.items()}
    return [(texts[i][:cut], texts[i][cut:]) for _, i, cut in ranked]


def _add_special_tokens(backend: Backend, meta: Mapping[str, Any]) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens."""
    pairs = list(zip(_token_texts(meta), meta.get("tokenizer.ggml.token_type") or (), strict=False))
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in pairs if k == CONTROL]
    )
    user = [AddedToken(t, normalized=False, special=False) for t, k in pairs if k == USER_DEFINED]
    backend.add_tokens(user)


def _set_post_processor(backend: Backend, meta: Mapping[str, Any]) -> None:
    """BOS/EOS added by `encode(add_special_tokens=True)` when the file asks for them."""
    tokens = _token_texts(meta)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    before = [tokens[bos]] if meta.get("tokenizer.ggml.add_bos_token") and bos is not None else []
    after = [tokens[eos]] if meta.get("tokenizer.ggml.add_eos_token") and eos is not None else []
    if not before and not after:
        return
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(before + after)]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*before, "$A", *after]),
        pair=" ".join([*before, "$A", *after, *before, "$B:1", *after]),
        special_tokens=specials,
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level tokens."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
