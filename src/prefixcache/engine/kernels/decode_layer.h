// One decoder layer for the new tokens of one sequence, fused (decode_layer.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "gguf_matmul.h"
#include "kv_rows.h"

namespace prefixcache {

// A projection: an int4 one as torch's CPU kernel takes it (quant.Int4Linear; `ggml_type`
// -1), or a GGUF matrix in its own blocks (weight_types.PackedLinear; `ggml_type` its type).
struct Projection {
  at::Tensor packed;            // int4: uint8 [N, K / 2]; GGUF: its blocks, uint8 [N, row bytes]
  at::Tensor scales_and_zeros;  // int4: bf16 [K / 32, N, 2]; GGUF: unused
  int64_t ggml_type;            // -1: int4
  int64_t in;                   // K
};

// One fused projection (q|k|v, gate|up): its parts' outputs side by side (one part, or one
// per run of a GGUF type: weight_types.ConcatLinear).
using Projections = std::vector<Projection>;

// A layer's weights and what sets it apart from the others. The norms after attention and
// after the MLP (Gemma 3's sandwich), the QK-norms and the bias are null where the family has
// none.
struct LayerWeights {
  const float* input_norm;
  const float* post_norm;  // before the MLP
  const float* q_norm;
  const float* k_norm;
  const float* attention_out_norm;
  const float* mlp_out_norm;
  const float* qkv_bias;  // null, or Qwen 2's bias on q|k|v
  Projections qkv, o, gate_up, down;
  const float* cos;  // this layer's RoPE tables, [T, head_dim]
  const float* sin;
  int64_t window;  // 0: full attention; else a token sees its last `window` positions
};

struct LayerShape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;
  gguf::RowLimits row_limits;  // GGUF projections: packed_weight.row_limits(), as eager
  bool gelu;                // the MLP's gate: GeLU (tanh) as Gemma's; else SiLU
  int64_t activation_bits;  // GGUF projections: as gguf_matmul's (gguf_int8.h), as eager
};

// Where the new tokens' K/V go: the sequence's contiguous fp32 copy (`keys`, `values`
// [kv, capacity, dim]), which holds `length` tokens once they are in, the last T of them
// new; and, for new token i, its K and V rows of the paged cache (`cache` + row *
// `row_bytes`), each of kv heads' rows in `format`. The copy gets the values as stored.
struct KVTarget {
  at::Tensor keys, values;
  int64_t length;
  uint8_t* cache;
  const int64_t* rows;  // [T, 2]: K row, V row
  KVFormat format;
  int64_t head_bytes;  // one head's row in the cache
};

// Each of `rows` rows of x [rows, n], RMS-normalised and scaled, into out [rows, stride]:
// x / sqrt(mean(x^2) + eps) * weight, as torch's rms_norm (and the eager models' norms).
void rms_norm(const float* x, const float* weight, int64_t rows, int64_t n, float eps,
              float* out, int64_t stride);

// One token's QK-norms: its `heads` query heads of src [heads + kv_heads, dim] normed by
// `q_norm`, then its key heads by `k_norm`, into dst (which may be src).
void norm_heads(const float* src, float* dst, const float* q_norm, const float* k_norm,
                int64_t heads, int64_t kv_heads, int64_t dim, float eps);

// Each of `heads` heads of x [heads, dim] rotated in place: x * cos + rotate_half(x) * sin,
// with `sin` already signed ([-sin, sin]) as models.llama.Rotary makes it.
void rope(float* x, int64_t heads, int64_t dim, const float* cos, const float* sin);

// h [T, hidden] += attention(norm(h)), then += mlp(norm(h)): the eager layer's numbers
// (models.llama.DecoderLayer, models.gemma3.Gemma3Layer) for T tokens of one sequence
// (causal: token i sees the context and the new tokens <= i, within its window if any).
void decode_layer(at::Tensor& h, const LayerWeights& w, const LayerShape& s, const KVTarget& kv);

}  // namespace prefixcache
