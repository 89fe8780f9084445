"""The Messages API on the real default model: the anthropic SDK, a cached system prompt."""

from __future__ import annotations

import anthropic

from engine_fixtures import assert_pool_clean, default_engine
from prefixcache.protocol.auth import Tenants
from server_fixtures import running_server, wait_idle

SYSTEM = "You are a concise assistant for a bicycle repair shop. Answer in one sentence. " * 3


def test_the_default_model_answers_and_reads_its_system_prompt_from_cache():
    engine = default_engine()
    with running_server(engine, Tenants(None), model_name="smollm2") as (url, state):
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        replies = [
            client.messages.create(
                model="smollm2",
                max_tokens=8,
                system=system,
                messages=[{"role": "user", "content": question}],
                extra_body={"temperature": 0},
            )
            for question in ("How do I fix a flat tyre?", "Why does my chain skip?")
        ]
        first, second = (reply.usage for reply in replies)
        assert replies[0].content[0].text.strip()
        assert first.cache_creation_input_tokens > 0
        assert first.cache_creation.ephemeral_5m_input_tokens == first.cache_creation_input_tokens
        assert second.cache_read_input_tokens >= first.cache_creation_input_tokens
        assert second.cache_creation_input_tokens == 0
        wait_idle(state)
    assert_pool_clean(engine)
