// torch.ops.prefixcache: the native kernels' checked entry points (decode_layers,
// head_logits, round_bf16_, rms_norm, rope_heads, gather_kv, write_kv_, and gguf_matmul.cpp's
// gguf_simd, gguf_int8, gguf_dequantize and gguf_matmul): every op of the library is registered here.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "decode_layer.h"
#include "gguf_matmul.h"
#include "head_logits.h"
#include "kv_rows.h"
#include "round_bf16.h"

namespace prefixcache {

namespace {

float* floats(const at::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.is_contiguous() && t.numel() >= numel, name,
              " must be contiguous fp32 with at least ", numel, " values");
  return t.data_ptr<float>();
}

// An int4 projection (`type` -1) or a GGUF one of `type`, checked for `cols` inputs.
Projection projection(const at::Tensor& packed, const at::Tensor& pairs, int64_t type, int64_t cols) {
  if (type >= 0) {
    gguf::check_blocks(packed, type, cols);
    return {packed, pairs, type, cols};
  }
  TORCH_CHECK(packed.dtype() == at::kByte && packed.dim() == 2 && packed.size(1) * 2 == cols,
              "packed codes must be uint8 [N, ", cols / 2, "]");
  TORCH_CHECK(pairs.dtype() == at::kBFloat16 && pairs.dim() == 3 && pairs.size(1) == packed.size(0),
              "scales_and_zeros must be bf16 [K / 32, N, 2]");
  return {packed, pairs, -1, cols};
}

// Rows a fused projection's parts give together.
int64_t rows_of(const Projections& parts) {
  int64_t rows = 0;
  for (const Projection& part : parts) rows += part.packed.size(0);
  return rows;
}

// The flat lists of every layer's parts, read in order.
struct FlatParts {
  at::TensorList packed, pairs;
  at::IntArrayRef types, counts;  // counts: parts of each projection, 4 per layer
  size_t next_part = 0, next_count = 0;

  Projections take(int64_t cols) {
    TORCH_CHECK(next_count < counts.size() && counts[next_count] >= 1, "every projection needs a part");
    Projections parts;
    for (int64_t i = 0, n = counts[next_count++]; i < n; ++i, ++next_part) {
      TORCH_CHECK(next_part < packed.size(), "fewer parts than the counts say");
      parts.push_back(projection(packed[next_part], pairs[next_part], types[next_part], cols));
    }
    return parts;
  }
};

// One layer's norms (`per_layer` of them: input and pre-MLP; then the QK-norms; then the
// norms of the attention's and the MLP's outputs), qkv bias (empty: none), projections, RoPE
// tables and window.
LayerWeights layer_weights(at::TensorList norms, int64_t per_layer, const at::Tensor& bias,
                           FlatParts& parts, int64_t layer, const LayerShape& s,
                           const float* const* rope, int64_t window) {
  const int64_t qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim;
  const at::Tensor* n = norms.data() + per_layer * layer;
  auto norm = [&](int64_t i, int64_t size, const char* name) {
    return i < per_layer ? floats(n[i], size, name) : nullptr;
  };
  LayerWeights w{norm(0, s.hidden, "input_norm"), norm(1, s.hidden, "post_norm"),
                 norm(2, s.head_dim, "q_norm"), norm(3, s.head_dim, "k_norm"),
                 norm(4, s.hidden, "attention_out_norm"), norm(5, s.hidden, "mlp_out_norm"),
                 bias.numel() == 0 ? nullptr : floats(bias, qkv_rows, "qkv_bias"),
                 parts.take(s.hidden), parts.take(s.heads * s.head_dim), parts.take(s.hidden),
                 parts.take(s.intermediate), rope[window > 0 ? 2 : 0], rope[window > 0 ? 3 : 1],
                 window};
  TORCH_CHECK(rows_of(w.qkv) == qkv_rows && rows_of(w.o) == s.hidden &&
                  rows_of(w.gate_up) == 2 * s.intermediate && rows_of(w.down) == s.hidden,
              "layer ", layer, ": projection shapes do not match the heads and the hidden size");
  return w;
}

// The new tokens' K/V targets in one layer: its contiguous copy and the rows of its pool.
KVTarget kv_target(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& cache,
                   int64_t length, const at::Tensor& rows, const LayerShape& s) {
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes() && keys.size(0) == s.kv_heads &&
                  keys.size(2) == s.head_dim,
              "keys, values must be [", s.kv_heads, ", capacity, ", s.head_dim, "]");
  TORCH_CHECK(length >= rows.size(0) && length <= keys.size(1), "length ", length, " outside ",
              rows.size(0), "..", keys.size(1));
  auto [format, head_bytes] = cache_format(cache, s.head_dim);
  const int64_t* r = checked_rows(rows, cache, s.kv_heads, head_bytes);
  floats(keys, keys.numel(), "keys");
  floats(values, values.numel(), "values");
  auto* bytes = static_cast<uint8_t*>(cache.data_ptr());
  return {keys, values, length, bytes, r, format, head_bytes};
}

