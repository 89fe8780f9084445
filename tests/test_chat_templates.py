"""Chat templates from the model file or ``--chat-template FILE``: a model without one serves
completions and answers chat with a 400 in each API's shape naming ``--chat-template``;
hostile templates (sandbox escapes, endless loops, huge output) end in one clear line, at
start-up (exit code 2) and per request (a 400, and the server keeps serving)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import anthropic
import gguf
import openai
import pytest

import loopback
from engine_fixtures import default_tokenizer, random_state_dict, tiny_config
from gemma_fixtures import gemma_tokenizer
from prefixcache.cli import run_command
from prefixcache.engine.chat_template import (
    MAX_RANGE,
    MAX_TEMPLATE_CHARS,
    NoChatTemplate,
    TemplateFailed,
)
from prefixcache.engine.engine import EngineConfig, LLMEngine
from prefixcache.engine.model_files import default_model_path, load_tokenizer
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.engine.weights import LoadedModel
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.errors import ApiError
from prefixcache.server.cli import install_chat_template
from prefixcache.server.messages import prepare_messages
from prefixcache.server.prepare import PrepareContext, prepare_chat, prepare_completion
from prefixcache.server.response_store import ResponseStore
from prefixcache.server.responses_api import prepare_responses
from router_fixtures import write_tiny_hf_model
from server_fixtures import running_server, write_key_file

KEY = "sk-alpha"
HELLO = [{"role": "user", "content": "Hello there"}]
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LOOP = "{% for a in [1,2,3,4,5,6,7,8,9,10] %}" * 8 + "{% endfor %}" * 8
# Each refused with the words that say why; none may hang, crash or escape.
HOSTILE = {
    "escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    "globals": ("{{ raise_exception.__globals__['sys'].modules }}", "unsafe"),
    "huge range": ("{% for i in range(10**9) %}x{% endfor %}", f"{MAX_RANGE:,}"),
    "nested loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "CPU time",
    ),
    "nested literal loops": (LOOP, "CPU time"),
    "repeat": ("{{ 'x' * 10**10 }}", "repeated"),
    "power": ("{{ 2 ** 100000000 }}", "too large"),
    "doubling": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "built a value",
    ),
    "width": ("{{ 'x'|center(10**9) }}", "was given"),
    "format width": ("{{ '%999999999d' % 1 }}", "width"),
    "str.format width": ("{{ '{:>999999999}'.format(1) }}", "width"),
    "huge output": ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "output"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed"),
    "rejects": ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    "syntax": ("{% for %}", "does not compile"),
}


def copy_of(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    """The same vocabulary with another chat template (or none)."""
    return Tokenizer(
        tokenizer.backend,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        chat_template=template,
        special_tokens=tokenizer.special_tokens,
    )


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_one_clear_line(name: str) -> None:
    source, reason = HOSTILE[name]
    tokenizer = copy_of(default_tokenizer(), source)
    with pytest.raises(TemplateFailed) as caught:
        tokenizer.apply_chat_template(HELLO)
    message = str(caught.value)
    assert reason in message and "\n" not in message and len(message) < 400, message
    with pytest.raises(TemplateFailed):  # the start-up check refuses it too
        tokenizer.check_chat_template()


def test_rendering_stays_identical_for_the_default_models_template() -> None:
    """Bounded rendering changes nothing a real template writes (test_tokenizer.py compares
    it with transformers); its largest value is far below the caps."""
    ours = default_tokenizer()
    long = [{"role": "user", "content": "word " * 50_000}] * 4
    text = ours.apply_chat_template(long)
    assert len(text) < MAX_TEMPLATE_CHARS and text.count("word ") == 200_000
    ours.check_chat_template()


def test_start_up_check_refuses_templates_that_are_not_chat_templates() -> None:
    tokenizer = copy_of(default_tokenizer(), None)
    with pytest.raises(TemplateFailed, match="content"):
        tokenizer.use_chat_template("just some text, not a template")
    with pytest.raises(TemplateFailed, match="one-message conversation"):
        tokenizer.use_chat_template("{{ messages[0]['content'] }}{{ 'x' * 100000 }}")
    assert tokenizer.chat_template is None  # nothing installed on failure
    tokenizer.use_chat_template(PLAIN)
    assert tokenizer.apply_chat_template(HELLO).startswith("<|im_start|>user\nHello there")


# --- no template --------------------------------------------------------------------------


def template_less_copy(folder: Path) -> Path:
    """The default GGUF rewritten with gguf-py without `tokenizer.chat_template`."""
    reader = gguf.GGUFReader(default_model_path())
    arch = reader.fields["general.architecture"].contents()
    path = folder / "no-template.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "tokenizer.chat_template"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor_info(
            tensor.name,
            tensor.data.shape,
            tensor.data.dtype,
            tensor.data.nbytes,
            tensor.tensor_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return path


def test_a_gguf_without_template_has_no_chat(tmp_path: Path) -> None:
    path = template_less_copy(tmp_path)
    ours = load_tokenizer(path)
    assert ours.chat_template is None
    assert ours.encode("Hello") == default_tokenizer().encode("Hello")
    with pytest.raises(NoChatTemplate, match="--chat-template FILE"):
        ours.apply_chat_template(HELLO)
    ours.check_chat_template()  # nothing to refuse at start-up: completions still serve


@pytest.fixture(scope="module")
def gemma_context() -> PrepareContext:
    """Request preparation on Gemma 3 270M's real vocabulary (a base model: no template)."""
    tokenizer = gemma_tokenizer()
    return PrepareContext(tokenizer, "gemma", 2048, tokenizer.vocab_size, 2048 * 64)


