"""Shared builders for engine tests: a tiny random Llama with the real tokenizer."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import torch

from hf_fixtures import transformers_gguf_once
from prefixcache.engine.config import ModelConfig
from prefixcache.engine.engine import EngineConfig, LLMEngine
from prefixcache.engine.model_files import load_tokenizer
from prefixcache.engine.models import build_model
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.engine.weights import LoadedModel, load_model
from prefixcache.tier.seal import TierKeys


@cache
def default_model() -> LoadedModel:
    """The real default model, loaded once per test session."""
    return load_model()


@cache
def default_tokenizer() -> Tokenizer:
    """The default model's tokenizer alone, once per session: no weights are read."""
    return load_tokenizer()


@cache
def _shared_default_engine(quantized: bool, caching: bool) -> LLMEngine:
    config = EngineConfig(
        num_kv_blocks=256, quantized_weights=quantized, enable_prefix_caching=caching
    )
    return LLMEngine(default_model(), config)


def default_engine(quantized: bool = True, caching: bool = True) -> LLMEngine:
    """An engine on the real default model, built once per session for each kind (a build
    copies the weights and packs them to int4: seconds), handed out as new: no request, every
    block free, nothing cached. Its stats count on: compare them before and after."""
    engine = _shared_default_engine(quantized, caching)
    assert_pool_clean(engine)
    engine.manager.reset()
    return engine


@cache
def default_reference() -> torch.nn.Module:
    """transformers' own model of the default GGUF, dequantized to float32, loaded once per
    session (its GGUF loader takes ~20 s, ~7 s without its repeated work: hf_fixtures.py):
    the reference the exactness tests compare with."""
    from transformers import AutoModelForCausalLM

    path = default_model().source
    with transformers_gguf_once():
        reference = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return reference.eval()


def tiny_config(vocab_size: int, eos: tuple[int, ...]) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=50000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_ids=eos,
        name="tiny-random",
    )


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face Llama names, scaled to keep activations sane."""
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) / shape[-1] ** 0.5

    hidden, heads, kv = config.hidden_size, config.num_heads, config.num_kv_heads
    state = {"model.embed_tokens.weight": weight(config.vocab_size, hidden) * 4}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        state[prefix + "self_attn.q_proj.weight"] = weight(heads * config.head_dim, hidden)
        state[prefix + "self_attn.k_proj.weight"] = weight(kv * config.head_dim, hidden)
        state[prefix + "self_attn.v_proj.weight"] = weight(kv * config.head_dim, hidden)
        state[prefix + "self_attn.o_proj.weight"] = weight(hidden, heads * config.head_dim)
        state[prefix + "mlp.gate_proj.weight"] = weight(config.intermediate_size, hidden)
        state[prefix + "mlp.up_proj.weight"] = weight(config.intermediate_size, hidden)
        state[prefix + "mlp.down_proj.weight"] = weight(hidden, config.intermediate_size)
        state[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        state[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
    state["model.norm.weight"] = torch.ones(hidden)
    return state


def tiny_model() -> LoadedModel:
    """A 2-layer random model that speaks the default model's tokenizer."""
    tokenizer = default_tokenizer()
    config = tiny_config(tokenizer.vocab_size, tokenizer.eos_token_ids)
    return LoadedModel(config, random_state_dict(config), tokenizer, Path("tiny-random"))


@cache
def tiny_gemma_model() -> LoadedModel:
    """A 3-layer random Gemma 3 (two window layers of 8 tokens, then a full one) that speaks
    the default model's tokenizer: a hybrid pool of 1 full and 2 window groups of 1 layer."""
    tokenizer = default_tokenizer()
    config = replace(
        tiny_config(tokenizer.vocab_size, tokenizer.eos_token_ids),
        num_layers=3,
        name="tiny-random-gemma3",
        architecture="gemma3",
        qk_norm=True,
        sliding_window=8,
        window_layers=(True, True, False),
    )
    generator = torch.Generator().manual_seed(1)
    targets = build_model(config).weight_targets()
    state = {name: torch.randn(*target.shape, generator=generator) / target.shape[-1] ** 0.5
             for name, target in targets.items()}  # fmt: skip
    return LoadedModel(config, state, tokenizer, Path("tiny-random-gemma3"))


TEST_TIER_KEYS = TierKeys(bytes(range(32)))


def tiny_engine(model: LoadedModel | None = None, **options: object) -> LLMEngine:
    """An engine on the tiny model in float64, so batching can't flip a greedy choice.

    With a tier, fetches may take up to 5 s unless a test says otherwise: the tiny model's
    compute is so cheap that the real deadline would make tier hits depend on the load.
    """
    settings = {"block_size": 4, "num_kv_blocks": 64, "dtype": torch.float64, **options}
    if "kv_tier" in options and "kv_tier_max_wait" not in options:
        settings.update(kv_tier_max_wait=5.0, kv_tier_min_wait=5.0)
    if "kv_tier" in options:  # one tenant secret for the whole suite, as in a deployment
        settings.setdefault("tier_keys", TEST_TIER_KEYS)
    return LLMEngine(model or tiny_model(), EngineConfig(**settings))


def run_to_completion(engine: LLMEngine) -> dict:
    """Step until every request finishes; the final output of each, by request id."""
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def serve_in_turn(engine: LLMEngine, prompts: list[list[int]], params, prefix: str = "r") -> list:
    """Run prompts one at a time, each after the last one's tier writes landed."""
    outputs = []
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{index}", prompt, params)
        outputs.append(run_to_completion(engine)[f"{prefix}{index}"])
        if engine.tier is not None:
            assert engine.tier.client.flush(timeout=10)
    return outputs


def assert_pool_clean(engine: LLMEngine) -> None:
    """No request left, every block free, and the cache's invariants hold."""
    assert not engine.requests
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.manager.num_free_blocks == engine.manager.num_blocks
    engine.manager.check_invariants()