at::Tensor gguf_matmul_op(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t in,
                          int64_t max_decode_rows, int64_t max_panel_rows, int64_t activation_bits) {
  return gguf::matmul(x, blocks, type, in, {max_decode_rows, max_panel_rows}, activation_bits);
}

void decode_layers_op(at::Tensor& h, at::TensorList norms, at::TensorList packed,
                      at::TensorList pairs, at::IntArrayRef types, at::IntArrayRef counts,
                      at::TensorList biases, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& local_cos, const at::Tensor& local_sin,
                      at::IntArrayRef windows, at::TensorList keys, at::TensorList values,
                      at::TensorList caches, int64_t length,
                      at::TensorList rows, int64_t heads, int64_t kv_heads, double eps,
                      double scale, bool gelu, int64_t max_decode_rows, int64_t max_panel_rows,
                      int64_t activation_bits) {
  const size_t layers = caches.size();
  TORCH_CHECK(layers > 0 && norms.size() % layers == 0 && counts.size() == 4 * layers &&
                  pairs.size() == packed.size() && types.size() == packed.size() &&
                  keys.size() == layers && values.size() == layers && rows.size() == layers &&
                  windows.size() == layers && biases.size() == layers,
              "per layer: its norms, 4 projections (qkv, o, gate_up, down) of one or more parts "
              "with their types, a qkv bias (or none), a window, keys, values, cache and rows");
  const int64_t per_layer = static_cast<int64_t>(norms.size() / layers);
  TORCH_CHECK(per_layer == 2 || per_layer == 4 || per_layer == 6,
              "2, 4 or 6 norms a layer (input and pre-MLP; QK-norms; output norms), not ", per_layer);
  TORCH_CHECK(h.dim() == 2 && h.size(0) >= 1, "h must be [tokens, hidden]");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must group by kv_heads");
  int64_t tokens = h.size(0), hidden = h.size(1), dim = keys[0].size(-1);
  int64_t gate_up = 0;  // layer 0's gate_up rows: twice the MLP's width
  for (int64_t p = counts[0] + counts[1]; p < counts[0] + counts[1] + counts[2]; ++p) {
    TORCH_CHECK(p < static_cast<int64_t>(packed.size()), "fewer parts than the counts say");
    gate_up += packed[p].size(0);
  }
  LayerShape s{hidden, heads, kv_heads, dim, gate_up / 2, static_cast<float>(eps),
               static_cast<float>(scale), {max_decode_rows, max_panel_rows}, gelu, activation_bits};
  floats(h, tokens * hidden, "h");
  const float* rope[4] = {floats(cos, tokens * dim, "cos"), floats(sin, tokens * dim, "sin"),
                          floats(local_cos, tokens * dim, "local_cos"),
                          floats(local_sin, tokens * dim, "local_sin")};
  FlatParts parts{packed, pairs, types, counts};
  for (size_t layer = 0; layer < layers; ++layer) {
    TORCH_CHECK(windows[layer] >= 0, "layer ", layer, ": window ", windows[layer], " < 0");
    TORCH_CHECK(rows[layer].dtype() == at::kLong && rows[layer].is_contiguous() &&
                    rows[layer].dim() == 2 && rows[layer].size(0) == tokens && rows[layer].size(1) == 2,
                "rows must be int64 [tokens, 2] (each token's K and V rows of the layer's pool)");
    LayerWeights w = layer_weights(norms, per_layer, biases[layer], parts, layer, s, rope, windows[layer]);
    decode_layer(h, w, s, kv_target(keys[layer], values[layer], caches[layer], length, rows[layer], s));
  }
  TORCH_CHECK(parts.next_part == packed.size(), "more parts than the counts say");
}

at::Tensor head_logits_op(const at::Tensor& parts, const at::Tensor& hidden,
                          const at::Tensor& weight, const at::Tensor& norm,
                          const at::Tensor& error_norm, const at::Tensor& plane_norms,
                          int64_t planes, double safety) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "hidden [R, K] and weight [N, K] expected");
  int64_t rows = hidden.size(0), n = weight.size(0);
  TORCH_CHECK(planes >= 1 && parts.dtype() == at::kBFloat16 && parts.is_contiguous() &&
                  parts.numel() == rows * planes * n,
              "parts must be contiguous bf16 [R, planes * N]");
  floats(hidden, hidden.numel(), "hidden");
  floats(weight, weight.numel(), "weight");
  floats(norm, n, "norm");
  floats(error_norm, n, "error_norm");
  floats(plane_norms, n, "plane_norms");
  return head_logits(parts, hidden, weight, norm, error_norm, plane_norms, planes, safety);
}

