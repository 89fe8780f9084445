// torch.ops.prefixcache.decode_layer: the fused lone-decode layer's checked entry point.
#include <torch/library.h>

#include "decode_layer.h"

namespace prefixcache {

namespace {

float* floats(const at::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.is_contiguous() && t.numel() >= numel, name,
              " must be contiguous fp32 with at least ", numel, " values");
  return t.data_ptr<float>();
}

Int4Projection projection(const at::Tensor& packed, const at::Tensor& pairs, int64_t cols) {
  TORCH_CHECK(packed.dtype() == at::kByte && packed.dim() == 2 && packed.size(1) * 2 == cols,
              "packed codes must be uint8 [N, ", cols / 2, "]");
  TORCH_CHECK(pairs.dtype() == at::kBFloat16 && pairs.dim() == 3 && pairs.size(1) == packed.size(0),
              "scales_and_zeros must be bf16 [K / 32, N, 2]");
  return {packed, pairs};
}

void decode_layer_op(at::Tensor& h, const at::Tensor& input_norm, const at::Tensor& post_norm,
                     double eps, at::TensorList packed, at::TensorList pairs,
                     const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                     at::Tensor& values, int64_t length, at::Tensor& cache, int64_t k_row,
                     int64_t v_row, int64_t heads, double scale) {
  TORCH_CHECK(packed.size() == 4 && pairs.size() == 4, "qkv, o, gate_up and down expected");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes(), "keys, values: [kv, cap, dim]");
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1, "h must be one row [1, hidden]");
  int64_t hidden = h.size(1), kv_heads = keys.size(0), capacity = keys.size(1);
  int64_t dim = keys.size(2), intermediate = packed[3].size(1) * 2;
  TORCH_CHECK(length >= 1 && length <= capacity, "length ", length, " outside 1..", capacity);
  TORCH_CHECK(packed[0].size(0) == (heads + 2 * kv_heads) * dim &&
                  packed[2].size(0) == 2 * intermediate && packed[1].size(0) == hidden,
              "projection shapes do not match the heads and the hidden size");
  LayerWeights w{floats(input_norm, hidden, "input_norm"), floats(post_norm, hidden, "post_norm"),
                 projection(packed[0], pairs[0], hidden),
                 projection(packed[1], pairs[1], heads * dim),
                 projection(packed[2], pairs[2], hidden),
                 projection(packed[3], pairs[3], intermediate)};
  LayerShape s{hidden, heads, kv_heads, dim, intermediate, static_cast<float>(eps),
               static_cast<float>(scale)};
  int64_t row = kv_heads * dim, rows = cache.numel() / row;
  TORCH_CHECK(k_row >= 0 && k_row < rows && v_row >= 0 && v_row < rows, "cache row out of range");
  float* flat = floats(cache, row, "cache");
  KVTarget kv{floats(keys, keys.numel(), "keys"), floats(values, values.numel(), "values"),
              capacity, length, flat + k_row * row, flat + v_row * row};
  floats(h, hidden, "h");
  decode_layer(h, w, s, floats(cos, dim, "cos"), floats(sin, dim, "sin"), kv);
}

}  // namespace

TORCH_LIBRARY(prefixcache, m) {
  m.def(
      "decode_layer(Tensor(a!) h, Tensor input_norm, Tensor post_norm, float eps, "
      "Tensor[] packed, Tensor[] scales_and_zeros, Tensor cos, Tensor sin, Tensor(b!) keys, "
      "Tensor(c!) values, int length, Tensor(d!) cache, int k_row, int v_row, int heads, "
      "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, m) { m.impl("decode_layer", decode_layer_op); }

}  // namespace prefixcache
