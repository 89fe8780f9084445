"""LlamaModel over paged KV blocks must give Hugging Face's logits in every batch shape."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers

from prefixcache.engine import attention
from prefixcache.engine.attention import AttentionMetadata
from prefixcache.engine.config import ModelConfig
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.models.llama import LlamaModel

BLOCK = 4
NUM_BLOCKS = 96
VOCAB = 300
ATOL = 1e-4


@dataclass
class Pair:
    """The same random weights as a Hugging Face model and as ours."""

    hf: transformers.LlamaForCausalLM
    ours: LlamaModel
    config: ModelConfig


def _hf_config(tied: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=31337.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32,  # small on purpose: the RoPE table must grow past it
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )


def _model_config(hf: transformers.LlamaConfig) -> ModelConfig:
    return ModelConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        rope_theta=hf.rope_parameters["rope_theta"],
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=hf.tie_word_embeddings,
    )


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def pair(request: pytest.FixtureRequest) -> Pair:
    return make_pair(tied=request.param)


def make_pair(tied: bool) -> Pair:
    """Random HF weights (seeded) and our model loaded from them."""
    torch.manual_seed(1234)
    hf_config = _hf_config(tied=tied)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # larger than HF's 0.02 init, so attention is far from uniform
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.25 * torch.randn_like(p))
    config = _model_config(hf_config)
    ours = LlamaModel(config)
    ours.load_weights(hf.state_dict())
    return Pair(hf, ours, config)


def hf_logits(pair: Pair, tokens: list[int]) -> torch.Tensor:
    """Reference logits for every position of `tokens`."""
    with torch.no_grad():
        return pair.hf(torch.tensor([tokens])).logits[0]


@dataclass
class Seq:
    tokens: list[int]
    block_table: list[int]
    computed: int = 0


class Runner:
    """Drives our model like an engine would, with hand-assigned, shuffled block ids."""

    def __init__(self, pair: Pair, seed: int = 0, num_blocks: int = NUM_BLOCKS) -> None:
        self.model = pair.ours
        c = pair.config
        dtype = pair.ours.dtype
        self.store = KVStore(c.num_layers, num_blocks, BLOCK, c.num_kv_heads, c.head_dim, dtype)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.metadata: AttentionMetadata | None = None  # of the last forward

    def new_seq(self, tokens: list[int], shared: list[int] = (), computed: int = 0) -> Seq:
        """A sequence whose table starts with the `shared` blocks; fresh blocks cover the rest."""
        need = -(-len(tokens) // BLOCK) - len(shared)
        table = list(shared) + [self.free.pop() for _ in range(need)]
        return Seq(list(tokens), table, computed)

    def append(self, seq: Seq, tokens: list[int]) -> None:
        """Extend `seq` by `tokens`, with fresh blocks when they spill past its table."""
        seq.tokens += tokens
        need = -(-len(seq.tokens) // BLOCK) - len(seq.block_table)
        seq.block_table += [self.free.pop() for _ in range(need)]

    def step(self, batch: list[tuple[Seq, int]], **build_options: Any) -> list[torch.Tensor]:
        """One forward computing `n` more tokens of each sequence; their logits, per sequence.

        `build_options` go to `AttentionMetadata.build` (e.g. cascade thresholds).
        """
        logits = self.forward(batch, **build_options)
        for s, n in batch:
            s.computed += n
        return logits

    def forward(self, batch: list[tuple[Seq, int]], **build_options: Any) -> list[torch.Tensor]:
        """`step` without advancing the sequences (it rewrites the same K/V if repeated)."""
        query_lens = [n for _, n in batch]
        context_lens = [s.computed + n for s, n in batch]
        md = AttentionMetadata.build(
            query_lens, context_lens, [s.block_table for s, _ in batch], BLOCK, **build_options
        )
        self.metadata = md
        ids = [t for s, n in batch for t in s.tokens[s.computed : s.computed + n]]
        hidden = self.model(torch.tensor(ids), md.positions, md, self.store)
        return list(self.model.compute_logits(hidden).split(query_lens))


def _tokens(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(VOCAB), k=n)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max abs error {err}"


# --- logits against Hugging Face -------------------------------------------------------------


def test_reference_logits_are_not_trivial(pair: Pair) -> None:
    ref = hf_logits(pair, _tokens(12, 0))
    assert ref.std().item() > 0.5, "random weights too small for a 1e-4 check to mean much"


def test_full_prefill(pair: Pair) -> None:
    runner = Runner(pair)
    seq = runner.new_seq(_tokens(37, 1))  # past max_position_embeddings: RoPE table grows
    (logits,) = runner.step([(seq, 37)])
    _close(logits, hf_logits(pair, seq.tokens))


def test_prefix_hit_prefills_only_the_suffix(pair: Pair) -> None:
    runner = Runner(pair, seed=1)
    prefix = _tokens(12, 2)
    first = runner.new_seq(prefix + _tokens(5, 3))
    runner.step([(first, len(first.tokens))])
    second = runner.new_seq(prefix + _tokens(9, 4), shared=first.block_table[:3], computed=12)
    assert second.block_table != sorted(second.block_table)
    (logits,) = runner.step([(second, 9)])
    _close(logits, hf_logits(pair, second.tokens)[12:])


def test_chunked_prefill(pair: Pair) -> None:
    runner = Runner(pair, seed=2)
    seq = runner.new_seq(_tokens(23, 5))
    ref = hf_logits(pair, seq.tokens)
    for chunk in (5, 7, 1, 4, 6):  # boundaries off the block grid, one single-token chunk
        start = seq.computed
        (logits,) = runner.step([(seq, chunk)])
        _close(logits, ref[start : start + chunk])


def test_a_long_chunk_after_a_prefix_attends_in_two_parts(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of >= MIN_SPLIT_QUERIES new tokens after computed ones attends to its prefix
    unmasked and to its own tokens causally, merged by log-sum-exp (lowered here so that a
    tiny chunk takes it): the same logits as HF, and as the one-mask path."""
    monkeypatch.setattr(attention, "MIN_SPLIT_QUERIES", 8)
    runner = Runner(pair, seed=3)
    seq = runner.new_seq(_tokens(40, 6))
    ref = hf_logits(pair, seq.tokens)
    runner.step([(seq, 13)])
    masked = runner.forward([(seq, 7)])[0]  # under the threshold: one mask
    assert runner.metadata.prefills[0].prefix_keys == 0
    (logits,) = runner.step([(seq, 27)])
    assert runner.metadata.prefills[0].prefix_keys == 13
    _close(logits, ref[13:])
    assert (logits[:7] - masked).abs().max().item() < 3e-5


