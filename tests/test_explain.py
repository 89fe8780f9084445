"""``prefixcache explain``: reuse through a real manager, the first miss and its reason."""

from __future__ import annotations

import json

import pytest

from engine_fixtures import default_tokenizer
from prefixcache.cli import main
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.tools import explain
from prefixcache.tools.explain import DEFAULT_BLOCK_SIZE, build_side
from prefixcache.tools.request_file import parse_request

BASE = list(range(1000, 1040))
SECRET = "Quartz falcon ledger: the vault opens on Thursdays at noon."


@pytest.fixture(autouse=True)
def shared_tokenizer(monkeypatch):
    """The session's tokenizer instead of re-reading the GGUF for every call."""
    monkeypatch.setattr(
        "prefixcache.engine.model_files.load_tokenizer", lambda _=None: default_tokenizer()
    )


def run(tmp_path, capsys, a: dict, b: dict, *options: str) -> tuple[int, str, str]:
    paths = []
    for name, body in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(body))
        paths.append(str(tmp_path / name))
    status = main(["explain", *paths, *options])
    out, err = capsys.readouterr()
    return status, out, err


def test_default_block_size_is_the_engines():
    from prefixcache.engine.engine import EngineConfig

    assert EngineConfig().block_size == DEFAULT_BLOCK_SIZE


def test_one_changed_token_names_block_position_and_ids(tmp_path, capsys):
    changed = BASE[:21] + [7] + BASE[22:]
    status, out, _ = run(tmp_path, capsys, {"token_ids": BASE}, {"token_ids": changed})
    assert status == 0
    assert "reusable: 1 block, 16 tokens of B's 40" in out
    assert "first miss: block 1 (token positions 16-31)" in out
    assert "first differing token: position 21 (block 1, offset 5)" in out
    assert "reason: token ids differ at position 21: A has 1021, B has 7" in out
    assert "| 1021 1022" in out and "| 7 1022" in out


@pytest.mark.parametrize(
    ("b", "block_size", "expected"),
    [
        ({"token_ids": BASE, "cache_salt": "t2"}, 16, "reason: cache_salt differs: only B has one"),
        ({"token_ids": BASE, "lora_name": "x"}, 16, "reason: lora_name differs (None vs 'x')"),
        ({"token_ids": BASE, "namespace": {"model": "m2"}}, 16, "namespaces differ in 'model'"),
        ({"token_ids": BASE[:10]}, 16, "shorter than one block (16)"),
        ({"token_ids": BASE[:32]}, 16, "reason: rule 10 caps the reuse"),
        ({"token_ids": BASE + [5] * 20}, 16, "reason: A has only 2 full blocks (40 tokens)"),
        ({"token_ids": BASE[:30]}, 4, "reusable: 7 blocks, 28 tokens"),
    ],
)
def test_each_reason(tmp_path, capsys, b, block_size, expected):
    status, out, _ = run(tmp_path, capsys, {"token_ids": BASE}, b, "--block-size", str(block_size))
    assert status == 0 and expected in out, out


def test_rule_10_is_named_only_when_it_limits_the_reuse(tmp_path, capsys):
    _, out, _ = run(tmp_path, capsys, {"token_ids": BASE + [1]}, {"token_ids": BASE[:32]})
    assert "rule 10" in out and "without the cap B would reuse 32 tokens" in out
    _, out, _ = run(tmp_path, capsys, {"token_ids": BASE}, {"token_ids": BASE[:35]})
    assert "rule 10" not in out and "first miss: none" in out


def test_text_requests_show_ids_but_no_text_unless_asked(tmp_path, capsys):
    a = {"prompt": SECRET + " When does it close?"}
    b = {"prompt": SECRET + " Whenever it closes?"}
    status, out, _ = run(tmp_path, capsys, a, b)
    assert status == 0 and "tokenization boundary" in out and "token ids around" in out
    for word in ("Quartz", "falcon", "vault", "Thursdays", "When"):
        assert word not in out
    _, shown, _ = run(tmp_path, capsys, a, b, "--show-text")
    assert "' When'" in shown and "' Whenever'" in shown and "pieces" in shown


def test_changed_message_and_prompt_vs_chat(tmp_path, capsys):
    system = {"role": "system", "content": SECRET * 3}
    a = {"messages": [system, {"role": "user", "content": "Open?"}]}
    b = {"messages": [system, {"role": "user", "content": "Closed?"}]}
    _, out, _ = run(tmp_path, capsys, a, b)
    assert "note: messages[1].content differs from character 0" in out
    assert "rendered conversation text differs" in out
    _, out, _ = run(tmp_path, capsys, {"prompt": SECRET}, a)
    assert "A was given as a plain prompt" in out and "chat template" in out
    assert "Quartz" not in out


def test_a_template_that_renders_equal_messages_differently_is_named():
    real = default_tokenizer()
    template = (
        "{{ messages | length }} turns\n"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    tokenizer = Tokenizer(real.backend, chat_template=template)
    first = {"role": "user", "content": SECRET}
    a = build_side("A", parse_request({"messages": [first]}, "a"), tokenizer)
    b = build_side("B", parse_request({"messages": [first, first]}, "b"), tokenizer)
    lines = explain.explain(a, b, 4, tokenizer, show_text=False)
    assert any("a chat template difference" in line for line in lines), lines


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"token_ids": [1, "x"]}', "b.json: field 'token_ids[1]': expected an integer"),
        ("{", "b.json: not valid JSON"),
        ('{"prompt": "x", "token_ids": [1]}', "give one (found token_ids and prompt)"),
        ('{"messages": [{"role": "user"}]}', "field 'messages[0].content': expected a string"),
        ('{"token_ids": [1], "cache_salt": 3}', "field 'cache_salt': expected a string or null"),
        ('{"token_ids": [1], "salt": "x"}', "field 'salt' is unknown"),
        ("[1, 2]", "b.json: expected a JSON object, got list"),
    ],
)
def test_bad_files_get_one_line_naming_file_and_field(tmp_path, capsys, content, message):
    (tmp_path / "a.json").write_text(json.dumps({"token_ids": BASE}))
    (tmp_path / "b.json").write_text(content)
    status = main(["explain", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    out, err = capsys.readouterr()
    assert status == 2 and not out
    assert message in err and err.count("\n") == 1, err
