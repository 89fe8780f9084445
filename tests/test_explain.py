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


# ------------------------------------------------------------------ window layers (issue 35)
ANSWERED = list(range(2000, 2060))  # a 40-token prompt, then a 20-token answer
WINDOWED = ("--block-size", "4", "--window", "8")  # a hit of L reads tokens L-7 .. L-1


def test_a_window_caused_miss_names_what_each_group_held(tmp_path, capsys):
    b = {"token_ids": ANSWERED[:50] + [7] * 5}  # differs at 50: the full layers hold 48
    status, out, _ = run(tmp_path, capsys, {"token_ids": ANSWERED}, b, *WINDOWED,
                         "--answer-tokens", "20")  # fmt: skip
    assert status == 0, out
    assert "no memory pressure (A's stale window pages still cached): B reuses 48 tokens" in out
    # kept: the window before the prompt's end (blocks 8-9) and the answer's (blocks 13-14)
    assert "window pages kept for tokens 32-39, 52-59): B reuses 40 tokens" in out
    assert (
        "window-caused miss: full layers held 48 tokens; window layers held the window before "
        "40 (tokens 33-39), not the one before 48; B reuses 40 tokens under pressure: only its "
        "15 tokens after 40 are recomputed, not the whole prompt"
    ) in out
    _, plain, _ = run(tmp_path, capsys, {"token_ids": ANSWERED}, b, "--block-size", "4")
    assert "window" not in plain and out.startswith(plain)  # no window: the report as before


def test_without_the_answers_window_the_whole_prompt_is_recomputed(tmp_path, capsys):
    b = {"token_ids": ANSWERED[:50] + [7] * 5}
    _, out, _ = run(tmp_path, capsys, {"token_ids": ANSWERED}, b, *WINDOWED)
    assert "window pages kept for tokens 52-59): B reuses 0 tokens" in out
    assert (
        "full layers held 48 tokens; window layers held none of the window before 48 (tokens "
        "41-47) nor of any earlier one; B reuses 0 tokens under pressure: all 55 tokens"
    ) in out


def test_a_follow_up_of_the_whole_answer_has_no_window_caused_miss(tmp_path, capsys):
    b = {"token_ids": ANSWERED + [7] * 5}
    _, out, _ = run(tmp_path, capsys, {"token_ids": ANSWERED}, b, *WINDOWED,
                    "--answer-tokens", "20")  # fmt: skip
    assert "reusable: 15 blocks, 60 tokens" in out
    assert "kept for tokens 32-39, 52-59): B reuses 60 tokens" in out
    assert "window-caused miss: none: the kept windows serve B's whole 60-token hit" in out


def test_the_window_comes_from_a_gemma_models_metadata(tmp_path, capsys):
    from gemma_fixtures import gemma_file
    from prefixcache.engine.model_files import sliding_window

    assert sliding_window(None) == 0  # SmolLM2: every layer is full
    a = {"token_ids": list(range(1000, 1000 + 1600))}
    b = {"token_ids": a["token_ids"][:1300] + [7]}
    _, out, _ = run(tmp_path, capsys, a, b, "--model", str(gemma_file()))
    assert "window layers (512 tokens" in out
    assert "full layers held 1,296 tokens" in out and "B reuses 0 tokens under pressure" in out
    _, out, _ = run(tmp_path, capsys, a, b, "--model", str(gemma_file()), "--window", "0")
    assert "window" not in out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--window", "-1"], "--window -1 must be >= 1 token (0: no window layers)"),
        (["--answer-tokens", "3"], "--answer-tokens only matters with a window"),
        (["--window", "8", "--answer-tokens", "40"], "--answer-tokens 40 must be below A's 40"),
        (["--window", "8", "--answer-tokens", "-2"], "--answer-tokens -2 must be >= 0"),
    ],
)
def test_bad_window_options_get_one_line_naming_the_limit(tmp_path, capsys, options, message):
    status, out, err = run(tmp_path, capsys, {"token_ids": BASE}, {"token_ids": BASE}, *options)
    assert status == 2 and not out
    assert message in err and err.count("\n") == 1, err


def test_a_window_that_is_not_a_number_is_refused_by_argparse(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run(tmp_path, capsys, {"token_ids": BASE}, {"token_ids": BASE}, "--window", "wide")
    assert exit_.value.code == 2
    assert "argument --window: invalid int value: 'wide'" in capsys.readouterr().err
