"""``prefixcache export-tokenizer DIR``: a Hugging Face tokenizer with the server's ids."""

from __future__ import annotations

from transformers import AutoTokenizer

from engine_fixtures import default_tokenizer
from prefixcache.cli import main

TEXTS = [
    "The capital of France is Paris.",
    "Digits split one by one: 12345 and  3.14",
    "héllo wörld, naïve café <|im_end|> tail",
]


def test_exported_tokenizer_gives_the_servers_ids(tmp_path, capsys):
    assert main(["export-tokenizer", str(tmp_path / "tok")]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    exported = AutoTokenizer.from_pretrained(tmp_path / "tok")
    ours = default_tokenizer()
    for text in TEXTS:
        assert exported.encode(text) == ours.encode(text, add_special_tokens=True)
        ids = ours.encode(text)
        assert exported.decode(ids) == ours.decode(ids, skip_special_tokens=False)
    assert exported.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "Hi!"}]
    templated = exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert templated == ours.apply_chat_template(messages)


def test_token_bytes_are_exact_even_for_half_characters():
    tokenizer = default_tokenizer()
    ids = tokenizer.encode("naïve 日本語 ✓")
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == "naïve 日本語 ✓".encode()
