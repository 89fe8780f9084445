"""The fused lone decode (engine/fused_decode.py, kernels/) against the eager layers it replaces."""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import assert_pool_clean, default_engine, default_tokenizer, run_to_completion
from prefixcache.engine import kernels
from prefixcache.engine.compute_threads import release_pool
from prefixcache.engine.fused_decode import MAX_FUSED_ROWS, FusedWeights, fused_applies
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.weight_types.packed_weight import row_limits

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Write a haiku about the sea.",
)
# Nats. On the GGUF blocks (where the decoders are vectorized) both paths run the same
# projections and differ only in the order of the norms' and attention's fp32 sums: measured
# 7e-6 over 3 prompts x 24 steps, lone and staggered, with fp32 activations. With the default
# int16 activations those differences flip a few roundings of the activations to 15-bit
# codes, which grow over 30 layers and the steps: measured up to 1.02e-3, so 5e-3. On torch's
# int4 kernel every projection is rounded to bf16, the same way: the eager path itself, lone
# against batched, differs by up to 0.05.
LOGPROB_TOLERANCE = 5e-3 if kernels.simd_decoders() else 0.15


def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=2)


def _run(fused: bool, requests: list[tuple[str, list[int], int]], stagger: int = 0) -> dict:
    """Per request, each step's (token, its logprob, the runner-up's logprob); the later
    requests join `stagger` steps after the first."""
    engine = default_engine()
    engine.config.fused_decode = fused
    try:
        first, *rest = requests
        engine.add_request(first[0], first[1], _greedy(first[2]))
        finals = {}
        for _ in range(stagger):
            for output in engine.step():
                finals[output.request_id] = output
        for request_id, prompt, tokens in rest:
            engine.add_request(request_id, prompt, _greedy(tokens))
        finals.update(run_to_completion(engine))
        assert_pool_clean(engine)
    finally:
        engine.config.fused_decode = True
    return {
        rid: [(lp.token_id, lp.logprob, lp.top[1][1]) for lp in out.outputs[0].logprobs]
        for rid, out in finals.items()
    }


def _assert_same(fused: dict, eager: dict) -> None:
    """Same tokens with close logprobs, up to a step where eager's top two are a near tie."""
    assert fused.keys() == eager.keys()
    for rid, steps in eager.items():
        for i, ((token, logprob, runner_up), (f_token, f_logprob, _)) in enumerate(
            zip(steps, fused[rid], strict=True)
        ):
            if f_token != token:  # a flip is only allowed where the choice was a coin toss
                assert logprob - runner_up < 2 * LOGPROB_TOLERANCE, (rid, i)
                assert i >= 4, (rid, i)
                break
            assert abs(f_logprob - logprob) < LOGPROB_TOLERANCE, (rid, i, f_logprob, logprob)


def test_the_native_kernels_load_and_the_default_model_decodes_fused() -> None:
    assert kernels.available(), "the native kernels did not build or load (see the log)"
    assert kernels.library_path().exists()
    engine = default_engine()
    assert fused_applies(engine.model, engine.kv_store)


def test_a_lone_decode_gives_the_eager_tokens_and_logprobs() -> None:
    tokenizer = default_tokenizer()
    requests = [(f"r{i}", tokenizer.encode(p), 40) for i, p in enumerate(PROMPTS)]
    for request in requests:  # one at a time: every decode step is lone
        _assert_same(_run(True, [request]), _run(False, [request]))


def _sequential(fused: bool, prompts: list[list[int]], tokens: int) -> dict:
    """`_run` for each prompt after the previous one finished, on one engine (cache kept)."""
    engine = default_engine()
    engine.config.fused_decode = fused
    results = {}
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"s{i}", prompt, _greedy(tokens))
            for rid, out in run_to_completion(engine).items():
                results[rid] = [
                    (lp.token_id, lp.logprob, lp.top[1][1]) for lp in out.outputs[0].logprobs
                ]
        hits = engine.manager.stats.hits
        assert_pool_clean(engine)
    finally:
        engine.config.fused_decode = True
    assert hits > 0  # the later prompts found the shared prefix cached
    return results


