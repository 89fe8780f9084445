"""The weight cache: a GGUF's built int4 model stored once, read back bit for bit, and never
trusted when the file is damaged or belongs to another model (engine/weight_cache.py)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
import torch

from engine_fixtures import run_to_completion
from prefixcache.engine import kernels, weight_cache
from prefixcache.engine.cache_folder import default_cache_dir
from prefixcache.engine.engine import EngineConfig, LLMEngine
from prefixcache.engine.model_files import default_model_path
from prefixcache.engine.models import build_model
from prefixcache.engine.packed import PackedMismatch, load_packed, packed_tensors
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.weight_cache import EVENTS, build, cache_key, load_serving_model
from prefixcache.engine.weight_types.linear import PackedLinear
from prefixcache.engine.weights import LoadedModel, load_model
from test_weights import TINY as WEIGHTS_TINY
from test_weights import add_tiny_metadata, gguf_tensors, tiny_state

TINY = replace(WEIGHTS_TINY, intermediate_size=64)  # Q4 blocks want 32-multiples
PROMPT = "the thin hen sat on the mat"


@pytest.fixture
def tiny_q4(tmp_path: Path) -> Path:
    """A tiny GGUF whose layer matrices are Q4_1 (the embedding stays F32)."""
    path = tmp_path / "tiny-q4.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    add_tiny_metadata(writer, TINY)
    for name, array in gguf_tensors(tiny_state(TINY), TINY).items():
        if name.startswith("blk.") and array.ndim == 2:
            q4 = gguf.GGMLQuantizationType.Q4_1
            writer.add_tensor(name, gguf.quants.quantize(array, q4), raw_dtype=q4)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cache_file(folder: Path) -> Path:
    (file,) = folder.glob("weights-*.safetensors")
    return file


def greedy(loaded: LoadedModel, max_tokens: int = 8) -> list[int]:
    """Greedy tokens for PROMPT on a fresh engine."""
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=32, block_size=4))
    ids = loaded.tokenizer.encode(PROMPT)
    engine.add_request("r", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return list(run_to_completion(engine)["r"].token_ids)


def assert_same_model(a: LoadedModel, b: LoadedModel) -> None:
    """Every tensor bitwise equal, and the same config, int4 names and tokenizer."""
    assert a.model is not None and b.model is not None
    ta, tb = packed_tensors(a.model), packed_tensors(b.model)
    assert sorted(ta) == sorted(tb)
    for name, tensor in ta.items():
        assert tensor.dtype == tb[name].dtype and torch.equal(tensor, tb[name]), name
    assert a.config == b.config and a.int4_weights == b.int4_weights
    assert a.tokenizer.encode(PROMPT) == b.tokenizer.encode(PROMPT)
    assert a.tokenizer.eos_token_ids == b.tokenizer.eos_token_ids
    assert a.tokenizer.chat_template == b.tokenizer.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert a.tokenizer.apply_chat_template(messages) == b.tokenizer.apply_chat_template(messages)


def test_tiny_round_trip_is_bitwise_and_greedy_identical(tiny_q4: Path, tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "nested"  # missing: created
    before = EVENTS.copy()
    first = load_serving_model(tiny_q4, folder)
    second = load_serving_model(tiny_q4, folder)
    assert EVENTS["built"] == before["built"] + 1 and EVENTS["hit"] == before["hit"] + 1
    assert second.state_dict == {} and len(second.int4_weights) == 2 * 7
    assert_same_model(first, second)
    # The engine's own path (dequantize, load, quantize at build) gives the same tokens.
    assert greedy(second) == greedy(first) == greedy(load_model(tiny_q4))


def test_default_model_round_trip(tmp_path: Path) -> None:
    """The real model: every packed tensor and the int4 head bitwise, the same greedy tokens."""
    built = load_serving_model(None, tmp_path)
    read = load_serving_model(None, tmp_path)
    assert_same_model(built, read)
    expected = "PackedLinear" if kernels.simd_decoders() else "Int4Head"
    assert type(read.model.head).__name__ == expected
    assert greedy(read, 6) == greedy(built, 6)


def test_a_stored_packed_head_of_a_bad_type_or_shape_is_refused() -> None:
    """The head's stored GGUF type and blocks are checked before use (a rebuild follows)."""
    loaded = load_model(default_model_path())
    model = build_model(loaded.config)
    model.load_quantized(loaded.state_dict, loaded.quantized)
    if not isinstance(model.head, PackedLinear):
        model.head = PackedLinear(loaded.quantized["model.embed_tokens.weight"])
    good = packed_tensors(model)
    bad_type = {**good, "head.ggml_type": torch.tensor([99])}
    with pytest.raises(PackedMismatch, match="GGML type 99"):
        load_packed(build_model(loaded.config), bad_type)
    short = {**good, "head.blocks": good["head.blocks"][:, :-34]}
    with pytest.raises(PackedMismatch, match=r"head\.blocks is torch\.uint8"):
        load_packed(build_model(loaded.config), short)
    load_packed(build_model(loaded.config), good)  # and the good ones load