def test_batched_decode_of_different_lengths(pair: Pair) -> None:
    runner = Runner(pair, seed=3)
    steps = 20
    seqs = [runner.new_seq(_tokens(n + steps, 10 + n)) for n in (3, 9, 14, 6)]
    prompt = [len(s.tokens) - steps for s in seqs]
    outs = runner.step([(s, n) for s, n in zip(seqs, prompt, strict=True)])
    decoded: list[list[torch.Tensor]] = [[] for _ in seqs]
    for _ in range(steps):
        for out, logits in zip(decoded, runner.step([(s, 1) for s in seqs]), strict=True):
            out.append(logits)
    for s, n, first, rest in zip(seqs, prompt, outs, decoded, strict=True):
        ref = hf_logits(pair, s.tokens)
        _close(first, ref[:n])
        _close(torch.cat(rest), ref[n:])


def test_a_lone_decode_appends_to_its_copy_and_rebuilds_after_other_work(pair: Pair) -> None:
    runner = Runner(pair, seed=7)
    seq, other = runner.new_seq(_tokens(19, 50)), runner.new_seq(_tokens(9, 51))
    ref = hf_logits(pair, seq.tokens)
    runner.step([(seq, 11), (other, 9)])
    rebuilt = []
    for step in range(8):  # lone decodes; the fifth comes after another sequence's forward
        if step == 4:
            runner.append(other, _tokens(1, 52))
            runner.step([(other, 1)])
        (logits,) = runner.step([(seq, 1)])
        rebuilt.append(runner.model.lone.rebuild)
        _close(logits, ref[11 + step : 12 + step])
    assert rebuilt == [True, False, False, False, True, False, False, False]


def test_mixed_batch_of_prefills_and_decodes(pair: Pair) -> None:
    runner = Runner(pair, seed=4)
    a, b = runner.new_seq(_tokens(10, 20)), runner.new_seq(_tokens(7, 21))
    runner.step([(a, 9), (b, 6)])
    prefix = _tokens(8, 22)
    c = runner.new_seq(prefix + _tokens(3, 23))
    runner.step([(c, 8)])
    new = runner.new_seq(_tokens(11, 24))
    hit = runner.new_seq(prefix + _tokens(6, 25), shared=c.block_table[:2], computed=8)
    logits = runner.step([(a, 1), (new, 11), (b, 1), (hit, 6), (c, 1)])
    _close(logits[0], hf_logits(pair, a.tokens)[9:])
    _close(logits[1], hf_logits(pair, new.tokens))
    _close(logits[2], hf_logits(pair, b.tokens)[6:])
    _close(logits[3], hf_logits(pair, hit.tokens)[8:])
    _close(logits[4], hf_logits(pair, c.tokens)[8:9])


@pytest.mark.parametrize("writer_first", [True, False])
def test_prefix_block_written_and_read_in_one_forward(pair: Pair, writer_first: bool) -> None:
    runner = Runner(pair, seed=5)
    prefix = _tokens(8, 30)
    writer = runner.new_seq(prefix + _tokens(4, 31))
    # The reader treats the first two blocks as cached, though the writer computes them now.
    reader = runner.new_seq(prefix + _tokens(6, 32), shared=writer.block_table[:2], computed=8)
    batch = [(writer, 12), (reader, 6)]
    logits = runner.step(batch if writer_first else batch[::-1])
    if not writer_first:
        logits.reverse()
    _close(logits[0], hf_logits(pair, writer.tokens))
    _close(logits[1], hf_logits(pair, reader.tokens)[8:])