def test_a_short_suffix_after_a_cached_prefix_runs_fused_with_the_eager_numbers() -> None:
    tokenizer = default_tokenizer()
    # ~150 prefix tokens: a 5-token suffix (x its context) takes the SDPA branch (>= 512)
    prefix = tokenizer.encode("A list of facts about the planets of the solar system. " * 12)
    prompts = [prefix + tokenizer.encode(q) for q in (" Mars is", " Jupiter has", " Venus")]
    assert all(len(p) - len(prefix) <= MAX_FUSED_ROWS for p in prompts)
    _assert_same(_sequential(True, prompts, 16), _sequential(False, prompts, 16))


def test_a_long_context_decode_takes_the_sdpa_branch_with_the_eager_numbers() -> None:
    tokenizer = default_tokenizer()
    prompt = tokenizer.encode("Notes on the history of printing, chapter by chapter. " * 50)
    assert len(prompt) >= 512  # every decode step: 1 token x >= 512 keys, the SDPA branch
    request = [("long", prompt, 12)]
    _assert_same(_run(True, request), _run(False, request))


def test_a_decode_that_turns_lone_after_a_batch_rebuilds_its_copy_the_same_way() -> None:
    tokenizer = default_tokenizer()
    long, short = tokenizer.encode(PROMPTS[0]), tokenizer.encode(PROMPTS[1])
    # `a` decodes alone, then beside `b` (paged attention), then alone again from the pool
    requests = [("a", long, 48), ("b", short, 12)]
    fused, eager = _run(True, requests, stagger=6), _run(False, requests, stagger=6)
    _assert_same(fused, eager)


def _call_op(engine, keys: torch.Tensor, length: int, norms=None, types=None, windows=(0,)):
    layer = engine.model.layers[0]
    layer_norms = layer.fused_norms()
    w = FusedWeights((layer.qkv, layer.o, layer.gate_up, layer.down), layer_norms)
    rope = [torch.zeros(1, 64)] * 4
    torch.ops.prefixcache.decode_layers(
        torch.zeros(1, 576), layer_norms if norms is None else norms, w.packed, w.pairs,
        w.types if types is None else types, w.counts, w.biases, *rope, list(windows), [keys],
        [keys.clone()], [engine.kv_store.layers[0]], length, [torch.tensor([[0, 16]])],
        layer.num_heads, layer.num_kv_heads, layer.eps, layer.scale, False, *row_limits(),
    )  # fmt: skip


def test_the_op_names_what_it_refuses() -> None:
    assert kernels.available()
    engine = default_engine()
    with pytest.raises(RuntimeError, match=r"length 9 outside 1\.\.8"):
        _call_op(engine, torch.zeros(3, 8, 64), 9)
    with pytest.raises(RuntimeError, match=r"keys, values must be \[3, capacity, 64\]"):
        _call_op(engine, torch.zeros(2, 8, 64), 1)
    with pytest.raises(RuntimeError, match="2, 4 or 6 norms a layer"):
        _call_op(engine, torch.zeros(3, 8, 64), 1, norms=[])
    with pytest.raises(RuntimeError, match="per layer: its norms, 4 projections"):
        _call_op(engine, torch.zeros(3, 8, 64), 1, windows=())
    with pytest.raises(RuntimeError, match="layer 0: window -1 < 0"):
        _call_op(engine, torch.zeros(3, 8, 64), 1, windows=(-1,))
    if kernels.simd_decoders():  # the layers run on their GGUF blocks: each type is checked
        with pytest.raises(RuntimeError, match="unsupported GGML type 99"):
            _call_op(engine, torch.zeros(3, 8, 64), 1, types=[99, 99, 99, 99])
        with pytest.raises(RuntimeError, match="blocks must be contiguous uint8"):
            _call_op(engine, torch.zeros(3, 8, 64), 1, types=[8, 8, 8, 8])  # Q8_0: wider rows


def test_releasing_this_threads_openmp_pool_leaves_torch_computing() -> None:
    a = torch.randn(512, 512)
    expected = a @ a
    assert release_pool()  # torch's libgomp is loaded and knows OpenMP 5's pause
    assert torch.equal(a @ a, expected)  # the pool comes back on the next parallel op
    assert release_pool()
