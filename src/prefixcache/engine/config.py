"""The shape of a Llama-family model: everything the engine needs besides weights."""

from __future__ import annotations

from dataclasses import dataclass, field

# Engine defaults, read by EngineConfig and by `prefixcache serve` (no torch needed here).
DEFAULT_KV_CACHE_BYTES = 2 * 2**30
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (GQA, RoPE, RMSNorm, SwiGLU)."""

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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
