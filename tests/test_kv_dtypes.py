"""KV cache dtypes (`--kv-cache-dtype`): bfloat16 and int8 pools, against float32."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine_fixtures import assert_pool_clean, default_model, run_to_completion, tiny_engine
from prefixcache.cache.events import BlockStored
from prefixcache.engine import kernels
from prefixcache.engine.attention import gather_context, gather_eager
from prefixcache.engine.engine import EngineConfig, LLMEngine
from prefixcache.engine.kv_quant import dequantize_int8, quantize_int8
from prefixcache.engine.kv_store import KVStore, kv_dtype
from prefixcache.engine.sampling import SamplingParams
from prefixcache.tier import TierValueError, decode_value, encode_value
from prefixcache.tier.seal import TierKeys
from process_fixtures import serve_usage_error

DTYPES = ("float32", "bfloat16", "int8")
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books far faster than scribes. Within fifty years, presses operated in more than two "
    "hundred European cities, and millions of volumes had been printed. The spread of printed "
    "books lowered their price, encouraged literacy, and allowed scholars to compare identical "
    "copies of a text, which in turn supported the rise of modern science."
)
# Nats, on TEXT's 95 scored tokens, from float32 KV (measured: bf16 max 0.072, mean 0.017;
# int8 max 0.215, mean 0.035). bf16 keeps 8 significant bits, a relative error <= 2^-9 per
# K/V value; int8 is off by <= absmax/254 per value, relative to its row's largest, so
# small values lose more. The errors pass through softmax and 30 layers, so no closed form:
# the bounds are ~3x what was measured, room for another thread count's summation order
# (the int4 path alone, lone against batched, moves logprobs by up to 0.05).
DEVIATION_BOUNDS = {"bfloat16": (0.25, 0.05), "int8": (0.6, 0.1)}  # (max, mean)
# Nats, as test_fused_decode.py: a cache hit computes the rest of a prompt in another chunk
# (the fused kernel, or the int4 kernel instead of the dense matmul) than a cold prefill,
# and the int4 path rounds activations to bf16, so logprobs move by a few hundredths
# (measured <= 0.04); an int8 row that lands on a rounding boundary moves by a whole step.
LOGPROB_TOLERANCE = 0.15


def engine_for(kv_cache_dtype: str, caching: bool = True, fused: bool = True) -> LLMEngine:
    """An engine on the real default model (its prebuilt int4 model is shared: cheap)."""
    config = EngineConfig(
        num_kv_blocks=64,
        kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=caching,
        fused_decode=fused,
    )
    return LLMEngine(default_model(), config)


@cache
def text_ids() -> list[int]:
    return default_model().tokenizer.encode(TEXT)


@cache
def prompt_logprobs(kv_cache_dtype: str) -> torch.Tensor:
    """Each of TEXT's tokens' logprob given the ones before it (no cache: one prefill)."""
    engine = engine_for(kv_cache_dtype, caching=False)
    engine.add_request("score", text_ids(), SamplingParams(max_tokens=0, prompt_logprobs=0))
    (output,) = run_to_completion(engine).values()
    return torch.tensor([lp.logprob for lp in output.prompt_logprobs[1:]], dtype=torch.float64)


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[tuple[int, float, float]]]:
    """Per prompt, each greedy step's (token, its logprob, the runner-up's logprob), one
    request after another (later ones hit what earlier ones cached)."""
    steps = []
    for index, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
        engine.add_request(f"g{index}", prompt, params)
        output = run_to_completion(engine)[f"g{index}"].outputs[0]
        steps.append([(lp.token_id, lp.logprob, lp.top[1][1]) for lp in output.logprobs])
    assert_pool_clean(engine)
    return steps


def assert_same_greedy(reference: list, other: list) -> None:
    """Same tokens with close logprobs; a flip only where the reference's top two were a
    coin toss, and nothing compared after it (the texts then differ)."""
    for prompt, (ours, theirs) in enumerate(zip(reference, other, strict=True)):
        for step, ((token, logprob, runner_up), (o_token, o_logprob, _)) in enumerate(
            zip(ours, theirs, strict=True)
        ):
            if o_token != token:
                assert logprob - runner_up < 2 * LOGPROB_TOLERANCE, (prompt, step)
                break
            assert abs(o_logprob - logprob) < LOGPROB_TOLERANCE, (prompt, step)


# --- int8 rows --------------------------------------------------------------------------


@given(
    st.lists(
        st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=False, width=32),
        min_size=1,
        max_size=80,
    )
)
def test_int8_rows_come_back_within_half_a_step(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    packed, _, scale = quantize_int8(x[None])
    back = dequantize_int8(packed)[0]
    absmax = x.abs().max().item()
    assert packed.shape == (1, len(values) + 4) and packed.dtype == torch.uint8
    # half a step of absmax / 127, plus fp32 rounding of the scale and the product
    assert (back - x).abs().max().item() <= absmax / 254 * (1 + 1e-5) + 1e-30
    assert scale.item() == pytest.approx(absmax / 127, rel=1e-6)
    if absmax == 0:
        assert not back.any()


def test_an_int8_store_round_trips_blocks_and_zeroes_to_zero() -> None:
    store = KVStore(2, 4, 4, 2, 8, dtype=torch.int8)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slots = torch.tensor([4, 5, 6, 7, 8, 9])
    k_read, v_read = store.write(1, k, v, slots)
    blocks = torch.tensor([1, 2])
    got_k, got_v = gather_context(store.layers[1], blocks, 6)
    assert torch.equal(got_k, k_read) and torch.equal(got_v, v_read)  # as attention reads
    assert 0 < (k_read - k).abs().max() <= k.abs().amax(-1, keepdim=True).max() / 254 + 1e-6
    payload = store.read_blocks([1])[0].numpy().tobytes()  # a tier payload: codes and scales
    assert len(payload) == 2 * 2 * 4 * 2 * (8 + 4)
    store.write_block(3, payload)
    assert torch.equal(gather_context(store.layers[1], torch.tensor([3]), 4)[0], k_read[:4])
    store.zero_blocks([1])
    assert not gather_context(store.layers[1], torch.tensor([1]), 4)[0].any()


def test_a_bfloat16_store_gives_back_the_rounded_values() -> None:
    store = KVStore(1, 2, 4, 2, 8, dtype=torch.bfloat16)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    k_read, _ = store.write(0, k, v, torch.tensor([0, 1, 2]))
    assert k_read.dtype == torch.float32
    assert torch.equal(k_read, k.to(torch.bfloat16).float()) and not torch.equal(k_read, k)


# --- the pool's size ----------------------------------------------------------------------


def test_a_budget_holds_twice_the_tokens_in_bfloat16_and_more_in_int8() -> None:
    budget = 1 << 20  # tiny model: 2 layers, 2 KV heads of 8, blocks of 4 tokens
    blocks = {
        dtype: tiny_engine(num_kv_blocks=None, kv_cache_bytes=budget, kv_cache_dtype=dtype)
        for dtype in DTYPES
    }
    per_token = {dtype: engine.kv_store.bytes_per_token for dtype, engine in blocks.items()}
    assert per_token == {"float32": 2 * 2 * 2 * 8 * 4, "bfloat16": 128, "int8": 2 * 2 * 2 * 12}
    counts = {dtype: engine.num_blocks for dtype, engine in blocks.items()}
    assert counts["float32"] == budget // (4 * 256)
    assert counts["bfloat16"] == 2 * counts["float32"]
    assert counts["int8"] == budget // (4 * 96)
    for dtype, engine in blocks.items():
        assert engine.kv_store.nbytes <= budget
        assert engine.snapshot.kv_bytes_per_token == per_token[dtype]


def test_the_default_model_takes_46_23_and_12_kb_a_token() -> None:
    per_token = {dtype: engine_for(dtype).kv_store.bytes_per_token for dtype in DTYPES}
    # 30 layers x K and V x 3 KV heads x 64 values (int8: 64 codes and a 4-byte scale)
    assert per_token == {"float32": 46_080, "bfloat16": 23_040, "int8": 12_240}


# --- the model on each dtype -------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_greedy_tokens_equal_with_caching_on_and_off(kv_cache_dtype: str) -> None:
    """Equal, or a flip at a coin toss of the cold run (`assert_same_greedy`)."""
    ids = text_ids()
    prompts = [ids[:60], ids[:60], ids[:40] + ids[70:90]]  # cold, a full hit, a partial hit
    on, off = engine_for(kv_cache_dtype), engine_for(kv_cache_dtype, caching=False)
    assert_same_greedy(greedy(off, prompts), greedy(on, prompts))
    assert on.manager.stats.hits >= 48 + 32  # the repeat and the shared start were hits


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_logprobs_stay_near_float32(kv_cache_dtype: str) -> None:
    deviation = (prompt_logprobs(kv_cache_dtype) - prompt_logprobs("float32")).abs()
    worst, mean = DEVIATION_BOUNDS[kv_cache_dtype]
    assert 0 < deviation.max().item() <= worst  # > 0: the pool really rounds
    assert deviation.mean().item() <= mean


@pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the fused kernel")
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_the_fused_kernel_attends_to_what_the_pool_holds(kv_cache_dtype: str) -> None:
    """The fused decode writes the pool in its dtype and keeps the values as stored in its
    fp32 copy: what it attends to is what a later request reads from the pool."""
    engine = engine_for(kv_cache_dtype)
    engine.add_request("d", text_ids()[:30], SamplingParams(max_tokens=6, temperature=0))
    run_to_completion(engine)
    lone = engine.model.lone
    table, length = torch.tensor(lone.table), lone.length
    assert lone.new_tokens == 1 and length == 35  # the last forward was a fused decode step
    for layer, cache_layer in enumerate(engine.kv_store.layers):
        keys, values = gather_context(cache_layer, table, length)
        assert torch.equal(lone.keys[layer][:, :length], keys.float().transpose(0, 1))
        assert torch.equal(lone.values[layer][:, :length], values.float().transpose(0, 1))


def test_fused_and_eager_decode_agree_under_each_dtype() -> None:
    ids = text_ids()[:40]
    for kv_cache_dtype in ("bfloat16", "int8"):
        fused = greedy(engine_for(kv_cache_dtype), [ids])
        assert_same_greedy(greedy(engine_for(kv_cache_dtype, fused=False), [ids]), fused)


# --- tier, events, command line -------------------------------------------------------


def test_a_replica_of_another_kv_dtype_reads_nothing_from_the_tier(tmp_path) -> None:
    spec = f"disk:{tmp_path / 'tier'}"
    document = list(range(1000, 1041))  # 10 full blocks of 4
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def serve(engine: LLMEngine) -> tuple[list[int], int]:
        engine.add_request("t", document, params)
        (output,) = run_to_completion(engine).values()
        engine.tier.client.flush(timeout=10)
        return output.outputs[0].token_ids, output.num_tier_tokens

    writer = tiny_engine(kv_tier=spec, kv_cache_dtype="bfloat16")
    written, _ = serve(writer)
    writer.close()
    other = tiny_engine(kv_tier=spec, kv_cache_dtype="int8")
    alone = tiny_engine(kv_cache_dtype="int8")
    alone.add_request("t", document, params)
    (reference,) = run_to_completion(alone).values()
    tokens, from_tier = serve(other)
    assert from_tier == 0 and tokens == reference.outputs[0].token_ids  # a miss, recomputed
    stats = other.tier.client.stats
    assert stats.errors == 0 and not stats.rejected and stats.hit_blocks == 0
    other.close()
    again = tiny_engine(kv_tier=spec, kv_cache_dtype="bfloat16")  # the values are still there
    tokens, from_tier = serve(again)
    assert from_tier == 40 and tokens == written
    again.close()


def test_a_value_of_another_kv_dtype_is_refused_not_misread(tmp_path) -> None:
    bf16 = tiny_engine(kv_tier=f"disk:{tmp_path / 'a'}", kv_cache_dtype="bfloat16")
    int8 = tiny_engine(kv_tier=f"disk:{tmp_path / 'b'}", kv_cache_dtype="int8")
    key = TierKeys(bytes(range(32))).current.for_salt(None)
    fmt_bf16, fmt_int8 = bf16.tier.client.fmt, int8.tier.client.fmt
    assert (fmt_bf16.dtype, fmt_int8.dtype) == ("bfloat16", "int8")
    assert "int8[head_dim]+float32_scale" in fmt_int8.layout
    digest = bytes(32)
    value = encode_value(fmt_bf16, digest, 0, bytes(fmt_bf16.payload_bytes), key)
    with pytest.raises(TierValueError) as refused:
        decode_value(fmt_int8, digest, value, key)
    assert refused.value.reason in ("namespace", "dtype")
    for engine in (bf16, int8):
        engine.close()


def test_stored_blocks_name_the_pools_dtype() -> None:
    engine = tiny_engine(kv_cache_dtype="int8")
    events: list = []
    engine.set_event_sink(events.append)
    engine.add_request("e", list(range(1000, 1013)), SamplingParams(max_tokens=1))
    run_to_completion(engine)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and all(e.kv_cache_dtype == "int8" for e in stored)


def test_health_names_the_kv_dtype_and_it_changes_the_namespace() -> None:
    from prefixcache.server.app import replica_identity

    identities = {
        dtype: replica_identity(tiny_engine(kv_cache_dtype=dtype), None) for dtype in DTYPES
    }
    assert [identity["kv_cache_dtype"] for identity in identities.values()] == list(DTYPES)
    assert len({identity["namespace_digest"] for identity in identities.values()}) == 3


def test_a_bad_kv_cache_dtype_is_a_one_line_usage_error() -> None:
    last = serve_usage_error("--kv-cache-dtype", "fp8")
    assert "--kv-cache-dtype" in last and "'fp8'" in last
    assert all(name in last for name in DTYPES)


# --- the native gather ----------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
@given(data=st.data())
def test_the_native_gather_equals_the_torch_path_bit_for_bit(kv_cache_dtype, data) -> None:
    if not kernels.available():
        pytest.fail("the native kernels must build here (make kernels)")
    store = KVStore(1, 6, 16, 2, 8, dtype=kv_dtype(kv_cache_dtype))
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    rows = torch.arange(6 * 16)
    store.write(0, torch.randn(96, 2, 8) * 30, torch.randn(96, 2, 8), rows)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, 5), max_size=8)), dtype=torch.long)
    for which in (0, 1):
        native = torch.ops.prefixcache.gather_kv(store.layers[0], which, ids)
        eager = gather_eager(store.layers[0], which, ids).float()
        assert native.dtype == torch.float32 and native.shape == eager.shape
        assert torch.equal(native.view(torch.int32), eager.view(torch.int32))


def test_the_native_gather_refuses_a_block_outside_the_pool() -> None:
    if not kernels.available():
        pytest.fail("the native kernels must build here (make kernels)")
    store = KVStore(1, 4, 16, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"block id 4 outside 0\.\.3"):
        torch.ops.prefixcache.gather_kv(store.layers[0], 0, torch.tensor([1, 4]))


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_the_native_write_stores_the_same_bits_as_the_torch_path(kv_cache_dtype) -> None:
    if not kernels.available():
        pytest.fail("the native kernels must build here (make kernels)")
    dtype = kv_dtype(kv_cache_dtype)
    native, eager = KVStore(2, 4, 16, 2, 8, dtype=dtype), KVStore(2, 4, 16, 2, 8, dtype=dtype)
    k, v = torch.randn(20, 2, 8) * 40, torch.randn(20, 2, 8)
    k[3] = 0  # a zero row: scale 0, codes 0
    slots = torch.randperm(64)[:20]
    got = native.write_native(1, k, v, slots)
    expected = eager.write_eager(1, k, v, slots)
    assert torch.equal(native.layers[1].view(torch.uint8), eager.layers[1].view(torch.uint8))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert not native.layers[0].any()  # another layer untouched
