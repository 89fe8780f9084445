"""The asyncio engine: concurrent streams, early close aborts, bad requests raise."""

from __future__ import annotations

import asyncio

import pytest

from engine_fixtures import assert_pool_clean, tiny_engine
from prefixcache.engine import async_engine
from prefixcache.engine.async_engine import COALESCE_PROMPT_TOKENS, AsyncLLMEngine
from prefixcache.engine.sampling import SamplingParams


async def collect(engine: AsyncLLMEngine, request_id: str, prompt: list[int], tokens: int):
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [output async for output in engine.generate(request_id, prompt, params)]


def test_concurrent_streams_grow_and_finish():
    async def main():
        engine = AsyncLLMEngine(tiny_engine())
        engine.start()
        try:
            streams = await asyncio.gather(
                *(collect(engine, f"r{i}", [40 + i, 41, 42], 6) for i in range(5))
            )
        finally:
            engine.shutdown()
        return engine, streams

    engine, streams = asyncio.run(main())
    for stream in streams:
        lengths = [len(output.token_ids) for output in stream]
        assert lengths == sorted(lengths) and lengths[-1] == 6 and stream[-1].finished
    assert_pool_clean(engine.engine)


def test_closing_a_stream_early_aborts_the_request():
    async def main():
        engine = AsyncLLMEngine(tiny_engine())
        engine.start()
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            stream = engine.generate("long", list(range(30, 60)), params)
            async for output in stream:
                if len(output.token_ids) >= 2:
                    break
            await stream.aclose()
            await asyncio.sleep(0.05)
            with pytest.raises(ValueError, match="prompt is empty"):
                await collect(engine, "bad", [], 3)
            rest = await collect(engine, "after", [5, 6, 7], 3)
        finally:
            engine.shutdown()
        return engine, rest

    engine, rest = asyncio.run(main())
    assert rest[-1].finished and len(rest[-1].token_ids) == 3
    assert_pool_clean(engine.engine)


def _first_step_batch(delay: float, length: int, cached: bool = False) -> int:
    """How many requests the first step ran when a second one arrives `delay` s after the
    first, both with `length`-token prompts (the first one's cached before, if `cached`)."""
    batches: list[int] = []

    async def main():
        engine = AsyncLLMEngine(tiny_engine(num_kv_blocks=512))
        step = engine.engine.step

        def recording_step():
            if not batches and recording:
                batches.append(len(engine.engine.requests))
            return step()

        recording = not cached
        engine.engine.step = recording_step
        engine.start()
        try:
            if cached:  # the same prompt but its last token: all but a block's worth is cached
                await collect(engine, "warm", list(range(100, 100 + length - 1)) + [9], 1)
                recording = True

            async def later():
                await asyncio.sleep(delay)
                return await collect(engine, "b", [7] + list(range(100, 100 + length)), 2)

            await asyncio.gather(collect(engine, "a", list(range(100, 100 + length)), 2), later())
        finally:
            engine.shutdown()

    asyncio.run(main())
    return batches[0]


def test_a_long_prompt_waits_a_moment_for_companions_and_a_short_one_does_not(monkeypatch):
    # Windows far wider than the arrivals' gap, so a loaded machine cannot flip the result.
    monkeypatch.setattr(async_engine, "COALESCE_SECONDS", 0.5)
    monkeypatch.setattr(async_engine, "COALESCE_LIMIT_SECONDS", 1.0)
    assert _first_step_batch(0.02, COALESCE_PROMPT_TOKENS) == 2  # one step for the burst
    assert _first_step_batch(0.3, 8) == 1  # a short prompt starts at once


def test_a_long_prompt_whose_prefix_is_cached_starts_at_once(monkeypatch):
    """Little is left to share: it does not wait for companions (5 ms of a cached TTFT)."""
    monkeypatch.setattr(async_engine, "COALESCE_SECONDS", 0.5)
    monkeypatch.setattr(async_engine, "COALESCE_LIMIT_SECONDS", 1.0)
    assert _first_step_batch(0.3, COALESCE_PROMPT_TOKENS + 40, cached=True) == 1