// rms_norm over x's last dim (fp32, any leading shape): one call where torch's takes ~8 ops.
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.dtype() == at::kFloat, "x must be fp32");
  const int64_t n = x.size(-1);
  const float* w = floats(weight, n, "weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "weight must be [", n, "]");
  at::Tensor in = x.contiguous(), out = at::empty_like(in);
  const float* src = in.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t rows = n == 0 ? 0 : in.numel() / n;  // a prefill's rows split over threads
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t a, int64_t b) {
    rms_norm(src + a * n, w, b - a, n, static_cast<float>(eps), dst + a * n, n);
  });
  return out;
}

// The query and key heads of qk [T, heads + kv_heads, dim] (rows may be strided, as a slice
// of the qkv projection), each RMS-normalised by its weight when given (QK-norm), then rotated
// by its token's cos/sin [T, dim]: a new contiguous tensor, one call for ~10 torch ops.
at::Tensor rope_heads_op(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t heads, const std::optional<at::Tensor>& q_norm,
                         const std::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(qk.dim() == 3 && qk.dtype() == at::kFloat && qk.stride(2) == 1 &&
                  qk.stride(1) == qk.size(2),
              "qk must be fp32 [tokens, heads, dim] with contiguous heads");
  const int64_t tokens = qk.size(0), all = qk.size(1), dim = qk.size(2);
  TORCH_CHECK(heads >= 0 && heads <= all && dim % 2 == 0, "heads ", heads, " outside 0..", all,
              " or odd head dim ", dim);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
  const float* c = floats(cos, tokens * dim, "cos");
  const float* sn = floats(sin, tokens * dim, "sin");
  const float* qn = q_norm ? floats(*q_norm, dim, "q_norm") : nullptr;
  const float* kn = k_norm ? floats(*k_norm, dim, "k_norm") : nullptr;
  at::Tensor out = at::empty({tokens, all, dim}, qk.options());
  const float* src = qk.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(all * dim, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const float* row = src + t * qk.stride(0);
      float* o = dst + t * all * dim;
      if (qn != nullptr) {
        norm_heads(row, o, qn, kn, heads, all - heads, dim, static_cast<float>(eps));
      } else {
        std::copy(row, row + all * dim, o);
      }
      rope(o, all, dim, c + t * dim, sn + t * dim);
    }
  });
  return out;
}

at::Tensor& round_bf16_op(at::Tensor& x) {
  round_bf16_(x);
  return x;
}

}  // namespace

TORCH_LIBRARY(prefixcache, m) {
  m.def("round_bf16_(Tensor(a!) x) -> Tensor(a!)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "rope_heads(Tensor qk, Tensor cos, Tensor sin, int heads, Tensor? q_norm, Tensor? k_norm, "
      "float eps) -> Tensor");
  m.def("gguf_simd() -> str", &gguf::simd_name);
  m.def("gguf_dequantize(Tensor blocks, int ggml_type, int in_features, bool portable=False) -> Tensor");
  m.def(
      "gguf_matmul(Tensor x, Tensor blocks, int ggml_type, int in_features, "
      "int max_decode_rows, int max_panel_rows, int activation_bits=32) -> Tensor");
  m.def("gguf_int8(int ggml_type) -> bool", &gguf::has_int8_kernel);
  m.def("gather_kv(Tensor cache, int which, Tensor block_ids) -> Tensor");
  m.def("write_kv_(Tensor(a!) cache, Tensor rows, Tensor(b!) k, Tensor(c!) v) -> ()");
  m.def(
      "head_logits(Tensor parts, Tensor hidden, Tensor weight, Tensor norm, Tensor error_norm, "
      "Tensor plane_norms, int planes, float safety) -> Tensor");
  m.def(
      "decode_layers(Tensor(a!) h, Tensor[] norms, Tensor[] packed, Tensor[] scales_and_zeros, "
      "int[] ggml_types, int[] part_counts, Tensor[] qkv_biases, Tensor cos, Tensor sin, "
      "Tensor local_cos, Tensor local_sin, int[] windows, Tensor(b!)[] keys, Tensor(c!)[] values, "
      "Tensor(d!)[] caches, int length, Tensor[] rows, int heads, int kv_heads, float eps, "
      "float scale, bool gelu, int max_decode_rows, int max_panel_rows, "
      "int activation_bits=32) -> ()");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, m) {
  m.impl("decode_layers", decode_layers_op);
  m.impl("head_logits", head_logits_op);
  m.impl("round_bf16_", round_bf16_op);
  m.impl("rms_norm", rms_norm_op);
  m.impl("rope_heads", rope_heads_op);
  m.impl("gguf_dequantize", gguf::dequantize);
  m.impl("gguf_matmul", gguf_matmul_op);
  m.impl("gather_kv", gather_kv);
  m.impl("write_kv_", write_kv);
}

}  // namespace prefixcache
