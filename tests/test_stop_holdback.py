"""Stop strings never leak: held-back text, random stop sets, streamed == non-streamed."""

from __future__ import annotations

import json
import random

import pytest

import loopback
from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.stop_holdback import releasable_length, visible_tokens
from prefixcache.protocol.auth import Tenants
from server_fixtures import running_server, wait_idle


@pytest.mark.parametrize(
    ("text", "stops", "shown"),
    [
        ("1. 1\n2. 2\n3. 3\n4. ", ["4. 4"], "1. 1\n2. 2\n3. 3\n"),
        ("abc", ["xyz"], "abc"),
        ("abcx", ["xyz", "cxq"], "ab"),
        ("ab", ["abc"], ""),
        ("", ["abc"], ""),
        ("aaa", ["aab"], "a"),
    ],
)
def test_text_that_may_start_a_stop_string_is_held_back(text, stops, shown):
    assert text[: releasable_length(text, stops)] == shown


def test_a_token_straddling_the_cut_is_visible_and_later_ones_are_not():
    # tokens "ab", "c|d", "ef": the text was cut at 3 (inside the second token)
    assert visible_tokens([2, 4, 6], 3) == 2
    assert visible_tokens([2, 4, 6], 6) == 3
    assert visible_tokens([0, 0, 2], 0) == 2  # empty tokens before the cut count


def _random_stops(rng: random.Random, text: str) -> list[str]:
    """Stop strings that often match: substrings of the text the request will produce."""
    stops = []
    for _ in range(rng.randrange(1, 5)):
        if text and rng.random() < 0.8:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randrange(1, 9)])
        else:
            stops.append("".join(rng.choice("ab .\n1") for _ in range(rng.randrange(1, 5))))
    return [s for s in stops if s] or ["zz"]


def test_engine_snapshots_never_show_a_stop_string_on_random_stop_sets():
    engine = tiny_engine(num_kv_blocks=256)
    rng = random.Random(13)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[rng.randrange(100, 5000) for _ in range(rng.randrange(3, 12))] for _ in range(40)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"free{i}", prompt, greedy)
    free = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        stops = _random_stops(rng, free[f"free{i}"].text)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stops)
        engine.add_request(f"stop{i}", prompt, params)
        snapshots = []
        while engine.has_unfinished_requests():
            snapshots += [o.text for o in engine.step()]
        final = snapshots[-1]
        assert all(stop not in final for stop in stops)
        assert all(final.startswith(shown) for shown in snapshots), (stops, snapshots)
    assert_pool_clean(engine)


def _stream_text(url: str, body: dict) -> str:
    pieces = []
    with loopback.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice.get("delta", {}).get("content")
                    pieces.append(choice.get("text") or delta or "")
    return "".join(pieces)


def test_streamed_equals_non_streamed_byte_for_byte_on_random_stop_sets():
    engine = tiny_engine(num_kv_blocks=256)
    rng = random.Random(7)
    with running_server(engine, Tenants(None)) as (url, state):
        for i in range(24):
            chat = i % 2 == 0
            endpoint = url + ("/v1/chat/completions" if chat else "/v1/completions")
            body = {"model": "tiny", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
            if chat:
                body["messages"] = [{"role": "user", "content": f"count with me {i}"}]
            else:
                body["prompt"] = f"Numbers {i}: 1. 1\n2. 2\n"
            free = loopback.post(endpoint, json=body, timeout=60).json()["choices"][0]
            text = free["message"]["content"] if chat else free["text"]
            body["stop"] = _random_stops(rng, text)
            whole = loopback.post(endpoint, json=body, timeout=60).json()["choices"][0]
            whole = whole["message"]["content"] if chat else whole["text"]
            assert _stream_text(endpoint, body) == whole
            assert not any(stop in whole for stop in body["stop"])
        wait_idle(state)
    assert_pool_clean(engine)
