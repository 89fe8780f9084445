"""The engine's grammar mask on the tiny random model: whatever it samples, the output parses.

A random model puts no weight on JSON, so every valid document it writes is the mask's work.
"""

from __future__ import annotations

import json
from enum import StrEnum

import pytest
from pydantic import BaseModel, ConfigDict, Field

from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.engine.sampling import SamplingParams
from prefixcache.protocol.constraints import JsonOutput, ToolCalls, ToolSpec, canonical_json


class Color(StrEnum):
    RED = "red"
    GREEN = "green"


class Point(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: int = Field(ge=-99, le=99)
    label: str = Field(max_length=6)


class Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")
    color: Color
    points: list[Point] = Field(max_length=3)
    closed: bool
    origin: Point


SHAPE = JsonOutput(canonical_json(Shape.model_json_schema()))
PROMPT = list(range(20, 32))


def _params(**options: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 300, "temperature": 1.0, **options})


@pytest.mark.parametrize("seed", range(4))
def test_constrained_output_validates_against_the_schema(seed: int) -> None:
    engine = tiny_engine()
    engine.add_request("r", PROMPT, _params(seed=seed, constraint=SHAPE))
    final = run_to_completion(engine)["r"]
    assert final.outputs[0].finish_reason == "stop"
    Shape.model_validate_json(final.text)
    assert_pool_clean(engine)
    assert engine.num_constrained == 0


def test_n_2_each_branch_follows_its_own_matcher() -> None:
    engine = tiny_engine()
    engine.add_request("r", PROMPT, _params(seed=5, n=2, constraint=SHAPE))
    final = run_to_completion(engine)["r"]
    assert [o.finish_reason for o in final.outputs] == ["stop", "stop"]
    for output in final.outputs:
        Shape.model_validate_json(output.text)
    assert final.outputs[0].text != final.outputs[1].text
    assert_pool_clean(engine)


def test_any_json_object_starts_an_object() -> None:
    engine = tiny_engine()
    engine.add_request("r", PROMPT, _params(seed=2, max_tokens=8, constraint=JsonOutput(None)))
    final = run_to_completion(engine)["r"]
    assert final.text.startswith("{")


def test_max_tokens_inside_the_json_is_length() -> None:
    engine = tiny_engine()
    engine.add_request("r", PROMPT, _params(seed=1, max_tokens=3, constraint=SHAPE))
    final = run_to_completion(engine)["r"]
    assert final.outputs[0].finish_reason == "length"
    assert len(final.token_ids) == 3 and final.text.startswith('{"')


def test_free_rows_get_the_tokens_of_a_run_without_constrained_ones() -> None:
    free = [list(range(40 + i, 50 + 2 * i)) for i in range(3)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = tiny_engine()
    for i, prompt in enumerate(free):
        alone.add_request(f"free{i}", prompt, greedy)
    expected = {k: v.token_ids for k, v in run_to_completion(alone).items()}
    mixed = tiny_engine()
    for i, prompt in enumerate(free):
        mixed.add_request(f"c{i}", prompt, _params(seed=i, constraint=SHAPE))
        mixed.add_request(f"free{i}", prompt, greedy)
    finals = run_to_completion(mixed)
    assert {k: finals[k].token_ids for k in expected} == expected
    for i in range(3):
        Shape.model_validate_json(finals[f"c{i}"].text)


def test_matcher_survives_preemption() -> None:
    engine = tiny_engine(num_kv_blocks=24)
    for i in range(4):
        engine.add_request(f"r{i}", PROMPT[: 8 + i], _params(seed=i, constraint=SHAPE))
    finals = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    for final in finals.values():
        if final.outputs[0].finish_reason == "stop":
            Shape.model_validate_json(final.text)
    assert_pool_clean(engine)


def test_required_tool_call_is_one_call_to_a_named_tool() -> None:
    weather = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}}
    weather["required"] = ["unit"]
    weather["additionalProperties"] = False
    tools = (ToolSpec("get_weather", canonical_json(weather)),)
    engine = tiny_engine()
    constraint = ToolCalls(tools, "required", parallel=False)
    engine.add_request("r", PROMPT, _params(seed=3, constraint=constraint))
    text = run_to_completion(engine)["r"].text.strip()
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["name"] == "get_weather" and call["arguments"]["unit"] in ("c", "f")


def test_a_bad_schema_is_a_value_error_naming_it() -> None:
    engine = tiny_engine()
    bad = JsonOutput(canonical_json({"type": "string", "format": "no-such-format"}))
    with pytest.raises(ValueError, match="no-such-format"):
        engine.add_request("r", PROMPT, _params(constraint=bad))
    assert not engine.requests


def test_logprobs_are_the_raw_distributions() -> None:
    """Raw logits, before the mask (a random model ranks most grammar tokens low)."""
    engine = tiny_engine()
    engine.add_request("r", PROMPT, _params(seed=4, logprobs=2, constraint=SHAPE))
    final = run_to_completion(engine)["r"]
    entries = final.outputs[0].logprobs
    assert [e.token_id for e in entries] == final.token_ids
    assert all(e.logprob < 0 and len(e.top) == 2 for e in entries)
    # a raw top token is mostly one the grammar forbids: the mask did not touch the values
    assert any(e.rank > 2 for e in entries)
