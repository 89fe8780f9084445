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
  int64_t kv_size = s.kv_heads * s.head_dim, capacity = kv.keys.size(1);
  rope(qkv, s.heads + s.kv_heads, s.head_dim, cos, sin);
  const float* k = qkv + s.heads * s.head_dim;
  const float* v = k + kv_size;
  std::memcpy(kv.cache_k_row, k, kv_size * sizeof(float));
  std::memcpy(kv.cache_v_row, v, kv_size * sizeof(float));
  float* keys = kv.keys.data_ptr<float>();
  float* values = kv.values.data_ptr<float>();
  for (int64_t h = 0; h < s.kv_heads; ++h) {
    int64_t at = (h * capacity + kv.length - 1) * s.head_dim;
    std::memcpy(keys + at, k + h * s.head_dim, s.head_dim * sizeof(float));
    std::memcpy(values + at, v + h * s.head_dim, s.head_dim * sizeof(float));
  }
}

// e^x for x <= 0 (a softmax's shifted scores), to about 2 ulp: 2^n * p(r) with x = n ln 2 + r,
// in plain float arithmetic that the compiler vectorizes (libm's expf does not).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // 2^n stays a normal float
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Softmax over `scores` [length] in place, then out[dim] = sum_t p_t values[t].
void softmax_values(float* scores, int64_t length, const float* values, int64_t dim,
                    float* out) {
  float top = -INFINITY;
  for (int64_t t = 0; t < length; ++t) top = std::max(top, scores[t]);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < length; ++t) {
    scores[t] = exp_nonpositive(scores[t] - top);
    total += scores[t];
  }
  std::fill(out, out + dim, 0.0f);
  for (int64_t t = 0; t < length; ++t) {
    float p = scores[t] / total;
    const float* value = values + t * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) out[i] += p * value[i];
  }
}

// The query heads of one KV head: each key is read once for all of them.
void attend_group(const float* q, const float* keys, const float* values, int64_t length,
                  int64_t group, const LayerShape& s, float* scores, float* out) {
  for (int64_t t = 0; t < length; ++t) {
    const float* key = keys + t * s.head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* query = q + g * s.head_dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < s.head_dim; ++i) dot += query[i] * key[i];
      scores[g * length + t] = dot * s.scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    softmax_values(scores + g * length, length, values, s.head_dim, out + g * s.head_dim);
  }
}

// Softmax attention of each query head over its KV head's `length` keys: [1, heads * dim].
at::Tensor attend(const at::Tensor& qkv, const KVTarget& kv, const LayerShape& s) {
  int64_t group = s.heads / s.kv_heads, stride = kv.keys.size(1) * s.head_dim;
  const float* q = qkv.data_ptr<float>();
  const float* keys = kv.keys.data_ptr<float>();
  const float* values = kv.values.data_ptr<float>();
  at::Tensor out = at::empty({1, s.heads * s.head_dim}, qkv.options());
  float* o = out.data_ptr<float>();
  int64_t grain = kv.length < 512 ? s.kv_heads : 1;  // short contexts: not worth a thread
  at::parallel_for(0, s.kv_heads, grain, [&](int64_t first, int64_t last) {
    std::vector<float> scores(group * kv.length);
    for (int64_t h = first; h < last; ++h) {
      attend_group(q + h * group * s.head_dim, keys + h * stride, values + h * stride, kv.length,
                   group, s, scores.data(), o + h * group * s.head_dim);
    }
  });
  return out;
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
  at::Tensor normed = x.narrow(1, 0, s.hidden);
  rms_norm(hp, w.input_norm, s.hidden, s.eps, normed.data_ptr<float>());
  at::Tensor qkv = project(normed, w.qkv);
  store_kv(qkv.data_ptr<float>(), s, cos, sin, kv);
  add(hp, project(attend(qkv, kv, s), w.o), s.hidden);
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
