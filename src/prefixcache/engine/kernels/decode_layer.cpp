// model.DecoderLayer's lone decode in one call: the projections on torch's int4 kernel (the
// same numbers as the eager path), norms, RoPE, the K/V stores and attention in C++ loops,
// instead of ~25 torch ops, each with its Python and dispatch overhead.
#include "decode_layer.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace prefixcache {

namespace {

constexpr int64_t kGroupSize = 32;  // inputs per scale/zero pair (quant.GROUP_SIZE)

// bf16(bf16(x) . W'^T) in fp32, as quant.Int4Linear computes a row.
at::Tensor project(const at::Tensor& x, const Int4Projection& p) {
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), p.packed, kGroupSize,
                                                 p.scales_and_zeros);
  return y.to(at::kFloat);
}

void rms_norm(const float* x, const float* weight, int64_t n, float eps, float* out) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  float inverse = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inverse * weight[i];
}

// x * cos + rotate_half(x) * sin per head; `sin` is already signed ([-sin, sin]).
void rope(float* x, int64_t heads, int64_t dim, const float* cos, const float* sin) {
  std::vector<float> head(dim);
  int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * dim;
    std::memcpy(head.data(), v, dim * sizeof(float));
    for (int64_t i = 0; i < dim; ++i) v[i] = head[i] * cos[i] + head[(i + half) % dim] * sin[i];
  }
}

// Rotate q and k, then store this token's k and v in the lone copy and the paged cache.
void store_kv(float* qkv, const LayerShape& s, const float* cos, const float* sin,
              const KVTarget& kv) {
  int64_t kv_size = s.kv_heads * s.head_dim;
  rope(qkv, s.heads + s.kv_heads, s.head_dim, cos, sin);
  const float* k = qkv + s.heads * s.head_dim;
  const float* v = k + kv_size;
  std::memcpy(kv.cache_k_row, k, kv_size * sizeof(float));
  std::memcpy(kv.cache_v_row, v, kv_size * sizeof(float));
  for (int64_t h = 0; h < s.kv_heads; ++h) {
    int64_t at = (h * kv.capacity + kv.length - 1) * s.head_dim;
    std::memcpy(kv.keys + at, k + h * s.head_dim, s.head_dim * sizeof(float));
    std::memcpy(kv.values + at, v + h * s.head_dim, s.head_dim * sizeof(float));
  }
}

// Softmax attention of query head `h` over its KV head's `length` keys, into `out`.
void attend_head(const float* query, const float* keys, const float* values, int64_t length,
                 const LayerShape& s, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t t = 0; t < length; ++t) {
    const float* key = keys + t * s.head_dim;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < s.head_dim; ++i) dot += query[i] * key[i];
    scores[t] = dot * s.scale;
    top = std::max(top, scores[t]);
  }
  float total = 0.0f;
  for (int64_t t = 0; t < length; ++t) total += scores[t] = std::exp(scores[t] - top);
  std::fill(out, out + s.head_dim, 0.0f);
  for (int64_t t = 0; t < length; ++t) {
    float p = scores[t] / total;
    const float* value = values + t * s.head_dim;
#pragma omp simd
    for (int64_t i = 0; i < s.head_dim; ++i) out[i] += p * value[i];
  }
}

void attend(const float* q, const KVTarget& kv, const LayerShape& s, float* out) {
  int64_t group = s.heads / s.kv_heads, stride = kv.capacity * s.head_dim;
  int64_t grain = kv.length < 256 ? s.heads : 1;  // short contexts: not worth a thread
  at::parallel_for(0, s.heads, grain, [&](int64_t first, int64_t last) {
    std::vector<float> scores(kv.length);
    for (int64_t h = first; h < last; ++h) {
      int64_t kv_head = h / group;
      attend_head(q + h * s.head_dim, kv.keys + kv_head * stride, kv.values + kv_head * stride,
                  kv.length, s, scores.data(), out + h * s.head_dim);
    }
  });
}

void add(float* h, const at::Tensor& delta, int64_t n) {
  const float* d = delta.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) h[i] += d[i];
}

}  // namespace

void decode_layer(at::Tensor& h, const LayerWeights& w, const LayerShape& s, const float* cos,
                  const float* sin, const KVTarget& kv) {
  float* hp = h.data_ptr<float>();
  at::Tensor x = at::empty({1, std::max(s.hidden, s.intermediate)}, h.options());
  at::Tensor normed = x.narrow(1, 0, s.hidden), attn = at::empty({1, s.hidden}, h.options());
  rms_norm(hp, w.input_norm, s.hidden, s.eps, normed.data_ptr<float>());
  at::Tensor qkv = project(normed, w.qkv);
  store_kv(qkv.data_ptr<float>(), s, cos, sin, kv);
  attend(qkv.data_ptr<float>(), kv, s, attn.data_ptr<float>());
  add(hp, project(attn, w.o), s.hidden);
  rms_norm(hp, w.post_norm, s.hidden, s.eps, normed.data_ptr<float>());
  at::Tensor gate_up = project(normed, w.gate_up);
  const float* gu = gate_up.data_ptr<float>();
  float* act = x.data_ptr<float>();
  for (int64_t i = 0; i < s.intermediate; ++i) {
    float gate = gu[i];
    act[i] = gate / (1.0f + std::exp(-gate)) * gu[s.intermediate + i];
  }
  add(hp, project(x.narrow(1, 0, s.intermediate), w.down), s.hidden);
}

}  // namespace prefixcache
