// One decoder layer for the one token of a lone decode, fused (decode_layer.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace prefixcache {

// An int4 projection as torch's CPU kernel takes it (quant.Int4Linear).
struct Int4Projection {
  at::Tensor packed;             // uint8 [N, K / 2]
  at::Tensor scales_and_zeros;   // bf16 [K / 32, N, 2]
};

struct LayerWeights {
  const float* input_norm;
  const float* post_norm;
  Int4Projection qkv, o, gate_up, down;
};

struct LayerShape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;
};

// Where this token's K/V go: the lone copy (`keys`, `values` [kv, capacity, dim], `length`
// tokens once this one is in) and its two rows of the paged cache.
struct KVTarget {
  at::Tensor keys, values;
  int64_t length;
  float* cache_k_row;
  float* cache_v_row;
};

// h += attention(norm(h)); h += mlp(norm(h)), as model.DecoderLayer computes a lone decode.
void decode_layer(at::Tensor& h, const LayerWeights& w, const LayerShape& s, const float* cos,
                  const float* sin, const KVTarget& kv);

}  // namespace prefixcache