def chat_bodies(model: str) -> dict[str, bytes]:
    user = {"role": "user", "content": "Hello"}
    bodies = {
        "chat": {"model": model, "messages": [user]},
        "messages": {"model": model, "max_tokens": 4, "messages": [user]},
        "responses": {"model": model, "input": "Hello"},
    }
    return {name: json.dumps(body).encode() for name, body in bodies.items()}


def test_gemma_base_model_prepares_completions_and_refuses_chat(
    gemma_context: PrepareContext,
) -> None:
    ctx = gemma_context
    assert ctx.tokenizer.chat_template is None
    body = json.dumps({"model": "gemma", "prompt": "The capital of France is"}).encode()
    prepared = prepare_completion(body, ctx)
    assert prepared.prompts[0][0] == ctx.tokenizer.bos_token_id == 2
    bodies = chat_bodies("gemma")
    prepares = {
        "chat": lambda raw: prepare_chat(raw, ctx),
        "messages": lambda raw: prepare_messages(raw, ctx),
        "responses": lambda raw: prepare_responses(raw, ctx, ResponseStore().view("t")),
    }
    for name, prepare in prepares.items():
        with pytest.raises(ApiError) as caught:
            prepare(bodies[name])
        assert caught.value.status == 400, name
        assert "no chat template" in caught.value.message, name
        assert "--chat-template FILE" in caught.value.message, name


def tiny_model(template: str | None) -> LoadedModel:
    tokenizer = copy_of(default_tokenizer(), template)
    config = tiny_config(tokenizer.vocab_size, tokenizer.eos_token_ids)
    return LoadedModel(config, random_state_dict(config), tokenizer, Path("tiny-random"))


def serve(loaded: LoadedModel, folder: Path):
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_kv_blocks=64))
    return running_server(engine, Tenants.from_file(write_key_file(folder)))


def test_server_without_template_serves_completions_and_400s_chat(tmp_path: Path) -> None:
    with serve(tiny_model(None), tmp_path) as (url, _):
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        done = oa.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
        assert done.usage.completion_tokens == 3
        headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY}
        for name, body in chat_bodies("tiny").items():
            path = {"chat": "chat/completions", "messages": "messages", "responses": "responses"}
            reply = loopback.post(f"{url}/v1/{path[name]}", content=body, headers=headers)
            assert reply.status_code == 400, (name, reply.text)
            error = reply.json()["error"]
            assert "no chat template" in error["message"] and "--chat-template" in error["message"]
            if name == "messages":  # Anthropic's shape
                assert reply.json()["type"] == "error"
                assert error["type"] == "invalid_request_error"
            else:  # OpenAI's
                assert error["type"] == "invalid_request_error" and "code" in error
        with pytest.raises(anthropic.BadRequestError, match="--chat-template"):
            anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
                model="tiny", max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
            )


TRAP = (  # fine, except for a conversation that says "loop"
    "{% for m in messages %}{% if m['content'] == 'loop' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


def test_a_template_that_loops_on_one_request_is_a_400_and_the_server_keeps_serving(
    tmp_path: Path,
) -> None:
    with serve(tiny_model(TRAP), tmp_path) as (url, _):
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            oa.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "loop"}], max_tokens=2
            )
        assert "CPU time" in str(caught.value)
        fine = oa.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert fine.choices[0].finish_reason in ("length", "stop")


def test_chat_template_file_replaces_a_missing_template(tmp_path: Path) -> None:
    loaded = tiny_model(None)
    (tmp_path / "plain.jinja").write_text(PLAIN)
    install_chat_template(loaded, str(tmp_path / "plain.jinja"))
    with serve(loaded, tmp_path) as (url, _):
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        reply = oa.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        prompt = default_tokenizer().encode(
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        )
        assert reply.usage.prompt_tokens == len(prompt)


# --- `prefixcache serve` refuses at start-up ------------------------------------------------


def serve_exit(model: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "prefixcache.cli", "serve", "--model", str(model)]
    return subprocess.run(
        [*command, "--port", "1", *extra], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")


def serve_exit_in_process(model: Path, *extra: str) -> subprocess.CompletedProcess:
    """``serve_exit`` through the same command-line code in this process (no interpreter to
    start: the refusals below come before any server or signal handler)."""
    argv = ["serve", "--model", str(model), "--port", "1", *extra]
    with (
        contextlib.redirect_stdout(io.StringIO()) as out,
        contextlib.redirect_stderr(io.StringIO()) as err,
    ):
        code = run_command(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize(
    ("template", "said", "run"),
    [
        (None, "cannot read it", serve_exit),  # one real process: its exit status and stderr
        ("{% for %}", "does not compile", serve_exit_in_process),
        (HOSTILE["nested loops"][0], "CPU time", serve_exit_in_process),
        (HOSTILE["escape"][0], "unsafe", serve_exit_in_process),
    ],
)
def test_serve_refuses_a_bad_template_file_with_one_line_and_exit_2(
    tiny_folder: Path, tmp_path: Path, template: str | None, said: str, run
) -> None:
    path = tmp_path / "template.jinja"
    if template is not None:
        path.write_text(template)
    result = run(tiny_folder, "--chat-template", str(path))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and said in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_serve_refuses_a_model_whose_own_template_loops(tiny_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "looping"
    folder.mkdir()
    for file in tiny_folder.iterdir():
        (folder / file.name).symlink_to(file)
    config = json.loads((tiny_folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").unlink()
    config["chat_template"] = HOSTILE["nested literal loops"][0]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    result = serve_exit(folder)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "CPU time" in lines[0] and "--chat-template FILE" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
