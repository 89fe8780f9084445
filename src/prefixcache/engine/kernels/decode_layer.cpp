// A decoder layer (Llama's; Qwen 2's bias, Qwen 3's QK-norms; Gemma 3's sandwich norms, GeGLU
// and windows) for the new tokens of one sequence, in one call: the projections on torch's
// int4 kernel or on the GGUF blocks (the same numbers as the eager path), norms, RoPE, the K/V
// stores and attention in C++ loops, instead of ~25 torch ops, each with its Python and
// dispatch cost.
#include "decode_layer.h"

#include "gguf_matmul.h"
#include "round_bf16.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace prefixcache {

namespace {

constexpr int64_t kGroupSize = 32;  // inputs per scale/zero pair (quant.GROUP_SIZE)
constexpr int64_t kSdpaWork = 512;  // new tokens x context from which SDPA beats the loops

// As the eager layer computes rows: bf16(bf16(x) . W'^T) in fp32 (quant.Int4Linear), or
// x . W^T in fp32 on the GGUF blocks (PackedLinear, the same kernel and row limit).
at::Tensor project_part(const at::Tensor& x, const Projection& p, const LayerShape& s) {
  if (p.ggml_type >= 0) return gguf::matmul(x.contiguous(), p.packed, p.ggml_type, p.in, s.row_limits,
                                                   s.activation_bits);
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16).contiguous(), p.packed, kGroupSize,
                                                 p.scales_and_zeros);
  return y.to(at::kFloat);
}

// A fused projection: its parts' outputs side by side (weight_types.ConcatLinear).
at::Tensor project(const at::Tensor& x, const Projections& parts, const LayerShape& s) {
  if (parts.size() == 1) return project_part(x, parts[0], s);
  std::vector<at::Tensor> outputs;
  for (const Projection& part : parts) outputs.push_back(project_part(x, part, s));
  return at::cat(outputs, 1);
}

// y [T, n] += bias [n], row by row.
void add_bias(at::Tensor& y, const float* bias) {
  const int64_t n = y.size(1);
  float* row = y.data_ptr<float>();
  for (int64_t t = 0; t < y.size(0); ++t, row += n) {
    for (int64_t i = 0; i < n; ++i) row[i] += bias[i];
  }
}

// Each new token's query and key heads RMS-normalised in place by the QK-norms, if any.
void qk_norm(float* qkv, int64_t tokens, const LayerWeights& w, const LayerShape& s) {
  if (w.q_norm == nullptr) return;
  const int64_t row = (s.heads + 2 * s.kv_heads) * s.head_dim;
  for (float* q = qkv; q < qkv + tokens * row; q += row) {
    norm_heads(q, q, w.q_norm, w.k_norm, s.heads, s.kv_heads, s.head_dim, s.eps);
  }
}

// Rotate each new token's q and k, then store its k and v in the paged cache and the copy.
void store_kv(float* qkv, int64_t tokens, const LayerShape& s, const float* cos,
              const float* sin, const KVTarget& kv) {
  int64_t q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim;
  int64_t row = q_size + 2 * kv_size, capacity = kv.keys.size(1);
  float* keys = kv.keys.data_ptr<float>();
  float* values = kv.values.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    float* token = qkv + t * row;
    rope(token, s.heads + s.kv_heads, s.head_dim, cos + t * s.head_dim, sin + t * s.head_dim);
    float* k = token + q_size;
    float* v = k + kv_size;
    uint8_t* k_out = kv.cache + kv.rows[2 * t] * s.kv_heads * kv.head_bytes;
    uint8_t* v_out = kv.cache + kv.rows[2 * t + 1] * s.kv_heads * kv.head_bytes;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      store_row(k + h * s.head_dim, s.head_dim, kv.format, k_out + h * kv.head_bytes);
      store_row(v + h * s.head_dim, s.head_dim, kv.format, v_out + h * kv.head_bytes);
    }
    int64_t position = kv.length - tokens + t;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      int64_t at = (h * capacity + position) * s.head_dim;
      std::memcpy(keys + at, k + h * s.head_dim, s.head_dim * sizeof(float));
      std::memcpy(values + at, v + h * s.head_dim, s.head_dim * sizeof(float));
    }
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

