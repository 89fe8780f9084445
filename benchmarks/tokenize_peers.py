"""Our token ids against llama.cpp's own, on the same GGUF: llama-server's ``/tokenize``
(built by benchmarks/llama_server.py, as `make bench-peers` builds it) for each model.

    python benchmarks/tokenize_peers.py [--model NAME_OR_GGUF ...]

For each text of a multilingual corpus (code, emoji, whitespace runs, digits, special-token
markup, random mixes), ``Tokenizer.encode(text)`` and ``/tokenize`` with ``parse_special``
(markup becomes its special token, as ours does) and without BOS; prints the count that
agree and the first differences, and exits 1 if any differs. Not a test (it needs the
llama-server build); tests/test_gguf_tokenizers.py checks the same algorithms written out.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path

import httpx

from llama_server import ensure_built
from servers import free_port, interrupt, wait_healthy

MODELS = ("smollm2", "gemma3-270m")
TEXTS = [
    "Hello, world!",
    " leading space",
    "  two  spaces   three\t\ttabs\n\n\nnewlines",
    "I'm sure they'll say it's fine; we'd've known",
    "Café naïve Ångström Straße, e\u0301 a\u0308",
    "你好\uff0c世界\uff01日本語のテキスト 한국어 텍스트",
    "Россия, Ελληνικά, مرحبا, שלום, हिन्दी, ภาษาไทย",
    "Emoji: 😀👍🏽🇺🇸 ❤️ 👨‍👩‍👧‍👦 🧑🏽‍💻 𓀀𓁐 🫨",
    "31415926535897932384626433832795 and 1,000,000.25 and ١٢٣",
    "def f(x):\n    return x ** 2  # square\n",
    'fn main() {\n\tprintln!("{}", 1 + 2);\n}\n',
    "SELECT id FROM t WHERE a >= 18 ORDER BY name;",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> and <think>reasoning</think>",
    "trailing spaces   ",
    "\u3000ideographic, NBSP\u00a0, thin\u2009space, zero\u200bwidth",
]
WORDS = [
    "the",
    "cache",
    "naïve",
    "東京",
    "데이터",
    "данные",
    "🙂",
    "x",
    "I'm",
    "__init__",
    "≤",
    "€100",
]
SEPARATORS = [" ", "  ", "   ", "\n", "\n\n", "\t", " \n", "", ", ", "\u3000"]


def corpus(count: int = 200, seed: int = 1) -> list[str]:
    """The hand-picked texts, then random mixes of words, numbers and whitespace."""
    rng = random.Random(seed)
    mixes = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.2:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
            else:
                parts.append(rng.choice(WORDS))
            parts.append(rng.choice(SEPARATORS))
        mixes.append("".join(parts))
    return TEXTS + mixes


def compare(binary: Path, model: Path) -> int:
    """Texts whose ids differ between ours and llama-server's on ``model``."""
    from prefixcache.engine.model_files import load_tokenizer

    ours = load_tokenizer(model)
    port = free_port()
    command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        [*command, "-c", "512", "-t", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    differ = 0
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        texts = corpus()
        for text in texts:
            body = {"content": text, "add_special": False, "parse_special": True}
            theirs = httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["tokens"]
            if ours.encode(text) != theirs:
                differ += 1
                if differ <= 5:
                    print(
                        f"  differs: {text!r}\n    ours   {ours.encode(text)}\n    theirs {theirs}"
                    )
        print(f"{model.name}: {len(texts) - differ} of {len(texts)} texts give the same ids")
    finally:
        interrupt(server)
    return differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help=f"name or GGUF (default: {MODELS})")
    args = parser.parse_args()
    from prefixcache.engine.model_files import model_source

    binary = ensure_built()
    return 1 if sum(compare(binary, model_source(m)) for m in args.model or MODELS) else 0


if __name__ == "__main__":
    sys.exit(main())
