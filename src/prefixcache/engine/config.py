"""The shape of a decoder model: everything the engine needs besides weights."""

from __future__ import annotations

from dataclasses import dataclass, field

# Engine defaults, read by EngineConfig and by `prefixcache serve` (no torch needed here).
DEFAULT_KV_CACHE_BYTES = 2 * 2**30
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# The step time target we measured (docs/benchmarks.md, benchmarks/http_scheduling.py). On
# the first AVX-512 machine, of 50, 100, 250 and 500 ms, 100 kept a long prompt behind cached
# ones within 1.2x and cut agents' TTFT beside a flood 2x against 250. On a 2-core KVM Xeon
# (2026-12-05), of 60, 80, 100 and 150 ms over 4-5 runs, 60 met the agents' TTFT p95 (<= 2x)
# and the stream's gap p99 (<= 10x) in every run and the p50 (<= 1.5x) in three of four,
# where 100 met the gap in one run of five and the p50 in one; the flood kept 0.73-0.83x of
# token-only steps at 60 and 0.71-0.80x at 100. `prefixcache serve`'s default; an
# `EngineConfig` has none unless given one: chunk sizes then follow measured
# times, so under concurrency a prompt's prefill may take the int4 kernels' small-batch path
# in one run and not in another, and greedy tokens differ between runs (as any server's
# batches do), where the library's token-only steps repeat exactly.
DEFAULT_STEP_TARGET_MS = 60.0
KV_CACHE_DTYPES = ("float32", "bfloat16", "int8")  # what the KV pool may store K/V as
# What a GGUF's decode kernels multiply the weights by, and its bits (kernels/gguf_int8.h).
ACTIVATION_BITS = {"fp32": 32, "int16": 16, "int8": 8}
DECODE_ACTIVATIONS = tuple(ACTIVATION_BITS)
DEFAULT_DECODE_ACTIVATIONS = "int16"
DEFAULT_KV_CACHE_DTYPE = "float32"
KV_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}  # bytes of one K or V value
KV_SCALE_BYTES = 4  # an int8 row's fp32 scale, after its codes (engine/kv_quant.py)
KV_LAYOUTS = ("hybrid", "full")  # window layers keep only their window's pages, or every token
DEFAULT_KV_LAYOUT = "hybrid"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyperparameters of a decoder (GQA, RoPE, RMSNorm); `architecture` names its family.

    The family's file (`engine/models/`) reads the fields it has: QKV bias (qwen2), QK-norm
    (qwen3, gemma3), per-dimension RoPE divisors (Llama 3's `rope_freqs`), sliding-window
    layers with their own RoPE base (gemma3).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "model"
    revision: str = ""
    architecture: str = "llama"
    attention_bias: bool = False
    qk_norm: bool = False
    rope_freq_factors: tuple[float, ...] = ()  # divides each RoPE frequency (Llama 3 scaling)
    sliding_window: int = 0  # tokens a window layer attends to; 0: every layer is full
    window_layers: tuple[bool, ...] = ()  # per layer: a window layer; (): all, if a window
    rope_local_theta: float = 10000.0  # RoPE base of the window layers
    attention_scale: float = 0.0  # 0: head_dim ** -0.5
    embedding_scale: float = 1.0  # the embedding lookup is multiplied by this

    def is_window_layer(self, layer: int) -> bool:
        """Whether `layer` attends only to the last `sliding_window` tokens."""
        if not self.sliding_window:
            return False
        return not self.window_layers or self.window_layers[layer]

    @property
    def scale(self) -> float:
        """The attention's query scale."""
        return self.attention_scale or self.head_dim**-0.5

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )


def kv_row_bytes(head_dim: int, kv_cache_dtype: str) -> int:
    """Bytes of one token's K (or V) for one KV head at a `--kv-cache-dtype` (int8: its scale
    too), without torch: what `kv_store.row_bytes` gives, for the simulator."""
    if kv_cache_dtype not in KV_VALUE_BYTES:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
        )
    scale = KV_SCALE_BYTES if kv_cache_dtype == "int8" else 0
    return head_dim * KV_VALUE_BYTES[kv_cache_dtype] + scale