// Attention as torch's SDPA, for long contexts or many new tokens, where its vectorized
// kernels beat the loops below despite ~90 us of op overhead a layer: queries grouped per
// KV head, rows (token, head in group), a causal mask by token.
at::Tensor attend_sdpa(const at::Tensor& qkv, int64_t tokens, const KVTarget& kv,
                       const LayerShape& s, int64_t window) {
  int64_t group = s.heads / s.kv_heads, width = s.heads * s.head_dim;
  at::Tensor q = qkv.narrow(1, 0, width).reshape({tokens, s.kv_heads, group, s.head_dim});
  q = q.permute({1, 0, 2, 3}).reshape({1, s.kv_heads, tokens * group, s.head_dim});
  // From the first position any new token's window starts at (the copy holds no more).
  int64_t first = window > 0 ? std::max<int64_t>(0, kv.length - tokens - window + 1) : 0;
  at::Tensor keys = kv.keys.narrow(1, first, kv.length - first).unsqueeze(0);
  at::Tensor values = kv.values.narrow(1, first, kv.length - first).unsqueeze(0);
  std::optional<at::Tensor> mask;
  if (tokens > 1) {  // row (t, g) sees positions up to length - tokens + t (within its window)
    at::Tensor end = at::arange(kv.length - tokens + 1, kv.length + 1, qkv.options().dtype(at::kLong));
    end = end.repeat_interleave(group).unsqueeze(1);
    at::Tensor position = at::arange(first, kv.length, end.options()).unsqueeze(0);
    mask = position.lt(end);
    if (window > 0) mask = mask->logical_and(position.ge(end.sub(window)));
  }
  at::Tensor out = at::scaled_dot_product_attention(q, keys, values, mask, 0.0, false, s.scale);
  return out.reshape({s.kv_heads, tokens, group, s.head_dim}).permute({1, 0, 2, 3}).reshape({tokens, width});
}

// Each new token's softmax attention over the keys it may see, per query head:
// out [T, heads * dim]. Work is split by (token, KV head, half of its query heads) when there
// is enough of it: by KV head alone, a lone decode of Gemma 3 (one KV head) ran on one core
// while the other waited, and SmolLM2's three KV heads split 2:1.
at::Tensor attend(const at::Tensor& qkv, int64_t tokens, const KVTarget& kv,
                  const LayerShape& s, int64_t window) {
  const int64_t seen = window > 0 ? std::min(window, kv.length) : kv.length;
  if (tokens * seen >= kSdpaWork) return attend_sdpa(qkv, tokens, kv, s, window);
  int64_t group = s.heads / s.kv_heads, stride = kv.keys.size(1) * s.head_dim;
  int64_t row = qkv.size(1), width = s.heads * s.head_dim;
  const float* q = qkv.data_ptr<float>();
  const float* keys = kv.keys.data_ptr<float>();
  const float* values = kv.values.data_ptr<float>();
  at::Tensor out = at::empty({tokens, width}, qkv.options());
  float* o = out.data_ptr<float>();
  const int64_t halves = group > 1 ? 2 : 1, half = (group + 1) / 2;  // query heads an item
  int64_t items = tokens * s.kv_heads * halves;
  int64_t grain = tokens * seen * group < 256 ? items : 1;  // little work: not worth a thread
  at::parallel_for(0, items, grain, [&](int64_t first, int64_t last) {
    std::vector<float> scores(half * kv.length);
    for (int64_t item = first; item < last; ++item) {
      int64_t t = item / (s.kv_heads * halves), h = item / halves % s.kv_heads;
      int64_t g0 = item % halves * half, count = std::min(half, group - g0);
      int64_t visible = kv.length - tokens + t + 1;
      int64_t start = window > 0 ? std::max<int64_t>(0, visible - window) : 0;
      int64_t head = h * group + g0;
      attend_group(q + t * row + head * s.head_dim, keys + h * stride + start * s.head_dim,
                   values + h * stride + start * s.head_dim, visible - start, count, s,
                   scores.data(), o + t * width + head * s.head_dim);
    }
  });
  return out;
}