def _flip_middle(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x40
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size - 100])


def _garbage(file: Path) -> None:
    file.write_bytes(b"not a cache file at all")


def _empty(file: Path) -> None:
    file.write_bytes(b"")


@pytest.mark.parametrize("damage", [_flip_middle, _truncate, _garbage, _empty])
def test_a_damaged_file_is_rebuilt(damage, tiny_q4: Path, tmp_path: Path, caplog) -> None:
    good = load_serving_model(tiny_q4, tmp_path)
    damage(cache_file(tmp_path))
    before = EVENTS["rebuilt"]
    with caplog.at_level(logging.WARNING, "prefixcache.engine.weight_cache"):
        rebuilt = load_serving_model(tiny_q4, tmp_path)
    assert EVENTS["rebuilt"] == before + 1
    assert "rebuilding" in caplog.text and PROMPT not in caplog.text
    assert_same_model(good, rebuilt)
    hits = EVENTS["hit"]
    assert_same_model(good, load_serving_model(tiny_q4, tmp_path))  # rewritten, good again
    assert EVENTS["hit"] == hits + 1


def test_a_file_for_another_model_or_packing_is_not_used(
    tiny_q4: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    """A file under the expected name but built for another key (another GGUF, another
    packing version): its stored key gives it away."""
    load_serving_model(tiny_q4, tmp_path)
    old = cache_file(tmp_path)
    monkeypatch.setattr(weight_cache, "FORMAT", weight_cache.FORMAT + 1)
    new_key = cache_key(tiny_q4)
    old.rename(tmp_path / f"weights-{new_key[:40]}.safetensors")
    before = EVENTS["rebuilt"]
    with caplog.at_level(logging.WARNING, "prefixcache.engine.weight_cache"):
        load_serving_model(tiny_q4, tmp_path)
    assert EVENTS["rebuilt"] == before + 1 and "another model" in caplog.text


def test_the_key_follows_the_gguf_bytes(tiny_q4: Path) -> None:
    key = cache_key(tiny_q4)
    data = bytearray(tiny_q4.read_bytes())
    data[-10] ^= 1  # inside the last sampled span
    tiny_q4.write_bytes(bytes(data))
    assert cache_key(tiny_q4) != key


def test_a_folder_that_cannot_be_written_degrades_to_the_slow_path(
    tiny_q4: Path, tmp_path: Path, caplog
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    before = EVENTS["unwritable"]
    with caplog.at_level(logging.WARNING, "prefixcache.engine.weight_cache"):
        loaded = load_serving_model(tiny_q4, blocked)
    assert EVENTS["unwritable"] == before + 1 and "not written" in caplog.text
    assert greedy(loaded) == greedy(build(tiny_q4))


def test_no_folder_builds_without_a_cache(tiny_q4: Path) -> None:
    loaded = load_serving_model(tiny_q4, None)
    assert loaded.model is not None and loaded.int4_weights


def test_a_built_model_refuses_another_dtype(tiny_q4: Path) -> None:
    with pytest.raises(ValueError, match="fp32 on int4"):
        LLMEngine(build(tiny_q4), EngineConfig(num_kv_blocks=8, dtype=torch.float64))


def test_serve_flags() -> None:
    from prefixcache.cli import build_parser

    args = build_parser().parse_args(["serve", "--weight-cache", "/x"])
    assert args.weight_cache == "/x" and not args.no_weight_cache
    assert build_parser().parse_args(["serve", "--no-weight-cache"]).no_weight_cache


def test_default_folder(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PREFIXCACHE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "prefixcache"
    assert default_model_path().suffix == ".gguf"


def test_zeroed_kv_pool_reads_zero() -> None:
    """The pool's calloc'd layers read as zeros and take writes (engine/kv_store.py)."""
    from prefixcache.engine.kv_store import KVStore

    store = KVStore(2, 4, 4, 2, 8, dtype=torch.bfloat16)
    assert all(not layer.any() for layer in store.layers)
    store.layers[1][3, 1, 2] = 1.5
    assert store.layers[1].sum().item() == 1.5 * 2 * 8