def test_logits_for_last_rows_only(pair: Pair) -> None:
    runner = Runner(pair, seed=6)
    a, b = runner.new_seq(_tokens(9, 40)), runner.new_seq(_tokens(5, 41))
    md = AttentionMetadata.build([9, 5], [9, 5], [a.block_table, b.block_table], BLOCK)
    ids = torch.tensor(a.tokens + b.tokens)
    hidden = pair.ours(ids, md.positions, md, runner.store)
    logits = pair.ours.compute_logits(hidden[md.last_token_rows])
    assert md.last_token_rows.tolist() == [8, 13]
    _close(logits, torch.stack([hf_logits(pair, a.tokens)[-1], hf_logits(pair, b.tokens)[-1]]))


# --- weight loading --------------------------------------------------------------------------


def test_load_weights_names_every_problem(pair: Pair) -> None:
    state = dict(pair.hf.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    state["model.norm.weight"] = torch.ones(65)
    model = LlamaModel(pair.config)
    with pytest.raises(ValueError) as err:
        model.load_weights(state)
    message = str(err.value)
    assert "missing tensors model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected tensors model.layers.0.self_attn.q_proj.bias" in message
    assert "mis-shaped tensors model.norm.weight has shape (65,), expected (64,)" in message


def test_untied_model_needs_lm_head(pair: Pair) -> None:
    if pair.config.tie_word_embeddings:
        state = dict(pair.hf.state_dict())
        state.pop("lm_head.weight", None)
        LlamaModel(pair.config).load_weights(state)  # a tied checkpoint may omit it
        return
    state = {k: v for k, v in pair.hf.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"missing tensors lm_head\.weight"):
        LlamaModel(pair.config).load_weights(state)


# --- KV store and metadata -------------------------------------------------------------------


def _store(num_layers: int = 2, num_blocks: int = 6) -> KVStore:
    return KVStore(num_layers, num_blocks, block_size=4, num_kv_heads=2, head_dim=3)


def test_write_puts_each_token_at_its_slot() -> None:
    store = _store()
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    store.write(1, k, v, torch.tensor([5, 6, 20]))  # block 1 slots 1-2, block 5 slot 0
    cache = store.layers[1]
    for i, (block, slot) in enumerate([(1, 1), (1, 2), (5, 0)]):
        assert torch.equal(cache[block, 0, slot], k[i])
        assert torch.equal(cache[block, 1, slot], v[i])
    assert int((cache != 0).sum()) == 2 * k.numel()
    assert not store.layers[0].any()


def test_copy_blocks_reads_all_sources_first() -> None:
    store = _store()
    for cache in store.layers:
        cache.copy_(torch.randn_like(cache))
    before = [c.clone() for c in store.layers]
    store.copy_blocks([(0, 3), (3, 4)])
    for old, new in zip(before, store.layers, strict=True):
        assert torch.equal(new[3], old[0])
        assert torch.equal(new[4], old[3])
        for b in (0, 1, 2, 5):
            assert torch.equal(new[b], old[b])
    store.copy_blocks([])


def test_zero_blocks() -> None:
    store = _store()
    for cache in store.layers:
        cache.fill_(1.0)
    store.zero_blocks([2, 4])
    store.zero_blocks([])
    for cache in store.layers:
        assert not cache[[2, 4]].any()
        assert cache[[0, 1, 3, 5]].eq(1).all()


def test_bytes_per_block_sizes_a_pool() -> None:
    per_block = KVStore.bytes_per_block(2, 4, 2, 3, torch.float16)
    assert per_block == 2 * 2 * 4 * 2 * 3 * 2
    store = KVStore(2, 7, 4, 2, 3, torch.float16)
    assert store.nbytes == 7 * per_block


def test_metadata_positions_slots_and_groups() -> None:
    md = AttentionMetadata.build([3, 1, 2], [5, 6, 2], [[7, 2], [4, 9], [0]], block_size=4)
    assert md.positions.tolist() == [2, 3, 4, 5, 0, 1]
    assert md.slot_mapping.tolist() == [30, 31, 8, 37, 0, 1]
    assert md.last_token_rows.tolist() == [2, 3, 5]
    assert [(p.start, p.query_len, p.context_len) for p in md.prefills] == [(0, 3, 5), (4, 2, 2)]
    assert md.prefills[1].mask is None
    assert md.prefills[0].mask.tolist()[0] == [True, True, True, False, False]
    assert md.decode is not None and md.decode.rows == slice(3, 4)
    assert md.decode.mask.flatten().tolist() == [True] * 6 + [False] * 2


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "tables"),
    [([0], [3], [[0]]), ([4], [3], [[0]]), ([3], [5], [[0]]), ([1, 1], [1], [[0]]), ([], [], [])],
)
def test_metadata_rejects_bad_batches(
    query_lens: list[int], context_lens: list[int], tables: list[list[int]]
) -> None:
    with pytest.raises(ValueError):
        AttentionMetadata.build(query_lens, context_lens, tables, block_size=4)