// h += delta, normed first by `norm` where the family norms a block's output (Gemma 3).
void add(float* h, at::Tensor delta, const float* norm, const LayerShape& s) {
  float* d = delta.data_ptr<float>();
  if (norm != nullptr) rms_norm(d, norm, delta.size(0), s.hidden, s.eps, d, s.hidden);
  for (int64_t i = 0; i < delta.numel(); ++i) h[i] += d[i];
}

// 1 / (1 + e^-z) from e^-|z| (exp_nonpositive), so that a loop of them vectorizes: libm's
// expf and tanhf do not (a Gemma step called tanhf 37k times, a 48-token chunk 1.6M).
inline float sigmoid(float z) {
  const float e = exp_nonpositive(-std::fabs(z));
  const float r = 1.0f / (1.0f + e);
  return z >= 0.0f ? r : e * r;
}

// The MLP's gate: SiLU, x sigmoid(x); or GeLU with tanh's approximation as torch's
// F.gelu(approximate="tanh"), 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
inline float gated(float x, bool gelu) {
  constexpr float kTwoBeta = 2.0f * 0.7978845608028654f, kKappa = 0.044715f;
  return x * sigmoid(gelu ? kTwoBeta * (x + kKappa * x * x * x) : x);
}

}  // namespace

// Each of `rows` rows of x [rows, n], RMS-normalised and scaled, into out [rows, stride].
void rms_norm(const float* x, const float* weight, int64_t rows, int64_t n, float eps,
              float* out, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r, x += n, out += stride) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
    float inverse = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inverse * weight[i];
  }
}

void norm_heads(const float* src, float* dst, const float* q_norm, const float* k_norm,
                int64_t heads, int64_t kv_heads, int64_t dim, float eps) {
  rms_norm(src, q_norm, heads, dim, eps, dst, dim);
  rms_norm(src + heads * dim, k_norm, kv_heads, dim, eps, dst + heads * dim, dim);
}

void rope(float* x, int64_t heads, int64_t dim, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {  // each pair (i, i + half) in one pass: no copy
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] + b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

void decode_layer(at::Tensor& h, const LayerWeights& w, const LayerShape& s, const KVTarget& kv) {
  int64_t tokens = h.size(0), width = std::max(s.hidden, s.intermediate);
  float* hp = h.data_ptr<float>();
  at::Tensor x = at::empty({tokens, width}, h.options());
  at::Tensor normed = x.narrow(1, 0, s.hidden);
  rms_norm(hp, w.input_norm, tokens, s.hidden, s.eps, x.data_ptr<float>(), width);
  at::Tensor qkv = project(normed, w.qkv, s);
  if (w.qkv_bias != nullptr) add_bias(qkv, w.qkv_bias);
  qk_norm(qkv.data_ptr<float>(), tokens, w, s);
  store_kv(qkv.data_ptr<float>(), tokens, s, w.cos, w.sin, kv);
  add(hp, project(attend(qkv, tokens, kv, s, w.window), w.o, s), w.attention_out_norm, s);
  rms_norm(hp, w.post_norm, tokens, s.hidden, s.eps, x.data_ptr<float>(), width);
  at::Tensor gate_up = project(normed, w.gate_up, s);
  float* act = x.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const float* gu = gate_up.data_ptr<float>() + t * 2 * s.intermediate;
    float* out = act + t * width;
#pragma omp simd
    for (int64_t i = 0; i < s.intermediate; ++i) out[i] = gated(gu[i], s.gelu) * gu[s.intermediate + i];
  }
  add(hp, project(x.narrow(1, 0, s.intermediate), w.down, s), w.mlp_out_norm, s);
}

}  // namespace prefixcache
